"""Scheduler unit tests: budget and caps, admission, preemption paths, stop rules, abort, output."""
from __future__ import annotations

import pytest
from sched_sim import FakeRunner, check_invariants, reference_generate, run_to_completion

from scheduler import (CachedRequestData, NewRequestData, Request, RequestStatus, SamplingParams, Scheduler,
                       SchedulerConfig, SchedulerOutput)

S = RequestStatus


def _cfg(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4, num_blocks=40)
    base.update(kw)
    return SchedulerConfig(**base)


def _req(rid: str, n: int, start: int = 100, *, max_tokens: int = 50, **kw) -> Request:
    sp_kw = {k: kw.pop(k) for k in ("min_tokens", "stop_token_ids", "ignore_eos") if k in kw}
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, **sp_kw), **kw)


def _step(s: Scheduler, tok: int | dict[str, int] = 1) -> tuple[SchedulerOutput, list[Request]]:
    """Schedule, then sample `tok` for every request whose known tokens are all computed."""
    out = s.schedule()
    check_invariants(s)
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = s.requests[rid]
        if r.num_computed_tokens == r.num_tokens:
            sampled[rid] = [tok[rid] if isinstance(tok, dict) else tok]
    fin = s.update_from_output(out, sampled)
    check_invariants(s)
    return out, fin


def test_output_types_and_first_step() -> None:
    s = Scheduler(_cfg())
    s.add_request(_req("a", 6))
    out = s.schedule()
    assert isinstance(out, SchedulerOutput) and isinstance(out.scheduled_cached_reqs, CachedRequestData)
    (nd,) = out.scheduled_new_reqs
    assert isinstance(nd, NewRequestData)
    assert (nd.req_id, nd.prompt_token_ids, nd.output_token_ids, nd.num_computed_tokens) == ("a", list(range(100, 106)), [], 0)
    assert nd.block_ids == s.kv_cache_manager.get_block_ids("a") and len(nd.block_ids) == 2
    assert out.num_scheduled_tokens == {"a": 6} and out.total_num_scheduled_tokens == 6
    assert out.finished_req_ids == set() and out.preempted_req_ids == set()
    assert s.requests["a"].num_computed_tokens == 6  # advanced when schedule() returns
    s.update_from_output(out, {"a": [7]})
    out2 = s.schedule()
    c = out2.scheduled_cached_reqs
    assert out2.scheduled_new_reqs == [] and (c.req_ids, c.new_block_ids, c.num_computed_tokens) == (["a"], [[]], [6])
    assert out2.num_scheduled_tokens == {"a": 1}


def test_unified_budget_running_first_and_chunking() -> None:
    s = Scheduler(_cfg(max_num_batched_tokens=10))
    s.add_request(_req("a", 25))
    s.add_request(_req("b", 3, 500))
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 10}  # a takes the whole budget
    assert s.requests["a"].output_token_ids == []  # partial prefill: nothing sampled
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 10}
    out, _ = _step(s)  # a's last 5 tokens, then b in the same step (no phases)
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}
    c = out.scheduled_cached_reqs
    assert c.req_ids == ["a"] and c.num_computed_tokens == [20] and len(c.new_block_ids[0]) == 2
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # decodes: exactly one token each


def test_long_prefill_threshold_and_max_num_seqs() -> None:
    s = Scheduler(_cfg(max_num_seqs=2, long_prefill_token_threshold=3))
    for i in range(3):
        s.add_request(_req(f"r{i}", 7, 100 * i))
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"r0": 3, "r1": 3} and len(s.running) == 2 and len(s.waiting) == 1
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"r0": 3, "r1": 3}
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1}


def test_no_chunked_prefill_head_of_line_blocking() -> None:
    s = Scheduler(_cfg(max_num_batched_tokens=32, enable_chunked_prefill=False))
    s.add_request(_req("a", 20))
    s.add_request(_req("b", 20, 300))  # does not fit the 12 tokens left
    s.add_request(_req("c", 2, 600))  # would fit, but admission stopped at b
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 20}
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 20, "c": 2}


def test_head_of_line_blocking_on_blocks() -> None:
    s = Scheduler(_cfg(max_num_batched_tokens=64, num_blocks=9))  # 8 usable blocks
    s.add_request(_req("a", 20))  # 5 blocks
    s.add_request(_req("b", 16, 300))  # 4 blocks: no room
    s.add_request(_req("c", 2, 600))  # 1 block would fit
    out, _ = _step(s)
    assert set(out.num_scheduled_tokens) == {"a"} and [r.request_id for r in s.waiting] == ["b", "c"]


def test_fcfs_preemption_victim_is_last_and_resumes_as_new_data() -> None:
    s = Scheduler(_cfg(max_num_batched_tokens=32, num_blocks=9, enable_prefix_caching=False))
    s.add_request(_req("a", 7))  # 2 blocks; its position 8 will need a third
    s.add_request(_req("b", 15, 300))  # 4 blocks
    s.add_request(_req("c", 6, 600))  # 2 blocks: all 8 in use
    _step(s, 5)
    _step(s, 6)
    out, _ = _step(s, 7)  # a needs a block: the victim is c (running[-1]), not b
    assert out.preempted_req_ids == {"c"} and set(out.num_scheduled_tokens) == {"a", "b"}
    (c,) = list(s.waiting)
    assert c.request_id == "c" and (c.status, c.num_computed_tokens, c.num_preemptions) == (S.PREEMPTED, 0, 1)
    assert c.output_token_ids == [5, 6] and s.make_stats().num_preemptions == 1
    assert [r.request_id for r in s.running] == ["a", "b"]
    s.finish_requests("a", S.FINISHED_ABORTED)
    out, _ = _step(s, 8)
    (nd,) = out.scheduled_new_reqs  # resumed: new data again, with its output tokens
    assert nd.req_id == "c" and nd.output_token_ids == [5, 6] and nd.num_computed_tokens == 0
    assert nd.prompt_token_ids == list(range(600, 606)) and out.num_scheduled_tokens["c"] == 8
    assert "c" not in out.scheduled_cached_reqs.req_ids and out.finished_req_ids == {"a"}
    assert c.status == S.RUNNING and c.output_token_ids == [5, 6, 8]


def test_no_admission_in_a_step_with_preemption() -> None:
    s = Scheduler(_cfg(max_num_batched_tokens=32, num_blocks=9, enable_prefix_caching=False))
    s.add_request(_req("a", 7))
    s.add_request(_req("b", 15, 300))
    s.add_request(_req("c", 6, 600))
    _step(s)
    _step(s)
    s.add_request(_req("d", 1, 900))  # would fit in the block c frees
    out, _ = _step(s)
    assert out.preempted_req_ids == {"c"} and out.scheduled_new_reqs == []
    assert [r.request_id for r in s.waiting] == ["c", "d"]


def test_priority_victim_is_largest_priority_value() -> None:
    s = Scheduler(_cfg(max_num_batched_tokens=32, num_blocks=9, enable_prefix_caching=False, policy="priority"))
    s.add_request(_req("a", 7, priority=0, arrival_time=0.0))
    s.add_request(_req("b", 15, 300, priority=2, arrival_time=1.0))
    _step(s)
    s.add_request(_req("c", 6, 600, priority=1, arrival_time=2.0))
    _step(s)
    assert [r.request_id for r in s.running] == ["a", "b", "c"]
    out, _ = _step(s)  # a needs a block: b (priority 2) goes, although c is running[-1]
    assert out.preempted_req_ids == {"b"} and set(out.num_scheduled_tokens) == {"a", "c"}
    assert [r.request_id for r in s.waiting] == ["b"]


def test_priority_ties_cannot_livelock() -> None:
    """Two requests with equal (priority, arrival_time) that cannot both fit: the victim is the one
    last in the waiting queue's total order (request_id breaks the tie), so the other keeps its
    blocks and finishes. Found by the property test: with a (priority, arrival_time) key the one
    running longer was always preempted, and the pair traded places forever."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=16, block_size=1,
                          num_blocks=17, long_prefill_token_threshold=3, enable_prefix_caching=False,
                          policy="priority")
    s = Scheduler(cfg)
    reqs = [_req(rid, n, start, max_tokens=16 - n, ignore_eos=True, priority=1, arrival_time=93.0)
            for rid, n, start in (("q2", 10, 100), ("q8", 9, 200))]
    everyone, steps = run_to_completion(s, FakeRunner(17, 1, 1000), {0: reqs[:1], 1: reqs[1:]},
                                        max_steps=200)
    assert all(r.status == S.FINISHED_LENGTH_CAPPED and r.num_tokens == 16 for r in everyone.values())
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 16
    assert s.make_stats().num_preemptions > 0  # the squeeze really happened


def test_priority_victim_already_scheduled_is_unscheduled_and_unhashed() -> None:
    """a (priority 1) runs ahead of b (priority 0) in `running`; when b cannot get a block, a
    was already scheduled in this step: its tokens go back to the budget and the block it
    filled in this step loses its hash (that KV was never written)."""
    s = Scheduler(_cfg(max_num_seqs=2, max_num_batched_tokens=8, long_prefill_token_threshold=6,
                       max_model_len=28, num_blocks=8, policy="priority"))
    s.add_request(_req("a", 22, priority=1, arrival_time=0.0))
    _step(s)  # a: 0..5
    s.add_request(_req("b", 4, 500, priority=0, arrival_time=1.0))
    out, _ = _step(s)  # a: 6..11, b: 0..1
    assert out.num_scheduled_tokens == {"a": 6, "b": 2}
    _step(s)  # a: 12..17, b: 2..3 (+ sampled token)
    kvm = s.kv_cache_manager
    a = s.requests["a"]
    a_blocks = list(kvm.req_to_blocks["a"])
    assert kvm.block_pool.get_num_free_blocks() == 1 and a.num_computed_tokens == 18
    out = s.schedule()  # a: 18..21 fills block 4 (hashed now) and takes the last free block
    assert out.preempted_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 1}
    assert out.total_num_scheduled_tokens == 1 and out.scheduled_cached_reqs.req_ids == ["b"]
    assert (a.status, a.num_computed_tokens, a.num_preemptions) == (S.PREEMPTED, 0, 1)
    check_invariants(s)
    assert [b.block_hash is not None for b in a_blocks[:5]] == [True, True, True, True, False]
    # a's freed blocks are in the free queue except the tail one b took; block 4 is unhittable
    assert a_blocks[4].ref_cnt == 0 and a_blocks[4] in kvm.block_pool.free_block_queue.get_all_free_blocks()
    probe = _req("probe", 22, priority=0)
    probe.set_block_hasher(s._block_hasher, 4)
    assert kvm.get_computed_blocks(probe, record_stats=False)[1] == 16


def test_priority_admission_order_and_waiting_iteration() -> None:
    s = Scheduler(_cfg(max_num_seqs=1, policy="priority"))
    s.add_request(_req("late_hi", 3, priority=0, arrival_time=5.0))
    s.add_request(_req("lo", 3, priority=2, arrival_time=0.0))
    s.add_request(_req("early_hi", 3, priority=0, arrival_time=1.0))
    assert [r.request_id for r in s.waiting] == ["early_hi", "late_hi", "lo"]
    out = s.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["early_hi"]


def test_stop_rules_in_contract_order() -> None:
    s = Scheduler(_cfg(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=12))
    s.add_request(_req("eos", 3, eos_token_id=9))
    s.add_request(_req("ignore", 3, 200, eos_token_id=9, ignore_eos=True, max_tokens=2))
    s.add_request(_req("stopid", 3, 300, eos_token_id=9, stop_token_ids=[7]))
    s.add_request(_req("min", 3, 400, eos_token_id=9, stop_token_ids=[7], min_tokens=2))
    s.add_request(_req("eos_at_max", 3, 500, eos_token_id=9, max_tokens=1))
    s.add_request(_req("len", 9, 600, max_tokens=50))  # max_model_len 12 -> 3 outputs
    _, fin = _step(s, {"eos": 9, "ignore": 9, "stopid": 7, "min": 7, "eos_at_max": 9, "len": 1})
    got = {r.request_id: (r.status, r.stop_reason) for r in fin}
    assert got == {"eos": (S.FINISHED_STOPPED, None), "stopid": (S.FINISHED_STOPPED, 7),
                   "eos_at_max": (S.FINISHED_STOPPED, None)}
    _, fin = _step(s, {"ignore": 9, "min": 9, "len": 1})  # min: 2nd token may stop (EOS)
    assert {r.request_id: r.status for r in fin} == {"ignore": S.FINISHED_LENGTH_CAPPED, "min": S.FINISHED_STOPPED}
    assert s.requests["len"].num_tokens == 11
    out, fin = _step(s, {"len": 1})
    assert [(r.request_id, r.status, r.num_tokens) for r in fin] == [("len", S.FINISHED_LENGTH_CAPPED, 12)]
    assert out.finished_req_ids == {"ignore", "min"}  # finished last step, reported now
    assert s.schedule().finished_req_ids == {"len"} and not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 39


def test_min_tokens_holds_back_stop_token() -> None:
    s = Scheduler(_cfg())
    s.add_request(_req("m", 3, stop_token_ids=[7], min_tokens=3, eos_token_id=9))
    for tok in (7, 9):
        _, fin = _step(s, tok)
        assert fin == []
    _, (r,) = _step(s, 7)
    assert (r.status, r.stop_reason, r.output_token_ids) == (S.FINISHED_STOPPED, 7, [7, 9, 7])


def test_finish_requests_waiting_running_unknown() -> None:
    s = Scheduler(_cfg(max_num_seqs=1))
    s.add_request(_req("run", 5))
    s.add_request(_req("wait", 5, 300))
    _step(s)
    s.finish_requests(["wait", "nope"], S.FINISHED_ABORTED)
    s.finish_requests("nope", S.FINISHED_ABORTED)
    assert len(s.waiting) == 0 and [r.request_id for r in s.running] == ["run"]
    run = s.requests["run"]
    s.finish_requests("run", S.FINISHED_ABORTED)
    assert run.status == S.FINISHED_ABORTED and run.get_finished_reason() == "abort"
    assert not s.running and s.kv_cache_manager.block_pool.get_num_free_blocks() == 39
    out = s.schedule()
    assert out.finished_req_ids == {"wait", "run"} and out.total_num_scheduled_tokens == 0
    with pytest.raises(ValueError, match="finished_status"):
        s.finish_requests("x", S.RUNNING)


def test_sampled_tokens_for_partial_prefill_and_unknown_ids_are_ignored() -> None:
    s = Scheduler(_cfg(max_num_batched_tokens=4))
    s.add_request(_req("a", 10))
    out = s.schedule()
    assert s.update_from_output(out, {"a": [1], "ghost": [2]}) == []
    assert s.requests["a"].output_token_ids == []


def test_prefix_hits_reported_in_new_data_and_stats() -> None:
    s = Scheduler(_cfg(max_num_batched_tokens=64))
    s.add_request(_req("a", 10))
    _step(s)
    s.add_request(_req("b", 10))  # same prompt: 2 full blocks hit (the cap keeps the last token)
    out, _ = _step(s)
    (nd,) = out.scheduled_new_reqs
    assert nd.num_computed_tokens == 8 and out.num_scheduled_tokens["b"] == 2
    assert nd.block_ids[:2] == s.kv_cache_manager.get_block_ids("a")[:2]
    st = s.make_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.num_running_reqs, st.num_waiting_reqs) == (20, 8, 2, 0)
    assert st.kv_cache_usage == pytest.approx(s.kv_cache_manager.usage) and st.kv_cache_usage > 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [True, False])
def test_tight_memory_workload_matches_requests_run_alone(policy: str, caching: bool) -> None:
    vocab, eos = 31, 0
    cfg = _cfg(max_num_seqs=3, max_num_batched_tokens=6, max_model_len=24, num_blocks=8,
               enable_prefix_caching=caching, policy=policy)
    arrivals = {k: [Request(f"r{k}{j}", [1 + (k + j + i) % 5 for i in range(9 + 2 * j)],
                            SamplingParams(max_tokens=10, stop_token_ids=(3,)), eos_token_id=eos,
                            priority=(k * 7 + j) % 3, arrival_time=float(k))
                    for j in range(3)] for k in range(3)}
    s = Scheduler(cfg)
    everyone, _ = run_to_completion(s, FakeRunner(cfg.num_blocks, cfg.block_size, vocab), arrivals)
    assert s.make_stats().num_preemptions > 0
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == cfg.num_blocks - 1
    for r in everyone.values():
        ref = reference_generate(r.prompt_token_ids, r.sampling_params, eos, cfg.max_model_len, vocab)
        assert (r.output_token_ids, r.status, r.stop_reason) == ref


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_schedule_before_update(async_scheduling: bool) -> None:
    """Calling schedule() again before update_from_output: the sync scheduler has nothing new to
    compute for a decoding request; the async one schedules it on its placeholder, stops at the
    length limit its placeholders reach, and takes each token in order, one update late."""
    s = Scheduler(_cfg(async_scheduling=async_scheduling))
    s.add_request(_req("a", 6, max_tokens=3))
    outs = [s.schedule()]                    # the prompt; "a" will sample output token 1
    outs.append(s.schedule())                # before the update
    a = s.requests["a"]
    if not async_scheduling:
        assert outs[1].total_num_scheduled_tokens == 0 and a.num_output_placeholders == 1
        s.update_from_output(outs[0], {"a": [7]})
        assert a.output_token_ids == [7] and a.num_output_placeholders == 0
        return
    assert outs[1].num_scheduled_tokens == {"a": 1}           # position 6: output token 1's slot
    assert a.num_computed_tokens == 7 and a.num_output_placeholders == 2
    s.update_from_output(outs[0], {"a": [7]})
    outs.append(s.schedule())                                 # token 3 is the last: nothing after
    assert outs[2].num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    assert s.schedule().total_num_scheduled_tokens == 0       # 1 known + 2 pending = max_tokens
    s.update_from_output(outs[1], {"a": [8]})
    assert s.update_from_output(outs[2], {"a": [9]}) == [a]
    assert a.output_token_ids == [7, 8, 9] and a.status is S.FINISHED_LENGTH_CAPPED
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 39

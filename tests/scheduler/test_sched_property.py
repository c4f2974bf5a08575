"""Property-based tests: random operation sequences on the free queue against a list model, and
random workloads through the Scheduler against the requests run alone (see sched_sim)."""
from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_sim import FakeRunner, check_invariants, reference_generate, run_to_completion

from scheduler import FreeKVCacheBlockQueue, KVCacheBlock, Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig

# ------------------------------------------------------------------ free queue vs a list

_ops = st.lists(st.tuples(st.sampled_from(["popleft", "popleft_n", "remove", "append", "append_n"]),
                          st.integers(0, 10 ** 6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 12), ops=_ops)
def test_free_queue_matches_list_model(n: int, ops: list[tuple[str, int]]) -> None:
    blocks = [KVCacheBlock(i) for i in range(n)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(blocks)
    out: list[KVCacheBlock] = []  # blocks not in the queue
    for op, r in ops:
        if op == "popleft":
            if not model:
                try:
                    q.popleft()
                except ValueError:
                    continue
                raise AssertionError("popleft on an empty queue must raise ValueError")
            b = q.popleft()
            assert b is model.pop(0)
            out.append(b)
        elif op == "popleft_n":
            k = r % (len(model) + 1)
            got = q.popleft_n(k)
            assert got == model[:k]
            del model[:k]
            out.extend(got)
        elif op == "remove" and model:
            b = model.pop(r % len(model))
            q.remove(b)
            out.append(b)
        elif op == "append" and out:
            b = out.pop(r % len(out))
            q.append(b)
            model.append(b)
        elif op == "append_n" and out:
            k = r % (len(out) + 1)
            chunk, out[:] = out[:k], out[k:]
            q.append_n(chunk)
            model.extend(chunk)
        assert q.num_free_blocks == len(model)
        assert q.get_all_free_blocks() == model
        for b in out:
            assert b.prev_free_block is None and b.next_free_block is None


# ------------------------------------------------------------------ scheduler workloads

VOCAB = 23  # small, so EOS and stop tokens do occur
EOS = 0


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(12, 48))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    lo = max_model_len if not chunked else max_num_seqs
    budget = draw(st.integers(lo, lo + 40))
    min_blocks = -(-max_model_len // block_size) + 1
    tight = draw(st.booleans())
    num_blocks = min_blocks + (draw(st.integers(0, 3)) if tight else draw(st.integers(0, 60)))
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
        block_size=block_size, num_blocks=num_blocks, enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])) if chunked else 0,
        enable_prefix_caching=draw(st.booleans()), policy=draw(st.sampled_from(["fcfs", "priority"])))
    rng = random.Random(draw(st.integers(0, 2 ** 32)))
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, max_model_len - 2))] for _ in range(3)]
    num_reqs = draw(st.integers(1, 9))
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    for i in range(num_reqs):
        if i and rng.random() < 0.25:  # an exact repeat: a fully cached prompt
            prompt = list(rng.choice([r for rs in arrivals.values() for r in rs]).prompt_token_ids)
        else:
            prompt = list(rng.choice(prefixes)) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
            prompt = prompt[:max_model_len - 1]
        max_tokens = rng.randrange(1, 20)
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=rng.randrange(0, max_tokens + 1),
                            stop_token_ids=rng.choice([(), (5,), (3, 7)]), ignore_eos=rng.random() < 0.2)
        req = Request(f"q{i}", prompt, sp, eos_token_id=EOS, priority=rng.randrange(3),
                      arrival_time=float(rng.randrange(100)), cache_salt=rng.choice([None, None, "s"]))
        arrivals.setdefault(rng.randrange(6), []).append(req)
        if rng.random() < 0.15:
            aborts.setdefault(rng.randrange(12), []).append(req.request_id)
    return cfg, arrivals, aborts


def _check_workload(cfg: SchedulerConfig, arrivals, aborts, async_scheduling: bool = False) -> Scheduler:
    sched = Scheduler(dataclasses.replace(cfg, async_scheduling=async_scheduling))
    runner = FakeRunner(cfg.num_blocks, cfg.block_size, VOCAB)
    everyone, _ = run_to_completion(sched, runner, arrivals, aborts)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == cfg.num_blocks - 1, "blocks leaked"
    assert not sched.running and not len(sched.waiting) and not sched.has_unfinished_requests()
    for rid, req in everyone.items():
        assert req.is_finished()
        ref, status, reason = reference_generate(req.prompt_token_ids, req.sampling_params, EOS,
                                                 cfg.max_model_len, VOCAB)
        if req.status == RequestStatus.FINISHED_ABORTED:
            assert req.output_token_ids == ref[:len(req.output_token_ids)]
        else:
            assert (req.output_token_ids, req.status, req.stop_reason) == (ref, status, reason), rid
    check_invariants(sched)
    return sched


@settings(max_examples=300, deadline=None)
@given(workloads(), st.booleans())
def test_random_workloads_match_requests_run_alone(w, async_scheduling: bool) -> None:
    """Sync, and async scheduling (each update one step late): same tokens as run alone."""
    _check_workload(*w, async_scheduling=async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stress_workloads_exercise_preemption_and_chunking(async_scheduling: bool) -> None:
    """Fixed seeds in tight settings; asserts that the hard paths were really taken."""
    totals = {"preempt": 0, "hits": 0}
    for seed in range(40):
        rng = random.Random(seed)
        policy = ["fcfs", "priority"][seed % 2]
        cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=40, block_size=4,
                              num_blocks=12, long_prefill_token_threshold=5 if seed % 3 else 0,
                              enable_prefix_caching=seed % 4 != 3, policy=policy)
        shared = [rng.randrange(1, VOCAB) for _ in range(13)]
        arrivals: dict[int, list[Request]] = {}
        for i in range(8):
            prompt = shared + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
            sp = SamplingParams(max_tokens=rng.randrange(8, 20), ignore_eos=True)
            arrivals.setdefault(rng.randrange(4), []).append(
                Request(f"s{i}", prompt, sp, eos_token_id=EOS, priority=rng.randrange(3), arrival_time=float(i)))
        sched = _check_workload(cfg, arrivals, {}, async_scheduling)
        stats = sched.make_stats()
        totals["preempt"] += stats.num_preemptions
        totals["hits"] += stats.prefix_cache_hits
    assert totals["preempt"] > 0 and totals["hits"] > 0

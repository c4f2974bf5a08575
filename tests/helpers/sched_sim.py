"""Brute-force helpers for the scheduler tests: a stand-in model that really goes through the
paged "KV cache", an independent reference for the stop rules, and invariant checks.

The stand-in runner keeps per-request state from the SchedulerOutput diffs exactly as a real
runner would, writes each scheduled token (with its position) into the slot
`block_id * block_size + offset` of a flat cache, and computes the next token from what it reads
back through the block table. A block-table, prefix-hit or eviction bug therefore changes the
generated tokens, which are compared with `reference_generate` (the request run alone).

Async scheduling (a Scheduler whose config has `async_scheduling=True`): the update for step
N comes after step N+1 was scheduled and run, as in an engine that keeps one step in flight; the
stand-in runner knows its own sampled tokens at once (a device forwarding them), so a decode
scheduled on a placeholder reads the real token.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from scheduler import (Request, RequestStatus, SamplingParams, Scheduler, SchedulerOutput)


def next_token(history: list, vocab: int) -> int:
    """Deterministic function of the whole history (independent of Python's hash seed)."""
    return int.from_bytes(hashlib.blake2b(repr(history).encode(), digest_size=8).digest(), "little") % vocab


def reference_generate(prompt: list[int], sp: SamplingParams, eos: int | None, max_model_len: int,
                       vocab: int) -> tuple[list[int], RequestStatus, int | None]:
    """The request alone: generate until the stop rules fire (written independently here)."""
    out: list[int] = []
    while True:
        t = next_token([(p, x) for p, x in enumerate(prompt + out)], vocab)
        out.append(t)
        if len(out) >= sp.min_tokens:
            if not sp.ignore_eos and eos is not None and t == eos:
                return out, RequestStatus.FINISHED_STOPPED, None
            if t in sp.stop_token_ids:
                return out, RequestStatus.FINISHED_STOPPED, t
        if len(out) >= sp.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, RequestStatus.FINISHED_LENGTH_CAPPED, None


@dataclass
class _ReqState:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


@dataclass
class FakeRunner:
    num_blocks: int
    block_size: int
    vocab: int
    kv: list = field(default_factory=list)
    state: dict[str, _ReqState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv = [None] * (self.num_blocks * self.block_size)

    def _slot(self, st: _ReqState, pos: int) -> int:
        return st.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.state.pop(rid, None)
        for nd in out.scheduled_new_reqs:
            assert nd.req_id not in self.state
            self.state[nd.req_id] = _ReqState(list(nd.prompt_token_ids) + list(nd.output_token_ids),
                                              list(nd.block_ids), nd.num_computed_tokens)
        c = out.scheduled_cached_reqs
        assert len(c.req_ids) == len(c.new_block_ids) == len(c.num_computed_tokens)
        for rid, new_ids, nc in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.state[rid]
            assert st.num_computed == nc, (rid, st.num_computed, nc)
            st.block_ids.extend(new_ids)
        assert set(out.num_scheduled_tokens) == {d.req_id for d in out.scheduled_new_reqs} | set(c.req_ids)
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        # every layer writes its KV before attention reads: write all, then read all
        for rid, n in out.num_scheduled_tokens.items():
            st = self.state[rid]
            assert n >= 1 and st.num_computed + n <= len(st.tokens)
            assert 0 not in st.block_ids, "null block handed out"
            for pos in range(st.num_computed, st.num_computed + n):
                self.kv[self._slot(st, pos)] = (pos, st.tokens[pos])
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            st = self.state[rid]
            st.num_computed += n
            if st.num_computed == len(st.tokens):
                history = [self.kv[self._slot(st, p)] for p in range(st.num_computed)]
                tok = next_token(history, self.vocab)
                st.tokens.append(tok)
                sampled[rid] = [tok]
        return sampled


def check_invariants(sched: Scheduler, drafts: dict[str, list[int]] | None = None) -> None:
    """Pool/queue/ref-count/hash-map consistency and the per-step caps; `drafts`: the step just
    scheduled verifies these (its requests' computed tokens run past their known ones)."""
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    cfg = sched.config
    holders: dict[int, int] = {}
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        for b in kvm.req_to_blocks.get(req.request_id, []):
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert req.num_tokens <= cfg.max_model_len
        assert 0 <= req.num_output_placeholders <= 2
        ahead = req.num_output_placeholders + len((drafts or {}).get(req.request_id, ()))
        assert req.num_computed_tokens <= min(req.num_tokens + ahead, cfg.max_model_len - 1)
        assert len(kvm.req_to_blocks.get(req.request_id, [])) * cfg.block_size >= req.num_computed_tokens
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.request_id not in kvm.req_to_blocks and req.num_computed_tokens == 0
    assert set(kvm.req_to_blocks) == {r.request_id for r in sched.running}
    assert len(sched.running) <= cfg.max_num_seqs
    assert pool.null_block.block_id == 0 and 0 not in holders
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.free_block_queue.num_free_blocks
    assert len({b.block_id for b in free}) == len(free)
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders.get(b.block_id, 0), (b, holders.get(b.block_id, 0))
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    mapped = {(h, bid) for h, d in pool.cached_block_hash_to_block.items() for bid in d}
    hashed = {(b.block_hash, b.block_id) for b in pool.blocks if b.block_hash is not None}
    assert mapped == hashed
    if not cfg.enable_prefix_caching:
        assert not hashed


def run_to_completion(sched: Scheduler, runner: FakeRunner, arrivals: dict[int, list[Request]],
                      aborts: dict[int, list[str]] | None = None, max_steps: int = 5000
                      ) -> tuple[dict[str, Request], int]:
    """Drive the scheduler, adding requests at their arrival steps; check invariants every step.
    With the scheduler's `async_scheduling`, each step's update comes after the next step ran.
    Returns all requests by id and the number of steps."""
    async_scheduling = sched.config.async_scheduling
    aborts = aborts or {}
    cfg = sched.config
    everyone: dict[str, Request] = {}
    last = max(list(arrivals) + list(aborts) + [0])
    step = 0
    in_flight: tuple[SchedulerOutput, dict[str, list[int]]] | None = None
    while step <= last or sched.has_unfinished_requests() or in_flight:
        assert step < max_steps, "no progress"
        for req in arrivals.get(step, []):
            sched.add_request(req)
            everyone[req.request_id] = req
        if aborts.get(step):
            sched.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
        ahead = async_scheduling  # the scheduler counts tokens in flight
        gaps = {r.request_id: r.num_tokens + ahead * r.num_output_placeholders - r.num_computed_tokens
                for r in sched.running}
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        for rid, n in out.num_scheduled_tokens.items():
            if rid in gaps:  # served from running: never more than its gap; decodes get exactly 1
                assert n <= gaps[rid] and (gaps[rid] != 1 or n == 1)
            if cfg.long_prefill_token_threshold:
                assert n <= cfg.long_prefill_token_threshold
        check_invariants(sched)
        if async_scheduling:
            ran, in_flight = in_flight, (out, runner.execute(out))
            if not out.total_num_scheduled_tokens:
                in_flight = None  # nothing ran (an engine dispatches nothing)
        else:
            ran = (out, runner.execute(out))
        if ran is not None:
            for r in sched.update_from_output(*ran):
                assert r.is_finished()
        if not async_scheduling:  # every sampled token was delivered
            assert all(r.num_output_placeholders == 0 for r in sched.requests.values())
        check_invariants(sched)
        step += 1
    return everyone, step

"""The scheduler's side of speculative decoding against brute force: `sched_sim`'s stand-in
model reads every token back through the paged KV cache, and here it also verifies drafts (a
draft is accepted while it equals the model's own next token, as greedy verification does). A
draft the scheduler forgot to roll back, a rejected draft's KV read again, a block hashed over a
rejected token or a stop rule skipped inside an accepted run changes the generated tokens, which
must equal each request run alone (`reference_generate`)."""
from __future__ import annotations

import random

import pytest

from scheduler import Request, SamplingParams, Scheduler
from scheduler.config import SchedulerConfig
from sched_sim import FakeRunner, _ReqState, check_invariants, next_token, reference_generate

VOCAB = 50


class VerifyingRunner(FakeRunner):
    """FakeRunner that also runs a step's drafts: every scheduled token's KV is written (drafts
    included), then each request that reaches its end gets its next token, and one with drafts
    its accepted drafts and one more token; its computed count rolls back like the scheduler's."""

    def execute(self, out):  # type: ignore[override]
        drafts = out.scheduled_spec_decode_tokens
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.state.pop(rid, None)
        for nd in out.scheduled_new_reqs:
            self.state[nd.req_id] = _ReqState(list(nd.prompt_token_ids) + list(nd.output_token_ids),
                                              list(nd.block_ids), nd.num_computed_tokens)
        c = out.scheduled_cached_reqs
        for rid, new_ids, nc in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.state[rid]
            assert st.num_computed == nc, (rid, st.num_computed, nc)
            st.block_ids.extend(new_ids)
        for rid, n in out.num_scheduled_tokens.items():
            st = self.state[rid]
            seq = st.tokens + list(drafts.get(rid, ()))
            assert st.num_computed + n <= len(seq) and 0 not in st.block_ids
            for pos in range(st.num_computed, st.num_computed + n):
                self.kv[self._slot(st, pos)] = (pos, seq[pos])
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            st = self.state[rid]
            d = drafts.get(rid, [])
            st.num_computed += n
            if st.num_computed < len(st.tokens) + len(d):
                continue  # a partial prefill
            emitted = []
            for i in range(len(d) + 1):  # greedy verification over what the cache holds
                history = [self.kv[self._slot(st, p)] for p in range(len(st.tokens) + i)]
                emitted.append(next_token(history, self.vocab))
                if i == len(d) or d[i] != emitted[-1]:
                    break
            st.tokens.extend(emitted)
            st.num_computed = len(st.tokens) - 1
            sampled[rid] = emitted
        return sampled


def _drafts(req: Request, rng: random.Random, k: int, max_model_len: int) -> list[int]:
    """Up to k drafts: a random-length prefix of the true continuation, then random tokens."""
    sp = req.sampling_params
    m = min(k, sp.max_tokens - len(req.output_token_ids) - 1, max_model_len - req.num_tokens - 1)
    if m <= 0 or rng.random() < 0.3:
        return []
    history = [(p, x) for p, x in enumerate(req.all_token_ids)]
    out = []
    good = rng.randint(0, m)
    for i in range(m):
        tok = next_token(history, VOCAB) if i < good else rng.randrange(VOCAB)
        out.append(tok)
        history.append((len(history), tok))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_drafts_roll_back_and_outputs_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64, block_size=4,
                          num_blocks=40 if seed % 2 else 120, enable_prefix_caching=True,
                          policy="priority" if seed == 5 else "fcfs")
    sched = Scheduler(cfg)
    runner = VerifyingRunner(cfg.num_blocks, cfg.block_size, VOCAB)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    reqs = []
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        sp = SamplingParams(max_tokens=rng.randint(1, 30), stop_token_ids=[7] if i % 4 == 0 else [],
                            min_tokens=3 if i % 5 == 0 else 0)
        reqs.append(Request(f"r{i}", prompt, sp, eos_token_id=3 if i % 2 else None, priority=i % 3))
    pending = list(reqs)
    drafted = accepted = 0
    for step in range(2000):
        if not pending and not sched.has_unfinished_requests():
            break
        if pending and step % 2 == 0:
            sched.add_request(pending.pop(0))
        proposed = {}
        for req in sched.running:
            if req.num_computed_tokens == req.num_tokens - 1:
                req.spec_token_ids = proposed[req.request_id] = _drafts(req, rng, 4, cfg.max_model_len)
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert all(not r.spec_token_ids for r in sched.requests.values())  # consumed
        for rid, d in out.scheduled_spec_decode_tokens.items():
            assert d and d == proposed[rid][:len(d)]
            assert out.num_scheduled_tokens[rid] == 1 + len(d)
        check_invariants(sched, out.scheduled_spec_decode_tokens)
        sampled = runner.execute(out)
        for r in sched.update_from_output(out, sampled):
            assert r.is_finished()
        for req in sched.running:  # every request is at its known tokens again
            assert req.num_computed_tokens <= req.num_tokens
            assert len(req.block_hashes) == req.num_tokens // cfg.block_size
        check_invariants(sched)
        drafted, accepted = sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens
    else:
        pytest.fail("no progress")
    assert drafted > 20 and 0 < accepted < drafted
    stats = sched.make_stats()
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (drafted, accepted)
    for req in reqs:
        want, status, reason = reference_generate(req.prompt_token_ids, req.sampling_params,
                                                  req.eos_token_id, cfg.max_model_len, VOCAB)
        assert req.output_token_ids == want, req.request_id
        assert (req.status, req.stop_reason) == (status, reason)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == cfg.num_blocks - 1


def test_draft_limit_caps_and_turn_off() -> None:
    """draft_limit: only a decode with no token in flight; at most k; never past max_tokens or
    max_model_len, nor across min_tokens' boundary; none with a grammar; none once 16 drafted
    tokens are accepted below 25 %."""
    from scheduler import StructuredOutputsParams
    from scheduler.spec_decode import draft_limit

    def decoding(n_out: int, **sp: object) -> Request:
        req = Request("r", [5, 6, 7], SamplingParams(**sp))
        for t in range(n_out):
            req.append_output_token_ids(t)
        req.num_computed_tokens = req.num_tokens - 1
        return req

    assert draft_limit(decoding(2, max_tokens=100), 7, 64) == 7
    assert draft_limit(decoding(2, max_tokens=6), 7, 64) == 3  # tokens 3..6: 3 drafts + 1
    assert draft_limit(decoding(2, max_tokens=100), 7, 10) == 4  # length 5 + 4 drafts + 1 = 10
    assert draft_limit(decoding(2, max_tokens=100, min_tokens=5), 7, 64) == 2  # up to token 5
    assert draft_limit(decoding(5, max_tokens=100, min_tokens=5), 7, 64) == 7
    assert draft_limit(decoding(2, max_tokens=3), 7, 64) == 0
    assert draft_limit(decoding(2, structured_outputs=StructuredOutputsParams(regex="a+")), 7, 64) == 0
    prefill = decoding(2)
    prefill.num_computed_tokens -= 1
    assert draft_limit(prefill, 7, 64) == 0
    in_flight = decoding(2)
    in_flight.num_output_placeholders = 1
    assert draft_limit(in_flight, 7, 64) == 0
    poor = decoding(2, max_tokens=100)
    poor.num_draft_tokens, poor.num_accepted_tokens = 16, 3
    assert draft_limit(poor, 7, 64) == 0
    poor.num_accepted_tokens = 4
    assert draft_limit(poor, 7, 64) == 7
    poor.num_draft_tokens, poor.num_accepted_tokens = 15, 0  # too few drafted to judge
    assert draft_limit(poor, 7, 64) == 7

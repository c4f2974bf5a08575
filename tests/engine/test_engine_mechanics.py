"""The engine's scheduling mechanics on a tiny random Llama (2 layers, word-level tokenizer), where
the model is not the point and compiling is cheap: preemption and compile counts, precompile,
priorities, random arrivals and aborts, a long prompt's prefill and decode.

Truth: transformers' greedy generation on the same checkpoint (float32), and brute-force counts of
buckets and blocks. The prompts (engine_helpers.TINY_PROMPTS) have the token lengths of
test_llm.py's SmolLM2 prompts, and two of them share a 27-token prefix, so the pools and buckets
behave alike.

Compiling is most of this module's time, so its engines take one of three shapes, each compiled
once: PREEMPT (a 10-block pool), which test_preemption_and_compile_count meets first,
test_precompile_covers_every_step's PRECOMPILED, which it compiles whole, and LONG_ENGINE (1024-row
steps), which test_compiled_steps_load_from_disk meets first. Each has a cache shape
(num_kv_blocks) of its own, which no other test module uses, so those three tests find their
programs compiled nowhere (not in this process, not in the session's compile cache on disk).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from engine_helpers import (BASE, GREEDY, MAX_TOKENS, TINY_PROMPTS, hf_greedy_ids, step_compiles,
                            token_ids)
from minivllm_jax import LLM, SamplingParams
from minivllm_jax.buckets import bucket
from minivllm_jax.backends import ATTENTION_BACKENDS

# BASE with a pool of 10 blocks, 9 usable: 3-4 per request (prompts of up to 33 tokens + 16), so
# 7 requests force preemptions
PREEMPT = {**BASE, "num_kv_blocks": 10}
# 16-token steps and a 33-block pool: compiled whole by test_precompile_covers_every_step, then
# the engine shape of the tests that need neither a small pool nor BASE's 64-token steps
PRECOMPILED = {**BASE, "max_num_batched_tokens": 16, "num_kv_blocks": 33}
# one 1024-row step: a 640-token prompt's prefill at once (a cache shape of its own too)
LONG_ENGINE = dict(max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=1024, num_kv_blocks=160)


def test_preemption_and_compile_count(tiny_model: Any, backend: str,
                                      tiny_greedy: list[list[int]]) -> None:
    """PREEMPT's 10-block pool forces preemptions, with async_scheduling off and on: with it,
    requests are preempted while a token of theirs is in flight, and decodes read their input ids
    from the step before; the tokens must be transformers' own either way. PREEMPT's cache shape
    is new to the process, so XLA compiles the forward exactly once per (token bucket, attention
    kind) met: the first engine every one it meets, the second (same shape) only those the first
    did not (the samplers, which do not read the cache, at most once per sample bucket and
    sampling kind), and those stay few over ~100 varied steps."""
    met: set[Any] = set()  # the forward programs compiled so far
    for async_scheduling in (False, True):
        with step_compiles() as compiles:
            engine = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling,
                         **PREEMPT)
            outs = engine.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)
        assert token_ids(outs) == tiny_greedy, async_scheduling
        stats = engine.get_stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_free_kv_blocks"] == PREEMPT["num_kv_blocks"] - 1
        shapes = engine.engine.runner.shapes_used
        programs = {s.forward for s in shapes} | {s.sampler for s in shapes}
        assert engine.engine.runner.programs.compiled_shapes == programs
        token_buckets = {s.num_tokens for s in shapes}
        forwards = {s.forward for s in shapes}
        assert compiles.count("forward") == len(forwards - met), async_scheduling
        assert compiles.count("sample_tokens") <= len({s.sampler for s in shapes})
        assert {s.sampling for s in shapes} == {"greedy"}  # GREEDY: every row greedy
        met |= forwards
        min_tokens, min_sampled = ATTENTION_BACKENDS[backend].min_buckets
        assert token_buckets <= {b for b in (4, 8, 16, 32, 64) if b >= min_tokens}
        assert {s.num_sampled for s in shapes} <= {b for b in (4, 8) if b >= min_sampled}
    assert len(met) > 1


def test_precompile_covers_every_step(tiny_model: Any, backend: str,
                                      tiny_greedy: list[list[int]]) -> None:
    """precompile() covers exactly the programs that a brute-force walk over every step
    composition reaches: a forward per (token bucket, attention kind the backend's rule gives
    some composition of that many rows) and a sampler per (sample bucket, sampling kind,
    structured or not). It
    leaves the KV cache as it was; afterwards a chunked, batched run compiles nothing and its
    tokens are transformers' own."""
    from minivllm_jax.sampling.sampler import SAMPLING_KINDS
    from minivllm_jax.step_layout import step_kind

    engine = LLM(tiny_model, attention_backend=backend, **PRECOMPILED)  # a fresh cache shape
    runner = engine.engine.runner
    min_tokens, min_sampled = ATTENTION_BACKENDS[backend].min_buckets
    budget, seqs = PRECOMPILED["max_num_batched_tokens"], PRECOMPILED["max_num_seqs"]
    reachable = {(bucket(t, min_tokens, budget), bucket(s, min_sampled, seqs))
                 for t in range(1, budget + 1) for s in range(0, min(t, seqs) + 1)}
    assert {(s.num_tokens, s.num_sampled) for s in runner.spec.step_shapes()} == reachable
    forwards = {(bucket(sum(q), min_tokens, budget), step_kind(backend, np.array(q),
                                                               bucket(sum(q), min_tokens, budget)))
                for q in _compositions(budget, seqs)}
    # the tiny model has a tokenizer: structured steps' samplers are precompiled too
    samplers = {(s, kind, structured) for _, s in reachable for kind in SAMPLING_KINDS
                for structured in (False, True)}
    cache = np.asarray(runner.kv_cache).copy()
    with step_compiles() as compiles:
        assert engine.precompile() == 2 * len(runner.spec.step_shapes())
    assert np.array_equal(np.asarray(runner.kv_cache), cache)  # empty steps write no slot
    # a fresh cache shape: every forward compiles; samplers may come from an earlier engine
    assert compiles.count("forward") == len(forwards)
    assert compiles.count("sample_tokens") <= len(samplers)
    assert {(k.num_tokens, k.num_sampled, k.kind if k.num_tokens else k.sampling, k.structured)
            for k in runner.programs.compiled_shapes} == (
        {(t, 0, kind, False) for t, kind in forwards}
        | {(0, s, kind, structured) for s, kind, structured in samplers})
    with step_compiles() as compiles:
        assert token_ids(engine.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)) == tiny_greedy
    assert compiles == []  # nothing compiled while serving
    assert {k for s in runner.shapes_used for k in (s.forward, s.sampler)} <= runner.programs.compiled_shapes
    # not vacuous: the run meets three sampling shapes, or all there are (the Pallas backend's
    # 16-row minimum leaves one at this budget)
    used = {(s.num_tokens, s.num_sampled) for s in runner.shapes_used}
    assert len(used) >= min(3, len({(t, s) for t, s in reachable if s > 0}))


def _compositions(budget: int, seqs: int, most: int | None = None) -> list[tuple[int, ...]]:
    """Every multiset of 1..seqs query runs of at least one row, at most `budget` rows in all
    (runs in non-increasing order, none over `most`)."""
    most = budget if most is None else most
    out = []
    for first in range(1, min(budget, most) + 1):
        out.append((first,))
        if seqs > 1:
            out += [(first, *rest) for rest in _compositions(budget - first, seqs - 1, first)]
    return out


def test_priority_policy_admits_lower_values_first(tiny_model: Any, backend: str,
                                                   tiny_greedy: list[list[int]]) -> None:
    """scheduling_policy="priority" with one priority per prompt: the scheduler first schedules
    requests in (priority, arrival) order (the brute-force truth: the priorities sorted), not in
    the order they were added, and FCFS (priority 0 everywhere) keeps that order. The 10-block
    pool (PREEMPT) forces preemptions, and greedy tokens stay transformers'; no block leaks."""
    priorities = [3, 6, 0, 5, 1, 4, 2]
    for policy in ("priority", "fcfs"):
        llm = LLM(tiny_model, attention_backend=backend, scheduling_policy=policy, **PREEMPT)
        engine = llm.engine
        first: list[str] = []  # request ids, first scheduled first

        def schedule(inner: Any = engine.scheduler.schedule) -> Any:
            so = inner()
            first.extend(r.req_id for r in so.scheduled_new_reqs if r.req_id not in first)
            return so
        engine.scheduler.schedule = schedule
        given = priorities if policy == "priority" else None
        outs = llm.generate(TINY_PROMPTS, GREEDY, use_tqdm=False, priority=given)
        assert token_ids(outs) == tiny_greedy
        index = {o.request_id: i for i, o in enumerate(outs)}
        order = [index[r] for r in first]
        key = (lambda i: (priorities[i], i)) if policy == "priority" else (lambda i: i)
        assert order == sorted(order, key=key) and len(order) > 1
        assert len(first) == len(TINY_PROMPTS)
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_free_kv_blocks"] == 10 - 1


@pytest.fixture(scope="module")
def long_case(tiny_hf: Any) -> tuple[list[list[int]], list[list[int]]]:
    """A 640-token prompt beside a short one, and transformers' 8 greedy tokens of each."""
    from pallas_kernels.xla_attention import LONG_RUN

    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=640).tolist(), TINY_PROMPTS[0]]
    assert LONG_RUN <= len(prompts[0]) and len(prompts[0]) + len(prompts[1]) <= 1024
    return prompts, [hf_greedy_ids(tiny_hf, ids, 8) for ids in prompts]


def test_compiled_steps_load_from_disk(tiny_model: Any, backend: str, tmp_path: Any,
                                       long_case: tuple[list[list[int]], list[list[int]]],
                                       caplog: pytest.LogCaptureFixture) -> None:
    """An engine with the same config and compile cache as an earlier one loads every step
    program from disk: no compilation, transformers' tokens. Corrupt files are misses (compiled
    again and stored, with a warning), and compile_cache=False writes nothing there. The engine
    (LONG_ENGINE, a cache shape of its own, so the first engine compiles its forwards) and the
    requests of test_long_prompt_matches_transformers, which comes next and finds its programs
    compiled: one 1024-row prefill step and decodes, two forward programs and a sampler."""
    prompts, want = [{"prompt_token_ids": p} for p in long_case[0]], long_case[1]
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    kw = dict(attention_backend=backend, compile_cache=str(tmp_path / "xla"), **LONG_ENGINE)
    with step_compiles() as first:
        llm = LLM(tiny_model, **kw)
        assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    files = sorted((tmp_path / "xla").glob("step-*.bin"))
    # every program is stored, samplers an earlier engine of this process compiled included
    assert first.count("forward") >= 2 and len(files) >= len(first)
    assert len(files) == len({k for s in llm.engine.runner.shapes_used for k in (s.forward, s.sampler)})
    with step_compiles() as again:
        assert token_ids(LLM(tiny_model, **kw).generate(prompts, sp, use_tqdm=False)) == want
    assert again == []
    for f in files:
        f.write_bytes(b"not a program")
    with caplog.at_level("WARNING", logger="minivllm_jax.worker.executable_cache"):
        assert token_ids(LLM(tiny_model, **kw).generate(prompts, sp, use_tqdm=False)) == want
    assert caplog.text.count("ignoring unreadable compiled program") == len(files)
    assert all(f.read_bytes() != b"not a program" for f in files)  # compiled and stored again
    llm = LLM(tiny_model, **{**kw, "compile_cache": False})
    assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert llm.engine.runner.executable_cache is None
    assert sorted((tmp_path / "xla").glob("step-*.bin")) == files  # nothing new written
    # a process whose JAX persistent cache is on stores no step program, and the next process
    # without it stores and loads its own: tests/cli/test_cli.py, through generate.py


def test_long_prompt_matches_transformers(tiny_model: Any, backend: str,
                                          long_case: tuple[list[list[int]], list[list[int]]]) -> None:
    """A 600+ token prompt beside a short one: one 1024-row prefill step (on the XLA backend, the
    long-tile layout: a query run of LONG_RUN+ tokens, few sequences), then decode steps over the
    long context. Both get transformers' greedy tokens."""
    prompts, expected = long_case
    llm = LLM(tiny_model, attention_backend=backend, **LONG_ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert token_ids(outs) == expected
    assert [s.num_tokens for s in llm.engine.runner.shapes_used if s.num_tokens >= len(prompts[0])] == [1024]
    assert llm.get_stats()["num_free_kv_blocks"] == LONG_ENGINE["num_kv_blocks"] - 1  # all but the null one


@pytest.mark.parametrize("async_scheduling, policy", [(False, "fcfs"), (True, "priority")])
def test_random_arrivals_and_aborts_lose_nothing(tiny_model: Any, backend: str, on_gpu: bool,
                                                 tiny_greedy: list[list[int]], async_scheduling: bool,
                                                 policy: str) -> None:
    """A seeded random workload through the step API: after a burst of six requests that
    overfills PREEMPT's 10-block pool (15 blocks at their full length, shared prefixes counted
    once) and repeats a shared prefix, 20 more requests arrive between steps
    (random prompt, max_tokens 1-16, priority), and random ones of those are aborted while
    running. Truth per request: transformers' greedy
    tokens cut at its max_tokens; an aborted one has a prefix of them and finish_reason "abort"
    (unless it finished first). Every request is reported finished exactly once, its deltas carry
    every token and character of its output, and afterwards every block but the null block is
    free."""
    rng = np.random.default_rng(8 + async_scheduling)
    llm = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling,
              scheduling_policy=policy, **PREEMPT)
    eos = llm.engine.model_config.eos_token_ids[0]
    asked: dict[str, tuple[int, int]] = {}  # request id -> (prompt index, max_tokens)
    aborted: set[str] = set()
    deltas: list[Any] = []
    steps = 0
    # first a burst that overfills the pool (each replica's too) and repeats a shared prefix,
    # then random arrivals
    burst = [(i, MAX_TOKENS) for i in (2, 4, 5, 2, 5, 6)]
    arrivals = [burst]
    while sum(map(len, arrivals)) < len(burst) + 20:
        arrivals.append([(int(rng.integers(len(TINY_PROMPTS))), int(rng.integers(1, MAX_TOKENS + 1)))
                         for _ in range(rng.integers(0, 3))])
    while arrivals or llm.has_unfinished_requests():
        for i, m in arrivals.pop(0) if arrivals else []:
            priority = int(rng.integers(0, 3)) if policy == "priority" else 0
            asked[llm.add_request(TINY_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=m),
                                  priority=priority)] = (i, m)
        done = {d.request_id for d in deltas if d.finished}
        live = sorted(set(list(asked)[len(burst):]) - done - aborted)  # the burst is never aborted
        if live and rng.random() < 0.2:
            victim = live[int(rng.integers(len(live)))]
            aborted.add(victim)
            llm.abort_request(victim)
        deltas += llm.step()
        steps += 1
        assert steps < 1000, "the workload does not drain"
    finished = [d for d in deltas if d.finished]
    assert sorted(d.request_id for d in finished) == sorted(asked)  # each exactly once
    for d in finished:
        i, m = asked[d.request_id]
        c = d.output.outputs[0]
        ref = tiny_greedy[i][:m]
        mine = [x for x in deltas if x.request_id == d.request_id]
        assert [t for x in mine for t in x.new_token_ids] == c.token_ids
        assert "".join(x.new_text for x in mine) == c.text
        if c.finish_reason == "abort":
            assert d.request_id in aborted and c.token_ids == ref[:len(c.token_ids)]
        else:
            assert c.token_ids == ref
            assert c.finish_reason == ("stop" if ref[-1] == eos else "length")
    assert any(d.output.outputs[0].finish_reason == "abort" for d in finished)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_kv_blocks"] == PREEMPT["num_kv_blocks"] - 1
    assert stats["kv_cache_usage"] == 0.0


def test_min_p_one_samples_the_greedy_tokens(tiny_model: Any, backend: str,
                                             tiny_greedy: list[list[int]]) -> None:
    """min_p = 1 keeps only each step's most likely token, so hot seeded sampling through the
    engine gives transformers' greedy tokens; min_p = 0 with the same seed does not (the check
    that the sampling path ran)."""
    llm = LLM(tiny_model, attention_backend=backend, **PRECOMPILED)
    hot = dict(temperature=1.5, max_tokens=MAX_TOKENS, seed=3, top_k=-1)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(min_p=1.0, **hot), use_tqdm=False)
    assert token_ids(outs) == tiny_greedy
    outs = llm.generate(prompts, SamplingParams(min_p=0.0, **hot), use_tqdm=False)
    assert token_ids(outs) != tiny_greedy


def _hf_biased_greedy(model: Any, ids: list[int], bias: dict[int, float], n: int) -> list[int]:
    """transformers' logits plus the bias at every step, argmax, n tokens."""
    import torch

    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            for tok, value in bias.items():
                logits[tok] += value
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_logit_bias_matches_transformers_logits_plus_bias(tiny_model: Any, tiny_hf: Any,
                                                          backend: str,
                                                          tiny_greedy: list[list[int]]) -> None:
    """Greedy decoding with logit_bias equals a greedy loop over transformers' logits plus the
    same bias; the batch's request without a bias keeps its plain greedy tokens; an id outside
    the vocabulary is refused by name."""
    llm = LLM(tiny_model, attention_backend=backend, **PRECOMPILED)
    first = tiny_greedy[0][0]
    biases = [{first: -100.0, 7: 2.5}, {11: 4.0, 12: -1.0, 13: 3.0}]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=b)
              for b in biases] + [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)]
    prompts = [{"prompt_token_ids": TINY_PROMPTS[i]} for i in (0, 1, 2)]
    outs = token_ids(llm.generate(prompts, params, use_tqdm=False))
    for i, bias in enumerate(biases):
        assert outs[i] == _hf_biased_greedy(tiny_hf, TINY_PROMPTS[i], bias, MAX_TOKENS)
    assert outs[0][0] != first
    assert outs[2] == tiny_greedy[2]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompts[:1], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def _hf_penalized_greedy(model: Any, ids: list[int], n: int, rep: float, pres: float,
                         freq: float) -> list[int]:
    """A greedy loop over transformers' logits with the repetition penalty (transformers' rule,
    prompt and output tokens) and then OpenAI's presence/frequency penalties (output tokens)."""
    import torch

    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            seen = torch.tensor(sorted(set(ids)))
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / rep, picked * rep)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0])
            logits = logits - freq * counts - pres * (counts > 0)
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_survive_preemption(tiny_model: Any, tiny_hf: Any, backend: str,
                                      async_scheduling: bool) -> None:
    """The device-side token counts are rebuilt when a preempted request comes back: under
    PREEMPT's pool, which forces preemptions, greedy decoding with all three penalties equals a greedy loop
    over transformers' logits with the same penalties. A second run with other penalty values
    (same step shapes) compiles nothing: the values are data, not statics."""
    engine = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling,
                 **PREEMPT)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]

    def params(rep: float, pres: float, freq: float) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                               repetition_penalty=rep + 0.1 * i, presence_penalty=pres,
                               frequency_penalty=freq) for i in range(len(prompts))]

    outs = token_ids(engine.generate(prompts, params(1.2, 0.5, 0.3), use_tqdm=False))
    assert engine.get_stats()["num_preemptions"] > 0
    for i, p in enumerate(TINY_PROMPTS):
        assert outs[i] == _hf_penalized_greedy(tiny_hf, p, MAX_TOKENS, 1.2 + 0.1 * i, 0.5, 0.3), i
    with step_compiles() as compiles:
        again = token_ids(engine.generate(prompts, params(1.5, -0.5, 0.8), use_tqdm=False))
    assert compiles == [] and again != outs
    assert again[5] == _hf_penalized_greedy(tiny_hf, TINY_PROMPTS[5], MAX_TOKENS, 2.0, -0.5, 0.8)
    assert engine.get_stats()["num_free_kv_blocks"] == PREEMPT["num_kv_blocks"] - 1


def _run_steps(llm: LLM) -> tuple[dict[str, Any], int, int]:
    """Step until idle: the finished outputs by id, the peak of KV blocks in use, and the tokens
    the model computed."""
    outs, peak, computed = {}, 0, 0
    while llm.has_unfinished_requests():
        for d in llm.step():
            if d.finished:
                outs[d.request_id] = d.output
        stats = llm.get_stats()
        peak = max(peak, stats["num_kv_blocks"] - 1 - stats["num_free_kv_blocks"])
        computed += llm.engine.last_step.num_tokens
    return outs, peak, computed


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_share_the_prompt(tiny_model: Any, backend: str, prefix_caching: bool,
                                    tiny_greedy: list[list[int]]) -> None:
    """n=8 samples of a 120-token prompt (7 full blocks and 8 tokens; a chunked prefill in
    PRECOMPILED's 16-token steps): the prompt is computed once (the other samples wait for it,
    then share its full blocks by reference, with prefix caching off too), so the blocks in use
    stay under twice a single request's (15 against 16: eight unshared copies would take 64);
    eight distinct samples with indices 0..7; every block is free afterwards."""
    llm = LLM(tiny_model, attention_backend=backend, enable_prefix_caching=prefix_caching,
              **PRECOMPILED)
    prompt = np.random.default_rng(3).integers(3, 256, 120).tolist()
    assert len(prompt) + 8 <= PRECOMPILED["max_model_len"]
    hot = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    llm.add_request(prompt, SamplingParams(n=8, seed=5, **hot), request_id="n8")
    outs, peak8, computed8 = _run_steps(llm)
    samples = outs["n8"].outputs
    assert [c.index for c in samples] == list(range(8))
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in samples)
    assert len({tuple(c.token_ids) for c in samples}) == 8
    llm.engine.scheduler.reset_prefix_cache()
    llm.add_request(prompt, SamplingParams(seed=5, **hot), request_id="n1")
    single, peak1, computed1 = _run_steps(llm)
    assert single["n1"].outputs[0].token_ids == samples[0].token_ids  # sample 0 is stream 0
    assert peak8 < 2 * peak1
    tail = len(prompt) % 16 + 1  # the shared prompt's partial block and last token, per other sample
    assert computed8 <= computed1 + 7 * (tail + 8)
    assert llm.get_stats()["num_free_kv_blocks"] == PRECOMPILED["num_kv_blocks"] - 1


def test_n_samples_seeded_greedy_and_abort(tiny_model: Any, backend: str,
                                           tiny_greedy: list[list[int]]) -> None:
    """Seeded n=4 samples are reproducible and the same whatever else shares the batch; greedy
    n=3 gives transformers' greedy tokens three times; aborting an n=4 request mid-way ends
    each sample once ("abort"), reports the request once with four outputs, and leaks no block."""
    llm = LLM(tiny_model, attention_backend=backend, **PRECOMPILED)
    hot = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    p = {"prompt_token_ids": TINY_PROMPTS[5]}
    alone = [c.token_ids for c in llm.generate(p, hot, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in alone}) == 4
    crowd = llm.generate([{"prompt_token_ids": TINY_PROMPTS[0]}, p, {"prompt_token_ids": TINY_PROMPTS[2]}],
                         [SamplingParams(n=2, temperature=0.7, max_tokens=5), hot, GREEDY], use_tqdm=False)
    assert [c.token_ids for c in crowd[1].outputs] == alone
    assert [c.token_ids for c in crowd[2].outputs] == [tiny_greedy[2]]
    greedy = llm.generate(p, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [c.token_ids for c in greedy[0].outputs] == [tiny_greedy[5]] * 3

    rid = llm.add_request(TINY_PROMPTS[5], hot)
    deltas = []
    for _ in range(4):
        deltas += llm.step()
    llm.abort_request(rid)
    while llm.has_unfinished_requests():
        deltas += llm.step()
    ends = [d for d in deltas if d.finish_reason is not None]
    assert sorted(d.index for d in ends) == [0, 1, 2, 3]
    assert {d.finish_reason for d in ends} == {"abort"}
    final = [d for d in deltas if d.finished]
    assert len(final) == 1 and len(final[0].output.outputs) == 4
    for c in final[0].output.outputs:
        assert 0 < len(c.token_ids) < MAX_TOKENS and c.token_ids == alone[c.index][:len(c.token_ids)]
    assert llm.get_stats()["num_free_kv_blocks"] == PRECOMPILED["num_kv_blocks"] - 1


def test_generation_config_supplies_the_default_sampling(tiny_llama: str, tmp_path: Any, backend: str,
                                                         tiny_greedy: list[list[int]]) -> None:
    """A checkpoint's generation_config.json sampling fields become the defaults of calls given no
    SamplingParams (vLLM's rule): temperature 0 there gives transformers' greedy tokens; without
    the file the defaults are vLLM's (temperature 1.0, 16 tokens)."""
    import json
    import shutil

    from minivllm_jax.loader import load_model

    ckpt = tmp_path / "with_generation_config"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "do_sample": False, "bos_token_id": 1}))
    llm = LLM(load_model(ckpt, dtype="float32", use_cache=False), attention_backend=backend,
              **PRECOMPILED)
    sp = llm.default_sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.0, 0.9, 7, 16)
    outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS[:3]], use_tqdm=False)
    assert token_ids(outs) == tiny_greedy[:3]
    plain = LLM(load_model(tiny_llama, dtype="float32", use_cache=False), attention_backend=backend,
                **PRECOMPILED)
    assert plain.default_sampling_params == SamplingParams()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steady_decode_step_makes_one_host_to_device_transfer(
        tiny_model: Any, backend: str, async_scheduling: bool, capfd: Any) -> None:
    """A steady decode step moves one buffer from the host to the device (its packed main part,
    passed into the forward, which hands the sampler its part), whatever its rows' sampling
    kind (greedy, random, filtered by top-k): JAX's transfer guard logs every host-to-device
    transfer, explicit or implicit (on stderr, from C++), and exactly one shows per step."""
    import jax

    from minivllm_jax.sampling.sampler import FILTERED, GREEDY, RANDOM

    llm = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling, **BASE)
    engine = llm.engine
    cases = {GREEDY: SamplingParams(temperature=0.0), RANDOM: SamplingParams(temperature=0.9, seed=1),
             FILTERED: SamplingParams(temperature=0.9, top_k=5, seed=2)}
    for kind, sp in cases.items():
        sp = dataclasses.replace(sp, max_tokens=40, ignore_eos=True)
        ids = [engine.add_request(prompt, sp) for prompt in TINY_PROMPTS[:4]]
        for _ in range(6):  # prefills, then decode steps: their programs compile and run once
            engine.step()
        capfd.readouterr()
        engine.runner.shapes_used.clear()
        with jax.transfer_guard_host_to_device("log_explicit"):
            for _ in range(5):
                engine.step()
        err = capfd.readouterr().err
        assert err.count("host-to-device transfer") == 5, (kind, err)
        shapes = engine.runner.shapes_used  # the five steps': decodes of this sampling kind
        assert {(s.num_spec, s.sampling, s.num_bias, s.penalties) for s in shapes} == {
            (0, kind, 0, False)}, shapes
        engine.abort_request(ids, report=False)
        while engine.has_unfinished_requests():
            engine.step()
    assert llm.get_stats()["num_free_kv_blocks"] == BASE["num_kv_blocks"] - 1


def test_n_beyond_max_num_seqs_runs_in_waves(tiny_model: Any, backend: str) -> None:
    """n = 3 x max_num_seqs, as vLLM runs it: at most max_num_seqs samples run at once, every
    sample finishes, each is seeded by its own index (the first max_num_seqs equal a request of
    n = max_num_seqs with the same seed, whose one wave is the same batch), the samples differ,
    and no block leaks."""
    llm = LLM(tiny_model, attention_backend=backend, **BASE)
    seqs = BASE["max_num_seqs"]
    engine = llm.engine
    running: list[int] = []

    def schedule(inner: Any = engine.scheduler.schedule) -> Any:
        out = inner()
        running.append(len(engine.scheduler.running))
        return out
    engine.scheduler.schedule = schedule
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": TINY_PROMPTS[5]}]
    wide = llm.generate(prompt, dataclasses.replace(sp, n=3 * seqs), use_tqdm=False)[0].outputs
    assert max(running) == seqs and sum(r == seqs for r in running) >= 3 * 6 - 2, running
    narrow = llm.generate(prompt, dataclasses.replace(sp, n=seqs), use_tqdm=False)[0].outputs
    assert [c.index for c in wide] == list(range(3 * seqs))
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in wide)
    assert [c.token_ids for c in wide[:seqs]] == [c.token_ids for c in narrow]
    assert len({tuple(c.token_ids) for c in wide}) > 2 * seqs  # independent streams
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == BASE["num_kv_blocks"] - 1


def _nothing_left(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and llm.step() == []
    assert not engine.scheduler.requests and not engine.outputs.parents and not engine.outputs.tracked
    assert llm.get_stats()["num_free_kv_blocks"] == BASE["num_kv_blocks"] - 1


def test_an_interrupt_while_adding_leaves_nothing_behind(tiny_model: Any, backend: str,
                                                         tiny_greedy: list[list[int]]) -> None:
    """A KeyboardInterrupt at every point of `generate`'s add phase (before and after each of its
    samples' registration with the scheduler: 7 prompts x n=2), and from a timer at delays
    across it: nothing of the call is left (no request, sample, parent or block), its request
    ids are free again, and the next call equals transformers."""
    import _thread
    import gc
    import signal
    import threading
    import time

    llm = LLM(tiny_model, attention_backend=backend, **BASE)
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=4, n=2)
    inner = engine.scheduler.add_request
    for k in range(2 * 2 * len(TINY_PROMPTS)):
        calls = [0]

        def add(request: Any, k: int = k) -> None:
            calls[0] += 1
            if calls[0] == k // 2 + 1 and k % 2 == 0:
                raise KeyboardInterrupt  # before this sample is registered
            inner(request)
            if calls[0] == k // 2 + 1:
                raise KeyboardInterrupt  # after it
        engine.scheduler.add_request = add
        with pytest.raises(KeyboardInterrupt):
            llm.generate(TINY_PROMPTS, sp, use_tqdm=False)
        engine.scheduler.add_request = inner
        _nothing_left(llm)
    start = time.perf_counter()
    llm.generate(TINY_PROMPTS * 4, dataclasses.replace(sp, max_tokens=1), use_tqdm=False)
    adding = time.perf_counter() - start  # an upper bound of the add phase
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    gc.disable()  # an interrupt landing in a gc callback (jax has one) would be swallowed there
    try:
        for trial in range(8):
            timer = threading.Timer(adding * trial / 16, _thread.interrupt_main)
            try:
                timer.start()
                llm.generate(TINY_PROMPTS * 4, sp, use_tqdm=False)
                timer.join()
                time.sleep(0.3)  # an interrupt after the call lands here
            except KeyboardInterrupt:
                pass
            _nothing_left(llm)
    finally:
        gc.enable()
        signal.signal(signal.SIGINT, handler)
    assert token_ids(llm.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)) == tiny_greedy

"""The engine's scheduling mechanics on a tiny random Llama (2 layers, word-level tokenizer), where
the model is not the point and compiling is cheap: preemption and compile counts, precompile,
priorities, random arrivals and aborts, a long prompt's prefill and decode.

Truth: transformers' greedy generation on the same checkpoint (float32), and brute-force counts of
buckets and blocks. The prompts have the token lengths of test_llm.py's SmolLM2 prompts, and two
of them share a 27-token prefix, so the pools and buckets behave alike.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine_helpers import BASE, GREEDY, MAX_TOKENS, step_compiles, token_ids
from minivllm_jax import LLM, SamplingParams
from minivllm_jax.buckets import bucket
from minivllm_jax.backends import ATTENTION_BACKENDS

_rng = np.random.default_rng(0)
_SHARED = _rng.integers(3, 256, size=27).tolist()
TINY_PROMPTS = [_rng.integers(3, 256, size=n).tolist() for n in (5, 5, 6, 6, 5, 19, 7)]
TINY_PROMPTS[2], TINY_PROMPTS[4] = _SHARED + TINY_PROMPTS[2], _SHARED + TINY_PROMPTS[4]  # 33, 32


def _hf_greedy(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        t = torch.tensor([ids])
        gen = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=2)
    return gen[0, t.shape[1]:].tolist()


@pytest.fixture(scope="module")
def tiny_greedy(tiny_hf: Any) -> list[list[int]]:
    """transformers' greedy continuation of each tiny prompt, one at a time (no padding)."""
    return [_hf_greedy(tiny_hf, p, MAX_TOKENS) for p in TINY_PROMPTS]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_compile_count(tiny_model: Any, backend: str, tiny_greedy: list[list[int]],
                                      async_scheduling: bool) -> None:
    """A pool of 10-11 blocks (3-4 per request) forces preemptions; a unique cache shape makes
    every forward compilation of this engine new, so XLA compiles the forward exactly once per
    token bucket met (the samplers, which do not read the cache, at most once per sample
    bucket), and those stay few over ~100 varied steps. With
    async_scheduling, requests are preempted while a token of theirs is in flight, and decodes read
    their input ids from the step before: the tokens must still be transformers' own."""
    with step_compiles() as compiles:
        engine = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling,
                     **{**BASE, "num_kv_blocks": 10 + async_scheduling})
        outs = engine.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == tiny_greedy
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0
    shapes = engine.engine.runner.shapes_used
    programs = {s.forward for s in shapes} | {s.sampler for s in shapes}
    assert engine.engine.runner.programs.compiled_shapes == programs
    assert compiles.count("forward") == len({s.num_tokens for s in shapes})
    assert compiles.count("sample_tokens") <= len({s.num_sampled for s in shapes})
    min_tokens, min_sampled = ATTENTION_BACKENDS[backend].min_buckets
    assert {s.num_tokens for s in shapes} <= {b for b in (4, 8, 16, 32, 64) if b >= min_tokens}
    assert {s.num_sampled for s in shapes} <= {b for b in (4, 8) if b >= min_sampled}


def test_precompile_covers_every_step(tiny_model: Any, backend: str,
                                      tiny_greedy: list[list[int]]) -> None:
    """precompile() covers exactly the (token bucket, sample bucket) pairs that a brute-force
    walk over every step composition reaches: one forward per token bucket and one sampler per
    sample bucket among them. It leaves the KV cache as it was; afterwards a chunked, batched run
    compiles nothing and its tokens are transformers' own."""
    engine = LLM(tiny_model, attention_backend=backend,
                 **{**BASE, "max_num_batched_tokens": 32, "num_kv_blocks": 33})  # fresh cache shape
    runner = engine.engine.runner
    min_tokens, min_sampled = ATTENTION_BACKENDS[backend].min_buckets
    reachable = {(bucket(t, min_tokens, 32), bucket(s, min_sampled, 8))
                 for t in range(1, 33) for s in range(0, min(t, 8) + 1)}
    assert {(s.num_tokens, s.num_sampled) for s in runner.step_shapes()} == reachable
    cache = np.asarray(runner.kv_cache).copy()
    with step_compiles() as compiles:
        assert engine.precompile() == len(reachable)
    assert np.array_equal(np.asarray(runner.kv_cache), cache)  # empty steps write no slot
    token_buckets, sample_buckets = {t for t, _ in reachable}, {s for _, s in reachable}
    # a fresh cache shape: every forward compiles; samplers may come from an earlier engine
    assert compiles.count("forward") == len(token_buckets)
    assert compiles.count("sample_tokens") <= len(sample_buckets)
    assert {(k.num_tokens, k.num_sampled) for k in runner.programs.compiled_shapes} == (
        {(t, 0) for t in token_buckets} | {(0, s) for s in sample_buckets})
    with step_compiles() as compiles:
        assert token_ids(engine.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)) == tiny_greedy
    assert compiles == []  # nothing compiled while serving
    assert {k for s in runner.shapes_used for k in (s.forward, s.sampler)} <= runner.programs.compiled_shapes
    assert len(runner.shapes_used) > 2


def test_priority_policy_admits_lower_values_first(tiny_model: Any, backend: str,
                                                   tiny_greedy: list[list[int]]) -> None:
    """scheduling_policy="priority" with one priority per prompt: the scheduler first schedules
    requests in (priority, arrival) order (the brute-force truth: the priorities sorted), not in
    the order they were added, and FCFS (priority 0 everywhere) keeps that order. The 10-block
    pool forces preemptions, and greedy tokens stay transformers'; no block leaks."""
    priorities = [3, 6, 0, 5, 1, 4, 2]
    for policy in ("priority", "fcfs"):
        llm = LLM(tiny_model, attention_backend=backend, scheduling_policy=policy,
                  **{**BASE, "num_kv_blocks": 10})
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


def test_long_prompt_matches_transformers(tiny_model: Any, tiny_hf: Any, backend: str) -> None:
    """A 600+ token prompt beside a short one: one 1024-row prefill step (on the XLA backend, the
    long-tile layout: a query run of LONG_RUN+ tokens, few sequences), then decode steps over the
    long context. Both get transformers' greedy tokens."""
    from pallas_kernels.xla_attention import LONG_RUN

    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=640).tolist(), TINY_PROMPTS[0]]
    assert LONG_RUN <= len(prompts[0]) and len(prompts[0]) + len(prompts[1]) <= 1024
    expected = [_hf_greedy(tiny_hf, ids, 8) for ids in prompts]
    llm = LLM(tiny_model, attention_backend=backend, max_num_seqs=4, max_model_len=1024,
              max_num_batched_tokens=1024, num_kv_blocks=160)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert token_ids(outs) == expected
    assert llm.get_stats()["num_free_kv_blocks"] == 159  # every block but the null one is free


@pytest.mark.parametrize("async_scheduling, policy", [(False, "fcfs"), (True, "priority")])
def test_random_arrivals_and_aborts_lose_nothing(tiny_model: Any, backend: str, on_gpu: bool,
                                                 tiny_greedy: list[list[int]], async_scheduling: bool,
                                                 policy: str) -> None:
    """A seeded random workload through the step API: after a burst that overfills a 7-block pool
    (64-token requests) and repeats a shared prefix, 20 more requests arrive between steps
    (random prompt, max_tokens 1-16, priority), and random ones of those are aborted while
    running. Truth per request: transformers' greedy
    tokens cut at its max_tokens; an aborted one has a prefix of them and finish_reason "abort"
    (unless it finished first). Every request is reported finished exactly once, its deltas carry
    every token and character of its output, and afterwards every block but the null block is
    free."""
    rng = np.random.default_rng(8 + async_scheduling)
    llm = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling,
              scheduling_policy=policy,
              **{**BASE, "max_model_len": 64, "num_kv_blocks": 7})
    eos = llm.engine.model_config.eos_token_ids[0]
    asked: dict[str, tuple[int, int]] = {}  # request id -> (prompt index, max_tokens)
    aborted: set[str] = set()
    deltas: list[Any] = []
    steps = 0
    # first a burst that overfills the pool (each replica's too) and repeats a shared prefix,
    # then random arrivals
    arrivals = [[(i, MAX_TOKENS) for i in (2, 4, 5, 2)]]
    while sum(map(len, arrivals)) < 24:
        arrivals.append([(int(rng.integers(len(TINY_PROMPTS))), int(rng.integers(1, MAX_TOKENS + 1)))
                         for _ in range(rng.integers(0, 3))])
    while arrivals or llm.has_unfinished_requests():
        for i, m in arrivals.pop(0) if arrivals else []:
            priority = int(rng.integers(0, 3)) if policy == "priority" else 0
            asked[llm.add_request(TINY_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=m),
                                  priority=priority)] = (i, m)
        done = {d.request_id for d in deltas if d.finished}
        live = sorted(set(list(asked)[4:]) - done - aborted)  # the burst is never aborted
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
    assert stats["num_free_kv_blocks"] == 7 - 1
    assert stats["kv_cache_usage"] == 0.0


def test_min_p_one_samples_the_greedy_tokens(tiny_model: Any, backend: str,
                                             tiny_greedy: list[list[int]]) -> None:
    """min_p = 1 keeps only each step's most likely token, so hot seeded sampling through the
    engine gives transformers' greedy tokens; min_p = 0 with the same seed does not (the check
    that the sampling path ran)."""
    llm = LLM(tiny_model, attention_backend=backend, **BASE)
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
    llm = LLM(tiny_model, attention_backend=backend, **BASE)
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
    """The device-side token counts are rebuilt when a preempted request comes back: under a
    pool that forces preemptions, greedy decoding with all three penalties equals a greedy loop
    over transformers' logits with the same penalties. A second run with other penalty values
    (same step shapes) compiles nothing: the values are data, not statics."""
    engine = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling,
                 **{**BASE, "num_kv_blocks": 10 + async_scheduling})
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
    assert engine.get_stats()["num_free_kv_blocks"] == 10 + async_scheduling - 1


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
    """n=8 samples of a 200-token prompt (a chunked prefill): the prompt is computed once (the
    other samples wait for it, then share its full blocks by reference, with prefix caching off
    too), so the blocks in use stay under twice a single request's; eight distinct samples with
    indices 0..7; every block is free afterwards."""
    llm = LLM(tiny_model, attention_backend=backend, enable_prefix_caching=prefix_caching,
              **{**BASE, "max_model_len": 256, "num_kv_blocks": 128})
    prompt = np.random.default_rng(3).integers(3, 256, 200).tolist()
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
    tail = 200 % 16 + 1  # the shared prompt's partial block and last token, per other sample
    assert computed8 <= computed1 + 7 * (tail + 8)
    assert llm.get_stats()["num_free_kv_blocks"] == 128 - 1


def test_n_samples_seeded_greedy_and_abort(tiny_model: Any, backend: str,
                                           tiny_greedy: list[list[int]]) -> None:
    """Seeded n=4 samples are reproducible and the same whatever else shares the batch; greedy
    n=3 gives transformers' greedy tokens three times; aborting an n=4 request mid-way ends
    each sample once ("abort"), reports the request once with four outputs, and leaks no block."""
    llm = LLM(tiny_model, attention_backend=backend, **BASE)
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
    assert llm.get_stats()["num_free_kv_blocks"] == BASE["num_kv_blocks"] - 1


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
    llm = LLM(load_model(ckpt, dtype="float32", use_cache=False), attention_backend=backend, **BASE)
    sp = llm.default_sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.0, 0.9, 7, 16)
    outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS[:3]], use_tqdm=False)
    assert token_ids(outs) == tiny_greedy[:3]
    plain = LLM(load_model(tiny_llama, dtype="float32", use_cache=False), attention_backend=backend,
                **BASE)
    assert plain.default_sampling_params == SamplingParams()


def test_compiled_steps_load_from_disk(tiny_model: Any, backend: str, tmp_path: Any,
                                       tiny_greedy: list[list[int]],
                                       caplog: pytest.LogCaptureFixture) -> None:
    """An engine with the same config and compile cache as an earlier one loads every step
    program from disk: no compilation, transformers' tokens. Corrupt files are misses (compiled
    again and stored, with a warning), and compile_cache=False writes nothing there. Three of the
    prompts, 43 tokens: one prefill step and decodes, two forward programs and a sampler per
    engine (each engine but the second compiles them all: a cache shape of their own)."""
    kw = dict(attention_backend=backend, compile_cache=str(tmp_path / "xla"),
              **{**BASE, "num_kv_blocks": 37})  # a cache shape of its own
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS[:3]]
    want = tiny_greedy[:3]
    with step_compiles() as first:
        llm = LLM(tiny_model, **kw)
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    files = sorted((tmp_path / "xla").glob("step-*.bin"))
    # every program is stored, samplers an earlier engine of this process compiled included
    assert first.count("forward") >= 2 and len(files) >= len(first)
    assert len(files) == len({k for s in llm.engine.runner.shapes_used for k in (s.forward, s.sampler)})
    with step_compiles() as again:
        assert token_ids(LLM(tiny_model, **kw).generate(prompts, GREEDY, use_tqdm=False)) == want
    assert again == []
    for f in files:
        f.write_bytes(b"not a program")
    with caplog.at_level("WARNING", logger="minivllm_jax.executable_cache"):
        assert token_ids(LLM(tiny_model, **kw).generate(prompts, GREEDY, use_tqdm=False)) == want
    assert caplog.text.count("ignoring unreadable compiled program") == len(files)
    assert all(f.read_bytes() != b"not a program" for f in files)  # compiled and stored again
    llm = LLM(tiny_model, **{**kw, "compile_cache": False, "num_kv_blocks": 38})
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert llm.engine.runner.executable_cache is None
    assert sorted((tmp_path / "xla").glob("step-*.bin")) == files  # nothing new written
    # a process whose JAX persistent cache is on stores no step program, and the next process
    # without it stores and loads its own: tests/engine/test_cli.py, through generate.py

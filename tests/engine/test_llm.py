"""End-to-end engine tests on the embedded SmolLM2-135M-Instruct GGUF.

Truth: transformers' own greedy generation on the same GGUF (float32). Most engines here share one
shape configuration (BASE) so that the jitted step compiles once per token bucket for all of them.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.input_batch import bucket
from minivllm_jax.plan import MIN_BUCKETS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_common import CompileWatch  # noqa: E402

SHARED = ("You are a careful assistant. Answer briefly and precisely, using plain words, "
          "and never repeat the question back to the user. ")
PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    SHARED + "Question: what is two plus two?",
    "def fibonacci(n):",
    SHARED + "Question: name a primary colour.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "What is the capital of France?",
]
MAX_TOKENS = 16
BASE = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@contextlib.contextmanager
def step_compiles() -> Iterator[list[str]]:
    """The XLA compilations of the engine's two programs ("forward", "sample_tokens") inside the
    block, from JAX's own backend-compile events (`CompileWatch`); the list fills on exit."""
    seen: list[str] = []
    with CompileWatch().install() as watch:
        yield seen
    seen.extend(name for name in watch.names if name in ("forward", "sample_tokens"))


@pytest.fixture(scope="module")
def hf_greedy(loaded_model: Any) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time (no padding)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = loaded_model.source
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    tok = loaded_model.tokenizer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several times faster than 2 threads on a busy 2-core machine
    try:
        out = _hf_generate(torch, model, tok, loaded_model.config.eos_token_ids[0])
    finally:
        torch.set_num_threads(threads)
    return out


def _hf_generate(torch: Any, model: Any, tok: Any, eos: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def llm(loaded_model: Any, backend: str) -> LLM:
    return LLM(loaded_model, attention_backend=backend, **BASE)


def _token_ids(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_batch_matches_transformers(llm: LLM, hf_greedy: list[list[int]], tokenizer: Any) -> None:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.prompt_token_ids for o in outs] == [tokenizer.encode(p) for p in PROMPTS]
    assert _token_ids(outs) == hf_greedy
    eos = llm.engine.model_config.eos_token_ids[0]
    for o, ref in zip(outs, hf_greedy):
        c = o.outputs[0]
        assert c.finish_reason == ("stop" if ref[-1] == eos else "length")
        assert c.text == tokenizer.decode(ref, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert len({o.request_id for o in outs}) == len(PROMPTS)


@pytest.mark.parametrize("variant", ["chunked", "no_prefix_cache", "one_at_a_time"])
def test_greedy_invariance(variant: str, llm: LLM, loaded_model: Any, backend: str,
                           hf_greedy: list[list[int]]) -> None:
    if variant == "one_at_a_time":
        got = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:3]]
        assert got == hf_greedy[:3]
        return
    kwargs = dict(BASE)
    if variant == "chunked":
        kwargs["max_num_batched_tokens"] = 16  # prompts of up to ~35 tokens take several steps
    else:
        kwargs["enable_prefix_caching"] = False
    engine = LLM(loaded_model, attention_backend=backend, **kwargs)
    assert _token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == hf_greedy
    if variant == "no_prefix_cache":
        assert engine.get_stats()["prefix_cache_hits"] == 0


@pytest.mark.parametrize("layout", ["stacked", "switched"])
def test_every_layer_layout_matches_transformers(loaded_model: Any, backend: str, layout: str,
                                                 hf_greedy: list[list[int]]) -> None:
    """Stacked layers (nn.scan over [L, ...] params) and switched ones (a scan over per-layer
    arrays, the CPU default) both give transformers' greedy tokens, each runner holding its own
    layout of the same weights."""
    llm = LLM(loaded_model, attention_backend=backend, layer_layout=layout, **BASE)
    params = llm.engine.runner.params
    layers = loaded_model.config.num_hidden_layers
    stacked = loaded_model.params["layers"]["self_attn"]["q_proj"]["weight"]
    if layout == "stacked":
        assert sorted(params) == ["embed_tokens", "layers", "norm"]
        assert params["layers"]["self_attn"]["q_proj"]["weight"] is stacked
    else:
        assert "layers" not in params and sorted(params) == sorted(
            ["embed_tokens", "norm", *(f"layers_{i}" for i in range(layers))])
        for i in (0, layers - 1):
            q = params[f"layers_{i}"]["self_attn"]["q_proj"]["weight"]
            assert q.shape == stacked.shape[1:] and bool((q == stacked[i]).all())
    assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == hf_greedy


def test_pallas_rejects_a_cache_past_int32_offsets(loaded_model: Any) -> None:
    """A user-given num_kv_blocks whose all-layer cache has >= 2**31 elements would overflow the
    kernels' int32 offsets: refused before anything is allocated, naming the field and the bound."""
    c = loaded_model.config
    per_block = c.num_hidden_layers * BASE.get("block_size", 16) * 2 * c.num_key_value_heads * c.head_dim
    limit = (2**31 - 1) // per_block
    with pytest.raises(ValueError, match=rf"num_kv_blocks={limit + 1} .* at most {limit}\b"):
        LLM(loaded_model, attention_backend="pallas", **{**BASE, "num_kv_blocks": limit + 1})


def test_prefix_cache_hits(llm: LLM, hf_greedy: list[list[int]]) -> None:
    before = llm.get_stats()["prefix_cache_hits"]
    # PROMPTS[2] and PROMPTS[4] share a > 16-token prefix: submitted together, one hits the other's
    # blocks once they are cached; both are also cached from the earlier tests of this module.
    outs = llm.generate([PROMPTS[2], PROMPTS[4]], GREEDY, use_tqdm=False)
    assert _token_ids(outs) == [hf_greedy[2], hf_greedy[4]]
    assert llm.get_stats()["prefix_cache_hits"] > before


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_compile_count(loaded_model: Any, backend: str, hf_greedy: list[list[int]],
                                      async_scheduling: bool) -> None:
    """A pool of 10-11 blocks (3-4 per request) forces preemptions; a unique cache shape makes
    every forward compilation of this engine new, so XLA compiles the forward exactly once per
    token bucket met (the samplers, which do not read the cache, at most once per sample
    bucket), and those stay few over ~100 varied steps. With
    async_scheduling, requests are preempted while a token of theirs is in flight, and decodes read
    their input ids from the step before: the tokens must still be transformers' own."""
    with step_compiles() as compiles:
        engine = LLM(loaded_model, attention_backend=backend, async_scheduling=async_scheduling,
                     **{**BASE, "num_kv_blocks": 10 + async_scheduling})
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outs) == hf_greedy
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0
    shapes = engine.engine.runner.shapes_used
    programs = {s.forward for s in shapes} | {s.sampler for s in shapes}
    assert engine.engine.runner.programs.compiled_shapes == programs
    assert compiles.count("forward") == len({s.num_tokens for s in shapes})
    assert compiles.count("sample_tokens") <= len({s.num_sampled for s in shapes})
    min_tokens, min_sampled = MIN_BUCKETS[backend]
    assert {s.num_tokens for s in shapes} <= {b for b in (4, 8, 16, 32, 64) if b >= min_tokens}
    assert {s.num_sampled for s in shapes} <= {b for b in (4, 8) if b >= min_sampled}


def test_precompile_covers_every_step(loaded_model: Any, backend: str,
                                      hf_greedy: list[list[int]]) -> None:
    """precompile() covers exactly the (token bucket, sample bucket) pairs that a brute-force
    walk over every step composition reaches: one forward per token bucket and one sampler per
    sample bucket among them. It leaves the KV cache as it was; afterwards a chunked, batched run
    compiles nothing and its tokens are transformers' own."""
    engine = LLM(loaded_model, attention_backend=backend,
                 **{**BASE, "max_num_batched_tokens": 32, "num_kv_blocks": 33})  # fresh cache shape
    runner = engine.engine.runner
    min_tokens, min_sampled = MIN_BUCKETS[backend]
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
        assert _token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == hf_greedy
    assert compiles == []  # nothing compiled while serving
    assert {k for s in runner.shapes_used for k in (s.forward, s.sampler)} <= runner.programs.compiled_shapes
    assert len(runner.shapes_used) > 2


def test_top_k_1_equals_greedy_and_seeds(llm: LLM, hf_greedy: list[list[int]]) -> None:
    top1 = SamplingParams(temperature=0.9, top_k=1, max_tokens=MAX_TOKENS, seed=3)
    assert _token_ids(llm.generate(PROMPTS[:3], top1, use_tqdm=False)) == hf_greedy[:3]
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, seed=99, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], [other, seeded, GREEDY], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert batch[0].outputs[0].token_ids != alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a, b = llm.generate([PROMPTS[1], PROMPTS[1]], unseeded, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids  # per-request derived seeds


def test_stop_strings_and_streaming(llm: LLM, hf_greedy: list[list[int]], tokenizer: Any) -> None:
    prompt, ref = PROMPTS[5], hf_greedy[5]
    full = tokenizer.decode(ref, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    stop = full.split()[3]  # a word from the middle of the greedy continuation
    idx = full.index(stop)
    for include in (False, True):
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop], include_stop_str_in_output=include)
        c = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == (full[:idx + len(stop)] if include else full[:idx])
        assert c.token_ids == ref[:len(c.token_ids)] and len(c.token_ids) < len(ref)
    # streaming through the step API: the deltas add up to the final text
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop])
    rid = llm.add_request(prompt, sp)
    pieces, final = [], None
    while llm.has_unfinished_requests():
        for d in llm.step():
            assert d.request_id == rid
            pieces.append(d.new_text)
            final = d.output if d.finished else final
    assert final is not None and "".join(pieces) == final.outputs[0].text == full[:idx]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_abort_frees_blocks(loaded_model: Any, backend: str, async_scheduling: bool) -> None:
    """Aborted requests finish "abort" once; their deltas carry every token of the final output.
    With async_scheduling the third call's step is still in flight at the abort: its tokens are
    dropped, so two tokens were generated, against three without."""
    llm = LLM(loaded_model, attention_backend=backend, async_scheduling=async_scheduling, **BASE)
    rid = llm.add_request(PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=100))
    other = llm.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=100))
    deltas = [d for _ in range(3) for d in llm.step()]
    assert llm.get_stats()["kv_cache_usage"] > 0
    llm.abort_request([rid, other, "no-such-id"])
    deltas += llm.step()
    finished = [d for d in deltas if d.finished]
    assert sorted(d.request_id for d in finished) == sorted([rid, other])
    assert all(d.output.outputs[0].finish_reason == "abort" for d in finished)
    for d in finished:  # the deltas carry every token and character of the final output
        mine = [x for x in deltas if x.request_id == d.request_id]
        assert [t for x in mine for t in x.new_token_ids] == d.output.outputs[0].token_ids
        assert "".join(x.new_text for x in mine) == d.output.outputs[0].text
        assert len(d.output.outputs[0].token_ids) == (2 if async_scheduling else 3)
    assert not llm.has_unfinished_requests() and llm.step() == []
    stats = llm.get_stats()
    assert stats["kv_cache_usage"] == 0.0 and stats["num_free_kv_blocks"] == BASE["num_kv_blocks"] - 1


def test_async_scheduling_is_sync_one_call_later(loaded_model: Any, backend: str, on_gpu: bool,
                                                    hf_greedy: list[list[int]], tokenizer: Any) -> None:
    """async_scheduling=True returns, at call k + 1, exactly the deltas that async_scheduling=False
    returns at call k, for stop strings, stop tokens, lengths and seeded sampling. Each step is
    scheduled before the previous one's tokens are known: a request that a stop string or stop
    token ends is scheduled one step more, and that token is never reported; a length limit is
    foreseen.
    Short prompts are all prefilled in the first step, so the two runs schedule alike."""
    full = tokenizer.decode(hf_greedy[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    cases = [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[full.split()[2]])),
             (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[hf_greedy[1][4]])),
             (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=1)),
             (PROMPTS[6], SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True))]
    assert LLM(loaded_model, attention_backend=backend, **BASE).engine.plan.async_scheduling == on_gpu  # auto
    runs, scheduled = {}, {}
    for async_scheduling in (False, True):
        llm = LLM(loaded_model, attention_backend=backend, async_scheduling=async_scheduling, **BASE)
        sched = llm.engine.scheduler
        seen: list[str] = []
        schedule = sched.schedule
        sched.schedule = lambda: (lambda so: (seen.extend(so.num_scheduled_tokens), so)[1])(schedule())
        scheduled[async_scheduling] = seen
        for prompt, sp in cases:
            llm.add_request(prompt, sp)
        steps = []
        while llm.has_unfinished_requests():
            steps.append([(d.request_id, d.new_token_ids, d.new_text, d.finished, d.finish_reason,
                           d.output.outputs[0] if d.output else None) for d in llm.step()])
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == BASE["num_kv_blocks"] - 1  # nothing leaked
        runs[async_scheduling] = steps
    sync, lagged = runs[False], runs[True]
    while lagged[-1] == []:  # a last call may only collect a step whose requests all ended
        lagged.pop()
    assert lagged[0] == [] and lagged[1:] == sync
    # the stop-string and stop-token requests ran one step more (tokens dropped); the others alike
    assert all(scheduled[True].count(r) == scheduled[False].count(r) + 1 for r in "01")
    assert all(scheduled[True].count(r) == scheduled[False].count(r) for r in "23")
    reasons = {d[0]: (d[4], d[5].stop_reason) for step in sync for d in step if d[3]}
    assert reasons == {"0": ("stop", full.split()[2]), "1": ("stop", hf_greedy[1][4]),
                       "2": ("length", None), "3": ("length", None)}


def test_chat_uses_template(llm: LLM, tokenizer: Any) -> None:
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    conv2 = conv + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.chat([conv, conv2], sp, use_tqdm=False)
    for out, c in zip(outs, (conv, conv2)):
        text = tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        assert out.prompt == text and "France" in text
        assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    single = llm.chat(conv, sp, use_tqdm=False)  # one conversation, not a list of them
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_input_validation(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(1, 200))], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([3.5], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[10**9]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(None, attention_backend="cuda")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(None, max_num_seqs=64, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 1])  # fcfs ignores no priority
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(TypeError, match="priority must be an int"):
        llm.add_request("a", GREEDY, priority=1.5)
    with pytest.raises(TypeError, match="priority must be an int or a list of them, got str"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority="0")
    assert not llm.has_unfinished_requests()  # nothing half-added by the failed calls
    # any integer type is one priority for every prompt, as add_request takes it
    one = SamplingParams(temperature=0.0, max_tokens=1)
    assert [len(o.outputs[0].token_ids) for o in
            llm.generate(["a", "b"], one, use_tqdm=False, priority=np.int64(0))] == [1, 1]


def test_pallas_backend_matches_reference(loaded_model: Any, hf_greedy: list[list[int]]) -> None:
    engine = LLM(loaded_model, attention_backend="pallas", **{**BASE, "max_num_batched_tokens": 16})
    out = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy[0][:3]


def test_default_kv_cache_size_on_cpu(loaded_model: Any, on_gpu: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Without num_kv_blocks the CPU cache holds max_num_seqs full-length requests (+ the null
    block) unless that exceeds the byte cap; the size and concurrency are logged."""
    if on_gpu:
        pytest.skip("GPU sizing profiles device memory")
    from minivllm_jax.kv_cache_sizing import kv_cache_bytes_per_block

    with caplog.at_level("INFO", logger="minivllm_jax.runner"):
        engine = LLM(loaded_model, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16)
    assert engine.engine.runner.num_blocks == 4 * (64 // 16) + 1
    assert "17 blocks" in caplog.text and "concurrency 4.00x" in caplog.text
    big = LLM(loaded_model, max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=256)
    per_block = kv_cache_bytes_per_block(loaded_model.config, 16, loaded_model.dtype)
    assert big.engine.runner.num_blocks == (256 << 20) // per_block + 1
    assert big.engine.runner.kv_cache.nbytes <= (256 << 20) + per_block
    # the cap never drops below one full-length request
    long = LLM(loaded_model, max_num_seqs=256, max_model_len=8192, max_num_batched_tokens=256)
    assert long.engine.runner.num_blocks == 8192 // 16 + 1


def test_priority_policy_admits_lower_values_first(loaded_model: Any, backend: str,
                                                   hf_greedy: list[list[int]]) -> None:
    """scheduling_policy="priority" with one priority per prompt: the scheduler first schedules
    requests in (priority, arrival) order (the brute-force truth: the priorities sorted), not in
    the order they were added, and FCFS (priority 0 everywhere) keeps that order. The 10-block
    pool forces preemptions, and greedy tokens stay transformers'; no block leaks."""
    priorities = [3, 6, 0, 5, 1, 4, 2]
    for policy in ("priority", "fcfs"):
        llm = LLM(loaded_model, attention_backend=backend, scheduling_policy=policy,
                  **{**BASE, "num_kv_blocks": 10})
        engine = llm.engine
        first: list[str] = []  # request ids, first scheduled first

        def schedule(inner: Any = engine.scheduler.schedule) -> Any:
            so = inner()
            first.extend(r.req_id for r in so.scheduled_new_reqs if r.req_id not in first)
            return so
        engine.scheduler.schedule = schedule
        given = priorities if policy == "priority" else None
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=given)
        assert _token_ids(outs) == hf_greedy
        index = {o.request_id: i for i, o in enumerate(outs)}
        order = [index[r] for r in first]
        key = (lambda i: (priorities[i], i)) if policy == "priority" else (lambda i: i)
        assert order == sorted(order, key=key) and len(order) > 1
        assert len(first) == len(PROMPTS)
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_free_kv_blocks"] == 10 - 1


def test_long_prompt_matches_transformers(loaded_model: Any, backend: str) -> None:
    """A 600+ token prompt beside a short one: one 1024-row prefill step (on the reference
    backend, the long-tile layout: a query run of LONG_RUN+ tokens, few sequences), then decode
    steps over the long context. Both get transformers' greedy tokens."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from pallas_kernels.xla_attention import LONG_RUN

    tok = loaded_model.tokenizer
    long_prompt = "Count slowly and carefully: " + ", ".join(str(i) for i in range(1, 150))
    prompts = [tok.encode(long_prompt), tok.encode("The capital of France is")]
    assert LONG_RUN <= len(prompts[0]) and len(prompts[0]) + len(prompts[1]) <= 1024
    path = loaded_model.source
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    eos = loaded_model.config.eos_token_ids[0]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            t = torch.tensor([ids])
            gen = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=8,
                                 eos_token_id=eos, pad_token_id=eos)
            expected.append(gen[0, t.shape[1]:].tolist())
    llm = LLM(loaded_model, attention_backend=backend, max_num_seqs=4, max_model_len=1024,
              max_num_batched_tokens=1024, num_kv_blocks=160)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert _token_ids(outs) == expected
    assert llm.get_stats()["num_free_kv_blocks"] == 159  # every block but the null one is free


@pytest.mark.parametrize("async_scheduling, policy", [(False, "fcfs"), (True, "priority")])
def test_random_arrivals_and_aborts_lose_nothing(loaded_model: Any, backend: str, on_gpu: bool,
                                                 hf_greedy: list[list[int]], async_scheduling: bool,
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
    llm = LLM(loaded_model, attention_backend=backend, async_scheduling=async_scheduling,
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
        arrivals.append([(int(rng.integers(len(PROMPTS))), int(rng.integers(1, MAX_TOKENS + 1)))
                         for _ in range(rng.integers(0, 3))])
    while arrivals or llm.has_unfinished_requests():
        for i, m in arrivals.pop(0) if arrivals else []:
            priority = int(rng.integers(0, 3)) if policy == "priority" else 0
            asked[llm.add_request(PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=m),
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
        ref = hf_greedy[i][:m]
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

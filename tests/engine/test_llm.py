"""End-to-end engine tests: on the embedded SmolLM2-135M-Instruct GGUF where a real model and
tokenizer are the point (a greedy batch, stop strings in its BPE text, the chat template, logprobs
and prompt logprobs, the default cache size), and on the tiny random Llama (tests/conftest.py's,
2 layers, a word-level tokenizer) where they are not and its engines compile and run in a
fraction of SmolLM2's time (invariance to chunking, prefix caching and batching, layer layouts,
the Pallas backend, top_k and seeds, penalties, aborts, async scheduling, the default context
length).

Truth: transformers' own greedy generation and logits on the same checkpoints (float32). The
engines of each model share one shape configuration (BASE) so that the jitted step compiles once
per token bucket for all of them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine_helpers import BASE, GREEDY, MAX_TOKENS, TINY_PROMPTS, check_logprobs, token_ids
from minivllm_jax import LLM, SamplingParams

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
@pytest.fixture(scope="module")
def hf_greedy(loaded_model: Any, smollm2_hf: Any) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time (no padding)."""
    torch = pytest.importorskip("torch")
    return _hf_generate(torch, smollm2_hf, loaded_model.tokenizer, loaded_model.config.eos_token_ids[0])


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


def test_greedy_batch_matches_transformers(llm: LLM, hf_greedy: list[list[int]], tokenizer: Any) -> None:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.prompt_token_ids for o in outs] == [tokenizer.encode(p) for p in PROMPTS]
    assert token_ids(outs) == hf_greedy
    eos = llm.engine.model_config.eos_token_ids[0]
    for o, ref in zip(outs, hf_greedy):
        c = o.outputs[0]
        assert c.finish_reason == ("stop" if ref[-1] == eos else "length")
        assert c.text == tokenizer.decode(ref, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert len({o.request_id for o in outs}) == len(PROMPTS)


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


def test_pallas_rejects_a_cache_past_int32_offsets(loaded_model: Any) -> None:
    """A user-given num_kv_blocks whose all-layer cache has >= 2**31 elements would overflow the
    kernels' int32 offsets: refused before anything is allocated, naming the field and the bound."""
    c = loaded_model.config
    per_block = c.num_hidden_layers * BASE.get("block_size", 16) * 2 * c.num_key_value_heads * c.head_dim
    limit = (2**31 - 1) // per_block
    with pytest.raises(ValueError, match=rf"num_kv_blocks={limit + 1} .* at most {limit}\b"):
        LLM(loaded_model, attention_backend="pallas", **{**BASE, "num_kv_blocks": limit + 1})


def test_default_kv_cache_size_on_cpu(loaded_model: Any, on_gpu: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Without num_kv_blocks the CPU cache holds max_num_seqs full-length requests (+ the null
    block) unless that exceeds the byte cap; the size and concurrency are logged."""
    if on_gpu:
        pytest.skip("GPU sizing profiles device memory")
    from minivllm_jax.kv_cache_sizing import kv_cache_bytes_per_block

    with caplog.at_level("INFO", logger="minivllm_jax.engine_spec"):
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


# ---- logprobs against transformers' logits ------------------------------------------------------
LONG = SHARED + PROMPTS[5] + " " + SHARED  # over BASE's 64-token budget: a chunked prefill


def _hf_logprobs(model: Any, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax of the logits at every position of ``ids``, float64 [len, V]."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def test_logprobs_and_prompt_logprobs_match_transformers(llm: LLM, smollm2_hf: Any, tokenizer: Any,
                                                         hf_greedy: list[list[int]]) -> None:
    """Streamed through the step API: a greedy request with logprobs=5 and prompt_logprobs=5 over a
    chunked prefill, and a hot sampled one with a repetition penalty and logprobs=2, whose logprobs
    must still be the model's raw ones. Each position's values, ranks and top sets equal
    transformers' log-softmax on the same sequence (<= 1e-3); the streamed deltas add up to the
    final output; cumulative_logprob is the sum; greedy tokens are unchanged."""
    # (in this order the three are scheduled in two 64-token steps, then decode in one sampler
    # shape: a single program of each kind to compile)
    params = {
        "s": SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=2, repetition_penalty=1.3),
        "g": SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=5),
        "long": SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, prompt_logprobs=3),
    }
    prompts = {"g": PROMPTS[5], "long": LONG, "s": PROMPTS[3]}
    assert len(tokenizer.encode(LONG)) > BASE["max_num_batched_tokens"]
    for rid, sp in params.items():
        llm.add_request(prompts[rid], sp, request_id=rid)
    streamed: dict[str, list] = {rid: [] for rid in params}
    outs = {}
    while llm.has_unfinished_requests():
        for d in llm.step():
            streamed[d.request_id].extend(d.new_logprobs or [])
            if d.finished:
                outs[d.request_id] = d.output
    assert outs["g"].outputs[0].token_ids == hf_greedy[5][:8]
    for rid, out in outs.items():
        sp, c = params[rid], out.outputs[0]
        prompt = out.prompt_token_ids
        want = _hf_logprobs(smollm2_hf, prompt + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) and streamed[rid] == c.logprobs
        for t, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_logprobs(entry, tok, want[len(prompt) - 1 + t], sp.logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            check_logprobs(out.prompt_logprobs[j], prompt[j], want[j - 1], sp.prompt_logprobs)


# ---- the tiny random Llama: engine mechanics against transformers on the same checkpoint ----------
@pytest.fixture(scope="module")
def tiny_llm(tiny_model: Any, backend: str) -> LLM:
    return LLM(tiny_model, attention_backend=backend, **BASE)


# a chat template in the tiny tokenizer's words ("t5" is id 5): each message's content, then t3 as
# the generation prompt, and t4 after it when the caller sets enable_thinking false
WORD_TEMPLATE = ("{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}t3"
                 "{% if enable_thinking is defined and not enable_thinking %} t4{% endif %}{% endif %}")


def test_chat_template_options(tiny_llm: LLM) -> None:
    """vLLM's chat options on a template written here (the tiny tokenizer has none): the
    prompt ids are the template's words, `chat_template_kwargs` reach the template, a final
    assistant message is continued without a generation prompt, tools are the template's, and
    each reply is the one generate() gives those ids. Bad options raise naming the field."""
    conv = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7 t8"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cases = [({}, [5, 6, 7, 8, 3]),
             ({"chat_template_kwargs": {"enable_thinking": False}}, [5, 6, 7, 8, 3, 4]),
             ({"chat_template_kwargs": {"enable_thinking": True}}, [5, 6, 7, 8, 3]),
             ({"add_generation_prompt": False, "continue_final_message": True}, [5, 6, 7, 8])]
    for options, ids in cases:
        out = tiny_llm.chat(conv, greedy, use_tqdm=False, chat_template=WORD_TEMPLATE, **options)[0]
        assert out.prompt_token_ids == ids, options
        want = tiny_llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    for options, error, words in [
            ({"continue_final_message": True}, ValueError, "continue_final_message"),
            ({"add_generation_prompt": "yes"}, TypeError, "add_generation_prompt"),
            ({"chat_template_kwargs": ["enable_thinking"]}, TypeError, "chat_template_kwargs"),
            ({"chat_template_kwargs": {"messages": []}}, ValueError, "'messages'")]:
        with pytest.raises(error, match=words):
            tiny_llm.chat(conv, greedy, use_tqdm=False, chat_template=WORD_TEMPLATE, **options)
    with pytest.raises(ValueError, match="chat_template"):  # no template of its own
        tiny_llm.chat(conv, greedy, use_tqdm=False)
    listing = "{% for t in tools %}t{{ t.function.description }} {% endfor %}" + WORD_TEMPLATE
    tools = [{"type": "function", "function": {"name": "f", "description": "9"}}]
    out = tiny_llm.chat(conv, greedy, use_tqdm=False, chat_template=listing, tools=tools)[0]
    assert out.prompt_token_ids == [9, 5, 6, 7, 8, 3]  # the tools reach the template


# 16-token steps (prompts of up to 33 tokens take several steps) with stacked layers: the engine of
# test_every_layer_layout_matches_transformers[stacked], over the four prompts of CHUNKED_PROMPTS
# (three of them chunked; four sequences decode in the smallest token bucket, so its steps take
# two of them). (Switched layers, the CPU default, run BASE's 64-token steps, which chunk too:
# TINY_PROMPTS hold 107 tokens.)
CHUNKED_STACKED = {**BASE, "max_num_batched_tokens": 16, "layer_layout": "stacked"}
CHUNKED_PROMPTS = [2, 3, 4, 5]  # of TINY_PROMPTS: 33, 6, 32 and 19 tokens


@pytest.mark.parametrize("variant", ["no_prefix_cache", "one_at_a_time"])
def test_greedy_invariance(variant: str, tiny_llm: LLM, tiny_model: Any, backend: str,
                           tiny_greedy: list[list[int]]) -> None:
    """Greedy tokens are transformers' whatever the batching: prompts one at a time, or the batch
    without the prefix cache (no hit). (In 16-token chunks: test_every_layer_layout_matches_
    transformers[stacked]; the batch in BASE's steps with the cache: its [switched], and
    SmolLM2's test_greedy_batch_matches_transformers.)"""
    if variant == "one_at_a_time":
        got = [tiny_llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
               for p in TINY_PROMPTS[:3]]
        assert got == tiny_greedy[:3]
        return
    engine = LLM(tiny_model, attention_backend=backend, enable_prefix_caching=False, **BASE)
    assert token_ids(engine.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)) == tiny_greedy
    assert engine.get_stats()["prefix_cache_hits"] == 0


@pytest.mark.parametrize("layout", ["stacked", "switched"])
def test_every_layer_layout_matches_transformers(tiny_model: Any, backend: str, layout: str,
                                                 tiny_greedy: list[list[int]]) -> None:
    """Stacked layers (nn.scan over [L, ...] params) and switched ones (a scan over per-layer
    arrays, the CPU default) both give transformers' greedy tokens, each runner holding its own
    layout of the same weights. (Stacked: in CHUNKED_STACKED's 16-token steps, a chunked prefill
    of each CHUNKED_PROMPTS prompt over 16 tokens.)"""
    config = CHUNKED_STACKED if layout == "stacked" else {**BASE, "layer_layout": layout}
    which = CHUNKED_PROMPTS if layout == "stacked" else range(len(TINY_PROMPTS))
    llm = LLM(tiny_model, attention_backend=backend, **config)
    params = llm.engine.runner.params
    layers = tiny_model.config.num_hidden_layers
    stacked = tiny_model.params["layers"]["self_attn"]["q_proj"]["weight"]
    others = [k for k in tiny_model.params if k != "layers"]  # embeddings, final norm, LM head
    if layout == "stacked":
        assert sorted(params) == sorted(["layers", *others])
        assert params["layers"]["self_attn"]["q_proj"]["weight"] is stacked
    else:
        assert "layers" not in params and sorted(params) == sorted(
            [*others, *(f"layers_{i}" for i in range(layers))])
        for i in (0, layers - 1):
            q = params[f"layers_{i}"]["self_attn"]["q_proj"]["weight"]
            assert q.shape == stacked.shape[1:] and bool((q == stacked[i]).all())
    outs = llm.generate([TINY_PROMPTS[i] for i in which], GREEDY, use_tqdm=False)
    assert token_ids(outs) == [tiny_greedy[i] for i in which]


def test_prefix_cache_hits(tiny_llm: LLM, tiny_greedy: list[list[int]]) -> None:
    before = tiny_llm.get_stats()["prefix_cache_hits"]
    # TINY_PROMPTS[2] and [4] share a 27-token prefix (a full block): submitted together, one hits
    # the other's blocks once they are cached; [2] is also cached from an earlier test
    outs = tiny_llm.generate([TINY_PROMPTS[2], TINY_PROMPTS[4]], GREEDY, use_tqdm=False)
    assert token_ids(outs) == [tiny_greedy[2], tiny_greedy[4]]
    assert tiny_llm.get_stats()["prefix_cache_hits"] > before


def test_top_k_1_equals_greedy_and_seeds(tiny_llm: LLM, tiny_greedy: list[list[int]]) -> None:
    """top_k=1 at a temperature gives the greedy tokens; a seeded request samples the same tokens
    alone and in a batch beside other requests; unseeded requests get seeds of their own."""
    llm, prompts = tiny_llm, TINY_PROMPTS
    top1 = SamplingParams(temperature=0.9, top_k=1, max_tokens=MAX_TOKENS, seed=3)
    assert token_ids(llm.generate(prompts[:3], top1, use_tqdm=False)) == tiny_greedy[:3]
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, seed=99, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([prompts[0], prompts[1], prompts[5]], [other, seeded, GREEDY], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert batch[0].outputs[0].token_ids != alone
    assert batch[2].outputs[0].token_ids == tiny_greedy[5]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a, b = llm.generate([prompts[1], prompts[1]], unseeded, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids  # per-request derived seeds


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_abort_frees_blocks(tiny_model: Any, backend: str, async_scheduling: bool) -> None:
    """Aborted requests finish "abort" once; their deltas carry every token of the final output.
    With async_scheduling the third call's step is still in flight at the abort: its tokens are
    dropped, so two tokens were generated, against three without."""
    llm = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling, **BASE)
    rid = llm.add_request(TINY_PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=100))
    other = llm.add_request(TINY_PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=100))
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


def test_async_scheduling_is_sync_one_call_later(tiny_model: Any, backend: str, on_gpu: bool,
                                                    tiny_greedy: list[list[int]]) -> None:
    """async_scheduling=True returns, at call k + 1, exactly the deltas that async_scheduling=False
    returns at call k, for stop strings, stop tokens, lengths and seeded sampling. Each step is
    scheduled before the previous one's tokens are known: a request that a stop string or stop
    token ends is scheduled one step more, and that token is never reported; a length limit is
    foreseen.
    Short prompts are all prefilled in the first step, so the two runs schedule alike."""
    tokenizer = tiny_model.tokenizer
    full = tokenizer.decode(tiny_greedy[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    stop_token = tiny_greedy[1][4]
    cases = [(TINY_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[full.split()[2]])),
             (TINY_PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token])),
             (TINY_PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=1)),
             (TINY_PROMPTS[6], SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True))]
    assert LLM(tiny_model, attention_backend=backend, **BASE).engine.plan.async_scheduling == on_gpu  # auto
    runs, scheduled = {}, {}
    for async_scheduling in (False, True):
        llm = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling, **BASE)
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
    assert reasons == {"0": ("stop", full.split()[2]), "1": ("stop", stop_token),
                       "2": ("length", None), "3": ("length", None)}


def test_pallas_backend_matches_reference(tiny_model: Any, tiny_greedy: list[list[int]]) -> None:
    engine = LLM(tiny_model, attention_backend="pallas", **{**BASE, "max_num_batched_tokens": 16})
    out = engine.generate([TINY_PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].token_ids == tiny_greedy[0][:3]


def test_default_max_model_len_is_the_models_unless_the_cache_is_smaller(
        tiny_llama: str, on_gpu: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Without max_model_len the engine takes the model's limit (2048 here); a cache too small
    for one such request lowers it to the whole blocks the cache holds, said once at INFO level
    (the user asked for nothing), and the scheduler enforces the lowered length. A given
    max_model_len is never lowered: the cache grows to one full request, with one warning."""
    if on_gpu:
        pytest.skip("GPU sizing profiles device memory")
    from minivllm_jax.kv_cache_sizing import kv_cache_bytes_per_block

    kw = dict(max_num_seqs=8, max_num_batched_tokens=64)  # BASE's: its sampler programs
    caplog.set_level("INFO", logger="minivllm_jax")
    roomy = LLM(tiny_llama, **kw)
    assert roomy.engine.config.max_model_len == 2048
    assert not [r for r in caplog.records if "max_model_len" in r.getMessage()]
    per_block = kv_cache_bytes_per_block(roomy.engine.model_config, 16, roomy.engine.plan.kv_cache_dtype)
    caplog.clear()
    small = LLM(tiny_llama, cpu_kv_cache_bytes=8 * per_block, **kw)
    assert small.engine.runner.num_blocks == 9
    assert small.engine.config.max_model_len == small.engine.scheduler.config.max_model_len == 128
    said = [r for r in caplog.records if "max_model_len" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"] and not [r for r in caplog.records
                                                            if r.levelno >= 30]
    assert "max_model_len is 128" in said[0].getMessage() and "2048" in said[0].getMessage()
    with pytest.raises(ValueError, match="max_model_len"):
        small.generate([[5] * 128], SamplingParams(max_tokens=1), use_tqdm=False)
    # a prompt one token short of the limit gets one token of the 50 asked for (that token, sampled
    # from the prefill, ends it: no decode step to compile)
    out = small.generate([[5] * 127], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    caplog.clear()
    explicit = LLM(tiny_llama, max_model_len=2048, cpu_kv_cache_bytes=8 * per_block, **kw)
    assert explicit.engine.config.max_model_len == 2048
    assert explicit.engine.runner.num_blocks == 2048 // 16 + 1
    warned = [r for r in caplog.records if r.levelno >= 30]
    assert len(warned) == 1 and "max_model_len=2048" in warned[0].getMessage()


def _hf_penalized_greedy(model: Any, ids: list[int], n: int, presence: float, frequency: float,
                         eos: int) -> list[int]:
    """A greedy loop over transformers' logits minus OpenAI's penalties over the output tokens;
    transformers' own KV cache carries the sequence from one step to the next, as in generate."""
    import torch

    out: list[int] = []
    step, past = torch.tensor([ids]), None
    with torch.no_grad():
        for _ in range(n):
            result = model(step, past_key_values=past, use_cache=True)
            past, logits = result.past_key_values, result.logits[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0])
            logits = logits - frequency * counts - presence * (counts > 0)
            out.append(int(logits.argmax()))
            step = torch.tensor([[out[-1]]])
            if out[-1] == eos:
                break
    return out


def test_penalties_match_transformers(tiny_llm: LLM, tiny_hf: Any,
                                      tiny_greedy: list[list[int]]) -> None:
    """In one batch: repetition_penalty=1.3 greedy equals transformers' generate(repetition_penalty=
    1.3, do_sample=False); presence and frequency penalties equal a greedy loop over transformers'
    logits with OpenAI's formula; a request without penalties keeps its plain greedy tokens."""
    import torch

    llm, prompts = tiny_llm, TINY_PROMPTS
    eos = llm.engine.model_config.eos_token_ids[0]
    rep = [prompts[3], prompts[5]]
    with torch.no_grad():
        want_rep = []
        for p in rep:
            ids = torch.tensor([p])
            gen = tiny_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   repetition_penalty=1.3, max_new_tokens=MAX_TOKENS,
                                   eos_token_id=eos, pad_token_id=eos)
            want_rep.append(gen[0, ids.shape[1]:].tolist())
    pen = [(prompts[5], 1.0, 0.0), (prompts[0], 0.0, 1.5), (prompts[3], 0.5, 0.5)]
    want_pen = [_hf_penalized_greedy(tiny_hf, p, MAX_TOKENS, pres, freq, eos) for p, pres, freq in pen]
    params = ([SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3)] * 2
              + [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, presence_penalty=pres,
                                frequency_penalty=freq) for _, pres, freq in pen] + [GREEDY])
    outs = token_ids(llm.generate(rep + [p for p, _, _ in pen] + [prompts[1]], params, use_tqdm=False))
    assert outs[:2] == want_rep
    assert outs[2:5] == want_pen
    assert outs[5] == tiny_greedy[1]
    assert outs[:2] != [tiny_greedy[3], tiny_greedy[5]]  # the penalty changed something
    assert outs[2:5] != [tiny_greedy[5], tiny_greedy[0], tiny_greedy[3]]

"""Quantized engines: int8 weights (`quantization="int8"`), an fp8 KV cache (`kv_cache_dtype="fp8"`)
and both, on SmolLM2 and the tiny random Llama.

Accuracy: teacher-forced perplexity of held-out text (tests/data/heldout.txt, written for these
tests) through `prompt_logprobs`, within 3 % of the unquantized engine's, whose own perplexity is
transformers' float32 one; the first 16 greedy tokens of held-out prompts agree with the
unquantized engine's on most prompts. Features with both quantizations on, each against the same
quantized engine without the feature: prefix caching, preemption, speculative decoding (the tiny
Llama), a JSON-schema output (SmolLM2). Tensor parallelism with quantization: tests/parallel.

Truths: transformers float32; the unquantized engine (itself checked against transformers by the
engine tests); jsonschema.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_helpers import TINY_PROMPTS, no_leaks, token_ids
from minivllm_jax import LLM, SamplingParams, StructuredOutputsParams

HELDOUT = (Path(__file__).resolve().parents[1] / "data" / "heldout.txt").read_text()
VARIANTS = {"int8": dict(quantization="int8"), "fp8": dict(kv_cache_dtype="fp8"),
            "int8+fp8": dict(quantization="int8", kv_cache_dtype="fp8")}
# Few programs per engine: the held-out text's first 256 tokens are two 128-token steps, and
# the 16 prompts of 8 tokens one 128-token step, then 16-row decodes. Stacked layers: one scan
# body to compile (the CPU's switched layout compiles every layer). A small pool: XLA:CPU has no
# float8 scatter, so each layer's write converts the whole cache (docs/benchmarks.md,
# "Quantization").
ENGINE = dict(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=128, num_kv_blocks=40,
              layer_layout="stacked")
TEXT_TOKENS, PROMPT_TOKENS, MAX_TOKENS = 256, 8, 16
PROMPTS = ["The harbour master checked the tide tables and then",
           "A good loaf of bread needs flour, water, salt and a",
           "The train to the coast leaves at seven, so we should",
           "Write one short sentence about the moon and the stars:",
           "The three primary colours are red, blue and, in",
           "In the winter the river freezes and the children skate",
           "def add(a, b):\n    return a + b\n\ndef",
           "The museum opens at nine. Visitors should buy their",
           "Question: what is the boiling point of water at sea level? Answer:",
           "My grandmother kept bees in three wooden hives behind",
           "The recipe says to whisk the eggs before adding the",
           "List three animals that live in the ocean: 1.",
           "The old clock in the hall struck twelve, and the",
           "To change a flat tyre, first loosen the wheel nuts",
           "for i in range(10):\n    print(i *",
           "The committee will meet again next Tuesday to discuss"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], each given the ids before it."""
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    lps = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return math.exp(-float(np.mean(lps)))


def hf_perplexity(model: Any, ids: list[int]) -> float:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    lps = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return math.exp(-float(lps.mean()))


@pytest.fixture(scope="module")
def smollm2_engines(loaded_model: Any) -> dict[str, LLM]:
    """SmolLM2 in each variant: one float32 load, quantized as placed."""
    return {name: LLM(loaded_model, **ENGINE, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def heldout_ids(tokenizer: Any) -> list[int]:
    return tokenizer.encode(HELDOUT)[:TEXT_TOKENS]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(p)[:PROMPT_TOKENS] for p in PROMPTS]


def test_perplexity_within_3_percent(smollm2_engines: dict[str, LLM], heldout_ids: list[int],
                                     smollm2_hf: Any, loaded_model: Any, tiny_llama: str) -> None:
    """SmolLM2 on 256 tokens of held-out text: each variant's perplexity is within 3 % of the
    unquantized model's, transformers' float32 one (the unquantized engine's equals it: checked
    here on the tiny Llama, and on SmolLM2's logits by tests/models). The tiny random Llama too,
    on 256 random ids (near-uniform: its perplexity is close to its vocabulary, so this checks
    that nothing breaks rather than accuracy)."""
    truth = hf_perplexity(smollm2_hf, heldout_ids)
    ppl = {name: perplexity(llm, heldout_ids) for name, llm in smollm2_engines.items()}
    print(f"\nSmolLM2 perplexity of {len(heldout_ids)} held-out tokens: transformers float32 "
          f"{truth:.4f}, " + ", ".join(f"{k} {v:.4f} ({100 * (v / truth - 1):+.2f} %)"
                                       for k, v in ppl.items()))
    for name in VARIANTS:
        assert abs(ppl[name] / truth - 1) < 0.03, (name, ppl, truth)
    from engine_helpers import hf_float32

    ids = [int(t) for t in np.random.default_rng(1).integers(3, 256, size=TEXT_TOKENS)]
    tiny = {name: perplexity(LLM(tiny_llama, **ENGINE, **kw), ids)
            for name, kw in {"none": {}, **VARIANTS}.items()}
    want = hf_perplexity(hf_float32(tiny_llama), ids)
    print(f"tiny Llama perplexity of {TEXT_TOKENS} random ids: transformers {want:.3f}, "
          + ", ".join(f"{k} {v:.3f} ({100 * (v / tiny['none'] - 1):+.2f} %)" for k, v in tiny.items()))
    assert abs(tiny["none"] / want - 1) < 1e-4, (tiny, want)
    for name in VARIANTS:
        assert abs(tiny[name] / tiny["none"] - 1) < 0.03, (name, tiny)


def test_greedy_agreement_on_most_prompts(smollm2_engines: dict[str, LLM], smollm2_hf: Any,
                                          prompt_ids: list[list[int]]) -> None:
    """The first 16 greedy tokens of each held-out prompt equal the unquantized model's
    (transformers float32, which the unquantized engine matches: tests/engine) on more than half
    the prompts with int8 weights and with the fp8 cache; with both, on at least half (e4m3's
    3-bit mantissa and int8 weights together move a 135M model's near-ties: bfloat16 weights
    alone keep 12 of 16; the figures and the floor are in docs/benchmarks.md, "Quantization").
    Tokens agree up to the first difference for at least 8 of the 16 on average. No block
    leaks."""
    from engine_helpers import hf_greedy_ids

    want = [hf_greedy_ids(smollm2_hf, ids, MAX_TOKENS, eos=-1) for ids in prompt_ids]
    for name, llm in smollm2_engines.items():
        got = token_ids(llm.generate([{"prompt_token_ids": i} for i in prompt_ids], GREEDY,
                                     use_tqdm=False))
        same = sum(g == w for g, w in zip(got, want))
        prefix = [next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), MAX_TOKENS)
                  for g, w in zip(got, want)]
        print(f"\n{name}: {same} of {len(PROMPTS)} prompts agree on {MAX_TOKENS} greedy tokens; "
              f"agreeing prefix lengths {prefix}")
        least = len(PROMPTS) // 2 + (name != "int8+fp8")
        assert same >= least and np.mean(prefix) >= 8, (name, same, prefix)
        no_leaks(llm)


def test_json_schema_output_with_both(smollm2_engines: dict[str, LLM], tokenizer: Any) -> None:
    """int8 weights with an fp8 cache: a JSON-schema constrained answer parses and validates."""
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                                               "capital": {"type": "boolean"}},
              "required": ["city", "capital"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=32,
                            structured_outputs=StructuredOutputsParams(json=schema))
    ids = tokenizer.encode("Describe the capital of France as a JSON object:")[:PROMPT_TOKENS]
    out = smollm2_engines["int8+fp8"].generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop", completion
    jsonschema.validate(json.loads(completion.text), schema)


@pytest.fixture(scope="module")
def tiny_both(tiny_llama: str) -> dict[str, Any]:
    return dict(model=tiny_llama, **VARIANTS["int8+fp8"])


def test_prefix_caching_preemption_and_speculation_with_both(tiny_both: dict[str, Any]) -> None:
    """The tiny Llama with int8 weights and an fp8 cache, greedy: prefix caching (hits, once the
    shared prefix is cached), an 8-block cache (preemptions) and n-gram speculation (drafts
    verified) each give the tokens of the same quantized engine without them; no block leaks."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    base = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, layer_layout="stacked")
    want = token_ids(LLM(**tiny_both, **base, num_kv_blocks=64, enable_prefix_caching=False)
                     .generate(prompts, greedy, use_tqdm=False))
    cached = LLM(**tiny_both, **base, num_kv_blocks=64)
    cached.generate(prompts[:1], greedy, use_tqdm=False)
    assert token_ids(cached.generate(prompts, greedy, use_tqdm=False)) == want
    assert cached.get_stats()["prefix_cache_hits"] > 0
    small = LLM(**tiny_both, **base, num_kv_blocks=8)
    assert token_ids(small.generate(prompts, greedy, use_tqdm=False)) == want
    assert small.get_stats()["num_preemptions"] > 0
    spec = LLM(**tiny_both, **base, num_kv_blocks=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert token_ids(spec.generate(prompts, greedy, use_tqdm=False)) == want
    assert spec.get_stats()["spec_num_draft_tokens"] > 0
    for llm in (cached, small, spec):
        no_leaks(llm)


def test_repr_stats_and_metrics_name_them(smollm2_engines: dict[str, LLM]) -> None:
    """repr(LLM), get_stats() and the server's /metrics text show the quantization and the
    cache dtype (shown only when set); an 8-bit cache holds 1/4 of the float32 cache's bytes for the same blocks, and
    int8 weights are under 60 % of float32's (SmolLM2's tied embedding stays float32)."""
    from minivllm_jax.serving.metrics import ServerMetrics

    none, both = smollm2_engines["fp8"], smollm2_engines["int8+fp8"]
    assert "quantization=int8" in repr(both) and "kv_cache_dtype=float8_e4m3fn" in repr(both)
    assert "quantization" not in repr(none) and "kv_cache_dtype=float8_e4m3fn" in repr(none)
    s0, s1 = none.get_stats(), both.get_stats()
    assert (s0["quantization"], s0["kv_cache_dtype"]) == (None, "float8_e4m3fn")
    assert (s1["quantization"], s1["kv_cache_dtype"]) == ("int8", "float8_e4m3fn")
    cache_f32 = smollm2_engines["int8"].get_stats()
    assert cache_f32["kv_cache_dtype"] == "float32"
    assert s1["kv_cache_bytes"] * 4 == cache_f32["kv_cache_bytes"]
    assert s1["weight_bytes"] == cache_f32["weight_bytes"] < 0.6 * s0["weight_bytes"]
    from prometheus_client.parser import text_string_to_metric_families

    text = ServerMetrics("m").render(both.engine.make_stats()).decode()
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
               for family in text_string_to_metric_families(text) for x in family.samples}
    info = (("kv_cache_dtype", "float8_e4m3fn"), ("model_name", "m"), ("quantization", "int8"))
    assert samples[("minivllm:engine_config_info", info)] == 1
    for name in ("weight_bytes", "kv_cache_bytes"):
        assert samples[(f"minivllm:{name}", (("model_name", "m"),))] == s1[name]

"""Llama (llama3 RoPE scaling; linear scaling with q/k/v/o biases and tied embeddings), Qwen2
(qkv bias, tied), Qwen3 (q/k norm) and Mistral (sliding window shorter than the prompt): tiny random
checkpoints saved by transformers, loaded by our safetensors loader, run through the paged path and
compared with transformers' own forward pass and greedy generate."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from minivllm_jax.loader import load_model
from engine_helpers import hf_logits
from paged_harness import PagedRunner
from tiny_configs import FAMILIES

PROMPTS = [[5, 17, 99, 3, 42, 250, 8, 8, 61, 200, 13, 77, 31], [101, 7, 7, 64]]


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """``load(checkpoint, dtype)``: our load of a tiny checkpoint (converted, and its param-cache
    entry written, in a directory of the module's), once per checkpoint and dtype: the tests
    that run one family's weights in both layouts, or bfloat16 in both ways, share it."""
    cache_dir = str(tmp_path_factory.mktemp("param_cache"))
    made = {}

    def load(ckpt, dtype: str):
        if (ckpt, dtype) not in made:
            made[ckpt, dtype] = load_model(ckpt, dtype=dtype, cache_dir=cache_dir)
            assert not made[ckpt, dtype].from_cache
        return made[ckpt, dtype]

    return load


@pytest.fixture(scope="module")
def hf_truth():
    """``truth(model)``: transformers' logits of PROMPTS and its 12 greedy tokens after PROMPTS[0],
    once per model (both layouts of a family check against one run)."""
    made = {}

    def truth(model) -> tuple[list[np.ndarray], list[int]]:
        if id(model) not in made:
            made[id(model)] = ([hf_logits(model, ids) for ids in PROMPTS],
                               _hf_greedy(model, PROMPTS[0], 12))
        return made[id(model)]

    return truth


@pytest.mark.parametrize("feature_major, layout", [(False, "stacked"), (True, "switched")],
                         ids=["x@W^T-stacked", "W@x^T-switched"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_match_transformers(family: str, feature_major: bool, layout: str,
                                              tiny_checkpoint, loaded, hf_truth) -> None:
    """Both forms of ``project`` and both scanned layer layouts give transformers' logits and
    greedy tokens: token-major stacked (as on accelerators), and feature-major switched (as the
    runner picks for small float32 batches on one CPU device)."""
    shard = "20KB" if family == "qwen3" else None  # one checkpoint sharded with an index file
    ckpt, hf = tiny_checkpoint(family, shard)
    if shard:
        assert (ckpt / "model.safetensors.index.json").is_file()
    model = loaded(ckpt, "float32")
    cfg = model.config
    assert cfg.architecture == hf.config.architectures[0]
    if family == "mistral":
        assert cfg.sliding_window == 7 < len(PROMPTS[0])
    ref_logits, ref_greedy = hf_truth(hf)
    runner = PagedRunner(cfg, model.params, block_size=4, feature_major_rows=16 * feature_major,
                         layer_layout=layout)
    for seq, (ids, ref) in enumerate(zip(PROMPTS, ref_logits)):
        ours = runner.run([(seq, ids)], pad_to=16)[0]
        np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)
    # same runner (one compiled shape), a fresh sequence: prefill, then one token per step
    assert runner.greedy(len(PROMPTS), PROMPTS[0], 12, pad_to=16) == ref_greedy


def test_bfloat16_load_tracks_float32(tiny_checkpoint, loaded, hf_truth) -> None:
    ckpt, hf = tiny_checkpoint("llama3")
    model = loaded(ckpt, "bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.params))
    ours = PagedRunner(model.config, model.params, cache_dtype=jnp.bfloat16).run([(0, PROMPTS[0])])[0]
    ref = hf_truth(hf)[0][0]
    assert ours.dtype == np.float32
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() < 0.1 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


def test_bfloat16_engine_keeps_a_float32_kv_cache_on_cpu(tiny_checkpoint, loaded, hf_truth) -> None:
    """A 16-bit model's KV cache is float32 on the CPU platform (plan.kv_cache_dtype: XLA:CPU
    would convert a whole 16-bit cache around every scatter and gather) and the model's dtype on
    accelerators; its layers are switched on the CPU (plan.make_plan). The bfloat16
    engine then gives the paged harness's greedy tokens (same weights in the same layout, a cache
    of that dtype; the harness is checked against transformers above), and tracks transformers'
    float32 tokens. The layout must match: bfloat16 rounding follows XLA's fusion boundaries,
    which differ between layouts, and a random tiny model's logits are close enough to flip."""
    from minivllm_jax import LLM, SamplingParams

    ckpt, hf = tiny_checkpoint("llama3")
    model = loaded(ckpt, "bfloat16")
    llm = LLM(model, attention_backend="xla", max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=32)
    cache = llm.engine.runner.kv_cache
    cpu = jax.devices()[0].platform == "cpu"
    assert cache.dtype == (jnp.float32 if cpu else jnp.bfloat16)
    layout = llm.engine.plan.model.layer_layout
    assert layout == ("switched" if cpu else "stacked")
    assert ("layers_0" in llm.engine.runner.params) is cpu
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    runner = PagedRunner(model.config, model.params, cache_dtype=cache.dtype,
                         layer_layout=layout)
    for seq, (ids, out) in enumerate(zip(PROMPTS, outs)):
        assert out.outputs[0].token_ids == runner.greedy(seq, ids, 8, pad_to=16)
    hf_tokens = [_hf_greedy(hf, ids, 8) for ids in PROMPTS]
    agree = np.mean([a == b for out, ref in zip(outs, hf_tokens) for a, b in zip(out.outputs[0].token_ids, ref)])
    assert agree >= 0.75

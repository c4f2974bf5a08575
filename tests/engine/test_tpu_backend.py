"""The whole engine through the TPU kernel (attention_backend="pallas-tpu", Pallas' TPU interpret
mode on this CPU) on the embedded SmolLM2: greedy tokens against transformers'.

The interpreter simulates every DMA and semaphore, so a step costs seconds: few prompts, few tokens.
Not here: tensor parallelism through it. With several virtual CPU devices jax 0.10.2's TPU
interpreter hangs at random (docs/benchmarks.md, TPU).
"""
from __future__ import annotations

from typing import Any

import pytest

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 4
ENGINE = dict(attention_backend="pallas-tpu", max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=32, num_kv_blocks=16)


def _generate(llm: Any) -> list[list[int]]:
    from minivllm_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def hf_greedy(smollm2_hf: Any, tokenizer: Any) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            gen = smollm2_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


def test_engine_on_tpu_kernel_matches_transformers(loaded_model: Any,
                                                   hf_greedy: list[list[int]]) -> None:
    from minivllm_jax import LLM

    llm = LLM(loaded_model, **ENGINE)
    assert llm.engine.runner.plan.model.attention_backend == "pallas-tpu"
    assert _generate(llm) == hf_greedy
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1   # all but the null block

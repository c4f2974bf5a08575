"""The whole engine through the TPU kernel (attention_backend="pallas-tpu", Pallas' TPU interpret
mode on this CPU) on the embedded SmolLM2: greedy tokens against transformers', on one device and
under tensor parallelism over three virtual CPU devices (shard_map: one kv head per device).

The interpreter simulates every DMA and semaphore, so a step costs seconds: few prompts, few tokens.
This file run as a script is the tensor-parallel worker (one JSON line on stdout).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def test_tensor_parallel_on_tpu_kernel_matches_transformers(smollm2_path: str,
                                                            hf_greedy: list[list[int]]) -> None:
    """PJRT_NPROC: the interpreter's device threads wait on each other at barriers while its
    callbacks need a thread of the CPU client's pool (as many threads as cores, 2 on CI) to copy
    their operands; more threads than devices, or the run deadlocks."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PJRT_NPROC": "8",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    proc = subprocess.run([sys.executable, __file__, smollm2_path], capture_output=True,
                          text=True, env=env, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert result["devices"] == 3 and result["backend"] == "pallas-tpu"
    assert result["tokens"] == hf_greedy
    assert result["free_blocks"] == result["num_blocks"] - 1


def _worker(path: str) -> None:
    import jax

    from minivllm_jax import LLM

    llm = LLM(path, dtype="float32", tensor_parallel_size=3, **ENGINE)
    tokens = _generate(llm)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    print(json.dumps({"devices": jax.device_count(), "tokens": tokens,
                      "backend": llm.engine.runner.plan.model.attention_backend,
                      "free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_blocks}))


if __name__ == "__main__":
    _worker(sys.argv[1])

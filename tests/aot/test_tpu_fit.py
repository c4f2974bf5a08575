"""Fit on a TPU, checked by libtpu's compiler without a TPU (`aot.compile_for_topology`): an 8B
model with int8 weights and an fp8 cache on one 16 GB v5e chip at an 8,192-token context, and a
32k-context model's defaults, whose block tables once overflowed the kernel's scalar memory.

Each compile sizes the cache as the engine would on that chip (the largest step's two programs
compiled for their peak bytes) and then compiles one decode forward (`only=`), not all 27
programs (216 s for the 8B model on the 2-core CI machine: docs/benchmarks.md, "Quantization").

Truths: the weight and cache bytes computed here from config.json alone; the chip's HBM.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import bench_common  # scripts/: the published models' config.json fields
from minivllm_jax.config import EngineConfig

V5E = "v5e:2x2"
# Qwen/Qwen2.5-0.5B's config.json: 14 q / 2 kv heads of 64, 32k context, tied embeddings
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
              "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
              "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16"}


def _model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_llama_8b_int8_fp8_fits_one_v5e_chip(tmp_path: Path, tpu_topology) -> None:
    """Llama-3.1-8B, int8 weights and an fp8 cache, TP=1 on one v5e chip, max_model_len 8192:
    the report's weight bytes are the int8 linears (1 byte a weight, a float32 scale a row) and
    the bf16 embedding; the cache holds at least one full request, in fp8 (8 kv heads: no
    padding), and weights + cache fit the chip; the decode forward compiles."""
    from minivllm_jax import aot

    tpu_topology(V5E)
    cfg = {**bench_common.build_hf_config("llama-3.1-8b").to_dict(), "torch_dtype": "bfloat16"}
    config = EngineConfig(max_model_len=8192, quantization="int8", kv_cache_dtype="fp8")
    report = aot.compile_for_topology(_model_dir(tmp_path, cfg), V5E, config,
                                      only=lambda key: key.num_sampled == 0 and key.num_tokens == 8)
    e, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], 32
    q, kv = cfg["num_attention_heads"] * 128, cfg["num_key_value_heads"] * 128
    rows = layers * (q + 2 * kv + 2 * e + 2 * i) + v           # every quantized weight's rows
    linear = layers * (2 * q * e + 2 * kv * e + 3 * e * i) + v * e  # int8 weights, the head's
    floats = 2 * (v * e + (2 * layers + 1) * e)                # the embedding and norms, bf16
    assert report["weight_bytes_per_device"] == linear + 4 * rows + floats
    assert report["quantization"] == "int8" and report["kv_cache_dtype"] == "float8_e4m3fn"
    per_block = layers * 16 * 2 * 8 * 128                      # one byte a K/V value
    assert report["kv_cache_bytes_per_device"] == report["num_kv_blocks"] * per_block
    assert report["num_kv_blocks"] - 1 >= 8192 // 16
    assert report["weight_bytes_per_device"] + report["kv_cache_bytes_per_device"] \
        < report["hbm_bytes_per_device"]
    assert report["weight_bytes_per_device"] < 8.6e9 < 2 * linear  # bf16 would take 16 GB
    (forward,) = report["programs"]
    assert forward["ok"] and forward["num_tokens"] == 8, forward
    assert forward["temp_bytes"] < report["kv_cache_bytes_per_device"] / 10, forward


def test_32k_context_defaults_compile(tmp_path: Path, tpu_topology) -> None:
    """Qwen2.5-0.5B's defaults on one v5e chip (max_model_len 32,768, 128 sequences, 2,048-token
    steps): the block table (128 x 2,048 int32, 1 MiB) once filled the kernel's SMEM and every
    forward failed after minutes; now the engine's decode forward compiles over the full table (a
    given cache of two full requests: the sizing is test_llama_8b_int8_fp8_fits_one_v5e_chip's;
    the kernel at 2,048 rows of this shape: tests/kernels/test_tpu_attention.py). A shape past
    the kernel's SMEM budget is refused at once, naming the options."""
    from minivllm_jax import aot

    tpu_topology(V5E)
    model = _model_dir(tmp_path, QWEN25_05B)
    report = aot.compile_for_topology(
        model, V5E, EngineConfig(num_kv_blocks=2 * 2048 + 1),
        only=lambda key: key.num_sampled == 0 and key.num_tokens == 8)
    assert report["max_model_len"] == 32768
    assert [p["num_tokens"] for p in report["programs"]] == [8]
    assert all(p["ok"] for p in report["programs"]), report["programs"]
    too_many = EngineConfig(max_num_batched_tokens=200_000, max_num_seqs=256)
    with pytest.raises(ValueError, match="SMEM.*max_num_batched_tokens"):
        aot.compile_for_topology(model, V5E, too_many)

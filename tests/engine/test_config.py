"""EngineConfig validation: each bad value raises, naming the field; defaults resolve per model."""
from __future__ import annotations

import pytest

from minivllm_jax.config import EngineConfig


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_seqs=2.5), TypeError, "max_num_seqs"),
    (dict(block_size=12), ValueError, "block_size"),
    (dict(num_kv_blocks=1), ValueError, "num_kv_blocks"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=0.0), ValueError, "gpu_memory_utilization"),
    (dict(attention_backend="triton"), ValueError, "attention_backend"),
    (dict(max_num_seqs=32, max_num_batched_tokens=16), ValueError, "max_num_batched_tokens"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=512), ValueError,
     "max_num_batched_tokens"),
    (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(dtype=None), TypeError, "dtype"),
    (dict(scan_layers="no"), TypeError, "scan_layers"),
    (dict(async_scheduling="yes"), TypeError, "async_scheduling"),
    (dict(scan_layers=False, tensor_parallel_size=2), ValueError, "scan_layers"),
])
def test_invalid_values_name_the_field(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field):
        EngineConfig(**kwargs)


def test_resolve_defaults() -> None:
    cfg = EngineConfig(max_num_seqs=4).resolve(max_position_embeddings=1000)
    assert cfg.max_model_len == 1000 and cfg.max_num_batched_tokens >= 4
    assert cfg.max_blocks_per_seq == -(-1000 // 16)
    no_chunk = EngineConfig(enable_chunked_prefill=False, max_model_len=3000).resolve(8192)
    assert no_chunk.max_num_batched_tokens >= 3000
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=4096).resolve(max_position_embeddings=2048)


@pytest.mark.parametrize("asked,dtype,platform,tp,stacked", [
    (None, "float32", "cpu", 1, True), (None, "bfloat16", "cpu", 1, False),
    (None, "float16", "cpu", 1, False), (None, "bfloat16", "cpu", 2, True),
    (None, "bfloat16", "gpu", 1, True), (True, "bfloat16", "cpu", 1, True),
    (False, "float32", "gpu", 1, False),
])
def test_scan_layers_auto(asked, dtype, platform, tp, stacked) -> None:
    """scan_layers=None stacks the layers except for a 16-bit model on one CPU device; an
    explicit bool is kept."""
    import jax.numpy as jnp

    from minivllm_jax.runner import resolve_scan_layers

    assert resolve_scan_layers(asked, jnp.dtype(dtype), platform, tp) is stacked

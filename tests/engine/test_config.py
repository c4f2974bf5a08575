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
    (dict(layer_layout=False), TypeError, "layer_layout"),
    (dict(layer_layout="scan"), ValueError, "layer_layout"),
    (dict(async_scheduling="yes"), TypeError, "async_scheduling"),
    (dict(tune_cpu_malloc=None), TypeError, "tune_cpu_malloc"),
    (dict(data_parallel_size=0), ValueError, "data_parallel_size"),
    (dict(data_parallel_size=True), TypeError, "data_parallel_size"),
    (dict(data_parallel_size=2, tensor_parallel_size=2), ValueError, "data_parallel_size"),
    (dict(layer_layout="switched", tensor_parallel_size=2), ValueError, "layer_layout"),
    (dict(layer_layout="unrolled", tensor_parallel_size=2), ValueError, "layer_layout"),
    (dict(scheduling_policy="lifo"), ValueError, "scheduling_policy"),
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


@pytest.mark.parametrize("asked,platform,tp,layout", [
    (None, "cpu", 1, "switched"), (None, "cpu", 2, "stacked"), (None, "gpu", 1, "stacked"),
    (None, "tpu", 1, "stacked"), ("stacked", "cpu", 1, "stacked"), ("unrolled", "gpu", 1, "unrolled"),
])
def test_layer_layout_auto(asked, platform, tp, layout) -> None:
    """layer_layout=None switches the layers on one CPU device and stacks them elsewhere; an
    explicit layout is kept."""
    from minivllm_jax.runner import resolve_layer_layout

    assert resolve_layer_layout(asked, platform, tp) == layout

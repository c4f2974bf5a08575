"""KV-cache sizing and allocation: how many blocks the cache holds, and the array itself.

The cache is one array ``[num_hidden_layers, *one layer's cache]`` in the attention backend's
layout (`backends.AttentionBackend.cache_layout`): ``[num_blocks, block_size, 2 * KVH, head_dim]``
(K of kv head h at combined head 2h, V at 2h+1; docs/API.md §2), or the TPU kernels' packed
layout (`pallas_kernels.tpu_layout`); split on its head axis under tensor parallelism. Block 0 is the null block. Sizes are per device: each of the
``tensor_parallel_size`` devices holds 1/N of every block.
"""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.typing import DTypeLike

import pallas_kernels
from minivllm_jax.parallel import sharding
from minivllm_jax.backends import COMBINED_HEADS, TPU_PACKED
from minivllm_jax.config import EngineConfig
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.plan import ExecutionPlan

logger = logging.getLogger(__name__)


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int, dtype: DTypeLike,
                   layout: str = COMBINED_HEADS, num_shards: int = 1) -> tuple[int, ...]:
    """The stacked cache's shape: ``[num_hidden_layers, *one layer's cache in `layout`]``, split
    on its head axis over `num_shards` devices (the TPU layout pads each device's heads)."""
    kvh, d = config.num_key_value_heads, config.head_dim
    if layout == TPU_PACKED:
        layer = pallas_kernels.tpu_kv_cache_shape(num_blocks, block_size, kvh, d, dtype,
                                                  num_shards)
    else:
        layer = (num_blocks, block_size, 2 * kvh, d)
    return (config.num_hidden_layers, *layer)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: DTypeLike,
                             layout: str = COMBINED_HEADS, num_shards: int = 1) -> int:
    """Bytes one block takes across all layers and devices (K and V, and the layout's padding)."""
    shape = kv_cache_shape(config, 1, block_size, dtype, layout, num_shards)
    return math.prod(shape) * np.dtype(dtype).itemsize


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The stacked cache's placement on a tensor-parallel mesh, in any layout: split on its head
    axis (`sharding.kv_cache_spec`)."""
    return NamedSharding(mesh, sharding.kv_cache_spec())


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: DTypeLike,
                  mesh: Mesh | None = None, layout: str = COMBINED_HEADS) -> jax.Array:
    """Zeros of the cache's shape; under a `mesh`, created directly in shards (never whole on
    one device)."""
    shape = kv_cache_shape(config, num_blocks, block_size, dtype, layout,
                           1 if mesh is None else mesh.size)
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=kv_cache_sharding(mesh))()


def max_num_blocks(plan: ExecutionPlan, bytes_per_block: int) -> int:
    """The most blocks the plan's backend addresses: below 2**31 cache elements for a kernel
    with int32 offsets into the flat all-layer cache; no bound otherwise."""
    if not plan.backend.int32_offsets:
        return np.iinfo(np.int64).max
    return (2**31 - 1) // (bytes_per_block // np.dtype(plan.kv_cache_dtype).itemsize)


def choose_num_blocks(config: EngineConfig, plan: ExecutionPlan, bytes_per_block: int, *,
                      bytes_limit: int | None = None, peak_bytes: int | None = None,
                      reserved_bytes: int = 0, fit_length: bool = False) -> int:
    """The number of blocks (the null block included), per device: a stage with inputs and an
    output, whatever measured them.

    A given ``num_kv_blocks`` is checked against the backend's bound. With a byte budget
    (``plan.kv_cache_bytes``, the CPU's; also a device that reports no ``bytes_limit``), room
    for ``max_num_seqs`` full-length requests, capped by the budget but never below one
    full-length request. Otherwise ``peak_bytes`` is the device's peak use by a max-size step on
    a cache of one request's blocks (``probe_blocks``), weights included; what
    ``gpu_memory_utilization`` of ``bytes_limit`` leaves after that peak and ``reserved_bytes``
    (buffers made later, e.g. the penalties' token counts) becomes blocks, at least one
    full-length request's. With ``fit_length`` (a default max_model_len, which
    `EngineConfig.fit_kv_cache` then lowers to the cache) neither floor applies: one block."""
    bound = max_num_blocks(plan, bytes_per_block)
    if config.num_kv_blocks is not None:
        if config.num_kv_blocks > bound:
            raise ValueError(f"num_kv_blocks={config.num_kv_blocks} is too large for the "
                             f"{plan.backend.name} attention backend (int32 cache offsets): at "
                             f"most {bound} for this model and block_size")
        return config.num_kv_blocks
    budget = plan.kv_cache_bytes
    if budget is None and bytes_limit is None:  # a device that reports no memory limit
        budget = config.cpu_kv_cache_bytes
    if budget is not None:
        wanted = config.max_num_seqs * config.max_blocks_per_seq
        floor = 1 if fit_length else config.max_blocks_per_seq
        if budget // bytes_per_block < floor:
            logger.warning("max_model_len=%d needs %d KV blocks, more than the cache budget of %d "
                           "bytes holds (%d): the cache takes %d blocks, one full-length request",
                           config.max_model_len, floor, budget, budget // bytes_per_block, floor)
        return min(wanted, max(budget // bytes_per_block, floor)) + 1
    if peak_bytes is None:
        raise ValueError("sizing the KV cache from device memory needs the peak bytes of a "
                         "max-size step (peak_bytes)")
    free = int(bytes_limit * config.gpu_memory_utilization) - peak_bytes - reserved_bytes
    num_blocks = min(free // bytes_per_block + probe_blocks(config), bound)
    if num_blocks - 1 < (1 if fit_length else config.max_blocks_per_seq):
        raise ValueError(f"not enough device memory for one {config.max_model_len}-token request: "
                         "raise gpu_memory_utilization or lower max_model_len")
    return int(num_blocks)


def probe_blocks(config: EngineConfig) -> int:
    """The cache size (null block included) a max-size step is profiled on: one full request."""
    return config.max_blocks_per_seq + 1


def needs_peak(config: EngineConfig, plan: ExecutionPlan, bytes_limit: int | None) -> bool:
    """Whether `choose_num_blocks` needs a measured peak: no given block count, no byte budget,
    and a device that reports its memory limit."""
    return config.num_kv_blocks is None and plan.kv_cache_bytes is None and bytes_limit is not None

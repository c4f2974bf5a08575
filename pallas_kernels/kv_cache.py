"""Writing a step's new K/V into the paged cache, and the one place the slot formula lives.

Cache layout: ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]``; combined head ``2h`` is K
and ``2h + 1`` is V of kv head ``h``. Slot ``block_id * block_size + offset`` addresses one token
row of the flattened ``[num_blocks * block_size, ...]`` view.

A cache of a quantized dtype (``common.QUANTIZED_KV_DTYPES``: float8_e4m3fn, scale 1) stores each
K/V value as its round-to-nearest cast, saturated: a value beyond the dtype's finite range
(+-448) is stored as +-448 (a plain cast would give NaN: e4m3fn has no infinity), NaN stays NaN.
"""
from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels.common import FP8_BYTES, QUANTIZED_KV_DTYPES

IntLike = TypeVar("IntLike")


def slot_of(block_id: IntLike, offset: IntLike, block_size: int) -> IntLike:
    """Flat cache slot of token ``offset`` within block ``block_id`` (ints or int arrays)."""
    return block_id * block_size + offset


def write_kv_cache(kv_cache: jax.Array, k: jax.Array, v: jax.Array,
                   slot_mapping: jax.Array, block_offset: jax.Array | int = 0) -> jax.Array:
    """Return ``kv_cache`` with ``k[t], v[t]`` written at slot ``slot_mapping[t]`` of the blocks
    from ``block_offset`` on (an int32 scalar, the kernels' own: slot ``s`` is
    ``slot_of(block_offset, s, block_size)`` of the whole cache).

    ``k, v``: ``[num_tokens, num_kv_heads, head_dim]`` (cast to the cache dtype by
    `quantize_kv`: saturating for an fp8 cache);
    ``slot_mapping``: int ``[num_tokens]``. Negative slots (padding tokens) are skipped: they are
    redirected past the end and dropped, so nothing else is touched. A pure ``.at[].set`` so that a
    donated cache is updated in place under jit. Slots must be distinct among non-negative entries.
    """
    validate_new_kv(kv_cache, k, v, slot_mapping)
    num_blocks, block_size, combined, head_dim = kv_cache.shape
    num_slots = num_blocks * block_size
    kv = quantize_kv(jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, head_dim),
                     kv_cache.dtype)
    slots = jnp.where(slot_mapping >= 0, slot_of(block_offset, slot_mapping, block_size), num_slots)
    flat = kv_cache.reshape(num_slots, combined, head_dim)
    flat = flat.at[slots].set(kv, mode="drop", unique_indices=False)
    return flat.reshape(kv_cache.shape)


def quantize_kv(x: jax.Array, dtype: DTypeLike) -> jax.Array:
    """``x`` cast to the cache dtype ``dtype``: for a quantized dtype (QUANTIZED_KV_DTYPES),
    clipped to its finite range first, so that out-of-range values saturate instead of turning
    NaN; for any other, a plain cast."""
    dtype = jnp.dtype(dtype)
    if dtype == FP8_BYTES:  # the bytes of float8_e4m3fn values
        return jax.lax.bitcast_convert_type(quantize_kv(x, jnp.float8_e4m3fn), FP8_BYTES)
    if dtype in QUANTIZED_KV_DTYPES and x.dtype != dtype:
        bound = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -bound, bound)
    return x.astype(dtype)


def validate_new_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array,
                    slot_mapping: jax.Array) -> None:
    """Raise ValueError/TypeError unless ``k, v [num_tokens, KVH, D]`` and ``slot_mapping
    [num_tokens]`` (integer) fit ``kv_cache [num_blocks, block_size, 2 * KVH, D]``."""
    if kv_cache.ndim != 4:
        raise ValueError("kv_cache must be [num_blocks, block_size, 2 * num_kv_heads, head_dim], "
                         f"got shape {kv_cache.shape}")
    _, _, combined, head_dim = kv_cache.shape
    if combined % 2:
        raise ValueError(f"kv_cache axis 2 holds 2 * num_kv_heads; got odd {combined}")
    expected = (combined // 2, head_dim)
    if k.ndim != 3 or k.shape[1:] != expected:
        raise ValueError(f"k must be [num_tokens, {expected[0]}, {expected[1]}], got {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {v.shape} must equal k shape {k.shape}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens={k.shape[0]}], got {slot_mapping.shape}")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise TypeError(f"slot_mapping must be an integer array, got {slot_mapping.dtype}")

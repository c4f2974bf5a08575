"""The TPU kernels' KV-cache layout (docs/API.md §2a), and its conversions to and from
section 2's ``[num_blocks, block_size, 2 * KVH, D]``.

One layer's cache is ``[num_blocks, block_size, 2 * KVH // packing, packing, round_up(D, 128)]``
with ``packing = 4 // itemsize`` (2 for 16-bit types, 1 for float32): combined head ``c = 2h``
(K of kv head h) and ``2h + 1`` (its V) sit at ``[..., c // packing, c % packing, :]``, so for a
16-bit cache K and V of one head share every 32-bit word (K in the low half). Why this shape:
a TPU array is tiled over its two minor dimensions, here ``(packing, D)``, one 32-bit sublane of
128 lanes, so
- a token's K/V (``cache[page, offset]``) and a page (``cache[page]``) are whole tiles: the
  kernel moves either with one tile-aligned DMA, for any number of heads and any offset;
- no head count or head_dim 64 forces padded tiles that the compiler would relayout (copy);
- lanes past D (head_dim 64: the upper 64) hold zeros.
The block axis and the leading axes merge freely (a stacked ``[L, num_blocks, ...]`` cache is
``[L * num_blocks, ...]`` at no cost), and tensor parallelism splits the ``2 * KVH // packing``
axis (each device holds whole heads: KVH is a multiple of the device count).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

LANES = 128


def kv_packing(dtype: DTypeLike) -> int:
    """Values of ``dtype`` per 32-bit word: 1 (float32) or 2 (bfloat16, float16)."""
    itemsize = np.dtype(dtype).itemsize
    if itemsize not in (2, 4):
        raise ValueError(f"the TPU KV-cache layout takes 16- or 32-bit types, got {np.dtype(dtype)}")
    return 4 // itemsize


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to whole 128-lane vregs."""
    return -(-head_dim // LANES) * LANES


def tpu_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: DTypeLike) -> tuple[int, int, int, int, int]:
    """One layer's cache shape in the TPU layout (see the module docstring)."""
    packing = kv_packing(dtype)
    return (num_blocks, block_size, 2 * num_kv_heads // packing, packing, padded_head_dim(head_dim))


def to_tpu_kv_cache(kv_cache: jax.Array) -> jax.Array:
    """Section 2's ``[..., num_blocks, block_size, 2 * KVH, D]`` in the TPU layout (lanes past D
    zero). For tests and converters: a step never converts."""
    *lead, combined, d = kv_cache.shape
    packing = kv_packing(kv_cache.dtype)
    out = jnp.pad(kv_cache, [(0, 0)] * (kv_cache.ndim - 1) + [(0, padded_head_dim(d) - d)])
    return out.reshape(*lead, combined // packing, packing, out.shape[-1])


def from_tpu_kv_cache(tpu_cache: jax.Array, num_kv_heads: int, head_dim: int) -> jax.Array:
    """The TPU layout back in section 2's ``[..., num_blocks, block_size, 2 * KVH, D]``."""
    *lead, groups, packing, _ = tpu_cache.shape
    if groups * packing != 2 * num_kv_heads:
        raise ValueError(f"a cache of {groups * packing} combined heads does not hold "
                         f"{num_kv_heads} kv heads")
    return tpu_cache.reshape(*lead, groups * packing, tpu_cache.shape[-1])[..., :head_dim]

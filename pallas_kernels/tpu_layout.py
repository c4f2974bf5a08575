"""The TPU kernels' KV-cache layout (docs/API.md §2a), and its conversions to and from
section 2's ``[num_blocks, block_size, 2 * KVH, D]``.

One layer's cache is ``[num_blocks, block_size, groups, packing, round_up(D, 128)]`` with
``packing = 4 // itemsize`` (4 for 8-bit types, 2 for 16-bit types, 1 for float32) and
``groups = num_shards * ceil(2 * KVH / num_shards / packing)`` (`kv_head_groups`). The ``2 * KVH``
combined heads (``c = 2h``: K of kv head h; ``2h + 1``: its V) are cut into ``num_shards``
consecutive runs of ``C = 2 * KVH / num_shards`` (one per tensor-parallel device: every device
holds whole heads); run ``s``'s combined head ``l`` sits at
``[..., s * G + l // packing, l % packing, :]`` with ``G = ceil(C / packing)``, and each run's
``G * packing - C`` padding heads hold zeros. With one shard this is combined head ``c`` at
``[..., c // packing, c % packing, :]``; a 32-bit word then holds K and V of one head (16-bit: K
in the low half) or, for 8-bit types, ``K_h, V_h, K_{h+1}, V_{h+1}`` in its bytes, low byte first.
Padding heads occur only for 8-bit types and an odd ``C / 2`` (e.g. KVH 3: 6 combined heads in 2
groups of 4; KVH 3 over 3 shards: 3 groups, each [K, V, 0, 0]).
Why this shape: a TPU array is tiled over its two minor dimensions, here ``(packing, D)``, one
32-bit sublane of 128 lanes, so
- a token's K/V (``cache[page, offset]``) and a page (``cache[page]``) are whole tiles: the
  kernel moves either with one tile-aligned DMA, for any number of heads and any offset;
- no head count or head_dim 64 forces padded tiles that the compiler would relayout (copy);
- lanes past D (head_dim 64: the upper 64) hold zeros.
The block axis and the leading axes merge freely (a stacked ``[L, num_blocks, ...]`` cache is
``[L * num_blocks, ...]`` at no cost), and tensor parallelism splits the ``groups`` axis into its
``num_shards`` runs (KVH a multiple of the shard count): each device's share is the one-shard
layout of its ``KVH / num_shards`` heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

LANES = 128


def kv_packing(dtype: DTypeLike) -> int:
    """Values of ``dtype`` per 32-bit word: 1 (float32), 2 (bfloat16, float16) or 4 (8-bit)."""
    itemsize = np.dtype(dtype).itemsize
    if itemsize not in (1, 2, 4):
        raise ValueError(f"the TPU KV-cache layout takes 8-, 16- or 32-bit types, got "
                         f"{np.dtype(dtype)}")
    return 4 // itemsize


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to whole 128-lane vregs."""
    return -(-head_dim // LANES) * LANES


def _shard_heads(num_kv_heads: int, num_shards: int) -> int:
    """Combined heads per shard; ValueError unless the shards split the kv heads evenly."""
    if num_shards < 1 or num_kv_heads < 1 or num_kv_heads % num_shards:
        raise ValueError(f"num_shards ({num_shards}) must divide num_kv_heads ({num_kv_heads}): "
                         "each device holds whole kv heads")
    return 2 * num_kv_heads // num_shards


def kv_head_groups(num_kv_heads: int, dtype: DTypeLike, num_shards: int = 1) -> int:
    """The layout's ``groups`` axis: ``num_shards`` runs of ``ceil(2 * KVH / num_shards /
    packing)`` word rows (see the module docstring)."""
    packing = kv_packing(dtype)
    return num_shards * -(-_shard_heads(num_kv_heads, num_shards) // packing)


def tpu_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: DTypeLike, num_shards: int = 1) -> tuple[int, int, int, int, int]:
    """One layer's cache shape in the TPU layout (see the module docstring); ``num_shards``: the
    devices that split its heads (tensor_parallel_size), each holding a padded run."""
    return (num_blocks, block_size, kv_head_groups(num_kv_heads, dtype, num_shards),
            kv_packing(dtype), padded_head_dim(head_dim))


def to_tpu_kv_cache(kv_cache: jax.Array, num_shards: int = 1) -> jax.Array:
    """Section 2's ``[..., num_blocks, block_size, 2 * KVH, D]`` in the TPU layout of
    ``num_shards`` shards (padding heads and lanes past D zero). For tests and converters: a
    step never converts."""
    *lead, combined, d = kv_cache.shape
    if combined % 2:
        raise ValueError(f"kv_cache axis -2 holds 2 * num_kv_heads, got odd {combined}")
    per_shard = _shard_heads(combined // 2, num_shards)
    packing = kv_packing(kv_cache.dtype)
    groups = -(-per_shard // packing)
    out = kv_cache.reshape(*lead, num_shards, per_shard, d)
    out = jnp.pad(out, [(0, 0)] * len(lead) + [(0, 0), (0, groups * packing - per_shard),
                                               (0, padded_head_dim(d) - d)])
    return out.reshape(*lead, num_shards * groups, packing, out.shape[-1])


def from_tpu_kv_cache(tpu_cache: jax.Array, num_kv_heads: int, head_dim: int,
                      num_shards: int = 1) -> jax.Array:
    """The TPU layout (of ``num_shards`` shards) back in section 2's
    ``[..., num_blocks, block_size, 2 * KVH, D]``, padding heads and lanes dropped."""
    *lead, groups, packing, lanes = tpu_cache.shape
    if (packing != kv_packing(tpu_cache.dtype)
            or groups != kv_head_groups(num_kv_heads, tpu_cache.dtype, num_shards)):
        raise ValueError(f"a cache of {groups} x {packing} combined heads of "
                         f"{tpu_cache.dtype} is not the TPU layout of {num_kv_heads} kv heads "
                         f"over {num_shards} shard(s)")
    per_shard = _shard_heads(num_kv_heads, num_shards)
    out = tpu_cache.reshape(*lead, num_shards, groups // num_shards * packing, lanes)
    return out[..., :per_shard, :head_dim].reshape(*lead, 2 * num_kv_heads, head_dim)

"""Paged attention: the only place the model touches the KV-cache kernels (pallas_kernels).

One call serves any mix of prefill and decode rows of a flat token batch: the step's K/V are first
written into the paged cache at ``slot_mapping``, then every query row attends to its sequence's
cached tokens up to its own position (CONTRACT §2). Tensor parallelism wraps ``paged_attention`` in
``shard_map`` over the head axes, so every kernel call must stay inside it.
"""
from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

BACKENDS = ("reference", "pallas")


@flax.struct.dataclass
class AttentionMetadata:
    """Per-step paged-attention metadata; a pytree of int32 device arrays.

    Query row ``cu_q_lens[s] + j`` of sequence ``s`` sits at position ``kv_lens[s] - q_len_s + j``.
    Rows at or past ``cu_q_lens[num_seqs[0]]`` are padding: their slot is -1 (nothing written) and
    their outputs are garbage the caller ignores.
    """

    slot_mapping: jax.Array  # [T_pad] cache slot (block_id * block_size + offset); -1 = padding
    block_tables: jax.Array  # [max_num_seqs, max_blocks_per_seq]
    kv_lens: jax.Array       # [max_num_seqs] tokens in cache per sequence, this step's included
    cu_q_lens: jax.Array     # [max_num_seqs + 1]
    num_seqs: jax.Array      # [1]


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                    md: AttentionMetadata, *, backend: str, sm_scale: float,
                    sliding_window: int | None, soft_cap: float | None,
                    layer: jax.Array | int | None = None,
                    interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Write ``k, v [T, KVH, D]`` into the cache, then attend ``q [T, H, D]``; returns (out, cache).

    q, k, v are cast to the cache dtype for the kernel; ``out`` comes back in q's dtype.

    ``layer=None``: ``kv_cache`` is one layer, ``[num_blocks, block_size, 2*KVH, D]``.
    ``layer=i``: ``kv_cache`` is the stacked ``[L, num_blocks, ...]`` cache and layer ``i`` is
    addressed in place: the stack is viewed (a free reshape) as one cache of ``L*num_blocks``
    blocks, and the slots and block ids are shifted by ``i*num_blocks``. No layer is sliced out,
    so under a donated cache each layer's write is an in-place scatter and nothing is copied.
    ``out`` has q's shape and dtype; the returned cache has the shape of the one passed in.
    """
    from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference, write_kv_cache

    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    slots, tables, flat = md.slot_mapping, md.block_tables, kv_cache
    if layer is not None:
        num_layers, num_blocks, block_size = kv_cache.shape[:3]
        flat = kv_cache.reshape(num_layers * num_blocks, *kv_cache.shape[2:])
        offset = jnp.asarray(layer, jnp.int32) * num_blocks
        slots = jnp.where(slots >= 0, slots + offset * block_size, -1)
        tables = tables + offset
    flat = write_kv_cache(flat, k, v, slots)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    q_cache = q.astype(flat.dtype)
    if backend == "pallas":
        out = ragged_paged_attention(q_cache, flat, md.kv_lens, tables, md.cu_q_lens, md.num_seqs,
                                     interpret=interpret, **kwargs)
    else:
        out = ragged_paged_attention_reference(q_cache, flat, md.kv_lens, tables, md.cu_q_lens,
                                               md.num_seqs, **kwargs)
    return out.astype(q.dtype), flat.reshape(kv_cache.shape)

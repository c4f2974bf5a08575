"""Ragged paged attention, the plain-jnp ground truth: one query row at a time, every cache
position of its sequence gathered through the block table, masked, and a float32 softmax.

Invariant: matches the float64 numpy oracle of tests/helpers/cases.py to float32 rounding, given
the same (dequantized) cache: an fp8 cache (``common.QUANTIZED_KV_DTYPES``, scale 1) is upcast to
float32 like any other, its values exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import (MIXED, block_offset_scalar, check_kind, kv_values,
                                   validate_attention_inputs)


def ragged_paged_attention_reference(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                                     block_tables: jax.Array, cu_q_lens: jax.Array,
                                     num_seqs: jax.Array, *, sm_scale: float,
                                     sliding_window: int | None = None,
                                     soft_cap: float | None = None,
                                     interpret: bool | None = None, kind: str = MIXED,
                                     block_offset: jax.Array | int = 0) -> jax.Array:
    """docs/API.md §2 in plain jnp (``interpret`` is accepted and ignored, ``kind`` checked:
    this path serves every kind); jit-able. Block ids are ``block_tables``' plus the int32 scalar
    ``block_offset``.

    Keys and values a row may not see are zeroed before the dots and their scores masked, so
    nothing outside the valid lengths (NaN included) reaches the output; padding rows are zeros.
    q and the cache (q's dtype or fp8) are read as float32; the output is q's dtype.
    """
    del interpret
    check_kind(kind)
    validate_attention_inputs(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                              sm_scale, sliding_window, soft_cap)
    block_offset = block_offset_scalar(block_offset)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, combined, _ = kv_cache.shape
    num_kv_heads = combined // 2
    max_num_seqs, max_blocks = block_tables.shape

    # Each row's sequence: how many live sequences end at or before it.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    live = jnp.arange(max_num_seqs) < num_seqs[0]
    ends_before = live[None, :] & (cu_q_lens[None, 1:] <= t[:, None])
    seq = jnp.minimum(jnp.sum(ends_before, axis=1), max_num_seqs - 1).astype(jnp.int32)
    valid = t < cu_q_lens[num_seqs[0]]
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - t)          # the row's position in its sequence
    kv_pos = jnp.arange(max_blocks * block_size, dtype=jnp.int32)

    def one_row(row: tuple[jax.Array, ...]) -> jax.Array:
        q_row, s, p, ok = row
        pages = jnp.clip(block_tables[s, kv_pos // block_size] + block_offset, 0, num_blocks - 1)
        kv = kv_values(kv_cache[pages, kv_pos % block_size]).astype(jnp.float32)  # [P, 2KVH, D]
        seen = ok & (kv_pos < kv_lens[s]) & (kv_pos <= p)
        if sliding_window is not None:
            seen &= kv_pos > p - sliding_window
        kv = jnp.where(seen[:, None, None], kv, 0.0).reshape(-1, num_kv_heads, 2, head_dim)
        qg = q_row.astype(jnp.float32).reshape(num_kv_heads, -1, head_dim)  # [KVH, group, D]
        scores = sm_scale * jnp.einsum("hgd,phd->hgp", qg, kv[:, :, 0],
                                       precision=jax.lax.Precision.HIGHEST)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(seen, scores, -jnp.inf)
        top = jnp.max(scores, axis=-1, keepdims=True)
        w = jnp.exp(scores - jnp.where(seen.any(), top, 0.0))       # unseen keys: exp(-inf) = 0
        out = jnp.einsum("hgp,phd->hgd", w, kv[:, :, 1], precision=jax.lax.Precision.HIGHEST)
        total = jnp.sum(w, axis=-1, keepdims=True)
        return (out / jnp.where(total > 0, total, 1.0)).reshape(num_q_heads, head_dim)

    out = jax.lax.map(one_row, (q, seq, pos, valid))  # one row's K/V in memory at a time
    return out.astype(q.dtype)

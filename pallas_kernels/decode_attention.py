"""Flash-decoding: paged attention for batches where every live sequence has one query token.

Grid ``(num_kv_heads, max_num_seqs, num_splits)``: each program takes one sequence's query heads of
one KV group (``group`` rows padded to a power of two >= 16) and one contiguous share of that
sequence's KV tiles, and emits its unnormalised partial result with the running max and sum. The
partials are merged in XLA with a log-sum-exp rescale. Splitting the KV range keeps the GPU busy
when ``num_kv_heads * num_seqs`` programs alone would leave SMs idle.

A cache of a quantized dtype (``common.QUANTIZED_KV_DTYPES``: fp8, scale 1) is read by
``common.attend_blocks``: each K/V tile is loaded in the cache's dtype and upcast to q's in the
kernel, before anything else touches it, so the dots and the softmax run as with a cache of q's
dtype.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (SQ, WHOLE, AttnStatics, attend_blocks, idiv, next_pow2,
                                   triton_compiler_params)
from pallas_kernels.metadata import token_metadata


class DecodeMetadata(NamedTuple):
    """What the decode kernel derives from the batch's metadata, once per step (`decode_metadata`)."""

    meta: jax.Array   # [max_num_seqs, 2]: (1 when live with exactly one query row, kv_len)
    tok: jax.Array    # [max_num_seqs]: each sequence's query row (clipped into the batch)
    seq: jax.Array    # [num_tokens]: each query row's sequence
    valid: jax.Array  # [num_tokens]: the row is not padding


def decode_metadata(num_tokens: int, kv_lens: jax.Array, cu_q_lens: jax.Array,
                    num_seqs: jax.Array) -> DecodeMetadata:
    """The decode kernel's per-step metadata for a batch of ``num_tokens`` query rows."""
    max_num_seqs = kv_lens.shape[0]
    seq_ids = jnp.arange(max_num_seqs, dtype=jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    live = ((seq_ids < num_seqs[0]) & (q_lens == 1)).astype(jnp.int32)
    seq, _, valid = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    return DecodeMetadata(jnp.stack([live, kv_lens], axis=1),
                          jnp.clip(cu_q_lens[:-1], 0, num_tokens - 1), seq, valid)


def default_num_splits(max_num_seqs: int, num_kv_heads: int, max_context: int, block_kv: int,
                       target_programs: int = 1024) -> int:
    """Enough splits for about ``target_programs`` programs, never more than the KV tiles."""
    want = next_pow2(max(1, -(-target_programs // (max_num_seqs * num_kv_heads))))
    return max(1, min(want, 16, next_pow2(-(-max_context // block_kv))))


def _decode_kernel(meta_ref: Any, bt_ref: Any, offset_ref: Any, cache_ref: Any, q_ref: Any,
                   acc_ref: Any, m_ref: Any, l_ref: Any, *, num_splits: int,
                   st: AttnStatics) -> None:
    h = pl.program_id(0)
    s = pl.program_id(1)
    split = pl.program_id(2)
    live = meta_ref[s, 0]          # 1 when sequence s is live with exactly one query token
    kv_len = meta_ref[s, 1]
    q = q_ref[...]
    r = jax.lax.broadcasted_iota(jnp.int32, (q.shape[0],), 0)
    row_ok = (r < st.group) & (live > 0)
    pos = kv_len - 1
    lo = 0
    if st.sliding_window is not None:
        lo = idiv(jnp.maximum(pos - st.sliding_window + 1, 0), st.block_kv)
    n_blk = jnp.where(live > 0, idiv(kv_len + st.block_kv - 1, st.block_kv), lo)
    per_split = idiv(n_blk - lo + num_splits - 1, num_splits)
    start = lo + split * per_split
    stop = jnp.minimum(start + per_split, n_blk)
    m, l, acc = attend_blocks(q, jnp.full(r.shape, pos, jnp.int32), row_ok, s, h, kv_len,
                              start, jnp.maximum(stop, start), bt_ref, offset_ref[0], cache_ref,
                              st)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "interpret", "block_kv", "num_splits", "num_warps"))
def decode_attention(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                     block_tables: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                     sm_scale: float, sliding_window: int | None = None,
                     soft_cap: float | None = None, interpret: bool = False,
                     block_kv: int | None = None, num_splits: int | None = None,
                     num_warps: int = 4, metadata: DecodeMetadata | None = None,
                     block_offset: jax.Array | int = 0) -> jax.Array:
    """Same contract as ``ragged_paged_attention`` for batches whose live sequences each have
    exactly one query row; rows of sequences with another q length come out as zeros (callers pick
    this path only for pure decode batches). Inputs are assumed validated (an fp8 cache is read
    upcast to q's dtype: see the module docstring). ``metadata``: this batch's `decode_metadata`
    (computed here when None). Block ids are ``block_tables``' plus the int32 scalar
    ``block_offset``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, combined, _ = kv_cache.shape
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, max_blocks = block_tables.shape
    rows = max(16, next_pow2(group))
    if block_kv is None:
        # a K+V tile of <= 64 KiB in the cache's dtype (what a pipeline stage holds)
        block_kv = max(16, min(128, 32 * 1024 // (head_dim * kv_cache.dtype.itemsize)))
    if num_splits is None:
        num_splits = default_num_splits(max_num_seqs, num_kv_heads, max_blocks * block_size, block_kv)

    if metadata is None:
        metadata = decode_metadata(num_tokens, kv_lens, cu_q_lens, num_seqs)
    meta, tok = metadata.meta, metadata.tok
    g = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), group - 1)
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None, None] * group + g[None, None, :]
    q_rows = q.reshape(num_tokens * num_q_heads, head_dim)[tok[None, :, None] * num_q_heads + heads]
    cache2 = kv_cache.reshape(num_blocks * block_size * combined, head_dim)

    st = AttnStatics(group, block_kv, block_size, num_blocks, num_kv_heads, max_blocks,
                     float(sm_scale), sliding_window, soft_cap)
    grid = (num_kv_heads, max_num_seqs, num_splits)
    part = (num_kv_heads, max_num_seqs, num_splits, rows)
    vec_spec = pl.BlockSpec((SQ, SQ, SQ, rows), lambda h, s, k: (h, s, k, 0))
    acc, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, num_splits=num_splits, st=st),
        grid=grid,
        in_specs=[WHOLE, WHOLE, WHOLE, WHOLE,
                  pl.BlockSpec((SQ, SQ, rows, head_dim), lambda h, s, k: (h, s, 0, 0))],
        out_specs=[pl.BlockSpec((SQ, SQ, SQ, rows, head_dim), lambda h, s, k: (h, s, k, 0, 0)),
                   vec_spec, vec_spec],
        out_shape=[jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else triton_compiler_params(num_warps, 2),
        name="paged_decode_attention",
    )(meta, block_tables, jnp.asarray(block_offset, jnp.int32).reshape(1), cache2, q_rows)

    # Log-sum-exp merge of the splits: weight each partial by exp(m_split - m_max).
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_max)
    den = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * acc, axis=2)
    merged = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    merged = merged[:, :, :group]                                   # [Hkv, S, G, D]

    out = jnp.transpose(merged, (1, 0, 2, 3)).reshape(max_num_seqs, num_q_heads, head_dim)
    return jnp.where(metadata.valid[:, None, None], out[metadata.seq], 0.0).astype(q.dtype)

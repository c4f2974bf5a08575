"""Plain-jnp ragged paged attention: the ground truth for the Pallas kernel and the XLA attention
backend on CPU.

Work layout: query rows are grouped into tiles of up to ``tokens_per_tile`` consecutive tokens of
one sequence (``metadata.tile_metadata``), so each tile gathers its sequence's pages once; an
online softmax runs over the block-table columns any live sequence needs, about 32 keys a step.

Invariants (CONTRACT section 2): query row ``cu_q_lens[s] + j`` of sequence ``s`` sits at position
``kv_lens[s] - q_len_s + j`` and sees cache positions ``p <= position`` (and
``p > position - sliding_window`` when set). Rows past ``cu_q_lens[num_seqs[0]]`` are padding and
come out as zeros. Cache slots outside the valid lengths (NaN included) never reach the output:
keys/values are zeroed before every dot, and probabilities are masked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import max_num_tiles, tile_metadata, token_tiles

_NEG = -1e30  # finite "minus infinity": a fully masked row keeps exp(score - max) finite.


def validate_attention_inputs(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                              block_tables: jax.Array, cu_q_lens: jax.Array,
                              num_seqs: jax.Array, sm_scale: float,
                              sliding_window: int | None, soft_cap: float | None) -> None:
    """Raise ValueError/TypeError for inconsistent static shapes and dtypes (trace time only)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if kv_cache.ndim != 4:
        raise ValueError("kv_cache must be [num_blocks, block_size, 2 * num_kv_heads, head_dim], "
                         f"got shape {kv_cache.shape}")
    _, num_q_heads, head_dim = q.shape
    _, _, combined, cache_head_dim = kv_cache.shape
    if combined % 2:
        raise ValueError(f"kv_cache axis 2 holds 2 * num_kv_heads (K and V interleaved); got odd {combined}")
    num_kv_heads = combined // 2
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim != cache_head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, kv_cache has {cache_head_dim}")
    if q.dtype != kv_cache.dtype:
        raise TypeError(f"q dtype {q.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q and kv_cache must be floating point, got {q.dtype}")
    for name, arr, ndim in (("kv_lens", kv_lens, 1), ("block_tables", block_tables, 2),
                            ("cu_q_lens", cu_q_lens, 1), ("num_seqs", num_seqs, 1)):
        if arr.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {arr.dtype}")
        if arr.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    max_num_seqs = kv_lens.shape[0]
    if block_tables.shape[0] != max_num_seqs:
        raise ValueError(f"block_tables must be [max_num_seqs={max_num_seqs}, max_blocks_per_seq], "
                         f"got {block_tables.shape}")
    if cu_q_lens.shape[0] != max_num_seqs + 1:
        raise ValueError(f"cu_q_lens must be [max_num_seqs + 1 = {max_num_seqs + 1}], got {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must have shape (1,), got {num_seqs.shape}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or > 0, got {soft_cap}")


def reference_tokens_per_tile(num_tokens: int, max_num_seqs: int) -> int:
    """One token per tile for decode-sized buckets, up to 16 when sequences carry many rows."""
    per_seq = max(1, num_tokens // max(1, max_num_seqs))
    return min(16, 1 << (per_seq.bit_length() - 1))


def reference_pages_per_step(block_size: int, max_blocks: int) -> int:
    """Whole pages per online-softmax step: about 32 keys. On XLA:CPU, 16-key steps make the
    batched dots too thin (measured 1.5-2.2x slower); much longer steps waste work on padding."""
    return max(1, min(max_blocks, 32 // block_size))


def ragged_paged_attention_reference(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                                     block_tables: jax.Array, cu_q_lens: jax.Array,
                                     num_seqs: jax.Array, *, sm_scale: float,
                                     sliding_window: int | None = None,
                                     soft_cap: float | None = None,
                                     interpret: bool | None = None) -> jax.Array:
    """Ragged paged attention in plain jnp (``interpret`` is accepted and ignored).

    Accumulates in f32 and returns ``q.dtype``; jit-able (static shapes; the page loop has a
    data-dependent trip count). Per loop step every tile gathers ``pps`` pages of its sequence,
    ``[num_tiles, pps, block_size, 2 * num_kv_heads, head_dim]``.
    """
    del interpret
    validate_attention_inputs(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                              sm_scale, sliding_window, soft_cap)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, combined, _ = kv_cache.shape
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, max_blocks = block_tables.shape
    tpt = reference_tokens_per_tile(num_tokens, max_num_seqs)
    num_tiles = max_num_tiles(num_tokens, max_num_seqs, tpt)

    meta, q_first, tile_start = tile_metadata(cu_q_lens, kv_lens, num_seqs, tpt, num_tiles)
    seq, pos0, nq, kv_len = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3]
    # Rows r = token * group + g of a tile, laid out [tile, kv head, row] for batched dots.
    r = jnp.arange(tpt * group, dtype=jnp.int32)
    row_ok = (r // group)[None, :] < nq[:, None]                             # [N, R]
    q_pos = pos0[:, None] + (r // group)[None, :]                            # [N, R]
    tok = jnp.clip(q_first[:, None] + jnp.arange(tpt, dtype=jnp.int32)[None, :], 0, num_tokens - 1)
    qt = q[tok].astype(jnp.float32).reshape(num_tiles, tpt, num_kv_heads, group, head_dim)
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, tpt * group, head_dim)
    # Each loop step gathers `pps` whole pages per tile (see `reference_pages_per_step`).
    pps = reference_pages_per_step(block_size, max_blocks)
    keys = pps * block_size
    tables = jnp.pad(block_tables[seq], ((0, 0), (0, -max_blocks % pps)))  # [N, MB padded]
    live = jnp.arange(max_num_seqs) < num_seqs[0]
    n_pages = jnp.minimum((jnp.max(jnp.where(live, kv_lens, 0)) + block_size - 1) // block_size,
                          max_blocks)

    def page_step(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, l, acc = carry
        pages = jnp.clip(jax.lax.dynamic_slice_in_dim(tables, c * pps, pps, axis=1), 0, num_blocks - 1)
        kv = kv_cache[pages].astype(jnp.float32)                            # [N, P, BS, 2H, D]
        kv = kv.reshape(num_tiles, keys, num_kv_heads, 2, head_dim).transpose(0, 2, 3, 1, 4)
        kpos = c * keys + jnp.arange(keys, dtype=jnp.int32)
        key_ok = (kpos[None, :] < kv_len[:, None])[:, None, :, None]        # [N, 1, K, 1]
        k = jnp.where(key_ok, kv[:, :, 0], 0.0)                             # [N, H, K, D], NaN-free
        v = jnp.where(key_ok, kv[:, :, 1], 0.0)
        visible = (row_ok[:, :, None] & (kpos[None, None, :] < kv_len[:, None, None])
                   & (kpos[None, None, :] <= q_pos[:, :, None]))             # [N, R, K]
        if sliding_window is not None:
            visible &= kpos[None, None, :] > q_pos[:, :, None] - sliding_window
        s = jnp.einsum("nhrd,nhkd->nhrk", qt, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        vis = visible[:, None]
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        pr = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("nhrk,nhkd->nhrd", pr, v, precision=jax.lax.Precision.HIGHEST)
        return m_new, alpha * l + pr.sum(-1), alpha[..., None] * acc + pv

    shape = (num_tiles, num_kv_heads, tpt * group)
    init = (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, (n_pages + pps - 1) // pps, page_step, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = out.reshape(num_tiles, num_kv_heads, tpt, group, head_dim).transpose(0, 2, 1, 3, 4)
    tile, slot, valid = token_tiles(cu_q_lens, kv_lens, num_seqs, num_tokens, tile_start, tpt,
                                    num_tiles)
    out = out.reshape(num_tiles, tpt, num_q_heads, head_dim)[tile, slot]
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)

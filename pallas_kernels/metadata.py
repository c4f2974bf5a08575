"""Ragged-batch bookkeeping derived on the device from ``cu_q_lens`` (vectorised, static shapes,
no loops: every ``searchsorted`` compares all entries at once, so a step program holds no while).

A *tile* is up to ``tokens_per_tile`` consecutive query tokens of one live sequence; each live
sequence with ``q_len`` tokens owns ``ceil(q_len / tokens_per_tile)`` consecutive tiles, in
sequence order. Tiles past the last one used have no tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_metadata(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array,
                   num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: (sequence id, absolute position, valid). Padding rows get valid=False."""
    max_num_seqs = kv_lens.shape[0]
    n = num_seqs[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    live = jnp.arange(max_num_seqs, dtype=jnp.int32) < n
    ends = jnp.where(live, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.searchsorted(ends, t, side="right", method="compare_all")
    seq = jnp.minimum(seq, max_num_seqs - 1).astype(jnp.int32)
    valid = t < cu_q_lens[n]
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - t)
    return seq, pos, valid


def max_num_tiles(num_tokens: int, max_num_seqs: int, tokens_per_tile: int) -> int:
    """Static bound of sum_s ceil(q_len_s / tpt) over batches of ``num_tokens`` rows: each tile
    holds at least one token, and at most ``tpt - 1`` slots per sequence are left empty."""
    live = min(max_num_seqs, num_tokens)
    return max(1, min(num_tokens, (num_tokens + live * (tokens_per_tile - 1)) // tokens_per_tile))


def tile_metadata(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array,
                  tokens_per_tile: int, num_tiles: int, include: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns ``meta [num_tiles, 4] = (seq, first position, q tokens, kv_len)``, the first query
    row of each tile ``[num_tiles]`` and each sequence's first tile ``[max_num_seqs]``. Only live
    sequences in ``include`` (a ``[max_num_seqs]`` mask; default: all) own tiles."""
    max_num_seqs = kv_lens.shape[0]
    live = jnp.arange(max_num_seqs) < num_seqs[0]
    if include is not None:
        live &= include
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    n_tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    tile_end = jnp.cumsum(n_tiles).astype(jnp.int32)
    tile_start = tile_end - n_tiles
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(tile_end, i, side="right", method="compare_all")
    seq = jnp.minimum(seq, max_num_seqs - 1).astype(jnp.int32)
    local = (i - tile_start[seq]) * tokens_per_tile
    used = i < tile_end[-1]
    nq = jnp.where(used, jnp.clip(q_lens[seq] - local, 0, tokens_per_tile), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + local
    meta = jnp.stack([seq, pos0, nq, kv_lens[seq]], axis=1).astype(jnp.int32)
    return meta, cu_q_lens[seq] + local, tile_start


def token_tiles(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int,
                tile_start: jax.Array, tokens_per_tile: int,
                num_tiles: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: (its tile, its index within the tile, valid)."""
    seq, _, valid = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    tile = jnp.clip(tile_start[seq] + local // tokens_per_tile, 0, num_tiles - 1)
    return tile, local % tokens_per_tile, valid

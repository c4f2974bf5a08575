"""Ragged paged attention through Pallas (Triton lowering on NVIDIA GPUs, interpret mode on CPU).

Mixed kernel. Each live sequence's query rows are cut into tiles of ``tokens_per_tile`` tokens; a
tile packs those tokens' query heads of one KV group into the row dimension
(``row = token * group + g``, a power of two >= 16 rows). The grid is ``(num_kv_heads, num_tiles)``
with ``num_tiles`` a static upper bound of the tiles any batch of these shapes can need; spare
tiles have no query rows and run no loop iterations. The ragged bookkeeping (a tile's sequence and
first position, `MixedMetadata`) is computed in XLA from ``cu_q_lens``, once per step when the
caller passes it in (`ragged_paged_attention_metadata`); queries are gathered into tiles before
the kernel and outputs gathered back after it, with padding rows set to zero.

Inside a program, ``common.attend_blocks`` runs the online softmax over KV tiles, gathering pages
through the block table. Pure decode batches take the flash-decoding kernel instead
(``decode_attention.py``) when the caller says so (``kind="decode"``): the choice is static, never
a run-time branch.

An fp8 cache (``common.QUANTIZED_KV_DTYPES``, scale 1) is read by both kernels in
``common.attend_blocks``: tiles load in the cache's dtype (bytes, and so the K+V tile budget,
count in it) and are upcast to q's dtype in the kernel before the dots.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.common import (DECODE, MIXED, SQ, WHOLE, AttnStatics, attend_blocks,
                                   block_offset_scalar, check_kind, idiv, next_pow2,
                                   resolve_interpret, triton_compiler_params,
                                   validate_attention_inputs)
from pallas_kernels.decode_attention import DecodeMetadata, decode_attention, decode_metadata
from pallas_kernels.metadata import max_num_tiles, tile_metadata, token_tiles


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static tiling: ``block_q_rows`` query rows (tokens x group) and ``block_kv`` keys per step."""
    block_q_rows: int
    block_kv: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q_rows", "block_kv"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {val}")


def default_tiles(num_tokens: int, max_num_seqs: int, group: int, head_dim: int,
                  itemsize: int = 2) -> TileConfig:
    """Small row tiles when a bucket is decode-like (about one token per sequence); a K+V tile of
    64 KiB (small row tiles) or 32 KiB, so two pipeline stages fit an SM's shared memory.
    ``itemsize``: the cache's (the bytes a loaded tile holds; an fp8 cache's tiles take 1)."""
    per_seq = max(1, num_tokens // max(1, max_num_seqs))
    rows = min(128, max(16, next_pow2(group), next_pow2(per_seq * group)))
    kv_bytes = (64 if rows <= 32 else 32) * 1024
    block_kv = min(128, kv_bytes // (2 * head_dim * itemsize))
    return TileConfig(block_q_rows=rows, block_kv=max(16, next_pow2(block_kv + 1) // 2),
                      num_warps=4 if rows <= 64 else 8)


class MixedMetadata(NamedTuple):
    """What the mixed kernel derives from the batch's metadata, once per step."""

    meta: jax.Array   # [num_tiles, 4]: (seq, first position, q tokens, kv_len) of each tile
    tok: jax.Array    # [num_tiles, block_q_rows]: the query row each tile row reads
    tile: jax.Array   # [num_tokens]: each query row's tile
    slot: jax.Array   # [num_tokens]: its token index within the tile
    valid: jax.Array  # [num_tokens]: the row is not padding


def _mixed_metadata(num_tokens: int, group: int, tiles: TileConfig, kv_lens: jax.Array,
                    cu_q_lens: jax.Array, num_seqs: jax.Array) -> MixedMetadata:
    tpt = tiles.block_q_rows // group
    num_tiles = max_num_tiles(num_tokens, kv_lens.shape[0], tpt)
    meta, q_first, tile_start = tile_metadata(cu_q_lens, kv_lens, num_seqs, tpt, num_tiles)
    r = jnp.arange(tiles.block_q_rows, dtype=jnp.int32)
    tok = jnp.clip(q_first[:, None] + r[None, :] // group, 0, num_tokens - 1)
    tile, slot, valid = token_tiles(cu_q_lens, kv_lens, num_seqs, num_tokens, tile_start, tpt,
                                    num_tiles)
    return MixedMetadata(meta, tok, tile, slot, valid)


def _kernel(meta_ref: Any, bt_ref: Any, offset_ref: Any, cache_ref: Any, q_ref: Any, o_ref: Any,
            *, tokens_per_tile: int, st: AttnStatics) -> None:
    h = pl.program_id(0)
    i = pl.program_id(1)
    seq = meta_ref[i, 0]
    pos0 = meta_ref[i, 1]
    nq = meta_ref[i, 2]
    kv_len = meta_ref[i, 3]
    q = q_ref[...]
    r = jax.lax.broadcasted_iota(jnp.int32, (q.shape[0],), 0)
    row_tok = idiv(r, st.group)
    row_ok = (row_tok < nq) & (r < tokens_per_tile * st.group)
    kv_hi = jnp.minimum(kv_len, pos0 + nq)
    lo_blk = 0
    if st.sliding_window is not None:
        lo_blk = idiv(jnp.maximum(pos0 - st.sliding_window + 1, 0), st.block_kv)
    hi_blk = jnp.where(nq > 0, idiv(kv_hi + st.block_kv - 1, st.block_kv), lo_blk)
    _, l, acc = attend_blocks(q, pos0 + row_tok, row_ok, seq, h, kv_hi, lo_blk, hi_blk,
                              bt_ref, offset_ref[0], cache_ref, st)
    safe_l = jnp.where(l > 0, l, 1.0)
    o_ref[...] = jnp.where(l[:, None] > 0, acc / safe_l[:, None], 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "interpret", "tiles"))
def _ragged_paged_attention(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                            block_tables: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                            metadata: MixedMetadata | None, block_offset: jax.Array, *,
                            sm_scale: float,
                            sliding_window: int | None, soft_cap: float | None,
                            interpret: bool, tiles: TileConfig) -> jax.Array:
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, combined, _ = kv_cache.shape
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, max_blocks = block_tables.shape
    rows = tiles.block_q_rows
    tpt = rows // group
    num_tiles = max_num_tiles(num_tokens, max_num_seqs, tpt)
    if metadata is None:
        metadata = _mixed_metadata(num_tokens, group, tiles, kv_lens, cu_q_lens, num_seqs)
    meta, tok = metadata.meta, metadata.tok                                          # [NT, R]
    r = jnp.arange(rows, dtype=jnp.int32)
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None, None] * group + (r % group)[None, None, :]
    q2 = q.reshape(num_tokens * num_q_heads, head_dim)
    q_tiles = q2[tok[None] * num_q_heads + heads]                                   # [H, NT, R, D]
    cache2 = kv_cache.reshape(num_blocks * block_size * combined, head_dim)       # free view

    st = AttnStatics(group, tiles.block_kv, block_size, num_blocks, num_kv_heads, max_blocks,
                     float(sm_scale), sliding_window, soft_cap)
    kernel = functools.partial(_kernel, tokens_per_tile=tpt, st=st)
    tile_spec = pl.BlockSpec((SQ, SQ, rows, head_dim), lambda h, i: (h, i, 0, 0))
    out_tiles = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_tiles),
        in_specs=[WHOLE, WHOLE, WHOLE, WHOLE, tile_spec],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, num_tiles, rows, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_compiler_params(tiles.num_warps, tiles.num_stages),
        name="ragged_paged_attention",
    )(meta, block_tables, block_offset.reshape(1), cache2, q_tiles)

    # Gather back: token t, q head (h, g) sits in tile `tile[t]` at row `slot[t] * group + g`.
    tile, slot, valid = metadata.tile, metadata.slot, metadata.valid
    qh = jnp.arange(num_q_heads, dtype=jnp.int32)
    flat = (((qh[None, :] // group) * num_tiles + tile[:, None]) * rows
            + slot[:, None] * group + (qh % group)[None, :])
    out = out_tiles.reshape(num_kv_heads * num_tiles * rows, head_dim)[flat]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def _options(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array, tiles: TileConfig | None,
             kind: str) -> tuple[int, TileConfig]:
    """The GQA group and the mixed kernel's tiling (``tiles`` or `default_tiles`), checked."""
    check_kind(kind)
    head_dim = q.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the kernel needs head_dim to be a power of two >= 16, got {head_dim}")
    group = q.shape[1] // (kv_cache.shape[2] // 2)
    if tiles is None:
        tiles = default_tiles(q.shape[0], kv_lens.shape[0], group, head_dim,
                              jnp.dtype(kv_cache.dtype).itemsize)
    if tiles.block_q_rows < group:
        raise ValueError(f"block_q_rows ({tiles.block_q_rows}) must be >= the GQA group ({group})")
    return group, tiles


def ragged_paged_attention_metadata(q: Any, kv_cache: Any, kv_lens: jax.Array,
                                    block_tables: jax.Array, cu_q_lens: jax.Array,
                                    num_seqs: jax.Array, *, sliding_window: int | None = None,
                                    kind: str = MIXED, tiles: TileConfig | None = None
                                    ) -> MixedMetadata | DecodeMetadata:
    """The per-step metadata `ragged_paged_attention` takes (``metadata=``) for the same
    arguments and options (``sliding_window`` does not change it): compute it once and pass it to
    every layer's call. ``q`` and ``kv_cache`` are read for their shapes and dtypes only
    (ShapeDtypeStructs will do; an fp8 cache's with q of the model's dtype too)."""
    group, tiles = _options(q, kv_cache, kv_lens, tiles, kind)
    if kind == DECODE:
        return decode_metadata(q.shape[0], kv_lens, cu_q_lens, num_seqs)
    return _mixed_metadata(q.shape[0], group, tiles, kv_lens, cu_q_lens, num_seqs)


def pallas_step_kinds(num_tokens: int) -> tuple[str, ...]:
    """The step kinds these kernels compile apart in a bucket of ``num_tokens`` rows."""
    return (MIXED, DECODE)


def pallas_step_kind(q_lens: np.ndarray, num_tokens: int) -> str:
    """The kind of a batch whose live sequences have ``q_lens`` query rows (host side)."""
    return DECODE if len(q_lens) and bool((np.asarray(q_lens) == 1).all()) else MIXED


def ragged_paged_attention(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                           block_tables: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                           sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, interpret: bool | None = None,
                           tiles: TileConfig | None = None, kind: str = MIXED,
                           num_splits: int | None = None,
                           metadata: MixedMetadata | DecodeMetadata | None = None,
                           block_offset: jax.Array | int = 0) -> jax.Array:
    """Ragged paged attention (docs/API.md §2) through the Pallas kernels.

    ``kind``: "decode" runs the flash-decoding kernel (the caller guarantees every live sequence
    has exactly one query row), any other kind the mixed kernel; the choice is static. ``tiles``
    overrides the mixed kernel's tiling (see ``default_tiles``), ``num_splits`` the decode
    kernel's KV split. ``metadata``: `ragged_paged_attention_metadata` of the same arguments
    (computed here when None). Padding rows come out as zeros. ``kv_cache`` holds q's dtype or
    fp8 (``common.QUANTIZED_KV_DTYPES``), read upcast to q's dtype; the output is q's dtype.
    Block ids are ``block_tables``' plus the int32 scalar ``block_offset``, added in the kernel
    to each id it loads.
    """
    validate_attention_inputs(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                              sm_scale, sliding_window, soft_cap)
    _, tiles = _options(q, kv_cache, kv_lens, tiles, kind)
    opts = dict(sm_scale=float(sm_scale),
                sliding_window=None if sliding_window is None else int(sliding_window),
                soft_cap=None if soft_cap is None else float(soft_cap),
                interpret=resolve_interpret(interpret))
    args = (q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    block_offset = block_offset_scalar(block_offset)
    if kind == DECODE:
        return decode_attention(*args, num_splits=num_splits, metadata=metadata,
                                block_offset=block_offset, **opts)
    return _ragged_paged_attention(*args, metadata, block_offset, tiles=tiles, **opts)

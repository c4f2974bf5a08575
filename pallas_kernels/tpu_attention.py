"""Ragged paged attention through Pallas' TPU (Mosaic) backend (docs/API.md §2a).

Layout. The cache is in the TPU layout of `pallas_kernels.tpu_layout`, ``[num_blocks, block_size,
groups, packing, Dp]`` (Dp: head_dim padded to 128 lanes; ``groups = ceil(2 * KVH / packing)``
word rows, the last one's two padding heads zero for an 8-bit cache of odd KVH; under tensor
parallelism each device runs the kernel on its share, the one-shard layout of its own heads), so
a page and a token's K/V are whole tiles. Compiled, a KV tile's K and V of head ``h`` are read as
32-bit words, every ``groups``-th row from row ``2h // packing``: a float32 cache's words are K
then V; a 16-bit cache's word holds K in its low half and V in its high half; an 8-bit
(float8_e4m3fn) cache's word holds ``K_h, V_h, K_{h+1}, V_{h+1}`` from its low byte, each byte
shifted down, truncated to 8 bits and converted by Mosaic's fp8 unpack (`low_byte_e4m3`). (The
interpreter has no ref bitcasts, so interpret mode indexes combined heads ``2h`` and ``2h + 1``
directly.) K and V are upcast to q's dtype before the dots (an 8-bit cache's values are stored as
cast: scale 1). The query and the output are padded to Dp lanes with zeros; the cache's padding
lanes are zeros. ``num_kv_heads`` cannot always be read off a padded cache's shape (KVH 1 and 2
both take one group of 4): the entry points take it, and infer it only where one head count fits
the shapes and divides q's heads.

Work. As in the GPU kernel, each live sequence's query rows are cut into tiles of
``tokens_per_tile`` tokens; a tile holds, per kv head, its tokens' GQA group of query heads as
rows ``g * tokens_per_tile + token``. The grid runs the tiles in order (``arbitrary``: one core,
sequentially). Tile ``i`` walks KV tiles ``lo_i <= j < hi_i`` of ``block_kv`` keys each, for all
kv heads at once; the tiles with work (``n_work`` of them) come first, each with at least one KV
step, and KV step ``n`` (counted across tiles) uses VMEM slot ``n % 2``.

Memory. The cache and the block table stay in HBM (``pl.ANY``). SMEM holds, in int32 words
(each array padded to whole 128-word tiles), the scalar-prefetched per-tile table
(``7 * num_tiles``, ``num_tiles = max_num_tiles(num_tokens, max_num_seqs, tokens_per_tile)``),
``n_work`` and the block offset (2) and, for the fused write, the slot mapping
(``num_tokens``), plus the block-table rows of three tiles (``3 * max_blocks_per_seq``): about
``4 * (num_tokens * (1 + 7 / tokens_per_tile) + 7 * max_num_seqs + 3 * max_blocks_per_seq)``
bytes, whatever the cache and the heads. `smem_bytes` is that sum, and `check_smem` (which the
entry points call at trace time) refuses shapes past ``SMEM_LIMIT`` before anything compiles.

Block ids. Every block id the kernel reads, a block-table entry or (fused write) a slot's
block, is shifted by the scalar-prefetched ``block_offset`` where it addresses the cache in HBM:
one layer of a stacked cache, viewed as one, is read and written without a shifted copy of the
block table or of the slot mapping.

Pipeline invariants:
- tile ``i``'s block-table row (its sequence's page ids) is DMA'd into SMEM row slot
  ``i % ROW_SLOTS`` (3): those of tiles 0 and 1 start at grid step 0, tile ``i + 2``'s at the
  start of grid step ``i`` (its slot last read by tile ``i - 1``, whose every DMA has been waited
  on), a whole grid step before it is needed; tile 0's is waited on at grid step 0 and tile
  ``i + 1``'s before tile ``i``'s last KV step starts tile ``i + 1``'s first page DMAs, so every
  page id is read after it landed and before it is overwritten; a row DMA starts only for a tile
  with work, and every one started is waited on in the kernel;
- every page of a KV tile is DMA'd from HBM into its slot before the tile is read, and the DMAs of
  the next KV step (the next tile's first one at a tile's end) start before this step's compute;
- a slot is refilled only after the step that read it has finished;
- keys at positions ``>= kv_hi`` (past the tile's last query) are zeroed before the dots and
  masked, so pages never fetched and garbage pages (NaN included) never reach the output.

Fused write (``ragged_paged_attention_tpu_update``): grid step 0 first copies every new token's
K/V row (cast to the cache's dtype and packed as the layout, outside the kernel) from HBM into its
cache slot (the cache is aliased input to output) and waits for all of them, before the first
page is fetched; the cache is never copied or scattered outside the kernel.

Cost estimate (`cost_estimate`, what XLA's cost analysis counts for the kernel, which it cannot
see into): the work of a stated batch, ``min(num_tokens, max_num_seqs)`` sequences sharing the
query rows equally, each one's last row at position ``context - 1``, ``context`` being the
block table's reach (max_blocks_per_seq x block_size, the engine's max_model_len).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from pallas_kernels.common import (MIXED, NEG, block_offset_scalar, check_kind, next_pow2,
                                   resolve_interpret, validate_attention_inputs)
from pallas_kernels.kv_cache import quantize_kv, validate_new_kv
from pallas_kernels.metadata import max_num_tiles, tile_metadata, token_tiles
from pallas_kernels.tpu_layout import (LANES, kv_head_groups, kv_packing, padded_head_dim,
                                       to_tpu_kv_cache)

# Columns of the per-tile table scalar-prefetched into SMEM.
SEQ, POS0, NQ, KV_HI, LO, HI, STEP0 = range(7)
_COLS = 7
# SMEM slots of block-table rows: tile i's row is in slot i % ROW_SLOTS, fetched a tile ahead.
ROW_SLOTS = 3
# Bytes of one VMEM slot of KV pages: two slots (1 MiB) plus the query and output blocks (double-
# buffered by Pallas) and the f32 accumulators stay well inside the 16 MiB default scoped VMEM of
# v5e (32 MiB on v6e) for every shape in tests/kernels/test_tpu_attention.py's lowering list.
KV_SLOT_BYTES = 512 * 1024
# SMEM the kernel's own arrays may take (`smem_bytes`): the 1 MiB of a TensorCore (v4, v5e, v5p,
# v6e) less what Mosaic keeps for itself (libtpu for v5e and v6e failed at 2-3.5 KiB past
# smem_bytes; the margin is 16 KiB).
SMEM_LIMIT = 1024 * 1024 - 16 * 1024


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    """Static tiling: ``tokens_per_tile`` query tokens (a power of two) and ``block_kv`` keys (a
    multiple of the block size) per kernel step."""
    tokens_per_tile: int
    block_kv: int


def default_tpu_tiles(num_tokens: int, max_num_seqs: int, group: int, block_size: int,
                      kv_row_bytes: int, itemsize: int) -> TpuTiles:
    """Decode-like buckets (about a token per sequence) take the smallest row tile that fills the
    sublanes of q's dtype (``itemsize``: 8 rows, 16 for 16-bit types); others about 128 rows of
    query heads. ``block_kv``: the most whole pages in ``KV_SLOT_BYTES`` (``kv_row_bytes``: one
    token's K/V of every kv head in the cache's layout and dtype), at most 512 keys."""
    per_seq = max(1, num_tokens // max(1, max_num_seqs))
    sublanes = 8 * (4 // itemsize)
    tokens = max(sublanes, next_pow2(min(per_seq, max(1, 128 // group))))
    pages = max(1, min(KV_SLOT_BYTES // (block_size * kv_row_bytes), max(1, 512 // block_size)))
    return TpuTiles(tokens_per_tile=tokens, block_kv=pages * block_size)


def smem_bytes(num_tokens: int, max_num_seqs: int, max_blocks: int, tokens_per_tile: int = 8,
               write: bool = True) -> int:
    """The SMEM bytes of the kernel's arrays (the module docstring's sum, each array padded to
    whole 128-word tiles) for ``num_tokens`` query rows (max_num_batched_tokens),
    ``max_num_seqs`` sequences and ``max_blocks`` blocks per sequence (max_model_len /
    block_size). The default ``tokens_per_tile`` is the smallest the default tiles take: a bound
    for them."""
    def words(n: int) -> int:
        return -(-n // 128) * 128

    num_tiles = max_num_tiles(num_tokens, max_num_seqs, tokens_per_tile)
    return 4 * (words(_COLS * num_tiles) + words(2) + (words(num_tokens) if write else 0)
                + ROW_SLOTS * words(max_blocks))


def check_smem(num_tokens: int, max_num_seqs: int, max_blocks: int, tokens_per_tile: int = 8,
               write: bool = True) -> None:
    """ValueError when `smem_bytes` of the shapes passes ``SMEM_LIMIT`` (the compiler would run
    out of SMEM), naming the options that lower it."""
    need = smem_bytes(num_tokens, max_num_seqs, max_blocks, tokens_per_tile, write)
    if need > SMEM_LIMIT:
        raise ValueError(
            f"the TPU attention kernel needs {need} bytes of SMEM for {num_tokens} token rows, "
            f"{max_num_seqs} sequences and {max_blocks} blocks per sequence, more than the "
            f"{SMEM_LIMIT} it may use (of a TensorCore's 1 MiB): lower max_num_batched_tokens "
            f"or max_num_seqs (each row takes about {4 + 4 * _COLS // tokens_per_tile} bytes), "
            f"or max_model_len, or raise block_size ({4 * ROW_SLOTS} bytes a block)")


def low_byte_e4m3(words: jax.Array, dtype: DTypeLike) -> jax.Array:
    """The float8_e4m3fn numbers whose bit patterns are the low bytes of ``words`` (uint32),
    upcast to ``dtype`` (Mosaic: a truncation to 8 bits, then its fp8 unpack)."""
    return jax.lax.bitcast_convert_type(words.astype(jnp.uint8), jnp.float8_e4m3fn).astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Statics:
    num_kv_heads: int
    head_dim: int
    group: int
    block_size: int
    num_blocks: int
    max_blocks: int
    tokens_per_tile: int
    pages_per_tile: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    write: bool
    packing: int
    interpret: bool

    @property
    def block_kv(self) -> int:
        return self.pages_per_tile * self.block_size

    @property
    def head_groups(self) -> int:
        """The cache's third-minor axis: ceil(2 * KVH / packing)."""
        return -(-2 * self.num_kv_heads // self.packing)

    @property
    def lanes(self) -> int:
        return padded_head_dim(self.head_dim)


def _row_copy(meta_ref: Any, bt_hbm: Any, rows_ref: Any, row_sem: Any, i: jax.Array) -> Any:
    """The DMA of tile ``i``'s sequence's block-table row into SMEM row slot ``i % ROW_SLOTS``."""
    slot = jax.lax.rem(i, ROW_SLOTS)
    return pltpu.make_async_copy(bt_hbm.at[meta_ref[i * _COLS + SEQ]], rows_ref.at[slot],
                                 row_sem.at[slot])


def _page_copies(meta_ref: Any, rows_ref: Any, cache_ref: Any, buf_ref: Any, sem_ref: Any,
                 block_offset: jax.Array, i: jax.Array, j: jax.Array, st: _Statics,
                 start: bool) -> None:
    """Start (or wait for) the DMAs of tile ``i``'s KV step ``j``: the pages holding keys below
    the tile's ``kv_hi``, each into its rows of slot ``step % 2``; page ids from the tile's
    block-table row (SMEM row slot ``i % ROW_SLOTS``) plus ``block_offset``."""
    base = i * _COLS
    row = jax.lax.rem(i, ROW_SLOTS)
    kv_hi = meta_ref[base + KV_HI]
    slot = jax.lax.rem(meta_ref[base + STEP0] + j - meta_ref[base + LO], 2)
    for p in range(st.pages_per_tile):
        col = j * st.pages_per_tile + p

        @pl.when(col * st.block_size < kv_hi)
        def _() -> None:
            page = rows_ref[row, jnp.minimum(col, st.max_blocks - 1)]
            page = jnp.clip(page + block_offset, 0, st.num_blocks - 1)
            copy = pltpu.make_async_copy(
                cache_ref.at[page], buf_ref.at[slot, pl.ds(p * st.block_size, st.block_size)],
                sem_ref.at[slot])
            if start:
                copy.start()
            else:
                copy.wait()


def _write_new_kv(slots_ref: Any, num_new: int, new_ref: Any, cache_ref: Any, sem_ref: Any,
                  block_offset: jax.Array, st: _Statics) -> None:
    """Copy every new token's K/V row (``slots_ref[t] >= 0``) into its cache slot, in block
    ``block_offset + slot // block_size``; return when all copies have landed."""
    def copy(t: jax.Array) -> Any:
        slot = slots_ref[t]
        page = jax.lax.div(slot, st.block_size) + block_offset
        off = jax.lax.rem(slot, st.block_size)
        return pltpu.make_async_copy(new_ref.at[pl.ds(t, 1)], cache_ref.at[page, pl.ds(off, 1)],
                                     sem_ref.at[0])

    def issue(t: jax.Array, carry: None, wait: bool) -> None:
        @pl.when(slots_ref[t] >= 0)
        def _() -> None:
            c = copy(t)
            c.wait() if wait else c.start()

    jax.lax.fori_loop(0, num_new, functools.partial(issue, wait=False), None)
    jax.lax.fori_loop(0, num_new, functools.partial(issue, wait=True), None)


def _head_kv(buf_ref: Any, slot: jax.Array, h: int, dtype: Any,
             st: _Statics) -> tuple[jax.Array, jax.Array]:
    """K and V ``[block_kv, Dp]`` of kv head ``h`` in VMEM slot ``slot`` (combined heads 2h and
    2h + 1 of the layout), as ``dtype``."""
    c, p = 2 * h, st.packing
    if st.interpret:
        kv = buf_ref[slot, :, pl.ds(c // p, max(1, 2 // p))]       # [bkv, ., packing, Dp]
        kv = kv.reshape(st.block_kv, -1, st.lanes)
        return kv[:, c % p].astype(dtype), kv[:, c % p + 1].astype(dtype)
    # Mosaic's strided loads take 128-lane rows: a word row of Dp lanes is Dp // 128 of them
    folds = st.lanes // LANES
    words = buf_ref.bitcast(jnp.uint32).at[slot].reshape(
        st.block_kv * st.head_groups * folds, LANES)

    def rows(group: int) -> jax.Array:  # [block_kv, Dp] words of head group `group`
        return jnp.concatenate([words[pl.ds(group * folds + f, st.block_kv,
                                            stride=st.head_groups * folds)]
                                for f in range(folds)], axis=1)

    cache_dtype = buf_ref.dtype
    if p == 1:
        return (pltpu.bitcast(rows(c), cache_dtype).astype(dtype),
                pltpu.bitcast(rows(c + 1), cache_dtype).astype(dtype))
    if p == 2:
        w = rows(h)
        k = pltpu.bitcast((w & 0xFFFF).astype(jnp.uint16), cache_dtype)
        v = pltpu.bitcast((w >> 16).astype(jnp.uint16), cache_dtype)
        return k.astype(dtype), v.astype(dtype)
    w = rows(c // p) >> (8 * (c % p))                  # K_h in the low byte, V_h in the next
    return low_byte_e4m3(w, dtype), low_byte_e4m3(w >> 8, dtype)


def _attend_step(q_ref: Any, buf_ref: Any, m_ref: Any, l_ref: Any, acc_ref: Any, slot: jax.Array,
                 j: jax.Array, pos0: jax.Array, nq: jax.Array, kv_hi: jax.Array,
                 st: _Statics) -> None:
    """One KV step of the online softmax for every kv head."""
    rows = st.group * st.tokens_per_tile
    kpos = j * st.block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, st.block_kv), 1)
    tok = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (st.tokens_per_tile - 1)
    qpos = pos0 + tok
    key_ok = kpos < kv_hi                                              # [1, block_kv]
    mask = (tok < nq) & key_ok & (kpos <= qpos)                        # [rows, block_kv]
    if st.sliding_window is not None:
        mask &= kpos > qpos - st.sliding_window
    key_col = jax.lax.broadcasted_iota(jnp.int32, (st.block_kv, 1), 0) + j * st.block_kv
    for h in range(st.num_kv_heads):
        q = q_ref[h]                                                   # [rows, Dp]
        k, v = _head_kv(buf_ref, slot, h, q.dtype, st)                 # [block_kv, Dp] each
        k = jnp.where(key_col < kv_hi, k, jnp.zeros_like(k))
        v = jnp.where(key_col < kv_hi, v, jnp.zeros_like(v))
        prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32) * st.sm_scale
        if st.soft_cap is not None:
            s = st.soft_cap * jnp.tanh(s / st.soft_cap)
        s = jnp.where(mask, s, NEG)
        m_prev = m_ref[h]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32)
        acc_ref[h] = alpha * acc_ref[h] + pv
        m_ref[h] = m_new


def _kernel(meta_ref: Any, scalars_ref: Any, *refs: Any, st: _Statics, num_new: int) -> None:
    """Grid step ``i``: tile ``i``'s attention for every kv head (and, when writing, step 0's
    cache write first). ``scalars_ref``: ``(n_work, block_offset)``. The slot mapping, when
    writing, is the third scalar-prefetch ref; the block table (HBM) follows the query tiles."""
    if st.write:
        slots_ref, q_ref, bt_hbm, new_ref, _cache_in, o_ref, cache_ref, buf_ref, sem_ref, \
            wsem_ref, rows_ref, row_sem, m_ref, l_ref, acc_ref = refs
    else:
        q_ref, bt_hbm, cache_ref, o_ref, buf_ref, sem_ref, rows_ref, row_sem, m_ref, l_ref, \
            acc_ref = refs
    i = pl.program_id(0)
    n_work, block_offset = scalars_ref[0], scalars_ref[1]
    base = i * _COLS
    copies = functools.partial(_page_copies, meta_ref, rows_ref, cache_ref, buf_ref, sem_ref,
                               block_offset, st=st)
    row = functools.partial(_row_copy, meta_ref, bt_hbm, rows_ref, row_sem)

    @pl.when(i == 0)
    def _() -> None:
        for t in range(ROW_SLOTS - 1):                  # the rows of tiles 0 .. ROW_SLOTS - 2
            @pl.when(t < n_work)
            def _() -> None:
                row(jnp.int32(t)).start()

        if st.write:
            _write_new_kv(slots_ref, num_new, new_ref, cache_ref, wsem_ref, block_offset, st)

        @pl.when(n_work > 0)
        def _() -> None:
            row(jnp.int32(0)).wait()
            copies(jnp.int32(0), meta_ref[LO], start=True)

    @pl.when(i + ROW_SLOTS - 1 < n_work)
    def _() -> None:
        row(i + ROW_SLOTS - 1).start()

    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    lo, hi = meta_ref[base + LO], meta_ref[base + HI]

    def kv_step(j: jax.Array, carry: None) -> None:
        last = j + 1 == hi

        @pl.when(jnp.logical_not(last))
        def _() -> None:
            copies(i, j + 1, start=True)

        @pl.when(last & (i + 1 < n_work))
        def _() -> None:
            row(i + 1).wait()
            copies(i + 1, meta_ref[base + _COLS + LO], start=True)

        copies(i, j, start=False)
        slot = jax.lax.rem(meta_ref[base + STEP0] + j - lo, 2)
        _attend_step(q_ref, buf_ref, m_ref, l_ref, acc_ref, slot, j, meta_ref[base + POS0],
                     meta_ref[base + NQ], meta_ref[base + KV_HI], st)

    jax.lax.fori_loop(lo, hi, kv_step, None)
    l = l_ref[...]
    o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


class TpuMetadata(NamedTuple):
    """What the kernel derives from the batch's metadata, once per step
    (`ragged_paged_attention_tpu_metadata`)."""

    table: jax.Array   # [num_tiles * 7]: the per-tile table (columns SEQ..STEP0), flat
    n_work: jax.Array  # [1]: tiles with work (tiles 0 .. n_work - 1)
    tok: jax.Array     # [num_tiles, rows]: the query row each tile row reads
    tile: jax.Array    # [num_tokens]: each query row's tile
    slot: jax.Array    # [num_tokens]: its token index within the tile
    valid: jax.Array   # [num_tokens]: the row is not padding


def _tpu_metadata(num_tokens: int, group: int, tpt: int, block_kv: int, kv_lens: jax.Array,
                  cu_q_lens: jax.Array, num_seqs: jax.Array,
                  sliding_window: int | None) -> TpuMetadata:
    num_tiles = max_num_tiles(num_tokens, kv_lens.shape[0], tpt)
    meta, q_first, tile_start = tile_metadata(cu_q_lens, kv_lens, num_seqs, tpt, num_tiles)
    seq, pos0, nq, kv_len = (meta[:, c] for c in range(4))
    kv_hi = jnp.minimum(kv_len, pos0 + nq)
    lo = jnp.zeros_like(pos0)
    if sliding_window is not None:
        lo = jnp.maximum(pos0 - sliding_window + 1, 0) // block_kv
    hi = jnp.where(nq > 0, (kv_hi + block_kv - 1) // block_kv, lo)
    steps = hi - lo
    step0 = jnp.cumsum(steps) - steps
    table = jnp.stack([seq, pos0, nq, kv_hi, lo, hi, step0], axis=1).astype(jnp.int32)
    n_work = jnp.sum(nq > 0, dtype=jnp.int32).reshape(1)
    # q_tiles[i, h, g * tpt + t] = q[q_first[i] + t, h * group + g]
    r = jnp.arange(group * tpt, dtype=jnp.int32)
    tok = jnp.clip(q_first[:, None] + (r % tpt)[None, :], 0, num_tokens - 1)        # [NT, R]
    tile, slot, valid = token_tiles(cu_q_lens, kv_lens, num_seqs, num_tokens, tile_start, tpt,
                                    num_tiles)
    return TpuMetadata(table.reshape(-1), n_work, tok, tile, slot, valid)


def cost_estimate(num_tokens: int, max_num_seqs: int, num_q_heads: int, lanes: int,
                  tokens_per_tile: int, context: int, kv_row_bytes: int, itemsize: int,
                  write: bool, table_row_bytes: int = 0) -> pl.CostEstimate:
    """The kernel's flops, exponentials and HBM bytes for the stated batch of the module
    docstring: each of its ``seqs`` sequences has ``share`` query rows at positions
    ``context - share .. context - 1`` (causal: row j reads ``context - share + j + 1`` keys), cut
    into tiles of ``tokens_per_tile`` rows, and each tile streams its block-table row
    (``table_row_bytes``) and the K/V pages up to its last row (``kv_row_bytes`` a token: every
    kv head of the device in the cache's layout and dtype, padding heads and lanes included).
    Query tiles are read and output tiles written once (``lanes``: head_dim padded, ``itemsize``:
    q's); the fused write adds the new tokens' rows."""
    seqs = max(1, min(num_tokens, max_num_seqs))
    share = max(1, min(num_tokens // seqs, context))
    first = context - share  # keys before a sequence's first query row
    keys_seen = share * first + share * (share + 1) // 2           # summed over its query rows
    tiles = -(-share // tokens_per_tile)
    keys_streamed = tiles * first + min(share, tokens_per_tile * tiles) * (tiles + 1) // 2
    flops = 4 * num_q_heads * lanes * seqs * keys_seen          # q.k and p.v, 2 flops a MAC
    exps = num_q_heads * seqs * keys_seen
    io = 2 * seqs * tiles * tokens_per_tile * num_q_heads * lanes * itemsize
    new = num_tokens * kv_row_bytes if write else 0
    kv = seqs * (keys_streamed * kv_row_bytes + tiles * table_row_bytes)
    return pl.CostEstimate(flops=int(flops), transcendentals=int(exps),
                           bytes_accessed=int(io + kv + new))



def _call_specs(st: _Statics, kv_cache: jax.Array, q_tiles: jax.Array, block_tables: jax.Array,
                metadata: TpuMetadata, block_offset: jax.Array, new_kv: jax.Array | None,
                slot_mapping: jax.Array | None) -> tuple[tuple, tuple, list, list, list, dict]:
    """The pallas_call's scalar prefetch, operands, in and out specs, scratch and aliases."""
    tile_spec = pl.BlockSpec((None,) + q_tiles.shape[1:], lambda i, *_: (i, 0, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scratch = [pltpu.VMEM((2, st.block_kv, *kv_cache.shape[2:]), kv_cache.dtype),
               pltpu.SemaphoreType.DMA((2,))]
    prefetch = (metadata.table, jnp.concatenate([metadata.n_work, block_offset.reshape(1)]))
    if st.write:
        prefetch += (slot_mapping.astype(jnp.int32),)
        operands = (q_tiles, block_tables, new_kv, kv_cache)
        out_specs = [tile_spec, any_spec]
        scratch.append(pltpu.SemaphoreType.DMA((1,)))
        aliases = {len(prefetch) + 3: 1}
    else:
        operands = (q_tiles, block_tables, kv_cache)
        out_specs = [tile_spec]
        aliases = {}
    in_specs = [tile_spec] + [any_spec] * (len(operands) - 1)
    kvh, rows, dq = q_tiles.shape[1:]
    scratch += [pltpu.SMEM((ROW_SLOTS, st.max_blocks), jnp.int32),
                pltpu.SemaphoreType.DMA((ROW_SLOTS,)),
                pltpu.VMEM((kvh, rows, 1), jnp.float32), pltpu.VMEM((kvh, rows, 1), jnp.float32),
                pltpu.VMEM((kvh, rows, dq), jnp.float32)]
    return prefetch, operands, in_specs, out_specs, scratch, aliases


@functools.partial(jax.jit, static_argnames=("num_kv_heads", "sm_scale", "sliding_window",
                                             "soft_cap", "interpret", "tiles"))
def _tpu_attention(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                   block_tables: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                   new_kv: jax.Array | None, slot_mapping: jax.Array | None,
                   metadata: TpuMetadata | None, block_offset: jax.Array, *,
                   num_kv_heads: int, sm_scale: float,
                   sliding_window: int | None, soft_cap: float | None,
                   interpret: bool | pltpu.InterpretParams, tiles: TpuTiles
                   ) -> tuple[jax.Array, jax.Array | None]:
    num_tokens, num_q_heads, d = q.shape
    num_blocks, block_size, head_groups, packing, dq = kv_cache.shape
    kvh = num_kv_heads
    group = num_q_heads // kvh
    max_num_seqs, max_blocks = block_tables.shape
    tpt = tiles.tokens_per_tile
    num_tiles = max_num_tiles(num_tokens, max_num_seqs, tpt)
    st = _Statics(kvh, d, group, block_size, num_blocks, max_blocks, tpt,
                  tiles.block_kv // block_size, float(sm_scale), sliding_window, soft_cap,
                  write=new_kv is not None, packing=packing,
                  interpret=interpret is not False)

    if metadata is None:
        metadata = _tpu_metadata(num_tokens, group, tpt, st.block_kv, kv_lens, cu_q_lens,
                                 num_seqs, sliding_window)
    # q_tiles[i, h, g * tpt + t] = q[q_first[i] + t, h * group + g], zero-padded to dq lanes.
    r = jnp.arange(group * tpt, dtype=jnp.int32)
    heads = jnp.arange(kvh, dtype=jnp.int32)[:, None] * group + (r // tpt)[None, :]  # [H, R]
    q_tiles = q[metadata.tok[:, None, :], heads[None, :, :]]                         # [NT, H, R, D]
    if dq != d:
        q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, 0), (0, dq - d)))

    prefetch, operands, in_specs, out_specs, scratch, aliases = _call_specs(
        st, kv_cache, q_tiles, block_tables, metadata, block_offset, new_kv, slot_mapping)
    out_shape = [jax.ShapeDtypeStruct(q_tiles.shape, q.dtype)]
    if st.write:
        out_shape.append(jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype))
    kernel = functools.partial(_kernel, st=st, num_new=num_tokens)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(num_tiles,), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        cost_estimate=cost_estimate(num_tokens, max_num_seqs, num_q_heads, dq, tpt,
                                    max_blocks * block_size,
                                    head_groups * packing * dq * kv_cache.dtype.itemsize,
                                    q.dtype.itemsize, st.write, table_row_bytes=4 * max_blocks),
        name="ragged_paged_attention_tpu",
    )(*prefetch, *operands)
    out_tiles = outs[0][..., :d]

    # Token t, q head (h, g) sits in tile `tile[t]`, kv head h, row g * tpt + slot[t].
    tile, slot, valid = metadata.tile, metadata.slot, metadata.valid
    qh = jnp.arange(num_q_heads, dtype=jnp.int32)
    out = out_tiles[tile[:, None], (qh // group)[None, :],
                    (qh % group)[None, :] * tpt + slot[:, None]]                # [T, Hq, D]
    out = jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
    new_cache = outs[1] if st.write else None
    return out, new_cache


def _layout_kv_heads(q: Any, kv_cache: Any, num_kv_heads: int | None,
                     hint: int | None = None) -> int:
    """The kv heads of a TPU-layout cache: ``num_kv_heads`` (ValueError unless the layout of that
    many has the cache's groups) or, when None, ``hint`` if its layout fits, else the one count
    whose layout fits and divides q's heads; ValueError where several do (KVH 1 and 2 take one
    group of 4: pass num_kv_heads). Shapes that fit none are left to the shared checks."""
    if kv_cache.ndim != 5:
        return 1                                        # _combined_view says why
    groups, packing = kv_cache.shape[2], kv_cache.shape[3]

    def fits(n: int) -> bool:
        return n >= 1 and -(-2 * n // packing) == groups

    if num_kv_heads is not None:
        if not fits(num_kv_heads):
            raise ValueError(f"a TPU-layout cache of {groups} x {packing} combined heads does not "
                             f"hold {num_kv_heads} kv heads (tpu_kv_cache_shape)")
        return num_kv_heads
    if hint is not None and fits(hint):
        return hint
    hq = q.shape[1] if q.ndim == 3 else 0
    counts = [n for n in range(1, groups * packing // 2 + 1) if fits(n) and hq % n == 0]
    if len(counts) > 1:
        raise ValueError(f"a TPU-layout cache of {groups} x {packing} combined heads holds any of "
                         f"{counts} kv heads for {hq} q heads: pass num_kv_heads")
    return counts[0] if counts else max(1, groups * packing // 2)


def _combined_view(q: jax.Array, kv_cache: jax.Array, kvh: int) -> jax.ShapeDtypeStruct:
    """The section-2 shape ``[num_blocks, block_size, 2 * KVH, D]`` of a TPU-layout cache of
    ``kvh`` heads, for the shared checks; ValueError unless the cache is in the TPU layout of
    q's head_dim."""
    d = q.shape[-1] if q.ndim == 3 else -1
    if kv_cache.ndim != 5:
        raise ValueError("kv_cache must be in the TPU layout [num_blocks, block_size, "
                         "ceil(2 * KVH / packing), packing, head_dim padded to 128] "
                         f"(tpu_kv_cache_shape), got shape {kv_cache.shape}")
    num_blocks, block_size, groups, packing, lanes = kv_cache.shape
    if packing != kv_packing(kv_cache.dtype) or lanes != padded_head_dim(max(d, 1)):
        raise ValueError(f"kv_cache {kv_cache.shape} {kv_cache.dtype} is not the TPU layout of "
                         f"head_dim {d} (tpu_kv_cache_shape gives packing "
                         f"{kv_packing(kv_cache.dtype)} and {padded_head_dim(max(d, 1))} lanes)")
    if groups != kv_head_groups(kvh, kv_cache.dtype):
        raise ValueError(f"kv_cache {kv_cache.shape} is not the TPU layout of {kvh} kv heads")
    return jax.ShapeDtypeStruct((num_blocks, block_size, 2 * kvh, d), kv_cache.dtype)


def _tiles(q: Any, kv_cache: Any, kv_lens: jax.Array, block_tables: Any, kvh: int,
           tiles: TpuTiles | None, write: bool) -> TpuTiles:
    """``tiles`` or `default_tpu_tiles`, checked against the shapes and the SMEM budget."""
    block_size = kv_cache.shape[1]
    if block_size % 8:
        raise ValueError(f"the TPU kernel needs block_size to be a multiple of 8, got {block_size}")
    groups, packing, lanes = kv_cache.shape[2:]
    group = q.shape[1] // kvh
    if tiles is None:
        tiles = default_tpu_tiles(q.shape[0], kv_lens.shape[0], group, block_size,
                                  groups * packing * lanes * kv_cache.dtype.itemsize,
                                  q.dtype.itemsize)
    tpt = tiles.tokens_per_tile
    if tpt < 1 or tpt & (tpt - 1) or tiles.block_kv % block_size or tiles.block_kv < block_size:
        raise ValueError(f"tiles: tokens_per_tile must be a power of two and block_kv a positive "
                         f"multiple of block_size ({block_size}), got {tiles}")
    sublanes = 8 * (4 // q.dtype.itemsize)
    if (tpt * group) % sublanes:
        raise ValueError(f"tiles: tokens_per_tile x GQA group ({tpt} x {group}) must be a multiple "
                         f"of {sublanes} rows for {q.dtype.name}, got {tiles}")
    check_smem(q.shape[0], kv_lens.shape[0], block_tables.shape[1], tpt, write)
    return tiles


def _resolve(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array, block_tables: jax.Array,
             kvh: int, sliding_window: int | None, soft_cap: float | None,
             interpret: bool | pltpu.InterpretParams | None, tiles: TpuTiles | None, kind: str,
             write: bool) -> dict:
    check_kind(kind)  # one kernel serves every kind
    tiles = _tiles(q, kv_cache, kv_lens, block_tables, kvh, tiles, write)
    if interpret is None or isinstance(interpret, bool):  # else pltpu.InterpretParams
        interpret = resolve_interpret(interpret, native="tpu")
    if interpret is True:
        interpret = pltpu.InterpretParams()
    return dict(num_kv_heads=kvh,
                sliding_window=None if sliding_window is None else int(sliding_window),
                soft_cap=None if soft_cap is None else float(soft_cap),
                interpret=interpret, tiles=tiles)


def ragged_paged_attention_tpu_metadata(q: Any, kv_cache: Any, kv_lens: jax.Array,
                                        block_tables: jax.Array, cu_q_lens: jax.Array,
                                        num_seqs: jax.Array, *, sliding_window: int | None = None,
                                        tiles: TpuTiles | None = None, kind: str = MIXED,
                                        num_kv_heads: int | None = None) -> TpuMetadata:
    """The per-step metadata both TPU kernels take (``metadata=``) for the same arguments and
    options: compute it once and pass it to every layer's call. ``q`` and ``kv_cache`` are read
    for their shapes and dtypes only (ShapeDtypeStructs will do); ``num_kv_heads``: as
    `ragged_paged_attention_tpu`'s."""
    check_kind(kind)
    kvh = _layout_kv_heads(q, kv_cache, num_kv_heads)
    tiles = _tiles(q, kv_cache, kv_lens, block_tables, kvh, tiles, write=False)
    return _tpu_metadata(q.shape[0], q.shape[1] // kvh, tiles.tokens_per_tile, tiles.block_kv,
                         kv_lens, cu_q_lens, num_seqs, sliding_window)


def ragged_paged_attention_tpu(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                               block_tables: jax.Array, cu_q_lens: jax.Array,
                               num_seqs: jax.Array, *, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               interpret: bool | pltpu.InterpretParams | None = None,
                               tiles: TpuTiles | None = None, kind: str = MIXED,
                               metadata: TpuMetadata | None = None,
                               num_kv_heads: int | None = None,
                               block_offset: jax.Array | int = 0) -> jax.Array:
    """Ragged paged attention (docs/API.md §2 and §2a) through the Mosaic kernel.

    ``interpret``: True (or an ``InterpretParams``) runs Pallas' TPU interpret mode on any
    backend; None picks it off TPU. Padding rows come out as zeros. ``kv_cache`` is in the TPU
    layout (`tpu_kv_cache_shape`; q's dtype, or float8_e4m3fn read upcast to it); the block size
    a multiple of 8. ``num_kv_heads``: the cache's kv heads, needed only where its padded
    layout fits several (an 8-bit cache). ``kind`` is checked (one kernel serves every kind);
    ``metadata``: `ragged_paged_attention_tpu_metadata` of the same arguments (computed here
    when None). ``block_offset`` (an int32 scalar) is added to every block id read from
    ``block_tables``. ValueError where the shapes pass the SMEM budget (`check_smem`)."""
    kvh = _layout_kv_heads(q, kv_cache, num_kv_heads)
    validate_attention_inputs(q, _combined_view(q, kv_cache, kvh), kv_lens, block_tables,
                              cu_q_lens, num_seqs, sm_scale, sliding_window, soft_cap)
    opts = _resolve(q, kv_cache, kv_lens, block_tables, kvh, sliding_window, soft_cap, interpret,
                    tiles, kind, write=False)
    out, _ = _tpu_attention(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs, None, None,
                            metadata, block_offset_scalar(block_offset),
                            sm_scale=float(sm_scale), **opts)
    return out


def ragged_paged_attention_tpu_update(q: jax.Array, k: jax.Array, v: jax.Array,
                                      kv_cache: jax.Array, slot_mapping: jax.Array,
                                      kv_lens: jax.Array, block_tables: jax.Array,
                                      cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                                      sm_scale: float, sliding_window: int | None = None,
                                      soft_cap: float | None = None,
                                      interpret: bool | pltpu.InterpretParams | None = None,
                                      tiles: TpuTiles | None = None, kind: str = MIXED,
                                      metadata: TpuMetadata | None = None,
                                      block_offset: jax.Array | int = 0
                                      ) -> tuple[jax.Array, jax.Array]:
    """``write_kv_cache(kv_cache, k, v, slot_mapping)`` then ``ragged_paged_attention_tpu`` in one
    kernel; returns ``(out, kv_cache)``. The cache is aliased in to out, so under a donated cache
    the step makes one pass over it. Negative slots (padding tokens) are skipped; ``k, v`` are
    cast to the cache's dtype as `write_kv_cache` casts them (`kv_cache.quantize_kv`: an fp8
    cache saturates at its largest finite value). ``block_offset`` (an int32 scalar) is added
    to every block id, those of ``block_tables`` and those of the slots: slot ``s >= 0`` is
    token ``s % block_size`` of block ``block_offset + s // block_size``."""
    kvh = _layout_kv_heads(q, kv_cache, None, hint=k.shape[1] if k.ndim == 3 else None)
    view = _combined_view(q, kv_cache, kvh)
    validate_attention_inputs(q, view, kv_lens, block_tables, cu_q_lens, num_seqs,
                              sm_scale, sliding_window, soft_cap)
    validate_new_kv(view, k, v, slot_mapping)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must have q's {q.shape[0]} tokens, got {k.shape[0]}")
    opts = _resolve(q, kv_cache, kv_lens, block_tables, kvh, sliding_window, soft_cap, interpret,
                    tiles, kind, write=True)
    new_kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], 1, -1, k.shape[2])  # [T, 1, 2KVH, D]
    new_kv = to_tpu_kv_cache(quantize_kv(new_kv, kv_cache.dtype))[:, 0]  # [T, groups, packing, Dp]
    return _tpu_attention(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs, new_kv,
                          slot_mapping, metadata, block_offset_scalar(block_offset),
                          sm_scale=float(sm_scale), **opts)

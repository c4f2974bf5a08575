"""Ragged paged attention in XLA, tuned for XLA:CPU: the production attention backend on CPU.

Work layout: query rows are grouped into tiles of up to ``tokens_per_tile`` consecutive tokens of
one sequence (``metadata.tile_metadata``). A *work item* is one tile and one chunk of whole pages
(``pages_per_item``) that some row of the tile may see: chunks past the tile's last position
(causal) or wholly before its sliding window are never listed, so the work is the ragged sum of
what each tile needs, not tiles x the longest sequence. A loop takes ``items_per_step``
consecutive items at a time (a data-dependent trip count) and merges each item's partial softmax
(max, sum, weighted values) into its tile's running state. Slots of the last loop step past the
list all read one page (block 0).

An item gathers whole token rows of the cache (a token's K and V of every head, contiguous) in
one gather. Tiles of at most ``TRANSPOSED_K_MAX_TILE`` tokens (decode rows) take K transposed,
``[W, h, D, keys]``, behind an optimization barrier: XLA:CPU's dot runs faster with a row-major
right operand.

Tile sizes (`_passes`), chosen statically from the bucket and the step's kind (the host's
promise about the batch, `xla_step_kind`; never a run-time branch): buckets under
``SPLIT_MIN_TOKENS`` rows take one tile size for every sequence (``tokens_per_tile``). In bigger
buckets a decode step takes one pass of one-token tiles; any other step two passes over the one
cache, like vLLM's backends: the runs longer than ``SHORT_RUN`` tokens in 16- or 32-token tiles,
then the shorter runs (decodes) in one-token tiles, scattered over the first pass's output (a
pass with no sequences costs its setup and no loop step). A prefill step (buckets of
``LONG_RUN``+ rows whose longest run reaches ``LONG_RUN`` tokens, with at most ``LONG_MAX_SEQS``
long runs) takes ``LONG_TILE``-token tiles for its long pass.

Invariants (docs/API.md §2): query row ``cu_q_lens[s] + j`` of sequence ``s`` sits at position
``kv_lens[s] - q_len_s + j`` and sees cache positions ``p <= position`` (and
``p > position - sliding_window`` when set). Rows past ``cu_q_lens[num_seqs[0]]`` are padding and
come out as zeros. Cache slots outside the valid lengths (NaN included) never reach the output:
values are zeroed before every dot, and scores of invisible keys are masked before the softmax.

The cache holds q's dtype or fp8 (``common.QUANTIZED_KV_DTYPES``, scale 1): items gather token
rows in the cache's dtype (an fp8 cache's at a byte per value) and upcast K and V to float32, like
q, before the dots. Metadata and step kinds depend on shapes only, never on dtypes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import (DECODE, MIXED, PREFILL, block_offset_scalar, check_kind,
                                   kv_values, validate_attention_inputs)
from pallas_kernels.metadata import max_num_tiles, tile_metadata, token_tiles

_NEG = -1e30  # finite "minus infinity": a fully masked row keeps exp(score - max) finite.


LONG_RUN = 512   # a query run this long (buckets of as many rows or more) takes LONG_TILE tiles
LONG_TILE = 128  # tokens per tile of the long-run layout: fewer, fatter dots for long prompts
LONG_MAX_SEQS = 8  # ... when no more long runs than this are live
SPLIT_MIN_TOKENS = 64  # buckets this big run short and long query runs in separate passes
SHORT_RUN = 4          # ... where runs of at most this many tokens (decodes) take one-token tiles


def tokens_per_tile(num_tokens: int, max_num_seqs: int) -> int:
    """The tile of a bucket's query runs: in buckets under ``SPLIT_MIN_TOKENS`` rows, one token
    unless each sequence averages more rows (a power of two, up to 16); in bigger ones the tile of
    the runs longer than ``SHORT_RUN``: 16 tokens, 32 in buckets of 1024+ rows. (Short runs there
    take one-token tiles, and long runs at low concurrency ``LONG_TILE``.)"""
    if num_tokens >= SPLIT_MIN_TOKENS:
        return 32 if num_tokens >= 1024 else 16
    per_seq = max(1, num_tokens // max(1, max_num_seqs))
    return min(16, 1 << (per_seq.bit_length() - 1))


def pages_per_item(block_size: int, tpt: int = 1) -> int:
    """Whole pages per work item (at least one) of ``tpt``-token tiles: about 32 keys, 64 for
    32-token tiles, 256 for ``LONG_TILE`` tiles; fatter tiles amortise longer items."""
    keys = 256 if tpt >= LONG_TILE else 64 if tpt >= 32 else 32
    return max(1, keys // block_size)


def items_per_step(tpt: int, num_tokens: int) -> int:
    """Work items per loop step for ``tpt``-token tiles: 8 for ``LONG_TILE`` tiles; else 32 in big
    buckets (32+ rows for one-token tiles, 256+ for longer ones) and 16 in small ones, so a step's
    pages stay in the core's cache and a small bucket's few items drag few dead slots along."""
    if tpt >= LONG_TILE:
        return 8
    return 32 if num_tokens >= (32 if tpt == 1 else 256) else 16


TRANSPOSED_K_MAX_TILE = 4  # tiles this small take K^T: see _scores


@dataclass(frozen=True)
class _Pass:
    """One pass over the query runs of the sequences ``runs`` picks ("all", "short": at most
    SHORT_RUN rows, "long": more) in ``tpt``-token tiles, for steps where those are at most
    ``max_live`` sequences of at most ``max_rows`` rows (static bounds of the tile count). A
    ``scatter`` pass writes its rows over the previous pass's output."""

    tpt: int
    max_live: int
    runs: str = "all"
    max_rows: int | None = None
    scatter: bool = False


def _passes(num_tokens: int, max_num_seqs: int, kind: str) -> tuple[_Pass, ...]:
    """The passes of a bucket of ``num_tokens`` rows for a step of ``kind`` (module docstring)."""
    if num_tokens < SPLIT_MIN_TOKENS:
        return (_Pass(tokens_per_tile(num_tokens, max_num_seqs), max_num_seqs),)
    if kind == DECODE:
        return (_Pass(1, max_num_seqs),)
    long_live = min(max_num_seqs, num_tokens // (SHORT_RUN + 1))
    long_pass = _Pass(tokens_per_tile(num_tokens, max_num_seqs), long_live, "long")
    if kind == PREFILL and num_tokens >= LONG_RUN:
        long_pass = _Pass(LONG_TILE, min(LONG_MAX_SEQS, long_live), "long")
    return long_pass, _Pass(1, max_num_seqs, "short", SHORT_RUN * max_num_seqs, scatter=True)


def xla_step_kinds(num_tokens: int) -> tuple[str, ...]:
    """The step kinds this path compiles apart in a bucket of ``num_tokens`` rows."""
    if num_tokens < SPLIT_MIN_TOKENS:
        return (MIXED,)
    return (MIXED, DECODE, PREFILL) if num_tokens >= LONG_RUN else (MIXED, DECODE)


def xla_step_kind(q_lens: np.ndarray, num_tokens: int) -> str:
    """The kind of a batch whose live sequences have ``q_lens`` query rows (host side): DECODE
    when each has one, PREFILL when its longest run reaches LONG_RUN and at most LONG_MAX_SEQS
    runs are longer than SHORT_RUN, else MIXED; MIXED wherever the bucket has one layout."""
    kinds, q = xla_step_kinds(num_tokens), np.asarray(q_lens)
    if DECODE in kinds and len(q) and (q == 1).all():
        return DECODE
    if PREFILL in kinds and len(q) and q.max() >= LONG_RUN and (q > SHORT_RUN).sum() <= LONG_MAX_SEQS:
        return PREFILL
    return MIXED


class PassMetadata(NamedTuple):
    """One pass's per-step metadata: its tiles (`metadata.tile_metadata`'s table and first query
    rows), their work lists (`_work_list`), and where its rows go: a gathering pass's ``tile``,
    ``slot`` and ``valid`` per query row, a scattering pass's ``dest`` per tile row."""

    meta: jax.Array
    q_first: jax.Array
    first: jax.Array
    item_start: jax.Array
    item_end: jax.Array
    tile: jax.Array | None = None
    slot: jax.Array | None = None
    valid: jax.Array | None = None
    dest: jax.Array | None = None


def _pass_metadata(p: _Pass, num_tokens: int, block_size: int, kv_lens: jax.Array,
                   cu_q_lens: jax.Array, num_seqs: jax.Array, sliding_window: int | None,
                   include: jax.Array | None = None) -> PassMetadata:
    """Pass ``p``'s metadata; ``include`` (a mask over sequences) overrides ``p.runs``."""
    max_num_seqs = kv_lens.shape[0]
    if include is None and p.runs != "all":
        live = jnp.arange(max_num_seqs) < num_seqs[0]
        q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
        include = live & ((q_lens <= SHORT_RUN) if p.runs == "short" else (q_lens > SHORT_RUN))
    num_tiles = max_num_tiles(min(num_tokens, p.max_rows or num_tokens), p.max_live, p.tpt)
    meta, q_first, tile_start = tile_metadata(cu_q_lens, kv_lens, num_seqs, p.tpt, num_tiles,
                                              include)
    keys = pages_per_item(block_size, p.tpt) * block_size
    work = _work_list(meta[:, 1], meta[:, 2], keys, sliding_window)
    if p.scatter:
        j = jnp.arange(p.tpt, dtype=jnp.int32)
        dest = jnp.where(j[None, :] < meta[:, 2:3], q_first[:, None] + j[None, :], num_tokens)
        return PassMetadata(meta, q_first, *work, dest=dest)
    tile, slot, valid = token_tiles(cu_q_lens, kv_lens, num_seqs, num_tokens, tile_start, p.tpt,
                                    num_tiles)
    return PassMetadata(meta, q_first, *work, tile=tile, slot=slot, valid=valid)


def ragged_paged_attention_xla_metadata(q: Any, kv_cache: Any, kv_lens: jax.Array,
                                        block_tables: jax.Array, cu_q_lens: jax.Array,
                                        num_seqs: jax.Array, *, sliding_window: int | None = None,
                                        kind: str = MIXED) -> tuple[PassMetadata, ...]:
    """The per-step metadata `ragged_paged_attention_xla` takes (``metadata=``) for the same
    arguments and options, one entry per pass: compute it once and pass it to every layer's
    call. ``q`` and ``kv_cache`` are read for their shapes only (ShapeDtypeStructs of any
    dtypes will do)."""
    check_kind(kind)
    num_tokens, block_size = q.shape[0], kv_cache.shape[1]
    return tuple(_pass_metadata(p, num_tokens, block_size, kv_lens, cu_q_lens, num_seqs,
                                sliding_window)
                 for p in _passes(num_tokens, kv_lens.shape[0], kind))


def ragged_paged_attention_xla(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                               block_tables: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                               *, sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, interpret: bool | None = None,
                               kind: str = MIXED,
                               metadata: tuple[PassMetadata, ...] | None = None,
                               block_offset: jax.Array | int = 0) -> jax.Array:
    """Ragged paged attention (docs/API.md §2) in XLA; ``interpret`` is accepted and ignored.
    Block ids are ``block_tables``' plus the int32 scalar ``block_offset`` (added to the few ids
    each work item gathers, never to the table).

    Reads q and the cache (q's dtype or fp8) as float32, accumulates in float32 and returns
    ``q.dtype``; jit-able (static shapes; the item loops have data-dependent trip counts).
    ``kind`` (a promise about the batch, `xla_step_kind`) picks the passes statically: see the
    module docstring. ``metadata``:
    `ragged_paged_attention_xla_metadata` of the same arguments (computed here when None).
    """
    del interpret
    validate_attention_inputs(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                              sm_scale, sliding_window, soft_cap)
    passes = _passes(q.shape[0], kv_lens.shape[0], check_kind(kind))
    block_offset = block_offset_scalar(block_offset)
    if metadata is None:
        metadata = ragged_paged_attention_xla_metadata(q, kv_cache, kv_lens, block_tables,
                                                       cu_q_lens, num_seqs,
                                                       sliding_window=sliding_window, kind=kind)
    out = None
    for p, md in zip(passes, metadata, strict=True):
        out = _pass_attention(q, kv_cache, block_tables, p, md, sm_scale, sliding_window,
                              soft_cap, out, block_offset)
    return out


def _work_list_attention(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                         block_tables: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                         tpt: int, max_live: int, sm_scale: float, sliding_window: int | None,
                         soft_cap: float | None, include: jax.Array | None = None) -> jax.Array:
    """One gathering pass with ``tpt``-token tiles over the live sequences in ``include``
    (default: all), for steps where those hold at most ``max_live`` sequences: every row of the
    batch, padding rows zero and rows outside ``include`` unspecified (for tests of a layout)."""
    p = _Pass(tpt, max_live)
    md = _pass_metadata(p, q.shape[0], kv_cache.shape[1], kv_lens, cu_q_lens, num_seqs,
                        sliding_window, include)
    return _pass_attention(q, kv_cache, block_tables, p, md, sm_scale, sliding_window, soft_cap)


def _pass_attention(q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, layout: _Pass,
                    md: PassMetadata, sm_scale: float, sliding_window: int | None,
                    soft_cap: float | None, into: jax.Array | None = None,
                    block_offset: jax.Array | int = 0) -> jax.Array:
    """Pass ``layout`` (the work-list attention of the module docstring) from its metadata, block
    ids shifted by ``block_offset``. Returns every row of the batch, padding rows zero and rows
    outside the pass unspecified; or, for a scattering pass, ``into`` with the pass's rows
    overwritten (an in-place scatter)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, combined, _ = kv_cache.shape
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    tpt = layout.tpt
    num_tiles = md.meta.shape[0]
    rows = tpt * group

    seq, pos0, nq, kv_len = md.meta[:, 0], md.meta[:, 1], md.meta[:, 2], md.meta[:, 3]
    # Rows r = token * group + g of a tile, laid out [tile, kv head, row] for batched dots.
    r = jnp.arange(rows, dtype=jnp.int32)
    row_ok = (r // group)[None, :] < nq[:, None]                             # [N, R]
    q_pos = pos0[:, None] + (r // group)[None, :]                            # [N, R]
    qt = _query_tiles(q, md.q_first, tpt, num_kv_heads) * sm_scale   # [N, h, R, D]

    ppi = pages_per_item(block_size, tpt)
    keys = ppi * block_size
    first, item_start, item_end = md.first, md.item_start, md.item_end
    total = item_end[-1]
    width = items_per_step(tpt, num_tokens)
    tables = jnp.pad(block_tables, ((0, 0), (0, -max_blocks % ppi)))
    # one cache row per token: its K and V of every head, [k0, v0, k1, v1, ...] (docs/API.md §2)
    token_rows = kv_cache.reshape(num_blocks * block_size, combined * head_dim)
    in_page = jnp.arange(block_size, dtype=jnp.int32)

    def item_step(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, l, acc = carry
        ids = c * width + jnp.arange(width, dtype=jnp.int32)
        live = ids < total
        # compare_all: one fused compare of W ids x num_tiles ends; the default binary-search
        # scan is a nested loop of tiny ops
        tile = jnp.searchsorted(item_end, ids, side="right", method="compare_all")
        tile = jnp.minimum(tile, num_tiles - 1).astype(jnp.int32)
        chunk = first[tile] + ids - item_start[tile]                                # [W]
        rows_kv = kv_values(_gather_items(token_rows, tables, block_offset, seq[tile], chunk,
                                          live, ppi, in_page, num_kv_heads,
                                          head_dim))                         # [W, K, h, 2, D]
        k = rows_kv[:, :, :, 0].astype(jnp.float32)                          # [W, K, h, D]
        kpos = chunk[:, None] * keys + jnp.arange(keys, dtype=jnp.int32)[None, :]     # [W, K]
        key_ok = live[:, None] & (kpos < kv_len[tile][:, None])
        v = jnp.where(key_ok[:, :, None, None], rows_kv[:, :, :, 1].astype(jnp.float32),
                      0.0)                                  # [W, K, h, D]; 0 * NaN stays out
        s = _scores(qt[tile], k, tpt)                                       # [W, h, R, K]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        qp = q_pos[tile]
        visible = key_ok[:, None, :] & row_ok[tile][:, :, None] & (kpos[:, None, :] <= qp[:, :, None])
        if sliding_window is not None:
            visible &= kpos[:, None, :] > qp[:, :, None] - sliding_window
        visible = visible[:, None]                                          # [W, 1, R, K]
        s = jnp.where(visible, s, _NEG)                                     # NaN scores dropped
        m_item = s.max(-1)
        p = jnp.where(visible, jnp.exp(s - m_item[..., None]), 0.0)
        acc_item = jnp.einsum("whrk,wkhd->whrd", p, v, precision=jax.lax.Precision.HIGHEST)
        return _merge_items(m, l, acc, tile, m_item, p.sum(-1), acc_item, num_tiles)

    shape = (num_tiles, num_kv_heads, rows)
    init = (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, (total + width - 1) // width, item_step, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = out.reshape(num_tiles, num_kv_heads, tpt, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_tiles, tpt, num_q_heads, head_dim).astype(q.dtype)
    if layout.scatter:  # tile rows scattered over `into`; rows of other tiles dropped
        return into.at[md.dest].set(out, mode="drop")
    return jnp.where(md.valid[:, None, None], out[md.tile, md.slot], 0).astype(q.dtype)


def _query_tiles(q: jax.Array, q_first: jax.Array, tpt: int, num_kv_heads: int) -> jax.Array:
    """Each tile's ``tpt`` query tokens from ``q_first`` on as rows r = token * group + g,
    float32 ``[tiles, kv heads, tpt * group, D]`` (rows past the batch clipped to its last)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    tok = jnp.clip(q_first[:, None] + jnp.arange(tpt, dtype=jnp.int32)[None, :], 0, num_tokens - 1)
    qt = q[tok].astype(jnp.float32).reshape(-1, tpt, num_kv_heads, group, head_dim)
    return qt.transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, tpt * group, head_dim)


def _scores(qt: jax.Array, k: jax.Array, tpt: int) -> jax.Array:
    """``qt [W, h, R, D] . k [W, K, h, D]`` -> ``[W, h, R, K]``; small tiles take K transposed
    first (a layout XLA:CPU's dot runs faster)."""
    if tpt <= TRANSPOSED_K_MAX_TILE:
        k_t = jax.lax.optimization_barrier(k.transpose(0, 2, 3, 1))             # [W, h, D, K]
        return jnp.einsum("whrd,whdk->whrk", qt, k_t, precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("whrd,wkhd->whrk", qt, k, precision=jax.lax.Precision.HIGHEST)


def _work_list(pos0: jax.Array, nq: jax.Array, keys: int, sliding_window: int | None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tile t (first position ``pos0[t]``, ``nq[t]`` rows) owns items ``[item_start[t],
    item_end[t])``, the ``keys``-key chunks ``first[t], first[t] + 1, ...`` it can see: none past
    its last row (causal), none wholly before its window."""
    visible_end = jnp.where(nq > 0, pos0 + nq, 0)
    first = jnp.zeros_like(pos0) if sliding_window is None else (
        jnp.maximum(pos0 - sliding_window + 1, 0) // keys)
    n_items = jnp.where(nq > 0, (visible_end + keys - 1) // keys - first, 0)
    item_end = jnp.cumsum(n_items).astype(jnp.int32)
    return first, item_end - n_items, item_end


def _gather_items(token_rows: jax.Array, tables: jax.Array, block_offset: jax.Array | int,
                  seq: jax.Array, chunk: jax.Array, live: jax.Array, ppi: int, in_page: jax.Array,
                  num_kv_heads: int, head_dim: int) -> jax.Array:
    """``[W, keys, KVH, 2, D]``: the token rows (K and V of every head) of each item's chunk of
    ``ppi`` pages of sequence ``seq`` (page ids: ``tables``' plus ``block_offset``); items past
    the list (not ``live``) read page 0. ``in_page``: the offsets 0..block_size-1."""
    block_size = in_page.shape[0]
    num_blocks = token_rows.shape[0] // block_size
    cols = jnp.clip(chunk[:, None] * ppi + jnp.arange(ppi)[None, :], 0, tables.shape[1] - 1)
    pages = jnp.clip(tables[seq[:, None], cols] + block_offset, 0, num_blocks - 1)
    pages = jnp.where(live[:, None], pages, 0)                                  # [W, P]
    rows = (pages[:, :, None] * block_size + in_page)
    rows = rows.reshape(chunk.shape[0], ppi * block_size)
    # rows are in range; "clip" spares every consumer fusion the "fill" mode's bounds checks
    return jnp.take(token_rows, rows, axis=0, mode="clip").reshape(
        chunk.shape[0], ppi * block_size, num_kv_heads, 2, head_dim)


def _merge_items(m: jax.Array, l: jax.Array, acc: jax.Array, tile: jax.Array, m_item: jax.Array,
                 l_item: jax.Array, acc_item: jax.Array, num_tiles: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merge items' partial softmax (max, sum, weighted values) into their tiles' running state,
    touching those tiles only (in-place scatters). Several items of one tile may sit in one step
    (they are consecutive): its old state is rescaled once, through its first item, and every
    item adds its part at the new maximum."""
    m_new = m.at[tile].max(m_item)
    first_of_tile = jnp.concatenate([jnp.ones((1,), bool), tile[1:] != tile[:-1]])
    rescaled = jnp.where(first_of_tile, tile, num_tiles)   # others dropped (out of bounds)
    alpha = jnp.exp(m[tile] - m_new[tile])
    scale = jnp.exp(m_item - m_new[tile])
    l = l.at[rescaled].multiply(alpha, mode="drop").at[tile].add(l_item * scale)
    acc = acc.at[rescaled].multiply(alpha[..., None], mode="drop").at[tile].add(
        acc_item * scale[..., None])
    return m_new, l, acc

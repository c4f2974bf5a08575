"""The Mosaic TPU kernel (pallas_kernels/tpu_attention.py) without a TPU: Pallas' TPU interpret
mode (simulated HBM, VMEM, SMEM, DMAs and semaphores) against the float64 oracle on the shared
NaN-poisoned cases, the fused cache write against `write_kv_cache`, the interpreter's race
detector on the double buffering, float8_e4m3fn caches against the oracle of their upcast values,
the TPU layout's conversions (packing 4 and per-device padding included), the SMEM budget, and
TPU's own compiler (libtpu, ahead of time for a TPU topology): every model shape compiles (fp8
caches and block tables too wide for SMEM included), neither entry point copies the cache, and the
fused write updates it in place (with a traced block_offset, as the model's layers pass it).
Layered cases (here LAYERED, and cases.LAYERED) read and write one layer of a stacked cache viewed
as one through block_offset, the other layers NaN and left untouched. (The interpreter lands a
DMA at its wait, so a page or block-table row read before its wait reads stale data, and the
oracle cases fail.)

Truths: cases.oracle (float64 numpy), pallas_kernels.write_kv_cache (an XLA scatter) in section
2's layout, numpy index arithmetic for the TPU layout, XLA's memory analysis of the compiled
programs.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cases import make_batch, oracle, random_seqs, run_case, stacked_cache
from pallas_kernels import (TpuTiles, from_tpu_kv_cache, ragged_paged_attention_tpu,
                            ragged_paged_attention_tpu_metadata, ragged_paged_attention_tpu_update,
                            to_tpu_kv_cache, tpu_kv_cache_shape, write_kv_cache)
from pallas_kernels.tpu_attention import (SMEM_LIMIT, check_smem, default_tpu_tiles,
                                          low_byte_e4m3, smem_bytes)


def _races_found() -> bool:
    """The interpreter's race-detection verdict for the last kernel run with detect_races."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    return bool(ipc.races is not None and ipc.races.races_found)


def _tol(dtype) -> float:
    return 2e-2 if dtype == jnp.bfloat16 else 1e-5


# KV steps of the oracle cases: ORACLE_PAGES pages, twice as many where those would hold SLOW_KEYS
# keys. The kernel unrolls its page DMAs (`_page_copies`: a `pl.when` per page, at four sites),
# and the interpreter's compile time grows with them: the default tiles take up to 64 pages (512
# keys) a step, so every case's sequences (<= 70 keys) fit one KV step and most of its pages are
# skipped, at ~10 s of compiling a case. Steps of 16-128 keys make the same cases walk 1-5 KV
# steps a tile, through the double-buffered hand-over between steps and tiles, with the last
# step's pages past kv_hi skipped (test_oracle_tiles_walk_the_pipeline checks that they do).
# XLA:CPU compiles the interpreted kernel's dots over 32-key steps ~1.6x slower than over 16 or
# 64 keys (~5.5 s against ~3.5 s a case on the 2-core CI machine): block size 8 takes two pages
# a step, block size 16 four. The default tiles themselves run against the oracle in
# test_random_batches_share_one_compile (8 pages a step) and the fused-write case
# "default_tiles_b64_gqa1" below (8), and against transformers in tests/engine/test_tpu_backend.py
# (SmolLM2's: 21 pages, 32 under tensor parallelism).
ORACLE_PAGES = 2
SLOW_KEYS = 32


def _oracle_tiles(args: tuple, dtype) -> TpuTiles:
    """The default tiles of the case's shapes (its tokens_per_tile: the row tiling), with KV
    steps of ORACLE_PAGES pages (twice as many where those hold SLOW_KEYS keys), or fewer where
    the default takes fewer."""
    q, cache, kv_lens = args[:3]
    block_size, lanes = cache.shape[1], -(-q.shape[2] // 128) * 128
    itemsize = jnp.dtype(dtype).itemsize
    tiles = default_tpu_tiles(q.shape[0], kv_lens.shape[0], q.shape[1] // (cache.shape[2] // 2),
                              block_size, cache.shape[2] * lanes * itemsize, itemsize)
    pages = ORACLE_PAGES * (2 if ORACLE_PAGES * block_size == SLOW_KEYS else 1)
    return TpuTiles(tiles.tokens_per_tile, min(tiles.block_kv, pages * block_size))


# The shared cases the interpreted kernel runs (each ~5 s on the CI machine): every kind of
# batch, GQA groups 3, 4 and 8, head_dim 64 and 128, both dtypes, block sizes 8 to 64, a window
# with a soft cap. (MHA and a window or a soft cap alone: the fused-write cases below and the
# GPU kernel's run of every case; all of them when compiled on a GPU or a TPU run elsewhere.)
TPU_CASES = ["decode_gqa4_d64_b16", "chunked_gqa8_d64_b16", "mixed_window_softcap_bf16",
             "decode_gqa8_bf16_d128", "prefill_gqa3_bf16_b8", "mixed_gqa3_b64"]


@pytest.mark.parametrize("name", TPU_CASES)
def test_tpu_kernel_matches_oracle(name: str) -> None:
    """The case against the oracle, padding rows zeros; then the same compiled kernel on the
    batch with num_seqs = 0: every row is padding and comes out as zeros, whatever the cache
    holds (no page is fetched)."""
    args, truth, kw, total, dtype = run_case(name)
    fn = jax.jit(functools.partial(ragged_paged_attention_tpu, **kw,
                                   tiles=_oracle_tiles(args, dtype), interpret=True))
    args = (args[0], to_tpu_kv_cache(args[1]), *args[2:])
    out = fn(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, truth, atol=_tol(dtype), rtol=_tol(dtype))
    assert np.all(out[total:] == 0), "padding rows must be zeros"
    assert np.all(np.asarray(fn(*args[:5], jnp.zeros_like(args[5]))) == 0)
    assert fn._cache_size() == 1


def _kv_walk(name: str) -> list[tuple[int, bool]]:
    """Per tile with work of CASES[name] under _oracle_tiles: (its KV steps, whether its last step
    leaves pages unfetched past kv_hi), counted in numpy from the tiling rules (tpu_attention's
    module docstring)."""
    args, _, kw, _, dtype = run_case(name)
    tiles = _oracle_tiles(args, dtype)
    _, cache, kv_lens, _, cu, num_seqs = (np.asarray(a) for a in args)
    tpt, block_kv, block_size, window = (tiles.tokens_per_tile, tiles.block_kv, cache.shape[1],
                                         kw["sliding_window"])
    walk = []
    for s in range(int(num_seqs[0])):
        q_len, kv_len = int(cu[s + 1] - cu[s]), int(kv_lens[s])
        for first in range(0, q_len, tpt):
            pos0 = kv_len - q_len + first
            kv_hi = pos0 + min(tpt, q_len - first)
            lo = 0 if window is None else max(pos0 - window + 1, 0) // block_kv
            hi = -(-kv_hi // block_kv)
            walk.append((hi - lo, kv_hi - (hi - 1) * block_kv <= block_kv - block_size))
    return walk


def test_oracle_tiles_walk_the_pipeline() -> None:
    """What _oracle_tiles keeps covered: every case has several tiles with work (the hand-over
    from a tile's last KV step to the next tile's first), most cases have tiles of several KV
    steps (the hand-over between steps), and every case has last steps with pages past kv_hi
    (never fetched)."""
    walks = {name: _kv_walk(name) for name in TPU_CASES}
    assert all(len(w) >= 2 for w in walks.values())
    assert sum(any(steps >= 2 for steps, _ in w) for w in walks.values()) >= 4
    assert max(steps for w in walks.values() for steps, _ in w) >= 4
    assert all(any(skipped for _, skipped in w) for w in walks.values())


def _slots(b, seqs: list[tuple[int, int]], block_size: int, num_tokens: int) -> np.ndarray:
    """The cache slot of every live query row's own token (-1 for padding rows)."""
    slots = np.full(num_tokens, -1, np.int32)
    for s, (q_len, kv_len) in enumerate(seqs):
        for j in range(q_len):
            pos = kv_len - q_len + j
            slots[b.cu_q_lens[s] + j] = b.block_tables[s][pos // block_size] * block_size + pos % block_size
    return slots


# (seqs as (q_len, kv_len), kv heads, group, head_dim, block size, window, soft cap, dtype, tiles)
UPDATE_CASES = {
    # many tiles of 8 tokens and KV steps of one page: every pipeline hand-over, across tiles too
    "small_tiles_mixed_d64": ([(1, 40), (19, 19), (0, 12), (7, 33), (1, 2)], 3, 3, 64, 16, None,
                              None, jnp.float32, TpuTiles(8, 16)),
    "window_cap_bf16_d128": ([(12, 50), (1, 64), (30, 30)], 2, 4, 128, 16, 21, 20.0,
                             jnp.bfloat16, TpuTiles(16, 32)),
    "default_tiles_b64_gqa1": ([(5, 70), (1, 129), (2, 2)], 2, 1, 64, 64, None, None,
                               jnp.float32, None),
}
# Cases whose cache is layer `layer` of `num_layers` (layer, num_layers) viewed as one
# (`cases.stacked_cache`, the other layers NaN), written and read through a traced block_offset
# with the case's own block table and slots, as the model addresses its stacked cache.
LAYERED = {"small_tiles_mixed_d64": (1, 3), "read_kvh1_gqa8_bf16_d128": (1, 2)}


def _layered(name: str, cache: jax.Array) -> tuple[jax.Array, jax.Array, Callable]:
    """Case ``name``'s cache as the kernel gets it, its ``block_offset`` and the function that
    places a cache of the layer's shape as the kernel's returned cache must be: as it is, or
    for a LAYERED case its `stacked_cache` (every other layer untouched, NaN)."""
    layer, num_layers = LAYERED.get(name, (0, 1))
    place = functools.partial(stacked_cache, layer=layer, num_layers=num_layers)
    return place(cache), jnp.int32(layer * cache.shape[0]), place


@pytest.mark.parametrize("name", list(UPDATE_CASES))
def test_fused_write_then_attend_without_races(name: str) -> None:
    """The kernel that writes the step's K/V itself: its cache equals write_kv_cache's (NaN
    slots included; a LAYERED case's written into its layer's blocks alone), its output the
    oracle's over that cache, and the race detector finds no unordered access to a VMEM slot or
    a cache row (a missing wait would be one)."""
    seqs, hkv, group, d, bs, window, cap, dtype, tiles = UPDATE_CASES[name]
    rng = np.random.default_rng(len(name))
    num_tokens = sum(q for q, _ in seqs) + 3
    b = make_batch(rng, seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs,
                   max_num_seqs=len(seqs) + 1, num_tokens=num_tokens)
    q, cache, kv_lens, tables, cu, num_seqs = b.args(dtype)
    slots = jnp.asarray(_slots(b, seqs, bs, num_tokens))
    k, v = (jnp.asarray(rng.standard_normal((num_tokens, hkv, d)), dtype) for _ in range(2))
    kw = dict(sm_scale=1.0 / np.sqrt(d), sliding_window=window, soft_cap=cap)
    flat, offset, place = _layered(name, cache)
    out, new_cache = ragged_paged_attention_tpu_update(
        q, k, v, to_tpu_kv_cache(flat), slots, kv_lens, tables, cu, num_seqs, **kw, tiles=tiles,
        interpret=pltpu.InterpretParams(detect_races=True), block_offset=offset)
    assert not _races_found()
    want_cache = write_kv_cache(cache, k, v, slots)
    assert new_cache.shape == tpu_kv_cache_shape(flat.shape[0], bs, hkv, d, dtype)
    np.testing.assert_array_equal(np.asarray(from_tpu_kv_cache(new_cache, hkv, d).astype(jnp.float32)),
                                  np.asarray(place(want_cache).astype(jnp.float32)))
    assert not np.asarray(new_cache[..., d:]).any()  # the padding lanes stay zeros
    truth = oracle(b, q_dtype=np.asarray(q.astype(jnp.float32)),
                   cache=np.asarray(want_cache.astype(jnp.float32)), **kw)
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(out, truth, atol=_tol(dtype), rtol=_tol(dtype))
    assert np.all(out[sum(q for q, _ in seqs):] == 0)


FP8 = jnp.float8_e4m3fn
# float8_e4m3fn caches (stored as cast, read upcast to q's dtype) against the oracle over the same
# cache upcast, both entry points, with the race detector. (seqs as (q_len, kv_len), kv heads,
# group, head_dim, block size, q dtype, tiles, fused, max_blocks)
FP8_CASES = {
    # read-only, KVH 1 (one group of 4: a padding K/V pair), GQA 8; num_kv_heads passed
    "read_kvh1_gqa8_bf16_d128": ([(1, 70), (16, 50), (5, 33), (1, 120)], 1, 8, 128, 16,
                                 jnp.bfloat16, TpuTiles(16, 32), False, None),
    # fused write, odd KVH 3 (two groups of 4, the second [K2, V2, 0, 0]), GQA 3; one tile per
    # sequence and a block table wider than a KV step: each tile's block-table row is DMA'd into
    # the row slot of the tile three before (a different sequence), over several KV steps
    "fused_kvh3_gqa3_f32_b8": ([(1, 90), (3, 40), (8, 130), (2, 75), (1, 9)], 3, 3, 64, 8,
                               jnp.float32, TpuTiles(8, 16), True, 20),
}


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_cache_matches_oracle_of_its_values(name: str) -> None:
    """The output equals the float64 oracle's over the fp8 cache upcast (the fused kernel's:
    over write_kv_cache's fp8 cache, which its own cache equals byte for byte, padding heads
    and lanes zero), padding rows zeros, and the race detector finds nothing. A LAYERED case
    reads its layer of a stacked cache through block_offset."""
    seqs, hkv, group, d, bs, dtype, tiles, fused, max_blocks = FP8_CASES[name]
    rng = np.random.default_rng(len(name))
    num_tokens = sum(q for q, _ in seqs) + 3
    b = make_batch(rng, seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs,
                   max_num_seqs=len(seqs) + 1, num_tokens=num_tokens, max_blocks=max_blocks)
    q, _, kv_lens, tables, cu, num_seqs = b.args(dtype)
    cache = jnp.asarray(b.kv_cache).astype(FP8)                  # the NaN slots stay NaN
    kw = dict(sm_scale=1.0 / np.sqrt(d), tiles=tiles,
              interpret=pltpu.InterpretParams(detect_races=True))
    if fused:
        slots = jnp.asarray(_slots(b, seqs, bs, num_tokens))
        k, v = (jnp.asarray(rng.standard_normal((num_tokens, hkv, d)), dtype) for _ in range(2))
        out, new_cache = ragged_paged_attention_tpu_update(
            q, k, v, to_tpu_kv_cache(cache), slots, kv_lens, tables, cu, num_seqs, **kw)
        cache = write_kv_cache(cache, k, v, slots)
        np.testing.assert_array_equal(np.asarray(new_cache).view(np.uint8),
                                      np.asarray(to_tpu_kv_cache(cache)).view(np.uint8))
    else:
        flat, offset, _ = _layered(name, cache)
        out = ragged_paged_attention_tpu(q, to_tpu_kv_cache(flat), kv_lens, tables, cu, num_seqs,
                                         num_kv_heads=hkv, block_offset=offset, **kw)
    assert not _races_found()
    truth = oracle(b, sm_scale=kw["sm_scale"], q_dtype=np.asarray(q.astype(jnp.float32)),
                   cache=np.asarray(cache.astype(jnp.float32)))
    out = np.asarray(out.astype(jnp.float32))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_allclose(out, truth, atol=_tol(dtype), rtol=_tol(dtype))
    assert np.all(out[sum(q for q, _ in seqs):] == 0)


def test_fp8_head_count_is_asked_where_ambiguous() -> None:
    """An fp8 layout of one group of 4 holds KVH 1 or 2: the entry points infer the count that
    divides q's heads, and raise ValueError where both do (pass num_kv_heads) or where
    num_kv_heads does not fit the cache."""
    s = jax.ShapeDtypeStruct
    cache = s(tpu_kv_cache_shape(4, 16, 1, 64, FP8), FP8)
    meta = (s((2,), jnp.int32), s((2, 3), jnp.int32), s((3,), jnp.int32), s((1,), jnp.int32))
    with pytest.raises(ValueError, match="pass num_kv_heads"):
        ragged_paged_attention_tpu_metadata(s((8, 8, 64), jnp.bfloat16), cache, *meta)
    with pytest.raises(ValueError, match="does not hold 3 kv heads"):
        jax.eval_shape(functools.partial(ragged_paged_attention_tpu, sm_scale=0.1, num_kv_heads=3,
                                         interpret=True), s((8, 8, 64), jnp.bfloat16), cache, *meta)
    for heads, kvh in ((8, 1), (8, 2), (3, None)):   # 3 q heads: only KVH 1 divides them
        md = jax.eval_shape(functools.partial(ragged_paged_attention_tpu_metadata,
                                              num_kv_heads=kvh),
                            s((8, heads, 64), jnp.bfloat16), cache, *meta)
        assert md.tok.shape[1] == heads // (kvh or 1) * 16       # GQA group x 16 tokens a tile


def test_low_byte_e4m3_decodes_every_pattern() -> None:
    """`low_byte_e4m3` (the compiled kernel's read of a cache byte) is the float8_e4m3fn value
    of each word's low byte whatever its other bytes hold, upcast exactly: all 256 patterns
    (zeros of both signs, subnormals, 448, NaN) to float32 and bfloat16."""
    rng = np.random.default_rng(5)
    pattern = np.arange(256, dtype=np.uint32)
    words = jnp.asarray(pattern | rng.integers(0, 1 << 24, 256).astype(np.uint32) << 8)
    want = pattern.astype(np.uint8).view(FP8).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(low_byte_e4m3(words, dtype).astype(jnp.float32))
        np.testing.assert_array_equal(got, want)
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


def test_fp8_layout_pads_each_shards_heads() -> None:
    """For 8-bit caches `to_tpu_kv_cache` packs 4 combined heads a word row: of ``num_shards``
    runs of C = 2 * KVH / num_shards combined heads, run s's head l sits at
    [..., s * G + l // 4, l % 4, :] (G = ceil(C / 4)), padding heads and lanes zero bytes;
    `from_tpu_kv_cache` inverts it, `tpu_kv_cache_shape` is its shape, and each shard's run is
    the one-shard layout of its own heads (SmolLM2's 3 kv heads over 3 devices: a group each)."""
    rng = np.random.default_rng(4)
    d = 64
    for kvh, shards, groups in ((3, 1, 2), (1, 1, 1), (2, 1, 1), (4, 1, 2), (3, 3, 3), (4, 2, 2)):
        cache = jnp.asarray(rng.standard_normal((5, 8, 2 * kvh, d)), jnp.float32).astype(FP8)
        tpu = to_tpu_kv_cache(cache, shards)
        assert tpu.shape == tpu_kv_cache_shape(5, 8, kvh, d, FP8, shards) == (5, 8, groups, 4, 128)
        host, want = np.asarray(tpu).view(np.uint8), np.asarray(cache).view(np.uint8)
        per, g = 2 * kvh // shards, groups // shards
        placed = np.zeros(host.shape, bool)
        for c in range(2 * kvh):
            s, l = divmod(c, per)
            np.testing.assert_array_equal(host[:, :, s * g + l // 4, l % 4, :d], want[:, :, c])
            placed[:, :, s * g + l // 4, l % 4, :d] = True
        assert not host[~placed].any()
        np.testing.assert_array_equal(
            np.asarray(from_tpu_kv_cache(tpu, kvh, d, shards)).view(np.uint8), want)
        for s in range(shards):
            np.testing.assert_array_equal(
                host[:, :, s * g:(s + 1) * g],
                np.asarray(to_tpu_kv_cache(cache[:, :, s * per:(s + 1) * per])).view(np.uint8))
    with pytest.raises(ValueError, match="must divide num_kv_heads"):
        tpu_kv_cache_shape(5, 8, 3, d, FP8, num_shards=2)
    with pytest.raises(ValueError, match="is not the TPU layout of 2 kv heads"):
        from_tpu_kv_cache(to_tpu_kv_cache(cache), 2, d)


def test_race_detector_reports_a_missing_wait() -> None:
    """The detector the test above relies on is live: a kernel that reads a VMEM buffer while
    the DMA into it is still in flight is reported."""
    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
        copy.start()
        o_ref[...] = buf[...]          # read before the wait: a race
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                   in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                   scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA((1,))],
                   interpret=pltpu.InterpretParams(detect_races=True))(x).block_until_ready()
    assert _races_found()


def test_random_batches_share_one_compile() -> None:
    """Traced metadata: random ragged batches of one static shape reuse one compiled kernel, of
    the default tiles (8 pages of 32 keys a step, head_dim 64 taking 128 lanes: every sequence
    in the first step, most pages skipped; block size 32 halves the unrolled page DMAs of block
    size 16's 16 pages)."""
    fn = jax.jit(functools.partial(ragged_paged_attention_tpu, sm_scale=0.125, interpret=True))
    rng = np.random.default_rng(7)
    for kind in ("decode", "mixed", "chunked"):
        seqs = random_seqs(rng, int(rng.integers(1, 5)), kind, max_kv=60)
        while sum(q for q, _ in seqs) > 64:
            seqs = seqs[:-1]
        b = make_batch(rng, seqs, num_kv_heads=2, group=2, head_dim=64, block_size=32,
                       max_num_seqs=4, num_tokens=64, max_blocks=3, num_blocks=12)
        q, cache, *meta = b.args(jnp.float32)
        out = np.asarray(fn(q, to_tpu_kv_cache(cache), *meta))
        np.testing.assert_allclose(out, oracle(b, sm_scale=0.125), atol=1e-5, rtol=1e-5)
    assert fn._cache_size() == 1
    tiles = default_tpu_tiles(64, 4, 2, 32, 4 * 128 * 4, 4)
    assert (tiles.tokens_per_tile, tiles.block_kv) == (16, 8 * 32)


def test_tpu_layout_places_each_head_by_index_arithmetic() -> None:
    """`to_tpu_kv_cache` puts combined head c of token (block, offset), lane j < D at
    [block, offset, c // packing, c % packing, j] (packing 2 for 16-bit types, 1 for float32),
    zeros in lanes D..127; `from_tpu_kv_cache` inverts it; `tpu_kv_cache_shape` is its shape."""
    rng = np.random.default_rng(3)
    for dtype, packing in ((jnp.bfloat16, 2), (jnp.float32, 1)):
        for kvh, d in ((3, 64), (1, 128), (2, 96)):
            cache = jnp.asarray(rng.standard_normal((5, 8, 2 * kvh, d)), dtype)
            tpu = to_tpu_kv_cache(cache)
            assert tpu.shape == tpu_kv_cache_shape(5, 8, kvh, d, dtype) == (
                5, 8, 2 * kvh // packing, packing, -(-d // 128) * 128)
            host, want = np.asarray(tpu.astype(jnp.float32)), np.asarray(cache.astype(jnp.float32))
            for c in range(2 * kvh):
                np.testing.assert_array_equal(host[:, :, c // packing, c % packing, :d], want[:, :, c])
            assert not host[..., d:].any()
            np.testing.assert_array_equal(np.asarray(from_tpu_kv_cache(tpu, kvh, d)), np.asarray(cache))


@pytest.mark.parametrize("field,kw,match", [
    ("layout", dict(section2=True), "TPU layout"),
    ("head_dim", dict(lanes=64), "is not the TPU layout of head_dim 64"),
    ("block_size", dict(block_size=12), "block_size to be a multiple of 8"),
    ("tiles", dict(tiles=TpuTiles(6, 16)), "tokens_per_tile must be a power of two"),
    ("rows", dict(tiles=TpuTiles(2, 16)), "must be a multiple of 8 rows"),
])
def test_bad_shapes_raise(field: str, kw: dict, match: str) -> None:
    bs = kw.get("block_size", 16)
    q = jnp.zeros((4, 4, 64), jnp.float32)
    cache = jnp.zeros((8, bs, 4, 1, kw.get("lanes", 128)), jnp.float32)
    if kw.get("section2"):
        cache = jnp.zeros((8, bs, 4, 64), jnp.float32)
    meta = (jnp.zeros(2, jnp.int32), jnp.zeros((2, 3), jnp.int32), jnp.zeros(3, jnp.int32),
            jnp.ones(1, jnp.int32))
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_tpu(q, cache, *meta, sm_scale=0.1, tiles=kw.get("tiles"),
                                   interpret=True)


# What TPU's compiler must take: the fused kernel the engine runs, for both dtypes, head_dim 64
# and 128 and 1, 3 and 8 KV heads (one packed word of K|V per lane; a full head group; a tile's
# worth of heads); the read-only kernel on one; SmolLM2's bf16 shape on the other TPU
# generations. (dtype, kv heads, GQA group, head_dim, block size, topology, fused)
COMPILE = [(dt, kvh, 8 // kvh if kvh < 8 else 2, d, 16, "v5e:2x2", True)
           for dt, shapes in ((jnp.bfloat16, ((1, 64), (3, 64), (8, 128))),
                              (jnp.float32, ((1, 128), (3, 64)))) for kvh, d in shapes]
COMPILE += [(jnp.float32, 8, 4, 128, 64, "v5e:2x2", False)]
COMPILE += [(jnp.bfloat16, 3, 3, 64, 16, topo, True) for topo in ("v4:2x2x1", "v5p:2x2x1", "v6e:2x2")]


def _compile(device, q_dtype, cache_dtype, kvh: int, group: int, d: int, bs: int, fused: bool,
             *, seqs: int = 64, max_blocks: int | None = None, tokens: int = 256,
             pages: int = 20_000) -> tuple:
    """The kernel compiled by libtpu for ``device`` (a topology's) with `interpret=None`, on
    ShapeDtypeStructs of the shapes (the block table 4096 keys wide unless ``max_blocks``) and
    a traced ``block_offset``, as the model's layers pass it: the fused entry point under a
    donated cache and a window, or the read-only one with a soft cap. Returns it and the
    cache's bytes."""
    s = functools.partial(jax.ShapeDtypeStruct, sharding=jax.sharding.SingleDeviceSharding(device))
    cache = s(tpu_kv_cache_shape(pages, bs, kvh, d, cache_dtype), cache_dtype)
    cache_bytes = int(np.prod(cache.shape)) * jnp.dtype(cache_dtype).itemsize
    meta = (s((seqs,), jnp.int32), s((seqs, max_blocks or 4096 // bs), jnp.int32),
            s((seqs + 1,), jnp.int32), s((1,), jnp.int32))
    q, kv = s((tokens, kvh * group, d), q_dtype), s((tokens, kvh, d), q_dtype)
    offset = s((), jnp.int32)
    with jax.default_device(device):
        if fused:
            fn = jax.jit(lambda off, q, k, v, c, sl, *m: ragged_paged_attention_tpu_update(
                q, k, v, c, sl, *m, sm_scale=0.1, sliding_window=512, block_offset=off),
                donate_argnums=4)
            return fn.trace(offset, q, kv, kv, cache, s((tokens,), jnp.int32),
                            *meta).lower().compile(), cache_bytes
        fn = jax.jit(lambda off, *a: ragged_paged_attention_tpu(*a, sm_scale=0.1, soft_cap=30.0,
                                                                block_offset=off))
        return fn.trace(offset, q, cache, *meta).lower().compile(), cache_bytes


@pytest.mark.parametrize("dtype,kvh,group,d,bs,topology,fused", COMPILE,
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_compiles_for_tpu_without_copying_the_cache(tpu_topology, dtype, kvh, group, d, bs,
                                                    topology, fused) -> None:
    """TPU's compiler (libtpu, ahead of time, no TPU attached) takes the kernel for a 20,000-page
    cache with `interpret=None` under the topology's device (the kernel picks Mosaic there): the
    program's temporary bytes are under 5% of the cache (its tiles, gathers and metadata: a copy
    of the cache would be all of it), and the fused kernel's donated cache is aliased in to
    out."""
    compiled, cache_bytes = _compile(tpu_topology(topology), dtype, dtype, kvh, group, d, bs,
                                     fused)
    mem = compiled.memory_analysis()
    assert "tpu_custom_call" in compiled.as_text()
    assert mem.temp_size_in_bytes < cache_bytes // 20, (mem.temp_size_in_bytes, cache_bytes)
    assert mem.alias_size_in_bytes == (cache_bytes if fused else 0)


# The engine's fp8-cache shapes (bfloat16 queries): SmolLM2 (9 q / 3 kv heads, head_dim 64: one
# padding K/V pair) on v5e and v6e, Qwen3-0.6B (16 / 8, 128) on v6e (Llama-3.1-8B's 32 / 8 on v5e:
# test_long_context_block_tables_compile), and SmolLM2 under tensor parallelism 3 (a device's one
# kv head and 3 q heads; the read-only entry point infers the padded head count).
# (kv heads, GQA group, head_dim, topology, fused)
COMPILE_FP8 = [(3, 3, 64, "v5e:2x2", True), (3, 3, 64, "v6e:2x2", True),
               (8, 2, 128, "v6e:2x2", True), (1, 3, 64, "v5e:2x2", False)]


@pytest.mark.parametrize("kvh,group,d,topology,fused", COMPILE_FP8)
def test_fp8_cache_compiles_without_copying_it(tpu_topology, kvh, group, d, topology,
                                               fused) -> None:
    """As test_compiles_for_tpu_without_copying_the_cache, for a float8_e4m3fn cache read by
    bfloat16 queries: libtpu takes the byte extraction and the fp8 upcast, and the fused
    kernel's cache (written with the new tokens cast to fp8) stays aliased in to out."""
    compiled, cache_bytes = _compile(tpu_topology(topology), jnp.bfloat16, FP8, kvh, group, d,
                                     16, fused)
    mem = compiled.memory_analysis()
    assert "tpu_custom_call" in compiled.as_text()
    assert mem.temp_size_in_bytes < cache_bytes // 20, (mem.temp_size_in_bytes, cache_bytes)
    assert mem.alias_size_in_bytes == (cache_bytes if fused else 0)


# Long contexts, whose block tables alone pass SMEM's 1 MiB (they stay in HBM; a tile's row is
# DMA'd into SMEM): Qwen2.5-0.5B at 32k (14 q / 2 kv heads, head_dim 64; 128 sequences of 2048
# blocks) and a Llama-3.1-8B-like model at 128k (32 / 8, 128; 256 sequences of 8192 blocks), both
# with 2048 token rows and block size 16, for v5e. (kv heads, GQA group, head_dim, seqs, blocks)
LONG = [(2, 7, 64, 128, 2048), (8, 4, 128, 256, 8192)]


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kvh,group,d,seqs,max_blocks", LONG)
def test_long_context_block_tables_compile(tpu_topology, kvh, group, d, seqs, max_blocks,
                                           cache_dtype) -> None:
    """The fused kernel of a long-context engine compiles for v5e (bf16 queries), its SMEM
    within budget although the whole block table would not fit, and its cache aliased."""
    tokens = 2048
    assert seqs * max_blocks * 4 >= 1024 * 1024
    assert smem_bytes(tokens, seqs, max_blocks) <= SMEM_LIMIT
    compiled, cache_bytes = _compile(tpu_topology("v5e:2x2"), jnp.bfloat16, cache_dtype, kvh,
                                     group, d, 16, True, seqs=seqs, max_blocks=max_blocks,
                                     tokens=tokens)
    assert compiled.memory_analysis().alias_size_in_bytes == cache_bytes


def test_smem_budget_is_checked_before_compiling() -> None:
    """`smem_bytes` is the module docstring's sum (7 x 248 tiles' table, n_work and the block
    offset, the slot mapping, three block-table rows; each array in whole 128-word tiles), and
    shapes past SMEM_LIMIT raise a ValueError naming the options that lower it, at trace time
    (no compiler involved)."""
    assert smem_bytes(2048, 128, 2048, 16, write=True) == 4 * (1792 + 128 + 2048 + 3 * 2048)
    assert smem_bytes(2048, 128, 2000, 16, write=False) == 4 * (1792 + 128 + 3 * 2048)
    with pytest.raises(ValueError, match="max_num_batched_tokens or max_num_seqs"):
        check_smem(240_000, 256, 8192)
    s = jax.ShapeDtypeStruct
    tokens, seqs = 240_000, 256
    args = (s((tokens, 4, 64), jnp.bfloat16), s((tokens, 2, 64), jnp.bfloat16),
            s((tokens, 2, 64), jnp.bfloat16), s(tpu_kv_cache_shape(64, 16, 2, 64, FP8), FP8),
            s((tokens,), jnp.int32), s((seqs,), jnp.int32), s((seqs, 8), jnp.int32),
            s((seqs + 1,), jnp.int32), s((1,), jnp.int32))
    with pytest.raises(ValueError, match="SMEM"):
        jax.eval_shape(functools.partial(ragged_paged_attention_tpu_update, sm_scale=0.1,
                                         interpret=False), *args)

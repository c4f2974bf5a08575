"""Every attention backend (the Pallas kernel, the tuned XLA path, the plain-jnp reference) vs a
float64 numpy oracle on random ragged batches with NaN-poisoned caches.

Compiling dominates these tests' time on CPU, so tests whose batches can share static shapes do,
and one jit holds the option sets (window, soft cap) or variants a test checks: XLA compiles the
code they share once. A batch of only padding rows (num_seqs = 0) runs through each shared case's
compiled program (the TPU kernel's: in test_tpu_attention.py). The cases of cases.LAYERED run as
one layer of a stacked cache viewed as one, read through `block_offset` with the case's own block
table, the other layers NaN.

Every kernel call takes `interpret` from the conftest fixture, so `--gpu` compiles the same cases
through the Triton lowering.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import CASES, make_batch, oracle, random_seqs, run_case
from pallas_kernels import (DECODE, MIXED, PREFILL, pallas_step_kind, ragged_paged_attention,
                            ragged_paged_attention_metadata, ragged_paged_attention_reference,
                            ragged_paged_attention_xla, xla_step_kind)
from pallas_kernels.xla_attention import tokens_per_tile

def _tol(dtype, interpret: bool) -> float:
    if dtype == jnp.bfloat16:
        return 2e-2
    return 1e-5 if interpret else 2e-4


def _only_padding_is_zeros(fn: Callable, args: tuple) -> None:
    """``fn`` (a jit) on the case's batch with num_seqs = 0: every row is padding and comes out as
    zeros, whatever the cache holds; the compiled program is the case's own (one compile)."""
    out = fn(*args[:5], jnp.zeros_like(args[5]))
    assert np.all(np.asarray(out.astype(jnp.float32)) == 0)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_oracle(name: str, interpret: bool) -> None:
    """The Pallas kernels against the oracle: the mixed kernel, and for the decode cases also
    flash-decoding (``kind="decode"``, the host's choice for them), both in one jit; then every
    row padding (num_seqs = 0)."""
    args, truth, kw, total, dtype = run_case(name)
    q_lens = np.diff(np.asarray(args[4]))[:int(args[5][0])]
    kinds = (MIXED, DECODE) if pallas_step_kind(q_lens, args[0].shape[0]) == DECODE else (MIXED,)
    assert (DECODE in kinds) == name.startswith("decode")
    fn = jax.jit(lambda *a: [ragged_paged_attention(*a, **kw, interpret=interpret, kind=kind)
                             for kind in kinds])
    for kind, out in zip(kinds, fn(*args)):
        assert out.dtype == dtype and out.shape == args[0].shape
        out = np.asarray(out.astype(jnp.float32))
        assert np.isfinite(out).all()
        tol = _tol(dtype, interpret)
        np.testing.assert_allclose(out, truth, atol=tol, rtol=tol, err_msg=kind)
        assert np.all(out[total:] == 0), "padding rows must be zeros"
    out = fn(*args[:5], jnp.zeros_like(args[5]))  # every row padding, the same program
    assert all(np.all(np.asarray(o.astype(jnp.float32)) == 0) for o in out)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("name", list(CASES))
def test_xla_matches_oracle(name: str) -> None:
    """The XLA path against the oracle (buckets of SPLIT_MIN_TOKENS+ rows: its two passes); then
    every row padding (num_seqs = 0)."""
    args, truth, kw, total, dtype = run_case(name)
    fn = jax.jit(functools.partial(ragged_paged_attention_xla, **kw))
    out = fn(*args)
    assert out.dtype == dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out, truth, atol=tol, rtol=tol)
    assert np.all(out[total:] == 0)
    _only_padding_is_zeros(fn, args)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_oracle(name: str) -> None:
    """The plain-jnp ground truth on the same NaN-poisoned batches, padding rows included; then
    every row padding (num_seqs = 0)."""
    args, truth, kw, total, dtype = run_case(name)
    fn = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))
    out = fn(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out, truth, atol=tol, rtol=tol)
    assert np.all(out[total:] == 0)
    _only_padding_is_zeros(fn, args)


def _pass_rows(b, include: np.ndarray) -> np.ndarray:
    """The query rows of the live sequences in ``include``."""
    n = int(b.num_seqs[0])
    return np.concatenate([np.arange(b.cu_q_lens[s], b.cu_q_lens[s + 1]) for s in range(n)
                           if include[s]] or [np.zeros(0, int)]).astype(int)


@functools.cache
def _xla_options_jit(options: tuple[tuple[int | None, float | None], ...],
                     kind: str = MIXED) -> Callable:
    """The XLA path at sm_scale 0.125 under each (sliding window, soft cap) of ``options``, for a
    step of ``kind``: one jit, so XLA compiles the option sets' shared code once, and batches of
    equal shapes share the compiled program."""
    return jax.jit(lambda *a: [ragged_paged_attention_xla(*a, sm_scale=0.125, sliding_window=w,
                                                          soft_cap=c, kind=kind)
                               for w, c in options])


# Buckets of 512..1023 rows (LONG_RUN+ rows, 16-token tiles) in the XLA path's long-run and
# long-context tests: one shape, every batch checked under each option set, all in one program.
BIG_BUCKET = dict(num_tokens=1000, max_num_seqs=12, num_kv_heads=2, group=3, head_dim=64,
                  block_size=16, max_blocks=46, num_blocks=140)
BIG_OPTIONS = ((None, None), (90, 30.0))   # (sliding window, soft cap)


@functools.cache
def _big_bucket_jit() -> Callable:
    """Per option set of BIG_OPTIONS: the whole XLA call as a mixed step and as a prefill step
    (its LONG_TILE layout), and each layout a pass may take, run on its own over the sequences of
    its (traced) include mask: the usual long-run tiles, one-token tiles, LONG_TILE tiles. One
    jit: the option sets share most of their code, which XLA then compiles once."""
    from pallas_kernels.xla_attention import LONG_MAX_SEQS, LONG_TILE, _work_list_attention

    def run(*args):
        a, masks = args[:6], args[6:]
        num_tokens, max_seqs = a[0].shape[0], a[2].shape[0]
        layouts = [(tokens_per_tile(num_tokens, max_seqs), max_seqs), (1, max_seqs),
                   (LONG_TILE, LONG_MAX_SEQS)]
        return [({kind: ragged_paged_attention_xla(*a, sm_scale=0.125, sliding_window=w,
                                                   soft_cap=c, kind=kind)
                  for kind in (MIXED, PREFILL)},
                 [_work_list_attention(*a, tpt, live, 0.125, w, c, m)
                  for (tpt, live), m in zip(layouts, masks)]) for w, c in BIG_OPTIONS]
    return jax.jit(run)


def _check_big_bucket(b) -> None:
    """Under each option set of BIG_OPTIONS, the whole XLA call matches the oracle (padding rows
    zeros) as a mixed step, and as a prefill step when the host's rule (`xla_step_kind`) calls
    the batch one; so does every layout a call may pick for a pass, on the rows of that pass's
    sequences: the usual tiles and (at most LONG_MAX_SEQS long runs) the LONG_TILE ones for runs
    longer than SHORT_RUN, one-token tiles for the others."""
    from pallas_kernels.xla_attention import LONG_MAX_SEQS, LONG_RUN, SHORT_RUN

    assert b.q.shape[0] >= LONG_RUN
    n, max_seqs = int(b.num_seqs[0]), len(b.kv_lens)
    live = np.arange(max_seqs) < n
    q_lens = np.where(live, np.diff(b.cu_q_lens), 0)
    long, short = live & (q_lens > SHORT_RUN), live & (q_lens <= SHORT_RUN)
    few = long.sum() <= LONG_MAX_SEQS   # else the LONG_TILE layout is never taken: none included
    includes = (long, short, long & few)
    kinds = {MIXED, xla_step_kind(q_lens[:n], b.q.shape[0])}
    assert kinds <= {MIXED, PREFILL}
    results = _big_bucket_jit()(*b.args(jnp.float32), *map(jnp.asarray, includes))
    for (window, cap), (whole, layouts) in zip(BIG_OPTIONS, results):
        truth = oracle(b, sm_scale=0.125, sliding_window=window, soft_cap=cap)
        for name, include, got in zip(("usual", "one-token", "LONG_TILE"), includes, layouts):
            rows = _pass_rows(b, include)
            np.testing.assert_allclose(np.asarray(got)[rows], truth[rows], atol=1e-5, rtol=1e-5,
                                       err_msg=f"{name} tiles, window={window}, cap={cap}")
        for kind in kinds:
            out = np.asarray(whole[kind])
            np.testing.assert_allclose(out, truth, atol=1e-5, rtol=1e-5,
                                       err_msg=f"{kind}, window={window}, cap={cap}")
            assert np.all(out[b.cu_q_lens[n]:] == 0)
    return kinds


@pytest.mark.parametrize("seqs", [
    [(600, 600)],                                          # one long prompt, alone
    [(530, 700), (40, 40), (1, 77), (3, 150)],             # a long chunk beside others
    [(512, 512), (1, 33)],                                 # exactly LONG_RUN
    [(511, 511), (20, 300)],                               # one short of it
    [(520, 520)] + [(1, 40 + 9 * i) for i in range(9)],    # many decodes beside
    [(520, 520)] + [(5 + i, 40 + 9 * i) for i in range(8)],  # too many long runs
], ids=["alone", "beside_others", "exactly_long_run", "one_short", "many_decodes", "too_many_long"])
def test_xla_long_runs(seqs) -> None:
    """Buckets of LONG_RUN+ rows run short runs (decodes) in one-token tiles and long ones in the
    usual or (a prefill step) the LONG_TILE layout, picked per step on the host by the longest run
    and the number of long runs; every pass's layout, on its own rows, and the whole call match
    the oracle, without and with a sliding window and a soft cap."""
    rng = np.random.default_rng(sum(q for q, _ in seqs))
    kinds = _check_big_bucket(make_batch(rng, seqs, **BIG_BUCKET))
    longest, long_runs = max(q for q, _ in seqs), sum(q > 4 for q, _ in seqs)
    assert (PREFILL in kinds) == (longest >= 512 and long_runs <= 8)


@pytest.mark.parametrize("seqs", [
    [(1, 20 + 3 * i) for i in range(70)],                            # decodes only
    [(1, 50), (2, 90), (3, 33), (4, 64), (5, 70), (6, 6)] * 4,       # runs 1..6
    [(1, 130), (100, 260), (1, 7), (2, 40), (37, 37)],               # chunks beside decodes
    [(30, 30), (5, 81), (40, 100)],                                  # long runs only
], ids=["decodes_only", "runs_1_to_6", "chunks_beside_decodes", "long_runs_only"])
def test_xla_splits_short_and_long_runs(seqs) -> None:
    """Buckets of SPLIT_MIN_TOKENS+ rows: short runs (up to SHORT_RUN tokens) take one pass in
    one-token tiles, longer runs another (a pass with no sequences does no work); a decode step
    (the host's rule) takes the one-token pass alone. Every row matches the oracle, without and
    with a sliding window and a soft cap, with NaN everywhere in the cache that no sequence owns,
    and padding rows stay 0. (One bucket shape, both option sets in one jit per kind.)"""
    from pallas_kernels.xla_attention import LONG_RUN, SPLIT_MIN_TOKENS

    options = ((None, None), (17, 10.0))   # (sliding window, soft cap)
    rng = np.random.default_rng(len(seqs))
    total = sum(q for q, _ in seqs)
    num_tokens = 256
    assert SPLIT_MIN_TOKENS <= total <= num_tokens < LONG_RUN
    b = make_batch(rng, seqs, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                   max_num_seqs=80, num_tokens=num_tokens, max_blocks=19, num_blocks=580)
    kind = xla_step_kind(np.array([q for q, _ in seqs]), num_tokens)
    assert kind == (DECODE if all(q == 1 for q, _ in seqs) else MIXED)
    fn = _xla_options_jit(options, kind)
    for (window, cap), out in zip(options, fn(*b.args(jnp.float32))):
        out = np.asarray(out)
        np.testing.assert_allclose(out, oracle(b, sm_scale=0.125, sliding_window=window,
                                               soft_cap=cap),
                                   atol=1e-5, rtol=1e-5, err_msg=f"{kind}, window={window}, cap={cap}")
        assert np.all(out[total:] == 0)


@pytest.mark.parametrize("kind,options,bs,seed", [
    ("decode", ((None, None),), 16, 21), ("mixed", BIG_OPTIONS, 16, 13),
    ("chunked", BIG_OPTIONS, 16, 21), ("mixed", ((50, 20.0),), 4, 9)])
def test_xla_work_list_spans_many_loop_steps(kind, options, bs, seed) -> None:
    """Long contexts: the XLA path's work list holds many more items than one loop step takes,
    so a tile's items straddle steps and get merged across them (and windows skip chunks).
    Buckets of 512..1023 rows take BIG_BUCKET's shape, where each pass layout is checked too."""
    from pallas_kernels.xla_attention import (SHORT_RUN, SPLIT_MIN_TOKENS, items_per_step,
                                              pages_per_item)

    rng = np.random.default_rng(seed)
    seqs = random_seqs(rng, 6, kind, max_kv=600)
    total = sum(q for q, _ in seqs)
    shape = dict(num_tokens=total + 3, max_num_seqs=6, num_kv_heads=2, group=3, head_dim=64,
                 block_size=bs)
    if options == BIG_OPTIONS:
        assert 512 <= total < BIG_BUCKET["num_tokens"] and bs == BIG_BUCKET["block_size"]
        shape = BIG_BUCKET
    num_tokens = shape["num_tokens"]
    bucket_tile = tokens_per_tile(num_tokens, shape["max_num_seqs"])
    for window, _ in options:
        items = {}  # the work list per tile size (one pass each), counted independently
        for q, kv in seqs:
            tpt = 1 if num_tokens >= SPLIT_MIN_TOKENS and q <= SHORT_RUN else bucket_tile
            keys = pages_per_item(bs, tpt) * bs
            for first_pos in range(kv - q, kv, tpt):
                last_pos = min(first_pos + tpt, kv) - 1
                lo = 0 if window is None else max(first_pos - window + 1, 0) // keys
                items[tpt] = items.get(tpt, 0) + last_pos // keys + 1 - lo
        assert max(n / items_per_step(t, num_tokens) for t, n in items.items()) > 2
    b = make_batch(rng, seqs, **shape)
    if options == BIG_OPTIONS:
        _check_big_bucket(b)
    else:
        (window, cap), = options
        out, = _xla_options_jit(options)(*b.args(jnp.float32))
        out = np.asarray(out)
        np.testing.assert_allclose(out, oracle(b, sm_scale=0.125, sliding_window=window,
                                               soft_cap=cap), atol=1e-5, rtol=1e-5)
        assert np.all(out[total:] == 0)


DECODE_PATHS = [  # (kind, window, cap, dtype, num_splits); "given": decode, metadata passed in
    (DECODE, None, None, jnp.float32, 4), (DECODE, 11, 20.0, jnp.float32, None),
    (DECODE, None, None, jnp.bfloat16, 2), (MIXED, 11, 20.0, jnp.float32, None),
    ("given", None, None, jnp.float32, 8)]


# the shape of _decode_paths_run's batches: 8 rows, 8 sequence slots, 2 kv heads of 4 q heads
DECODE_SHAPE = dict(num_kv_heads=2, group=4, head_dim=64, block_size=16, max_num_seqs=8,
                    num_tokens=8, max_blocks=12, num_blocks=40)


@functools.cache
def _decode_paths_run(interpret: bool) -> tuple:
    """One pure decode batch (5 live of 8 sequence slots, 3 padding rows) and every variant of
    DECODE_PATHS on it, all in one jit: XLA compiles the variants' shared code once. Also that
    program's outputs on a decode-sized batch that holds a prefill chunk (of the same shapes)."""
    rng = np.random.default_rng(11)
    seqs = random_seqs(rng, 5, "decode", max_kv=150)
    b = make_batch(rng, seqs, **DECODE_SHAPE)
    args = {jnp.dtype(dt): b.args(dt) for dt in (jnp.float32, jnp.bfloat16)}
    def run(a: tuple, kind: str, window: int | None, cap: float | None, splits: int | None):
        metadata = None
        if kind == "given":  # computed once outside the call, as the engine does per step
            kind = DECODE
            metadata = ragged_paged_attention_metadata(*a, kind=kind)
        return ragged_paged_attention(*a, sm_scale=0.125, sliding_window=window, soft_cap=cap,
                                      interpret=interpret, kind=kind, num_splits=splits,
                                      metadata=metadata)

    fn = jax.jit(lambda args: [run(args[jnp.dtype(dtype)], kind, window, cap, splits)
                               for kind, window, cap, dtype, splits in DECODE_PATHS])
    chunk = make_batch(np.random.default_rng(12), [(1, 20), (3, 9), (1, 33)], **DECODE_SHAPE)
    chunk_args = {dt: chunk.args(dt) for dt in args}
    outs, chunk_outs = fn(args), fn(chunk_args)
    assert fn._cache_size() == 1
    return b, args, outs, chunk, chunk_outs


@pytest.mark.parametrize("kind,window,cap,dtype,splits", DECODE_PATHS)
def test_decode_paths(kind, window, cap, dtype, splits, interpret: bool) -> None:
    """Flash-decoding (with KV splits, and from metadata computed outside the call) and the mixed
    kernel agree with the oracle on a pure decode batch with padding rows and dead sequence
    slots."""
    b, args, outs, _, _ = _decode_paths_run(interpret)
    args = args[jnp.dtype(dtype)]
    truth = oracle(b, sm_scale=0.125, sliding_window=window, soft_cap=cap,
                   q_dtype=np.asarray(args[0].astype(jnp.float32)),
                   cache=np.asarray(args[1].astype(jnp.float32)))
    out = outs[DECODE_PATHS.index((kind, window, cap, dtype, splits))]
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(out, truth, atol=_tol(dtype, interpret), rtol=_tol(dtype, interpret))
    assert np.all(out[5:] == 0)


def test_host_kind_on_decode_sized_mixed_batch(interpret: bool) -> None:
    """A decode-sized bucket that holds a prefill chunk is a mixed step by the host's rule
    (flash-decoding would leave the chunk's rows zeros), and the pure decode batch of the same
    shape a decode step; the mixed kernel, compiled for these shapes, serves the chunk's batch."""
    b, _, _, chunk, outs = _decode_paths_run(interpret)
    for batch, kind in ((b, DECODE), (chunk, MIXED)):
        n = int(batch.num_seqs[0])
        assert pallas_step_kind(np.diff(batch.cu_q_lens)[:n], batch.q.shape[0]) == kind
    out = outs[DECODE_PATHS.index((MIXED, 11, 20.0, jnp.float32, None))]
    np.testing.assert_allclose(np.asarray(out), oracle(chunk, sm_scale=0.125, sliding_window=11,
                                                       soft_cap=20.0),
                               atol=_tol(jnp.float32, interpret), rtol=_tol(jnp.float32, interpret))


def test_random_sweep_fixed_shapes(interpret: bool) -> None:
    """Many random compositions (1..max_num_seqs live sequences of any kind, window and soft cap
    off and on) through the compiled mixed kernel, the XLA path and the reference, each against
    the oracle. One jit per backend runs both option sets: XLA compiles their shared code once.
    The metadata is traced: each jit serves every composition with the one program it compiled."""
    rng = np.random.default_rng(2024)
    max_seqs, num_tokens, bs = 6, 96, 8
    options = ((None, None), (7, 10.0))   # (sliding window, soft cap)
    fns = {impl: jax.jit(lambda *a, f=impl, kw=kw: [
        f(*a, sm_scale=0.125, sliding_window=w, soft_cap=c, **kw) for w, c in options])
        for impl, kw in ((ragged_paged_attention, dict(interpret=interpret)),
                         (ragged_paged_attention_xla, {}), (ragged_paged_attention_reference, {}))}
    for trial in range(8):
        n = int(rng.integers(1, max_seqs + 1))
        seqs = random_seqs(rng, n, "mixed", max_kv=60)
        while sum(q for q, _ in seqs) > num_tokens:
            seqs = seqs[:-1]
        b = make_batch(rng, seqs, num_kv_heads=2, group=3, head_dim=64, block_size=bs,
                       max_num_seqs=max_seqs, num_tokens=num_tokens, max_blocks=9, num_blocks=60)
        truths = [oracle(b, sm_scale=0.125, sliding_window=w, soft_cap=c) for w, c in options]
        for impl, fn in fns.items():
            for (w, c), out, truth in zip(options, fn(*b.args(jnp.float32)), truths):
                tol = _tol(jnp.float32, interpret)
                np.testing.assert_allclose(np.asarray(out), truth, atol=tol, rtol=tol,
                                           err_msg=f"{impl.__name__} trial {trial} window={w} "
                                                   f"cap={c}: {seqs}")
    assert all(fn._cache_size() == 1 for fn in fns.values())


@pytest.mark.parametrize("kind", [DECODE, MIXED])
def test_kernels_lower_through_triton_without_a_gpu(kind, lower_for_cuda) -> None:
    """Both kernels lower to Triton calls for CUDA (runs on CPU: lowering needs no device): one
    kernel per call, the static kind's, and no conditional or loop around it."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, random_seqs(rng, 3, "decode"), num_kv_heads=2, group=4, head_dim=64,
                   block_size=16, max_num_seqs=4, num_tokens=8)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, sliding_window=9, soft_cap=5.0,
                                                   interpret=False, kind=kind))
    lowered = lower_for_cuda(fn, *b.args(jnp.bfloat16))
    assert lowered.triton_calls == 1
    assert not any(op in lowered.text for op in ("stablehlo.case", "stablehlo.if", "stablehlo.while"))

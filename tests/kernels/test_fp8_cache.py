"""An fp8 KV cache (float8_e4m3fn, scale 1: ``kv_cache_dtype="fp8"``) read by every non-TPU
attention backend with queries of float32 and bfloat16, against the float64 oracle given the same
dequantized cache (tests/helpers/cases.py, NaN poison kept: e4m3fn has a NaN); and the Triton
kernels lowered for CUDA with an fp8 cache.

Truth: cases.oracle on the fp8 cache upcast to float64 (`run_case(..., kv_dtype=...)`). Each
backend's jit holds every kind it runs on a case and takes its metadata from ShapeDtypeStructs of
q's and the cache's dtypes, as the engine computes it.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import make_batch, random_seqs, run_case
from pallas_kernels import (DECODE, MIXED, ragged_paged_attention, ragged_paged_attention_metadata,
                            ragged_paged_attention_reference, ragged_paged_attention_xla,
                            ragged_paged_attention_xla_metadata, xla_step_kind)

FP8 = jnp.float8_e4m3fn

# mixed_window_b8: float32 q, GQA 2, a window, prefill + chunk + decodes (the XLA path's one-pass
# bucket); mixed_window_softcap_bf16: bfloat16 q, GQA 4, head_dim 128, window and soft cap,
# prefill + chunk + decodes (its two-pass bucket). The decode cases: flash-decoding too.
MIXED_CASES = ["mixed_window_b8", "mixed_window_softcap_bf16"]
DECODE_CASES = ["decode_gqa4_d64_b16", "decode_gqa8_bf16_d128"]


def _shapes(args: tuple) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[:2])


def _pallas(kinds: tuple[str, ...], interpret: bool, kw: dict) -> Callable:
    def run(*args: jax.Array) -> list[jax.Array]:
        outs = []
        for kind in kinds:
            md = ragged_paged_attention_metadata(*_shapes(args), *args[2:], kind=kind)
            outs.append(ragged_paged_attention(*args, **kw, interpret=interpret, kind=kind,
                                               metadata=md))
        return outs
    return run


def _xla(kind: str, kw: dict) -> Callable:
    def run(*args: jax.Array) -> list[jax.Array]:
        md = ragged_paged_attention_xla_metadata(*_shapes(args), *args[2:], kind=kind,
                                                 sliding_window=kw["sliding_window"])
        return [ragged_paged_attention_xla(*args, **kw, kind=kind, metadata=md)]
    return run


def _reference(kw: dict) -> Callable:
    return lambda *args: [ragged_paged_attention_reference(*args, **kw)]


def _check(name: str, make: Callable[[dict, tuple, int], Callable], tol: float) -> None:
    """Case ``name`` with an fp8 cache through ``make(kw, args, live rows)``'s function (a list
    of outputs): each is q's dtype and matches the oracle on the dequantized cache, padding rows
    zeros."""
    args, truth, kw, total, dtype = run_case(name, kv_dtype=FP8)
    assert args[1].dtype == FP8 and args[0].dtype == dtype
    outs = jax.jit(make(kw, args, total))(*args)
    for out in outs:
        assert out.dtype == dtype and out.shape == args[0].shape
        out = np.asarray(out.astype(jnp.float32))
        np.testing.assert_allclose(out, truth, atol=tol, rtol=tol)
        assert np.all(out[total:] == 0), "padding rows must be zeros"


def _tol(name: str, interpret: bool = True) -> float:
    if "bf16" in name:
        return 2e-2
    return 1e-5 if interpret else 2e-4


@pytest.mark.parametrize("name", MIXED_CASES + DECODE_CASES)
def test_pallas_reads_fp8_cache(name: str, interpret: bool) -> None:
    """The mixed kernel on every case, flash-decoding too on the decode cases."""
    kinds = (MIXED, DECODE) if name in DECODE_CASES else (MIXED,)
    _check(name, lambda kw, args, total: _pallas(kinds, interpret, kw), _tol(name, interpret))


@pytest.mark.parametrize("name", MIXED_CASES)
def test_xla_reads_fp8_cache(name: str) -> None:
    """The XLA path at the host's kind for the batch (its passes, its metadata)."""
    def make(kw: dict, args: tuple, total: int) -> Callable:
        n = int(args[5][0])
        kind = xla_step_kind(np.diff(np.asarray(args[4]))[:n], args[0].shape[0])
        return _xla(kind, kw)
    _check(name, make, _tol(name))


@pytest.mark.parametrize("name", MIXED_CASES)
def test_reference_reads_fp8_cache(name: str) -> None:
    _check(name, lambda kw, args, total: _reference(kw), _tol(name))


@pytest.mark.parametrize("kind", [DECODE, MIXED])
def test_triton_kernels_lower_with_fp8_cache(kind: str, lower_for_cuda) -> None:
    """Both kernels lower to one Triton call for CUDA with bfloat16 q and an fp8 cache, which
    reaches the kernel as fp8 (upcast inside it, not in XLA before it: no bfloat16 copy of the
    cache); the output is bfloat16."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, random_seqs(rng, 3, "decode"), num_kv_heads=2, group=4, head_dim=64,
                   block_size=16, max_num_seqs=4, num_tokens=8)
    args = b.args(jnp.bfloat16)
    args = (args[0], args[1].astype(FP8), *args[2:])
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, sliding_window=9,
                                                   soft_cap=5.0, interpret=False, kind=kind))
    lowered = lower_for_cuda(fn, *args)
    assert lowered.triton_calls == 1
    calls = [line for line in lowered.text.splitlines()
             if "@__gpu$xla.gpu.triton" in line or "@triton_kernel_call_ffi" in line]
    assert len(calls) == 1
    operands, results = calls[0].rsplit(" : (", 1)[1].split(") -> ", 1)
    assert "xf8E4M3FN>" in operands and "xbf16>" in operands
    assert "f8E4M3FN" not in results
    assert "tensor<" + "x".join(map(str, (b.kv_cache.size // 64, 64))) + "xf8E4M3FN>" in operands


@pytest.mark.parametrize("name", MIXED_CASES[:1])
def test_fp8_cache_kept_as_bytes_reads_and_writes_the_same(name: str) -> None:
    """An fp8 cache kept as its bytes (`FP8_BYTES`, the CPU's storage: XLA:CPU has no float8
    scatter): the XLA path and the reference give the fp8 cache's outputs bit for bit, and
    `write_kv_cache` writes the bytes of the fp8 write (saturation included)."""
    from pallas_kernels import FP8_BYTES, write_kv_cache

    args, _, kw, _, _ = run_case(name, kv_dtype=FP8)
    as_bytes = (args[0], jax.lax.bitcast_convert_type(args[1], FP8_BYTES), *args[2:])
    n = int(args[5][0])
    kind = xla_step_kind(np.diff(np.asarray(args[4]))[:n], args[0].shape[0])
    for run in (_xla(kind, kw), _reference(kw)):
        want, got = (np.asarray(jax.jit(run)(*a)[0].astype(jnp.float32)) for a in (args, as_bytes))
        np.testing.assert_array_equal(got, want)
    cache = args[1]
    k = jnp.asarray(np.random.default_rng(0).normal(0, 300, (3, cache.shape[2] // 2,
                                                             cache.shape[3])), jnp.float32)
    slots = jnp.array([0, -1, 5], jnp.int32)
    want = write_kv_cache(cache, k, -k, slots)
    got = write_kv_cache(jax.lax.bitcast_convert_type(cache, FP8_BYTES), k, -k, slots)
    assert got.dtype == FP8_BYTES
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(jax.lax.bitcast_convert_type(want, FP8_BYTES)))

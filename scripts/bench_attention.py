"""Benchmark ragged paged attention: the Pallas kernels and the XLA path vs the jnp reference vs
dense XLA attention.

    python scripts/bench_attention.py            # full sizes (GPU, TPU): decode 256 x 1, ctx 1k-4k
    python scripts/bench_attention.py --small    # CPU-friendly sizes (kernels in interpret mode)

The Triton kernel runs on GPUs, the Mosaic kernel (pallas-tpu) on TPUs; on the CPU both run in
interpret mode, whose timings time the interpreter and say nothing about either device.

Reports the median time per call, achieved HBM bandwidth (each sequence's K/V read once, plus q
and out) and useful TFLOP/s (causal score + PV FLOPs; the dense comparison computes unmasked
attention over K/V of the same sizes, so its useful rate is what an unpaged kernel would give), and
the fraction of the device's peak where the device kind is known (H100/H200, TPU v4-v6e).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench_common import device_peaks
from pallas_kernels import (DECODE, MIXED, TileConfig, ragged_paged_attention,
                            ragged_paged_attention_reference, xla_step_kind,
                            ragged_paged_attention_tpu, ragged_paged_attention_xla,
                            to_tpu_kv_cache)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    seqs: tuple[tuple[int, int], ...]     # (q_len, kv_len) per sequence
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


def build(shape: Shape, seed: int = 0) -> tuple:
    """The kernels' arguments: q, a paged KV cache whose pages are shuffled over its blocks (block
    0 unused), kv lengths, page tables, query start offsets, the number of sequences."""
    rng, bs, dtype = np.random.default_rng(seed), shape.block_size, jnp.dtype(shape.dtype)
    pages = [-(-kv // bs) for _, kv in shape.seqs]
    nb = sum(pages) + 1
    cache = jax.random.normal(jax.random.key(seed), (nb, bs, 2 * shape.num_kv_heads, shape.head_dim), dtype)
    perm = rng.permutation(np.arange(1, nb)).astype(np.int32)
    tables = np.zeros((len(shape.seqs), max(pages)), np.int32)
    for s, (n, c) in enumerate(zip(pages, np.cumsum([0, *pages]))):
        tables[s, :n] = perm[c:c + n]
    q_lens = [q for q, _ in shape.seqs]
    q = jax.random.normal(jax.random.key(seed + 1), (sum(q_lens), shape.num_q_heads, shape.head_dim), dtype)
    return (q, cache, jnp.array([kv for _, kv in shape.seqs], jnp.int32), jnp.asarray(tables),
            jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
            jnp.array([len(shape.seqs)], jnp.int32))


def work(shape: Shape) -> tuple[float, float]:
    """(bytes, flops) of one call: each sequence's K/V read once, causal score/PV FLOPs."""
    item = jnp.dtype(shape.dtype).itemsize
    kv_bytes = sum(kv for _, kv in shape.seqs) * 2 * shape.num_kv_heads * shape.head_dim * item
    qo_bytes = 2 * sum(q for q, _ in shape.seqs) * shape.num_q_heads * shape.head_dim * item
    visible = sum(sum(kv - q + j + 1 for j in range(q)) for q, kv in shape.seqs)
    return kv_bytes + qo_bytes, 4.0 * visible * shape.num_q_heads * shape.head_dim


def dense_equivalent(shape: Shape) -> Callable[[], jax.Array]:
    """jax.nn.dot_product_attention over dense K/V of the same sizes, one call per (q, kv) group."""
    dtype, calls = jnp.dtype(shape.dtype), []
    for i, ((ql, kv), n) in enumerate(Counter(shape.seqs).items()):
        key = jax.random.key(100 + i)
        q = jax.random.normal(key, (n, ql, shape.num_q_heads, shape.head_dim), dtype)
        k = jax.random.normal(key, (n, kv, shape.num_kv_heads, shape.head_dim), dtype)
        calls.append((q, k, k))
    fn = jax.jit(lambda cs: [jax.nn.dot_product_attention(q, k, v) for q, k, v in cs])
    return lambda: fn(calls)


def timeit(fn: Callable[[], object], iters: int) -> float:
    """Median seconds of `iters` calls, after one untimed (compiling) call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def shapes(small: bool) -> list[Shape]:
    """The benchmarked batches: CPU-sized ones when `small`."""
    if small:
        decode = [Shape(f"decode 16x1 ctx{c}", ((1, c),) * 16, 8, 2, 64, 16, "float32") for c in (128, 256)]
        return decode + [Shape("mixed 2x64 chunk + 14 decode", ((64, 128),) * 2 + ((1, 192),) * 14,
                               8, 2, 64, 16, "float32")]
    decode = [Shape(f"decode 256x1 ctx{c}", ((1, c),) * 256, 32, 8, 128, 16, "bfloat16")
              for c in (1024, 2048, 4096)]
    return decode + [
        Shape("mixed 7x256 chunk(ctx1k) + 256 decode(ctx2k)",
              ((256, 1024),) * 7 + ((1, 2048),) * 256, 32, 8, 128, 16, "bfloat16"),
        Shape("prefill 4x1024", ((1024, 1024),) * 4, 32, 8, 128, 16, "bfloat16")]


def implementations(shape: Shape, args: tuple, interpret: bool,
                    with_kernel: bool) -> dict[str, Callable[[], object]]:
    """Name -> a call on `args`: the platform's Pallas kernels (both on the CPU, interpreted) unless
    not `with_kernel`, the XLA path, the jnp reference and the dense comparison."""
    scale, platform = shape.head_dim ** -0.5, jax.default_backend()
    impls: dict[str, Callable[[], object]] = {}
    if with_kernel and platform in ("tpu", "cpu"):
        f = jax.jit(functools.partial(ragged_paged_attention_tpu, sm_scale=scale,
                                      interpret=platform != "tpu"))
        impls["pallas-tpu (Mosaic)"] = functools.partial(f, args[0], to_tpu_kv_cache(args[1]), *args[2:])
    if with_kernel and platform in ("gpu", "cpu"):
        variants = [("pallas mixed", MIXED, None)]
        if all(q == 1 for q, _ in shape.seqs):
            variants.insert(0, ("pallas flash-decode", DECODE, None))
        elif any(q == 1 for q, _ in shape.seqs):  # the bucket's tiles against prompt-sized ones
            variants.append(("pallas mixed, 128-row tiles", MIXED, TileConfig(128, 64, num_warps=8)))
        for name, kind, tiles in variants:
            f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, interpret=interpret,
                                          kind=kind, tiles=tiles))
            impls[name] = functools.partial(f, *args)
    # the XLA path with the kind the engine's host rule gives this batch
    xla_kind = xla_step_kind(np.array([q for q, _ in shape.seqs]), args[0].shape[0])
    for name, fn, kw in (("xla", ragged_paged_attention_xla, dict(kind=xla_kind)),
                         ("jnp reference", ragged_paged_attention_reference, {})):
        impls[name] = functools.partial(jax.jit(functools.partial(fn, sm_scale=scale, **kw)), *args)
    impls["dense XLA dot_product_attention (no mask)"] = dense_equivalent(shape)
    return impls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU-friendly sizes")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per row (median)")
    ap.add_argument("--no-kernel", action="store_true", help="skip the Pallas kernels")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args()
    iters = a.iters or (3 if a.small else 20)
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    peak = device_peaks(kind)
    interpret = jax.default_backend() == "cpu"  # the Triton kernel's; pallas-tpu picks its own
    print(f"device: {kind}  backend={jax.default_backend()}  interpret={interpret}  jax={jax.__version__}")
    print("| shape | impl | ms | GB/s | TFLOP/s | % peak HBM | % peak FLOP/s | speed vs reference |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in shapes(a.small):
        args = build(shape)
        nbytes, flops = work(shape)
        times = {name: timeit(fn, iters)
                 for name, fn in implementations(shape, args, interpret, not a.no_kernel).items()}
        for name, t in times.items():
            bw, tf = nbytes / t / 1e9, flops / t / 1e12
            pb = f"{100 * bw / peak[0]:.1f}" if peak else "-"
            pf = f"{100 * tf / peak[1]:.1f}" if peak else "-"
            print(f"| {shape.name} | {name} | {t * 1e3:.3f} | {bw:.1f} | {tf:.3f} | {pb} | {pf} "
                  f"| {times['jnp reference'] / t:.2f}x |", flush=True)
            rows.append(dict(shape=shape.name, impl=name, seconds=t, gbps=bw, tflops=tf, device=kind))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""The engine's step alone, its forward then its sampler, on an empty batch (no live sequence, so
no attention work): the model's matmuls, norms and sampling per layer layout and projection form,
with compile times.

    python scripts/bench_step.py [--rows 32 2048] [--layouts stacked switched] [--forms io fm]
                                 [--cpu-malloc tuned|default] [--dtype float32] [--rounds 8]

Every variant is compiled first, then the rounds interleave them (5 steps each at <= 256 rows,
1 above), so machine noise hits all alike; prints min / p25 / median ms per variant.
Layouts: ``layer_layout`` (models/llama.py). Forms: ``io`` computes projections as
x @ W^T, ``fm`` feature-major for batches of <= ``runner.FEATURE_MAJOR_ROWS`` rows (``project``).
``--cpu-malloc``: ``tune_cpu_malloc`` (minivllm_jax/host_malloc.py), a process-wide setting, so
compare it across invocations; the minor page faults a step show what it changes.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from minivllm_jax import LLM  # noqa: E402
from minivllm_jax.config import LAYER_LAYOUTS  # noqa: E402
from minivllm_jax.runner import FEATURE_MAJOR_ROWS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 2048], help="token buckets to time")
    p.add_argument("--layouts", nargs="+", default=["stacked", "switched"], choices=LAYER_LAYOUTS)
    p.add_argument("--forms", nargs="+", default=["io", "fm"], choices=["io", "fm"])
    p.add_argument("--cpu-malloc", default="tuned", choices=["tuned", "default"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()

    variants = {}  # (layout, form, rows) -> (runner, shape, compiled forward, compiled sampler)
    for layout in args.layouts:
        llm = LLM(args.model, dtype=args.dtype, layer_layout=layout,
                  max_num_seqs=args.max_num_seqs, max_model_len=256, max_num_batched_tokens=max(args.rows),
                  num_kv_blocks=64, tune_cpu_malloc=args.cpu_malloc == "tuned")
        runner = llm.engine.runner
        shapes = {s.num_tokens: s for s in runner.step_shapes()
                  if s.num_sampled == min(s.num_tokens, args.max_num_seqs)}
        for rows in args.rows:
            if rows not in shapes:
                raise ValueError(f"--rows {rows} is not a token bucket; buckets: {sorted(shapes)}")
            for form in args.forms:
                if form == "fm" and rows > FEATURE_MAJOR_ROWS and "io" in args.forms:
                    continue  # the same program: fm applies to <= FEATURE_MAJOR_ROWS rows only
                runner.feature_major_rows = FEATURE_MAJOR_ROWS if form == "fm" else 0
                t = time.perf_counter()
                shape = shapes[rows]
                forward, sampler = (runner.lower(k).compile() for k in (shape.forward, shape.sampler))
                print(f"{layout:8s} {form} {rows:5d} rows: lower + compile {time.perf_counter() - t:.1f} s",
                      flush=True)
                variants[layout, form, rows] = (runner, shape, forward, sampler)

    times: dict[tuple, list[float]] = {k: [] for k in variants}
    faults: dict[tuple, list[int]] = {k: [] for k in variants}  # minor page faults a step
    for _ in range(args.rounds):
        for key, (runner, shape, forward, sampler) in variants.items():
            for _ in range(5 if shape.num_tokens <= 256 else 1):
                forward_args = runner.empty_step_args(shape.forward)
                _, _, sampler_buf, last = runner.empty_step_args(shape.sampler)
                f, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                hidden, runner.kv_cache = forward(*forward_args)  # the forward donates the cache
                jax.block_until_ready(sampler(runner.head_params, hidden, sampler_buf, last))
                times[key].append(time.perf_counter() - t)
                faults[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
    for (layout, form, rows), ts in times.items():
        ms = np.asarray(ts) * 1e3
        print(f"{layout:8s} {form} {rows:5d} rows: min {ms.min():.1f}  p25 {np.percentile(ms, 25):.1f}  "
              f"median {np.median(ms):.1f} ms; {np.median(faults[layout, form, rows]):.0f} minor page "
              f"faults a step (median)")


if __name__ == "__main__":
    main()

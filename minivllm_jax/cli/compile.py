"""Compile every step program for a TPU topology, or lower it for a CUDA GPU, ahead of time, on
any machine (no TPU or GPU needed).

    minivllm-jax compile --model DIR --topology v5e:2x4 [--tensor-parallel-size N] \\
        [the engine options of generate] [--json FILE]
    minivllm-jax compile --model DIR --platform cuda [engine options] [--json FILE]

DIR needs only the model's config.json (no weights are read). With --topology, each forward
(per token bucket and attention kind) and each sampler (per sample bucket and sampling kind) is
compiled with libtpu for the topology's chips, the KV cache sized from their HBM as the engine
sizes it there; a table (per device: arguments, temporaries, XLA's flops and time estimate
counting every layer, the conditionals and loops) and the cache's size are printed, and --json
writes the full report (docs/API.md §2b). With --platform cuda the same programs are lowered
for a CUDA GPU: the table shows their conditionals and loops. Exit status 0 when every program
compiles and fits (lowers); 1 (one `error: ...` line on stderr naming the program and why) when
one does not, or libtpu is missing; 2 for bad input.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Iterator, Sequence

from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs, run_cli

TOPOLOGY_EXAMPLES = "v5e:2x2, v5e:2x4, v6e:2x2, v4:2x2x1, v5p:2x2x1"
# libtpu, loaded on a machine without a TPU: no metadata server to ask, and no TPU to lock
# (/tmp/libtpu_lockfile would keep a second compile, or a TPU job, from starting)
LIBTPU_ENV = {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_engine_options(p, skip=("--async-scheduling",),
                       model_help="model directory; only its config.json is read",
                       dtype_help="auto: the checkpoint's 16-bit dtype, else bfloat16")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--topology",
                        help=f"TPU topology as libtpu names it, e.g. {TOPOLOGY_EXAMPLES}")
    target.add_argument("--platform", choices=("cuda",),
                        help="lower for a CUDA GPU instead (no GPU needed; no memory or cost figures)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the full report here")
    return p


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 on /dev/null: libtpu's start-up logs (from C++) go there, not to the
    user; Python errors are raised, not printed, so nothing of ours is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


HEADER = (f"{'program':<8} {'kind':<8} {'tokens':>6} {'sampled':>7} {'ok':>4} {'args MiB':>9} "
          f"{'temp MiB':>9} {'code MiB':>8} {'GFLOP':>8} {'est. us':>8} {'cond':>4} {'while':>5}")


def row(p: dict[str, Any]) -> str:
    """One program's line of the table."""
    mib = 2**20
    figures = (f"{p['argument_bytes'] / mib:>9.1f} {p['temp_bytes'] / mib:>9.1f} "
               f"{p['generated_code_bytes'] / mib:>8.1f} {p['flops'] / 1e9:>8.2f} "
               f"{p['estimated_seconds'] * 1e6:>8.1f}") if p["argument_bytes"] else \
        f"{'-':>9} {'-':>9} {'-':>8} {'-':>8} {'-':>8}"  # not compiled
    flow = p["control_flow"] or {}
    return (f"{p['program']:<8} {p['kind']:<8} {p['num_tokens']:>6} {p['num_sampled']:>7} "
            f"{'ok' if p['ok'] else 'FAIL':>4} {figures} {flow.get('conditional', '-'):>4} "
            f"{flow.get('while', '-'):>5}")


def table(report: dict[str, Any], target: str, seconds: float, rows: bool = True) -> str:
    """The report for a person: the target, one line per program (unless `rows`: they were
    printed as they came), then the KV cache."""
    hbm = report["hbm_bytes_per_device"]
    memory = "" if hbm is None else f": {hbm / 2**30:.2f} GiB HBM per device"
    lines = [f"{report['device_kind']} x{report['num_devices']} ({target}), tensor parallel "
             f"{report['tensor_parallel_size']}{memory}; attention {report['attention_backend']}, "
             f"weights {report['quantization'] or 'unquantized'} "
             f"({report['weight_bytes_per_device'] / 2**30:.2f} GiB per device), "
             f"KV cache {report['kv_cache_dtype']}"]
    if rows:
        lines += [HEADER, *map(row, report["programs"])]
    blocks, bs = report["num_kv_blocks"], report["block_size"]
    length = report["max_model_len"]
    lines.append(f"KV cache: {blocks} blocks of {bs} tokens, "
                 f"{report['kv_cache_bytes_per_device'] / 2**30:.2f} GiB per device "
                 f"({(blocks - 1) * bs / length:.1f} requests of max_model_len {length}); "
                 f"{len(report['programs'])} programs in {seconds:.0f} s")
    return "\n".join(lines)


def failure(report: dict[str, Any]) -> str | None:
    """One line naming the first program that failed to compile or does not fit, and why."""
    for p in report["programs"]:
        if not p["ok"]:
            rows = (f"{p['num_tokens']} tokens" if p["program"] == "forward"
                    else f"{p['num_sampled']} sampled rows")
            rows += f", {p['kind']}" if p["kind"] != "mixed" else ""
            return f"{p['program']} ({rows}): {p['error']}"
    return None


def run(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    if args.model is None:
        raise ValueError("--model is required: a model directory holding its config.json")
    for name, value in LIBTPU_ENV.items():  # before jax starts
        os.environ.setdefault(name, value)
    kwargs = engine_kwargs(args)
    if args.platform == "cuda" and kwargs.get("tensor_parallel_size", 1) > 1:
        # a mesh to lower over: as many CPU devices as the GPUs it stands for (before jax starts)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                                   f"device_count={kwargs['tensor_parallel_size']}").strip()
    from minivllm_jax import aot
    from minivllm_jax.config import EngineConfig

    config = EngineConfig.from_kwargs("compile", kwargs)
    if args.platform == "cuda":
        return finish(aot.lower_for_cuda, args, config, "cuda")
    try:
        with quiet_stderr():  # libtpu's start-up logs
            aot.topology_devices(args.topology)
    except aot.LibtpuMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        raise ValueError(f"--topology: {e}; examples: {TOPOLOGY_EXAMPLES}") from None
    return finish(lambda model, cfg, progress: aot.compile_for_topology(
        model, args.topology, cfg, progress), args, config, args.topology)


def finish(build: Any, args: argparse.Namespace, config: Any, target: str) -> int:
    """Build the report (``build(model, config, progress)``), printing each program's line as it
    comes, then the rest of the table; write --json; the exit status."""
    start = time.perf_counter()
    print(f"{target}: one line per program as it is built (each can take seconds)\n{HEADER}",
          flush=True)
    report = build(args.model, config, lambda p: print(row(p), flush=True))
    print(table(report, target, time.perf_counter() - start, rows=False))
    if args.json is not None:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    why = failure(report)
    if why is not None:
        print(f"error: {' '.join(why.split())}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """The exit status: 0 (every program compiles and fits), 1 (one does not; libtpu missing)
    or 2 (bad input); one `error: ...` line on stderr for each failure."""
    return run_cli(lambda: run(argv, prog))

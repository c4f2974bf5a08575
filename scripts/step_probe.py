"""Where a steady decode step's time goes: every device program the engine launches and every
host-to-device copy, timed twice, at the engine's own batch; and which of the step fixes (no
run-time conditional, metadata once a step, one transfer a step) the step's time depends on.

    python scripts/step_probe.py --model qwen3-0.6b --dtype bfloat16 --num-seqs 128 --variants all
    python scripts/step_probe.py --model llama-tiny --dtype float32 --num-seqs 8 --input-len 32

--num-seqs requests of --input-len random ids are prefilled, then --steps decode steps run in each
of two passes. "launch": the steps as the engine runs them, recording how long each program call
and each copy takes to return (a call that returns late waits for the device, for memory or for a
transfer; an asynchronous one returns in well under a millisecond), and the dispatch split:
`build_step_arrays`, `StepShape.pack`, the copies to the device, the forward and the sampler
program calls, and the rest of `runner.dispatch`. "blocking": the same steps with a wait for
every result, so each program's and copy's own device time shows. Also reported: the KV cache's
size, whether a step updates it in place (its buffer address is unchanged), the step's split as
`bench.py` reports it (schedule, dispatch, collect, ...), the transfers a step makes each way
(an extra pass under `jax.transfer_guard_*("log_explicit")`, whose log lines on stderr are
counted; XLA:CPU logs no device-to-host copies) and the step programs compiled, with each one's
HLO `conditional` and `while` counts (on the CPU the switched layer layout adds its own).

--variants (default: all on an accelerator, none on the CPU): each variant builds a fresh engine
(`jax.clear_caches()`, no executable cache) with one fix turned off by patching the library in
this process, runs the same prefill and decode steps and checks its greedy tokens against
`fixed`'s: `fixed` (the code as it is), `cond-attention` (the kernel picked at run time by a
`lax.cond` on the batch being pure decode, each branch deriving its own metadata; the host
always says "mixed"), `cond-sampler` (a `lax.cond` on the batch being all greedy, and one on its
filters; the host always says "filtered"), `metadata-per-layer` (each layer's kernel derives the
step's metadata), `two-transfers` (the forward's buffer and the sampler's part each moved by an
eager `jnp.asarray`, no early copy of the sampled ids to the host), and `all-off` (all four:
closest to the code before the fixes). A summary compares the variants' decode steps with
`fixed`'s and names the fix whose absence costs the most. --time-budget skips the variants that
would not fit. Variants need the current tree; on an older one they are skipped with a note.

--trace DIR (default $OUT/trace when $OUT is set): a few steady steps of `fixed` (and of
`all-off`, time allowing; without variants, of the one engine) run under `jax.profiler.trace`;
from its Perfetto JSON the probe prints per step the wall time, the device's busy time (the
union of the events on the device's stream lines), busy % and the device-to-host memcpys.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import numpy as np

import bench_common as bc
from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs, run_cli

# single fixes first after the two ends, so a short budget still compares the ends
VARIANTS = ("fixed", "all-off", "cond-attention", "cond-sampler", "metadata-per-layer",
            "two-transfers")
SINGLE = VARIANTS[2:]
# variant -> (the fix it turns off, what runs instead)
CAUSE = {"cond-attention": ("the host-chosen attention kind", "a run-time cond picks the kernel"),
         "cond-sampler": ("the host-chosen sampling kind", "run-time conds in the sampler"),
         "metadata-per-layer": ("the once-a-step attention metadata", "every layer derives it"),
         "two-transfers": ("the one transfer a step", "two eager jnp.asarray copies")}
# what a variant patches, (module, attribute path): absent in the tree before the fixes
NEEDS = {"cond-attention": [("minivllm_jax.worker.input_batch", "step_kind")],
         "cond-sampler": [("minivllm_jax.worker.input_batch", "sampling_kind")],
         "metadata-per-layer": [("minivllm_jax.models.llama", "with_kernel_metadata")],
         "two-transfers": [("minivllm_jax.worker.runner", "ModelRunner._to_device")]}
NEEDS["all-off"] = [n for v in SINGLE for n in NEEDS[v]]
STEP_EVENT = "probe_step"  # the host annotation around each traced step
STARTED = time.perf_counter()  # --time-budget counts from here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p, model_help=f"a random-weight shape ({', '.join(bc.MODEL_SHAPES)}) or a "
                                     "checkpoint", dtype_help="weights; auto: float32 on CPU, else bfloat16")
    p.add_argument("--num-seqs", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per pass")
    p.add_argument("--variants", default=None, metavar="all|none|A,B,...",
                   help=f"fixes turned off one at a time ({', '.join(VARIANTS)}); default: all on "
                        "an accelerator, none on the CPU")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="profile a few steps into DIR (default: $OUT/trace when $OUT is set)")
    p.add_argument("--trace-steps", type=int, default=5)
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="skip variants (and traces) that would end after S seconds")
    args = p.parse_args(argv)
    if args.steps < 1 or args.trace_steps < 1:
        raise ValueError("--steps and --trace-steps must be >= 1")
    if args.trace is None and os.environ.get("OUT"):
        args.trace = os.path.join(os.environ["OUT"], "trace")
    return args


def variant_list(spec: str | None, on_cpu: bool) -> list[str]:
    spec = spec or ("none" if on_cpu else "all")
    if spec == "none":
        return []
    names = list(VARIANTS) if spec == "all" else [v.strip() for v in spec.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise ValueError(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}, all or none")
    return names


class Timers:
    """Wall times by label; `blocking`: wait for each result before the clock stops."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self.blocking = False
        self.on = False

    def wrap(self, label: str, fn: Callable[..., Any], block: bool = True) -> Callable[..., Any]:
        import jax

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.blocking and block:
                jax.block_until_ready(out)
            if self.on:
                self.times[label].append(time.perf_counter() - t0)
            return out
        return timed

    def report(self, title: str, steps: int) -> None:
        print(f"{title}: per decode step (ms; median of the calls x calls per step)")
        for label, ts in sorted(self.times.items()):
            print(f"  {label:<44} {1e3 * statistics.median(ts):8.3f} x {len(ts) / steps:.0f}")

    def dispatch_split(self, steps: int) -> str:
        """`runner.dispatch`'s mean ms per step, by part; "rest" is what no part covers."""
        def per_step(prefix: str) -> float:
            return 1e3 * sum(sum(ts) for k, ts in self.times.items() if k.startswith(prefix)) / steps
        parts = {"build_step_arrays": per_step("build_step_arrays"),
                 "pack": per_step("StepShape.pack"), "copy": per_step("copy to device"),
                 "forward call": per_step("program forward"),
                 "sampler call": per_step("program sampler")}
        total = per_step("runner.dispatch")
        parts["rest"] = total - sum(parts.values())
        return " ".join(f"{k}={v:.3f}" for k, v in parts.items()) + f" | dispatch={total:.3f}"


class Patcher:
    """Attributes set for one engine's run, undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._undo.append((obj, name, vars(obj).get(name, Patcher)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, own = self._undo.pop()
            if own is Patcher:
                delattr(obj, name)
            else:
                setattr(obj, name, own)


def missing_names(variant: str) -> list[str]:
    """The names a variant patches that this tree of the library lacks."""
    import importlib

    out = []
    for module, path in NEEDS.get(variant, []):
        obj: Any = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            out.append(f"{module}.{path}")
    return out


def cond_attention(p: Patcher, backend: Any) -> str | None:
    """The kernel picked at run time again (the code before the fix), the host saying "mixed"."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels
    from minivllm_jax.worker import input_batch
    from pallas_kernels import DECODE, MIXED

    if backend.writes_kv or backend.step_kind is None:
        return f"backend {backend.name} has no step kinds: nothing to turn off"
    kernel = getattr(pallas_kernels, backend.kernel)

    def cond_kernel(q: Any, kv_cache: Any, kv_lens: Any, block_tables: Any, cu_q_lens: Any,
                    num_seqs: Any, *, kind: str = MIXED, metadata: Any = None, **opts: Any) -> Any:
        del kind, metadata  # each branch derives its own metadata
        args = (q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs)

        def branch(kind: str) -> Callable[..., Any]:
            return lambda *a: kernel(*a, kind=kind, **opts)
        if q.shape[0] > 2 * kv_lens.shape[0]:  # as before: only decode-sized buckets branched
            return branch(MIXED)(*args)
        live = jnp.arange(kv_lens.shape[0]) < num_seqs[0]
        pure_decode = jnp.all(jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1] == 1, True))
        return jax.lax.cond(pure_decode, branch(DECODE), branch(MIXED), *args)

    p.set(pallas_kernels, backend.kernel, cond_kernel)
    p.set(input_batch, "step_kind", lambda *a, **k: MIXED)
    return None


def cond_sampler(p: Patcher, backend: Any) -> str | None:
    """`sample` branching at run time on all-greedy, then on any filter; the host says "filtered"."""
    import jax
    import jax.numpy as jnp

    from minivllm_jax.worker import input_batch
    from minivllm_jax.sampling import sampler
    from minivllm_jax.worker import step_programs

    sample = sampler.sample

    def cond_sample(logits: Any, params: Any, vocab_major: bool = False, kind: str = "") -> Any:
        def run(kind: str) -> Callable[..., Any]:
            return lambda x, q: sample(x, q, vocab_major, kind).astype(jnp.int32)

        def drawn(x: Any, q: Any) -> Any:
            filters = (q.temperature > 0) & ((q.top_k > 0) | (q.top_p < 1.0) | (q.min_p > 0))
            return jax.lax.cond(jnp.any(filters), run(sampler.FILTERED), run(sampler.RANDOM), x, q)
        return jax.lax.cond(jnp.all(params.temperature <= 0.0), run(sampler.GREEDY), drawn,
                            logits, params)

    p.set(step_programs, "sample", cond_sample)
    p.set(input_batch, "sampling_kind", lambda *a, **k: sampler.FILTERED)
    return None


def metadata_per_layer(p: Patcher, backend: Any) -> str | None:
    from minivllm_jax.models import llama

    p.set(llama, "with_kernel_metadata", lambda md, *a, **k: md)
    return None


def two_transfers(p: Patcher, backend: Any) -> str | None:
    """Each buffer moved by its own eager copy, as before: the forward's, then the sampler's part
    (not the forward's output); and no early copy of the sampled ids to the host."""
    from minivllm_jax.parallel import sharding
    from minivllm_jax.worker.runner import ModelRunner

    launch_forward = ModelRunner._launch_forward

    def to_device(self: Any, host: np.ndarray) -> Any:
        return sharding.put_replicated(host, self.mesh)  # jnp.asarray without a mesh

    def forward_then_copy(self: Any, shape: Any, main: np.ndarray) -> Any:
        rows, hidden, _ = launch_forward(self, shape, main)
        return rows, hidden, self._to_device(main[shape.sampler_offset:])

    def dispatch_sampler(self: Any, in_flight: Any, bitmask: np.ndarray | None = None) -> None:
        shape, rows, buf, extra = in_flight.sampler
        in_flight.sampler = None
        in_flight.tokens, in_flight.logprobs, in_flight.spec = self._launch_sampler(
            shape, rows, buf, extra, bitmask)

    p.set(ModelRunner, "_to_device", to_device)
    p.set(ModelRunner, "_launch_forward", forward_then_copy)
    p.set(ModelRunner, "dispatch_sampler", dispatch_sampler)
    return None


PATCHES = {"cond-attention": cond_attention, "cond-sampler": cond_sampler,
           "metadata-per-layer": metadata_per_layer, "two-transfers": two_transfers}


def apply_variant(p: Patcher, variant: str, backend: Any) -> list[str]:
    """Patch the library for ``variant``; returns notes (a fix that had nothing to turn off)."""
    names = SINGLE if variant == "all-off" else [v for v in SINGLE if v == variant]
    return [f"{name}: {note}" for name in names if (note := PATCHES[name](p, backend))]


def instrument(p: Patcher, runner: Any, timers: Timers) -> None:
    """Time every program call and host-to-device copy, and `dispatch`'s parts. Only names that
    exist both before and after the fixes: `build_step_arrays` in the runner's namespace,
    `StepShape.pack`, `programs.get`, `dispatch`; copies through `_to_device` where the runner has
    it, else `sharding.put_replicated`."""
    from minivllm_jax.worker import runner as runner_module
    from minivllm_jax.step_layout import StepShape

    get = runner.programs.get
    p.set(runner.programs, "get", lambda key, a: timers.wrap(
        f"program {'forward' if key.num_tokens else 'sampler'} {key.num_tokens or key.num_sampled}",
        get(key, a)))
    p.set(runner_module, "build_step_arrays",
          timers.wrap("build_step_arrays", runner_module.build_step_arrays, block=False))
    p.set(StepShape, "pack", timers.wrap("StepShape.pack", StepShape.pack, block=False))
    p.set(runner, "dispatch", timers.wrap("runner.dispatch", runner.dispatch, block=False))
    if hasattr(runner, "_to_device"):
        p.set(runner, "_to_device", timers.wrap("copy to device", runner._to_device))
    else:
        p.set(runner_module.sharding, "put_replicated",
              timers.wrap("copy to device", runner_module.sharding.put_replicated))


@contextlib.contextmanager
def transfer_log() -> Iterator[dict[str, int]]:
    """Count the transfers JAX logs under ``log_explicit`` guards: its C++ log lines go to fd 2,
    which is a temporary file meanwhile; other lines are passed on to stderr afterwards."""
    import jax

    counts: dict[str, int] = {}
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            with jax.transfer_guard_host_to_device("log_explicit"), \
                    jax.transfer_guard_device_to_host("log_explicit"):
                yield counts
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines()
    counts["h2d"] = sum("host-to-device transfer" in line for line in lines)
    counts["d2h"] = sum("device-to-host transfer" in line for line in lines)
    for line in lines:
        if "-to-" not in line or " transfer" not in line:
            print(line, file=sys.stderr)


@dataclasses.dataclass
class Run:
    """One engine's measurements (times in ms, per decode step)."""

    name: str
    steps: list[float] = dataclasses.field(default_factory=list)  # launch pass, each step
    split: dict[str, float] = dataclasses.field(default_factory=dict)  # engine's, means
    blocking: float = 0.0
    h2d: float = float("nan")
    d2h: float = float("nan")
    programs: tuple[int, int] = (0, 0)
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # the whole run's wall time, build and compiles included

    @property
    def median(self) -> float:
        return statistics.median(self.steps) if self.steps else float("nan")

    def line(self, fixed: Run | None) -> str:
        ratio = f"x{self.median / fixed.median:5.2f}" if fixed and fixed.steps else "      "
        split = self.split.get
        return (f"{self.name:<19} {self.median:7.3f} ms {ratio}  mean {statistics.mean(self.steps):7.3f}"
                f"  dispatch {split('dispatch', 0):6.3f}  collect {split('collect', 0):6.3f}"
                f"  blocking {self.blocking:7.3f}  h2d {self.h2d:.1f}  d2h {self.d2h:.1f}"
                f"  programs {self.programs[0]}+{self.programs[1]}")


def build_engine(args: argparse.Namespace, spec: Any, dtype: str, fresh: bool) -> Any:
    """The LLM for the probe; ``fresh``: nothing compiled earlier in this process or on disk."""
    import jax

    from minivllm_jax.config import EngineConfig

    kw = engine_kwargs(args)
    kw.update(dtype=dtype, max_num_seqs=max(args.num_seqs, kw.get("max_num_seqs", 0)))
    kw.setdefault("max_model_len", args.input_len + 4 * args.steps + 2 * args.trace_steps + 64)
    # a cache of the workload's blocks: no profiling step (its own compile) at start-up
    kw.setdefault("num_kv_blocks", args.num_seqs * (kw["max_model_len"] // 16 + 2) + 1)
    if fresh:
        jax.clear_caches()
        if "compile_cache" in {f.name for f in dataclasses.fields(EngineConfig)}:
            kw["compile_cache"] = False
    from minivllm_jax import LLM

    return LLM(spec.engine_model, **kw)


def prefill(engine: Any, args: argparse.Namespace, vocab_size: int) -> None:
    """Add the workload (the same ids every run), prefill it, and run the steps that compile the
    decode shapes."""
    from minivllm_jax import SamplingParams

    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=10 ** 6, ignore_eos=True, temperature=0.0)
    for _ in range(args.num_seqs):
        engine.add_request(rng.integers(100, vocab_size - 100, args.input_len).tolist(), params)
    while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # the decode shapes compile here
        engine.step()


def timed_passes(engine: Any, runner: Any, timers: Timers, run: Run, steps: int) -> None:
    """The launch pass and the blocking pass, printed; the launch pass's figures into ``run``."""
    for blocking in (False, True):
        timers.blocking, timers.on = blocking, True
        splits: dict[str, list[float]] = defaultdict(list)
        pointers, walls = set(), []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(1e3 * (time.perf_counter() - t0))
            for k, v in vars(engine.last_step).items():
                if isinstance(v, float):
                    splits[k].append(v)
            if blocking:
                pointers.add(runner.kv_cache.unsafe_buffer_pointer())
        timers.on = False
        timers.report(f"{'blocking' if blocking else 'launch'} pass, step {statistics.mean(walls):.2f} ms "
                      f"(median {statistics.median(walls):.2f})", steps)
        if not blocking:
            run.steps = walls
            run.split = {k: 1e3 * statistics.mean(v) for k, v in splits.items()}
            print("  engine split (mean ms): " + " ".join(f"{k}={v:.2f}" for k, v in run.split.items()))
            print("  dispatch split (mean ms per step): " + timers.dispatch_split(steps))
        else:
            run.blocking = statistics.mean(walls)
            same = len(pointers) == 1
            print(f"  KV cache buffer address: {'unchanged (in place)' if same else f'{len(pointers)} different'}")
        timers.times.clear()


def count_transfers(engine: Any, run: Run, steps: int) -> None:
    """Transfers per decode step, each way, in an extra pass (the guards' logging costs time)."""
    with transfer_log() as counts:
        for _ in range(steps):
            engine.step()
    run.h2d, run.d2h = counts["h2d"] / steps, counts["d2h"] / steps
    note = "" if counts["h2d"] else " (none logged: is TF_CPP_MIN_LOG_LEVEL above 1?)"
    print(f"  transfers per step over {steps} steps: host-to-device {run.h2d:.1f}, "
          f"device-to-host {run.d2h:.1f}{note}")


def traced_steps(engine: Any, trace_dir: str, steps: int) -> None:
    """``steps`` decode steps under the profiler, each annotated, then the trace's summary."""
    import jax

    os.makedirs(trace_dir, exist_ok=True)
    started = time.time()
    options = None
    with contextlib.suppress(Exception):  # no Python call events: they would slow the host down
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
            for i in range(steps):
                with jax.profiler.StepTraceAnnotation(STEP_EVENT, step_num=i):
                    engine.step()
            jax.block_until_ready(engine.runner.last_tokens)
    except Exception as e:  # noqa: BLE001 - the probe goes on without a trace
        print(f"  trace: profiling failed: {type(e).__name__}: {e}")
        return
    paths = [q for q in glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)
             if os.path.getmtime(q) >= started - 1]
    paths.sort(key=lambda q: ("perfetto_trace" not in q, -os.path.getmtime(q)))
    if not paths:
        print(f"  trace: no *.json.gz under {trace_dir}")
        return
    try:
        summarize_trace(paths[0])
    except Exception as e:  # noqa: BLE001 - a format this parser does not know
        print(f"  trace: could not read {paths[0]}: {type(e).__name__}: {e}")


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``spans`` (start, end) clipped to [lo, hi]."""
    total, end = 0.0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _memcpy(name: str, way: str) -> bool:
    n = name.lower().replace(" ", "").replace("_", "")
    return "memcpy" in n and (way in n or {"d2h": "devicetohost", "h2d": "hosttodevice"}[way] in n
                              or {"d2h": "dtoh", "h2d": "htod"}[way] in n)


def device_lines(events: list[dict]) -> tuple[set[tuple[Any, Any]], str]:
    """The (pid, tid) lines of device work in a Chrome trace, and a description: a device
    process's stream lines ("Stream ..."), else its lines less XProf's derived ones."""
    procs = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in procs.items() if "/device:" in name}
    lines = {k: v for k, v in threads.items() if k[0] in device}
    streams = {k for k, v in lines.items() if v.lower().startswith("stream")}
    derived = ("xla modules", "xla ops", "steps", "framework", "source", "traceme", "launch")
    chosen = streams or {k for k, v in lines.items() if not v.lower().startswith(derived)}
    names = sorted({procs[k[0]] + ":" + lines[k] for k in chosen})
    what = f"processes {sorted(set(procs.values()))}" if not chosen else \
        f"{len(chosen)} device lines ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
    return chosen, what


def summarize_trace(path: str) -> None:
    """Per traced step: wall, device busy (union of device-line events), busy %, memcpys."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    chosen, what = device_lines(events)
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    dev = [e for e in spans if (e.get("pid"), e.get("tid")) in chosen]
    steps = sorted((e for e in spans if e.get("name") == STEP_EVENT and e not in dev),
                   key=lambda e: e["ts"])
    print(f"  trace {path}: {len(events)} events; " + (what if dev else f"no device events ({what})"))
    if not steps:
        names = defaultdict(int)
        for e in spans:
            names[e.get("name")] += 1
        print(f"  trace: no {STEP_EVENT!r} events; most frequent: {sorted(names, key=names.get)[-8:]}")
        return
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in dev]
    busy_all = wall_all = 0.0
    for i, s in enumerate(steps):
        lo, hi = float(s["ts"]), float(s["ts"]) + float(s.get("dur", 0))
        inside = [e for e in dev if lo <= float(e["ts"]) < hi]
        busy = _union(intervals, lo, hi)
        busy_all, wall_all = busy_all + busy, wall_all + hi - lo
        d2h = sum(_memcpy(str(e.get("name", "")), "d2h") for e in inside)
        h2d = sum(_memcpy(str(e.get("name", "")), "h2d") for e in inside)
        print(f"    step {i}: wall {(hi - lo) / 1e3:7.3f} ms" + (
            f"  device busy {busy / 1e3:7.3f} ms ({100 * busy / max(hi - lo, 1e-9):5.1f} %)  "
            f"device events {len(inside)}  memcpy d2h {d2h} h2d {h2d}" if dev else ""))
    if dev:
        copies = sorted({str(e.get("name")) for e in dev if "cpy" in str(e.get("name", "")).lower()
                         or "copy" in str(e.get("name", "")).lower()})
        print(f"    all steps: device busy {100 * busy_all / max(wall_all, 1e-9):.1f} % of the wall; "
              f"copy events named {copies[:6]}")


def run_engine(args: argparse.Namespace, spec: Any, dtype: str, variant: str | None,
               trace_dir: str | None) -> Run:
    """Build an engine (patched for ``variant``; None: as it is, no fresh start), measure it."""
    import jax

    from minivllm_jax.backends import ATTENTION_BACKENDS

    run, started, p = Run(variant or "default"), time.perf_counter(), Patcher()
    try:
        llm = build_engine(args, spec, dtype, fresh=variant is not None)
        engine, runner = llm.engine, llm.engine.runner
        if variant is not None:
            backend = ATTENTION_BACKENDS[runner.plan.backend.name]
            for note in apply_variant(p, variant, backend):
                print(f"  note: {note}")
            if runner.programs.compiled_shapes:
                print("  error: programs compiled before the patches: this variant is not what it says")
        timers = Timers()
        instrument(p, runner, timers)
        prefill(engine, args, spec.vocab_size)
        print(f"model={spec.label} dtype={dtype} device={jax.devices()[0].device_kind} "
              f"running={len(engine.scheduler.running)} async={engine.plan.async_scheduling} "
              f"backend={runner.plan.backend.name} kv_cache={runner.kv_cache.nbytes / 2**30:.2f} GiB")
        timed_passes(engine, runner, timers, run, args.steps)
        count_transfers(engine, run, max(1, min(args.steps, 5)))
        run.tokens = [list(r.output_token_ids) for r in list(engine.scheduler.running)[:4]]
        shapes = runner.programs.compiled_shapes
        run.programs = (sum(k.num_sampled == 0 for k in shapes), sum(k.num_tokens == 0 for k in shapes))
        print(f"  step programs compiled: {run.programs[0]} forward + {run.programs[1]} sampler; "
              f"HLO conditionals/whiles: {control_flow(runner.programs)}")
        if trace_dir is not None:
            traced_steps(engine, trace_dir, args.trace_steps)
    finally:
        p.undo()
    run.seconds = time.perf_counter() - started
    return run


def control_flow(programs: Any) -> str:
    """Each compiled step program's count of HLO ``conditional`` and ``while`` instructions."""
    out = []
    for key, program in sorted(getattr(programs, "_compiled", {}).items(),
                               key=lambda kv: (kv[0].num_sampled, kv[0].num_tokens, repr(kv[0]))):
        try:
            text = getattr(program, "compiled", program).as_text()  # a LoadedProgram holds one
        except Exception:  # noqa: BLE001 - a deserialized executable may not say
            continue
        forward = key.num_sampled == 0
        kind = getattr(key, "kind" if forward else "sampling", None)
        out.append(f"{'forward' if forward else 'sampler'} {key.num_tokens or key.num_sampled}"
                   f"{'/' + kind if kind else ''} {len(re.findall(r'[ =]conditional[(]', text))}/"
                   f"{len(re.findall(r'[ =]while[(]', text))}")
    return ", ".join(out) or "n/a"


def check_tokens(run: Run, ref: Run) -> None:
    """Greedy tokens of the first requests must not depend on which fixes are on."""
    for i, (a, b) in enumerate(zip(run.tokens, ref.tokens)):
        n = min(len(a), len(b))
        if a[:n] != b[:n]:
            print(f"  error: {run.name}: request {i}'s tokens differ from {ref.name}'s: "
                  f"{a[:n][:12]} vs {b[:n][:12]}")
            return
    print(f"  tokens: the first {len(run.tokens)} requests match {ref.name}'s")


def run_variants(args: argparse.Namespace, spec: Any, dtype: str, names: list[str]) -> list[Run]:
    """Each variant in turn within --time-budget; printed as it ends."""
    runs: list[Run] = []
    for name in names:
        missing = missing_names(name)
        if missing:
            print(f"== variant {name}: skipped: this tree has no {', '.join(missing)}")
            continue
        longest = max((r.seconds for r in runs), default=0.0)
        if args.time_budget is not None and time.perf_counter() - STARTED + longest > args.time_budget:
            print(f"== variant {name}: skipped: would end past --time-budget {args.time_budget:g} s")
            continue
        traced = args.trace is not None and name in ("fixed", "all-off")
        what = {"fixed": "the code as it is", "all-off": "all four fixes off"}.get(name)
        print(f"== variant {name}: {what or 'off: {} ({})'.format(*CAUSE[name])}")
        try:
            run = run_engine(args, spec, dtype, name,
                             os.path.join(args.trace, name) if traced else None)
        except Exception as e:  # noqa: BLE001 - the other variants still tell something
            print(f"  error: variant {name} failed: {type(e).__name__}: {str(e)[:2000]}")
            gc.collect()
            continue
        if runs:
            check_tokens(run, runs[0])
        print(f"  result: {run.line(runs[0] if runs else None)}  ({run.seconds:.0f} s)")
        runs.append(run)
        gc.collect()
    return runs


def summary(runs: list[Run]) -> None:
    fixed = next((r for r in runs if r.name == "fixed"), None)
    print("summary: steady decode step (ms): launch pass median (ratio vs fixed) and mean, the "
          "engine's dispatch and collect means, blocking pass mean, transfers per step, programs")
    for r in runs:
        print("  " + r.line(fixed))
    singles = [r for r in runs if r.name in SINGLE]
    if fixed is None or not singles:
        print("verdict: needs fixed and at least one single-fix variant")
        return
    worst = max(singles, key=lambda r: r.median)
    ratio = worst.median / fixed.median
    off = next((f"; all off: x{r.median / fixed.median:.2f}" for r in runs if r.name == "all-off"), "")
    if ratio < 1.05:
        print(f"verdict: no single fix is worth 5 % of the step here (largest: {worst.name}, "
              f"x{ratio:.2f}){off}")
    else:
        fix, instead = CAUSE[worst.name]
        print(f"verdict: the largest share of the step comes back when {fix} is off ({worst.name}, "
              f"{instead}: +{worst.median - fixed.median:.3f} ms, x{ratio:.2f}){off}")


def main() -> None:
    args = parse_args()
    import jax

    import minivllm_jax

    on_cpu = jax.default_backend() == "cpu"
    names = variant_list(args.variants, on_cpu)
    dtype = args.dtype if args.dtype not in (None, "auto") else ("float32" if on_cpu else "bfloat16")
    spec = bc.resolve_model(args.model, dtype)
    print(f"probe: minivllm_jax {minivllm_jax.__file__}, jax {jax.__version__}, {jax.devices()[0]}, "
          f"variants {','.join(names) or 'none'}, trace {args.trace}")
    if not names:
        run_engine(args, spec, dtype, None,
                   None if args.trace is None else os.path.join(args.trace, "default"))
        return
    summary(run_variants(args, spec, dtype, names))


if __name__ == "__main__":
    sys.exit(run_cli(main))

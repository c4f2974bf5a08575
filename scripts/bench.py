"""Throughput benchmark of the engine, optionally against Hugging Face transformers.

The nano-vllm workload: N requests with random prompt token ids of random length in
--input-len [LO, HI] and random output lengths in --output-len [LO, HI], ignore_eos=True, so each
request produces exactly its output length. Offline mode adds every request at once and steps the
engine until done; --online RATE adds requests at Poisson arrival times (req/s) from the same loop
and reports time to first token (TTFT) and time per output token (TPOT).

Warm-up (untimed): by default ("full") the same workload shapes with different token ids (another
seed, so no prefix-cache hits carry over) run once first, so every (token bucket, sample bucket)
the timed run meets is compiled; "short" only generates a few tokens for a few prompts (nano-vllm
style; later buckets then compile inside the timed run, which is reported).

--repeat K makes K timed rounds and reports the fastest run of each side (other processes on a
shared machine only ever slow a run down). A round is the engine's run, then transformers' pass
over the same token ids, so the machine's slow windows fall on both sides alike; each round's
ratio and their median are printed too. Rounds after the first redraw the token ids (same
lengths), so the prefix cache cannot help the engine.

--compare-hf runs transformers' batched `generate` on the same workload, weights and dtype in this
process: batches of --hf-batch-size prompts, left-padded, each batch generating exactly its largest
output length (min_new_tokens = max_new_tokens, so EOS cannot end a row early), because generate
cannot give each row its own length. Only each row's requested tokens count as useful output; the
extra tokens a row generates past its own length are wasted work that the engine does not do, and
are part of what the comparison measures. The HF run keeps the workload order (no length sorting).

Per-step host/device split: measured from the outside by wrapping the engine's phases
(scheduler.schedule, runner.dispatch, runner.build_step_arrays, runner.collect, the wait for the
sampled ids (sharding.to_host), scheduler.update_from_output, engine._process) with
time.perf_counter; the engine's files are not modified and nothing is synchronised that the
engine does not synchronise itself. One record per `step()` call, labelled with the model step
whose results that call collects. "device" is the time the host waits for those results: the
device time that host work did not hide. With async scheduling (--async-scheduling on; the
engine's default on accelerators) a call schedules and dispatches step N+1, then collects step N
and processes its outputs while N+1 runs: the device always has the next step queued, and
"host" is the host's time per call, overlapping the device rather than adding to it.

Roofline (GPU, or any device given --hbm-gbps): a step cannot take less than (bytes of all weights
+ bytes of the KV of every scheduled sequence) / peak memory bandwidth (table by jax device_kind).
The script prints this bound summed over the run's steps and for the mean decode step, and the
measured time as a multiple of it.

Examples:
  python scripts/bench.py --num-seqs 32 --input-len 32 192 --output-len 48 48 --dtype float32 --compare-hf
  python scripts/bench.py --model qwen3-0.6b --dtype bfloat16 --num-seqs 256 \
      --input-len 100 1024 --output-len 100 1024 --compare-hf
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from bench_common import (DTYPE_BYTES, CompileWatch, ModelSpec, Workload, dump_json,  # noqa: E402
                          kv_bytes_per_token, make_workload, peak_bandwidth_gbps, percentiles,
                          poisson_arrivals, resolve_model, weight_bytes_per_step)
from cli import run_cli  # noqa: E402

# ------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="default: the embedded SmolLM2-135M GGUF; a checkpoint directory; a .gguf "
                        "file; or a random-weight shape: qwen3-0.6b, llama-3.2-1b, llama-tiny "
                        "(for host-overhead runs)")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 192], metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=[48, 48], metavar=("LO", "HI"))
    p.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="weights and KV cache (default: float32 on CPU, bfloat16 on GPU; on CPU the KV cache "
                        "stays float32, see runner.kv_cache_dtype)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the workload's longest prompt + output, rounded up to a block")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="default: on CPU, enough blocks for the whole workload at once; on GPU, "
                        "the engine's gpu_memory_utilization sizing")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "pallas", "reference"))
    p.add_argument("--layers", default="auto", choices=("auto", "stacked", "switched", "unrolled"),
                   help="the engine's layer_layout (models/llama.py): stacked (nn.scan), switched "
                        "(a scan over per-layer weights) or unrolled (a Python loop over them); "
                        "auto: switched on one CPU device, else stacked (runner.resolve_layer_layout)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="LLM(tensor_parallel_size=N); on a CPU with virtual devices "
                        "(XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="LLM(data_parallel_size=N): N engine replicas stepped side by side from "
                        "host threads, requests spread over them (CPU backend; dp_engine.py). The "
                        "per-step split is not measured then")
    p.add_argument("--cpu-malloc", default="tuned", choices=("tuned", "default"),
                   help="LLM(tune_cpu_malloc=...): glibc settings that let XLA:CPU reuse each "
                        "step's memory (minivllm_jax/host_malloc.py); default: leave malloc alone")
    p.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                   help="the engine's async_scheduling: schedule and dispatch step N+1 before "
                        "collecting step N (auto: on for accelerators, off on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", default="full", choices=("full", "short", "all", "none"),
                   help="all: LLM.precompile() (every step shape), then the full warm-up")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed rounds, each an engine run then a transformers pass on the same "
                        "token ids; the fastest of each side is reported (robust to other load "
                        "on a shared machine), and each round's ratio. Rounds after the first "
                        "redraw the prompt token ids (same lengths), so no prefix-cache hits")
    p.add_argument("--online", type=float, default=None, metavar="RATE",
                   help="Poisson arrivals at RATE requests/s; reports TTFT and TPOT percentiles")
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="rows per transformers generate call (default: --max-num-seqs or 32)")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="one device's peak memory bandwidth for the roofline (default: table by "
                        "device kind)")
    p.add_argument("--json", default=None, metavar="OUT", help="append the results to this JSON list")
    args = p.parse_args(argv)
    if args.num_seqs < 1:
        p.error("--num-seqs must be >= 1")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')} needs 1 <= LO <= HI, got {lo} {hi}")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.online is not None and not (args.online > 0 and math.isfinite(args.online)):
        p.error("--online RATE must be a positive number of requests per second")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                 "hf_batch_size", "repeat", "tensor_parallel_size", "data_parallel_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ------------------------------------------------------------------------------------------
# Step instrumentation (from the outside: wraps engine callables, restores them afterwards)
# ------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    """One `step()` call: wall time and phase times (seconds); and for the model step whose
    results it collected (none: zeros), its scheduled tokens and requests and the bytes the
    roofline says it must read (weights + KV of every scheduled sequence)."""

    total: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    num_tokens: int = 0
    num_reqs: int = 0
    bytes_read: int = 0

    @property
    def is_decode(self) -> bool:
        return self.num_reqs > 0 and self.num_tokens == self.num_reqs

    @property
    def host(self) -> float:
        return self.total - self.phases.get("device", 0.0)


class StepProfiler:
    """Wraps the engine's phases with perf_counter; `missing` names what could not be wrapped."""

    def __init__(self, weight_bytes: int, kv_token_bytes: int) -> None:
        self.weight_bytes = weight_bytes
        self.kv_token_bytes = kv_token_bytes
        self.records: list[StepRecord] = []
        self.current = StepRecord()
        self.missing: list[str] = []
        self._dispatched: deque[tuple[int, int, int]] = deque()  # (tokens, reqs, bytes) in flight

    def _timed(self, name: str, fn: Callable[..., Any], after: Callable[[Any], None] | None = None
               ) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if after is not None:
                after(out)
            self.current.phases[name] = self.current.phases.get(name, 0.0) + time.perf_counter() - t0
            return out
        return wrapper

    def _on_schedule(self, so: Any) -> None:
        num_sched = getattr(so, "num_scheduled_tokens", {})
        kv_tokens = 0
        for new in getattr(so, "scheduled_new_reqs", []):
            kv_tokens += new.num_computed_tokens + num_sched.get(new.req_id, 0)
        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            for rid, comp in zip(cached.req_ids, cached.num_computed_tokens):
                kv_tokens += comp + num_sched.get(rid, 0)
        num_tokens = int(getattr(so, "total_num_scheduled_tokens", 0))
        if num_tokens:  # the runner dispatches (and the engine later collects) only these
            self._dispatched.append((num_tokens, len(num_sched),
                                     self.weight_bytes + kv_tokens * self.kv_token_bytes))

    def _on_collect(self, _: Any) -> None:
        rec = self.current
        rec.num_tokens, rec.num_reqs, rec.bytes_read = self._dispatched.popleft()

    @contextlib.contextmanager
    def install(self, llm: Any) -> Iterator["StepProfiler"]:
        undo: list[Callable[[], None]] = []

        def patch(owner: Any, attr: str, name: str, after: Callable[[Any], None] | None = None,
                  label: str = "") -> None:
            orig = getattr(owner, attr, None) if owner is not None else None
            if orig is None:
                self.missing.append(label or f"{name} ({attr})")
                return
            wrapped = self._timed(name, orig, after)
            for extra in ("_cache_size", "lower", "clear_cache"):  # keep the jit's helpers reachable
                if hasattr(orig, extra):
                    setattr(wrapped, extra, getattr(orig, extra))
            had_own = isinstance(owner, type(sys)) or attr in getattr(owner, "__dict__", {})
            setattr(owner, attr, wrapped)
            undo.append((lambda: setattr(owner, attr, orig)) if had_own
                        else (lambda: delattr(owner, attr)))

        engine = getattr(llm, "engine", None) or getattr(llm, "llm_engine", None) or llm
        if getattr(engine, "replicas", None):  # replicas step on threads: phases would interleave
            self.missing.append("every phase (data-parallel replicas step side by side)")
            yield self
            return
        scheduler = getattr(engine, "scheduler", None)
        runner = getattr(engine, "runner", None) or getattr(engine, "model_runner", None)
        runner_mod = sys.modules.get(type(runner).__module__) if runner is not None else None
        sharding = getattr(runner_mod, "sharding", None)
        patch(scheduler, "schedule", "schedule", self._on_schedule, "scheduler.schedule")
        patch(runner, "dispatch", "dispatch", label="runner.dispatch")
        patch(runner, "collect", "collect", self._on_collect, label="runner.collect")
        patch(runner_mod, "build_step_arrays", "prepare", label="runner.build_step_arrays")
        patch(sharding, "to_host", "device", label="sharding.to_host (waiting for the step)")
        patch(scheduler, "update_from_output", "update", label="scheduler.update_from_output")
        patch(engine, "_process", "output", label="engine._process")
        try:
            yield self
        finally:
            for fn in reversed(undo):
                fn()

    def step(self, llm: Any) -> list[Any]:
        self.current = StepRecord()
        t0 = time.perf_counter()
        deltas = llm.step()
        self.current.total = time.perf_counter() - t0
        self.records.append(self.current)
        return deltas


def split_summary(records: Sequence[StepRecord]) -> dict[str, Any]:
    """Mean per-step times (ms) over all steps and over pure-decode steps, split host/device."""
    def mean_ms(rs: Sequence[StepRecord], key: str) -> float:
        if not rs:
            return float("nan")
        if key == "total":
            vals = [r.total for r in rs]
        elif key == "host":
            vals = [r.host for r in rs]
        elif key == "host_other":  # in step() but in none of the wrapped phases
            vals = [r.total - sum(v for k, v in r.phases.items() if k not in ("prepare", "device"))
                    for r in rs]
        elif key == "execute_host":  # runner.dispatch + collect minus array building and the wait
            vals = [r.phases.get("dispatch", 0.0) + r.phases.get("collect", 0.0)
                    - r.phases.get("prepare", 0.0) - r.phases.get("device", 0.0) for r in rs]
        else:
            vals = [r.phases.get(key, 0.0) for r in rs]
        return 1e3 * float(np.mean(vals))

    out: dict[str, Any] = {}
    for label, rs in (("all", list(records)), ("decode", [r for r in records if r.is_decode]),
                      ("prefill", [r for r in records if r.num_tokens and not r.is_decode])):
        out[label] = {k: mean_ms(rs, k) for k in
                      ("total", "host", "device", "schedule", "prepare", "execute_host", "update",
                       "output", "host_other")}
        out[label]["num_steps"] = len(rs)
    return out


# ------------------------------------------------------------------------------------------
# Engine runs
# ------------------------------------------------------------------------------------------


def sampling_params(args: argparse.Namespace, max_tokens: int) -> Any:
    from minivllm_jax import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)


def delta_fields(delta: Any) -> tuple[str, list[int], bool]:
    return delta.request_id, list(delta.new_token_ids), bool(delta.finished)


def run_offline(llm: Any, workload: Workload, args: argparse.Namespace,
                profiler: StepProfiler | None) -> dict[str, Any]:
    """All requests added at t=0, then step until done. Returns elapsed time and token counts."""
    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        counts[llm.add_request(prompt, sampling_params(args, out_len), request_id=f"r{i}")] = 0
    steps = 0
    while llm.has_unfinished_requests():
        deltas = profiler.step(llm) if profiler else llm.step()
        steps += 1
        for rid, toks, _ in map(delta_fields, deltas):
            counts[rid] += len(toks)
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "num_steps": steps, "output_tokens": sum(counts.values()),
            "per_request_tokens": [counts[f"r{i}"] for i in range(len(workload.prompts))]}


def run_online(llm: Any, workload: Workload, args: argparse.Namespace,
               profiler: StepProfiler | None) -> dict[str, Any]:
    """Requests join at Poisson arrival times; one loop adds the arrived ones, then steps."""
    arrivals = poisson_arrivals(len(workload.prompts), args.online, args.seed)
    pending = deque(range(len(workload.prompts)))
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    counts = [0] * len(workload.prompts)
    steps = 0
    t0 = time.perf_counter()
    while pending or llm.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and arrivals[pending[0]] <= now:
            i = pending.popleft()
            llm.add_request(workload.prompts[i], sampling_params(args, workload.output_lens[i]),
                            request_id=f"r{i}")
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending[0]] - (time.perf_counter() - t0)))
            continue
        deltas = profiler.step(llm) if profiler else llm.step()
        steps += 1
        t = time.perf_counter() - t0
        for rid, toks, finished in map(delta_fields, deltas):
            i = int(rid[1:])
            if toks and i not in first:
                first[i] = t
            counts[i] += len(toks)
            if finished:
                last[i] = t
    elapsed = time.perf_counter() - t0
    ttft = [first[i] - arrivals[i] for i in first]
    tpot = [(last[i] - first[i]) / (counts[i] - 1) for i in last if counts[i] > 1]
    e2e = [last[i] - arrivals[i] for i in last]
    return {"elapsed_s": elapsed, "num_steps": steps, "output_tokens": sum(counts),
            "per_request_tokens": counts, "request_rate": args.online,
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "e2e_s": percentiles(e2e)}


def build_llm(spec: ModelSpec, workload: Workload, args: argparse.Namespace, dtype: str,
              on_cpu: bool) -> Any:
    from minivllm_jax import LLM

    block = 16
    max_model_len = args.max_model_len or -(-workload.max_total_len // block) * block
    kw: dict[str, Any] = dict(max_model_len=max_model_len, dtype=dtype, seed=args.seed,
                              attention_backend=args.attention_backend,
                              layer_layout=None if args.layers == "auto" else args.layers,
                              tensor_parallel_size=args.tensor_parallel_size,
                              data_parallel_size=args.data_parallel_size,
                              tune_cpu_malloc=args.cpu_malloc == "tuned",
                              async_scheduling={"auto": None, "on": True,
                                                "off": False}[args.async_scheduling])
    if args.max_num_seqs is not None:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_kv_blocks is not None:
        kw["num_kv_blocks"] = args.num_kv_blocks
    elif on_cpu:  # the whole workload fits at once: no preemption on the CPU runs
        kw["num_kv_blocks"] = 1 + sum(-(-(len(p) + o) // block)
                                      for p, o in zip(workload.prompts, workload.output_lens))
    return LLM(model=spec.engine_model, **kw)


def first_runner(llm: Any) -> Any:
    """The engine's ModelRunner (replica 0's under data parallelism)."""
    return getattr(llm.engine, "replicas", [llm.engine])[0].runner


def redraw_tokens(workload: Workload, seed: int) -> Workload:
    """The same prompt and output lengths with other token ids (drawn below the largest id used)."""
    vocab = max(max(p) for p in workload.prompts) + 1
    rng = np.random.default_rng(seed)
    return Workload([rng.integers(0, vocab, size=len(p)).tolist() for p in workload.prompts],
                    list(workload.output_lens))


def warm_up(llm: Any, workload: Workload, args: argparse.Namespace) -> None:
    if args.warmup == "none":
        return
    if args.warmup == "all":
        llm.precompile()
    warm = redraw_tokens(workload, args.seed + 12345)  # other ids: no prefix-cache hits
    if args.warmup == "short":
        n = min(4, len(workload.prompts))
        warm = Workload(warm.prompts[:n], [min(8, o) for o in workload.output_lens[:n]])
    run_offline(llm, warm, args, None)
    if args.online is not None and args.warmup in ("full", "all"):
        # Arrival timing varies run to run, so the timed run may still meet new (token, sample)
        # bucket pairs; their compilations are counted and reported.
        run_online(llm, warm, args, None)


# ------------------------------------------------------------------------------------------
# transformers baseline
# ------------------------------------------------------------------------------------------


@dataclass
class HFBaseline:
    """transformers' `generate` on one model, loaded and warmed once (`load_hf`), timed pass by
    pass: batches of `batch_size` prompts in workload order, each batch left-padded and
    generating exactly its largest output length (see the module docstring)."""

    generate: Callable[[Sequence[list[int]], int], int]  # (prompts, new tokens) -> tokens made
    batch_size: int
    device: str
    torch_threads: int

    def timed_pass(self, workload: Workload) -> tuple[float, int]:
        """(seconds, generated tokens, the extra ones of rows shorter than their batch's
        longest included) for one pass over the workload."""
        t0 = time.perf_counter()
        generated = 0
        for start in range(0, len(workload.prompts), self.batch_size):
            prompts = workload.prompts[start:start + self.batch_size]
            lens = workload.output_lens[start:start + self.batch_size]
            n = self.generate(prompts, max(lens))
            if n != max(lens):
                raise RuntimeError(f"transformers generated {n} tokens, expected {max(lens)}")
            generated += n * len(prompts)
        return time.perf_counter() - t0, generated


def load_hf(spec: ModelSpec, workload: Workload, args: argparse.Namespace, dtype: str,
            batch_size: int) -> HFBaseline:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {"gguf_file": spec.hf_gguf_file} if spec.hf_gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(spec.hf_dir, dtype=getattr(torch, dtype), **kw)
    model = model.to(device).eval()
    pad_id = 0  # masked out by the attention mask; any id works

    def generate(prompts: Sequence[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        sample = args.temperature > 0
        extra = dict(temperature=args.temperature, top_p=1.0, top_k=0) if sample else {}
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=sample, pad_token_id=pad_id, **extra)
        if device == "cuda":
            torch.cuda.synchronize()
        return int(out.shape[1] - width)

    generate(workload.prompts[:2], 4)  # warm-up
    return HFBaseline(generate, batch_size, device, torch.get_num_threads())


# ------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------


def throughput(res: dict[str, Any], workload: Workload) -> None:
    res["output_tok_s"] = res["output_tokens"] / res["elapsed_s"]
    res["total_tok_s"] = (res["output_tokens"] + workload.num_prompt_tokens) / res["elapsed_s"]


def roofline(records: Sequence[StepRecord], res: dict[str, Any], device_kind: str,
             hbm_gbps: float | None, devices: int = 1) -> dict[str, Any] | None:
    """Lower bound on time: every step reads all weights and the KV of its sequences once, over
    ``devices`` devices' bandwidth together (optimistic where tensor parallelism replicates)."""
    gbps = hbm_gbps or peak_bandwidth_gbps(device_kind)
    if gbps is None or not records:
        return None
    bw = gbps * 1e9 * devices
    bound = sum(r.bytes_read for r in records) / bw
    dec = [r for r in records if r.is_decode]
    out = {"hbm_gbps": gbps, "bound_s": bound, "measured_s": res["elapsed_s"],
           "gap": res["elapsed_s"] / bound if bound else float("nan"),
           "bound_output_tok_s": res["output_tokens"] / bound if bound else float("nan")}
    if dec:
        dec_bound = float(np.mean([r.bytes_read for r in dec])) / bw
        dec_meas = float(np.mean([r.total for r in dec]))
        out.update(decode_steps=len(dec), decode_bytes_per_step=float(np.mean([r.bytes_read for r in dec])),
                   decode_bound_ms=1e3 * dec_bound, decode_measured_ms=1e3 * dec_meas,
                   decode_gap=dec_meas / dec_bound)
    return out


def fastest_of(times: Sequence[float]) -> str:
    """The suffix naming every timed run behind a fastest-of figure ("" for a single run)."""
    if len(times) < 2:
        return ""
    return f" (fastest of {len(times)}: {', '.join(f'{t:.2f}' for t in times)}s)"


def print_split(split: dict[str, Any], missing: Sequence[str], phases: bool = True) -> None:
    print("per-step time split (mean ms; device = waiting for the step's results, host = the rest):")
    for label in ("all", "prefill", "decode"):
        s = split[label]
        if not s["num_steps"]:
            continue
        if not phases:
            print(f"  {label:7s} steps={s['num_steps']:4d} total={s['total']:8.2f}")
            continue
        print(f"  {label:7s} steps={s['num_steps']:4d} total={s['total']:8.2f} host={s['host']:7.2f} "
              f"device={s['device']:8.2f} | schedule={s['schedule']:.2f} prepare={s['prepare']:.2f} "
              f"execute_host={s['execute_host']:.2f} update={s['update']:.2f} "
              f"output={s['output']:.2f} other={s['host_other']:.2f}")
    if missing:
        print(f"  not measured (not found in the engine): {', '.join(missing)}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import jax

    on_cpu = jax.default_backend() == "cpu"
    dev = jax.devices()[0]
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    spec = resolve_model(args.model, dtype, seed=args.seed)
    workload = make_workload(args.num_seqs, args.input_len, args.output_len, spec.vocab_size, args.seed)
    print(f"model={spec.label} dtype={dtype} device={dev.device_kind} ({jax.default_backend()}) "
          f"num_seqs={args.num_seqs} prompt_tokens={workload.num_prompt_tokens} "
          f"output_tokens={workload.num_output_tokens} temperature={args.temperature}"
          + (f" tensor_parallel_size={args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else "")
          + (f" data_parallel_size={args.data_parallel_size}" if args.data_parallel_size > 1 else ""))

    t = time.perf_counter()
    llm = build_llm(spec, workload, args, dtype, on_cpu)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    warm_up(llm, workload, args)
    warm_s = time.perf_counter() - t
    print(f"engine load {load_s:.1f}s, warm-up ({args.warmup}) {warm_s:.1f}s")

    hf_model: HFBaseline | None = None
    if args.compare_hf:
        import torch

        if not on_cpu and not torch.cuda.is_available():
            print("transformers: skipped — torch has no CUDA here while the engine runs on "
                  f"{jax.default_backend()}; a GPU-vs-CPU ratio would mean nothing")
        else:
            hf_model = load_hf(spec, workload, args, dtype,
                               args.hf_batch_size or args.max_num_seqs or 32)

    # The rounds interleave: the engine's run r, then transformers' pass r over the same token
    # ids, so a slow window of the machine meets both sides of a round alike.
    nbytes = DTYPE_BYTES[dtype]
    runs, hf_passes = [], []
    for r in range(args.repeat):
        timed = workload if r == 0 else redraw_tokens(workload, args.seed + 777 + r)
        kv_nbytes = first_runner(llm).kv_cache.dtype.itemsize  # float32 on CPU, see kv_cache_dtype
        prof = StepProfiler(weight_bytes_per_step(spec, nbytes), kv_bytes_per_token(spec, kv_nbytes))
        with CompileWatch().install() as watch, prof.install(llm):
            run = run_online if args.online is not None else run_offline
            out = run(llm, timed, args, prof)
        if out["output_tokens"] != workload.num_output_tokens:
            raise RuntimeError(f"engine produced {out['output_tokens']} tokens, the workload asks "
                               f"for {workload.num_output_tokens}")
        runs.append((out, prof, watch))
        if hf_model is not None:
            hf_passes.append(hf_model.timed_pass(timed))
    res, profiler, compiles = min(runs, key=lambda run: run[0]["elapsed_s"])
    res["elapsed_all_s"] = [run[0]["elapsed_s"] for run in runs]
    throughput(res, workload)
    res["compile_count"], res["compile_s"] = compiles.count, compiles.seconds
    print(f"engine: {res['output_tokens']} output tokens in {res['elapsed_s']:.2f}s over "
          f"{res['num_steps']} steps -> output {res['output_tok_s']:.1f} tok/s, total "
          f"{res['total_tok_s']:.1f} tok/s"
          + fastest_of(res["elapsed_all_s"]))
    if compiles.count:
        print(f"  note: {compiles.count} XLA compilations ({compiles.seconds:.1f}s) inside the timed run")
    if args.online is not None:
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            q = res[key]
            print(f"  {key[:-2].upper():5s} p50={1e3 * q['p50']:.1f}ms p90={1e3 * q['p90']:.1f}ms "
                  f"p99={1e3 * q['p99']:.1f}ms")
    split = split_summary(profiler.records)
    print_split(split, profiler.missing, phases=args.data_parallel_size == 1)
    roof = roofline(profiler.records, res, dev.device_kind, args.hbm_gbps, args.tensor_parallel_size)
    if roof is not None:
        print(f"roofline ({roof['hbm_gbps']:.0f} GB/s x {args.tensor_parallel_size} device(s)): "
              f"bound {roof['bound_s']:.3f}s "
              f"({roof['bound_output_tok_s']:.0f} output tok/s) vs measured {roof['measured_s']:.3f}s "
              f"-> {roof['gap']:.2f}x the bound")
        if "decode_gap" in roof:
            print(f"  decode step: {roof['decode_bytes_per_step'] / 1e6:.1f} MB read, bound "
                  f"{roof['decode_bound_ms']:.3f} ms vs measured {roof['decode_measured_ms']:.3f} ms "
                  f"-> {roof['decode_gap']:.2f}x")
    elif not on_cpu:
        print(f"roofline: no peak bandwidth known for {dev.device_kind!r}; pass --hbm-gbps")

    hf = None
    if hf_model is not None:
        times = [t for t, _ in hf_passes]
        hf = {"elapsed_s": min(times), "elapsed_all_s": times,
              "output_tokens": workload.num_output_tokens, "generated_tokens": hf_passes[0][1],
              "batch_size": hf_model.batch_size, "device": hf_model.device,
              "torch_threads": hf_model.torch_threads}
        throughput(hf, workload)
        # both sides make the workload's output tokens in every round: a round's throughput
        # ratio is its transformers time over its engine time
        hf["round_ratios"] = [t / e for t, e in zip(times, res["elapsed_all_s"])]
        print(f"transformers ({hf['device']}, batch {hf['batch_size']}): {hf['output_tokens']} "
              f"useful output tokens ({hf['generated_tokens']} generated) in {hf['elapsed_s']:.2f}s "
              f"-> output {hf['output_tok_s']:.1f} tok/s, total {hf['total_tok_s']:.1f} tok/s"
              + fastest_of(times))
        mode = f" (engine online at {args.online} req/s, transformers offline)" if args.online else ""
        print(f"engine / transformers output throughput: "
              f"{res['output_tok_s'] / hf['output_tok_s']:.2f}x{mode}"
              + (f" (fastest of each; round by round, interleaved: "
                 f"{', '.join(f'{x:.2f}x' for x in hf['round_ratios'])}; median "
                 f"{float(np.median(hf['round_ratios'])):.2f}x)" if args.repeat > 1 else ""))
    record = {
        "mode": "online" if args.online is not None else "offline",
        "model": spec.label, "dtype": dtype, "device_kind": dev.device_kind,
        "backend": jax.default_backend(), "num_seqs": args.num_seqs, "input_len": args.input_len,
        "output_len": args.output_len, "temperature": args.temperature, "warmup": args.warmup,
        "repeat": args.repeat, "tensor_parallel_size": args.tensor_parallel_size,
        "cpu_malloc": args.cpu_malloc,
        "data_parallel_size": args.data_parallel_size,
        "kv_cache_devices": len(first_runner(llm).kv_cache.sharding.device_set),
        "prompt_tokens": workload.num_prompt_tokens, "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0], "engine": res, "split": split,
        "missing_phases": profiler.missing, "roofline": roof, "hf": hf,
        "ratio": res["output_tok_s"] / hf["output_tok_s"] if hf else None,
        "steps": [{"total": r.total, "host": r.host, "device": r.phases.get("device", 0.0),
                   "num_tokens": r.num_tokens, "num_reqs": r.num_reqs} for r in profiler.records],
    }
    if args.json:
        dump_json(args.json, record)
    return record


if __name__ == "__main__":
    sys.exit(run_cli(main))

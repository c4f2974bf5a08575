"""Throughput benchmark of the engine, optionally against Hugging Face transformers.

Workload (nano-vllm's, bench_common.make_workload): --num-seqs requests, random prompt ids, lengths
uniform in --input-len / --output-len [LO, HI], ignore_eos. Offline: all added at once, then step
until done; --online RATE: Poisson arrivals (req/s), TTFT/TPOT/E2E reported. Untimed --warmup:
"full" runs the same lengths with other ids (no prefix-cache hits), so the timed run meets
compiled buckets only ("all": LLM.precompile() first; "short": a few tokens). --repeat K: K rounds,
each the engine's run, then --compare-hf's pass (transformers' `generate`, same weights and dtype,
--hf-batch-size rows left-padded, only requested tokens counted) on the same ids, redrawn after
round 1; the fastest of each side and each round's ratio are reported. Per step() call: device =
waiting for its results (the engine's `last_step.collect`), host = the rest; with async scheduling
a call dispatches step N+1, then collects step N. Roofline (GPU, or --hbm-gbps): a step reads all
weights plus its sequences' KV, so it takes at least those bytes / peak memory bandwidth. Unless
given, --max-model-len fits the longest request, and on CPU --num-kv-blocks the whole workload.
--json-schema builtin|PATH: each round's engine run is followed by the same ids with that JSON
schema on every request (structured outputs; the prefix cache reset between): the two output
throughputs per round, their ratio and the token-bitmask fill's share of the step time.

  python scripts/bench.py --num-seqs 32 --input-len 32 192 --output-len 48 48 --dtype float32 --compare-hf
  python scripts/bench.py --num-seqs 32 --dtype float32 --json-schema builtin --repeat 3
  python scripts/bench.py --model qwen3-0.6b --dtype bfloat16 --num-seqs 256 \\
      --input-len 100 1024 --output-len 100 1024 --compare-hf
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

import bench_common as bc
from minivllm_jax import SamplingParams, StructuredOutputsParams
from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs, run_cli
from minivllm_jax.worker.compile_watch import CompileWatch
from minivllm_jax.config import EngineConfig

PHASES = ("total", "host", "device", "schedule", "dispatch", "mask", "update", "process")
PENALTIES = ("repetition", "presence", "frequency")
Steps = list[dict[str, float]]
# --json-schema builtin: an object holding an array of at least 1000 records, so no output shorter
# than ~10k tokens completes it and every step's mask is the grammar's work (a completed grammar
# allows only EOS, which ignore_eos then repeats to the request's end)
RECORDS_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["records"],
    "properties": {"records": {"type": "array", "minItems": 1000, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags"],
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                       "score": {"type": "number"},
                       "tags": {"type": "array", "items": {"type": "string"}}}}}}}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked (the engine's and SamplingParams' own checks included) before any
    model is loaded: a ValueError names the first bad one."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(
        p, model_help="default: the embedded SmolLM2-135M GGUF; a checkpoint directory; a .gguf "
                      f"file; or a random-weight shape: {', '.join(bc.MODEL_SHAPES)}",
        dtype_help="weights (and KV cache, float32 on CPU); auto: float32 on CPU, else bfloat16")
    bc.add_workload_options(p, num_seqs=32, repeat_help="timed rounds (see above)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="every request asks for its tokens' logprobs and the K most likely")
    for name in PENALTIES:
        p.add_argument(f"--{name}-penalty", type=float, default=None,
                       help=f"every request's {name}_penalty (default: off)")
    p.add_argument("--cpu-malloc", default="default", choices=("default", "tuned"), help="tuned: glibc "
                   "settings that let XLA:CPU reuse each step's memory, process-wide (host_malloc.py)")
    p.add_argument("--warmup", default="full", choices=("full", "short", "all", "none"))
    p.add_argument("--online", type=float, default=None, metavar="RATE",
                   help="Poisson arrivals at RATE requests/s (inf: all at once)")
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--json-schema", default=None, metavar="builtin|PATH",
                   help="each round also runs the same ids with this JSON schema on every request "
                        "(builtin: an array of at least 1000 records) and compares")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="rows per transformers generate call (default: --max-num-seqs or 32)")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="one device's peak memory bandwidth (default: table by device kind)")
    args = p.parse_args(argv)
    bc.check_workload_args(args, ("num_seqs", "repeat", "hf_batch_size"))
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    if args.online is not None and not args.online > 0:
        raise ValueError("--online RATE must be a positive number of requests per second (inf: "
                         "all at once)")
    EngineConfig(**engine_kwargs(args))  # the engine's own checks
    args.structured = json_schema_params(args.json_schema)
    sampling_params(args, 1, constrained=True)  # and SamplingParams' own
    return args


def json_schema_params(source: str | None) -> StructuredOutputsParams | None:
    """--json-schema's constraint (None without it); ValueError naming the option when the file
    cannot be read or holds no JSON object. Whether it compiles is checked when a request is added."""
    if source is None:
        return None
    try:
        schema = RECORDS_SCHEMA if source == "builtin" else Path(source).read_text()
        return StructuredOutputsParams(json=schema)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--json-schema {source}: {e}") from None


def sampling_params(args: argparse.Namespace, max_tokens: int, constrained: bool = False) -> Any:
    """The options' SamplingParams, ignoring EOS: exactly `max_tokens` tokens (fewer only if a
    `constrained` request's grammar refuses a token); `constrained`: with --json-schema's."""
    extra = {f"{n}_penalty": v for n in PENALTIES if (v := getattr(args, f"{n}_penalty")) is not None}
    return SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=args.logprobs, **extra,
                          structured_outputs=args.structured if constrained else None)


def timed_step(llm: Any, steps: Steps | None) -> list[Any]:
    """`llm.step()`, and (given `steps`) its wall time and the engine's record of it."""
    t0 = time.perf_counter()
    deltas = llm.step()
    if steps is not None:
        total, rec = time.perf_counter() - t0, dict(vars(llm.engine.last_step))
        steps.append({"total": total, "host": total - rec["collect"], "device": rec.pop("collect"), **rec})
    return deltas


def run_offline(llm: Any, workload: bc.Workload, args: argparse.Namespace,
                steps: Steps | None, constrained: bool = False) -> dict[str, Any]:
    """All requests added at t=0, then step until done."""
    counts, eos, eos_ids = [0] * len(workload.prompts), 0, set(llm.engine.model_config.eos_token_ids)
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        llm.add_request(prompt, sampling_params(args, out_len, constrained), request_id=str(i))
    num_steps = 0
    while llm.has_unfinished_requests():
        for delta in timed_step(llm, steps):
            counts[int(delta.request_id)] += len(delta.new_token_ids)
            eos += sum(t in eos_ids for t in delta.new_token_ids)
        num_steps += 1
    return {"elapsed_s": time.perf_counter() - t0, "num_steps": num_steps,
            "output_tokens": sum(counts), "per_request_tokens": counts, "eos_tokens": eos}


def run_online(llm: Any, workload: bc.Workload, args: argparse.Namespace,
               steps: Steps | None, constrained: bool = False) -> dict[str, Any]:
    """Requests join at Poisson arrival times; one loop adds the arrived ones, then steps."""
    n, eos, eos_ids = len(workload.prompts), 0, set(llm.engine.model_config.eos_token_ids)
    arrivals = bc.poisson_arrivals(n, args.online, args.seed)
    pending, first, last, counts = deque(range(n)), [math.nan] * n, [math.nan] * n, [0] * n
    num_steps, t0 = 0, time.perf_counter()
    while pending or llm.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= time.perf_counter() - t0:
            i = pending.popleft()
            params = sampling_params(args, workload.output_lens[i], constrained)
            llm.add_request(workload.prompts[i], params, request_id=str(i))
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending[0]] - (time.perf_counter() - t0)))
            continue
        deltas = timed_step(llm, steps)
        num_steps += 1
        t = time.perf_counter() - t0
        for delta in deltas:
            i = int(delta.request_id)
            if delta.new_token_ids and math.isnan(first[i]):
                first[i] = t
            counts[i] += len(delta.new_token_ids)
            eos += sum(t in eos_ids for t in delta.new_token_ids)
            if delta.finished:
                last[i] = t
    return {"elapsed_s": time.perf_counter() - t0, "num_steps": num_steps,
            "output_tokens": sum(counts), "per_request_tokens": counts, "eos_tokens": eos,
            "request_rate": args.online, **bc.latencies(arrivals, first, last, last, counts)}


def build_llm(spec: bc.ModelSpec, workload: bc.Workload, args: argparse.Namespace, dtype: str,
              on_cpu: bool) -> Any:
    """The engine of --model, sized by `bc.sized_engine_kwargs`, seeded with --seed."""
    from minivllm_jax import LLM

    return LLM(spec.engine_model, **bc.sized_engine_kwargs(args, workload, dtype, on_cpu), seed=args.seed)


def warm_up(llm: Any, workload: bc.Workload, args: argparse.Namespace) -> None:
    """--warmup's untimed runs: the workload's lengths with other ids (no prefix-cache hits)."""
    if args.warmup == "none":
        return
    if args.warmup == "all":
        llm.precompile()
    warm = bc.redraw_tokens(workload, args.seed + 12345)
    if args.warmup == "short":
        n = min(4, len(workload.prompts))
        warm = bc.Workload(warm.prompts[:n], [min(8, o) for o in workload.output_lens[:n]])
    for constrained in (False, True) if args.structured is not None else (False,):
        engine_run(llm, warm, args, None, constrained, online=False)
        if args.online is not None and args.warmup != "short":  # arrival timing still varies
            engine_run(llm, warm, args, None, constrained, online=True)


@dataclass
class HFBaseline:
    """transformers' `generate` on one model, loaded and warmed once (`load_hf`)."""

    generate: Callable[[Sequence[list[int]], int], int]  # (prompts, new tokens) -> tokens made
    batch_size: int
    device: str
    torch_threads: int

    def timed_pass(self, workload: bc.Workload) -> tuple[float, int]:
        """(seconds, generated tokens: rows' tokens past their own length included) of a pass."""
        t0, generated = time.perf_counter(), 0
        for start in range(0, len(workload.prompts), self.batch_size):
            prompts = workload.prompts[start:start + self.batch_size]
            want = max(workload.output_lens[start:start + self.batch_size])
            if (n := self.generate(prompts, want)) != want:
                raise RuntimeError(f"transformers generated {n} tokens, expected {want}")
            generated += n * len(prompts)
        return time.perf_counter() - t0, generated


def load_hf(spec: bc.ModelSpec, workload: bc.Workload, args: argparse.Namespace, dtype: str,
            on_cpu: bool) -> HFBaseline | None:
    """transformers' side of --compare-hf, warmed up; None without the flag, or (said) when torch
    has no CUDA while the engine runs on an accelerator."""
    if not args.compare_hf:
        return None
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    if not on_cpu and not torch.cuda.is_available():
        print("transformers: skipped — torch has no CUDA here while the engine runs on "
              f"{jax.default_backend()}; a GPU-vs-CPU ratio would mean nothing")
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {"gguf_file": spec.hf_gguf_file} if spec.hf_gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(spec.hf_dir, dtype=getattr(torch, dtype), **kw)
    model = model.to(device).eval()
    sample = args.temperature > 0
    extra = dict(temperature=args.temperature, top_p=1.0, top_k=0) if sample else {}

    def generate(prompts: Sequence[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)  # pad id 0, masked out
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=sample, pad_token_id=0, **extra)
        if device == "cuda":
            torch.cuda.synchronize()
        return int(out.shape[1] - width)

    generate(workload.prompts[:2], 4)  # warm-up
    batch_size = args.hf_batch_size or args.max_num_seqs or 32
    return HFBaseline(generate, batch_size, device, torch.get_num_threads())


def engine_run(llm: Any, workload: bc.Workload, args: argparse.Namespace, steps: Steps | None,
               constrained: bool, online: bool) -> dict[str, Any]:
    """run_online or run_offline; a constrained run forgets the prefix cache first, as it follows
    the unconstrained run on the same ids."""
    if constrained:
        llm.engine.scheduler.reset_prefix_cache()
    return (run_online if online else run_offline)(llm, workload, args, steps, constrained)


def is_decode(step: dict[str, float]) -> bool:
    """A pure-decode step: one token for each scheduled request."""
    return step["num_reqs"] > 0 and step["num_tokens"] == step["num_reqs"]


def split_summary(steps: Steps) -> dict[str, Any]:
    """Mean ms of each phase over all step() calls, prefill ones and pure-decode ones."""
    groups = {"all": list(steps), "prefill": [s for s in steps if s["num_tokens"] and not is_decode(s)],
              "decode": [s for s in steps if is_decode(s)]}
    return {label: {"num_steps": len(g), **{k: 1e3 * float(np.mean([s[k] for s in g])) if g
                                            else float("nan") for k in PHASES}}
            for label, g in groups.items()}


def roofline(steps: Steps, res: dict[str, Any], gbps: float | None,
             weight_bytes: int, kv_token_bytes: int, devices: int) -> dict[str, Any] | None:
    """Lower bound on time: each model step reads all weights and its sequences' KV once, over
    `devices` devices' bandwidth together (optimistic where tensor parallelism replicates)."""
    ran = [s for s in steps if s["num_tokens"]]
    if gbps is None or not ran:
        return None
    bw = gbps * 1e9 * devices
    bound = sum(weight_bytes + s["kv_tokens"] * kv_token_bytes for s in ran) / bw
    out = {"hbm_gbps": gbps, "bound_s": bound, "measured_s": res["elapsed_s"],
           "gap": res["elapsed_s"] / bound, "bound_output_tok_s": res["output_tokens"] / bound}
    if dec := [s for s in ran if is_decode(s)]:
        read = weight_bytes + float(np.mean([s["kv_tokens"] for s in dec])) * kv_token_bytes
        measured = float(np.mean([s["total"] for s in dec]))
        out.update(decode_steps=len(dec), decode_bytes_per_step=read, decode_bound_ms=1e3 * read / bw,
                   decode_measured_ms=1e3 * measured, decode_gap=measured * bw / read)
    return out


def fastest_of(times: Sequence[float]) -> str:
    """" (fastest of K: t1, ..., tKs)" for K > 1 rounds, else ""."""
    return f" (fastest of {len(times)}: {', '.join(f'{t:.2f}' for t in times)}s)" if len(times) > 1 else ""


def split_lines(split: dict[str, Any]) -> list[str]:
    """A line per group of step() calls that has any: mean ms of each phase (mask where any)."""
    lines = []
    for label, s in split.items():
        if s["num_steps"]:
            other = s["host"] - sum(s[k] for k in ("schedule", "dispatch", "mask", "update", "process"))
            mask = f" mask={s['mask']:.2f}" if s["mask"] else ""
            lines.append(f"  {label:7s} steps={s['num_steps']:4d} total={s['total']:8.2f} "
                         f"host={s['host']:7.2f} device={s['device']:8.2f} | schedule={s['schedule']:.2f} "
                         f"dispatch={s['dispatch']:.2f}{mask} update={s['update']:.2f} "
                         f"process={s['process']:.2f} other={other:.2f}")
    return lines


def rounds_note(values: Sequence[float], fmt: str, lead: str = "fastest of each") -> str:
    """" (LEAD; round by round, interleaved: a, b, c; median m)" for more than one round."""
    if len(values) <= 1:
        return ""
    return (f" ({lead}; round by round, interleaved: {', '.join(fmt.format(v) for v in values)}; "
            f"median {fmt.format(float(np.median(values)))})")


def report_structured(st: dict[str, Any], res: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the constrained runs of --json-schema against the unconstrained ones."""
    short = st["ended_early"]
    print(f"engine, --json-schema {args.json_schema} on every request: {st['output_tokens']} output "
          f"tokens ({st['eos_tokens']} EOS after a completed grammar"
          + (f"; {short} request(s) ended early by their grammar" if short else "")
          + f") in {st['elapsed_s']:.2f}s over {st['num_steps']} steps -> output "
          f"{st['output_tok_s']:.1f} tok/s" + fastest_of(st["elapsed_all_s"]))
    if st["compile_count"]:
        print(f"  note: {st['compile_count']} XLA compilations ({st['compile_s']:.1f}s) inside the "
              "timed run")
    print(*bc.latency_lines(st), "per-step time split (mean ms; mask = filling the token bitmask "
          "on the host):", *split_lines(st["split"]), sep="\n")
    print(f"constrained / unconstrained output throughput: {st['output_tok_s'] / res['output_tok_s']:.2f}x"
          + rounds_note(st["round_ratios"], "{:.2f}x"))
    print(f"mask fill: {100 * st['mask_s'] / st['step_s']:.1f} % of the step time, "
          f"{1e3 * st['mask_s'] / st['num_steps']:.2f} ms a step"
          + (rounds_note([100 * m for m in st["mask_share_all"]], "{:.1f} %", "fastest run")
             or " (fastest run)"))


def report(res: dict[str, Any], split: dict[str, Any], roof: dict[str, Any] | None,
           hf: dict[str, Any] | None, args: argparse.Namespace) -> None:
    """Print the engine's throughput, latencies (online), per-step split, roofline and the
    transformers comparison."""
    print(f"engine: {res['output_tokens']} output tokens in {res['elapsed_s']:.2f}s over "
          f"{res['num_steps']} steps -> output {res['output_tok_s']:.1f} tok/s, total "
          f"{res['total_tok_s']:.1f} tok/s" + fastest_of(res["elapsed_all_s"]))
    if res["compile_count"]:
        print(f"  note: {res['compile_count']} XLA compilations ({res['compile_s']:.1f}s) inside the "
              "timed run")
    print(*bc.latency_lines(res), "per-step time split (mean ms; device = waiting for the step's "
          "results, host = the rest):", *split_lines(split), sep="\n")
    if roof is not None:
        print(f"roofline ({roof['hbm_gbps']:.0f} GB/s x {args.tensor_parallel_size} device(s)): "
              f"bound {roof['bound_s']:.3f}s ({roof['bound_output_tok_s']:.0f} output tok/s) vs "
              f"measured {roof['measured_s']:.3f}s -> {roof['gap']:.2f}x the bound")
        if "decode_gap" in roof:
            print(f"  decode step: {roof['decode_bytes_per_step'] / 1e6:.1f} MB read, bound "
                  f"{roof['decode_bound_ms']:.3f} ms vs measured {roof['decode_measured_ms']:.3f} ms "
                  f"-> {roof['decode_gap']:.2f}x")
    if hf is not None:
        print(f"transformers ({hf['device']}, batch {hf['batch_size']}): {hf['output_tokens']} useful "
              f"output tokens ({hf['generated_tokens']} generated) in {hf['elapsed_s']:.2f}s -> "
              f"output {hf['output_tok_s']:.1f} tok/s, total {hf['total_tok_s']:.1f} tok/s"
              + fastest_of(hf["elapsed_all_s"]))
        mode = f" (engine online at {args.online} req/s, transformers offline)" if args.online else ""
        print(f"engine / transformers output throughput: {res['output_tok_s'] / hf['output_tok_s']:.2f}x"
              f"{mode}" + rounds_note(hf["round_ratios"], "{:.2f}x"))


Run = tuple[dict[str, Any], Steps, CompileWatch]  # a timed run's result, step records, compilations


def watched_run(llm: Any, workload: bc.Workload, args: argparse.Namespace, constrained: bool) -> Run:
    """One timed run (offline or --online), with its step records and XLA compilations."""
    steps: Steps = []
    with CompileWatch().install() as watch:
        out = engine_run(llm, workload, args, steps, constrained, online=args.online is not None)
    return out, steps, watch


def structured_summary(runs: Sequence[Run], res: dict[str, Any], workload: bc.Workload
                       ) -> dict[str, Any]:
    """--json-schema's constrained runs, only generated tokens counted: the fastest (its result,
    step split and records) with every round's time, output tok/s, ratio to the round's
    unconstrained run, and bitmask fill's share of the step time."""
    tok_s = [out["output_tokens"] / out["elapsed_s"] for out, _, _ in runs]
    mask_s = [sum(s["mask"] for s in steps) for _, steps, _ in runs]
    step_s = [sum(s["total"] for s in steps) for _, steps, _ in runs]
    best = int(np.argmax(tok_s))
    out, steps, watch = runs[best]
    return bc.add_throughput({
        **out, "elapsed_all_s": [run[0]["elapsed_s"] for run in runs], "output_tok_s_all": tok_s,
        "round_ratios": [t * e / workload.num_output_tokens for t, e in zip(tok_s, res["elapsed_all_s"])],
        "mask_s": mask_s[best], "step_s": step_s[best],
        "mask_share_all": [m / t for m, t in zip(mask_s, step_s)],
        "ended_early": sum(n < o for n, o in zip(out["per_request_tokens"], workload.output_lens)),
        "compile_count": len(watch.names), "compile_s": watch.seconds, "split": split_summary(steps),
        "steps": steps}, workload)


def timed_rounds(llm: Any, workload: bc.Workload, args: argparse.Namespace, hf_model: HFBaseline | None
                 ) -> tuple[dict[str, Any], Steps, dict[str, Any] | None, dict[str, Any] | None]:
    """--repeat rounds, each the engine's run, then (--json-schema) the engine's constrained run
    and transformers' pass on the same ids (redrawn after the first round): (the fastest engine
    run, with every round's time and its XLA compilations; its step records; transformers'
    summary or None; `structured_summary` or None). RuntimeError when the unconstrained engine
    makes other than the workload's tokens."""
    runs, constrained, hf_passes = [], [], []
    for r in range(args.repeat):
        timed = workload if r == 0 else bc.redraw_tokens(workload, args.seed + 777 + r)
        out, steps, watch = watched_run(llm, timed, args, False)
        if out["output_tokens"] != workload.num_output_tokens:
            raise RuntimeError(f"engine produced {out['output_tokens']} tokens, the workload asks "
                               f"for {workload.num_output_tokens}")
        runs.append((out, steps, watch))
        if args.structured is not None:
            constrained.append(watched_run(llm, timed, args, True))
        if hf_model is not None:
            hf_passes.append(hf_model.timed_pass(timed))
    res, steps, watch = min(runs, key=lambda run: run[0]["elapsed_s"])
    res.update(elapsed_all_s=[run[0]["elapsed_s"] for run in runs], compile_count=len(watch.names),
               compile_s=watch.seconds)
    res = bc.add_throughput(res, workload)
    st = structured_summary(constrained, res, workload) if constrained else None
    if hf_model is None:
        return res, steps, None, st
    times = [t for t, _ in hf_passes]  # both sides make the workload's tokens: ratios of times
    hf = {"elapsed_s": min(times), "elapsed_all_s": times, "output_tokens": workload.num_output_tokens,
          "generated_tokens": hf_passes[0][1], "batch_size": hf_model.batch_size,
          "device": hf_model.device, "torch_threads": hf_model.torch_threads,
          "round_ratios": [h / e for h, e in zip(times, res["elapsed_all_s"])]}
    return res, steps, bc.add_throughput(hf, workload), st


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its report; the --json record (appended there if given)."""
    args = parse_args(argv)
    if args.cpu_malloc == "tuned":  # process-wide, so before the engine allocates anything
        from host_malloc import tune_glibc_malloc

        if not tune_glibc_malloc():
            print("note: --cpu-malloc tuned needs glibc on Linux; malloc left alone")
    import jax

    on_cpu, dtype, spec, workload = bc.setup(args)
    dev, t = jax.devices()[0], time.perf_counter()
    llm = build_llm(spec, workload, args, dtype, on_cpu)
    load_s, t, plan = time.perf_counter() - t, time.perf_counter(), llm.engine.plan
    given = "".join(f" {k}={v}" for k in ("logprobs", "json_schema", *(f"{n}_penalty" for n in PENALTIES))
                    if (v := getattr(args, k)) is not None)  # the sampling options given
    print(f"model={spec.label} dtype={dtype} kv_cache={plan.kv_cache_dtype} device={dev.device_kind} "
          f"({jax.default_backend()}) attention={plan.model.attention_backend} "
          f"layers={plan.model.layer_layout} async={plan.async_scheduling} num_seqs={args.num_seqs} "
          f"prompt_tokens={workload.num_prompt_tokens} output_tokens={workload.num_output_tokens} "
          f"temperature={args.temperature} tensor_parallel_size={args.tensor_parallel_size}{given}")
    warm_up(llm, workload, args)
    print(f"engine load {load_s:.1f}s, warm-up ({args.warmup}) {time.perf_counter() - t:.1f}s")
    res, steps, hf, st = timed_rounds(llm, workload, args, load_hf(spec, workload, args, dtype, on_cpu))
    split = split_summary(steps)
    kv_itemsize = jax.numpy.dtype(plan.kv_cache_dtype).itemsize
    roof = roofline(steps, res, args.hbm_gbps or (bc.device_peaks(dev.device_kind) or (None,))[0],
                    spec.read_params * bc.DTYPE_BYTES[dtype], spec.kv_bytes_per_token(kv_itemsize),
                    args.tensor_parallel_size)
    report(res, split, roof, hf, args)
    if st is not None:
        report_structured(st, res, args)
    if roof is None and not on_cpu:
        print(f"roofline: no peak bandwidth known for {dev.device_kind!r}; pass --hbm-gbps")
    record = {
        "mode": "online" if args.online is not None else "offline",
        **bc.workload_record(spec, dtype, workload, args, dev.device_kind),
        "kv_cache_dtype": plan.kv_cache_dtype, "backend": jax.default_backend(),
        "attention_backend": plan.model.attention_backend, "layer_layout": plan.model.layer_layout,
        "async_scheduling": plan.async_scheduling, "temperature": args.temperature,
        "logprobs": args.logprobs, "penalties": [getattr(args, f"{n}_penalty") for n in PENALTIES],
        "warmup": args.warmup, "repeat": args.repeat,
        "tensor_parallel_size": args.tensor_parallel_size, "cpu_malloc": args.cpu_malloc,
        "kv_cache_devices": len(llm.engine.runner.kv_cache.sharding.device_set),
        "load_avg_1m": os.getloadavg()[0], "engine": res, "split": split, "roofline": roof, "hf": hf,
        "ratio": res["output_tok_s"] / hf["output_tok_s"] if hf else None, "steps": steps,
        "json_schema": args.json_schema, "structured": st}
    return bc.dump_json(args.json, record)


if __name__ == "__main__":
    sys.exit(run_cli(main))

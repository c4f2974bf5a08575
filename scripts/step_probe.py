"""Where a steady decode step's time goes: every device program the engine launches and every
host-to-device copy, timed twice, at the engine's own batch.

    python scripts/step_probe.py --model qwen3-0.6b --dtype bfloat16 --num-seqs 128
    python scripts/step_probe.py --model llama-tiny --dtype float32 --num-seqs 8 --input-len 32

--num-seqs requests of --input-len random ids are prefilled, then --steps decode steps run in each
of two passes. "launch": the steps as the engine runs them, recording how long each program call
and each copy takes to return (a call that returns late waits for the device, for memory or for a
transfer; an asynchronous one returns in well under a millisecond). "blocking": the same steps with
a wait for every result, so each program's and copy's own device time shows. Also reported: the KV
cache's size and whether a step updates it in place (its buffer address is unchanged). The step's
split as `bench.py` reports it (schedule, dispatch, collect, ...) is printed for the launch pass.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import numpy as np

import bench_common as bc
from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs, run_cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p, model_help=f"a random-weight shape ({', '.join(bc.MODEL_SHAPES)}) or a "
                                     "checkpoint", dtype_help="weights; auto: float32 on CPU, else bfloat16")
    p.add_argument("--num-seqs", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per pass")
    return p.parse_args(argv)


class Timers:
    """Wall times by label; `blocking`: wait for each result before the clock stops."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self.blocking = False
        self.on = False

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import jax

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.blocking:
                jax.block_until_ready(out)
            if self.on:
                self.times[label].append(time.perf_counter() - t0)
            return out
        return timed

    def report(self, title: str, steps: int) -> None:
        print(f"{title}: per decode step (ms; median of the calls x calls per step)")
        for label, ts in sorted(self.times.items()):
            print(f"  {label:<44} {1e3 * statistics.median(ts):8.3f} x {len(ts) / steps:.0f}")
        self.times.clear()


def main() -> None:
    args = parse_args()
    import jax

    from minivllm_jax import LLM, SamplingParams
    from minivllm_jax import runner as runner_module

    on_cpu = jax.default_backend() == "cpu"
    dtype = args.dtype if args.dtype not in (None, "auto") else ("float32" if on_cpu else "bfloat16")
    spec = bc.resolve_model(args.model, dtype)
    kw = engine_kwargs(args)
    kw.update(dtype=dtype, max_num_seqs=max(args.num_seqs, kw.get("max_num_seqs", 0)))
    kw.setdefault("max_model_len", args.input_len + 4 * args.steps + 64)
    if on_cpu:
        kw.setdefault("num_kv_blocks", args.num_seqs * (kw["max_model_len"] // 16 + 2) + 1)
    llm = LLM(spec.engine_model, **kw)
    engine, runner = llm.engine, llm.engine.runner
    timers = Timers()
    # every device program the runner launches, and its host-to-device copies
    get = runner.programs.get
    runner.programs.get = lambda key, a: timers.wrap(
        f"program {'forward' if key.num_tokens else 'sampler'} {key.num_tokens or key.num_sampled}",
        get(key, a))
    runner_module.sharding.put_replicated = timers.wrap("copy to device", runner_module.sharding.put_replicated)

    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=10 ** 6, ignore_eos=True, temperature=0.0)
    for _ in range(args.num_seqs):
        engine.add_request(rng.integers(100, spec.vocab_size - 100, args.input_len).tolist(), params)
    while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # the decode shapes compile here
        engine.step()
    print(f"model={spec.label} dtype={dtype} device={jax.devices()[0].device_kind} "
          f"running={len(engine.scheduler.running)} async={engine.plan.async_scheduling} "
          f"kv_cache={runner.kv_cache.nbytes / 2**30:.2f} GiB")
    for blocking in (False, True):
        timers.blocking, timers.on = blocking, True
        splits: dict[str, list[float]] = defaultdict(list)
        pointers = set()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
            for k, v in vars(engine.last_step).items():
                if isinstance(v, float):
                    splits[k].append(v)
            if blocking:
                pointers.add(runner.kv_cache.unsafe_buffer_pointer())
        wall = (time.perf_counter() - t0) / args.steps
        timers.on = False
        timers.report(f"{'blocking' if blocking else 'launch'} pass, step {1e3 * wall:.2f} ms", args.steps)
        if not blocking:
            print("  engine split (mean ms): " + " ".join(
                f"{k}={1e3 * statistics.mean(v):.2f}" for k, v in splits.items()))
        else:
            print(f"  KV cache buffer address: {'unchanged (in place)' if len(pointers) == 1 else f'{len(pointers)} different'}")


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""Run minivllm-jax tensor-parallel over several processes (hosts) with jax.distributed.

On each of N hosts (same command, its own --process-id; process 0's address is the coordinator):

    minivllm-jax multihost --coordinator 10.0.0.1:7777 --num-processes 2 \
        --process-id 0 --model /models/Llama-3.1-8B-Instruct --prompt "Hello"

(`python scripts/launch_multihost.py` takes the same options.) Every process builds the same LLM
over a mesh of all devices of all processes (tensor_parallel_size = the global device count).
Process 0 schedules, broadcasts each step's packed metadata, and prints the completions; the
others run the same jitted steps until process 0 stops them. To try it on one machine with CPU
devices:

    minivllm-jax multihost --local-processes 2 --cpu-devices 2 --prompt "Hello"

Bad input exits with status 2 and one `error: ...` line on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Sequence

from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs, run_cli


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (jax.distributed)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="processes in the run (jax.distributed; default: from the environment)")
    p.add_argument("--process-id", type=int, default=None,
                   help="this process's index (default: from the environment)")
    p.add_argument("--local-processes", type=int, default=None,
                   help="spawn this many processes on 127.0.0.1 instead (a one-machine trial)")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="run on the CPU backend with this many virtual devices per process")
    add_engine_options(p, skip=("--tensor-parallel-size",), max_num_seqs=16, max_model_len=1024)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--ignore-eos", action="store_true", help="generate past EOS, to --max-tokens")
    p.add_argument("--json", action="store_true", help="print one JSON line of token ids and texts")
    p.add_argument("--timeout", type=float, default=600.0, help="--local-processes: seconds to wait")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start ``--local-processes`` copies of this command on loopback; return the worst exit code."""
    n = args.local_processes
    if n < 1:
        raise ValueError(f"--local-processes must be >= 1, got {n}")
    flag = "--local-processes"  # dropped with its value, as "--local-processes N" or "...=N"
    rest = [a for i, a in enumerate(argv)
            if not a.startswith(flag) and (i == 0 or argv[i - 1] != flag)]
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "minivllm_jax.cli.multihost", *rest,
                               "--coordinator", coordinator,
                               "--num-processes", str(n), "--process-id", str(i)],
                              stdout=None if i == 0 else subprocess.DEVNULL)
             for i in range(n)]
    deadline = time.monotonic() + args.timeout
    try:  # one failed process would leave the others waiting in a collective: stop them all
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                return 124
            if any(p.returncode for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max((p.returncode for p in procs), key=abs)


def run(args: argparse.Namespace) -> None:
    if args.cpu_devices is not None:  # before jax is imported
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.cpu_devices}")
    import jax

    if args.coordinator is not None:
        if args.num_processes is None or args.process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    from minivllm_jax import LLM, SamplingParams

    llm = LLM(args.model, tensor_parallel_size=jax.device_count(), **engine_kwargs(args))
    runner = llm.engine.runner
    if jax.process_index() != 0:
        runner.follow()  # returns when process 0 calls stop_followers()
        return
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    try:
        outputs = llm.generate(args.prompt or ["What is the capital of France?"], params, use_tqdm=False)
    finally:
        runner.stop_followers()
    if args.json:
        print(json.dumps({"devices": jax.device_count(), "processes": jax.process_count(),
                          "token_ids": [o.outputs[0].token_ids for o in outputs],
                          "texts": [o.outputs[0].text for o in outputs]}))
    else:
        for o in outputs:
            print(f"--- {o.prompt!r}\n{o.outputs[0].text}")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def go() -> int | None:
        args = build_parser(prog).parse_args(argv)
        return spawn_local(args, argv) if args.local_processes is not None else run(args)

    return run_cli(go)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Online serving benchmark over HTTP (the shape of vLLM's `bench serve`), optionally against the
same workload in process.

Workload: bench.py's (bench_common.make_workload: random prompt ids, lengths uniform in
--input-len and --output-len, ignore_eos so each request yields exactly its output length),
sent as streamed /v1/completions requests (token-id prompts, greedy) at Poisson arrival times of
each --request-rate (inf: all at once). Per request: TTFT (first token - arrival), ITL (gaps
between streamed chunks), TPOT ((end - first token) / (tokens - 1)) and end-to-end latency, at
p50 / p90 / p99; output throughput is tokens / (last finish - first arrival). With
--compare-in-process, also each request's HTTP TTFT minus its in-process TTFT (same arrival).

--launch starts scripts/serve.py with the engine options given here, sized as bench.py sizes its
engine (max_model_len fits the longest request; on CPU, KV blocks for the whole workload), and
warms it up with the same lengths and other ids (a burst, then the Poisson pass; --warmup all
precompiles every step shape first, as bench.py's; none skips). --compare-in-process then also
runs bench.py's `--online` loop on an engine built and warmed the same way in this process, after
each HTTP round (--repeat rounds, interleaved), while the server idles.

  python scripts/bench_serve.py --launch --num-seqs 32 --input-len 16 64 --output-len 16 16 \\
      --request-rate 0.5 inf --warmup all --compare-in-process --repeat 3
  python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --request-rate 1 2 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import bench_common as bc
from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs, run_cli

SERVE = Path(__file__).resolve().parent / "serve.py"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p)
    p.add_argument("--base-url", default=None, help="a running server (without /v1)")
    p.add_argument("--launch", action="store_true", help="start scripts/serve.py (and stop it)")
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 192], metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=[48, 48], metavar=("LO", "HI"))
    p.add_argument("--request-rate", type=float, nargs="+", default=[1.0], metavar="RATE",
                   help="Poisson arrival rates (requests/s), one pass each; inf sends all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", default="full", choices=("full", "all", "none"),
                   help="full: the workload's lengths with other ids, a burst then a Poisson "
                        "pass; all: also precompile every step shape first (serve.py "
                        "--precompile, bench.py --warmup all)")
    p.add_argument("--repeat", type=int, default=1, help="rounds per rate")
    p.add_argument("--compare-in-process", action="store_true",
                   help="also run bench.py's --online loop in this process (needs --launch)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, metavar="OUT", help="append the results to this JSON list")
    args = p.parse_args(argv)
    if args.launch == (args.base_url is not None):
        raise ValueError("give exactly one of --launch and --base-url")
    if args.compare_in_process and not args.launch:
        raise ValueError("--compare-in-process needs --launch (both engines sized alike)")
    for name in ("num_seqs", "repeat"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("input_len", "output_len"):
        bc.check_range(f"--{name.replace('_', '-')}", getattr(args, name))
    for rate in args.request_rate:
        if not rate > 0:
            raise ValueError(f"--request-rate must be positive (inf: all at once), got {rate}")
    if args.base_url is not None and urlsplit(args.base_url).hostname is None:
        raise ValueError(f"--base-url must look like http://HOST:PORT, got {args.base_url!r}")
    return args


# ---- the client: one streamed request on a raw asyncio connection (least client CPU) --------------
@dataclass
class Result:
    arrival: float
    ok: bool = False
    error: str = ""
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0


async def _read_chunked(reader: asyncio.StreamReader) -> Any:
    """Yields the body pieces of a chunked HTTP/1.1 response as they arrive."""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def stream_request(host: str, port: int, body: dict[str, Any], headers: dict[str, str],
                         result: Result) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in {
            "Host": f"{host}:{port}", "Content-Type": "application/json",
            "Content-Length": str(len(payload)), "Connection": "close", **headers}.items())
        writer.write(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + payload)
        await writer.drain()
        status = (await reader.readline()).decode()
        hdrs = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if " 200 " not in status:
            result.error = status.strip() + " " + (await reader.read()).decode()[:200]
            return
        buf = b""
        body_iter = (_read_chunked(reader) if hdrs.get("transfer-encoding") == "chunked"
                     else _read_all(reader))
        async for piece in body_iter:
            now = time.perf_counter()
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.decode().removeprefix("data: ")
                if data == "[DONE]":
                    result.end, result.ok = now, result.error == ""
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                elif chunk["choices"]:
                    result.chunk_times.append(now)
                elif chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
        result.error = result.error or "the stream ended without [DONE]"
    finally:
        writer.close()


async def _read_all(reader: asyncio.StreamReader) -> Any:
    while piece := await reader.read(65536):
        yield piece


async def run_pass(host: str, port: int, workload: bc.Workload, rate: float | None, seed: int,
                   headers: dict[str, str]) -> tuple[list[Result], float]:
    """Send every request at its Poisson arrival (all at once when `rate` is None)."""
    n = len(workload.prompts)
    arrivals = bc.poisson_arrivals(n, rate if rate is not None else math.inf, seed)
    t0 = time.perf_counter()
    results = [Result(t0 + a) for a in arrivals]

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, results[i].arrival - time.perf_counter()))
        body = {"prompt": workload.prompts[i], "max_tokens": workload.output_lens[i],
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            await stream_request(host, port, body, headers, results[i])
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            results[i].error = f"{type(e).__name__}: {e}"

    await asyncio.gather(*(one(i) for i in range(n)))
    return results, t0


def summarize(results: list[Result], t0: float, workload: bc.Workload, rate: float) -> dict[str, Any]:
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} requests failed, e.g. {bad[0]}")
    for r, want in zip(results, workload.output_lens):
        if r.tokens != want:
            raise RuntimeError(f"a request made {r.tokens} tokens, the workload asks for {want}")
    elapsed = max(r.end for r in results) - t0
    out = sum(r.tokens for r in results)
    return {"request_rate": rate, "elapsed_s": elapsed, "output_tokens": out,
            "output_tok_s": out / elapsed,
            "total_tok_s": (out + workload.num_prompt_tokens) / elapsed,
            "ttft_s": bc.percentiles([r.chunk_times[0] - r.arrival for r in results]),
            "ttft_per_request_s": [r.chunk_times[0] - r.arrival for r in results],
            "itl_s": bc.percentiles([b - a for r in results
                                     for a, b in zip(r.chunk_times, r.chunk_times[1:])]),
            "tpot_s": bc.percentiles([(r.chunk_times[-1] - r.chunk_times[0]) / (r.tokens - 1)
                                      for r in results if r.tokens > 1]),
            "e2e_s": bc.percentiles([r.end - r.arrival for r in results])}


# ---- the server ---------------------------------------------------------------------------------
class LaunchedServer:
    """scripts/serve.py on a free loopback port, until `stop()`."""

    def __init__(self, serve_args: list[str]) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="bench-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(SERVE), "--port", "0", *serve_args],
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        deadline, self.port = time.monotonic() + 600, 0
        while True:
            text = Path(self.log.name).read_text(errors="replace")
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve.py did not start:\n{text[-2000:]}")
            m = re.search(r"on http://[^:]+:(\d+)/v1", text)
            if m and self._healthy(int(m.group(1))):
                self.port = int(m.group(1))
                return
            time.sleep(0.5)

    @staticmethod
    def _healthy(port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


def serve_args(args: argparse.Namespace, workload: bc.Workload, dtype: str, on_cpu: bool) -> list[str]:
    """serve.py's engine options: the given ones, sized as bench.build_llm sizes its engine."""
    kw = engine_kwargs(args) | {"dtype": dtype}
    block = 16
    kw.setdefault("max_model_len", -(-workload.max_total_len // block) * block)
    if on_cpu:
        kw.setdefault("num_kv_blocks", 1 + sum(-(-(len(p) + o) // block)
                                               for p, o in zip(workload.prompts, workload.output_lens)))
    out = [] if args.model is None else ["--model", args.model]
    for k, v in kw.items():
        if k == "async_scheduling":
            v = "on" if v else "off"
        out += [f"--{k.replace('_', '-')}", str(v)]
    out += ["--precompile"] if args.warmup == "all" else []
    return out + ([] if args.api_key is None else ["--api-key", args.api_key])


def in_process_args(args: argparse.Namespace, rate: float) -> argparse.Namespace:
    """bench.py's arguments for the same workload and engine options, online at `rate`."""
    import bench

    argv = ["--num-seqs", str(args.num_seqs), "--input-len", *map(str, args.input_len),
            "--output-len", *map(str, args.output_len), "--seed", str(args.seed),
            "--online", str(rate), "--warmup", args.warmup]
    for k, v in engine_kwargs(args).items():
        argv += [f"--{k.replace('_', '-')}", ("on" if v else "off") if isinstance(v, bool) else str(v)]
    if args.model is not None:
        argv += ["--model", args.model]
    return bench.parse_args(argv)


def fmt(res: dict[str, Any]) -> str:
    lines = [f"  output {res['output_tok_s']:.1f} tok/s, total {res['total_tok_s']:.1f} tok/s, "
             f"{res['output_tokens']} tokens in {res['elapsed_s']:.2f}s"]
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        if key in res:
            q = res[key]
            lines.append(f"  {key[:-2].upper():5s} p50={1e3 * q['p50']:.1f}ms p90={1e3 * q['p90']:.1f}ms "
                         f"p99={1e3 * q['p99']:.1f}ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import jax

    on_cpu = jax.default_backend() == "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    spec = bc.resolve_model(args.model, dtype, seed=args.seed)
    workload = bc.make_workload(args.num_seqs, args.input_len, args.output_len, spec.vocab_size, args.seed)
    headers = {} if args.api_key is None else {"Authorization": f"Bearer {args.api_key}"}
    server = LaunchedServer(serve_args(args, workload, dtype, on_cpu)) if args.launch else None
    host, port = ("127.0.0.1", server.port) if server else (urlsplit(args.base_url).hostname,
                                                             urlsplit(args.base_url).port or 80)
    record: dict[str, Any] = {"model": spec.label, "dtype": dtype, "num_seqs": args.num_seqs,
                              "input_len": args.input_len, "output_len": args.output_len,
                              "prompt_tokens": workload.num_prompt_tokens, "cpu_count": os.cpu_count(),
                              "device_kind": jax.devices()[0].device_kind, "http": [], "in_process": []}
    llm = None
    try:
        print(f"model={spec.label} dtype={dtype} num_seqs={args.num_seqs} prompt_tokens="
              f"{workload.num_prompt_tokens} output_tokens={workload.num_output_tokens} "
              f"server=http://{host}:{port}")
        if args.warmup != "none":
            import bench

            warm = bench.redraw_tokens(workload, args.seed + 12345)  # bench.py's warm-up ids
            t = time.perf_counter()
            asyncio.run(run_pass(host, port, warm, None, args.seed, headers))
            asyncio.run(run_pass(host, port, warm, args.request_rate[0], args.seed, headers))
            print(f"server warm-up {time.perf_counter() - t:.1f}s")
        if args.compare_in_process:
            import bench

            bargs = in_process_args(args, args.request_rate[0])
            llm = bench.build_llm(spec, workload, bargs, dtype, on_cpu)
            t = time.perf_counter()
            bench.warm_up(llm, workload, bargs)
            print(f"in-process warm-up {time.perf_counter() - t:.1f}s")
        for rate in args.request_rate:
            for r in range(args.repeat):
                results, t0 = asyncio.run(run_pass(host, port, workload, rate, args.seed, headers))
                res = summarize(results, t0, workload, rate)
                record["http"].append(res)
                print(f"HTTP, rate {rate} req/s, round {r + 1}:\n{fmt(res)}")
                if llm is not None:
                    import bench

                    bargs = in_process_args(args, rate)
                    inp = bench.run_online(llm, workload, bargs, None)
                    bench.throughput(inp, workload)
                    inp.pop("per_request_tokens")
                    record["in_process"].append(inp)
                    print(f"in process (bench.py --online), rate {rate} req/s, round {r + 1}:\n{fmt(inp)}")
                    paired = [h - i for h, i in zip(res["ttft_per_request_s"], inp["ttft_per_request_s"])]
                    res["ttft_paired_diff_s"] = bc.percentiles(paired, (10, 50, 90))
                    q = res["ttft_paired_diff_s"]
                    print(f"  HTTP / in process: output throughput {res['output_tok_s'] / inp['output_tok_s']:.3f}x, "
                          f"TTFT p50 {1e3 * (res['ttft_s']['p50'] - inp['ttft_s']['p50']):+.1f}ms, "
                          f"TTFT per request HTTP - in process p10/p50/p90 {1e3 * q['p10']:+.1f}/"
                          f"{1e3 * q['p50']:+.1f}/{1e3 * q['p90']:+.1f}ms")
    finally:
        if server is not None:
            server.stop()
    if args.json:
        bc.dump_json(args.json, record)
    return record


if __name__ == "__main__":
    sys.exit(run_cli(main))

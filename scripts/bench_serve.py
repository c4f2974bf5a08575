#!/usr/bin/env python
"""Online serving benchmark over HTTP (the shape of vLLM's `bench serve`), optionally against the
same workload in process.

bench.py's workload, sent as streamed /v1/completions requests (token-id prompts, greedy) at
Poisson arrivals of each --request-rate (inf: all at once). Per request: TTFT, ITL (gaps between
streamed chunks), TPOT ((end - first token) / (tokens - 1)) and end-to-end latency at p50 / p90 /
p99; output throughput is tokens / (last finish - first arrival). --launch starts scripts/serve.py
with the engine options given, sized as bench.py sizes its engine, and warms it up with the same
lengths and other ids (a burst, then a Poisson pass; --warmup all precompiles first; none skips).
--compare-in-process also runs bench.py's `--online` loop on an engine built and warmed the same
way in this process after each HTTP round (interleaved, the server idle), and reports each
request's HTTP minus in-process TTFT.

  python scripts/bench_serve.py --launch --num-seqs 32 --input-len 16 64 --output-len 16 16 \\
      --request-rate 0.5 inf --warmup all --compare-in-process --repeat 3
  python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --request-rate 1 2 4
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Sequence
from urllib.parse import urlsplit

import bench
import bench_common as bc
from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs, run_cli

SERVE = Path(__file__).resolve().parent / "serve.py"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked: a ValueError names the first bad one."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p)
    p.add_argument("--base-url", default=None, help="a running server (without /v1)")
    p.add_argument("--launch", action="store_true", help="start scripts/serve.py (and stop it)")
    bc.add_workload_options(p, num_seqs=16, repeat_help="rounds per rate")
    p.add_argument("--request-rate", type=float, nargs="+", default=[1.0], metavar="RATE",
                   help="Poisson arrival rates (requests/s), one pass each; inf sends all at once")
    p.add_argument("--warmup", default="full", choices=("full", "all", "none"),
                   help="full: the workload's lengths with other ids, a burst then a Poisson pass; "
                        "all: also precompile every step shape first (serve.py --precompile)")
    p.add_argument("--compare-in-process", action="store_true",
                   help="also run bench.py's --online loop in this process (needs --launch)")
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    if args.launch == (args.base_url is not None):
        raise ValueError("give exactly one of --launch and --base-url")
    if args.compare_in_process and not args.launch:
        raise ValueError("--compare-in-process needs --launch (both engines sized alike)")
    bc.check_workload_args(args)
    if bad := [rate for rate in args.request_rate if not rate > 0]:
        raise ValueError(f"--request-rate must be positive (inf: all at once), got {bad[0]}")
    if args.base_url is not None and urlsplit(args.base_url).hostname is None:
        raise ValueError(f"--base-url must look like http://HOST:PORT, got {args.base_url!r}")
    return args


# ---- the client: one streamed request on a raw asyncio connection (least client CPU) --------------
@dataclass
class Result:
    """One request: its arrival, each streamed chunk's arrival, [DONE]'s (`end`) and the usage's
    completion tokens; `ok` only when [DONE] came and nothing went wrong (else `error`)."""

    arrival: float
    ok: bool = False
    error: str = ""
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0


async def _body(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The response body's pieces as they arrive, chunked transfer encoding decoded."""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            piece = await reader.readexactly(size) if size else b""
            await reader.readline()  # the chunk's CRLF (after the last chunk: the body's end)
        else:
            piece = await reader.read(65536)
        if not piece:
            return
        yield piece


async def stream_request(host: str, port: int, body: dict[str, Any], headers: dict[str, str],
                         result: Result) -> None:
    """POST `body` to /v1/completions and read its event stream into `result`."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in {
            "Host": f"{host}:{port}", "Content-Type": "application/json",
            "Content-Length": str(len(payload)), "Connection": "close", **headers}.items())
        writer.write(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + payload)
        await writer.drain()
        status, hdrs = (await reader.readline()).decode(), {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if " 200 " not in status:
            result.error = status.strip() + " " + (await reader.read()).decode()[:200]
            return
        buf = b""
        async for piece in _body(reader, hdrs.get("transfer-encoding") == "chunked"):
            now = time.perf_counter()
            *events, buf = (buf + piece).split(b"\n\n")
            for data in (event.decode().removeprefix("data: ") for event in events):
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


async def run_pass(host: str, port: int, workload: bc.Workload, rate: float, seed: int,
                   headers: dict[str, str]) -> tuple[list[Result], float]:
    """Every request sent at its Poisson arrival (`bc.poisson_arrivals`; inf: all at once),
    greedy, streamed: (the results, the pass's start on their clock)."""
    t0 = time.perf_counter()
    results = [Result(t0 + a) for a in bc.poisson_arrivals(len(workload.prompts), rate, seed)]

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, results[i].arrival - time.perf_counter()))
        body = {"prompt": workload.prompts[i], "max_tokens": workload.output_lens[i],
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            await stream_request(host, port, body, headers, results[i])
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            results[i].error = f"{type(e).__name__}: {e}"

    await asyncio.gather(*(one(i) for i in range(len(results))))
    return results, t0


def summarize(results: list[Result], t0: float, workload: bc.Workload, rate: float) -> dict[str, Any]:
    """Throughput over (last finish - `t0`) and the latencies (`bc.latencies`, ITL included);
    RuntimeError when a request failed or made other than its tokens."""
    if bad := [r.error for r in results if not r.ok]:
        raise RuntimeError(f"{len(bad)} of {len(results)} requests failed, e.g. {bad[0]}")
    for r, want in zip(results, workload.output_lens):
        if r.tokens != want:
            raise RuntimeError(f"a request made {r.tokens} tokens, the workload asks for {want}")
    res = {"request_rate": rate, "elapsed_s": max(r.end for r in results) - t0,
           "output_tokens": sum(r.tokens for r in results)}
    arrivals, first, last, ends, tokens = zip(*((r.arrival, r.chunk_times[0], r.chunk_times[-1], r.end,
                                                 r.tokens) for r in results))
    itl = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {**bc.add_throughput(res, workload), **bc.latencies(arrivals, first, last, ends, tokens),
            "itl_s": bc.percentiles(itl)}


# ---- the server and the in-process side ---------------------------------------------------------
def _healthy(port: int) -> bool:
    """Whether the server on loopback `port` answers /health with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def launched_server(serve_args: list[str]) -> Iterator[int]:
    """scripts/serve.py on a free loopback port: yields the port once /health answers, stops it
    on exit (SIGTERM, then SIGKILL after 30 s); RuntimeError (the log's tail) when it exits or is
    not up within 10 minutes."""
    with tempfile.NamedTemporaryFile(prefix="bench-serve-", suffix=".log") as log:
        proc = subprocess.Popen([sys.executable, str(SERVE), "--port", "0", *serve_args],
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                m = re.search(r"on http://[^:]+:(\d+)/v1", Path(log.name).read_text(errors="replace"))
                if m and _healthy(int(m.group(1))):
                    break
                time.sleep(0.5)
            else:
                text = Path(log.name).read_text(errors="replace")
                raise RuntimeError(f"serve.py did not start:\n{text[-2000:]}")
            yield int(m.group(1))
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def serve_args(args: argparse.Namespace, spec: bc.ModelSpec, workload: bc.Workload, dtype: str,
               on_cpu: bool) -> list[str]:
    """serve.py's options: --model's checkpoint, the engine options sized as bench.py sizes its
    engine (`bc.sized_engine_kwargs`), --precompile for --warmup all, and --api-key."""
    model = [] if spec.engine_model is None else ["--model", spec.engine_model]
    return (model + bc.engine_argv(bc.sized_engine_kwargs(args, workload, dtype, on_cpu))
            + ["--precompile"] * (args.warmup == "all")
            + ([] if args.api_key is None else ["--api-key", args.api_key]))


def in_process_args(args: argparse.Namespace, rate: float) -> argparse.Namespace:
    """bench.py's arguments for the same workload and engine options, online at `rate`."""
    return bench.parse_args(
        ["--num-seqs", str(args.num_seqs), "--input-len", *map(str, args.input_len),
         "--output-len", *map(str, args.output_len), "--seed", str(args.seed), "--online", str(rate),
         "--warmup", args.warmup, *bc.engine_argv(engine_kwargs(args)),
         *([] if args.model is None else ["--model", args.model])])


def warm_up(args: argparse.Namespace, spec: bc.ModelSpec, workload: bc.Workload, dtype: str,
            on_cpu: bool, host: str, port: int, headers: dict[str, str]) -> Any:
    """--warmup's passes on the server (bench.py's warm-up ids: a burst, then at the first rate);
    with --compare-in-process, the in-process engine, built and warmed as bench.py's (else None)."""
    if args.warmup != "none":
        warm, t = bc.redraw_tokens(workload, args.seed + 12345), time.perf_counter()
        for rate in (float("inf"), args.request_rate[0]):
            asyncio.run(run_pass(host, port, warm, rate, args.seed, headers))
        print(f"server warm-up {time.perf_counter() - t:.1f}s")
    if not args.compare_in_process:
        return None
    bargs, t = in_process_args(args, args.request_rate[0]), time.perf_counter()
    bench.warm_up(llm := bench.build_llm(spec, workload, bargs, dtype, on_cpu), workload, bargs)
    print(f"in-process warm-up {time.perf_counter() - t:.1f}s")
    return llm


def fmt(res: dict[str, Any]) -> str:
    """A round's report: throughput, then `bc.latency_lines`."""
    return "\n".join([f"  output {res['output_tok_s']:.1f} tok/s, total {res['total_tok_s']:.1f} "
                      f"tok/s, {res['output_tokens']} tokens in {res['elapsed_s']:.2f}s",
                      *bc.latency_lines(res)])


def in_process_round(llm: Any, args: argparse.Namespace, workload: bc.Workload, rate: float,
                     http: dict[str, Any], label: str) -> dict[str, Any]:
    """bench.py's --online loop on `llm`, printed against the HTTP round `http`, which gains
    ttft_paired_diff_s: each request's HTTP TTFT minus its in-process one, p10 / p50 / p90."""
    inp = bc.add_throughput(bench.run_online(llm, workload, in_process_args(args, rate), None), workload)
    inp.pop("per_request_tokens")
    print(f"in process (bench.py --online), {label}:\n{fmt(inp)}")
    q = http["ttft_paired_diff_s"] = bc.percentiles(
        [h - i for h, i in zip(http["ttft_per_request_s"], inp["ttft_per_request_s"])], (10, 50, 90))
    print(f"  HTTP / in process: output throughput {http['output_tok_s'] / inp['output_tok_s']:.3f}x, "
          f"TTFT p50 {1e3 * (http['ttft_s']['p50'] - inp['ttft_s']['p50']):+.1f}ms, TTFT per request "
          "HTTP - in process p10/p50/p90 " + "/".join(f"{1e3 * v:+.1f}" for v in q.values()) + "ms")
    return inp


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its report; the --json record (appended there if given)."""
    args = parse_args(argv)
    import jax

    on_cpu, dtype, spec, workload = bc.setup(args)
    headers = {} if args.api_key is None else {"Authorization": f"Bearer {args.api_key}"}
    record = {**bc.workload_record(spec, dtype, workload, args, jax.devices()[0].device_kind),
              "http": [], "in_process": []}
    url = urlsplit(args.base_url or "")
    with (launched_server(serve_args(args, spec, workload, dtype, on_cpu)) if args.launch
          else contextlib.nullcontext(url.port or 80)) as port:
        host = "127.0.0.1" if args.launch else url.hostname
        print(f"model={spec.label} dtype={dtype} num_seqs={args.num_seqs} prompt_tokens="
              f"{workload.num_prompt_tokens} output_tokens={workload.num_output_tokens} "
              f"server=http://{host}:{port}")
        llm = warm_up(args, spec, workload, dtype, on_cpu, host, port, headers)
        for rate in args.request_rate:
            for r in range(args.repeat):
                results, t0 = asyncio.run(run_pass(host, port, workload, rate, args.seed, headers))
                record["http"].append(res := summarize(results, t0, workload, rate))
                print(f"HTTP, rate {rate} req/s, round {r + 1}:\n{fmt(res)}")
                if llm is not None:
                    record["in_process"].append(in_process_round(
                        llm, args, workload, rate, res, f"rate {rate} req/s, round {r + 1}"))
    return bc.dump_json(args.json, record)


if __name__ == "__main__":
    sys.exit(run_cli(main))

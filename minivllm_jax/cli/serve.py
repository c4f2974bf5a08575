"""Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).

    minivllm-jax serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] \\
        [--max-waiting-requests N] [--max-body-bytes N] [--chat-template FILE|TEMPLATE] \\
        [--trust-request-chat-template] \\
        [--enable-auto-tool-choice --tool-call-parser hermes] [--reasoning-parser qwen3] \\
        [the engine options of generate]

(`python scripts/serve.py` takes the same options.)

Then `openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything")`. SIGINT or
SIGTERM ends in-flight requests (an error chunk on streams), then the process exits with status 0.
Bad input exits with status 2 and one `error: ...` line on stderr.
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Sequence

from minivllm_jax.cli.args import (ArgumentParser, add_compile_cache_options, add_engine_options,
                                  compile_cache_arg, engine_kwargs, named_by_flags, run_cli)
from minivllm_jax.serving.output_parsers import REASONING_PARSERS, TOOL_PARSERS

if TYPE_CHECKING:
    from minivllm_jax.config import EngineConfig
    from minivllm_jax.serving.tools import ToolOptions

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: --model, or "
                        f"{DEFAULT_MODEL_NAME} for the embedded model)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="more requests (samples) than this waiting for the batch: 503 at once")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="a larger request body: 413, refused before it is parsed")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template replacing the tokenizer's, a file or the template "
                        "itself (e.g. one that renders tools: docs/API.md §4a)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request bring its own chat_template (Jinja the client "
                        "writes runs here)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default when tools are given): calls are parsed '
                        "out of the output with --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the format of the model's calls (hermes: <tool_call>{...}</tool_call>)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> reasoning into reasoning_content")
    p.add_argument("--precompile", action="store_true",
                   help="compile every step shape before serving (minutes on a CPU)")
    add_compile_cache_options(p)
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's (info: one access-log line per request)")
    return p


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = build_parser(prog)
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty")
    with named_by_flags(p):  # a bad engine option fails before the model loads
        args.engine_config = engine_config(args)
    args.tools = tool_options(args)
    return args


def tool_options(args: argparse.Namespace) -> ToolOptions:
    """The server's tool options; --chat-template (vLLM's rule: the template itself when the
    value holds ``{``, ``}`` or a newline, else a file to read) parsed as Jinja (a bad one fails
    here, naming the flag, before the model loads)."""
    from minivllm_jax.serving.tools import ToolOptions, check_jinja

    template, value = None, args.chat_template
    if value is not None:
        inline = any(c in value for c in "{}\n")
        where = "the inline template" if inline else value
        try:
            template = value if inline else open(value, encoding="utf-8").read()
        except OSError as e:
            raise OSError(f"--chat-template: cannot read {value}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--chat-template: {value} is not UTF-8 text") from None
        check_jinja(template, f"--chat-template: {where}")
    return ToolOptions(template, args.enable_auto_tool_choice, args.tool_call_parser,
                       args.reasoning_parser, args.trust_request_chat_template)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config of the command line's engine options."""
    from minivllm_jax.config import EngineConfig

    return EngineConfig.from_kwargs("serve", {**engine_kwargs(args),
                                              "compile_cache": compile_cache_arg(args)})


@dataclass
class QuietExit:
    """The process's SIGINT / SIGTERM handler outside uvicorn's: exit without a traceback, with
    status 0 once uvicorn shut down gracefully (it re-raises the signal it caught), else
    128 + the signal."""

    graceful: bool = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0 if self.graceful else 128 + signum)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    quiet = QuietExit()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, quiet)
    sock = bind(args.host, args.port)

    import uvicorn

    from minivllm_jax.engine.llm_engine import LLMEngine
    from minivllm_jax.serving.api import ServerConfig, build_app
    from minivllm_jax.serving.async_engine import AsyncEngine, AsyncEngineConfig
    from minivllm_jax.serving.metrics import ServerMetrics

    llm_engine = LLMEngine.from_model(args.model, args.engine_config)
    if args.precompile:
        llm_engine.precompile()
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    metrics = ServerMetrics(name)
    engine = AsyncEngine(llm_engine, AsyncEngineConfig(args.max_waiting_requests), metrics=metrics)
    cfg = llm_engine.config
    server = ServerConfig(name, cfg.max_model_len, args.api_key, args.max_body_bytes, args.tools)
    app = build_app(engine, llm_engine.tokenizer, server, metrics)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            quiet.graceful = True
            engine.begin_shutdown_threadsafe()  # in-flight requests end now, not when done
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                            access_log=args.log_level in ("info", "debug"))
    host, port = sock.getsockname()[:2]
    print(f"serving {name} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    Server(config).run(sockets=[sock])
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """The exit status: 0, or 2 for bad input (one line on stderr). SIGINT / SIGTERM end the
    process through `QuietExit`."""
    return run_cli(lambda: run(argv, prog))


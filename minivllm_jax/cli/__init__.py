"""The `minivllm-jax` console script: `minivllm-jax generate [options]`, `minivllm-jax serve
[options]` and `minivllm-jax multihost [options]` run scripts/generate.py's, scripts/serve.py's
and scripts/launch_multihost.py's code with the same options; `minivllm-jax compile [options]`
compiles every step program for a TPU topology ahead of time (`aot.py`). Importing this package
imports no jax; a subcommand's module is imported only when it runs."""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

from minivllm_jax.cli.args import run_cli, version

PROG = "minivllm-jax"
COMMANDS = {"generate": "generate completions for prompts",
            "serve": "serve the OpenAI API over HTTP",
            "multihost": "generate tensor-parallel over several processes (hosts)",
            "compile": "compile every step program for a TPU topology (or lower it for CUDA), "
                       "without one"}
USAGE = "\n".join([f"usage: {PROG} {{{','.join(COMMANDS)}}} [options]", "",
                   *(f"  {name:<10}{what}" for name, what in COMMANDS.items()), "",
                   f"{PROG} COMMAND --help lists a command's options."])


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status: 0 for --help, 2 (one `error: ...` line on stderr) without a known
    command, else the command's own status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if args[:1] == ["--version"]:
        print(f"{PROG} {version()}")
        return 0

    def dispatch() -> int:
        if not args or args[0] not in COMMANDS:
            got = f"unknown command {args[0]!r}" if args else "a command is required"
            raise ValueError(f"{got}; choose from {', '.join(COMMANDS)} (see {PROG} --help)")
        module = importlib.import_module(f"minivllm_jax.cli.{args[0]}")
        return module.main(args[1:], prog=f"{PROG} {args[0]}")

    return run_cli(dispatch)

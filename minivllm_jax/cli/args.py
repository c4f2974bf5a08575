"""Command-line plumbing shared by the console script and scripts/: one argument parser, the
engine options they share, and the rule for bad input: a ValueError, TypeError, OSError or
NotImplementedError (an unsupported model) becomes one ``error: ...`` line on stderr and exit
status 2, never a traceback. Importing this module imports no jax (launch_multihost.py picks the
platform before jax starts)."""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import sys
from typing import Any, Callable, Iterator

from minivllm_jax import backends
from scheduler.spec_decode import SpeculativeConfig

BAD_INPUT = (ValueError, TypeError, OSError, NotImplementedError)
ATTENTION_BACKENDS = ("auto", *backends.ATTENTION_BACKENDS)
LAYER_LAYOUTS = ("auto", *backends.LAYER_LAYOUTS)
DTYPES = ("auto", "float32", "bfloat16", "float16")
ENGINE_OPTIONS = ("dtype", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                  "num_kv_blocks", "attention_backend", "layer_layout", "tensor_parallel_size",
                  "async_scheduling", "speculative_config")


def version() -> str:
    """The installed package's version (`--version`)."""
    try:
        return importlib.metadata.version("minivllm-jax")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown (not installed)"


class ArgumentParser(argparse.ArgumentParser):
    """The scripts' parser: a bad flag is one `error:` line (`run_cli`), every command has
    `--version`, and an option's help ends with its default unless it says it already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=f"%(prog)s {version()}")

    def error(self, message: str) -> None:  # raised for run_cli's one line, no usage dump
        raise ValueError(message)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        shown = action.default not in (None, False, argparse.SUPPRESS)
        if shown and action.help and "default" not in action.help:
            action.help += " (default: %(default)s)"
        return action


def add_engine_options(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = (),
                       model_help: str = "HF checkpoint directory or .gguf file (default: the "
                                         "embedded SmolLM2-135M-Instruct)",
                       dtype_help: str = "auto: float32 on a CPU, else the checkpoint's 16-bit dtype",
                       **defaults: Any) -> None:
    """The LLM options (EngineConfig fields) the scripts share, less `skip`ped flags; `defaults`
    overrides defaults by dest name. The engine validates the values (`engine_kwargs`)."""
    options: dict[str, dict[str, Any]] = {
        "--model": dict(default=None, help=model_help),
        "--dtype": dict(default="auto", choices=DTYPES, help=dtype_help),
        "--max-num-seqs": dict(type=int, help="the most sequences one step runs (default: 128; "
                                              "more samples of a request run in waves)"),
        "--max-model-len": dict(type=int, help="the context length (default: the model's, "
                                               "lowered to what the KV cache holds)"),
        "--max-num-batched-tokens": dict(type=int, help="the token budget of one step (default: "
                                                        "2048, or max-num-seqs if larger)"),
        "--num-kv-blocks": dict(type=int, help="KV cache blocks, the null block included (default: "
                                               "sized from device memory, or a CPU byte budget)"),
        "--attention-backend": dict(default="auto", choices=ATTENTION_BACKENDS,
                                    help="xla: tuned XLA attention (CPU default); pallas: the "
                                         "Triton GPU kernel (GPU default); pallas-tpu: the "
                                         "Mosaic TPU kernel (TPU default; interpret mode "
                                         "elsewhere); reference: plain jnp"),
        "--layer-layout": dict(default="auto", choices=LAYER_LAYOUTS,
                               help="stacked (nn.scan) or switched (a scan over per-layer "
                                    "weights); auto: switched on one CPU device, else stacked"),
        "--tensor-parallel-size": dict(type=int, default=1,
                                       help="shard weights and KV cache over this many devices"),
        "--async-scheduling": dict(default="auto", choices=("auto", "on", "off"),
                                   help="dispatch step N+1 before collecting step N "
                                        "(auto: on for accelerators, off on CPU)"),
        "--speculative-config": dict(default=None, metavar="JSON",
                                     help='n-gram speculative decoding, e.g. \'{"method": "ngram", '
                                          '"num_speculative_tokens": 4}\' (vLLM\'s keys)'),
    }
    for flag, kw in options.items():
        if flag not in skip:
            p.add_argument(flag, *(("--layers",) if flag == "--layer-layout" else ()), **kw)
    p.set_defaults(**defaults)


def add_compile_cache_options(p: argparse.ArgumentParser) -> None:
    """--compile-cache DIR and --no-compile-cache: the engine's `compile_cache`
    (`compile_cache_arg`)."""
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep compiled step programs here, so a later run loads them (default: "
                        "$MINIVLLM_JAX_COMPILE_CACHE or ~/.cache/minivllm_jax/xla)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile every step afresh")


def compile_cache_arg(args: argparse.Namespace) -> bool | str:
    """`LLM(compile_cache=...)` of the --compile-cache / --no-compile-cache flags."""
    if args.no_compile_cache and args.compile_cache is not None:
        raise ValueError("give at most one of --compile-cache and --no-compile-cache")
    return False if args.no_compile_cache else (args.compile_cache or True)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(model, **engine_kwargs(args))`: the given engine options ("auto"/None: the engine's
    own choice)."""
    kw = {name: getattr(args, name, None) for name in ENGINE_OPTIONS}
    kw["async_scheduling"] = {"on": True, "off": False}.get(kw["async_scheduling"])
    if kw["speculative_config"] is not None:
        kw["speculative_config"] = SpeculativeConfig.from_json(kw["speculative_config"])
    if kw["layer_layout"] == "auto":
        kw["layer_layout"] = None
    return {k: v for k, v in kw.items() if v is not None}


@contextlib.contextmanager
def named_by_flags(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Re-raise a ValueError or TypeError from a config or SamplingParams field with the field
    name its message starts with spelt as the parser's flag for it ("max_tokens must be >= 1"
    -> "--max-tokens must be >= 1"); unchanged when no flag sets that field."""
    try:
        yield
    except (ValueError, TypeError) as error:
        text = str(error)
        name = text.split(" ", 1)[0]
        base, dot, key = name.partition(".")  # "speculative_config.method": a key of a flag's JSON
        flags = {a.dest: a.option_strings[-1] for a in parser._actions if a.option_strings}
        if base not in flags:
            raise
        flag = f"{flags[base]}: {key}" if dot else flags[base]
        raise (TypeError if isinstance(error, TypeError) else ValueError)(flag + text[len(name):]) from None


def run_cli(main: Callable[[], Any]) -> int:
    """Call ``main``: its status when it returns an int, else 0; 2 (with the one line) when it
    raises BAD_INPUT."""
    try:
        status = main()
    except BAD_INPUT as e:
        print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) and not isinstance(status, bool) else 0

"""Command-line plumbing shared by the console script and scripts/: one argument parser, the
engine options they share, and the rule for bad input: a ValueError, TypeError, OSError or
NotImplementedError (an unsupported model) becomes one ``error: ...`` line on stderr and exit
status 2, never a traceback. Importing this module imports no jax (launch_multihost.py picks the
platform before jax starts)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import sys
from typing import Any, Callable, Iterator

from minivllm_jax.config import EngineConfig
from scheduler.spec_decode import SpeculativeConfig

BAD_INPUT = (ValueError, TypeError, OSError, NotImplementedError)
AUTO_BOOL = {"auto": None, "on": True, "off": False}


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


def engine_fields() -> list[dataclasses.Field]:
    """The EngineConfig fields the command line exposes (made with `config.option`)."""
    return [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


def _flag_options(field: dataclasses.Field, default: Any) -> dict[str, Any]:
    """argparse keywords of a config field, from its type: ints and floats as numbers, a bool
    as --x/--no-x, an optional bool as auto/on/off, an optional choice with "auto" for None,
    the speculative config as JSON. The parsed default is the field's (`engine_kwargs` passes
    on only the values that differ from it)."""
    meta, kind = field.metadata, str(field.type)
    kw: dict[str, Any] = dict(help=meta["help"], default=default, metavar=meta["metavar"])
    if kind in ("int", "int | None", "float"):
        kw["type"] = float if kind == "float" else int
    elif kind == "bool":
        kw.update(action=argparse.BooleanOptionalAction, metavar=None)
    elif kind == "bool | None":
        kw.update(choices=tuple(AUTO_BOOL), default={v: k for k, v in AUTO_BOOL.items()}[default])
    elif meta["choices"] is not None:
        none = (meta["none"],) if meta["none"] else ()
        kw["choices"] = (*none, *meta["choices"])
        if default is None and none:
            kw["default"] = meta["none"]
    shown = {True: "on", False: "off"}.get(kw["default"], kw["default"]) if kind == "bool" \
        else kw["default"]
    if shown is None:
        shown = meta["shown"]
    if shown is not None:
        kw["help"] += f" (default: {shown})"
    return kw


def add_engine_options(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = (),
                       model_help: str = "HF checkpoint directory or .gguf file (default: the "
                                         "embedded SmolLM2-135M-Instruct)",
                       dtype_help: str | None = None, **defaults: Any) -> None:
    """--model and a flag per exposed EngineConfig field (`engine_fields`), less `skip`ped
    flags; `defaults` overrides a field's default by name (shown in the help). The engine
    validates the values (`engine_kwargs`)."""
    p.add_argument("--model", default=None, help=model_help)
    for field in engine_fields():
        flag = "--" + field.name.replace("_", "-")
        if flag in skip:
            continue
        kw = _flag_options(field, defaults.get(field.name, field.default))
        if field.name == "dtype" and dtype_help is not None:
            kw["help"] = f"{dtype_help} (default: auto)"
        alias = field.metadata["alias"]
        p.add_argument(flag, *((alias,) if alias else ()), **kw)
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
    """`LLM(model, **engine_kwargs(args))`: the engine options given on the command line (or
    set as a command's default), as EngineConfig values; the rest is the engine's default."""
    kw: dict[str, Any] = {}
    for field in engine_fields():
        if not hasattr(args, field.name):  # a flag the command skips
            continue
        value = getattr(args, field.name)
        if value is not None and value == field.metadata["none"]:
            value = None
        elif str(field.type) == "bool | None":
            value = AUTO_BOOL[value]
        elif field.name == "speculative_config" and value is not None:
            value = SpeculativeConfig.from_json(value)
        if value != field.default:
            kw[field.name] = value
    return kw


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

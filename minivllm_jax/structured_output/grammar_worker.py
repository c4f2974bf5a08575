"""A constraint's first compile, in a process of its own: llguidance (native code) can crash the
process it runs in (a stack overflow on a deeply nested schema or grammar) or run long, and
neither may take the engine or the server with it.

Invariants:
- `GrammarWorker.check` compiles a constraint, computes its first token mask and reports
  whether that succeeded within `timeout_s`, in a child process (a fresh interpreter, so it
  shares no state with the engine's threads) whose compiling thread has a smaller stack
  (`WORKER_STACK_BYTES`) than any thread of the engine's process: what passes there cannot
  overflow the stack of the engine's own compile of the same constraint, which is deterministic.
- A child that crashes or runs past the limit is killed; the next check starts a new one. One
  check runs at a time (callers queue on a lock); no check ever blocks on the engine.
- The child imports llguidance and the scheduler's pure-Python params, never jax or transformers.
- `grammar_text` and `compile_and_mask` are the one place a constraint becomes an llguidance
  grammar and matcher: the child and the engine's process run the same code.
"""
from __future__ import annotations

import logging
import os
import pickle
import re
import resource
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance

from scheduler.errors import InvalidFieldError
from scheduler.structured import FIELD, StructuredOutputsParams

logger = logging.getLogger(__name__)

# the stack of the child's compiling thread: 3/4 of what the engine's threads have (Linux gives
# threads the main thread's stack limit, 8 MiB by default), so a constraint that compiles here
# compiles there with room to spare (llguidance takes ~2.7 KiB a nesting level: a 2,000-rule
# chain needs 4-6 MiB, a 3,000-rule one overflows 8)
WORKER_STACK_BYTES = 6 * 1024 * 1024
# how long the child may take to start (import llguidance, load the tokenizer) before a check
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CheckResult:
    """The child's answer: `error` None when the constraint compiled and has a first mask;
    `seconds` its compile-and-mask time there."""

    error: str | None
    seconds: float


def _first_line(text: str, limit: int = 300) -> str:
    lines = text.strip().splitlines()
    return (lines[0] if lines else "")[:limit]


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of one constraint (not yet checked: `compile_and_mask` does). A
    choice is a regex alternation: the lexer takes thousands of strings in one lexeme, where a
    grammar alternation of more than `max_items_in_row` strings fails."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not params.disable_any_whitespace})
        except ValueError as e:
            raise InvalidFieldError(FIELD, f"{FIELD}.{kind} cannot be compiled: {e}") from None
    try:  # llguidance's own: a regex, a grammar Lark or GBNF
        if kind == "choice":
            return llguidance.grammar_from("regex", "|".join(map(re.escape, params.choice)))
        return llguidance.grammar_from(kind, params.spec)
    except ValueError as e:
        raise InvalidFieldError(FIELD, f"{FIELD}.{kind} cannot be compiled: {e}") from None


def compile_and_mask(tokenizer: Any, params: StructuredOutputsParams, limits: Any) -> Any:
    """The pristine matcher of `params` (llguidance), with its first mask computed once so that
    everything a first step does has run; ValueError with the library's reason when it fails."""
    grammar = grammar_text(params)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
    if error:
        raise ValueError(_first_line(error))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if not matcher.is_error():
        matcher.deep_copy().compute_bitmask()
    if matcher.is_error():
        raise ValueError(_first_line(matcher.get_error()))
    return matcher


def worker_stack_bytes() -> int:
    """`WORKER_STACK_BYTES`, or 3/4 of the engine threads' stack where that is smaller: the
    stack limit, or with none glibc's fallback for threads, 2 MiB."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    engine = 2 * 1024 * 1024 if soft == resource.RLIM_INFINITY else soft
    return min(WORKER_STACK_BYTES, engine * 3 // 4)


def _read(stream: Any) -> Any:
    """One length-prefixed pickle from a binary stream (EOFError at its end)."""
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    data = stream.read(struct.unpack("<Q", head)[0])
    return pickle.loads(data)


def _write(stream: Any, value: Any) -> None:
    data = pickle.dumps(value)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _serve() -> None:
    """The child (``python -m minivllm_jax.structured_output.grammar_worker``): from stdin, the tokenizer's JSON,
    vocabulary size, EOS ids and parser limits; then answer `(kind, value,
    disable_any_whitespace)` checks until stdin ends."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer_json, vocab_size, eos_ids, limits = _read(stdin)
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids)
    parser_limits = llguidance.LLParserLimits(**limits)
    threading.stack_size(worker_stack_bytes())
    _write(stdout, "ready")
    while True:
        try:
            kind, value, disable_ws = _read(stdin)
        except EOFError:  # the engine's process closed the pipe, or went away
            return
        answer: list[Any] = [None]

        def run() -> None:
            start = time.perf_counter()
            try:
                params = StructuredOutputsParams(**{kind: value, "disable_any_whitespace": disable_ws})
                compile_and_mask(tokenizer, params, parser_limits)
                answer[0] = (None, time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001 - the library's refusal is the answer
                answer[0] = (str(e) or type(e).__name__, time.perf_counter() - start)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        _write(stdout, answer[0])


class GrammarWorker:
    """One child process that compiles constraints in isolation (see the module invariants). It
    is a plain ``python -m`` subprocess talking over its stdin and stdout, so starting it never
    imports the caller's main module (as multiprocessing's spawn would)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int],
                 limits: dict[str, Any], timeout_s: float) -> None:
        self._args = (tokenizer_json, vocab_size, list(eos_ids), dict(limits))
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    def start(self) -> None:
        """Start the child now (it takes a second or two), rather than at the first check; a
        failure is logged (the first check tries again)."""
        with self._lock:
            try:
                self._ensure_started()
            except Exception as e:  # noqa: BLE001 - a background start: the check reports it
                logger.warning("the grammar worker did not start: %s", e)

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        # the child finds this package where this process did (a checkout on sys.path included)
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen([sys.executable, "-m", "minivllm_jax.structured_output.grammar_worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL,
                                env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path})
        try:
            _write(proc.stdin, self._args)
            if not self._ready(proc, START_TIMEOUT_S) or _read(proc.stdout) != "ready":
                raise RuntimeError("it did not answer")
        except (OSError, EOFError, RuntimeError) as e:
            proc.kill()
            proc.wait(5)
            raise RuntimeError(f"the grammar worker process did not start: {e}") from None
        self._proc = proc
        self._finalizer = weakref.finalize(self, _stop, proc)  # ends with this object too

    @staticmethod
    def _ready(proc: subprocess.Popen, timeout_s: float) -> bool:
        """Whether the child's answer starts arriving within `timeout_s`."""
        return bool(select.select([proc.stdout], [], [], timeout_s)[0])

    def _kill(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._proc = self._finalizer = None

    def check(self, params: StructuredOutputsParams) -> CheckResult:
        """Compile `params` and its first mask in the child, within `timeout_s`."""
        with self._lock:
            try:
                self._ensure_started()
            except Exception as e:  # noqa: BLE001 - no worker: nothing can be checked
                return CheckResult(f"the grammar worker process could not start ({e})", 0.0)
            start = time.perf_counter()
            try:
                _write(self._proc.stdin, (params.kind, getattr(params, params.kind),
                                          params.disable_any_whitespace))
                if not self._ready(self._proc, self.timeout_s):
                    self._proc.kill()  # busy: it would not read a closed stdin
                    self._kill()
                    return CheckResult(f"compiling it took longer than the limit of "
                                       f"{self.timeout_s:g} s", time.perf_counter() - start)
                error, seconds = _read(self._proc.stdout)
            except (EOFError, OSError):  # the child died: a native crash in the library
                self._kill()
                return CheckResult("the grammar library crashed compiling it (too deeply "
                                   "nested?)", time.perf_counter() - start)
            return CheckResult(error, seconds)

    def close(self) -> None:
        with self._lock:
            self._kill()


def _stop(proc: subprocess.Popen) -> None:
    """End a child: its stdin closed (it returns), then killed should it linger."""
    try:
        proc.stdin.close()
        proc.wait(1)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(5)


if __name__ == "__main__":
    _serve()

"""`CompileWatch`: the XLA backend compilations made while it is installed, for benchmarks and
tests that must tell compiling from running.

Invariants:
- It counts exactly the `/jax/core/compile/backend_compile_duration` events JAX's monitoring
  records while `install()`'s block runs, from any thread (the listener is process-wide): one per
  backend compile step, a load from JAX's persistent compilation cache included; a hit in JAX's
  in-memory caches, or an executable deserialized directly (`executable_cache`), records none.
- `names` holds one entry per event, in order: the compiled function's name (``jit(f)`` gives
  ``f``); `seconds` is the sum of their durations. Both only grow, and nothing is counted after
  the block exits, even when it raises.
- Importing this module imports no jax (`install` does), so a script can still set up its
  process before jax starts.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


class CompileWatch:
    """The compilations seen while installed (`with CompileWatch().install() as watch:`); one
    install of an instance at a time."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.names: list[str] = []
        self.seconds = 0.0

    def __call__(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == self.EVENT:
            self.names.append(str(kwargs.get("fun_name", "")).removeprefix("jit(").removesuffix(")"))
            self.seconds += duration

    @contextlib.contextmanager
    def install(self) -> Iterator[CompileWatch]:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self)
        try:
            yield self
        finally:
            jax.monitoring.unregister_event_duration_listener(self)

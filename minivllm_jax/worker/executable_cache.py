"""Compiled step programs on disk (`ExecutableCache`), so a later process loads a step instead
of tracing, lowering and compiling it; and the switch for JAX's own persistent compilation cache
(`enable_compilation_cache`, for scripts and notebooks).

Invariants:
- A file's key covers everything the program depends on: its statics, its arguments' signature and
  device assignment (the caller's key) and `code_fingerprint()` (jax, jaxlib, the devices,
  XLA_FLAGS, this library's source). Files are written under a temporary name and renamed
  complete; anything unreadable, made for other devices or for other input shardings is a miss.
- A loaded program runs on exactly the devices it was compiled for, and until its first call
  succeeds a call it refuses before anything was donated compiles the program afresh
  (`LoadedProgram`).
- Nothing is stored while JAX's persistent cache is on (`jax_cache_on`): XLA:CPU serializes a
  program that came from JAX's cache again without its code.
- The library changes no JAX config; only `enable_compilation_cache` does, and the library never
  calls it.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

# enable_compilation_cache() keeps programs that took this long to compile (JAX's default: 1 s)
MIN_CACHED_COMPILE_SECONDS = 0.2


def default_compile_cache_dir() -> Path:
    """``$MINIVLLM_JAX_COMPILE_CACHE``, else ``~/.cache/minivllm_jax/xla``."""
    env = os.environ.get("MINIVLLM_JAX_COMPILE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minivllm_jax" / "xla"


class ExecutableCache:
    """Compiled programs on disk (``step-<key>.bin``), so a later process loads a step instead of
    tracing, lowering and compiling it. A key hashes a program's statics, argument signature and
    device assignment (`step_programs.StepPrograms.cache_key`) with `code_fingerprint()`: the jax and jaxlib
    versions, the devices, XLA_FLAGS and this library's own source, so any change to them
    recompiles. Process-local: no JAX config changes. Files are written to a temporary name and
    renamed complete; an unreadable file is a miss, as is a program whose input shardings differ
    from its arguments' (`load_program`).

    Devices: a file records the ids of the devices its program was compiled for (its device
    assignment, in order), and `load` makes the executable run on exactly those devices. A
    serialized executable names no devices of its own: loaded without them, jax spreads it over
    every device of the backend, and a one-device program on a host with several devices then
    fails its first call ("Expected args to execute_sharded_on_local_devices to have N shards").
    A file made for other devices, or whose loaded executable does not run on them, is a miss.

    Stored: only programs XLA compiled in this process, without host callbacks (those hold
    pointers into the process). While JAX's own persistent cache is on (`jax_cache_on`), a
    `compile()` may return one of its entries, which XLA:CPU serializes again without its code
    (another process then fails with "Function ... not found"), so nothing is stored then."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()

    def _file(self, key: str) -> Path:
        digest = hashlib.sha256(f"{code_fingerprint()}\n{key}".encode()).hexdigest()[:40]
        return self.path / f"step-{digest}.bin"

    def load(self, key: str, devices: Sequence[jax.Device]) -> jax.stages.Compiled | None:
        """The program stored under ``key``, loaded to run on ``devices`` (the device assignment
        it was compiled for, in order: a mesh's devices, or the one device of its arguments);
        None (a miss) when there is none, it is unreadable, or it was made for other devices."""
        file = self._file(key)
        if not file.is_file():
            return None
        ids = [d.id for d in devices]
        try:
            stored_ids, payload, in_tree, out_tree = pickle.loads(file.read_bytes())
            if stored_ids != ids:
                logger.warning("ignoring compiled program %s: made for devices %s, not %s",
                               file, stored_ids, ids)
                return None
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=devices[0].client,
                execution_devices=list(devices))
            runs_on = [d.id for d in compiled.runtime_executable().local_devices()]
        except Exception as e:  # a foreign, truncated or older-format file: compile afresh
            logger.warning("ignoring unreadable compiled program %s: %s", file, e)
            return None
        local = [d.id for d in devices if d.process_index == jax.process_index()]
        if runs_on != local:
            logger.warning("ignoring compiled program %s: it loads onto devices %s, not %s",
                           file, runs_on, local)
            return None
        return compiled

    def load_program(self, key: str, args: tuple[Any, ...], devices: Sequence[jax.Device],
                     recompile: Callable[[tuple[Any, ...]], jax.stages.Compiled]
                     ) -> LoadedProgram | None:
        """The program stored under ``key`` (see `load`) as a `LoadedProgram` for ``args``, which
        compiles afresh with ``recompile`` should its first call fail before running; None (a
        miss) when `load` misses or the program's input shardings differ from ``args``'."""
        compiled = self.load(key, devices)
        if compiled is None:
            return None
        leaves, tree = jax.tree.flatten(args)
        try:  # None: an argument the program does not read
            expected = tree.flatten_up_to(compiled.input_shardings[0])
        except (ValueError, TypeError):
            expected = None
        if expected is None or not all(
                s is None or not isinstance(x, jax.Array) or s.is_equivalent_to(x.sharding, x.ndim)
                for s, x in zip(expected, leaves)):
            logger.warning("ignoring compiled program %s: its input shardings differ from its "
                           "arguments'", self._file(key))
            return None
        return LoadedProgram(compiled, recompile)

    def store(self, key: str, compiled: jax.stages.Compiled, devices: Sequence[jax.Device]) -> None:
        """Keep ``compiled``, compiled for ``devices`` (its device assignment, in order)."""
        file = self._file(key)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}")
            record = ([d.id for d in devices], *serialize_executable.serialize(compiled))
            tmp.write_bytes(pickle.dumps(record))
            tmp.replace(file)
        except Exception as e:  # an unwritable cache or a program XLA cannot serialize
            logger.warning("could not store a compiled program under %s: %s", self.path, e)


def jax_cache_on() -> bool:
    """Whether JAX's persistent compilation cache may serve this process's compilations."""
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """What a compiled program depends on besides its statics: jax and jaxlib versions, the
    devices, XLA_FLAGS, and the source of this library's jax packages."""
    import jaxlib

    import pallas_kernels

    h = hashlib.sha256()
    for package in (Path(__file__).parent, Path(pallas_kernels.__file__).parent):
        for file in sorted(package.rglob("*.py")):
            h.update(file.read_bytes())
    devices = sorted({(d.platform, d.device_kind) for d in jax.devices()})
    return "\n".join([jax.__version__, jaxlib.__version__, repr(devices), str(jax.device_count()),
                      os.environ.get("XLA_FLAGS", ""), h.hexdigest()])


class LoadedProgram:
    """A step program loaded from the `ExecutableCache`, called like the `jax.stages.Compiled`
    it holds. Until its first call succeeds, a call the loaded executable refuses (it raises
    while every argument buffer is still alive, so nothing was donated or consumed) recompiles
    the program from those arguments (``recompile``) and runs that instead: the programs are
    pure functions of their arguments, so the retry computes what an uncached run would. A
    failure after an argument was donated (the forward's KV cache, the penalty state) cannot
    be retried and re-raises, as does any failure after a first successful call."""

    def __init__(self, compiled: jax.stages.Compiled,
                 recompile: Callable[[tuple[Any, ...]], jax.stages.Compiled]) -> None:
        self.compiled = compiled
        self._recompile = recompile
        self._proven = False

    def __call__(self, *args: Any) -> Any:
        if self._proven:
            return self.compiled(*args)
        try:
            out = self.compiled(*args)
        except Exception as e:
            if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(args)):
                raise
            logger.warning("a compiled program from the cache failed to run (%s); compiling it", e)
            self.compiled = self._recompile(args)
            out = self.compiled(*args)
        self._proven = True
        return out


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Point JAX's persistent compilation cache at ``path`` (default: the directory JAX already
    has, e.g. from ``$JAX_COMPILATION_CACHE_DIR``, else ``$MINIVLLM_JAX_COMPILE_CACHE``, else
    ``~/.cache/minivllm_jax/xla``), so a later process loads compiled steps instead of compiling
    them; programs that compiled in ``MIN_CACHED_COMPILE_SECONDS`` or more are kept. This changes
    JAX's process-wide config, so the library never calls it: scripts and notebooks do, before
    their first compilation."""
    if path is None and jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    path = default_compile_cache_dir() if path is None else Path(path).expanduser()
    jax.config.update("jax_compilation_cache_dir", str(path))
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min(threshold, MIN_CACHED_COMPILE_SECONDS))
    return path

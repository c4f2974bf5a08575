"""The compiled-step cache (executable_cache.ExecutableCache) on a host with several devices.

A serialized executable names no devices of its own; loaded without them, jax spreads it over
every device of the backend, so a one-device step (tensor_parallel_size=1) stored by one process
crashed the next on a host with three devices ("Expected args to execute_sharded_on_local_devices
to have 3 shards"). Checked here, in subprocesses with three virtual CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=3; the pytest process has one), on a tiny
random Llama with SmolLM2's head layout (3 q / 3 kv heads: 3 devices split every weight). One
process fills a fresh cache with engines of tensor_parallel_size 1 and 3, and a second engine of
each size in it loads every step program; a next process, whose first engine has one device and
second three, loads them too (compiles no forward or sampler) and gives the first process's
tokens. A cache entry made for other devices is a miss (compiled afresh), and a loaded program
that still fails its first call before running compiles and runs afresh: checked in the first
process, after its engines of both sizes, on a cache of its own. (Two processes in all: each
costs seconds to start.)

This file run as a script is the worker: ``ckpt op...``, one JSON line out. Ops: ``1`` / ``3`` a
new engine of that tensor_parallel_size generating the prompts; ``cache=DIR`` makes the later
engines' compile cache DIR (before it: $MINIVLLM_JAX_COMPILE_CACHE); ``foreign-true`` /
``foreign-lie`` overwrite the stored programs of the last one-device engine with ones compiled
for device 1 (recording device 1, or claiming device 0); ``oldload`` makes ExecutableCache.load
deserialize as before the fix (onto every device of the backend, unchecked).

Truth: a fresh engine's greedy tokens (an uncached compile, in the first process); each
engine's step programs compiled, read from JAX's compile log.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
# 4-token steps: the prompts' chunked prefills and the decodes meet one token and one sample
# bucket, so an engine has one forward and one sampler
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=4,
              num_kv_blocks=16)
PROMPTS = ["t5 t6 t7 t8 t9 t10", "t20 t21"]
MAX_TOKENS = 4
# SmolLM2's head layout (q heads = kv heads = 3 * k; tied embeddings), one layer: fast to compile
TINY3 = dict(num_attention_heads=3, num_key_value_heads=3, head_dim=16, hidden_size=48,
             intermediate_size=96, vocab_size=255, num_hidden_layers=1, tie_word_embeddings=True)
PROGRAMS = ("forward", "sample_tokens")
TIMEOUT = 300  # an upper bound against hangs; a worker takes seconds to tens of seconds


@pytest.fixture(scope="module")
def tiny3(make_tiny_llama: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny3_llama"), **TINY3)


def _run(checkpoint: str, cache: Path, *ops: str) -> list[dict[str, Any]]:
    """The worker in a subprocess with 3 CPU devices and ``cache`` as the compile cache; one
    result per op."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=3",
           "MINIVLLM_JAX_COMPILE_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # JAX's own cache on: the engine stores nothing
    proc = subprocess.run([sys.executable, __file__, checkpoint, *ops], capture_output=True,
                          text=True, env=env, timeout=TIMEOUT, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert proc.returncode == 0 and lines, \
        f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def both_sizes(tiny3: str, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, list[dict[str, Any]]]:
    """One process, one fresh cache: engines of tensor_parallel_size 1, 3, 1, 3 (the first two
    compile and store, the last two load); then, on a second fresh cache, the runs of
    test_entries_for_other_devices_are_misses_and_compile (a one-device engine storing its
    programs, whose entries are then overwritten: FOREIGN_OPS). The first cache and the
    results."""
    tmp = tmp_path_factory.mktemp("both_sizes")
    cache = tmp / "xla"
    return cache, _run(tiny3, cache, "1", "3", "1", "3", f"cache={tmp / 'foreign'}", "1", *FOREIGN_OPS)


FOREIGN_OPS = ("foreign-true", "1", "foreign-lie", "1", "oldload", "1")


def test_engines_of_both_sizes_share_one_cache_in_one_process(
        both_sizes: tuple[Path, list[dict[str, Any]]]) -> None:
    """tensor_parallel_size 1 then 3 compile and store their programs; a second engine of each,
    in the same process and cache, loads them all; the four give the same tokens."""
    fresh1, fresh3, loaded1, loaded3 = both_sizes[1][:4]
    for fresh in (fresh1, fresh3):
        assert all(fresh["compiles"][p] >= 1 for p in PROGRAMS), fresh
    for loaded in (loaded1, loaded3):
        assert loaded["compiles"] == {p: 0 for p in PROGRAMS} and loaded["warnings"] == [], loaded
    assert fresh1["tokens"] == fresh3["tokens"] == loaded1["tokens"] == loaded3["tokens"]
    assert all(len(t) == MAX_TOKENS for t in fresh1["tokens"])


@pytest.fixture(scope="module")
def next_process(tiny3: str, both_sizes: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A second process on the cache the first filled: engines of tensor_parallel_size 1 and 3."""
    return _run(tiny3, both_sizes[0], "1", "3")


@pytest.mark.parametrize("tp", [1, 3])
def test_next_process_loads_every_step_and_gives_the_same_tokens(
        both_sizes: tuple[Path, list[dict[str, Any]]], next_process: list[dict[str, Any]],
        tp: int) -> None:
    """The issue's repro at tensor_parallel_size 1 (a one-device program on a 3-device host: the
    process's first engine) and 3 (the mesh): an engine of a process on the cache the first
    process filled compiles no forward or sampler and gives that process's fresh tokens."""
    fresh = both_sizes[1][0 if tp == 1 else 1]
    loaded = next_process[0 if tp == 1 else 1]
    assert loaded["op"] == str(tp)
    assert loaded["compiles"] == {p: 0 for p in PROGRAMS}, loaded
    assert loaded["warnings"] == []
    assert loaded["tokens"] == fresh["tokens"]


def test_entries_for_other_devices_are_misses_and_compile(
        both_sizes: tuple[Path, list[dict[str, Any]]]) -> None:
    """An entry under a one-device program's key that holds a program compiled for device 1 (its
    arguments live on device 0) is a miss whether it records device 1 or claims device 0; a
    program loaded onto the wrong devices (the pre-fix load) fails its first call before running,
    so it compiles and runs afresh. Each run gives the fresh run's tokens."""
    fresh = both_sizes[1][0]
    results = both_sizes[1][5:]
    assert [r["op"] for r in results] == ["1", *FOREIGN_OPS]
    stored, _, recorded, _, claimed, _, old = results
    assert stored["tokens"] == fresh["tokens"] and stored["warnings"] == [], stored
    for run in (recorded, claimed, old):
        assert run["tokens"] == fresh["tokens"], run
    assert recorded["warnings"] and all("made for devices [1], not [0]" in w
                                        for w in recorded["warnings"]), recorded
    assert claimed["warnings"] and all("unreadable" in w for w in claimed["warnings"]), claimed
    assert old["warnings"] and all("failed to run" in w and "3 shards" in w
                                   for w in old["warnings"]), old
    assert len(recorded["warnings"]) == len(claimed["warnings"]) == len(old["warnings"]) == 2


# ---- the worker ------------------------------------------------------------------------------
class _Log(logging.Handler):
    """The step programs JAX compiles (JAX_LOG_COMPILES) and the cache's warnings."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.compiles = {p: 0 for p in PROGRAMS}
        self.warnings: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for program in PROGRAMS:
            if message.startswith(f"Compiling jit({program})"):
                self.compiles[program] += 1
        if record.name == "minivllm_jax.worker.executable_cache" and record.levelno >= logging.WARNING:
            self.warnings.append(message)


def _store_foreign(runner: Any, claim_device_0: bool) -> None:
    """Overwrite the entries of ``runner``'s step programs (arguments on device 0) with programs
    compiled for device 1."""
    import jax

    devices = jax.devices()
    for key in {k for s in runner.shapes_used for k in (s.forward, s.sampler)}:
        args = runner.empty_args(key)
        compiled = runner.programs.lower(key, jax.device_put(args, devices[1])).compile()
        runner.executable_cache.store(runner.programs.cache_key(key, args), compiled,
                                      (devices[0 if claim_device_0 else 1],))


def _old_load(self: Any, key: str, devices: Any) -> Any:
    """ExecutableCache.load before the fix: onto every device of the backend, unchecked."""
    import pickle

    from jax.experimental import serialize_executable

    file = self._file(key)
    if not file.is_file():
        return None
    _, payload, in_tree, out_tree = pickle.loads(file.read_bytes())
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)


def _worker(checkpoint: str, *ops: str) -> None:
    import jax

    from minivllm_jax import LLM, SamplingParams
    from minivllm_jax.worker import executable_cache

    assert jax.device_count() == 3
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    log = _Log()
    logging.getLogger("jax").addHandler(log)
    logging.getLogger("minivllm_jax.worker.executable_cache").addHandler(log)
    results: list[dict[str, Any]] = []
    one_device = None  # the runner of the last engine of tensor_parallel_size 1
    cache: str | bool = True  # the engines' compile_cache: $MINIVLLM_JAX_COMPILE_CACHE
    for op in ops:
        log.compiles, log.warnings = {p: 0 for p in PROGRAMS}, []
        if op.startswith("cache="):
            cache = op.removeprefix("cache=")
        elif op in ("foreign-true", "foreign-lie"):
            _store_foreign(one_device, claim_device_0=op == "foreign-lie")
        elif op == "oldload":
            executable_cache.ExecutableCache.load = _old_load
        else:
            llm = LLM(checkpoint, tensor_parallel_size=int(op), compile_cache=cache, **ENGINE)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            runner = llm.engine.runner
            assert runner.executable_cache is not None
            if op == "1":
                one_device = runner
        tokens = [o.outputs[0].token_ids for o in outs] if op.isdigit() else None
        results.append({"op": op, "tokens": tokens, "compiles": dict(log.compiles),
                        "warnings": list(log.warnings)})
    print(json.dumps(results))


if __name__ == "__main__":
    _worker(*sys.argv[1:])

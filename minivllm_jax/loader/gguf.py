"""GGUF files (llama.cpp) through the ``gguf`` package: metadata to ModelConfig, tensors dequantized
to float32 on the host one at a time and renamed to Hugging Face names, then converted like a
safetensors checkpoint (and, with a quantization, requantized one tensor at a time).

llama.cpp stores the q/k projections of ``llama``-architecture models with their rows permuted
(interleaved RoPE pairs); ``_unpermute`` restores the Hugging Face ``rotate_half`` row order. Qwen2/3
GGUFs use NeoX RoPE and are stored unpermuted. A missing ``output.weight`` means tied embeddings.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from minivllm_jax.loader.hf import params_from_hf_tensors
from minivllm_jax.model_config import ModelConfig, architecture_from_model_type

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_PERMUTED_ARCHS = ("llama", "mistral")


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``; ValueError naming the file if it is not a valid GGUF."""
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on truncated/corrupt files
        raise ValueError(f"{path}: corrupt or truncated GGUF file: {type(e).__name__}: {e}") from e


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_TOP[stem]}.{kind}" if stem in _TOP else None


def config_from_gguf(reader: Any, path: Path) -> ModelConfig:
    """Map GGUF metadata (``{arch}.*`` keys, tokenizer ids, tensor presence) to a ModelConfig."""
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    architecture = architecture_from_model_type(str(arch), source=str(path))

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata is missing {arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if vocab is None and emb is None:
        raise ValueError(f"{path}: GGUF has neither {arch}.vocab_size nor a token_embd.weight tensor")
    vocab = int(vocab) if vocab is not None else int(emb.shape[-1])
    scaling = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling = (("factor", float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))),
                   ("rope_type", str(kind)))
        if kind != "linear":
            raise ValueError(f"{path}: GGUF rope scaling type {kind!r} is not supported "
                             "(supported: 'linear', or a rope_freqs tensor)")
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = (("factors", tuple(float(x) for x in np.asarray(t.data, np.float32).ravel())),
                   ("rope_type", "freq_factors"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    window = _field(reader, f"{arch}.attention.sliding_window")
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // heads
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        attention_out_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=int(window) if window else None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved pairs -> rotate_half halves) per head."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_weights(path: Path, config: ModelConfig, dtype: Any, reader: Any = None,
                    quantization: str | None = None) -> dict[str, Any]:
    """Dequantize the tensors of the GGUF at ``path`` one at a time and return the numpy param
    tree (`params_from_hf_tensors`: with ``quantization``, each linear weight is quantized right
    after its own dequantization)."""
    from gguf.quants import dequantize

    reader = reader if reader is not None else open_gguf(path)
    arch = str(_field(reader, "general.architecture"))
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is not None:
            tensors[name] = t

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
            arr = arr.reshape(tuple(reversed([int(d) for d in t.shape])))
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize tensor {t.name!r} ({t.tensor_type.name}, "
                             f"shape {list(t.shape)}): {e}") from e
        if arch in _PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            if arr.shape[0] % (2 * heads) == 0:  # otherwise the shape check names the tensor
                arr = _unpermute(arr, heads)
        return arr

    return params_from_hf_tensors(get, config, dtype, where=lambda name: str(path),
                                  quantization=quantization)

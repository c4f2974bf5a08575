"""The GGUF loader on tiny files written here with gguf.GGUFWriter the way llama.cpp's converter
lays them out (``llama`` arch: q/k rows permuted, Llama 3 RoPE scaling as a rope_freqs tensor;
``qwen2`` arch: unpermuted, q/k/v biases; output.weight omitted for tied embeddings; MLP weights
Q8_0-quantized), compared with the torch model holding exactly the stored (dequantized) weights."""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from minivllm_jax.loader import load_model
from paged_harness import PagedRunner

gguf = pytest.importorskip("gguf")

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, arch: str, path: Path, quantize: bool) -> dict[str, torch.Tensor]:
    """Write ``model`` as a GGUF; returns its state dict as stored (MLP weights Q8_0 round-tripped)."""
    c = model.config
    stored = {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(2)
    if c.rope_parameters.get("rope_type") == "llama3":  # llama.cpp stores the scaling as rope_freqs
        d = c.head_dim
        base = 1.0 / (c.rope_parameters["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
        w.add_tensor("rope_freqs.weight", (base / model.model.rotary_emb.inv_freq.numpy()).astype(np.float32))
    for name, t in model.state_dict().items():
        arr = t.float().numpy()
        stored[name] = t.clone()
        if name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_BLOCK[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in module else c.num_key_value_heads
                arr = _llama_cpp_permute(arr, heads)
        if quantize and arr.ndim == 2 and "ffn" in gname:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(arr.shape)
            assert 0 < np.abs(deq - arr).max() < 0.01
            stored[name] = torch.from_numpy(np.ascontiguousarray(deq))
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("family,arch", [("llama3", "llama"), ("qwen2", "qwen2")])
def test_tiny_gguf_matches_source_model(family: str, arch: str, tiny_checkpoint, tmp_path) -> None:
    _, hf = tiny_checkpoint(family)
    path = tmp_path / f"tiny-{arch}.gguf"
    stored = _write_gguf(hf, arch, path, quantize=True)
    hf = type(hf)(hf.config).eval()
    hf.load_state_dict(stored)
    loaded = load_model(path, dtype="float32", use_cache=False)
    assert loaded.tokenizer is None
    cfg = loaded.config
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.attention_bias == (arch == "qwen2")
    assert (cfg.rope_scaling is not None) == (arch == "llama")  # from the rope_freqs tensor
    ids = [5, 17, 99, 3, 42, 250, 8, 8, 61]
    ours = PagedRunner(cfg, loaded.params, block_size=4).run([(0, ids)], pad_to=16)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)


def test_gguf_int8_quantizes_each_tensor_after_its_dequantization(tiny_checkpoint, tmp_path,
                                                                   monkeypatch) -> None:
    """``quantization="int8"`` on a GGUF (Q8_0 MLP, permuted q/k): each linear tensor is
    quantized, as one [out, in] matrix, right after its own dequantization (no float copy of
    the model), into exactly the int8 tree of quantizing the float load."""
    import minivllm_jax.loader.hf as hf_loader
    from minivllm_jax.models.quantization import quantize_params

    _, hf = tiny_checkpoint("llama3")  # untied: the LM head is quantized too
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(hf, "llama", path, quantize=True)
    events = []
    real_dequantize, real_quantize = gguf.quants.dequantize, hf_loader.quantize_int8
    monkeypatch.setattr(gguf.quants, "dequantize",
                        lambda *a: events.append("dequantize") or real_dequantize(*a))
    monkeypatch.setattr(hf_loader, "quantize_int8",
                        lambda w: events.append(("quantize", w.shape)) or real_quantize(w))
    quant = load_model(path, dtype="float32", use_cache=False, quantization="int8")
    monkeypatch.setattr(hf_loader, "quantize_int8", real_quantize)
    floats = load_model(path, dtype="float32", use_cache=False)
    quantized = [i for i, e in enumerate(events) if e != "dequantize"]
    assert len(quantized) == 7 * quant.config.num_hidden_layers + 1
    assert all(events[i - 1] == "dequantize" and len(events[i][1]) == 2 for i in quantized)
    want = quantize_params(jax.tree.map(np.asarray, floats.params), "int8")
    got = jax.tree.map(np.asarray, quant.params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)

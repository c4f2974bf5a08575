"""scripts/tpu_estimates.py's analytic roofline, without compiling: its per-chip byte counts of
bf16 and int8 weights and of bf16 and fp8 K/V in the TPU cache layout, checked against counts
made here by hand, and its workload selection."""
from __future__ import annotations

import pytest

import tpu_estimates as te

GB = 1e9


@pytest.fixture(scope="module")
def llama() -> dict:
    return te.model_config("llama-3.1-8b")


def test_bf16_llama_tp8_bytes(llama):
    """The docs' figures: 1.88 GB of weights and 8.59 GB of K/V a v5e-8 chip at 256 x 2048."""
    w = te.Workload("Llama-3.1-8B", "llama-3.1-8b", "v5e:2x4", 8, 256, 2048)
    roof = te.rooflines(w, llama, (819e9, 197e12))["decode"]
    share = te.workload_share(llama, w)
    # one kv head a chip: K and V, 128 lanes, 2 bytes
    assert share.kv_token_bytes == 2 * 128 * 2
    assert roof["kv_bytes"] == 32 * 512 * (256 * 2048 + 256)
    layer = 2 * (4096 * 128 * (2 * 4 + 2 * 1) + 3 * 4096 * 14336 // 8 + 2 * 4096)
    assert share.layer_bytes == layer
    assert roof["weight_bytes"] == 32 * layer + 2 * (4096 + 128256 // 8 * 4096)
    assert round(roof["weight_bytes"] / GB, 2) == 1.88 and round(roof["kv_bytes"] / GB, 2) == 8.59


def test_int8_fp8_llama_bytes(llama):
    """int8: 1 byte a weight, 4 a scale per output channel the chip holds (o and down: all
    4096), norms 2; the untied head int8 too. fp8 K/V: 1 byte a value, each shard's combined
    heads padded to 4 (TP 8: K, V and 2 zero heads, as many bytes as bf16)."""
    q_out, kv_out, inter = 4096, 1024, 14336
    tp1 = te.chip_share(llama, 1, "int8", "fp8")
    proj = 4096 * (q_out + 2 * kv_out) + q_out * 4096 + 3 * 4096 * inter
    assert tp1.layer_weights == proj + 2 * 4096
    scales = q_out + 2 * kv_out + 4096 + 2 * inter + 4096  # q, k, v, o, gate, up, down
    assert tp1.layer_bytes == proj + 4 * scales + 2 * 2 * 4096
    assert tp1.head_bytes == 2 * 4096 + 128256 * 4096 + 4 * 128256
    assert tp1.kv_token_bytes == 2 * 8 * 128  # 16 combined heads: 4 whole words of 4, no padding
    # the chip also holds the bf16 embedding table, which the roofline does not read whole: 7.97
    # GiB in all, what `minivllm-jax compile --quantization int8` reports for this model
    held = 32 * tp1.layer_bytes + tp1.head_bytes + 2 * 128256 * 4096
    assert round(held / 2**30, 2) == 7.97

    tp8 = te.chip_share(llama, 8, "int8", "fp8")
    assert tp8.kv_token_bytes == 4 * 128 == te.chip_share(llama, 8).kv_token_bytes
    assert tp8.layer_bytes == proj // 8 + 4 * ((q_out + 2 * kv_out + 2 * inter) // 8 + 2 * 4096) \
        + 2 * 2 * 4096
    assert tp8.head_bytes == 2 * 4096 + 128256 // 8 * (4096 + 4)
    # flops count weights, not bytes: the same for bf16 and int8
    assert tp8.layer_weights == te.chip_share(llama, 8).layer_weights


def test_fp8_pads_odd_heads_and_tied_head_stays_bf16():
    """SmolLM2's 3 kv heads: 6 combined heads, 2 words of 4 in fp8 (8 heads), 3 words of 2 in
    bf16; its tied head is the bf16 embedding under int8 too."""
    cfg = te.model_config("smollm2-135m")
    assert te.chip_share(cfg, 1).kv_token_bytes == 6 * 128 * 2
    int8 = te.chip_share(cfg, 1, "int8", "fp8")
    assert int8.kv_token_bytes == 8 * 128
    assert int8.head_bytes == te.chip_share(cfg, 1).head_bytes == 2 * (576 + 49152 * 576)


def test_variants_and_workloads():
    assert te.variant(te.QUICK[0]) == "bf16" and te.variant(te.QUICK[1]) == "int8+fp8"
    assert te.variant({"quantization": "int8", "kv_cache_dtype": "auto"}) == "int8"
    llama = te.model_config("llama-3.1-8b")
    for w in te.WORKLOADS:
        if w.tp == 1 and w.quantization == "int8":  # one v5e chip: weights and K/V under 90 %
            share = te.workload_share(llama, w)
            blocks = w.batch * w.context // te.BLOCK_SIZE + 1
            held = (32 * share.layer_bytes + share.head_bytes + 2 * 128256 * 4096
                    + 32 * share.kv_token_bytes * blocks * te.BLOCK_SIZE)
            assert held < 0.9 * 16 * 2**30
    with pytest.raises(ValueError):
        te.chip_share(llama, 1, "int4")

"""The paged KV cache as the model writes it: after a prefill every layer's K (post-RoPE) and V sit
at the sequence's slots of that layer and equal transformers' own past_key_values (an fp8 cache:
their float8 e4m3 casts after the Hadamard rotation, truth: scipy's Hadamard matrix, and the
logits stay near the float cache's); padding rows write nothing; and the jitted step updates the
donated cache in place (no cache-sized temporary)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from minivllm_jax.models.attention import AttentionMetadata
from minivllm_jax.loader import load_model
from minivllm_jax.kv_cache_sizing import init_kv_cache
from minivllm_jax.models.llama import LlamaForCausalLM
from minivllm_jax.models.rope import rope_table
from paged_harness import PagedRunner


def test_cache_contents_match_transformers_past_key_values(tiny_checkpoint, tmp_path) -> None:
    ckpt, hf = tiny_checkpoint("qwen3")  # q/k norm + RoPE both precede the cache write
    loaded = load_model(ckpt, dtype="float32", use_cache=False)
    cfg = loaded.config
    ids = [5, 17, 99, 3, 42, 250, 8]
    runner = PagedRunner(cfg, loaded.params, block_size=4, num_blocks=8)
    runner.run([(0, ids)], pad_to=16)  # 7 real rows + 9 padding rows (slot -1)
    cache = np.asarray(runner.cache)
    blocks = runner.tables[0]
    with torch.no_grad():
        pkv = hf(torch.tensor([ids]), use_cache=True).past_key_values
    written = np.zeros(cache.shape[1:3], bool)
    for p in range(len(ids)):
        written[blocks[p // 4], p % 4] = True
    for layer in range(cfg.num_hidden_layers):
        keys = pkv.layers[layer].keys[0].numpy()     # [KVH, T, D]
        values = pkv.layers[layer].values[0].numpy()
        for p in range(len(ids)):
            row = cache[layer, blocks[p // 4], p % 4]  # [2*KVH, D], K/V interleaved per head
            np.testing.assert_allclose(row[0::2], keys[:, p], atol=1e-5)
            np.testing.assert_allclose(row[1::2], values[:, p], atol=1e-5)
        assert not cache[layer][~written].any(), "padding rows or other slots were written"


def test_fp8_cache_holds_rotated_k_and_v(tiny_checkpoint) -> None:
    """An fp8 cache holds each head's ``k @ R`` and ``v @ R`` (R = Hadamard / sqrt(D)) rounded to
    e4m3: layer 0's within e4m3's half step of transformers' K/V rotated (|x| / 16, or 2**-10 in the
    subnormal range); the same rows unrotated are not within it (the rotation is really there);
    and the step's logits stay within a few % of the float32 cache's (q and the output rotated
    consistently; a mismatch would move them by their whole spread)."""
    from scipy.linalg import hadamard

    from minivllm_jax.models.attention import kv_rotation

    ckpt, hf = tiny_checkpoint("qwen3")
    loaded = load_model(ckpt, dtype="float32", use_cache=False)
    cfg = loaded.config
    rot = hadamard(cfg.head_dim) / np.sqrt(cfg.head_dim)
    np.testing.assert_allclose(kv_rotation(cfg.head_dim), rot, rtol=0, atol=1e-7)
    odd = kv_rotation(80).astype(np.float64)
    np.testing.assert_allclose(odd @ odd.T, np.eye(80), atol=1e-6)  # not a power of two
    ids = [5, 17, 99, 3, 42, 250, 8]
    want = PagedRunner(cfg, loaded.params, block_size=4, num_blocks=8).run([(0, ids)], pad_to=8)[0]
    runner = PagedRunner(cfg, loaded.params, block_size=4, num_blocks=8,
                         cache_dtype=jnp.float8_e4m3fn)
    got = runner.run([(0, ids)], pad_to=8)[0]
    err = np.abs(got - want)  # e4m3's ~3 % per value: a few % of the logits' spread, not ~100 %
    assert err.mean() < 0.05 * want.std() and err.max() < 0.1 * np.abs(want).max(), err.max()
    cache = np.asarray(runner.cache.astype(jnp.float32), np.float64)
    with torch.no_grad():
        pkv = hf(torch.tensor([ids]), use_cache=True).past_key_values
    blocks = runner.tables[0]
    for name, heads in (("keys", slice(0, None, 2)), ("values", slice(1, None, 2))):
        # layer 0 only: later layers' K/V follow the fp8 cache's outputs, not transformers'
        truth = getattr(pkv.layers[0], name)[0].numpy().astype(np.float64)  # [KVH, T, D]
        rows = np.stack([cache[0, blocks[p // 4], p % 4][heads] for p in range(len(ids))], 1)
        rotated = truth @ rot
        half_step = np.maximum(np.abs(rotated) / 16, 2.0 ** -10) + 1e-5
        assert (np.abs(rows - rotated) <= half_step).all(), name
        assert not (np.abs(rows - truth) <= np.maximum(np.abs(truth) / 16, 2.0 ** -10)).all()


def test_step_updates_donated_cache_in_place(tiny_checkpoint) -> None:
    ckpt, _ = tiny_checkpoint("llama3")
    loaded = load_model(ckpt, dtype="float32", use_cache=False)
    model = LlamaForCausalLM(loaded.config)
    cache = init_kv_cache(loaded.config, 4096, 16, jnp.float32)  # 32 MiB over 2 layers
    t = 16
    md = AttentionMetadata(jnp.full((t,), -1, jnp.int32), jnp.zeros((4, 8), jnp.int32),
                           jnp.zeros((4,), jnp.int32), jnp.zeros((5,), jnp.int32),
                           jnp.zeros((1,), jnp.int32))
    rope = jnp.asarray(rope_table(loaded.config, t))
    step = jax.jit(lambda p, c, i, md: model.apply({"params": p}, i, i, c, md, rope), donate_argnums=(1,))
    compiled = step.lower(loaded.params, cache, jnp.zeros((t,), jnp.int32), md).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= cache.nbytes          # the output cache reuses the input
    assert mem.temp_size_in_bytes < cache.nbytes // 8       # no layer-stack copy in between

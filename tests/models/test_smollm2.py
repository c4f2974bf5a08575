"""The embedded SmolLM2-135M-Instruct GGUF: our loader + paged model against transformers loading
the same file (float32). Prefill logits at every position, 16-token greedy decode through the paged
path, and a mixed prefill+decode batch against the same sequences run separately."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_helpers import hf_logits
from paged_harness import PagedRunner

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers."]
BUCKET = 64  # one compiled token-batch shape for every prefill in this file
LOGITS_ATOL = 2e-3  # measured max |diff| is ~1e-4 against logits of magnitude ~40


def _prompt(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(i) for i in ids]


@pytest.fixture(scope="module")
def hf_prefill(smollm2, smollm2_hf) -> dict[str, np.ndarray]:
    """transformers' prefill logits of each question's prompt, computed once for both forms of
    ``project``."""
    return {q: hf_logits(smollm2_hf, _prompt(smollm2.tokenizer, q)) for q in QUESTIONS}


def test_config_and_tokenizer(smollm2) -> None:
    cfg = smollm2.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and "lm_head" not in smollm2.params
    assert smollm2.params["layers"]["self_attn"]["q_proj"]["weight"].shape == (30, 576, 576)
    assert smollm2.tokenizer.chat_template
    assert smollm2.tokenizer.eos_token_id in cfg.eos_token_ids
    assert (smollm2.tokenizer.bos_token, smollm2.tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")


def _gguf_ints(path: str, keys: set[str]) -> dict[str, int]:
    """The integer metadata values under ``keys`` of a GGUF file (v2/v3: header, then key/value
    pairs), read from the format itself: gguf-py's GGUFReader, which the loader uses, parses
    the whole file (seconds for SmolLM2's vocabulary)."""
    import struct

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:
        data = f.read(16 << 20)  # the header and metadata (SmolLM2's: ~2 MB) come first
    magic, _, _, num_kv = struct.unpack_from("<4sIQQ", data, 0)
    assert magic == b"GGUF"
    off, out = 24, {}

    def skip_string(off: int) -> int:
        return off + 8 + struct.unpack_from("<Q", data, off)[0]

    for _ in range(num_kv):
        key_end = skip_string(off)
        key = data[off + 8:key_end].decode()
        (vtype,), off = struct.unpack_from("<I", data, key_end), key_end + 4
        if key in keys:
            out[key] = struct.unpack_from("<" + scalar[vtype], data, off)[0]
        if vtype == 8:                                   # a string
            off = skip_string(off)
        elif vtype == 9:                                 # an array: item type, count, items
            itype, count = struct.unpack_from("<IQ", data, off)
            off += 12
            if itype == 8:
                for _ in range(count):
                    off = skip_string(off)
            else:
                off += count * struct.calcsize(scalar[itype])
        else:
            off += struct.calcsize(scalar[vtype])
    return out


def test_gguf_special_tokens_follow_the_metadata(smollm2) -> None:
    """A tokenizer converted with other special ids (transformers 5.17 makes ``<|im_start|>`` the
    eos) is set to the GGUF file's ``tokenizer.ggml.{bos,eos}_token_id``."""
    import copy

    from minivllm_jax.loader import _gguf_special_tokens

    keys = [f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos")]
    fields = _gguf_ints(smollm2.source, set(keys))
    meta = [fields[k] for k in keys]
    tok = copy.deepcopy(smollm2.tokenizer)
    tok.bos_token, tok.eos_token = "<|im_end|>", "<|im_start|>"
    assert [tok.bos_token_id, tok.eos_token_id] == meta[::-1]
    _gguf_special_tokens(tok, smollm2.config)
    assert [tok.bos_token_id, tok.eos_token_id] == meta
    assert tok.decode([meta[1]]) == tok.eos_token


def test_cached_gguf_tokenizer_gets_the_metadata_ids(smollm2, tmp_path) -> None:
    """A param-cache entry written with another eos (by an older loader under transformers 5.17)
    loads with the file's. The entry, under the GGUF file's key, holds SmolLM2's config shrunk
    to one narrow layer (its token ids kept) and zero params of that shape: the mend is the
    tokenizer's, whatever the params, and 540 MB of float32 params would take seconds to write."""
    import copy
    import dataclasses
    from pathlib import Path

    import jax
    import jax.numpy as jnp

    from minivllm_jax.loader import cache as param_cache
    from minivllm_jax.loader import load_model
    from minivllm_jax.models.llama import param_shapes

    small = dataclasses.replace(smollm2.config, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=32)
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), param_shapes(small))
    tok = copy.deepcopy(smollm2.tokenizer)
    tok.eos_token = "<|im_start|>"
    key = param_cache.cache_key([Path(smollm2.source)], jnp.float32)
    param_cache.save_entry(tmp_path, key, param_cache.CacheEntry(small, params, tok))
    assert param_cache.load_entry(tmp_path, key, jnp.float32).tokenizer.eos_token == "<|im_start|>"
    hit = load_model(smollm2.source, dtype="float32", cache_dir=str(tmp_path))
    assert hit.from_cache and hit.config == small
    assert (hit.tokenizer.eos_token, hit.tokenizer.eos_token_id) == ("<|im_end|>", smollm2.config.eos_token_ids[0])


@pytest.mark.parametrize("feature_major_rows", [0, BUCKET], ids=["x@W^T", "W@x^T"])
def test_prefill_logits_match_transformers(smollm2, hf_prefill, feature_major_rows: int) -> None:
    """Both forms of ``project`` (models/llama.py) against transformers on the same GGUF."""
    runner = PagedRunner(smollm2.config, smollm2.params, block_size=16, num_blocks=64,
                         feature_major_rows=feature_major_rows)
    worst = 0.0
    for seq, q in enumerate(QUESTIONS):
        ids = _prompt(smollm2.tokenizer, q)
        ours = runner.run([(seq, ids)], pad_to=BUCKET)[0]
        ref = hf_prefill[q]
        assert ours.shape == ref.shape == (len(ids), smollm2.config.vocab_size)
        worst = max(worst, float(np.abs(ours - ref).max()))
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    print(f"SmolLM2 prefill logits max |ours - transformers| = {worst:.3g}")
    assert worst < LOGITS_ATOL


def test_greedy_decode_matches_transformers_generate(smollm2, smollm2_hf) -> None:
    ids = _prompt(smollm2.tokenizer, QUESTIONS[0])
    runner = PagedRunner(smollm2.config, smollm2.params, block_size=16, num_blocks=64)
    ours = runner.greedy(0, ids, 16, pad_to=8, prefill_pad=BUCKET)
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([ids]), attention_mask=torch.ones_like(torch.tensor([ids])),
                                  max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=2)
    assert ours == ref[0, len(ids):].tolist()
    assert "Paris" in smollm2.tokenizer.decode(ours)


def test_mixed_prefill_and_decode_batch_equals_separate_runs(smollm2) -> None:
    a = _prompt(smollm2.tokenizer, QUESTIONS[1])
    b = _prompt(smollm2.tokenizer, QUESTIONS[2])
    a_next = 1234
    alone = PagedRunner(smollm2.config, smollm2.params, block_size=16, num_blocks=64)
    alone.run([(0, a)], pad_to=BUCKET)
    a_decode = alone.run([(0, [a_next])], pad_to=BUCKET)[0]
    b_prefill = alone.run([(1, b)], pad_to=BUCKET)[0]

    # Same work with b's prompt split in two chunks, the second chunk batched with a's decode;
    # the runner hands out blocks in a different order, so the block tables differ too.
    mixed = PagedRunner(smollm2.config, smollm2.params, block_size=16, num_blocks=64)
    split = len(b) // 2 + 3
    first = mixed.run([(1, b[:split]), (0, a)], pad_to=BUCKET)[0]
    dec, rest = mixed.run([(0, [a_next]), (1, b[split:])], pad_to=BUCKET)
    np.testing.assert_allclose(dec, a_decode, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([first, rest]), b_prefill, atol=1e-4, rtol=1e-5)

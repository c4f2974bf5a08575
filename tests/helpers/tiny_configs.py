"""Tiny random-model configurations for the four supported families (transformers config classes),
and a byte-level tokenizer for tiny models (`save_byte_tokenizer`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

# family -> (config class name, extra config fields)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 16},
                                   rope_theta=500000.0, tie_word_embeddings=False)),
    "llama2-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                          attention_bias=True, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=7, head_dim=16)),
}


def small_model_config(**overrides: Any) -> Any:
    """A small `ModelConfig` for tests of shapes and param trees (no checkpoint): a 2-layer
    Llama, 4 query / 2 kv heads of 16, untied, with `overrides`."""
    from minivllm_jax.model_config import ModelConfig

    fields = dict(architecture="LlamaForCausalLM", vocab_size=250, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                  rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                  attention_bias=False, attention_out_bias=False, qk_norm=False,
                  sliding_window=None, bos_token_id=None, eos_token_ids=(0,))
    return ModelConfig(**{**fields, **overrides})


def save_byte_tokenizer(out: str | Path) -> None:
    """A byte-level BPE tokenizer in `out`: ids 0 unk, 1 bos, 2 eos, then the 256 bytes (259
    tokens; a tiny model of vocab_size 259 can write any text, JSON included)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(out)

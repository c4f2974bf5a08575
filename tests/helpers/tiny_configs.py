"""Tiny random-model configurations for the four supported families (transformers config classes)."""
from __future__ import annotations

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

"""Rotary position embeddings in the Hugging Face ``rotate_half`` (GPT-NeoX) convention.

Dimension ``j < D/2`` of a head rotates with dimension ``j + D/2`` at frequency ``inv_freq[j]``.
Frequencies and angles are computed in float32 whatever the model dtype.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """float32 ``[head_dim // 2]`` inverse frequencies, with the config's RoPE scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    scaling = dict(config.rope_scaling or ())
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":  # llama.cpp's rope_freqs tensor (Llama 3.x GGUFs)
        inv_freq = inv_freq / np.asarray(scaling["factors"], np.float32)
    elif kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_table(config: ModelConfig, num_positions: int) -> np.ndarray:
    """float32 ``[num_positions, 2, head_dim]``: ``cos`` and ``sin`` of every position below
    ``num_positions`` (vLLM's cos/sin cache), for the runner to keep on the device and the model
    to index. The angles are ``position * inv_freq`` rounded to float32, as transformers forms
    them; their cos/sin are then correctly rounded. Indexed, not computed in the step: XLA would
    fuse the transcendentals into every layer's rotation and recompute them per head and layer."""
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * rope_inv_freq(config)[None, :]
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    return np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [T, H, D]`` by the angles in ``cos, sin [T, D]``; returns x's dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin

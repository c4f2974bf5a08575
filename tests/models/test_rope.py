"""The runner's RoPE table (``rope.rope_table``) against the in-graph cos/sin, and the compiled
engine step computing no transcendentals (they would be recomputed per head and per layer)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax.loader import load_model
from minivllm_jax.models.rope import rope_inv_freq, rope_table


def in_graph_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos/sin computed in the jitted graph from float32 angles, as transformers' rotary embedding
    forms them (what the step computed before it indexed a table)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


@pytest.mark.parametrize("family", ["llama3", "llama2-linear", "qwen2"])
def test_rope_table_rows_equal_in_graph_cos_sin(family: str, tiny_checkpoint, tmp_path) -> None:
    config = load_model(tiny_checkpoint(family)[0], dtype="float32", use_cache=False).config
    inv_freq = rope_inv_freq(config)
    table = rope_table(config, 4096)
    assert table.shape == (4096, 2, config.head_dim) and table.dtype == np.float32
    positions = np.array([0, 1, 2, 17, 511, 2047, 4095], np.int32)
    cos, sin = jax.jit(lambda p: in_graph_cos_sin(p, inv_freq))(jnp.asarray(positions))
    np.testing.assert_allclose(table[positions, 0], np.asarray(cos), atol=2e-6)
    np.testing.assert_allclose(table[positions, 1], np.asarray(sin), atol=2e-6)


def test_engine_step_indexes_the_table(tiny_checkpoint) -> None:
    from minivllm_jax import LLM
    from minivllm_jax.step_layout import StepShape

    loaded = load_model(tiny_checkpoint("llama3")[0], dtype="float32", use_cache=False)
    r = LLM(loaded, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32).engine.runner
    assert r.rope.shape == (64, 2, loaded.config.head_dim)
    key = StepShape(32, 4, r.config.max_num_seqs, r.config.max_blocks_per_seq).forward
    text = r.programs.lower(key, r.empty_args(key)).compile().as_text()
    assert " cosine(" not in text and " sine(" not in text

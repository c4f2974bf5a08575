"""The switched layer layout's compiled step (models/llama.py): per-layer branches around the
projections only, so the KV cache never passes through a ``lax.switch`` (a switch around whole
layers made XLA copy the cache in and out of every layer). Its numerics are checked against
transformers in tests/engine/test_llm.py and test_families.py."""
from __future__ import annotations

import re
from typing import Any

import pytest


def _switch_results(text: str, num_layers: int) -> list[str]:
    """The result types of the compiled program's conditionals with one branch per layer."""
    out = []
    for line in text.splitlines():
        m = re.search(r"= (.*?) conditional\(.*branch_computations=\{([^}]*)\}", line)
        if m and len(m.group(2).split(",")) == num_layers:
            out.append(m.group(1))
    return out


@pytest.mark.parametrize("layout", ["stacked", "switched"])
def test_switched_branches_leave_the_kv_cache_out(layout: str, loaded_model: Any) -> None:
    from minivllm_jax import LLM
    from minivllm_jax.step_layout import StepShape

    r = LLM(loaded_model, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
            num_kv_blocks=16, layer_layout=layout).engine.runner
    layers = loaded_model.config.num_hidden_layers
    assert layers == 30 and r.plan.model.layer_layout == layout  # no other conditional has 30 branches
    key = StepShape(32, 4, r.config.max_num_seqs, r.config.max_blocks_per_seq).forward
    text = r.programs.lower(key, r.empty_args(key)).compile().as_text()
    results = _switch_results(text, layers)
    if layout == "stacked":
        assert results == []
        return
    cache = "f32[" + ",".join(map(str, r.kv_cache.shape)) + "]"
    assert cache in text  # the step does carry the cache, under this spelling
    assert len(results) >= 2  # the branches before and after attention
    assert not any(cache in types for types in results), results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unstack_layers_gives_each_layer_its_slices(dtype: str) -> None:
    """``unstack_layers`` (the per-layer layouts' params): layer i's leaves are the stacked
    leaves' i-th slices, with their dtype; the non-layer params are passed through; the slices
    (on CPU, views of the stacked buffers) stay valid once the stacked tree is dropped."""
    import gc

    import jax.numpy as jnp
    import numpy as np

    from minivllm_jax.models.llama import unstack_layers

    rng = np.random.default_rng(0)
    stacked = {"a": rng.standard_normal((5, 3, 4)), "b": {"c": rng.standard_normal((5, 7))}}
    layers = {"a": jnp.asarray(stacked["a"], dtype), "b": {"c": jnp.asarray(stacked["b"]["c"], dtype)}}
    params = {"embed": jnp.ones((2, 3), dtype), "layers": layers}
    out = unstack_layers(params, 5)
    assert sorted(out) == ["embed"] + [f"layers_{i}" for i in range(5)]
    assert out["embed"] is params["embed"]
    for i in range(5):
        a, c = out[f"layers_{i}"]["a"], out[f"layers_{i}"]["b"]["c"]
        assert (a.shape, c.shape, a.dtype, c.dtype) == ((3, 4), (7,), jnp.dtype(dtype), jnp.dtype(dtype))
        np.testing.assert_array_equal(np.asarray(a, np.float64),
                                      np.asarray(jnp.asarray(stacked["a"][i], dtype), np.float64))
        np.testing.assert_array_equal(np.asarray(c, np.float64),
                                      np.asarray(jnp.asarray(stacked["b"]["c"][i], dtype), np.float64))
        assert float(jnp.sum(a * 2)) == float(jnp.sum(params["layers"]["a"][i] * 2))  # usable in jax ops
    expected = [np.asarray(params["layers"]["a"][i], np.float64) for i in range(5)]
    del params, layers
    gc.collect()
    junk = [jnp.full((5, 3, 4), 7.0, dtype) + i for i in range(8)]  # reuse freed memory, if any
    for i in range(5):
        np.testing.assert_array_equal(np.asarray(out[f"layers_{i}"]["a"], np.float64), expected[i])
    del junk

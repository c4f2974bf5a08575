"""The switched layer layout's compiled step (models/llama.py): per-layer branches around the
projections only, so the KV cache never passes through a ``lax.switch`` (a switch around whole
layers made XLA copy the cache in and out of every layer). Its numerics are checked against
transformers in test_llm.py and tests/model/test_families.py."""
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
    from minivllm_jax.input_batch import StepShape

    r = LLM(loaded_model, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
            num_kv_blocks=16, layer_layout=layout).engine.runner
    layers = loaded_model.config.num_hidden_layers
    assert layers == 30 and r.layer_layout == layout  # no other conditional has 30 branches
    text = r.lower(StepShape(32, 4, r.config.max_num_seqs, r.config.max_blocks_per_seq)
                   ).compile().as_text()
    results = _switch_results(text, layers)
    if layout == "stacked":
        assert results == []
        return
    cache = "f32[" + ",".join(map(str, r.kv_cache.shape)) + "]"
    assert cache in text  # the step does carry the cache, under this spelling
    assert len(results) >= 2  # the branches before and after attention
    assert not any(cache in types for types in results), results

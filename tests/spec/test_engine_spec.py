"""The one-way build (minivllm_jax/engine_spec.py): its stages run from a model config alone (no
weights, any platform's plan), the KV sizing stage turns plain numbers into blocks by its formula,
and an engine's runner and scheduler are built from the one spec it keeps.

Truth: the sizing rules written out here by hand (the budget, the profiled device's free bytes
over the bytes of a block), and the engine's own parts compared with the spec."""
from __future__ import annotations

import pytest

import bench_common as bc
from minivllm_jax.config import EngineConfig
from minivllm_jax.engine_spec import draft_spec, sized_spec
from minivllm_jax.model_config import ModelConfig


def _model() -> ModelConfig:
    return ModelConfig.from_hf_config(bc.MODEL_SHAPES["smollm2-135m"])  # no weights


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"], ids=["on-cpu", "on-cuda", "on-tpu"])
def test_draft_needs_only_a_config(platform: str) -> None:
    """Every platform's draft from a config alone: sizes resolved (the model's limit, 2048-token
    steps), the platform's backend, a cache of one full request (the profile's)."""
    draft = draft_spec(_model(), EngineConfig(max_num_seqs=8), "bfloat16", platform)
    assert draft.config.max_model_len == 8192 and draft.config.max_num_batched_tokens == 2048
    assert draft.plan.platform == platform and draft.mesh is None
    assert draft.plan.backend.name == {"cpu": "xla", "gpu": "pallas", "tpu": "pallas-tpu"}[platform]
    assert draft.num_blocks == 8192 // 16 + 1
    # K and V of 3 heads x 64 over 30 layers, 16 tokens a block, in the plan's cache dtype; the
    # TPU layout pads each head's 64 lanes to 128
    itemsize = 4 if platform == "cpu" else 2
    lanes = 128 if platform == "tpu" else 64
    assert draft.bytes_per_block == 30 * 16 * 2 * 3 * lanes * itemsize


def test_profiled_device_sizes_by_its_free_bytes() -> None:
    """A GPU's cache: what gpu_memory_utilization of the limit leaves after the profiled peak
    (weights and a one-request cache included) and the penalty buffers, in blocks, plus the
    profile's own blocks; too little for one request raises, unless the length was defaulted
    (then the length is fitted to the cache)."""
    config = EngineConfig(max_num_seqs=8, max_model_len=4096, gpu_memory_utilization=0.5)
    draft = draft_spec(_model(), config, "bfloat16", "gpu")
    per_block, probe = draft.bytes_per_block, 4096 // 16 + 1
    limit, peak = 8 << 30, 1 << 30
    reserved = 5 * 8 * 49152  # int32 counts and bool masks, [max_num_seqs, vocab]
    spec = sized_spec(draft, bytes_limit=limit, peak_bytes=peak)
    assert spec.num_blocks == (limit // 2 - peak - reserved) // per_block + probe
    assert spec.config == draft.config and spec.plan == draft.plan
    # the Triton kernel's int32 offsets: the flat all-layer cache stays under 2**31 elements
    huge = sized_spec(draft, bytes_limit=80 << 40, peak_bytes=peak)
    assert huge.num_blocks == (2**31 - 1) // (per_block // 2)
    with pytest.raises(ValueError, match="not enough device memory"):
        sized_spec(draft, bytes_limit=limit, peak_bytes=limit // 2)  # nothing left over
    # a defaulted length (8192: a 513-block profile) on a device that holds 100 blocks in all
    defaulted = draft_spec(_model(), EngineConfig(max_num_seqs=8, gpu_memory_utilization=0.5),
                           "bfloat16", "gpu")
    short = (8192 // 16 + 1 - 100) * defaulted.bytes_per_block
    small = sized_spec(defaulted, bytes_limit=limit, peak_bytes=limit // 2 - reserved + short,
                       fit_length=True)
    assert small.num_blocks == 100 and small.config.max_model_len == 99 * 16
    assert small.scheduler_config().max_model_len == 99 * 16


def test_cpu_budget_and_given_blocks() -> None:
    """The CPU's byte budget holds max_num_seqs full requests when it can (plus the null block);
    a given num_kv_blocks stands; the Triton backend's int32 bound refuses too many blocks."""
    draft = draft_spec(_model(), EngineConfig(max_num_seqs=4, max_model_len=256,
                                              cpu_kv_cache_bytes=1 << 30), "float32", "cpu")
    assert sized_spec(draft).num_blocks == 4 * 256 // 16 + 1
    given = draft_spec(_model(), EngineConfig(max_model_len=256, num_kv_blocks=50), "float32", "cpu")
    assert sized_spec(given).num_blocks == 50
    elements = 30 * 16 * 2 * 3 * 64  # one block's elements over all layers
    too_many = EngineConfig(max_model_len=256, num_kv_blocks=2**31 // elements + 1,
                            attention_backend="pallas")
    with pytest.raises(ValueError, match="num_kv_blocks"):
        sized_spec(draft_spec(_model(), too_many, "float32", "cpu"))


def test_engine_parts_are_built_from_its_spec(tiny_model) -> None:
    """The runner and the scheduler of an engine read the one spec the engine keeps."""
    from minivllm_jax import LLM

    llm = LLM(tiny_model, max_num_seqs=4, max_model_len=64, num_kv_blocks=20)
    engine = llm.engine
    spec = engine.spec
    assert engine.runner.spec is spec and engine.config is spec.config and engine.plan is spec.plan
    assert engine.scheduler.config == spec.scheduler_config()
    assert engine.runner.kv_cache.shape[1] == spec.num_blocks == 20
    assert engine.runner.batch.token_ids.shape == (4, 64)
    assert spec.model_config == tiny_model.config  # one device: the model as loaded

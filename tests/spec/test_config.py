"""EngineConfig validation: each bad value raises, naming the field; defaults resolve per model."""
from __future__ import annotations

import pytest

from minivllm_jax.config import EngineConfig


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_seqs=2.5), TypeError, "max_num_seqs"),
    (dict(block_size=12), ValueError, "block_size"),
    (dict(num_kv_blocks=1), ValueError, "num_kv_blocks"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=0.0), ValueError, "gpu_memory_utilization"),
    (dict(attention_backend="triton"), ValueError, "attention_backend"),
    (dict(max_num_seqs=32, max_num_batched_tokens=16), ValueError, "max_num_batched_tokens"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=512), ValueError,
     "max_num_batched_tokens"),
    (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(dtype=None), TypeError, "dtype"),
    (dict(layer_layout=False), TypeError, "layer_layout"),
    (dict(layer_layout="scan"), ValueError, "layer_layout"),
    (dict(layer_layout="unrolled"), ValueError, "layer_layout"),
    (dict(cpu_kv_cache_bytes=0), ValueError, "cpu_kv_cache_bytes"),
    (dict(async_scheduling="yes"), TypeError, "async_scheduling"),
    (dict(layer_layout="switched", tensor_parallel_size=2), ValueError, "layer_layout"),
    (dict(scheduling_policy="lifo"), ValueError, "scheduling_policy"),
])
def test_invalid_values_name_the_field(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field):
        EngineConfig(**kwargs)


def test_resolve_defaults() -> None:
    cfg = EngineConfig(max_num_seqs=4).resolve(max_position_embeddings=1000)
    assert cfg.max_model_len == 1000 and cfg.max_num_batched_tokens >= 4
    assert cfg.max_blocks_per_seq == -(-1000 // 16)
    no_chunk = EngineConfig(enable_chunked_prefill=False, max_model_len=3000).resolve(8192)
    assert no_chunk.max_num_batched_tokens >= 3000
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=4096).resolve(max_position_embeddings=2048)


def test_fit_kv_cache_lowers_max_model_len_to_whole_blocks() -> None:
    cfg = EngineConfig(block_size=16).resolve(max_position_embeddings=1000)
    assert cfg.fit_kv_cache(num_blocks=64 + 1) is cfg  # 1024 tokens hold 1000
    assert cfg.fit_kv_cache(num_blocks=10 + 1).max_model_len == 160
    assert cfg.fit_kv_cache(num_blocks=11).max_blocks_per_seq == 10
    with pytest.raises(ValueError, match="KV cache of 1 blocks"):
        cfg.fit_kv_cache(num_blocks=1)


@pytest.mark.parametrize("asked,platform,tp,layout", [
    (None, "cpu", 1, "switched"), (None, "cpu", 2, "stacked"), (None, "gpu", 1, "stacked"),
    (None, "tpu", 1, "stacked"), ("stacked", "cpu", 1, "stacked"), ("switched", "gpu", 1, "switched"),
], ids=["auto-cpu", "auto-cpu-tp2", "auto-cuda", "auto-tpu", "stacked-cpu", "switched-cuda"])
def test_layer_layout_auto(asked, platform, tp, layout) -> None:
    """layer_layout=None switches the layers on one CPU device and stacks them elsewhere; an
    explicit layout is kept."""
    from minivllm_jax.plan import make_plan

    config = EngineConfig(layer_layout=asked, tensor_parallel_size=tp)
    assert make_plan(config, "float32", platform).model.layer_layout == layout


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"], ids=["on-cpu", "on-cuda", "on-tpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_decides_each_platform_choice(platform: str, dtype: str) -> None:
    """make_plan's table: the Pallas kernels on GPUs and TPUs, XLA attention on the CPU; feature-major
    small batches, a float32 KV cache, a byte-budget cache size and synchronous steps on the
    CPU; the model's dtype, profiled memory and async scheduling on accelerators. Explicit knobs
    win over "auto"."""
    from minivllm_jax.plan import CPU_FEATURE_MAJOR_ROWS, make_plan

    cpu = platform == "cpu"
    plan = make_plan(EngineConfig(cpu_kv_cache_bytes=1 << 20), dtype, platform)
    backend = {"gpu": "pallas", "tpu": "pallas-tpu"}.get(platform, "xla")
    # Triton dots need 16 rows; TPU vregs hold 8 sublanes; the CPU streams weights fastest at 4
    buckets = {"pallas": (16, 8), "pallas-tpu": (8, 8), "xla": (4, 4)}[backend]
    assert plan.model.attention_backend == backend and plan.min_buckets == buckets
    assert plan.model.interpret is False  # each platform's own backend runs compiled
    assert plan.model.feature_major_rows == (CPU_FEATURE_MAJOR_ROWS if cpu else 0)
    assert plan.kv_cache_dtype == ("float32" if cpu else dtype)
    assert plan.kv_cache_bytes == ((1 << 20) if cpu else None)
    assert plan.async_scheduling is not cpu
    forced = make_plan(EngineConfig(attention_backend="reference", async_scheduling=cpu), dtype, platform)
    assert forced.model.attention_backend == "reference" and forced.async_scheduling is cpu
    # a Pallas kernel off its own platform runs in interpret mode, decided here once
    for kernel, native in (("pallas", "gpu"), ("pallas-tpu", "tpu")):
        other = make_plan(EngineConfig(attention_backend=kernel), dtype, platform)
        assert other.model.interpret is (platform != native)


def test_llm_takes_every_engine_option_by_name(loaded_model) -> None:
    """LLM's keywords are EngineConfig's fields, declared once: its signature lists them with
    their defaults, an unknown name is a TypeError listing the options, and a knob that only the
    config had before (cpu_kv_cache_bytes) reaches the engine."""
    import dataclasses
    import inspect

    from minivllm_jax import LLM
    from minivllm_jax.kv_cache_sizing import kv_cache_bytes_per_block

    params = inspect.signature(LLM).parameters
    assert list(params)[1:] == [f.name for f in dataclasses.fields(EngineConfig)]
    assert all(params[f.name].default == f.default for f in dataclasses.fields(EngineConfig))
    with pytest.raises(TypeError, match=r"\['max_num_seq'\].*max_num_seqs"):
        LLM(loaded_model, max_num_seq=4)
    per_block = kv_cache_bytes_per_block(loaded_model.config, 16, "float32")
    llm = LLM(loaded_model, max_num_seqs=64, max_model_len=256, max_num_batched_tokens=64,
              cpu_kv_cache_bytes=40 * per_block)
    if llm.engine.plan.platform == "cpu":  # accelerators profile their memory instead
        assert llm.engine.runner.num_blocks == 40 + 1


def test_speculative_config_from_the_command_line_and_its_checks() -> None:
    """--speculative-config's JSON becomes the config's SpeculativeConfig (a dict does too);
    bad JSON and an unknown method name what is wrong; async scheduling keeps its default with it."""
    from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs
    from minivllm_jax.plan import make_plan
    from scheduler.spec_decode import SpeculativeConfig

    p = ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineConfig(**engine_kwargs(args))
    assert config.speculative_config == SpeculativeConfig("ngram", 3, 5, 5)
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}) == config
    assert make_plan(config, "bfloat16", "gpu").async_scheduling is True
    assert make_plan(config, "float32", "cpu").async_scheduling is False
    for text, match in (('{"method": "ngram"', "speculative_config must be a JSON object"),
                        ('{"method": "eagle", "num_speculative_tokens": 3}', "speculative_config.method")):
        with pytest.raises(ValueError, match=match):
            engine_kwargs(p.parse_args(["--speculative-config", text]))

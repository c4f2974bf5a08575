"""The engine's whole jitted step (``step_programs.forward``: embedding, stacked layers, Pallas
attention; ``step_programs.sample_tokens``: LM head, sampler) lowers for CUDA on a machine without a GPU, in
bfloat16 with the layer layout accelerators use, for SmolLM2's shape and the benchmark's named
real-model shapes. Lowering needs no device, so a shape or op the Triton lowering rejects fails
here, not on a lent GPU.

The census (docs/API.md §2b, `minivllm-jax compile --platform cuda`): no step program of a
Qwen3-0.6B-shaped config or of SmolLM2 holds a conditional (XLA:GPU would copy its predicate to
the host and wait for the device), and a forward's one loop is its layers'. The same census for
the TPU, compiled by libtpu, is in test_aot_compile.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from minivllm_jax.step_layout import StepShape
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.models.llama import param_shapes
from minivllm_jax.models.rope import rope_table
from minivllm_jax.worker.step_programs import forward, head_params, sample_tokens
from minivllm_jax.config import EngineConfig
from minivllm_jax.plan import ModelPlan, make_plan
import bench_common as bc


def _model_config(name: str) -> ModelConfig:
    hf = bc.build_hf_config(name)
    return ModelConfig.from_hf_config(hf.to_dict())


def _table_adds(text: str, max_seqs: int, max_blocks: int) -> list[str]:
    """The lowered program's adds whose result has the block table's shape: each layer used to
    shift a copy of the table to its blocks (now the kernels' scalar ``block_offset``)."""
    table = re.escape(f"tensor<{max_seqs}x{max_blocks}xi32>")
    return [line for line in text.splitlines() if re.search(rf"stablehlo\.add .*: {table}", line)]


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b"])
def test_cuda_census_no_conditional_one_loop(name: str, tmp_path: Path) -> None:
    """Every step program `minivllm-jax compile --platform cuda` lowers for the model: decode
    and mixed forwards (the Pallas backend's two kinds) with no conditional and one while (the
    layer loop), samplers of every sampling kind with neither."""
    from minivllm_jax.aot import lower_for_cuda

    hf = bc.build_hf_config(name)
    (tmp_path / "config.json").write_text(json.dumps(hf.to_dict()))
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512,
                          dtype="bfloat16", num_kv_blocks=256)
    report = lower_for_cuda(tmp_path, config)
    programs = {(p["program"], p["num_tokens"], p["num_sampled"], p["kind"]): p
                for p in report["programs"]}
    assert report["attention_backend"] == "pallas" and report["kv_cache_dtype"] == "bfloat16"
    assert {k for k in programs if k[0] == "forward"} == {
        ("forward", 16, 0, "mixed"), ("forward", 16, 0, "decode"), ("forward", 32, 0, "mixed"),
        ("forward", 64, 0, "mixed")}
    assert {k for k in programs if k[0] == "sampler"} == {
        ("sampler", 0, s, kind) for s in (8, 16) for kind in ("greedy", "random", "filtered")}
    for key, p in programs.items():
        assert p["ok"], (key, p["error"])
        want = {"conditional": 0, "while": int(key[0] == "forward")}
        assert p["control_flow"] == want, (key, p["control_flow"])
        assert p["flops"] is None and p["argument_bytes"] is None


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
def test_step_lowers_for_cuda_without_a_gpu(name: str, lower_for_cuda) -> None:
    mc = _model_config(name)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), param_shapes(mc))
    max_seqs, max_blocks, num_blocks, block_size = 256, 64, 1024, 16
    cache = jax.ShapeDtypeStruct((mc.num_hidden_layers, num_blocks, block_size,
                                  2 * mc.num_key_value_heads, mc.head_dim), jnp.bfloat16)
    rope = jax.ShapeDtypeStruct(rope_table(mc, max_blocks * block_size).shape, jnp.float32)
    prev = jax.ShapeDtypeStruct((max_seqs,), jnp.int32)
    gpu = make_plan(EngineConfig(), "bfloat16", "gpu").model
    # the compiled kernels, as a GPU process runs them (interpret mode is the CPU's default)
    plan = ModelPlan(gpu.attention_backend, gpu.layer_layout, gpu.feature_major_rows, interpret=False)
    assert plan.attention_backend == "pallas"
    # each kind's one kernel (flash decoding for decode steps, the mixed one else), with stacked
    # layers one body, one call; no kernel picked at run time
    for tokens, sampled, kind in ((256, 256, "decode"), (256, 256, "mixed"), (2048, 256, "mixed"),
                                  (16, 8, "decode")):
        shape = StepShape(tokens, sampled, max_seqs, max_blocks, kind=kind)
        main = shape.split(shape.empty_step())[0]
        lowered = lower_for_cuda(forward, params, cache, jax.ShapeDtypeStruct(main.shape, jnp.int32),
                                 prev, rope, model_config=mc, plan=plan, shape=shape.forward,
                                 mesh=None)
        calls = lowered.triton_calls
        assert calls == 1, f"{name}, {tokens} rows, {kind}: {calls} Triton calls, expected 1"
        assert "bf16" in lowered.text and "stablehlo.case" not in lowered.text
        assert not _table_adds(lowered.text, max_seqs, max_blocks)
        rows = jax.ShapeDtypeStruct((max_seqs, mc.hidden_size), jnp.bfloat16)
        tail = jax.ShapeDtypeStruct((main.shape[0] - shape.sampler_offset,), jnp.int32)
        sampler = lower_for_cuda(sample_tokens, head_params(params), rows, tail, None, prev, None,
                                 model_config=mc, plan=plan, shape=shape.sampler, mesh=None)
        assert sampler.triton_calls == 0 and "bf16" in sampler.text


def test_layers_read_the_block_table_unshifted() -> None:
    """The CPU's forward (the XLA backend; the Pallas one's in
    test_step_lowers_for_cuda_without_a_gpu) hands every layer's attention the step's block
    table as it is: no add of the table's shape (a per-layer copy, 8 MiB a layer at 256
    sequences x 128k tokens) is left in the program."""
    mc = _model_config("smollm2-135m")
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), param_shapes(mc))
    max_seqs, max_blocks, block_size = 256, 64, 16
    cache = jax.ShapeDtypeStruct((mc.num_hidden_layers, 1024, block_size,
                                  2 * mc.num_key_value_heads, mc.head_dim), jnp.float32)
    rope = jax.ShapeDtypeStruct(rope_table(mc, max_blocks * block_size).shape, jnp.float32)
    shape = StepShape(256, 256, max_seqs, max_blocks)
    main = shape.split(shape.empty_step())[0]
    text = forward.trace(params, cache, jax.ShapeDtypeStruct(main.shape, jnp.int32),
                         jax.ShapeDtypeStruct((max_seqs,), jnp.int32), rope, model_config=mc,
                         plan=ModelPlan("xla", "stacked"), shape=shape.forward,
                         mesh=None).lower().as_text()
    assert f"tensor<{max_seqs}x{max_blocks}xi32>" in text   # the table is there, unshifted
    assert not _table_adds(text, max_seqs, max_blocks)


def test_sampling_parameter_programs_lower_for_cuda(lower_for_cuda) -> None:
    """The variants sampling parameters switch on lower for CUDA too: the forward returning every
    row's hidden state, the sampler with logit_bias, penalties (donated token counts) and top-20
    logprobs, the prompt-logprobs program, and a speculative step's verifying sampler with a
    structured-output bitmask; no Pallas kernel in the sampling ones, no conditional in any, no
    loop in the samplers."""
    from minivllm_jax.worker.step_programs import prompt_logprobs

    mc = _model_config("smollm2-135m")
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), param_shapes(mc))
    max_seqs, max_blocks, tokens = 64, 16, 512
    plan = ModelPlan("pallas", make_plan(EngineConfig(), "bfloat16", "gpu").model.layer_layout,
                     interpret=False)
    shape = StepShape(tokens, 64, max_seqs, max_blocks, num_bias=8, penalties=True,
                      num_logprobs=20, all_hidden=True)
    main, extra = (jax.ShapeDtypeStruct(part.shape, jnp.int32)
                   for part in shape.split(shape.empty_step()))
    tail = jax.ShapeDtypeStruct((main.shape[0] - shape.sampler_offset,), jnp.int32)
    cache = jax.ShapeDtypeStruct((mc.num_hidden_layers, 256, 16, 2 * mc.num_key_value_heads,
                                  mc.head_dim), jnp.bfloat16)
    rope = jax.ShapeDtypeStruct(rope_table(mc, max_blocks * 16).shape, jnp.float32)
    prev = jax.ShapeDtypeStruct((max_seqs,), jnp.int32)
    fwd = lower_for_cuda(forward, params, cache, main, prev, rope, model_config=mc,
                         plan=plan, shape=shape.forward, mesh=None)
    assert fwd.triton_calls >= 1
    rows = jax.ShapeDtypeStruct((max_seqs, mc.hidden_size), jnp.bfloat16)
    state = (jax.ShapeDtypeStruct((max_seqs, mc.vocab_size), jnp.int32),
             jax.ShapeDtypeStruct((max_seqs, mc.vocab_size), jnp.bool_))
    sampler = lower_for_cuda(sample_tokens, head_params(params), rows, tail, extra, prev, state,
                             model_config=mc, plan=plan, shape=shape.sampler, mesh=None)
    assert sampler.triton_calls == 0 and "top_k" in sampler.text
    hidden = jax.ShapeDtypeStruct((tokens, mc.hidden_size), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((2, tokens), jnp.int32)
    prompt = lower_for_cuda(prompt_logprobs, head_params(params), hidden, idx, model_config=mc,
                            plan=plan, k=20, mesh=None)
    assert prompt.triton_calls == 0
    spec = StepShape(tokens, 64, max_seqs, max_blocks, num_spec=3, structured=True,
                     sampling="random")
    spec_main, spec_extra = (jax.ShapeDtypeStruct(part.shape, jnp.int32)
                             for part in spec.split(spec.empty_step()))
    bitmask = jax.ShapeDtypeStruct((64, -(-mc.vocab_size // 32)), jnp.int32)
    verify = lower_for_cuda(
        sample_tokens, head_params(params), jax.ShapeDtypeStruct((4 * max_seqs, mc.hidden_size),
                                                                 jnp.bfloat16),
        jax.ShapeDtypeStruct((spec_main.shape[0] - spec.sampler_offset,), jnp.int32), spec_extra,
        prev, None, bitmask, model_config=mc, plan=plan, shape=spec.sampler, mesh=None)
    for program in (fwd, sampler, prompt, verify):  # loops: the layers', prompt chunks'
        assert "stablehlo.case" not in program.text and "stablehlo.if" not in program.text
    assert sampler.text.count("stablehlo.while") == verify.text.count("stablehlo.while") == 0

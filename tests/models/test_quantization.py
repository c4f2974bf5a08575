"""Weight-only int8 (models/quantization.py): the rule against a numpy reference, the quantized
``project``/``Linear`` against numpy's ``x @ (q * scale)^T``, a quantized tiny model's logits
against the same model holding the dequantized float weights (the same math) in both layer
layouts, and the TPU compile (libtpu, v5e) of a quantized Qwen3-0.6B-shaped layer and untied LM
head: the int8 weights enter the dots as they are (no float copy: no temp bytes), argument bytes
about half of bfloat16's. The loader's per-tensor quantization and the param cache's int8 entries
are checked in tests/loader/, tensor parallelism in tests/parallel/."""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from minivllm_jax.loader import load_model
from minivllm_jax.models.llama import LlamaForCausalLM, Linear, param_shapes, project
from minivllm_jax.models.quantization import (abstract_params, check_quantization,
                                              dequantize_int8, dequantize_params, param_bytes,
                                              quantization_of, quantize_int8, quantize_params)
from minivllm_jax.plan import ModelPlan
from paged_harness import PagedRunner

PROMPTS = [[5, 17, 99, 3, 42, 250, 8, 8, 61, 200, 13, 77, 31], [101, 7, 7, 64]]


def _reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row absmax / 127 (as a float32 product by 1/127), round half to even, clip to
    [-127, 127], in float32."""
    w = w.astype(np.float32)
    scale = np.abs(w).max(axis=-1) * np.float32(1 / 127)
    q = np.clip(np.rint(w / np.where(scale > 0, scale, 1)[..., None]), -127, 127)
    return q.astype(np.int8), scale.astype(np.float32)


def test_quantize_int8_matches_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 40, 96)) * rng.uniform(0.01, 3, (3, 40, 1))).astype(np.float32)
    w[1, 5] = 0.0  # an all-zero row: scale 0, weights 0
    w[2, 7, 3] = -10.0  # the row's absmax is negative: -127
    want_q, want_s = _reference(w)
    for given in (w, jnp.asarray(w)):  # the loader's numpy path, the runner's jitted one
        q, s = quantize_int8(given)
        assert (q.shape, s.shape, q.dtype, s.dtype) == ((3, 40, 96), (3, 40), np.int8, np.float32)
        np.testing.assert_array_equal(np.asarray(q), want_q)
        np.testing.assert_array_equal(np.asarray(s), want_s)
    assert want_s[1, 5] == 0 and not want_q[1, 5].any() and want_q[2, 7, 3] == -127
    err = np.abs(dequantize_int8(want_q, want_s) - w)
    assert (err <= want_s[..., None] / 2 * (1 + 1e-6)).all()
    q2d, s2d = quantize_int8(w[0])  # one [out, in] matrix: the same rows
    np.testing.assert_array_equal(q2d, want_q[0])
    np.testing.assert_array_equal(s2d, want_s[0])
    bf16 = w.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(quantize_int8(bf16)[0], _reference(bf16.astype(np.float32))[0])
    with pytest.raises(ValueError, match="at least 2 axes"):
        quantize_int8(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="float"):
        quantize_int8(np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="int8"):
        check_quantization("int4")
    with pytest.raises(TypeError):
        check_quantization(8)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-4), (jnp.bfloat16, 6e-2)])
@pytest.mark.parametrize("rows", [1, 9])
def test_quantized_project_matches_numpy(dtype: Any, atol: float, rows: int) -> None:
    """``project(x, q, scale=s)`` (both forms, both output layouts) and ``Linear`` equal
    numpy's ``x @ (q * s)^T``."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 96)), dtype)
    q, s = quantize_int8(rng.standard_normal((40, 96)).astype(np.float32) * 0.1)
    want = np.asarray(x, np.float64) @ (q.astype(np.float64) * s[:, None].astype(np.float64)).T
    for feature_major_rows in (0, 8):
        got = jax.jit(functools.partial(project, feature_major_rows=feature_major_rows))(x, q, scale=s)
        assert got.shape == (rows, 40) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=1e-2)
        got_t = project(x, jnp.asarray(q), feature_major_rows, out_major=True, scale=jnp.asarray(s))
        np.testing.assert_allclose(np.asarray(got_t), want.T, atol=atol, rtol=1e-2)
    linear = Linear(40, quantization="int8")
    assert jax.tree.map(lambda a: (a.shape, a.dtype), linear.init(jax.random.key(0), x)["params"]) == {
        "weight": ((40, 96), jnp.int8), "scale": ((40,), jnp.float32)}
    y = linear.apply({"params": {"weight": q, "scale": s}}, x)
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=atol, rtol=1e-2)


def test_param_tree_transform_and_bytes() -> None:
    """`quantize_params` gives `param_shapes(config, "int8")`'s tree (the untied head a
    {weight, scale} pair); `dequantize_params` inverts the structure; weight bytes drop."""
    from tiny_configs import small_model_config

    config = small_model_config(vocab_size=64, hidden_size=32, intermediate_size=48, head_dim=8,
                                attention_bias=True)
    rng = np.random.default_rng(0)
    floats = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                          param_shapes(config))
    quantized = quantize_params(floats, "int8")
    want = abstract_params(param_shapes(config, "int8"), jnp.float32)
    assert jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), quantized) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), want)
    assert quantization_of(quantized) == "int8" and quantization_of(floats) is None
    assert quantize_params(floats, None) is floats
    with pytest.raises(ValueError, match="quantized already"):
        quantize_params(quantized, "int8")
    back = dequantize_params(quantized, np.float32)
    assert jax.tree.structure(back) == jax.tree.structure(floats)
    np.testing.assert_array_equal(back["embed_tokens"], floats["embed_tokens"])
    np.testing.assert_array_equal(back["layers"]["self_attn"]["q_proj"]["bias"],
                                  floats["layers"]["self_attn"]["q_proj"]["bias"])
    assert param_bytes(quantized) < 0.5 * param_bytes(floats)
    assert param_bytes(want) == param_bytes(quantized)


# ---- a quantized tiny model against its dequantized float twin ---------------------------------
@functools.lru_cache(maxsize=None)
def _step(config: Any, layout: str, feature_major_rows: int, quantization: str | None) -> Any:
    model = LlamaForCausalLM(config, ModelPlan("xla", layout, feature_major_rows,
                                               quantization=quantization))

    def step(params, cache, ids, pos, md, rope):
        hidden, cache = model.apply({"params": params}, ids, pos, cache, md, rope)
        return model.apply({"params": params}, hidden, method=LlamaForCausalLM.compute_logits), cache

    return jax.jit(step, donate_argnums=(1,))


@pytest.fixture(scope="module")
def loads(tiny_checkpoint) -> Any:
    """``loads(family) -> (int8 load, float32 load)`` of a tiny checkpoint, once per family."""
    made: dict[str, Any] = {}

    def load(family: str) -> Any:
        if family not in made:
            path, _ = tiny_checkpoint(family)
            made[family] = (load_model(path, dtype="float32", use_cache=False, quantization="int8"),
                            load_model(path, dtype="float32", use_cache=False))
        return made[family]

    return load


@dataclasses.dataclass
class QuantizedRunner(PagedRunner):
    """`PagedRunner` running the model with `quantization` (the params must match it)."""

    quantization: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._step = _step(self.config, self.layer_layout, self.feature_major_rows, self.quantization)


@pytest.mark.parametrize("family,layout,feature_major_rows", [
    ("qwen3", "stacked", 0),  # untied (quantized) LM head, q/k norms
    ("llama2-linear", "switched", 32),  # tied head (the float embedding), q/k/v/o biases;
    # the step's 32 rows run feature-major
])
def test_quantized_logits_equal_dequantized_float_model(family: str, layout: str,
                                                        feature_major_rows: int, loads) -> None:
    quant, floats = loads(family)
    assert quant.quantization == "int8" and quantization_of(quant.params) == "int8"
    assert quant.params["embed_tokens"].dtype == jnp.float32
    assert ("lm_head" in quant.params) != quant.config.tie_word_embeddings
    assert quant.weight_bytes < 0.6 * floats.weight_bytes
    twin = dequantize_params(jax.tree.map(np.asarray, quant.params), np.float32)

    def run(params: Any, quantization: str | None) -> list[np.ndarray]:
        runner = QuantizedRunner(quant.config, params, layer_layout=layout,
                                 feature_major_rows=feature_major_rows, quantization=quantization)
        return runner.run([(0, PROMPTS[0]), (1, PROMPTS[1])], pad_to=32)

    got, want, exact = run(quant.params, "int8"), run(twin, None), run(floats.params, None)
    for g, w, e in zip(got, want, exact):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-4)
        assert np.abs(g - e).max() < 0.05 * np.abs(e).max()  # int8 stays close to the float model


# ---- the TPU compile (libtpu ahead of time, v5e) ------------------------------------------------
def _qwen3_untied() -> Any:
    import bench_common as bc  # scripts/, on pyproject.toml's pythonpath

    from minivllm_jax.model_config import ModelConfig

    hf = bc.build_hf_config("qwen3-0.6b").to_dict()
    return ModelConfig.from_hf_config({**hf, "tie_word_embeddings": False})


def test_tpu_int8_weights_enter_the_dots_unconverted(tpu_topology) -> None:
    """A Qwen3-0.6B-shaped layer's projections (``DecoderLayer.pre`` and ``post``) and an untied
    LM head, bfloat16 activations, compiled for v5e: with int8 weights the program needs no
    temporary buffer (a float copy of a weight would be one, of megabytes) and holds no float
    array of a weight's shape; its arguments are about half of bfloat16's."""
    from jax.sharding import SingleDeviceSharding

    from minivllm_jax.models.llama import DecoderLayer

    where = SingleDeviceSharding(tpu_topology("v5e:2x2"))
    mc, tokens = _qwen3_untied(), 64

    def placed(tree: Any, cut: int = 0) -> Any:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[cut:], s.dtype, sharding=where),
                            tree)

    def compiled(quantization: str | None) -> Any:
        shapes = abstract_params(param_shapes(mc, quantization), jnp.bfloat16)
        layer = placed(shapes["layers"], cut=1)  # one layer's slice of the stacked tree
        # the untied head reads lm_head and norm (jit drops the unread embed_tokens argument)
        head = placed({k: shapes[k] for k in ("embed_tokens", "norm", "lm_head")})
        x = jax.ShapeDtypeStruct((tokens, mc.hidden_size), jnp.bfloat16, sharding=where)
        attn = jax.ShapeDtypeStruct((tokens, mc.num_attention_heads, mc.head_dim), jnp.bfloat16,
                                    sharding=where)
        rope = jax.ShapeDtypeStruct((tokens, mc.head_dim), jnp.float32, sharding=where)
        plan = ModelPlan("xla", quantization=quantization)
        body, model = DecoderLayer(mc, plan), LlamaForCausalLM(mc, plan)

        def f(layer, head, x, attn, cos, sin):
            qkv = body.apply({"params": layer}, x, cos, sin, method=DecoderLayer.pre)
            out = body.apply({"params": layer}, x, attn, method=DecoderLayer.post)
            logits = model.apply({"params": head}, out, method=LlamaForCausalLM.compute_logits)
            return qkv, logits

        return jax.jit(f).lower(layer, head, x, attn, rope, rope).compile()

    bf16, int8 = compiled(None), compiled("int8")
    m16, m8 = bf16.memory_analysis(), int8.memory_analysis()
    weights16 = param_bytes(abstract_params(param_shapes(mc), jnp.bfloat16)["lm_head"])
    assert m8.temp_size_in_bytes <= m16.temp_size_in_bytes + (1 << 20)
    assert m8.temp_size_in_bytes < weights16 // 64
    assert 0.45 < m8.argument_size_in_bytes / m16.argument_size_in_bytes < 0.6
    text = int8.as_text()
    assert "s8[" in text
    for rows, cols in ((mc.vocab_size, mc.hidden_size), (mc.intermediate_size, mc.hidden_size),
                       (mc.hidden_size, mc.intermediate_size)):
        assert not re.search(rf"(bf16|f32)\[{rows},{cols}\]", text), (rows, cols)


def test_place_params_quantizes_float_params_as_the_loader(loads) -> None:
    """An engine asked for int8 and given a float load (`runner.place_params`) quantizes it on
    the device into exactly the loader's int8 tree; int8 params with no quantization asked for
    are refused."""
    from minivllm_jax.config import EngineConfig
    from minivllm_jax.engine_spec import draft_spec, sized_spec
    from minivllm_jax.worker.runner import place_params

    quant, floats = loads("qwen3")

    def spec(quantization: str | None) -> Any:
        config = EngineConfig(max_num_seqs=2, max_model_len=32, num_kv_blocks=8,
                              layer_layout="stacked", quantization=quantization)
        return sized_spec(draft_spec(floats.config, config, floats.dtype, "cpu"))

    placed = place_params(spec("int8"), floats.config, floats.params)
    assert jax.tree.structure(placed) == jax.tree.structure(quant.params)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(quant.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="quantized"):
        place_params(spec(None), quant.config, quant.params)

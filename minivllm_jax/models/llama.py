"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) in Flax Linen.

One forward runs a flat batch of token rows (any mix of prefill and decode) through paged
attention; there are no dense masks. How it runs is the `plan.ModelPlan`'s: the attention
backend, the layer layout and which projections run feature-major.

Layer layouts, one layer body (``DecoderLayer``):
- ``"stacked"``: ``nn.scan`` over params with a leading ``[num_hidden_layers]`` axis
  (``params["layers"]``), the layout the loaders produce; the body compiles once.
- ``"switched"``: per-layer arrays (``params["layers_0"]``, ...; ``unstack_layers``) under a
  ``lax.scan`` over the layer index whose body reaches layer ``i``'s weights through
  ``lax.switch``, one branch per layer before attention (``DecoderLayer.pre``) and one after it
  (``DecoderLayer.post``). Attention, which holds no weights, runs once in the body, so the KV
  cache never enters a branch (XLA would copy it in and out of every one). Each branch reads its
  own arrays in place, where a stacked layer's slices are copied on XLA:CPU.

The KV cache ``[L, num_blocks, block_size, 2*KVH, D]`` is the scan *carry*: layer ``i`` writes
and reads it in place (``attention.paged_attention``), never copied into per-layer slices.

Weights keep torch's layout and names: a projection is ``weight [out, in]`` and computes
``x [T, in] @ weight^T`` (``project``, the one place that picks how XLA runs that product).
With ``plan.quantization`` "int8" every linear layer's ``weight`` (and an untied ``lm_head``,
then ``lm_head/weight``) is int8 beside a float32 ``scale [out]`` (models/quantization.py); the
embedding, and so a tied head, stays in the model dtype. With ``plan.embed_lanes`` (the TPU's)
the embedding table's rows are zero-padded to `embed_width` (the loaded tree is not:
`pad_embedding`).
Numerics: matmuls take operands in the param dtype (float32 at full precision, never TF32),
accumulate in float32 and round once to the param dtype; RMSNorm statistics, RoPE angles and
logits in float32.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh

from minivllm_jax.models.attention import AttentionMetadata, paged_attention, with_kernel_metadata
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.models.quantization import SCALE, check_quantization
from minivllm_jax.models.rope import apply_rope
from minivllm_jax.plan import ModelPlan

_init: Callable[..., Any] = nn.initializers.normal(0.02)


def _precision(dtype: Any) -> jax.lax.Precision | None:
    """float32 models get true float32 matmuls (GPUs would otherwise use TF32); others default."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def runs_feature_major(x: jax.Array, feature_major_rows: int) -> bool:
    """Whether ``project`` runs ``x`` feature-major: float32 batches of at most
    ``feature_major_rows`` rows (the one place for the rule)."""
    return x.dtype == jnp.float32 and x.shape[0] <= feature_major_rows


def project(x: jax.Array, weight: jax.Array, feature_major_rows: int = 0,
            out_major: bool = False, scale: jax.Array | None = None) -> jax.Array:
    """``x [T, in] @ weight[out, in]^T`` as float32 ``[T, out]`` (``[out, T]`` with ``out_major``),
    operands in x's dtype; with ``scale`` (float32 ``[out]``, a quantized weight's:
    models/quantization.py) the float32 product is multiplied by it, per output channel.

    The weight (int8 when quantized) is converted to x's dtype inside the product, which XLA
    fuses into the dot on the TPU (no float copy of the weight). float32 ``x`` of at most
    ``feature_major_rows`` rows runs feature-major, ``(weight @ x^T)^T``, which XLA:CPU streams
    faster at decode sizes; the optimization barrier keeps XLA from folding the transpose back
    into the dot. Everything else runs ``x @ weight^T``.
    """
    w, prec = weight.astype(x.dtype), _precision(x.dtype)
    if runs_feature_major(x, feature_major_rows):
        y = jax.lax.optimization_barrier(
            jnp.dot(w, x.T, precision=prec, preferred_element_type=jnp.float32))
        y = y if scale is None else y * scale.astype(jnp.float32)[:, None]
        return y if out_major else y.T
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)
    y = y if scale is None else y * scale.astype(jnp.float32)
    return y.T if out_major else y


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last axis, statistics in float32, output in x's dtype."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return weight.astype(x.dtype) * xf.astype(x.dtype)


class Linear(nn.Module):
    """``x @ weight^T (+ bias)`` with a torch Linear's ``weight [out, in]`` (see ``project``).
    ``quantization`` "int8": ``weight`` is int8 and ``scale`` float32 ``[out]``
    (models/quantization.py); the bias stays float."""

    features: int
    use_bias: bool = False
    feature_major_rows: int = 0
    quantization: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight, scale = weight_param(self, (self.features, x.shape[-1]), self.quantization)
        y = project(x, weight, self.feature_major_rows, scale=scale).astype(x.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(x.dtype)
        return y


def weight_param(module: nn.Module, shape: tuple[int, int], quantization: str | None
                 ) -> tuple[jax.Array, jax.Array | None]:
    """``module``'s projection params: ``(weight, None)``, float ``weight [out, in]``; or
    quantized (`quantization.check_quantization`), ``(weight, scale)``: int8 ``weight`` and
    float32 ``scale [out]``."""
    if check_quantization(quantization) is None:
        return module.param("weight", _init, shape, jnp.float32), None
    return (module.param("weight", nn.initializers.zeros, shape, jnp.int8),
            module.param(SCALE, nn.initializers.ones, shape[:1], jnp.float32))


class QuantizedHead(nn.Module):
    """The untied LM head's quantized params, ``lm_head/weight`` int8 ``[V, E]`` and
    ``lm_head/scale`` float32 ``[V]``; calling it returns ``(weight, scale)``."""

    vocab_size: int
    hidden_size: int
    quantization: str

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array | None]:
        return weight_param(self, (self.vocab_size, self.hidden_size), self.quantization)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array, md: AttentionMetadata,
           layer: jax.Array | int, *, config: ModelConfig, plan: ModelPlan,
           mesh: Mesh | None) -> tuple[jax.Array, jax.Array]:
    """Write layer ``layer``'s ``k, v`` into the stacked cache and attend ``q``; no weights."""
    return paged_attention(q, k, v, kv_cache, md, layer, plan=plan, sm_scale=config.head_dim ** -0.5,
                           sliding_window=config.sliding_window, mesh=mesh)


class Attention(nn.Module):
    """The attention block's weights: q/k/v projections (q/k normed per head when ``qk_norm``)
    and o_proj. The attention between them is ``attend``."""

    config: ModelConfig
    feature_major_rows: int = 0
    quantization: str | None = None

    def setup(self) -> None:
        c, fm, q = self.config, self.feature_major_rows, self.quantization
        self.q_proj = Linear(c.num_attention_heads * c.head_dim, c.attention_bias, fm, q)
        self.k_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, fm, q)
        self.v_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, fm, q)
        self.o_proj = Linear(c.hidden_size, c.attention_out_bias, fm, q)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.rms_norm_eps)
            self.k_norm = RMSNorm(c.rms_norm_eps)

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q [T, H, D]`` and ``k, v [T, KVH, D]`` of ``x [T, E]``."""
        shape = (x.shape[0], -1, self.config.head_dim)
        q, k, v = (p(x).reshape(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class MLP(nn.Module):
    config: ModelConfig
    feature_major_rows: int = 0
    quantization: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n, fm, q = self.config.intermediate_size, self.feature_major_rows, self.quantization
        gate = Linear(n, feature_major_rows=fm, quantization=q, name="gate_proj")(x)
        up = Linear(n, feature_major_rows=fm, quantization=q, name="up_proj")(x)
        return Linear(self.config.hidden_size, feature_major_rows=fm, quantization=q,
                      name="down_proj")(jax.nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block. ``__call__`` is the stacked scan's body (carry ``(hidden [T, E],
    kv_cache)``); ``pre`` and ``post`` are its weighted halves around ``attend``, which the
    switched layout calls one at a time."""

    config: ModelConfig
    plan: ModelPlan
    mesh: Mesh | None = None

    def setup(self) -> None:
        c, fm, q = self.config, self.plan.feature_major_rows, self.plan.quantization
        self.input_layernorm = RMSNorm(c.rms_norm_eps)
        self.self_attn = Attention(c, fm, q)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps)
        self.mlp = MLP(c, fm, q)

    def pre(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q [T, H, D]`` and ``k, v [T, KVH, D]`` of ``x``, RoPE applied to q and k."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(x))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def post(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        """The residual stream after the attention output ``attn [T, H, D]`` and the MLP."""
        x = x + self.self_attn.o_proj(attn.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, carry: tuple[jax.Array, jax.Array], layer: jax.Array | int, cos: jax.Array,
                 sin: jax.Array, md: AttentionMetadata) -> tuple[tuple[jax.Array, jax.Array], None]:
        x, kv_cache = carry
        attn, kv_cache = attend(*self.pre(x, cos, sin), kv_cache, md, layer, config=self.config,
                                plan=self.plan, mesh=self.mesh)
        return (self.post(x, attn), kv_cache), None


class LlamaForCausalLM(nn.Module):
    """``__call__(input_ids [T], positions [T], kv_cache, md, rope) -> (hidden [T, E], kv_cache)``.

    ``hidden`` is the last layer's residual stream (before the final norm);
    ``compute_logits(hidden_rows [N, E]) -> float32 [N, vocab]`` applies the final norm and the LM
    head (the tied embedding when ``tie_word_embeddings``) to just the rows that are sampled.
    ``plan.layer_layout`` must match the param tree; ``mesh`` (tensor parallelism) shards
    attention over its devices.
    """

    config: ModelConfig
    plan: ModelPlan = ModelPlan()
    mesh: Mesh | None = None

    def setup(self) -> None:
        c = self.config
        self.embed_tokens = self.param("embed_tokens", _init, (c.vocab_size, embed_width(c, self.plan)),
                                       jnp.float32)
        if self.plan.layer_layout == "stacked":
            self.layers = nn.scan(
                DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_hidden_layers,
            )(c, self.plan, self.mesh)
        else:  # submodules named layers_0, layers_1, ...
            self.layers = [DecoderLayer(c, self.plan, self.mesh) for _ in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps)
        if not c.tie_word_embeddings and self.plan.quantization is not None:
            self.lm_head = QuantizedHead(c.vocab_size, c.hidden_size, self.plan.quantization)
        elif not c.tie_word_embeddings:
            self.lm_head = self.param("lm_head", _init, (c.vocab_size, c.hidden_size), jnp.float32)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata, rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``rope``: ``rope.rope_table(config, n)``, covering every position of the step; an
        argument, not a constant, so a long table is not baked into the compiled program. The
        attention kernel's per-step metadata is made here, once, for every layer."""
        md = with_kernel_metadata(md, input_ids.shape[0], kv_cache, self.embed_tokens.dtype,
                                  config=self.config, plan=self.plan, mesh=self.mesh)
        x = jnp.take(self.embed_tokens, input_ids, axis=0)[:, :self.config.hidden_size]
        rows = jnp.take(rope, positions, axis=0, mode="clip")
        cos, sin = rows[:, 0], rows[:, 1]
        layer_ids = jnp.arange(self.config.num_hidden_layers, dtype=jnp.int32)
        if self.plan.layer_layout == "stacked":
            (x, kv_cache), _ = self.layers((x, kv_cache), layer_ids, cos, sin, md)
        elif not self.is_initializing():
            (x, kv_cache), _ = jax.lax.scan(self._switched_body(cos, sin, md), (x, kv_cache), layer_ids)
        else:  # the switched layout's init: the same per-layer params, created one by one
            for i, layer in enumerate(self.layers):
                (x, kv_cache), _ = layer((x, kv_cache), i, cos, sin, md)
        return x, kv_cache

    def _switched_body(self, cos: jax.Array, sin: jax.Array, md: AttentionMetadata) -> Callable[..., Any]:
        """The switched layout's scan body for layer ``i``: ``lax.switch`` runs layer i's ``pre``
        and ``post`` from its own param arrays (applied functionally: Linen submodules cannot be
        called inside a JAX control-flow branch); ``attend`` runs between them, outside."""
        body = DecoderLayer(self.config, self.plan, self.mesh, parent=None)
        params = [self.variables["params"][f"layers_{j}"] for j in range(len(self.layers))]
        # each half is traced once and its trace reused by every branch (jit's trace cache);
        # inline=True puts the same ops in every branch as tracing each would
        pre_fn = jax.jit(functools.partial(body.apply, method=DecoderLayer.pre), inline=True)
        post_fn = jax.jit(functools.partial(body.apply, method=DecoderLayer.post), inline=True)
        pre = [functools.partial(pre_fn, {"params": p}) for p in params]
        post = [functools.partial(post_fn, {"params": p}) for p in params]

        def step(carry: tuple[jax.Array, jax.Array], i: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
            x, kv_cache = carry
            q, k, v = jax.lax.switch(i, pre, x, cos, sin)
            attn, kv_cache = attend(q, k, v, kv_cache, md, i, config=self.config, plan=self.plan,
                                    mesh=self.mesh)
            return (jax.lax.switch(i, post, x, attn), kv_cache), None
        return step

    def compute_logits(self, hidden: jax.Array, vocab_major: bool = False) -> jax.Array:
        """float32 ``[N, vocab]``, or ``[vocab, N]`` with ``vocab_major`` (for the sampler: a
        feature-major LM head's logits then stay in the layout its dot wrote)."""
        head, scale = self.embed_tokens, None  # [V, E]; the tied head is never quantized
        if not self.config.tie_word_embeddings:
            head, scale = self.lm_head() if self.plan.quantization is not None else (self.lm_head, None)
        x = self.norm(hidden)
        x = jnp.pad(x, ((0, 0), (0, head.shape[1] - x.shape[1])))  # a padded tied head's zeros
        return project(x, head, self.plan.feature_major_rows, vocab_major, scale)


def unstack_layers(params: dict[str, Any], num_layers: int, host_views: bool = False
                   ) -> dict[str, Any]:
    """The stacked param tree in the switched layout's per-layer form: ``params["layers"]``
    (leading layer axis) becomes ``params["layers_0"] ... ["layers_{L-1}"]``, each its own arrays.
    The result takes no more memory than the stacked tree. `host_views` (the plan's: on the CPU
    platform) slices arrays that live on the default device as numpy views, which may share the
    stacked buffers."""
    out = {k: v for k, v in params.items() if k != "layers"}
    leaves, treedef = jax.tree.flatten(params["layers"])
    default = jax.devices()[0]
    if host_views and all(isinstance(a, jax.Array) and a.devices() == {default} for a in leaves):
        # on the default CPU device: numpy views of the slices, put back whole (far faster than
        # eager jax slices); uncommitted, like the slices would be (commitment keys jit's cache)
        cols = [jax.device_put(list(np.asarray(a))) for a in leaves]
    else:
        cols = [[a[i] for i in range(num_layers)] for a in leaves]
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.unflatten(treedef, [c[i] for c in cols])
    return out


def embed_width(config: ModelConfig, plan: ModelPlan) -> int:
    """The embedding table's row length: ``hidden_size``, rounded up to a multiple of
    ``plan.embed_lanes`` when set. The padding is zeros (`pad_embedding`): the lookup drops it,
    and a tied LM head contracts it with zeros, so logits are exactly the unpadded ones."""
    lanes = plan.embed_lanes
    return config.hidden_size if lanes <= 0 else -(-config.hidden_size // lanes) * lanes


def pad_embedding(params: dict[str, Any], config: ModelConfig, plan: ModelPlan) -> dict[str, Any]:
    """``params`` (a loaded tree, ``embed_tokens [V, hidden_size]``) with the table
    zero-padded to `embed_width` (the same tree when no padding is due)."""
    table, width = params["embed_tokens"], embed_width(config, plan)
    if table.shape[1] == width:
        return params
    pad = ((0, 0), (0, width - table.shape[1]))
    padded = np.pad(table, pad) if isinstance(table, np.ndarray) else jnp.pad(table, pad)
    return {**params, "embed_tokens": padded}


def param_shapes(config: ModelConfig, quantization: str | None = None,
                 embed_lanes: int = 0) -> dict[str, Any]:
    """The Linen param tree of ``LlamaForCausalLM(config)`` with ``quantization`` and
    ``embed_lanes`` (the plan's; the loaded tree has none: `pad_embedding`) as ShapeDtypeStructs
    (nothing allocated), in the stacked layout: float leaves float32 (the loaded tree has the
    model dtype: `quantization.leaf_dtype`), quantized weights int8 and their scales float32."""
    model = LlamaForCausalLM(config, ModelPlan(quantization=check_quantization(quantization),
                                               embed_lanes=embed_lanes))
    md = AttentionMetadata(*(jnp.zeros(s, jnp.int32) for s in [(1,), (1, 1), (1,), (2,), (1,)]))
    cache = jax.ShapeDtypeStruct((config.num_hidden_layers, 1, 1, 2 * config.num_key_value_heads,
                                  config.head_dim), jnp.float32)
    ids = jnp.zeros((1,), jnp.int32)
    rope = jnp.zeros((1, 2, config.head_dim), jnp.float32)

    def forward_and_logits(m: LlamaForCausalLM, cache: jax.Array) -> jax.Array:
        return m.compute_logits(m(ids, ids, cache, md, rope)[0])

    abstract = jax.eval_shape(
        lambda c: model.init(jax.random.key(0), c, method=forward_and_logits), cache)
    return abstract["params"]

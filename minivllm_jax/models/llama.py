"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) in Flax Linen.

One forward pass runs a flat batch of token rows (any mix of prefill and decode) through paged
attention; there are no dense masks.

Three layer layouts, one layer body (``DecoderLayer``), picked by ``layer_layout``:
- ``"stacked"``: layers stacked with ``nn.scan``; every layer param has a leading
  ``[num_hidden_layers]`` axis (``params["layers"]``) and the body compiles once. This is the
  layout the loaders produce and the one at rest.
- ``"switched"``: per-layer arrays (``params["layers_0"]``, ``["layers_1"]``, ...; see
  ``unstack_layers``) under a ``lax.scan`` over the layer index. Its body reaches layer ``i``'s
  weights through ``lax.switch``: one branch per layer around the projections before attention
  (``DecoderLayer.pre``) and one around those after it (``DecoderLayer.post``); attention itself,
  which holds no weights, runs once in the body. Each branch reads its own arrays in place, and
  the KV cache never enters a branch (a switch around the whole layer copied it: a 32-row step
  took 244 ms instead of ~75). Compiles 1.0-1.5x as long as stacked (twice the code).
- ``"unrolled"``: a Python loop over the per-layer arrays, read in place, compiled 3-7x longer.

XLA:CPU copies each layer's weight slices out of a stacked array before its dots (~15 % of a
float32 decode step's matmuls) and converts a 16-bit stack whole to float32 first (2/3 of a
bfloat16 step), so the engine switches layers on one CPU device (``runner.resolve_layer_layout``).

KV cache threading: the whole stacked cache ``[L, num_blocks, block_size, 2*KVH, D]`` is the scan
*carry*, and layer ``i`` writes and reads it in place through ``paged_attention(..., layer=i)``
(block ids shifted by ``i*num_blocks`` in a flat view). Passing per-layer slices as scan xs/ys
would instead copy every layer into a fresh output stack each step; the carry form lets XLA update
the donated cache buffer in place.

Weights keep torch's layout and names: a projection is ``weight [out, in]`` and computes
``x [T, in] @ weight^T`` (``project``, the one place that picks how XLA runs that product).

Numerics: matmuls take operands in the param dtype (float32 ones at full precision, never TF32),
accumulate and return float32, and round once to the param dtype (``Linear``); RMSNorm
statistics, RoPE angles and logits in float32. On XLA:CPU a bfloat16 dot with a float32 result
runs on AMX units where the CPU has them (a [2048x576]@[576x1536] dot: 1818 GFLOP/s, against
291 with a bfloat16 result and 325 in float32; scripts/bench_cpu_floor.py).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.attention import AttentionMetadata, paged_attention
from minivllm_jax.config import LAYER_LAYOUTS
from minivllm_jax.models.config import ModelConfig
from minivllm_jax.models.rope import apply_rope

_init: Callable[..., Any] = nn.initializers.normal(0.02)


def _precision(dtype: Any) -> jax.lax.Precision | None:
    """float32 models get true float32 matmuls (GPUs would otherwise use TF32); others default."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def runs_feature_major(x: jax.Array, feature_major_rows: int) -> bool:
    """Whether ``project`` runs ``x`` feature-major: float32 batches of at most
    ``feature_major_rows`` rows (the one place for the rule)."""
    return x.dtype == jnp.float32 and x.shape[0] <= feature_major_rows


def project(x: jax.Array, weight: jax.Array, feature_major_rows: int = 0,
            out_major: bool = False) -> jax.Array:
    """``x [T, in] @ weight[out, in]^T`` as float32 ``[T, out]`` (``[out, T]`` with ``out_major``),
    operands in x's dtype.

    float32 ``x`` of at most ``feature_major_rows`` rows runs feature-major, ``(weight @ x^T)^T``:
    at decode sizes XLA:CPU (YNNPACK) streams the weight faster that way (30 SmolLM2 layers at
    32 rows: 50.8 ms against 58.8 ms for an ``[in, out]`` weight and 70.3 ms for ``x @ W^T``).
    The optimization barrier keeps XLA from folding the transpose back into the dot, which would
    land on XLA:CPU's slow non-YNNPACK dot. Everything else, bfloat16 at every size included
    (where the feature-major form is 3-4x slower), runs ``x @ weight^T``. The runner sets
    ``feature_major_rows`` on the CPU platform only (``runner.FEATURE_MAJOR_ROWS``).
    """
    w, prec = weight.astype(x.dtype), _precision(x.dtype)
    if runs_feature_major(x, feature_major_rows):
        y = jax.lax.optimization_barrier(
            jnp.dot(w, x.T, precision=prec, preferred_element_type=jnp.float32))
        return y if out_major else y.T
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)
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
    """``x @ weight^T (+ bias)`` with a torch Linear's ``weight [out, in]`` (see ``project``)."""

    features: int
    use_bias: bool = False
    feature_major_rows: int = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", _init, (self.features, x.shape[-1]), jnp.float32)
        y = project(x, weight, self.feature_major_rows).astype(x.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(x.dtype)
        return y


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array, md: AttentionMetadata,
           layer: jax.Array | int, *, config: ModelConfig, backend: str, interpret: bool | None,
           mesh: Any) -> tuple[jax.Array, jax.Array]:
    """Write layer ``layer``'s ``k, v`` into the stacked cache and attend ``q``; no weights."""
    kwargs = dict(backend=backend, sm_scale=config.head_dim ** -0.5,
                  sliding_window=config.sliding_window, soft_cap=None, layer=layer, interpret=interpret)
    k, v = k.astype(kv_cache.dtype), v.astype(kv_cache.dtype)
    if mesh is None:
        return paged_attention(q, k, v, kv_cache, md, **kwargs)
    from minivllm_jax.sharding import sharded_paged_attention  # tensor parallel: shard_map

    return sharded_paged_attention(q, k, v, kv_cache, md, mesh=mesh, **kwargs)


class Attention(nn.Module):
    """The attention block's weights: q/k/v projections (q/k normed per head when ``qk_norm``)
    and o_proj. The attention between them is ``attend``."""

    config: ModelConfig
    feature_major_rows: int = 0

    def setup(self) -> None:
        c, fm = self.config, self.feature_major_rows
        self.q_proj = Linear(c.num_attention_heads * c.head_dim, c.attention_bias, fm)
        self.k_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, fm)
        self.v_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, fm)
        self.o_proj = Linear(c.hidden_size, c.attention_out_bias, fm)
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

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n, fm = self.config.intermediate_size, self.feature_major_rows
        gate = Linear(n, feature_major_rows=fm, name="gate_proj")(x)
        up = Linear(n, feature_major_rows=fm, name="up_proj")(x)
        return Linear(self.config.hidden_size, feature_major_rows=fm, name="down_proj")(
            jax.nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block. ``__call__`` is the scan body (carry ``(hidden [T, E], stacked
    kv_cache)``); ``pre`` and ``post`` are its weighted halves around ``attend``, which the
    switched layout calls one at a time."""

    config: ModelConfig
    attn_backend: str
    interpret: bool | None
    mesh: Any = None
    feature_major_rows: int = 0

    def setup(self) -> None:
        c, fm = self.config, self.feature_major_rows
        self.input_layernorm = RMSNorm(c.rms_norm_eps)
        self.self_attn = Attention(c, fm)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps)
        self.mlp = MLP(c, fm)

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
                                backend=self.attn_backend, interpret=self.interpret, mesh=self.mesh)
        return (self.post(x, attn), kv_cache), None


class LlamaForCausalLM(nn.Module):
    """``__call__(input_ids [T], positions [T], kv_cache, md, rope) -> (hidden [T, E], kv_cache)``.

    ``hidden`` is the last layer's residual stream (before the final norm);
    ``compute_logits(hidden_rows [N, E]) -> float32 [N, vocab]`` applies the final norm and the LM
    head (the tied embedding when ``tie_word_embeddings``) to just the rows that are sampled.
    ``mesh`` (a ``jax.sharding.Mesh``, tensor parallelism): attention runs through
    ``sharding.sharded_paged_attention`` on it; None runs ``paged_attention`` directly.
    ``feature_major_rows``: see ``project`` (how projections and the LM head run their dots).
    ``layer_layout``: one of ``LAYER_LAYOUTS`` (module docstring); the param tree must match it.
    """

    config: ModelConfig
    attn_backend: str = "reference"
    interpret: bool | None = None
    mesh: Any = None
    layer_layout: str = "stacked"
    feature_major_rows: int = 0

    def setup(self) -> None:
        c = self.config
        self.embed_tokens = self.param("embed_tokens", _init, (c.vocab_size, c.hidden_size), jnp.float32)
        if self.layer_layout not in LAYER_LAYOUTS:
            raise ValueError(f"layer_layout must be one of {LAYER_LAYOUTS}, got {self.layer_layout!r}")
        layer_args = (c, self.attn_backend, self.interpret, self.mesh, self.feature_major_rows)
        if self.layer_layout == "stacked":
            self.layers = nn.scan(
                DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_hidden_layers,
            )(*layer_args)
        else:  # submodules named layers_0, layers_1, ...
            self.layers = [DecoderLayer(*layer_args) for _ in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = self.param("lm_head", _init, (c.vocab_size, c.hidden_size), jnp.float32)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata, rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``rope``: ``rope.rope_table(config, n)``, covering every position of the step; an
        argument, not a constant, so a long table is not baked into the compiled program."""
        x = jnp.take(self.embed_tokens, input_ids, axis=0)
        rows = jnp.take(rope, positions, axis=0, mode="clip")
        cos, sin = rows[:, 0], rows[:, 1]
        layer_ids = jnp.arange(self.config.num_hidden_layers, dtype=jnp.int32)
        if self.layer_layout == "stacked":
            (x, kv_cache), _ = self.layers((x, kv_cache), layer_ids, cos, sin, md)
        elif self.layer_layout == "switched" and not self.is_initializing():
            (x, kv_cache), _ = jax.lax.scan(self._switched_body(cos, sin, md), (x, kv_cache), layer_ids)
        else:  # unrolled, and the switched layout's init (it creates the same per-layer params)
            for i, layer in enumerate(self.layers):
                (x, kv_cache), _ = layer((x, kv_cache), i, cos, sin, md)
        return x, kv_cache

    def _switched_body(self, cos: jax.Array, sin: jax.Array, md: AttentionMetadata) -> Callable[..., Any]:
        """The switched layout's scan body for layer ``i``: ``lax.switch`` runs layer i's ``pre``
        and ``post`` from its own param arrays (applied functionally: Linen submodules cannot be
        called inside a JAX control-flow branch); ``attend`` runs between them, outside."""
        body = DecoderLayer(self.config, self.attn_backend, self.interpret, self.mesh,
                            self.feature_major_rows, parent=None)
        params = [self.variables["params"][f"layers_{j}"] for j in range(len(self.layers))]
        # each half traced once: a jit's trace is cached, so the other 29 branches reuse it (same
        # avals), and inline=True puts the same ops in every branch as tracing each would (the
        # compiled step is unchanged; a step shape lowers in 0.40 s instead of 0.70 s)
        pre_fn = jax.jit(functools.partial(body.apply, method=DecoderLayer.pre), inline=True)
        post_fn = jax.jit(functools.partial(body.apply, method=DecoderLayer.post), inline=True)
        pre = [functools.partial(pre_fn, {"params": p}) for p in params]
        post = [functools.partial(post_fn, {"params": p}) for p in params]

        def step(carry: tuple[jax.Array, jax.Array], i: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
            x, kv_cache = carry
            q, k, v = jax.lax.switch(i, pre, x, cos, sin)
            attn, kv_cache = attend(q, k, v, kv_cache, md, i, config=self.config, backend=self.attn_backend,
                                    interpret=self.interpret, mesh=self.mesh)
            return (jax.lax.switch(i, post, x, attn), kv_cache), None
        return step

    def compute_logits(self, hidden: jax.Array, vocab_major: bool = False) -> jax.Array:
        """float32 ``[N, vocab]``, or ``[vocab, N]`` with ``vocab_major`` (for the sampler: a
        feature-major LM head's logits then stay in the layout its dot wrote)."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head  # [V, E]
        return project(self.norm(hidden), head, self.feature_major_rows, vocab_major)


def unstack_layers(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The stacked param tree in the per-layer layout (switched, unrolled): ``params["layers"]``
    (leading layer axis) becomes ``params["layers_0"] ... ["layers_{L-1}"]``, each its own arrays.
    The result takes no more memory than the stacked tree (on one CPU device its slices may share
    the stacked buffers)."""
    out = {k: v for k, v in params.items() if k != "layers"}
    leaves, treedef = jax.tree.flatten(params["layers"])
    default = jax.devices()[0]
    if default.platform == "cpu" and all(isinstance(a, jax.Array) and a.devices() == {default}
                                           for a in leaves):
        # on the default CPU device: numpy views of the slices, put back whole (270 eager jax
        # slices took ~0.6 s of every start; this takes milliseconds). Put without a sharding,
        # so they are uncommitted like the slices would be (commitment keys the step's cache)
        cols = [jax.device_put(list(np.asarray(a))) for a in leaves]
    else:
        cols = [[a[i] for i in range(num_layers)] for a in leaves]
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.unflatten(treedef, [c[i] for c in cols])
    return out


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: Any) -> jax.Array:
    """Zeros ``[num_hidden_layers, num_blocks, block_size, 2*num_key_value_heads, head_dim]``."""
    return jnp.zeros((config.num_hidden_layers, num_blocks, block_size,
                      2 * config.num_key_value_heads, config.head_dim), dtype)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: Any) -> int:
    """Bytes one block takes across all layers (K and V)."""
    return (config.num_hidden_layers * block_size * 2 * config.num_key_value_heads
            * config.head_dim * np.dtype(dtype).itemsize)


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The Linen param tree of ``LlamaForCausalLM(config)`` as ShapeDtypeStructs (nothing allocated)."""
    model = LlamaForCausalLM(config)
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

"""Weight-only quantization of the linear layers, the one place of its rule.

``"int8"`` (the only scheme, `config.QUANTIZATIONS`): a projection weight ``w [out, in]`` (any
leading axes, e.g. the stacked layer axis) becomes ``weight`` int8 ``[out, in]`` and ``scale``
float32 ``[out]`` with, per output row, in float32, ``scale = max|w| * float32(1/127)`` (a
product: XLA rewrites ``/ 127`` into one, so numpy and jax agree bit for bit only on it) and
``weight = clip(round_half_even(w / scale), -127, 127)`` (an all-zero row has scale 0 and zero
weights), so ``|w - weight * scale| <= scale / 2`` for every element. ``project`` computes
``(x @ weight.astype(x.dtype)^T) * scale``: activations stay in the model dtype, the product
accumulates in float32 and the scale multiplies that float32 result.

Which params: every ``weight`` of a ``QUANTIZED_LINEARS`` module (q/k/v/o and gate/up/down
projections) and an untied ``lm_head``. Biases, norms and the embedding table (and so a tied
head) stay float in the model dtype. The quantized param tree holds the pair side by side:
``{..., "q_proj": {"weight": int8, "scale": f32[, "bias"]}}`` and, for the untied head,
``{"lm_head": {"weight": int8 [V, E], "scale": f32 [V]}}`` where the float tree has the array
``lm_head``. Scale leaves are always float32; every other float leaf has the model dtype.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.config import check_quantization  # re-exported: the loader and model use it here

INT8 = "int8"
INT8_MAX = 127
_INV_INT8_MAX = np.float32(1 / INT8_MAX)
SCALE = "scale"  # the param name of a quantized weight's per-output-channel scales
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LM_HEAD = "lm_head"

Params = dict[str, Any]


def _names(path: tuple) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def is_quantized_weight(names: Sequence[str]) -> bool:
    """Whether the float param at ``names`` (its path of dict keys) is quantized: a
    `QUANTIZED_LINEARS` module's ``weight``, or the top-level (untied) ``lm_head``."""
    names = list(names)
    if names == [LM_HEAD]:
        return True
    return len(names) >= 2 and names[-1] == "weight" and names[-2] in QUANTIZED_LINEARS


def _check_weight(w: Any) -> None:
    if w.ndim < 2:
        raise ValueError(f"a quantized weight needs at least 2 axes ([.., out, in]), got shape {w.shape}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"only float weights are quantized, got dtype {w.dtype}")


def quantize_int8(w: Any) -> tuple[Any, Any]:
    """``w [.., out, in]`` (float) -> (int8 ``[.., out, in]``, float32 scale ``[.., out]``) by the
    module's rule, computed in float32; numpy in, numpy out (one float32 temporary of ``w``), a
    jax array in, jax arrays out (jitted). ValueError below 2 axes, TypeError for non-float."""
    _check_weight(w)
    if isinstance(w, jax.Array):
        return _quantize_jax(w)
    t = np.array(w, np.float32)  # the one temporary, worked on in place
    scale = np.maximum(t.max(axis=-1), -t.min(axis=-1)) * _INV_INT8_MAX
    t /= np.where(scale > 0, scale, np.float32(1))[..., None]
    np.rint(t, out=t)
    np.clip(t, -INT8_MAX, INT8_MAX, out=t)
    return t.astype(np.int8), scale.astype(np.float32)


@jax.jit
def _quantize_jax(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`quantize_int8`'s rule in jnp (the same float32 operations, so the same result)."""
    t = w.astype(jnp.float32)
    scale = jnp.maximum(t.max(axis=-1), -t.min(axis=-1)) * _INV_INT8_MAX
    q = jnp.round(t / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def dequantize_int8(q: Any, scale: Any, dtype: Any = np.float32) -> Any:
    """``q * scale`` (per output row) as ``dtype``: the float weight a quantized one stands for."""
    xp = jnp if isinstance(q, jax.Array) else np
    return (q.astype(xp.float32) * scale.astype(xp.float32)[..., None]).astype(dtype)


def quantization_of(params: Params) -> str | None:
    """The quantization a param tree (stacked or per-layer, arrays or ShapeDtypeStructs) holds:
    ``"int8"`` when any leaf is a `SCALE`, else None."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return INT8 if any(_names(path)[-1] == SCALE for path, _ in leaves) else None


def leaf_dtype(names: Sequence[str], declared: Any, model_dtype: Any) -> Any:
    """The dtype a loaded param leaf has: int8 weights and `SCALE` leaves keep theirs
    (``declared``: int8, float32); every other leaf has the model dtype."""
    if list(names)[-1] == SCALE or not jnp.issubdtype(declared, jnp.floating):
        return jnp.dtype(declared)
    return jnp.dtype(model_dtype)


def abstract_params(shapes: Params, model_dtype: Any) -> Params:
    """``shapes`` (`llama.param_shapes`) as ShapeDtypeStructs of the loaded dtypes (`leaf_dtype`)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, s: jax.ShapeDtypeStruct(s.shape, leaf_dtype(_names(p), s.dtype, model_dtype)),
        shapes)


def _map_quantizable(params: Params, fn: Any, prefix: tuple[str, ...] = ()) -> Params:
    """``params`` with each quantizable float leaf's dict entry replaced by the entries
    ``fn(names, leaf)`` returns, every other entry kept."""
    out: Params = {}
    for key, value in params.items():
        names = (*prefix, key)
        if isinstance(value, dict):
            out[key] = _map_quantizable(value, fn, names)
        elif is_quantized_weight(names):
            out.update(fn(names, value))
        else:
            out[key] = value
    return out


def quantize_params(params: Params, quantization: str | None) -> Params:
    """The float param tree (stacked or per-layer; numpy or jax leaves) with every quantizable
    weight quantized by ``quantization`` (None: ``params`` itself), one weight at a time; other
    leaves are passed through. ValueError when ``params`` is quantized already."""
    if check_quantization(quantization) is None:
        return params
    if quantization_of(params) is not None:
        raise ValueError("the params are quantized already")

    def quantize(names: tuple[str, ...], w: Any) -> Params:
        q, scale = quantize_int8(w)
        pair = {"weight": q, SCALE: scale}
        return {LM_HEAD: pair} if list(names) == [LM_HEAD] else pair

    return _map_quantizable(params, quantize)


def dequantize_params(params: Params, dtype: Any) -> Params:
    """The float param tree a quantized one stands for (each weight ``q * scale`` as ``dtype``,
    the untied head an array again); other leaves are passed through."""
    def walk(tree: Params, top: bool) -> Params:
        out: Params = {}
        for key, value in tree.items():
            if isinstance(value, dict) and SCALE in value:
                w = dequantize_int8(value["weight"], value[SCALE], dtype)
                if top and key == LM_HEAD:
                    out[key] = w
                    continue
                out[key] = {**{k: v for k, v in value.items() if k != SCALE}, "weight": w}
            else:
                out[key] = walk(value, False) if isinstance(value, dict) else value
        return out

    return walk(params, True)


def param_bytes(params: Params) -> int:
    """Total bytes of a param tree's leaves (arrays or ShapeDtypeStructs; global sizes, not
    per device): the weights' memory."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


__all__ = ["INT8", "SCALE", "QUANTIZED_LINEARS", "check_quantization", "is_quantized_weight",
           "quantize_int8", "dequantize_int8", "quantization_of", "leaf_dtype", "abstract_params",
           "quantize_params", "dequantize_params", "param_bytes"]

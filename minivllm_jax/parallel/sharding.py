"""Tensor parallelism over a one-axis ``jax.sharding.Mesh``: the one place for the mesh, the
partition rules of the param tree, KV-head replication, the KV-cache sharding, the shard_map'd
attention, and the multi-host step broadcast. ``N`` below is ``tensor_parallel_size``.

Weights (Megatron-style; GSPMD partitions the matmuls from these shardings):
- ``q/k/v_proj`` and ``gate/up_proj`` weights ``[L, out, E]`` (torch layout; and q/k/v biases
  ``[L, out]``, and int8 weights' scales ``[L, out]``) are split on their output axis; ``o_proj``
  and ``down_proj`` weights ``[L, E, in]`` on their input axis (their scales replicated). Each attention block and each MLP block therefore ends in one partial sum,
  i.e. one all-reduce of ``[E, T]``. ``o_proj``'s bias and all norm weights are replicated.
- Embedding and LM head are **vocab-split** (``embed_tokens [V, E]`` and ``lm_head [V, E]`` on
  V) when N divides V, else replicated. The vocab table is the largest single tensor of small
  models and of Llama 3 (128k x 4096), so splitting it saves (N-1)/N of it on every device. The
  lookup becomes a masked local gather plus one all-reduce of ``[T, E]``; the logits ``[S, V]``
  come out vocab-split. A plain greedy sampler (no logit bias, penalty, constraint, logprobs or
  draft: `step_programs`) reduces them where they are, an all-reduce of ``[S]`` for the max and
  one for its first index; every other sampler gathers them (replicated) first. Either way every
  device samples the same tokens from the same values.
- A dimension that N does not divide (e.g. an odd intermediate size) stays replicated.

KV heads: with H query heads, KVH kv heads and group ``g = H // KVH``, each device owns H/N
consecutive query heads. Let ``s = gcd(g, H/N)``; the sharded model uses ``KVH' = H/s`` kv heads,
expanded head ``e`` being a copy of original head ``e*s // g`` (its k/v projection columns are
repeated). Invariants: every query head ``i`` reads expanded head ``i // s``, a copy of its own
head ``i // g``; N divides KVH', and device ``d``'s local query head ``j`` reads its local kv head
``j // s`` -- the kernel's own GQA rule on the local shapes -- so attention needs no communication.
When N divides KVH, ``s = g`` and nothing is replicated.

KV cache ``[L, num_blocks, block_size, 2*KVH', D]`` is split on axis 3. K and V of head h sit at
2h and 2h+1, so a contiguous 1/N chunk holds whole K/V pairs: exactly the heads the device's
query heads read. Each device holds 1/N of the cache; the block table is shared by all. Attention runs per shard
under ``shard_map`` (``attention.paged_attention``); a multi-host run spans the global mesh
(``multihost.py``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from minivllm_jax.model_config import ModelConfig

MODEL_AXIS = "model"
Params = dict[str, Any]  # a model's Linen param tree

try:  # jax >= 0.7 (0.10 here, 0.11 on the GPU machine)
    from jax import shard_map as _shard_map

    def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
        """``f`` run per shard of ``mesh`` (replication unchecked)."""
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
except ImportError:  # older jax: the experimental API
    from jax.experimental.shard_map import shard_map as _shard_map

    def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
        """``f`` run per shard of ``mesh`` (replication unchecked)."""
        return _shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)

# param-tree module names whose kernel (and bias) is split on the output / input feature axis
_SPLIT_OUTPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_SPLIT_INPUT = ("o_proj", "down_proj")


# ---- validation and layout ---------------------------------------------------------------------
def check_tensor_parallel_size(tensor_parallel_size: int, num_attention_heads: int,
                               num_devices: int) -> None:
    """Raise ValueError unless ``tensor_parallel_size`` fits the devices and splits the heads."""
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
    if tp > num_devices:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {num_devices} available "
                         f"{jax.default_backend()} device(s); expected at most {num_devices}")
    if num_attention_heads % tp:
        divisors = [d for d in range(1, num_attention_heads + 1) if num_attention_heads % d == 0]
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_attention_heads "
                         f"({num_attention_heads}); expected one of {divisors}")


@dataclass(frozen=True)
class KVHeadLayout:
    """How N devices share the kv heads (see the module docstring for the invariants)."""

    num_q_heads: int
    num_kv_heads: int
    tensor_parallel_size: int

    @property
    def q_per_kv(self) -> int:
        """s: query heads per expanded kv head."""
        group = self.num_q_heads // self.num_kv_heads
        return math.gcd(group, self.num_q_heads // self.tensor_parallel_size)

    @property
    def num_expanded_kv_heads(self) -> int:
        return self.num_q_heads // self.q_per_kv

    def kv_head_map(self) -> np.ndarray:
        """Original kv head of each expanded head; the identity when nothing is replicated."""
        group = self.num_q_heads // self.num_kv_heads
        return np.arange(self.num_expanded_kv_heads) * self.q_per_kv // group


def kv_head_layout(config: ModelConfig, tensor_parallel_size: int) -> KVHeadLayout:
    return KVHeadLayout(config.num_attention_heads, config.num_key_value_heads, tensor_parallel_size)


def make_mesh(tensor_parallel_size: int, num_attention_heads: int,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh (axis ``"model"``) over the first ``tensor_parallel_size`` devices. In a
    multi-host run the mesh must span every device of every process."""
    devices = list(jax.devices() if devices is None else devices)
    check_tensor_parallel_size(tensor_parallel_size, num_attention_heads, len(devices))
    if jax.process_count() > 1 and tensor_parallel_size != len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: a multi-host run "
                         f"({jax.process_count()} processes) expects tensor_parallel_size equal to "
                         f"the global device count ({len(devices)})")
    return Mesh(np.array(devices[:tensor_parallel_size]), (MODEL_AXIS,))


# ---- weights -----------------------------------------------------------------------------------
def _names(path: tuple) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def param_spec(path: tuple, shape: tuple[int, ...], tensor_parallel_size: int) -> P:
    """The PartitionSpec of one param leaf (layer-stacked or not) under the rules above. A
    quantized weight's ``scale [.., out]`` (models/quantization.py) is split like a bias: with
    its weight's output axis where that is split (q/k/v, gate/up, the LM head), else replicated
    (o/down)."""
    names = _names(path)
    axis = None
    if names[0] in ("embed_tokens", "lm_head"):  # a quantized head's lm_head/{weight, scale} too
        axis = 0
    elif len(names) >= 2 and names[-2] in _SPLIT_OUTPUT:  # weight [.., out, in], bias [.., out]
        axis = len(shape) - (2 if names[-1] == "weight" else 1)
    elif len(names) >= 2 and names[-2] in _SPLIT_INPUT and names[-1] == "weight":
        axis = len(shape) - 1
    if axis is None or shape[axis] % tensor_parallel_size:
        return P()
    return P(*(MODEL_AXIS if i == axis else None for i in range(len(shape))))


def replicate_kv_heads(params: Params, layout: KVHeadLayout, head_dim: int) -> Params:
    """Host params with k/v projection output rows repeated per ``layout.kv_head_map()``: the
    weights' rows, and the biases' and quantized weights' scales' entries."""
    heads = layout.kv_head_map()
    if len(heads) == layout.num_kv_heads:
        return params

    def expand(path: tuple, leaf: np.ndarray) -> np.ndarray:
        names = _names(path)
        if len(names) < 2 or names[-2] not in ("k_proj", "v_proj"):
            return leaf
        axis = leaf.ndim - (2 if names[-1] == "weight" else 1)  # the output axis
        split = leaf.reshape(*leaf.shape[:axis], layout.num_kv_heads, head_dim, *leaf.shape[axis + 1:])
        out = np.take(split, heads, axis=axis)
        return out.reshape(*leaf.shape[:axis], len(heads) * head_dim, *leaf.shape[axis + 1:])

    return jax.tree_util.tree_map_with_path(expand, params)


def put_global(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds in full (works multi-host)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def sharded_model_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The model as tensor parallelism runs it: kv heads expanded per ``KVHeadLayout``."""
    if tensor_parallel_size == 1:
        return config
    layout = kv_head_layout(config, tensor_parallel_size)
    return dataclasses.replace(config, num_key_value_heads=layout.num_expanded_kv_heads)


def shard_model(config: ModelConfig, params: Params, mesh: Mesh) -> tuple[ModelConfig, Params]:
    """(config, params) for the sharded model: kv heads expanded per ``KVHeadLayout`` (the
    returned config's ``num_key_value_heads`` is KVH'), every leaf placed by ``param_spec``."""
    tp = mesh.size
    host = jax.tree.map(np.asarray, params)
    host = replicate_kv_heads(host, kv_head_layout(config, tp), config.head_dim)
    config = sharded_model_config(config, tp)
    sharded = jax.tree_util.tree_map_with_path(
        lambda path, leaf: put_global(leaf, NamedSharding(mesh, param_spec(path, leaf.shape, tp))), host)
    return config, sharded


# ---- KV cache and attention --------------------------------------------------------------------
def kv_cache_spec() -> P:
    """Split the stacked cache's head axis, axis 3 in every layout (after the layer, block and
    block-offset axes: the combined K/V heads, or the TPU layout's packed head groups)."""
    return P(None, None, None, MODEL_AXIS)


def put_replicated(host: np.ndarray, mesh: Mesh | None) -> jax.Array:
    """A host array as a device array, whole on every device of ``mesh`` (the default device
    without a mesh)."""
    return jnp.asarray(host) if mesh is None else put_global(host, NamedSharding(mesh, P()))


def replicate(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Constrain ``x`` to be whole on every device of ``mesh`` (no-op without a mesh)."""
    return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def vocab_split_logits(logits: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Logits ``[S, V]`` pinned vocab-split (when N divides V, as the LM head is), where the LM
    head makes them: a reduction over the vocabulary then runs per shard plus an all-reduce of
    ``[S]``, and a gather moves the logits, never the LM head."""
    if mesh is None or logits.shape[-1] % mesh.size:
        return logits
    split = NamedSharding(mesh, P(*([None] * (logits.ndim - 1)), MODEL_AXIS))
    return jax.lax.with_sharding_constraint(logits, split)


def gather_logits(logits: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Logits ``[S, V]`` replicated for sampling (all-gathered from `vocab_split_logits`)."""
    return logits if mesh is None else replicate(vocab_split_logits(logits, mesh), mesh)


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated result as numpy, reading only this process's copy (works multi-host)."""
    return np.asarray(x.addressable_data(0))

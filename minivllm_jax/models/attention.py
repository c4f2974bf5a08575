"""Paged attention: the one interface between the model and the attention backends.

Every backend is a function with docs/API.md §2's signature, `(q, kv_cache, kv_lens,
block_tables, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, interpret,
block_offset) -> out`, over a cache `[num_blocks, block_size, 2 * KVH, D]` (the TPU kernel's:
its own layout, `pallas_kernels.tpu_layout`, with the same block and slot addressing) whose
blocks from `block_offset` on are one layer's. A step's K/V are first written at
`slot_mapping`, then every query row attends to its sequence's cache up to its own position:
`step_attention` gives, per backend (its record in `backends.py`), the one function that does
both (`write_kv_cache` then the kernel, or a kernel that writes inside itself) and returns the
output and the cache.

Invariants:
- A step program never picks a kernel at run time: the step's kind (`pallas_kernels.STEP_KINDS`)
  is chosen on the host (`step_layout.step_kind`, the backend's rule) and is static in
  `AttentionMetadata`.
- The kernel's per-step metadata (tiles, work lists, gather indices) is computed once per step,
  before the layer loop (`with_kernel_metadata`), and read by every layer.
- The step's block table and slot mapping reach every layer's kernel as they are: a layer is
  addressed by the kernel's scalar `block_offset`, never by a shifted copy of the table.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import pallas_kernels
from minivllm_jax.parallel import sharding
from minivllm_jax.backends import ATTENTION_BACKENDS, TPU_PACKED
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.plan import ModelPlan
from pallas_kernels import MIXED


class StepAttention(Protocol):
    """Write ``k, v`` at ``slot_mapping``, then attend; returns ``(out, kv_cache)``. Every block
    id, of ``block_tables`` and of ``slot_mapping``, is relative to block ``block_offset`` (an
    int32 scalar) of ``kv_cache``: slot ``s >= 0`` is token ``s % block_size`` of block
    ``block_offset + s // block_size``."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                 slot_mapping: jax.Array, kv_lens: jax.Array, block_tables: jax.Array,
                 cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                 sliding_window: int | None, soft_cap: float | None,
                 interpret: bool | None, kind: str, block_offset: jax.Array | int = 0,
                 **metadata: Any) -> tuple[jax.Array, jax.Array]: ...


def step_attention(backend: str) -> StepAttention:
    """The backend's kernel (`backends.ATTENTION_BACKENDS`), writing the step's K/V first
    (`write_kv_cache`) unless the kernel writes them itself."""
    record = ATTENTION_BACKENDS[backend]
    kernel = getattr(pallas_kernels, record.kernel)
    if record.writes_kv:
        return kernel

    def step(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
             slot_mapping: jax.Array, *meta: jax.Array, block_offset: jax.Array | int = 0,
             **opts: object) -> tuple[jax.Array, jax.Array]:
        kv_cache = pallas_kernels.write_kv_cache(kv_cache, k, v, slot_mapping, block_offset)
        return kernel(q, kv_cache, *meta, block_offset=block_offset, **opts), kv_cache
    return step


@flax.struct.dataclass
class AttentionMetadata:
    """Per-step paged-attention metadata; a pytree of int32 device arrays.

    Query row ``cu_q_lens[s] + j`` of sequence ``s`` sits at position ``kv_lens[s] - q_len_s + j``.
    Rows at or past ``cu_q_lens[num_seqs[0]]`` are padding: their slot is -1 (nothing written) and
    their outputs are garbage the caller ignores. ``kind`` (static) is the host's promise about
    the batch (`step_layout.step_kind`); ``kernel`` the backend kernel's per-step metadata
    (`with_kernel_metadata`; None: each layer's kernel derives it).
    """

    slot_mapping: jax.Array  # [T_pad] cache slot (block_id * block_size + offset); -1 = padding
    block_tables: jax.Array  # [max_num_seqs, max_blocks_per_seq]
    kv_lens: jax.Array       # [max_num_seqs] tokens in cache per sequence, this step's included
    cu_q_lens: jax.Array     # [max_num_seqs + 1]
    num_seqs: jax.Array      # [1]
    kernel: Any = None
    kind: str = flax.struct.field(pytree_node=False, default=MIXED)


def with_kernel_metadata(md: AttentionMetadata, num_tokens: int, kv_cache: jax.Array,
                         model_dtype: Any, *, config: ModelConfig, plan: ModelPlan,
                         mesh: Mesh | None = None) -> AttentionMetadata:
    """``md`` with the backend kernel's per-step metadata (`AttentionBackend.metadata`) for a
    step of ``num_tokens`` rows over the stacked ``kv_cache``, as each layer's kernel sees its
    inputs (on one device's share of the heads under a mesh): computed once, before the layers."""
    record = ATTENTION_BACKENDS[plan.attention_backend]
    if record.metadata is None:
        return md
    devices = 1 if mesh is None else mesh.size
    num_layers, num_blocks, *per_block = kv_cache.shape
    per_block[1] //= devices                          # the head axis is split over the mesh
    cache = jax.ShapeDtypeStruct((num_layers * num_blocks, *per_block), kv_cache.dtype)
    q = jax.ShapeDtypeStruct((num_tokens, config.num_attention_heads // devices, config.head_dim),
                             kernel_q_dtype(model_dtype, kv_cache.dtype))
    heads = {"num_kv_heads": config.num_key_value_heads // devices} \
        if record.cache_layout == TPU_PACKED else {}  # a padded layout may fit two head counts
    kernel = getattr(pallas_kernels, record.metadata)(
        q, cache, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
        sliding_window=config.sliding_window, kind=md.kind, **heads)
    return md.replace(kernel=kernel)


def kernel_q_dtype(model_dtype: Any, cache_dtype: Any) -> Any:
    """The queries' dtype in the kernel: the cache's (a float32 cache under a 16-bit model on
    the CPU lifts them), except an 8-bit cache's, which the kernel reads upcast to the model's."""
    return model_dtype if cache_dtype in pallas_kernels.QUANTIZED_KV_DTYPES else cache_dtype


@functools.lru_cache(maxsize=None)
def kv_rotation(head_dim: int) -> np.ndarray:
    """The orthogonal ``[D, D]`` matrix ``R`` (float32) under which an 8-bit cache holds each
    head's ``k @ R`` and ``v @ R``: the normalized Sylvester-Hadamard matrix when ``D`` is a
    power of two, else the orthogonal factor of a seed-0 Gaussian matrix. Scores are unchanged
    (``(q R)(k R)^T = q k^T``) and ``out = (p (v R)) R^T``; the rotation spreads a head's few
    large channels over all ``D``, so e4m3's per-value rounding averages out in each dot product
    instead of landing on the channels that carry it (docs/benchmarks.md, "Quantization")."""
    if head_dim & (head_dim - 1) == 0:
        r = np.ones((1, 1))
        while r.shape[0] < head_dim:
            r = np.block([[r, r], [r, -r]])
        return (r / np.sqrt(head_dim)).astype(np.float32)
    q, upper = np.linalg.qr(np.random.default_rng(0).standard_normal((head_dim, head_dim)))
    return (q * np.sign(np.diag(upper))).astype(np.float32)


def _rotate(x: jax.Array, r: np.ndarray) -> jax.Array:
    """``x [..., D] @ r`` in float32 (full precision), as ``x``'s dtype."""
    y = jnp.einsum("...d,de->...e", x.astype(jnp.float32), jnp.asarray(r),
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                    md: AttentionMetadata, layer: jax.Array | int, *, plan: ModelPlan,
                    sm_scale: float, sliding_window: int | None,
                    mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """Write layer ``layer``'s ``k, v [T, KVH, D]`` into the stacked cache ``[L, num_blocks,
    block_size, ...]`` (one layer's cache in the backend's layout after the layer axis) and
    attend ``q [T, H, D]`` with ``plan.attention_backend``; returns ``(out [T, H, D] in q's
    dtype, cache)``.

    Layer ``i`` is addressed in place: the stack is viewed (a free reshape) as one cache of
    ``L*num_blocks`` blocks, which the backend addresses with ``block_offset=i*num_blocks`` (the
    table and the slots stay as they are, never copied shifted), so under a donated cache each
    layer's write is an in-place scatter. With a tensor-parallel ``mesh`` each device runs this
    on its own KV heads for its own query heads (``shard_map``; no collective).
    The kernel sees q, k and v in `kernel_q_dtype`, here alone (k and v become the cache's
    dtype as they are written; an 8-bit cache quantizes them there). An 8-bit cache holds K and V rotated
    by `kv_rotation` (q rotated alike, the output rotated back), so the output is the same
    function of q, k, v as with a float cache.
    """
    out_dtype, dtype = q.dtype, kernel_q_dtype(q.dtype, kv_cache.dtype)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    rotation = kv_rotation(q.shape[-1]) if kv_cache.dtype in pallas_kernels.QUANTIZED_KV_DTYPES \
        else None
    if rotation is not None:
        q, k, v = (_rotate(x, rotation) for x in (q, k, v))
    out, kv_cache = _sharded_attention(q, k, v, kv_cache, md, layer, plan=plan, sm_scale=sm_scale,
                                       sliding_window=sliding_window, mesh=mesh)
    return (out if rotation is None else _rotate(out, rotation.T)).astype(out_dtype), kv_cache


def _sharded_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                       md: AttentionMetadata, layer: jax.Array | int, *, plan: ModelPlan,
                       sm_scale: float, sliding_window: int | None,
                       mesh: Mesh | None) -> tuple[jax.Array, jax.Array]:
    attend = _local_attention(plan, sm_scale, sliding_window)
    layer = jnp.asarray(layer, jnp.int32)
    if mesh is None:
        return attend(q, k, v, kv_cache, md, layer)
    heads = P(None, sharding.MODEL_AXIS, None)
    cache = sharding.kv_cache_spec()
    return sharding.shard_map(attend, mesh, (heads, heads, heads, cache, P(), P()),
                              (heads, cache))(q, k, v, kv_cache, md, layer)


def _local_attention(plan: ModelPlan, sm_scale: float, sliding_window: int | None
                     ) -> Callable[..., tuple[jax.Array, jax.Array]]:
    step = step_attention(plan.attention_backend)
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=None,
                interpret=plan.interpret)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
               md: AttentionMetadata, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        num_layers, num_blocks = kv_cache.shape[:2]
        flat = kv_cache.reshape(num_layers * num_blocks, *kv_cache.shape[2:])
        kernel = {} if md.kernel is None else {"metadata": md.kernel}
        out, flat = step(q, k, v, flat, md.slot_mapping, md.kv_lens, md.block_tables,
                         md.cu_q_lens, md.num_seqs, kind=md.kind,
                         block_offset=layer * num_blocks, **kernel, **opts)
        return out, flat.reshape(kv_cache.shape)

    return attend

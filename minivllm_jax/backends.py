"""The attention backends, one record each (the only place their facts are written), and the
model's layer layouts.

A record says which `pallas_kernels` function a backend runs, which function computes its
per-step metadata (once a step, before the layer loop) and which pair classifies steps into the
kinds it compiles apart (`pallas_kernels.STEP_KINDS`), whether that kernel writes the step's K/V
itself (else `write_kv_cache` runs first), the smallest token and sampled-row buckets it takes,
the bound on its cache size, its cache layout, and on which platforms it compiles natively
(elsewhere it runs in Pallas interpret mode) or is the automatic choice. This module
imports no JAX, so the command line lists the choices before JAX starts.
"""
from __future__ import annotations

from dataclasses import dataclass

# the model's layer layouts (models/llama.py): stacked, nn.scan over [L, ...] params; switched,
# a scan whose body picks layer i's own arrays through lax.switch
LAYER_LAYOUTS = ("stacked", "switched")
# the KV-cache layouts a backend reads: per layer [num_blocks, block_size, 2 * KVH, head_dim],
# K of kv head h at combined head 2h and V at 2h+1 (docs/API.md §2)
COMBINED_HEADS = "combined-heads"
# the TPU kernels' (docs/API.md §2a, pallas_kernels.tpu_layout): per layer [num_blocks,
# block_size, 2 * KVH // packing, packing, head_dim padded to 128], packing = 4 // itemsize
TPU_PACKED = "tpu-packed"


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend. `int32_offsets`: the kernel addresses the flat all-layer cache
    with int32 offsets, so the cache holds fewer than 2**31 elements. `min_buckets`: (token
    rows, sampled rows) a step is padded to at least. `metadata`: the `pallas_kernels` function
    of the kernel's per-step metadata (None: the kernel has none). `step_kind`, `step_kinds`:
    the functions `(q_lens, num_tokens) -> kind` and `(num_tokens) -> kinds` of a kernel that
    compiles kinds apart (None: every step is "mixed"). `check_shapes`: the function
    `(num_tokens, max_num_seqs, max_blocks_per_seq) -> None` that raises ValueError, before
    anything compiles, for step shapes the kernel cannot hold (None: no such limit)."""

    name: str
    kernel: str
    writes_kv: bool
    min_buckets: tuple[int, int]
    native_on: tuple[str, ...]
    auto_on: tuple[str, ...] = ()
    int32_offsets: bool = False
    cache_layout: str = COMBINED_HEADS
    metadata: str | None = None
    step_kind: str | None = None
    step_kinds: str | None = None
    check_shapes: str | None = None

    def interpret_on(self, platform: str) -> bool:
        """Whether the kernel runs in Pallas interpret mode on `platform` (a Pallas kernel off
        its own platform; the XLA and reference backends never)."""
        return platform not in self.native_on


_ALL = ("cpu", "gpu", "tpu")

# Why these buckets: Triton dots need every dimension >= 16; on the CPU, small decode batches
# are weight-streaming bound and 4 rows stream fastest; TPU vregs hold 8 sublanes.
ATTENTION_BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (
    # the tuned XLA work-list attention: the CPU's
    AttentionBackend("xla", "ragged_paged_attention_xla", False, (4, 4), _ALL, auto_on=("cpu",),
                     metadata="ragged_paged_attention_xla_metadata", step_kind="xla_step_kind",
                     step_kinds="xla_step_kinds"),
    # the Pallas (Triton) GPU kernel
    AttentionBackend("pallas", "ragged_paged_attention", False, (16, 8), ("gpu",), auto_on=("gpu",),
                     int32_offsets=True, metadata="ragged_paged_attention_metadata",
                     step_kind="pallas_step_kind", step_kinds="pallas_step_kinds"),
    # the plain-jnp ground truth
    AttentionBackend("reference", "ragged_paged_attention_reference", False, (4, 4), _ALL),
    # the Pallas TPU (Mosaic) kernel, the cache write fused in
    AttentionBackend("pallas-tpu", "ragged_paged_attention_tpu_update", True, (8, 8), ("tpu",),
                     auto_on=("tpu",), cache_layout=TPU_PACKED,
                     metadata="ragged_paged_attention_tpu_metadata", check_shapes="check_smem"),
)}


def backend_for(name: str, platform: str) -> AttentionBackend:
    """The record of `name`, or with "auto" the platform's own backend (xla where none is)."""
    if name == "auto":
        return next((b for b in ATTENTION_BACKENDS.values() if platform in b.auto_on),
                    ATTENTION_BACKENDS["xla"])
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {tuple(ATTENTION_BACKENDS)}, "
                         f"got {name!r}")
    return ATTENTION_BACKENDS[name]

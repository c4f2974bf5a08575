"""Attention over the paged KV cache (docs/API.md §2), one function per backend with one
signature: the Pallas kernels (Triton on NVIDIA GPUs, Mosaic on TPUs), the XLA path tuned for CPU,
and the plain-jnp reference that is the ground truth for all; plus the cache write and its slot
formula (and the TPU kernel's variant that writes the step's K/V itself).

Each backend also takes a static ``kind`` (`STEP_KINDS`: what the caller knows about the batch,
so no kernel is picked at run time; `*_step_kind` is the host's rule, `*_step_kinds` the kinds a
bucket compiles apart); the kernels (not the reference) take a ``metadata`` argument: their
`*_metadata` function's result for the same arguments, computed once per step and shared by every
layer's call. Each backend takes a ``block_offset`` too (an int32 scalar, default 0): the block
ids it reads from ``block_tables`` (and the TPU fused write's slots) address block
``block_offset + id`` of ``kv_cache``, so one layer of a stacked cache viewed as one is addressed
without a shifted copy of the table."""
from pallas_kernels.common import (DECODE, FP8_BYTES, MIXED, PREFILL, QUANTIZED_KV_DTYPES,
                                   STEP_KINDS, kv_values, validate_attention_inputs)
from pallas_kernels.kv_cache import slot_of, write_kv_cache
from pallas_kernels.ragged_paged_attention import (TileConfig, pallas_step_kind, pallas_step_kinds,
                                                   ragged_paged_attention,
                                                   ragged_paged_attention_metadata)
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.tpu_attention import (TpuTiles, check_smem, ragged_paged_attention_tpu,
                                          ragged_paged_attention_tpu_metadata,
                                          ragged_paged_attention_tpu_update)
from pallas_kernels.tpu_layout import from_tpu_kv_cache, to_tpu_kv_cache, tpu_kv_cache_shape
from pallas_kernels.xla_attention import (ragged_paged_attention_xla,
                                          ragged_paged_attention_xla_metadata, xla_step_kind,
                                          xla_step_kinds)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference",
           "ragged_paged_attention_xla", "write_kv_cache", "slot_of", "validate_attention_inputs",
           "TileConfig", "ragged_paged_attention_tpu", "ragged_paged_attention_tpu_update",
           "TpuTiles", "check_smem", "tpu_kv_cache_shape", "to_tpu_kv_cache", "from_tpu_kv_cache",
           "ragged_paged_attention_metadata", "ragged_paged_attention_xla_metadata",
           "ragged_paged_attention_tpu_metadata", "pallas_step_kind", "pallas_step_kinds",
           "xla_step_kind", "xla_step_kinds", "MIXED", "DECODE", "PREFILL", "STEP_KINDS", "QUANTIZED_KV_DTYPES",
           "FP8_BYTES", "kv_values"]

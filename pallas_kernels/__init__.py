"""Attention over the paged KV cache (CONTRACT section 2), one function per backend with one
signature: the Pallas kernels (Triton on NVIDIA GPUs, Mosaic on TPUs), the XLA path tuned for CPU,
and the plain-jnp reference that is the ground truth for all; plus the cache write and its slot
formula (and the TPU kernel's variant that writes the step's K/V itself)."""
from pallas_kernels.common import validate_attention_inputs
from pallas_kernels.kv_cache import slot_of, write_kv_cache
from pallas_kernels.ragged_paged_attention import TileConfig, ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.tpu_attention import (TpuTiles, ragged_paged_attention_tpu,
                                          ragged_paged_attention_tpu_update)
from pallas_kernels.tpu_layout import from_tpu_kv_cache, to_tpu_kv_cache, tpu_kv_cache_shape
from pallas_kernels.xla_attention import ragged_paged_attention_xla

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference",
           "ragged_paged_attention_xla", "write_kv_cache", "slot_of", "validate_attention_inputs",
           "TileConfig", "ragged_paged_attention_tpu", "ragged_paged_attention_tpu_update",
           "TpuTiles", "tpu_kv_cache_shape", "to_tpu_kv_cache", "from_tpu_kv_cache"]

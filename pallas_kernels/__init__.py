"""Attention over the paged KV cache: the Pallas kernel, its plain-jnp reference, the cache write."""
from pallas_kernels.kv_cache import slot_of, write_kv_cache
from pallas_kernels.ragged_paged_attention import TileConfig, ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference, validate_attention_inputs

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "write_kv_cache",
           "slot_of", "validate_attention_inputs", "TileConfig"]

"""Model definitions: every supported architecture runs on the one Llama-family decoder."""
from minivllm_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from minivllm_jax.models.llama import (LlamaForCausalLM, init_kv_cache, kv_cache_bytes_per_block,
                                       param_shapes, unstack_layers)


def get_model(config: ModelConfig, attn_backend: str = "reference",
              interpret: bool | None = None) -> LlamaForCausalLM:
    """The Linen module for ``config.architecture`` (ValueError, listing them, if unsupported)."""
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: "
                         f"{sorted(SUPPORTED_ARCHITECTURES)}")
    return LlamaForCausalLM(config, attn_backend, interpret)


__all__ = ["ModelConfig", "LlamaForCausalLM", "SUPPORTED_ARCHITECTURES", "get_model",
           "init_kv_cache", "kv_cache_bytes_per_block", "param_shapes", "unstack_layers"]

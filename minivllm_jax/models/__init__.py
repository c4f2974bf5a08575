"""Model definitions: every supported architecture runs on the one Llama-family decoder."""
from minivllm_jax.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from minivllm_jax.models.llama import LlamaForCausalLM, param_shapes, unstack_layers

__all__ = ["ModelConfig", "LlamaForCausalLM", "SUPPORTED_ARCHITECTURES", "param_shapes",
           "unstack_layers"]

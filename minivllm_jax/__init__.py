"""minivllm-jax: a compact vLLM-V1-style LLM inference engine in JAX."""
from minivllm_jax.llm import LLM
from minivllm_jax.outputs import CompletionOutput, RequestOutput, StepDelta
from scheduler import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StepDelta"]

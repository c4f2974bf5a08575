"""minivllm-jax: a compact vLLM-V1-style LLM inference engine in JAX.

`LLM` is imported on first use (PEP 562), so importing the package, or minivllm_jax.cli, imports
no jax: a launcher can pick the platform before jax starts."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minivllm_jax.outputs import CompletionOutput, RequestOutput, StepDelta
from scheduler import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from minivllm_jax.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "StepDelta"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from minivllm_jax.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

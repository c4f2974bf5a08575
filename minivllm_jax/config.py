"""Engine configuration: every knob the LLM constructor takes, validated in one place.

`EngineConfig` holds what the user asked for (None meaning "pick a default"); `resolve` fills the
defaults that depend on the model and returns a config whose every size is a concrete int.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from scheduler import POLICIES as SCHEDULING_POLICIES

ATTENTION_BACKENDS = ("auto", "pallas", "reference")
LAYER_LAYOUTS = ("stacked", "switched", "unrolled")  # models/llama.py's module docstring
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Invariants after `__post_init__`: all given sizes are positive ints,
    block_size is a power of two, max_num_batched_tokens >= max_num_seqs, and without chunked
    prefill max_num_batched_tokens >= max_model_len (whichever are known)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    seed: int = 0
    attention_backend: str = "auto"
    cache_dir: str | None = None
    cpu_kv_cache_bytes: int = 256 << 20  # cap on the KV cache when sized automatically on CPU
    # one of LAYER_LAYOUTS (models/llama.py); switched and unrolled need one device. None:
    # switched on one CPU device, else stacked (runner.resolve_layer_layout)
    layer_layout: str | None = None
    # schedule and dispatch step N+1 before collecting step N (engine.py); None: on for
    # accelerators, off on CPU, where host and XLA share the same cores (docs/benchmarks.md)
    async_scheduling: bool | None = None
    # on the CPU backend with glibc: malloc settings that let XLA reuse each step's memory
    # instead of faulting it in afresh (host_malloc.py; process-wide, kept until exit)
    tune_cpu_malloc: bool = True
    # engine replicas over one set of weights, stepped side by side from host threads; CPU
    # backend only (dp_engine.py: they use the core XLA:CPU's one-core ops leave idle)
    data_parallel_size: int = 1
    # the scheduler's queue order (SchedulerConfig.policy, vLLM's name): "fcfs", or "priority"
    # (requests with a lower `priority` value first, then earlier arrivals; preemption takes
    # the running request with the largest (priority, arrival time))
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 2 if name == "max_model_len" else 1)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 2)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 needs tensor_parallel_size == 1 "
                             "(replicas share one device)")
        _check_int("seed", self.seed, 0)
        _check_int("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes, 1)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(
                self.gpu_memory_utilization, (int, float)):
            raise TypeError("gpu_memory_utilization must be a float in (0, 1]")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if not isinstance(self.dtype, str):
            raise TypeError(f"dtype must be a string such as 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "tune_cpu_malloc"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool")
        if self.layer_layout is not None and not isinstance(self.layer_layout, str):
            raise TypeError(f"layer_layout must be one of {LAYER_LAYOUTS} or None (auto), "
                            f"got {type(self.layer_layout).__name__}")
        if self.layer_layout is not None and self.layer_layout not in LAYER_LAYOUTS:
            raise ValueError(f"layer_layout must be one of {LAYER_LAYOUTS} or None (auto), "
                             f"got {self.layer_layout!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError("async_scheduling must be a bool or None (auto), "
                            f"got {type(self.async_scheduling).__name__}")
        if self.layer_layout not in (None, "stacked") and self.tensor_parallel_size > 1:
            raise ValueError(f"layer_layout={self.layer_layout!r} needs tensor_parallel_size == 1 "
                             "(tensor parallelism runs stacked layers)")
        tokens, seqs, length = self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len
        if tokens is not None and tokens < seqs:
            raise ValueError(f"max_num_batched_tokens ({tokens}) must be >= max_num_seqs ({seqs})")
        if (not self.enable_chunked_prefill and tokens is not None and length is not None
                and tokens < length):
            raise ValueError(f"max_num_batched_tokens ({tokens}) must be >= max_model_len ({length}) "
                             "when enable_chunked_prefill is False")

    def resolve(self, max_position_embeddings: int) -> "EngineConfig":
        """Fill max_model_len and max_num_batched_tokens for a model with that context length."""
        if self.max_model_len is not None and self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({max_position_embeddings})")
        length = self.max_model_len or min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        tokens = self.max_num_batched_tokens
        if tokens is None:
            tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
            if not self.enable_chunked_prefill:
                tokens = max(tokens, length)
        return dataclasses.replace(self, max_model_len=length, max_num_batched_tokens=tokens)

    @property
    def max_blocks_per_seq(self) -> int:
        assert self.max_model_len is not None, "resolve() first"
        return -(-self.max_model_len // self.block_size)

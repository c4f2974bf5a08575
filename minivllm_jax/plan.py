"""The execution plan: every platform-dependent choice of how the engine runs, made in one place.

`make_plan` reads the user's `EngineConfig`, the model's dtype and the platform, and decides the
attention backend, the layer layout, which projections run feature-major, the KV-cache dtype, the
async-scheduling default, the bucket minimums and how the number of KV blocks is chosen. Nothing
below it (runner, model, kernels) looks at the platform again; the model reads only `ModelPlan`.
The figures behind each choice are in docs/benchmarks.md ("Design measurements").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from minivllm_jax.backends import (ATTENTION_BACKENDS, COMBINED_HEADS, LAYER_LAYOUTS, AttentionBackend,
                                   backend_for)
from minivllm_jax.config import KV_CACHE_DTYPES

if TYPE_CHECKING:  # the plan reads the engine's config; the model imports this module
    from minivllm_jax.config import EngineConfig

# float32 projections of at most this many rows run feature-major on the CPU (models/llama.py
# `project`): XLA:CPU streams the weights faster that way at decode sizes
CPU_FEATURE_MAJOR_ROWS = 256


def current_platform() -> str:
    """The platform JAX runs on ("cpu", "gpu" or "tpu"): the one place the engine asks; the
    plan records the answer and everything below reads the plan."""
    return jax.default_backend()


def auto_dtype(platform: str, checkpoint_dtype: str | None = None) -> str:
    """The weights' dtype for ``dtype="auto"``: float32 on the CPU; on an accelerator the
    checkpoint's float16 or bfloat16, else bfloat16."""
    if platform == "cpu":
        return "float32"
    return "float16" if checkpoint_dtype == "float16" else "bfloat16"


TPU_LANES = 128  # a TPU vector register's minor dimension


@dataclass(frozen=True)
class ModelPlan:
    """How the model's forward runs; hashable, so it keys the jitted programs.

    `interpret`: run the attention kernel in Pallas interpret mode (`make_plan`: a Pallas
    kernel off its own platform)."""

    attention_backend: str = "xla"
    layer_layout: str = "stacked"
    feature_major_rows: int = 0
    interpret: bool = False
    # EngineConfig.quantization: None, or "int8" (the linear layers hold int8 weights and scales)
    quantization: str | None = None
    # the embedding table's rows zero-padded to a multiple of this many values (0: unpadded). The
    # TPU's 128 lanes: there a [V, E] table with E not a multiple of 128 (SmolLM2's 576) gets a
    # column-major default layout, which every forward copied whole to gather its rows
    embed_lanes: int = 0

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {tuple(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.layer_layout not in LAYER_LAYOUTS:
            raise ValueError(f"layer_layout must be one of {LAYER_LAYOUTS}, got {self.layer_layout!r}")


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything `make_plan` decided. `kv_cache_bytes` is the byte budget of an automatically
    sized KV cache (the CPU's), None where free device memory is profiled instead (accelerators);
    a given `EngineConfig.num_kv_blocks` overrides both. `early_host_copy`: start copying a
    step's sampled ids to the host as soon as its sampler is launched (accelerators; on the CPU
    the host reads them where they are, and the call costs host time). `multi_host`: the run
    spans several processes (process 0 schedules and broadcasts each step's header).
    `host_views`: the switched layout's per-layer weights are numpy views of the stacked ones
    (the CPU, where device memory is host memory), not copies."""

    platform: str
    backend: AttentionBackend
    model: ModelPlan
    kv_cache_dtype: str
    async_scheduling: bool
    kv_cache_bytes: int | None
    early_host_copy: bool = True
    multi_host: bool = False
    host_views: bool = False

    @property
    def kv_cache_storage(self) -> str:
        """The cache array's dtype: `kv_cache_dtype`, except an fp8 cache of the combined-heads
        layout on the CPU, kept as its bytes (uint8, `pallas_kernels.kv_values`): XLA:CPU has no
        float8 scatter and would convert the whole cache at every layer's write."""
        if (self.platform == "cpu" and self.kv_cache_dtype == "float8_e4m3fn"
                and self.backend.cache_layout == COMBINED_HEADS):
            return "uint8"
        return self.kv_cache_dtype

    @property
    def min_buckets(self) -> tuple[int, int]:
        """The smallest (token rows, sampled rows) buckets of a step (the backend's)."""
        return self.backend.min_buckets


def kv_cache_dtype(model_dtype: DTypeLike, platform: str, asked: str = "auto") -> str:
    """An 8-bit cache when `asked` (`EngineConfig.kv_cache_dtype`) names one; else the model's
    dtype, except float32 for a 16-bit model on the CPU: XLA:CPU has no 16-bit scatter or gather
    and would convert the whole cache around every layer's write and read."""
    if KV_CACHE_DTYPES[asked] is not None:
        return KV_CACHE_DTYPES[asked]
    dtype = jnp.dtype(model_dtype)
    if platform == "cpu" and dtype.itemsize < 4:
        return "float32"
    return dtype.name


def make_plan(config: "EngineConfig", model_dtype: DTypeLike, platform: str,
              num_processes: int = 1) -> ExecutionPlan:
    """The plan for `config` on `platform` ("cpu", "gpu" or "tpu") in a run of `num_processes`
    processes; "auto"/None knobs resolved:
    the Pallas kernels on GPUs and TPUs, XLA attention on the CPU; switched
    layers on one CPU device, stacked ones elsewhere; async scheduling off on the CPU, whose
    host and "device" share the same cores."""
    cpu = platform == "cpu"
    backend = backend_for(config.attention_backend, platform)
    layout = config.layer_layout or ("switched" if cpu and config.tensor_parallel_size == 1
                                     else "stacked")
    async_scheduling = not cpu if config.async_scheduling is None else config.async_scheduling
    return ExecutionPlan(
        platform=platform,
        backend=backend,
        model=ModelPlan(backend.name, layout, CPU_FEATURE_MAJOR_ROWS if cpu else 0,
                        interpret=backend.interpret_on(platform),
                        quantization=config.quantization,
                        embed_lanes=TPU_LANES if platform == "tpu" else 0),
        kv_cache_dtype=kv_cache_dtype(model_dtype, platform, config.kv_cache_dtype),
        async_scheduling=async_scheduling,
        kv_cache_bytes=config.cpu_kv_cache_bytes if cpu else None,
        early_host_copy=not cpu,
        multi_host=num_processes > 1,
        host_views=cpu)

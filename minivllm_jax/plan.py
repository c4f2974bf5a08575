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

import jax.numpy as jnp
from jax.typing import DTypeLike

if TYPE_CHECKING:  # the plan reads the engine's config; the model imports this module
    from minivllm_jax.config import EngineConfig

# attention backends (minivllm_jax/attention.py maps each to its function): the tuned XLA
# work-list attention, the Pallas (Triton) GPU kernel, the plain-jnp ground truth, and the Pallas
# TPU (Mosaic) kernel with the cache write fused in (interpret mode off TPU)
ATTENTION_BACKENDS = ("xla", "pallas", "reference", "pallas-tpu")
# stacked: nn.scan over [L, ...] params; switched: a scan whose body picks layer i's own arrays
# through lax.switch (models/llama.py)
LAYER_LAYOUTS = ("stacked", "switched")
# float32 projections of at most this many rows run feature-major on the CPU (models/llama.py
# `project`): XLA:CPU streams the weights faster that way at decode sizes
CPU_FEATURE_MAJOR_ROWS = 256
# (min token rows, min sampled rows) per backend: Triton dots need every dimension >= 16; on the
# CPU, small decode batches are weight-streaming bound and 4 rows stream fastest; TPU vregs hold
# 8 sublanes
MIN_BUCKETS = {"pallas": (16, 8), "xla": (4, 4), "reference": (4, 4), "pallas-tpu": (8, 8)}


@dataclass(frozen=True)
class ModelPlan:
    """How the model's forward runs; hashable, so it keys the jitted programs.

    `interpret`: Pallas interpret mode (None: on the CPU backend only)."""

    attention_backend: str = "xla"
    layer_layout: str = "stacked"
    feature_major_rows: int = 0
    interpret: bool | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.layer_layout not in LAYER_LAYOUTS:
            raise ValueError(f"layer_layout must be one of {LAYER_LAYOUTS}, got {self.layer_layout!r}")


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything `make_plan` decided. `kv_cache_bytes` is the byte budget of an automatically
    sized KV cache (the CPU's), None where free device memory is profiled instead (accelerators);
    a given `EngineConfig.num_kv_blocks` overrides both."""

    platform: str
    model: ModelPlan
    kv_cache_dtype: str
    async_scheduling: bool
    min_buckets: tuple[int, int]
    kv_cache_bytes: int | None


def kv_cache_dtype(model_dtype: DTypeLike, platform: str) -> str:
    """The model's dtype, except float32 for a 16-bit model on the CPU: XLA:CPU has no 16-bit
    scatter or gather and would convert the whole cache around every layer's write and read."""
    dtype = jnp.dtype(model_dtype)
    if platform == "cpu" and dtype.itemsize < 4:
        return "float32"
    return dtype.name


def make_plan(config: "EngineConfig", model_dtype: DTypeLike, platform: str) -> ExecutionPlan:
    """The plan for `config` on `platform` ("cpu", "gpu" or "tpu"); "auto"/None knobs resolved:
    the Pallas kernels on GPUs and TPUs, XLA attention on the CPU; switched
    layers on one CPU device, stacked ones elsewhere; async scheduling off on the CPU, whose
    host and "device" share the same cores."""
    cpu = platform == "cpu"
    backend = config.attention_backend
    if backend == "auto":
        backend = {"gpu": "pallas", "tpu": "pallas-tpu"}.get(platform, "xla")
    layout = config.layer_layout or ("switched" if cpu and config.tensor_parallel_size == 1
                                     else "stacked")
    async_scheduling = not cpu if config.async_scheduling is None else config.async_scheduling
    return ExecutionPlan(
        platform=platform,
        model=ModelPlan(backend, layout, CPU_FEATURE_MAJOR_ROWS if cpu else 0),
        kv_cache_dtype=kv_cache_dtype(model_dtype, platform),
        async_scheduling=async_scheduling,
        min_buckets=MIN_BUCKETS[backend],
        kv_cache_bytes=config.cpu_kv_cache_bytes if cpu else None)

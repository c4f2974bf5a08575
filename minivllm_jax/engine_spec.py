"""The engine's build, one way: config and model -> plan -> placement -> KV sizing -> `EngineSpec`
(`build` runs the stages for the engine and for `aot` alike).

Each stage is a function of the previous stages' outputs, and none reads back from what it
builds (`size_spec` runs the stages after the draft for the engine and for `aot` alike, each
measuring a max-size step's peak its own way): `draft_spec` resolves the sizes (`EngineConfig.resolve`), makes the execution plan
(`plan.make_plan`) and the tensor-parallel mesh and the model as it is placed there; the KV cache
is then sized from plain numbers (`kv_cache_sizing.choose_num_blocks`: a byte budget, or a
device's memory limit and a max-size step's peak bytes, however they were measured) and
`sized_spec` freezes the result. The runner, the scheduler, `LLM` and the server are all built
from that spec and only read it. Nothing here needs the weights or a device beyond the mesh's
`jax.Device`s, so the stages run as well over abstract params for a device that is not there.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

import pallas_kernels
from minivllm_jax import kv_cache_sizing
from minivllm_jax.parallel import sharding
from minivllm_jax.config import EngineConfig
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.parallel.multihost import broadcast_from_leader
from minivllm_jax.plan import ExecutionPlan, make_plan
from minivllm_jax.step_layout import StepShape, step_kinds, step_shapes
from scheduler import SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built from, fully resolved. `model_config` is the model as the
    devices run it (kv heads expanded under tensor parallelism); `config` has every size filled
    (max_model_len fitted to the cache when it was defaulted); `num_blocks` counts the null block
    and is per device (each of the mesh's devices holds 1/N of every block)."""

    model_config: ModelConfig
    config: EngineConfig
    plan: ExecutionPlan
    mesh: Mesh | None
    num_blocks: int

    @property
    def bytes_per_block(self) -> int:
        """One block's K and V over all layers, on one device."""
        tp = self.config.tensor_parallel_size
        return kv_cache_sizing.kv_cache_bytes_per_block(
            self.model_config, self.config.block_size, self.plan.kv_cache_dtype,
            self.plan.backend.cache_layout, tp) // tp

    def step_shapes(self) -> list[StepShape]:
        """Every StepShape a step of this spec can meet (`step_layout.step_shapes`)."""
        c, backend = self.config, self.plan.backend.name
        return step_shapes(c.max_num_batched_tokens, c.max_num_seqs, c.max_blocks_per_seq,
                           self.plan.min_buckets, lambda num_tokens: step_kinds(backend, num_tokens))

    def max_step(self) -> StepShape:
        """The largest step: every token and every row sampled (the shape memory is profiled on)."""
        c = self.config
        return StepShape(c.max_num_batched_tokens, c.max_num_seqs, c.max_num_seqs,
                         c.max_blocks_per_seq)

    def scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=c.max_model_len, block_size=c.block_size, num_blocks=self.num_blocks,
            enable_chunked_prefill=c.enable_chunked_prefill,
            enable_prefix_caching=c.enable_prefix_caching,
            async_scheduling=self.plan.async_scheduling, policy=c.scheduling_policy)


def draft_spec(model_config: ModelConfig, config: EngineConfig, model_dtype: DTypeLike,
               platform: str, devices: Sequence[jax.Device] | None = None) -> EngineSpec:
    """The spec before KV sizing: sizes resolved, the plan made for `platform`, the mesh over
    the first tensor_parallel_size of `devices` (default: every device), and a cache of one
    full request (`kv_cache_sizing.probe_blocks`), the size a max-size step is profiled on.
    Refuses (ValueError) what the plan cannot run before anything is placed: speculative
    decoding in a multi-host run (a verified step has no step header to broadcast), and step
    shapes the attention kernel cannot hold (`AttentionBackend.check_shapes`)."""
    resolved = config.resolve(model_config.max_position_embeddings)
    plan = make_plan(resolved, model_dtype, platform, jax.process_count())
    if plan.multi_host and resolved.speculative_config is not None:
        raise ValueError("speculative_config is not supported on a multi-host run (a verified "
                         "step has no step header to broadcast)")
    if plan.backend.check_shapes is not None:  # e.g. the TPU kernel's scalar memory
        getattr(pallas_kernels, plan.backend.check_shapes)(
            resolved.max_num_batched_tokens, resolved.max_num_seqs, resolved.max_blocks_per_seq)
    tp = resolved.tensor_parallel_size
    mesh = sharding.make_mesh(tp, model_config.num_attention_heads, devices) if tp > 1 else None
    return EngineSpec(sharding.sharded_model_config(model_config, tp), resolved, plan, mesh,
                      kv_cache_sizing.probe_blocks(resolved))


def device_bytes_limit(draft: EngineSpec) -> int | None:
    """The memory limit of the draft's first local device, where the plan sizes the cache from
    device memory (None where it has a byte budget, or the device reports none)."""
    if draft.plan.kv_cache_bytes is not None or draft.config.num_kv_blocks is not None:
        return None
    device = jax.local_devices()[0] if draft.mesh is None else draft.mesh.local_devices[0]
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


Placed = TypeVar("Placed")


def build(model_config: ModelConfig, config: EngineConfig, model_dtype: DTypeLike, platform: str,
          *, place: Callable[[EngineSpec], Placed],
          measure_peak: Callable[[EngineSpec, Placed], int],
          bytes_limit: Callable[[EngineSpec], int | None] = device_bytes_limit,
          devices: Sequence[jax.Device] | None = None) -> tuple[EngineSpec, Placed]:
    """The whole build, one way for the engine and for `aot`: `draft_spec`, then `place` (the
    weights on the draft's mesh, or their abstract stand-ins), then `size_spec` with the
    device's `bytes_limit` and `measure_peak` of the placed weights. Returns the final spec and
    what was placed, which the caller's runner takes as it is."""
    draft = draft_spec(model_config, config, model_dtype, platform, devices)
    placed = place(draft)
    spec = size_spec(draft, bytes_limit(draft), lambda d: measure_peak(d, placed),
                     fit_length=config.max_model_len is None)
    return spec, placed


def size_spec(draft: EngineSpec, bytes_limit: int | None,
              measure_peak: Callable[[EngineSpec], int], *, fit_length: bool) -> EngineSpec:
    """The build's last stages, one way for every caller: where the cache is sized from device
    memory (`kv_cache_sizing.needs_peak`: `bytes_limit` given, no block count or byte budget),
    the device's peak bytes in a max-size step on `draft`, as `measure_peak` measures it (the
    engine: a draft runner's real step; `aot`: the compiler's memory analysis); then
    `sized_spec`. `fit_length`: max_model_len was defaulted."""
    peak = None
    if kv_cache_sizing.needs_peak(draft.config, draft.plan, bytes_limit):
        peak = measure_peak(draft)
    return sized_spec(draft, bytes_limit=bytes_limit, peak_bytes=peak, fit_length=fit_length)


def sized_spec(draft: EngineSpec, *, bytes_limit: int | None = None, peak_bytes: int | None = None,
               fit_length: bool = False) -> EngineSpec:
    """The final spec: KV blocks chosen from the given numbers (`choose_num_blocks`; the
    penalties' token counts and prompt masks, made on demand, are reserved), and with
    `fit_length` (a defaulted max_model_len) the length lowered to what the cache holds for one
    request, said once at INFO level. In a multi-host run every process takes process 0's count."""
    config, model = draft.config, draft.model_config
    penalty_bytes = 5 * config.max_num_seqs * model.vocab_size  # int32 counts + bool masks
    num_blocks = kv_cache_sizing.choose_num_blocks(
        config, draft.plan, draft.bytes_per_block, bytes_limit=bytes_limit, peak_bytes=peak_bytes,
        reserved_bytes=penalty_bytes, fit_length=fit_length)
    if draft.plan.multi_host:  # every process builds process 0's cache
        num_blocks = int(broadcast_from_leader(np.array([num_blocks]), (1,))[0])
    fitted = config.fit_kv_cache(num_blocks) if fit_length else config
    if fitted is not config:
        logger.info("max_model_len is %d, below the model's %d tokens: the KV cache holds %d "
                    "blocks of %d (set max_model_len, or give the cache more memory)",
                    fitted.max_model_len, config.max_model_len, num_blocks - 1, config.block_size)
    spec = dataclasses.replace(draft, config=fitted, num_blocks=num_blocks)
    logger.info("KV cache: %d blocks of %d tokens; maximum concurrency %.2fx for %d-token requests",
                num_blocks, fitted.block_size, (num_blocks - 1) / fitted.max_blocks_per_seq,
                fitted.max_model_len)
    return spec

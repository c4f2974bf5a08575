"""Ahead-of-time compilation for a TPU topology that is not attached (docs/API.md §2b):
`compile_for_topology` builds the engine's spec for the topology's devices, over abstract params
and an abstract KV cache, and compiles every step program the config allows with libtpu (the
real TPU compiler), reporting each program's memory and cost as XLA sees them.

Invariants:
- Nothing is read but ``config.json``, and nothing is allocated: every argument is a
  `jax.ShapeDtypeStruct` with the sharding the engine would give it on the topology's devices
  (`abstract_params`, `abstract_cache`, `StepArgs`, mirroring `runner.place_params`; each
  program's argument list is `step_programs.forward_args` / `sampler_args`, as the runner's).
  The cache's shape and sharding come from `kv_cache_sizing` only.
- The KV cache is sized as the engine sizes it on a TPU (`engine_spec.build`): the chip's
  HBM (`hbm_bytes_per_device`) less the peak of a max-size step compiled on a cache of one
  request's blocks (`kv_cache_sizing.probe_blocks`), that peak being the step's resident bytes
  (params, cache, rope table, last tokens) plus its heaviest program's own bytes
  (`ProgramReport.peak_bytes`). A given ``num_kv_blocks`` skips the probe. Like the engine's
  profile, this assumes temporaries that do not grow with the cache: a program that copies the
  cache then fails at the sized cache ("does not fit"), as it would on the TPU.
- Every byte figure is per device, from XLA's `memory_analysis()`; flops, bytes accessed and
  seconds from its `cost_analysis()` (a Pallas kernel counts only through its cost estimate,
  `tpu_attention.cost_estimate`). XLA counts a loop's body once, so a forward's figures add its
  layer loop's body (`step_programs.forward_layer`, compiled on its own) once for every other
  layer.
- Every program's `control_flow` counts the conditionals and while loops of the program as
  compiled (`control_flow`): a step program holds no conditional and at most the layer loop.
- `lower_for_cuda` lowers the same programs for a CUDA GPU without one (StableHLO, no memory or
  cost figures), so the same census runs for both accelerators on any machine.
- This module changes no process-wide state (environment, jax config); the command line does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from minivllm_jax import engine_spec, kv_cache_sizing
from minivllm_jax.parallel import sharding
from minivllm_jax.config import EngineConfig
from minivllm_jax.engine_spec import EngineSpec, draft_spec, sized_spec
from minivllm_jax.loader import resolve_dtype
from minivllm_jax.loader.hf import read_config
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.models import quantization
from minivllm_jax.models.llama import param_shapes, unstack_layers
from minivllm_jax.models.rope import rope_table
from minivllm_jax.parallel.sharding import Params
from minivllm_jax.sampling.sampler import SAMPLING_KINDS
from minivllm_jax.step_layout import StepShape
from minivllm_jax.structured_output.manager import bitmask_words
from pallas_kernels import STEP_KINDS
from minivllm_jax.worker.step_programs import (StepPrograms, forward_args, forward_layer,
                                        forward_layer_inputs, head_params, sampler_args)

# where jax's own table (pallas.mosaic.tpu_info) is missing: device kind -> (HBM bytes per chip,
# TensorCores per chip)
_CHIPS = {"TPU v4": (34_400_000_000, 2), "TPU v5 lite": (17_200_000_000, 1),
          "TPU v5": (103_000_000_000, 2), "TPU v6 lite": (34_400_000_000, 1)}


class LibtpuMissing(RuntimeError):
    """libtpu (the TPU compiler) is not installed, or not the one the jax in use pins."""


def libtpu_problem() -> str | None:
    """Why libtpu cannot compile here (missing, or another release than ``jax[tpu]`` pins for
    this jax, e.g. ``libtpu==0.0.42.*``), with the command that installs the right one; None
    when it can."""
    fix = f'{sys.executable} -m pip install "jax[tpu]=={jax.__version__}" (no TPU needed)'
    if importlib.util.find_spec("libtpu") is None:
        return f"compiling for a TPU needs libtpu: {fix}"
    pins = [r.split(";")[0].strip() for r in importlib.metadata.requires("jax") or []
            if r.startswith("libtpu==") and 'extra == "tpu"' in r]
    have = importlib.metadata.version("libtpu")
    want = pins[0].removeprefix("libtpu==") if pins else None
    if want is not None and not (have == want or (want.endswith(".*")
                                                  and have.startswith(want[:-1]))):
        return f"libtpu {have} is not the one jax {jax.__version__} compiles with ({want}): {fix}"
    return None


def topology_devices(topology_name: str) -> list[jax.Device]:
    """The devices of a TPU topology (e.g. "v5e:2x4"), compiled for without being attached.
    Raises `LibtpuMissing` (`libtpu_problem`), ValueError for a name libtpu does not know."""
    problem = libtpu_problem()
    if problem is not None:
        raise LibtpuMissing(problem)
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
    except Exception as e:  # noqa: BLE001 - libtpu raises JaxRuntimeError / RuntimeError
        raise ValueError(f"unknown TPU topology {topology_name!r} ({_first_line(e)})") from None
    return list(topo.devices)


def _chip(device: jax.Device) -> tuple[Any, int] | None:
    """jax's record of a TPU device's chip (`pallas.mosaic.tpu_info`: figures per TensorCore)
    and the device's TensorCores; None where this jax has no such table or chip."""
    cores = int(getattr(device, "num_cores", 1) or 1)
    try:
        from jax._src.pallas.mosaic import tpu_info

        chip = tpu_info.chip_version_from_device_kind(device.device_kind)
        return None if chip is None else (tpu_info.get_tpu_info_for_chip(chip, cores), cores)
    except (ImportError, AttributeError, ValueError):
        return None


def hbm_bytes_per_device(device: jax.Device) -> int:
    """HBM of one device of a TPU topology: its chip's, split between the chip's TensorCores
    where each is a device of its own (v4 and v5p without megacore)."""
    chip = _chip(device)
    if chip is not None:
        info, cores = chip
        return int(info.hbm_capacity_bytes) * cores
    if device.device_kind not in _CHIPS:
        raise ValueError(f"the HBM size of a {device.device_kind!r} device is unknown")
    chip_bytes, chip_cores = _CHIPS[device.device_kind]
    return chip_bytes // chip_cores * int(getattr(device, "num_cores", 1) or 1)


def roofline_seconds(device: jax.Device, flops: float, bytes_accessed: float) -> float:
    """The larger of `flops` at the device's bfloat16 peak and `bytes_accessed` at its HBM
    bandwidth; -1 where jax's table does not know the chip."""
    chip = _chip(device)
    if chip is None:
        return -1.0
    info, cores = chip
    return max(flops / (info.bf16_ops_per_second * cores),
               bytes_accessed / (info.mem_bw_bytes_per_second * cores))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


# ---- abstract arguments ------------------------------------------------------------------------
def _on(spec: EngineSpec, device: jax.Device | None, pspec: P = P()) -> jax.sharding.Sharding | None:
    """Where the engine puts an array: `device` alone without a mesh (None: no device, as when
    lowering for a platform that is not here), else `pspec` on the mesh."""
    if spec.mesh is not None:
        return NamedSharding(spec.mesh, pspec)
    return None if device is None else SingleDeviceSharding(device)


def abstract_params(spec: EngineSpec, dtype: Any, device: jax.Device) -> Params:
    """The params `runner.place_params` would place for `spec`, as ShapeDtypeStructs: float
    leaves of `dtype` (the loader casts them to the model's dtype), with the plan's quantization
    int8 weights and float32 scales (`quantization.leaf_dtype`); under a mesh, the kv heads
    expanded (`spec.model_config` already is) and each leaf split by `sharding.param_spec`; in
    the switched layout, one tree per layer (on `device`)."""
    tp = spec.config.tensor_parallel_size

    def leaf(path: tuple, s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        where = _on(spec, device, sharding.param_spec(path, s.shape, tp))
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where)

    shapes = param_shapes(spec.model_config, spec.plan.model.quantization,
                          spec.plan.model.embed_lanes)
    params = jax.tree_util.tree_map_with_path(leaf, quantization.abstract_params(shapes, dtype))
    if spec.plan.model.layer_layout == "switched":  # one device (EngineConfig checks)
        layers = spec.model_config.num_hidden_layers
        per_layer = jax.eval_shape(lambda p: unstack_layers(p, layers), params)
        params = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=_on(spec, device)), per_layer)
    return params


def abstract_cache(spec: EngineSpec, device: jax.Device) -> jax.ShapeDtypeStruct:
    """The KV cache `kv_cache_sizing.init_kv_cache` would make for `spec` (its layout, shape and
    sharding from `kv_cache_sizing`)."""
    layout = spec.plan.backend.cache_layout
    shape = kv_cache_sizing.kv_cache_shape(spec.model_config, spec.num_blocks,
                                           spec.config.block_size, spec.plan.kv_cache_dtype, layout,
                                           spec.config.tensor_parallel_size)
    where = (_on(spec, device) if spec.mesh is None
             else kv_cache_sizing.kv_cache_sharding(spec.mesh))
    return jax.ShapeDtypeStruct(shape, jnp.dtype(spec.plan.kv_cache_storage), sharding=where)


@dataclass(frozen=True)
class StepArgs:
    """The abstract device state of a runner (`ModelRunner.__init__`'s arrays) for `spec`."""

    spec: EngineSpec
    device: jax.Device
    params: Params
    kv_cache: jax.ShapeDtypeStruct
    last_tokens: jax.ShapeDtypeStruct
    rope: jax.ShapeDtypeStruct

    @classmethod
    def build(cls, spec: EngineSpec, dtype: Any, device: jax.Device) -> StepArgs:
        c, replicated = spec.config, _on(spec, device)
        rope = rope_table(spec.model_config, 1)  # [max_model_len, 2, head_dim] in the runner
        return cls(spec, device, abstract_params(spec, dtype, device), abstract_cache(spec, device),
                   jax.ShapeDtypeStruct((c.max_num_seqs,), jnp.int32, sharding=replicated),
                   jax.ShapeDtypeStruct((c.max_model_len, *rope.shape[1:]), rope.dtype,
                                        sharding=replicated))

    def args(self, key: StepShape) -> tuple[Any, ...]:
        """Program ``key``'s arguments, in `ModelRunner._forward_args` / `_sampler_args`' order:
        (params, cache, main buffer, last tokens, rope) or (head params, rows, the forward's
        sampler buffer, the extra buffer or None, last tokens, the penalty state when
        ``key.penalties``, the token bitmask when ``key.structured``)."""
        main, extra = key.split(key.empty_step())
        replicated = _on(self.spec, self.device)
        int32 = lambda size: jax.ShapeDtypeStruct((size,), jnp.int32, sharding=replicated)  # noqa: E731
        if key.num_sampled == 0:
            return forward_args(self.params, self.kv_cache, int32(main.shape[0]), self.last_tokens,
                                self.rope)
        rows = jax.ShapeDtypeStruct((key.max_num_seqs * key.positions_per_row,
                                     self.spec.model_config.hidden_size),
                                    self.params["embed_tokens"].dtype, sharding=replicated)
        vocab = self.spec.model_config.vocab_size
        counts = (key.max_num_seqs, vocab)
        penalty_state = (jax.ShapeDtypeStruct(counts, jnp.int32, sharding=replicated),
                         jax.ShapeDtypeStruct(counts, jnp.bool_, sharding=replicated))
        bitmask = jax.ShapeDtypeStruct((key.num_sampled, bitmask_words(vocab)), jnp.int32,
                                       sharding=replicated)
        return sampler_args(key, self.params, rows, int32(main.shape[0] - key.sampler_offset),
                            None if extra is None else int32(extra.shape[0]), self.last_tokens,
                            penalty_state, bitmask)

    def layer_args(self, key: StepShape) -> tuple[Any, ...]:
        """`step_programs.forward_layer`'s arguments for the forward ``key``: one layer's
        weights, the cache, the residual stream and what the loop body reads of the step."""
        replicated = _on(self.spec, self.device)

        def unstacked(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            where = s.sharding
            if isinstance(where, NamedSharding):  # drop the layer axis of its spec
                where = NamedSharding(where.mesh, P(*tuple(where.spec)[1:]))
            return jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=where)

        statics = dict(model_config=self.spec.model_config, plan=self.spec.plan.model,
                       mesh=self.spec.mesh)
        md, cos, sin = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
            jax.eval_shape(functools.partial(forward_layer_inputs, shape=key,
                                             model_dtype=self.params["embed_tokens"].dtype,
                                             **statics),
                           self.args(key)[2], self.kv_cache, self.rope))
        x = jax.ShapeDtypeStruct((key.num_tokens, self.spec.model_config.hidden_size),
                                 self.params["embed_tokens"].dtype, sharding=replicated)
        return (jax.tree.map(unstacked, self.params["layers"]), self.kv_cache, x, cos, sin, md)

    def resident_bytes(self) -> int:
        """Per device: what lives through a whole step (params, cache, last tokens, rope)."""
        return device_bytes((self.params, self.kv_cache, self.last_tokens, self.rope))

    def resident_outside(self, key: StepShape) -> int:
        """Per device: the resident bytes that program ``key`` does not take as arguments (all
        but the head params and the last tokens, for a sampler)."""
        if key.num_sampled == 0:
            return 0
        return self.resident_bytes() - device_bytes((head_params(self.params), self.last_tokens))


def device_bytes(tree: Any) -> int:
    """The bytes one device holds of a tree of ShapeDtypeStructs (its shard of each leaf; the
    whole leaf where none is placed)."""
    return sum(math.prod(x.shape if x.sharding is None else x.sharding.shard_shape(x.shape))
               * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ---- compiling and the report ------------------------------------------------------------------
@dataclass
class ProgramReport:
    """One compiled step program (docs/API.md §2b's "programs" entries; bytes per device).
    `kind`: a forward's attention kind, a sampler's sampling kind. `estimated_seconds`: XLA's
    ``optimal_seconds``, or where XLA has none (negative) the `roofline_seconds` of its flops
    and bytes; flops, bytes and seconds count every layer (the module's invariants).
    `control_flow`: `control_flow` of the program. Lowered only (`lower_for_cuda`), the memory
    and cost fields are None. `peak_bytes` (not in the JSON): the device's bytes in use while
    it runs, the step's resident bytes included (`StepArgs.resident_bytes`); it fits when that
    is at most the HBM."""

    program: str
    num_tokens: int
    num_sampled: int
    ok: bool
    error: str | None = None
    argument_bytes: int | None = 0
    output_bytes: int | None = 0
    alias_bytes: int | None = 0
    temp_bytes: int | None = 0
    generated_code_bytes: int | None = 0
    flops: float | None = 0.0
    bytes_accessed: float | None = 0.0
    estimated_seconds: float | None = 0.0
    kind: str = ""
    control_flow: dict[str, int] | None = None
    peak_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["peak_bytes"]
        return out


def control_flow(text: str) -> dict[str, int]:
    """The conditionals and while loops of a program's text: compiled HLO (``conditional`` and
    ``while`` ops) or lowered StableHLO (``stablehlo.case``/``if``, ``stablehlo.while``)."""
    if "stablehlo." in text:
        return {"conditional": len(re.findall(r"stablehlo\.(?:case|if)\b", text)),
                "while": len(re.findall(r"stablehlo\.while\b", text))}
    return {"conditional": len(re.findall(r" conditional\(", text)),
            "while": len(re.findall(r" while\(", text))}


def _costs(compiled: jax.stages.Compiled) -> tuple[float, float, float]:
    """XLA's flops, bytes accessed and optimal seconds (-1 where it has none) of a program."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    return (float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
            float(cost.get("optimal_seconds", -1.0)))


def _key_fields(key: StepShape) -> tuple[str, int, int, str]:
    forward = key.num_sampled == 0
    return ("forward" if forward else "sampler", key.num_tokens, key.num_sampled,
            key.kind if forward else key.sampling)


def compile_program(programs: StepPrograms, key: StepShape, state: StepArgs,
                    hbm_bytes: int, costs: bool = True) -> ProgramReport:
    """Lower and compile program ``key`` (a StepShape's .forward or .sampler) for `state`'s
    devices; ok=False with the error's first line when it fails to compile or does not fit. With
    `costs`, a forward's costs add its layer body's for every layer but the one XLA counted."""
    name, tokens, sampled, kind = _key_fields(key)
    try:
        with jax.default_device(state.device):  # Pallas' TPU rules read the device kind
            compiled = programs.lower(key, state.args(key)).compile()
            flops, accessed, seconds = _costs(compiled)
            if name == "forward" and costs:
                layer = forward_layer.lower(*state.layer_args(key), model_config=programs.model_config,
                                            plan=programs.plan, mesh=programs.mesh).compile()
                more = programs.model_config.num_hidden_layers - 1
                l_flops, l_accessed, l_seconds = _costs(layer)
                flops, accessed = flops + more * l_flops, accessed + more * l_accessed
                seconds = seconds + more * l_seconds if min(seconds, l_seconds) >= 0 else -1.0
    except Exception as e:  # noqa: BLE001 - any lowering or compiler error is the report's
        fit = "does not fit: " if "RESOURCE_EXHAUSTED" in str(e) else ""  # the compiler's HBM check
        return ProgramReport(name, tokens, sampled, False, fit + _first_line(e), kind=kind)
    mem = compiled.memory_analysis()
    if seconds < 0:  # an op XLA cannot estimate adds -1 (seen with 512-block tables): a roofline
        seconds = roofline_seconds(state.device, flops, accessed)
    report = ProgramReport(
        name, tokens, sampled, True, None,
        int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
        int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes),
        int(mem.generated_code_size_in_bytes), flops, accessed, seconds, kind,
        control_flow(compiled.as_text()))
    # every resident array counts, whether or not the program takes it (jit drops an unused
    # argument, e.g. a forward's LM head), plus its step inputs beyond them
    resident = state.resident_bytes()
    inputs = max(0, report.argument_bytes - (resident - state.resident_outside(key)))
    report.peak_bytes = (resident + inputs + report.output_bytes - report.alias_bytes
                         + report.temp_bytes)
    if report.peak_bytes > hbm_bytes:
        report.ok = False
        report.error = (f"does not fit: {report.peak_bytes / 2**30:.2f} GiB in use while it runs "
                        f"(weights, KV cache, {report.temp_bytes / 2**20:.0f} MiB of temporaries) "
                        f"> {hbm_bytes / 2**30:.2f} GiB of HBM per device")
    return report


def program_keys(spec: EngineSpec) -> list[StepShape]:
    """Every program a step of `spec` can run: each token bucket's forward, then each sample
    bucket's sampler (of `EngineSpec.step_shapes`, as the runner's)."""
    keys = {k for s in spec.step_shapes() for k in (s.forward, s.sampler)}
    return sorted(keys, key=lambda k: (k.num_sampled > 0, k.num_tokens, k.num_sampled,
                                       STEP_KINDS.index(k.kind), SAMPLING_KINDS.index(k.sampling)))


def read_model(model_dir: str | Path, config: EngineConfig, platform: str) -> tuple[ModelConfig, Any]:
    """The model of `model_dir`'s config.json and the weights' dtype `config` gives it there."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{model_dir}: expected a model directory holding a config.json")
    hf = read_config(path)
    model_config = ModelConfig.from_hf_config(hf, source=str(path / "config.json"))
    return model_config, resolve_dtype(config.dtype, hf.get("torch_dtype") or hf.get("dtype"), platform)


class _Unmeasured(Exception):
    """A max-size step did not compile, so the cache cannot be sized from its peak."""


def compile_for_topology(model_dir: str | Path, topology_name: str, config: EngineConfig,
                         progress: Callable[[dict[str, Any]], None] | None = None,
                         only: Callable[[StepShape], bool] | None = None) -> dict[str, Any]:
    """Compile every step program `config` allows for the model of `model_dir` (only its
    config.json is read) on the TPU topology `topology_name` (e.g. "v5e:2x4"; the mesh takes its
    first tensor_parallel_size devices), the KV cache sized as on that TPU; returns the report
    (docs/API.md §2b; it also names the attention backend and the cache's dtype). Raises
    `LibtpuMissing` without libtpu, ValueError for a bad topology, model or config.
    `progress` gets each program's entry as it is compiled; `only` keeps the programs it
    accepts (the KV sizing still compiles the largest step's two)."""
    devices = topology_devices(topology_name)
    if config.tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} exceeds the "
                         f"{len(devices)} devices of TPU topology {topology_name!r}")
    model_config, dtype = read_model(model_dir, config, "tpu")
    hbm = hbm_bytes_per_device(devices[0])
    done: dict[tuple[StepShape, int, int], ProgramReport] = {}

    def report_of(spec: EngineSpec, key: StepShape, costs: bool = True) -> ProgramReport:
        memo = (key, spec.num_blocks, spec.config.max_model_len, costs)
        if memo not in done:
            programs = StepPrograms(spec.model_config, spec.plan.model, spec.mesh)
            state = StepArgs.build(spec, dtype, devices[0])
            done[memo] = compile_program(programs, key, state, hbm, costs)
        return done[memo]

    measured: list[EngineSpec] = []  # the draft, once its peak was measured

    def measure_peak(d: EngineSpec, placed: None) -> int:
        probe = [report_of(d, k, costs=False) for k in (d.max_step().forward, d.max_step().sampler)]
        measured.append(d)
        if not all(r.peak_bytes for r in probe):  # one did not compile: its report says why
            raise _Unmeasured
        return max(r.peak_bytes for r in probe)

    sizing_error = None
    try:  # placing is abstract here: `StepArgs.build` makes each spec's params
        spec, _ = engine_spec.build(model_config, config, dtype, "tpu", place=lambda d: None,
                                    measure_peak=measure_peak, bytes_limit=lambda d: hbm,
                                    devices=devices)
    except _Unmeasured:
        spec = measured[0]
    except ValueError as e:  # after measuring: not even one request fits
        if not measured:
            raise
        spec, sizing_error = measured[0], f"does not fit: {e}"
    reports = []
    for key in program_keys(spec):
        probed = key.num_sampled == 0 and key.num_tokens == spec.config.max_num_batched_tokens
        if only is not None and not only(key) and not (sizing_error and probed):
            continue
        reports.append(report_of(spec, key))
        if progress is not None:
            progress(reports[-1].as_dict())
    if sizing_error is not None:  # the probed step carries it
        first = next(i for i, r in enumerate(reports) if r.program == "forward"
                     and r.num_tokens == spec.config.max_num_batched_tokens)
        reports[first] = dataclasses.replace(reports[first], ok=False, error=sizing_error)
    c = spec.config
    return {"device_kind": devices[0].device_kind, "num_devices": len(devices),
            "tensor_parallel_size": c.tensor_parallel_size, "hbm_bytes_per_device": hbm,
            "num_kv_blocks": spec.num_blocks, "block_size": c.block_size,
            "max_model_len": c.max_model_len,
            "kv_cache_bytes_per_device": device_bytes(abstract_cache(spec, devices[0])),
            "weight_bytes_per_device": device_bytes(abstract_params(spec, dtype, devices[0])),
            "attention_backend": spec.plan.backend.name, "kv_cache_dtype": spec.plan.kv_cache_dtype,
            "quantization": spec.plan.model.quantization,
            "programs": [r.as_dict() for r in reports]}


# the GPU a CUDA lowering targets: jaxlib reads its compute capability while lowering, from the
# abstract mesh's device where no GPU is present
CUDA_TARGET = "NVIDIA H100 80GB HBM3"


def lower_program(programs: StepPrograms, key: StepShape, state: StepArgs) -> ProgramReport:
    """Lower program ``key`` for CUDA (no GPU needed) and count its control flow; the memory and
    cost fields stay None (nothing is compiled). ok=False with the error's first line when it
    does not lower."""
    name, tokens, sampled, kind = _key_fields(key)
    none = dict.fromkeys(("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                          "generated_code_bytes", "flops", "bytes_accessed", "estimated_seconds"))
    h100 = jax.sharding.AbstractDevice(device_kind=CUDA_TARGET, num_cores=132, platform="gpu")
    target = jax.sharding.AbstractMesh((1,), ("gpu",), (jax.sharding.AxisType.Explicit,),
                                       abstract_device=h100)
    # under a mesh (of this machine's devices) its own devices are the context
    context = contextlib.nullcontext() if programs.mesh is not None else \
        jax.sharding.use_abstract_mesh(target)
    try:
        with context:
            text = programs.lower(key, state.args(key), ("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001 - any lowering error is the report's
        return ProgramReport(name, tokens, sampled, False, _first_line(e), kind=kind, **none)
    return ProgramReport(name, tokens, sampled, True, None, kind=kind,
                         control_flow=control_flow(text), **none)


def lower_for_cuda(model_dir: str | Path, config: EngineConfig,
                   progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Lower every step program `config` allows for the model of `model_dir` (only its
    config.json is read) for a CUDA GPU, on any machine; returns the report of
    `compile_for_topology` with the memory and cost fields None, the KV cache sized as on the
    CPU (or as given). Under tensor parallelism the mesh is over this machine's devices (the
    command line makes enough CPU devices). `progress` gets each program's entry as it is
    lowered."""
    model_config, dtype = read_model(model_dir, config, "gpu")
    draft = draft_spec(model_config, config, dtype, "gpu")
    spec = sized_spec(draft, fit_length=config.max_model_len is None)
    programs = StepPrograms(spec.model_config, spec.plan.model, spec.mesh)
    state = StepArgs.build(spec, dtype, None)
    reports = []
    for key in program_keys(spec):
        reports.append(lower_program(programs, key, state))
        if progress is not None:
            progress(reports[-1].as_dict())
    c = spec.config
    return {"device_kind": f"cuda ({CUDA_TARGET}, lowered)", "num_devices": c.tensor_parallel_size,
            "tensor_parallel_size": c.tensor_parallel_size, "hbm_bytes_per_device": None,
            "num_kv_blocks": spec.num_blocks, "block_size": c.block_size,
            "max_model_len": c.max_model_len,
            "kv_cache_bytes_per_device": spec.num_blocks * spec.bytes_per_block,
            "weight_bytes_per_device": device_bytes(state.params),
            "attention_backend": spec.plan.backend.name, "kv_cache_dtype": spec.plan.kv_cache_dtype,
            "quantization": spec.plan.model.quantization,
            "programs": [r.as_dict() for r in reports]}

"""TPU step estimates without a TPU: libtpu's compile report of a decode and a prefill step, beside
an analytic HBM roofline computed here from the model's config alone.

    python scripts/tpu_estimates.py [--quick] [--only TEXT ...] [--json FILE]

Workloads (`WORKLOADS`; bfloat16 weights and KV cache unless a workload says otherwise, blocks
of 16 tokens):
- Llama-3.1-8B (`bench_common` shape "llama-3.1-8b") on v5e-8 (`v5e:2x4`) and on v6e-8
  (`v6e:2x4`), tensor parallel 8: decode B=256 sequences at context C=2048, the roofline table of
  docs/benchmarks.md's "TPU: the Mosaic kernel" section;
- Llama-3.1-8B with int8 weights and an fp8 KV cache (`EngineConfig(quantization="int8",
  kv_cache_dtype="fp8")`, variant "int8+fp8"): on v5e-8 (TP 8) at B=256, C=2048 beside the
  bf16 one; and on one v5e chip (`v5e:2x2`, TP 1) at B=48, C=2048 (7.97 GiB of weights, the
  embedding's included, and 6.0 GiB of K/V: 87 % of the chip's 16.0 GiB; B=64 would need 8.0 GiB
  of K/V, more than the chip has left);
- Qwen3-0.6B (shape "qwen3-0.6b") on one v5e chip (`v5e:2x2`, tensor parallel 1): decode B=64 at
  C=2048 (14.0 GiB of K/V and 1.1 GiB of weights: 94 % of the chip's 16.0 GiB, above the 90 %
  the engine's own sizing takes; B=128 would not fit);
- each also a prefill step: one 2048-token prompt.
`--quick`: SmolLM2-135M's shape on `v5e:2x2`, B=8 at C=256 and a 256-token prompt, bf16 and
int8+fp8 (its 3 kv heads: 6 combined heads, padded to 8 in fp8), in seconds.
`--only TEXT` (repeatable): the workloads whose label, shape, topology or variant ("bf16",
"int8+fp8", `variant`) contains one of the TEXTs.

Per workload only the step's programs are compiled (`aot.compile_program`, costs on, so a
forward counts every layer): the forward of the decode bucket (B token rows, B sequences) with
the greedy sampler of B rows; and the forward of the 2048-token bucket with the greedy sampler
of its one row, compiled under a second engine config, max_num_seqs=1 and max_model_len=2048.
Why: the TPU kernel's cost estimate (`tpu_attention.cost_estimate`) assumes min(num_tokens,
max_num_seqs) sequences share the bucket's rows, each reaching max_model_len; under the decode
config the 2048-token bucket would be estimated as 256 sequences of 8 rows at context 2048, not
one prompt. Both configs give the cache B x C / 16 + 1 blocks (no sizing probe): XLA stages a
cache small enough into VMEM whole, which a prefill-sized cache would be. Each forward's layer
body (`step_programs.forward_layer`) is also compiled on its own, to compare XLA's bytes of one
layer with the layer's weights and the kernel's estimate.

The roofline, per chip, from config.json's fields only (not from the engine):
- bytes read: the chip's share of every layer's projections (q, k, v, o, gate, up, down; the
  k/v heads a chip holds: kv_heads / TP, at least 1) and norms (replicated), the final norm and
  the LM head (vocab / TP rows; the embedding when tied). bf16: 2 bytes a weight; int8
  (`quantization="int8"`): the projections and an untied LM head 1 byte a weight plus a float32
  scale (4 bytes) per output channel the chip holds (o and down: all `hidden` of them, their
  scales replicated), norms and the embedding (so a tied head) 2 bytes. Left out: the embedding
  rows a step gathers (rows x hidden x 2 bytes: 2 MiB for Llama's 256-row decode, against ~10 GB),
  activations, metadata, the sampler's gathered logits and the collectives of tensor
  parallelism (ICI, not HBM);
- K/V in the TPU cache layout (`pallas_kernels.tpu_layout.tpu_kv_cache_shape` of the kv heads
  over TP shards, divided by TP): head_dim padded to a multiple of 128, the cache dtype's
  values packed per 32-bit word (2 for bf16, 4 for fp8: `kv_cache_dtype="fp8"`, 1 byte a value)
  and each shard's 2 x kv heads / TP combined heads padded to a multiple of the packing (one kv
  head a chip in fp8: K, V and 2 zero heads, so as many bytes as bf16); decode reads B x C tokens'
  K/V of every layer (each sequence's C positions, the new one's included) and writes B tokens';
  prefill, a lower bound: the prompt's K/V written once and read once. (The kernel's query
  tiles, 32 tokens for 4 q heads a kv head, 64 for 2, each stream the keys up to their last
  row: ~(n + 1) / 2 times the prompt's K/V for n tiles. Prefill's floor is compute either way.);
- flops: 2 per weight per token row (the LM head for the sampled rows only: B, or 1 for the
  prompt) plus attention's 4 x q heads / TP x head_dim per (query, key) pair: B x C pairs for
  decode, T (T + 1) / 2 causal pairs for a T-token prompt; int8 weights count the same (the
  engine casts them to bf16 for the matmul);
- the floor: max(bytes / HBM bandwidth, flops / bf16 peak), from jax's chip table
  (`pallas.mosaic.tpu_info`, as `aot.roofline_seconds`), else `FALLBACK_PEAKS`.
XLA's figures: `aot.compile_program`'s flops, bytes accessed and estimated seconds: XLA's
optimal_seconds, or where it has none (a forward: the Pallas kernel and the ConcatBitcast calls
have no estimate) the roofline of XLA's own flops and bytes (column "src"). XLA's bytes count
on-chip traffic too (a weight staged into VMEM by a copy-start or slice-start is counted for the
copy's read and write and again for the matmul's read), so its time sits above the HBM floor;
the bytes table shows by how much, per layer.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# libtpu on a machine without a TPU (as `minivllm-jax compile` sets them): before jax starts
for _name, _value in {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1",
                      "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}.items():
    os.environ.setdefault(_name, _value)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
from minivllm_jax import aot  # noqa: E402
from minivllm_jax.cli.compile import quiet_stderr  # noqa: E402
from minivllm_jax.config import KV_CACHE_DTYPES, EngineConfig  # noqa: E402
from minivllm_jax.engine_spec import draft_spec, sized_spec  # noqa: E402
from minivllm_jax.worker.step_programs import StepPrograms, forward_layer  # noqa: E402
from pallas_kernels.tpu_attention import cost_estimate, default_tpu_tiles  # noqa: E402
from pallas_kernels.tpu_layout import padded_head_dim, tpu_kv_cache_shape  # noqa: E402

BLOCK_SIZE = 16
BF16 = 2
INT8_SCALE = 4  # bytes of a float32 scale: one per output channel of an int8 weight
# device kind -> (HBM bytes/s, bf16 flop/s) per chip, where jax's table lacks the chip
FALLBACK_PEAKS = {"TPU v5 lite": (819e9, 197e12), "TPU v6 lite": (1640e9, 918e12)}


@dataclass(frozen=True)
class Workload:
    label: str
    shape: str  # a bench_common.MODEL_SHAPES name
    topology: str
    tp: int
    batch: int  # B: decode sequences (max_num_seqs)
    context: int  # C: each one's context (max_model_len)
    prompt: int = 2048  # T: the prefill step's one prompt
    quantization: str | None = None  # EngineConfig.quantization: None (bf16) or "int8"
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype: "auto" (bf16) or "fp8"


def variant(w: Workload | dict[str, Any]) -> str:
    """The workload's weights and KV cache, e.g. "bf16", "int8+fp8" ("int8": int8 weights, bf16
    cache; "bf16+fp8": bf16 weights, fp8 cache)."""
    w = asdict(w) if isinstance(w, Workload) else w
    weights = w.get("quantization") or "bf16"
    kv = w.get("kv_cache_dtype", "auto")
    return weights if kv == "auto" else f"{weights}+{kv}"


WORKLOADS = (
    Workload("Llama-3.1-8B", "llama-3.1-8b", "v5e:2x4", 8, 256, 2048),
    Workload("Llama-3.1-8B", "llama-3.1-8b", "v5e:2x4", 8, 256, 2048, quantization="int8",
             kv_cache_dtype="fp8"),
    Workload("Llama-3.1-8B", "llama-3.1-8b", "v5e:2x2", 1, 48, 2048, quantization="int8",
             kv_cache_dtype="fp8"),
    Workload("Llama-3.1-8B", "llama-3.1-8b", "v6e:2x4", 8, 256, 2048),
    Workload("Qwen3-0.6B", "qwen3-0.6b", "v5e:2x2", 1, 64, 2048),
)
QUICK = (Workload("SmolLM2-135M", "smollm2-135m", "v5e:2x2", 1, 8, 256, prompt=256),
         Workload("SmolLM2-135M", "smollm2-135m", "v5e:2x2", 1, 8, 256, prompt=256,
                  quantization="int8", kv_cache_dtype="fp8"))


def model_config(shape: str) -> dict[str, Any]:
    """config.json's fields of a named shape."""
    return {**bench_common.build_hf_config(shape).to_dict(), "torch_dtype": "bfloat16"}


# ---- the analytic roofline (config.json alone) ------------------------------------------------
@dataclass(frozen=True)
class ChipShare:
    """What one chip of a TP group holds of a Llama-family model: elements (the flops' count)
    and bytes (the roofline's), in the workload's weight and cache dtypes."""

    layers: int
    layer_weights: int  # projections and norms of one layer, this chip's share, elements
    head_weights: int  # the final norm and this chip's LM head rows, elements
    lm_head: int  # this chip's LM head: vocab / TP x hidden, elements
    q_heads: int  # this chip's query heads
    kv_heads: int  # this chip's kv heads
    head_dim: int
    lanes: int  # head_dim padded to a multiple of 128 (the TPU cache layout)
    layer_bytes: int  # layer_weights' bytes (int8: 1 a weight + 4 a scale; norms 2)
    head_bytes: int  # head_weights' bytes (an untied int8 head: 1 a weight + 4 a scale)
    kv_token_bytes: int  # K and V of one token in one layer, as this chip's TPU cache holds them


def kv_token_bytes(kv_heads: int, head_dim: int, tp: int, kv_dtype: Any) -> int:
    """One token's K/V of one layer on one chip in the TPU cache layout: the layer's cache over
    `tp` shards (each shard's combined heads padded to the packing) divided by `tp`; with fewer
    kv heads than chips, the one-shard layout of the one head each chip holds a copy of."""
    dtype = jnp.dtype(kv_dtype)
    if kv_heads % tp == 0:
        shape = tpu_kv_cache_shape(1, 1, kv_heads, head_dim, dtype, num_shards=tp)
        return math.prod(shape) * dtype.itemsize // tp
    return math.prod(tpu_kv_cache_shape(1, 1, 1, head_dim, dtype)) * dtype.itemsize


def chip_share(cfg: dict[str, Any], tp: int, quantization: str | None = None,
               kv_cache_dtype: str = "auto") -> ChipShare:
    """One chip's share of `cfg`'s model at tensor parallelism `tp`, its weights bf16 or int8
    (`quantization`), its cache bf16 or fp8 (`kv_cache_dtype`, EngineConfig's names)."""
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization must be None or 'int8', got {quantization!r}")
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or hidden // heads
    kv_chip = max(1, kv_heads // tp)  # fewer kv heads than chips: each chip holds a copy
    norms = 2 * hidden + (2 * d if cfg.get("model_type") == "qwen3" else 0)
    # this chip's output channels and input width of q, k, v, o, gate, up, down: o and down are
    # split on their input axis, so each chip holds all `hidden` output channels (and scales)
    outs = (heads // tp * d, kv_chip * d, kv_chip * d, hidden, inter // tp, inter // tp, hidden)
    ins = (hidden, hidden, hidden, heads // tp * d, hidden, hidden, inter // tp)
    proj = sum(o * i for o, i in zip(outs, ins))
    vocab = cfg["vocab_size"] // tp
    lm_head = vocab * hidden
    tied = bool(cfg.get("tie_word_embeddings", False))
    if quantization == "int8":
        layer_bytes = proj + INT8_SCALE * sum(outs) + BF16 * norms
        head_bytes = BF16 * hidden + (BF16 * lm_head if tied else lm_head + INT8_SCALE * vocab)
    else:
        layer_bytes, head_bytes = BF16 * (proj + norms), BF16 * (hidden + lm_head)
    kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or cfg.get("torch_dtype", "bfloat16")
    return ChipShare(cfg["num_hidden_layers"], proj + norms, hidden + lm_head, lm_head,
                     heads // tp, kv_chip, d, padded_head_dim(d), layer_bytes, head_bytes,
                     kv_token_bytes(kv_heads, d, tp, kv_dtype))


def roofline(share: ChipShare, rows: int, sampled: int, pairs: int, kv_read_tokens: int,
             peaks: tuple[float, float]) -> dict[str, float]:
    """Per chip: a step of `rows` token rows, `sampled` LM-head rows, `pairs` (query, key) pairs
    a layer and `kv_read_tokens` tokens' K/V read a layer; `peaks`: (HBM B/s, flop/s)."""
    L = share.layers
    weights = L * share.layer_bytes + share.head_bytes
    kv = L * share.kv_token_bytes * (kv_read_tokens + rows)  # read, and the new rows written
    proj = share.layer_weights * L  # norms' flops are noise beside the projections'
    attention = 4 * L * share.q_heads * share.head_dim * pairs
    flops = 2 * rows * proj + 2 * sampled * share.lm_head + attention
    hbm_s, flop_s = (weights + kv) / peaks[0], flops / peaks[1]
    return {"weight_bytes": weights, "kv_bytes": kv, "flops": flops, "hbm_s": hbm_s,
            "compute_s": flop_s, "seconds": max(hbm_s, flop_s),
            "bound": "HBM" if hbm_s >= flop_s else "compute"}


def chip_peaks(device: jax.Device) -> tuple[float, float, str]:
    """(HBM bytes/s, bf16 flop/s, where from) of one chip."""
    try:
        from jax._src.pallas.mosaic import tpu_info

        chip = tpu_info.chip_version_from_device_kind(device.device_kind)
        cores = int(getattr(device, "num_cores", 1) or 1)
        info = tpu_info.get_tpu_info_for_chip(chip, cores)
        return (info.mem_bw_bytes_per_second * cores, info.bf16_ops_per_second * cores,
                "jax tpu_info")
    except (ImportError, AttributeError, ValueError, TypeError):
        bw, flops = FALLBACK_PEAKS[device.device_kind]
        return bw, flops, "fallback"


def workload_share(cfg: dict[str, Any], w: Workload) -> ChipShare:
    return chip_share(cfg, w.tp, w.quantization, w.kv_cache_dtype)


def rooflines(w: Workload, cfg: dict[str, Any], peaks: tuple[float, float]) -> dict[str, dict]:
    share = workload_share(cfg, w)
    b, c, t = w.batch, w.context, w.prompt
    return {"decode": roofline(share, b, b, b * c, b * c, peaks),
            "prefill": roofline(share, t, 1, t * (t + 1) // 2, t, peaks)}


def layer_figures(cfg: dict[str, Any], w: Workload, step: str) -> dict[str, float]:
    """One layer, per chip: the roofline's weight and K/V bytes, and the TPU kernel's own HBM
    estimate (`tpu_attention.cost_estimate`, what XLA's cost analysis counts for the kernel)."""
    share = workload_share(cfg, w)
    rows, seqs, context = ((w.batch, w.batch, w.context) if step == "decode"
                           else (w.prompt, 1, w.prompt))
    kv_tokens = w.batch * w.context + rows if step == "decode" else 2 * w.prompt
    kv_row = share.kv_token_bytes  # the cache's dtype and layout; q (itemsize) stays bf16
    tiles = default_tpu_tiles(rows, seqs, share.q_heads // share.kv_heads, BLOCK_SIZE, kv_row, BF16)
    kernel = cost_estimate(rows, seqs, share.q_heads, share.lanes, tiles.tokens_per_tile, context,
                           kv_row, BF16, True)
    return {"weights": share.layer_bytes, "kv": kv_row * kv_tokens,
            "kernel": kernel.bytes_accessed, "tokens_per_tile": tiles.tokens_per_tile}


# ---- compiling (libtpu) -------------------------------------------------------------------------
def step_state(model_dir: Path, devices: list, w: Workload, step: str
               ) -> tuple[Any, StepPrograms, aot.StepArgs]:
    """The engine spec, programs and abstract arguments of the step's own engine config."""
    if step == "decode":
        sizes = dict(max_num_seqs=w.batch, max_num_batched_tokens=w.batch, max_model_len=w.context)
    else:  # one sequence: the kernel's stated workload is then the one prompt
        sizes = dict(max_num_seqs=1, max_num_batched_tokens=w.prompt, max_model_len=w.prompt)
    # both steps on the decode batch's cache: a small cache would be staged whole into VMEM
    config = EngineConfig(tensor_parallel_size=w.tp, dtype="bfloat16", block_size=BLOCK_SIZE,
                          num_kv_blocks=w.batch * w.context // BLOCK_SIZE + 1,
                          quantization=w.quantization, kv_cache_dtype=w.kv_cache_dtype,
                          compile_cache=False, **sizes)
    model, dtype = aot.read_model(model_dir, config, "tpu")
    spec = sized_spec(draft_spec(model, config, dtype, "tpu", devices))
    return (spec, StepPrograms(spec.model_config, spec.plan.model, spec.mesh),
            aot.StepArgs.build(spec, dtype, devices[0]))


def compile_step(model_dir: Path, devices: list, w: Workload, step: str) -> dict[str, Any]:
    """The step's forward and greedy sampler, compiled with costs, and its layer body's costs."""
    spec, programs, state = step_state(model_dir, devices, w, step)
    rows, sampled = (w.batch, w.batch) if step == "decode" else (w.prompt, 1)
    keys = aot.program_keys(spec)
    forward = next(k for k in keys if k.num_sampled == 0 and k.num_tokens == rows)
    sampler = next(k for k in keys if k.num_tokens == 0 and k.num_sampled == sampled
                   and k.sampling == "greedy")
    hbm = aot.hbm_bytes_per_device(devices[0])
    out: dict[str, Any] = {"attention_backend": spec.plan.backend.name,
                           "kv_cache_dtype": str(spec.plan.kv_cache_dtype),
                           "quantization": spec.plan.model.quantization,
                           "num_kv_blocks": spec.num_blocks, "hbm_bytes": hbm, "programs": []}
    for key in (forward, sampler):
        start = time.perf_counter()
        report = aot.compile_program(programs, key, state, hbm, costs=True)
        record = report.as_dict() | {"peak_bytes": report.peak_bytes,
                                     "compile_s": time.perf_counter() - start,
                                     "seconds_from": seconds_source(devices[0], report)}
        out["programs"].append(record)
        print(f"  {w.label} {variant(w)} {w.topology} {step}: {report.program} "
              f"({report.num_tokens} tokens, {report.num_sampled} sampled) {'ok' if report.ok else report.error} "
              f"in {record['compile_s']:.0f} s", flush=True)
    with jax.default_device(devices[0]):
        layer = forward_layer.lower(*state.layer_args(forward), model_config=programs.model_config,
                                    plan=programs.plan, mesh=programs.mesh).compile()
    out["layer_flops"], out["layer_bytes"], out["layer_seconds"] = aot._costs(layer)
    return out


def seconds_source(device: jax.Device, report: aot.ProgramReport) -> str:
    """"xla" where the estimate is XLA's optimal_seconds, "roofline" where compile_program fell
    back to the roofline of XLA's flops and bytes (XLA had no estimate for some op)."""
    if not report.ok:
        return "-"
    fallback = aot.roofline_seconds(device, report.flops, report.bytes_accessed)
    return "roofline" if math.isclose(report.estimated_seconds, fallback, rel_tol=1e-9) else "xla"


def estimate(w: Workload) -> dict[str, Any]:
    """Compile one workload's programs and put XLA's estimates beside the roofline."""
    cfg = model_config(w.shape)
    with quiet_stderr():  # libtpu's start-up logs
        devices = aot.topology_devices(w.topology)
    bw, flops, peaks_from = chip_peaks(devices[0])
    result: dict[str, Any] = {"workload": asdict(w), "device_kind": devices[0].device_kind,
                              "hbm_bytes_per_s": bw, "bf16_flops_per_s": flops,
                              "peaks_from": peaks_from, "layers": cfg["num_hidden_layers"],
                              "roofline": rooflines(w, cfg, (bw, flops))}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        for step in ("decode", "prefill"):
            result[step] = compile_step(Path(tmp), devices, w, step)
            result[step]["layer_roofline"] = layer_figures(cfg, w, step)
    return result


# ---- the report -------------------------------------------------------------------------------
def xla_step(step: dict[str, Any]) -> dict[str, float] | None:
    """XLA's forward + sampler: flops, bytes, seconds (None when a program failed)."""
    progs = step["programs"]
    if not all(p["ok"] for p in progs):
        return None
    return {k: sum(p[f] for p in progs) for k, f in
            (("flops", "flops"), ("bytes", "bytes_accessed"), ("seconds", "estimated_seconds"))}


def summary_table(results: list[dict[str, Any]]) -> str:
    """Per workload and step: XLA's time (forward + sampler) and the roofline's, ms and tok/s."""
    head = (f"{'workload':<13} {'variant':<8} {'slice':<8} {'TP':>2} {'step':<14} {'XLA ms':>8} "
            f"{'XLA tok/s':>10} "
            f"{'roof ms':>8} {'roof tok/s':>10} {'XLA/roof':>8} {'floor':>7}")
    lines = [head]
    for r in results:
        w = r["workload"]
        for step, tokens, what in (("decode", w["batch"], f"{w['batch']} x {w['context']}"),
                                   ("prefill", w["prompt"], f"1 x {w['prompt']}")):
            roof, xla = r["roofline"][step], xla_step(r[step])
            xla_ms, xla_tps = ((f"{xla['seconds'] * 1e3:8.2f}", f"{tokens / xla['seconds']:10,.0f}")
                               if xla else (f"{'FAIL':>8}", f"{'-':>10}"))
            ratio = f"{xla['seconds'] / roof['seconds']:8.2f}" if xla else f"{'-':>8}"
            lines.append(f"{w['label']:<13} {variant(w):<8} {w['topology']:<8} {w['tp']:>2} "
                         f"{step + ' ' + what:<14} {xla_ms} {xla_tps} {roof['seconds'] * 1e3:8.2f} "
                         f"{tokens / roof['seconds']:10,.0f} {ratio} {roof['bound']:>7}")
    return "\n".join(lines)


def programs_table(results: list[dict[str, Any]]) -> str:
    """Per compiled program: XLA's figures (every layer counted), where its time is from, its
    conditionals and loops, and its peak bytes against the chip's HBM."""
    lines = [f"{'workload':<13} {'variant':<8} {'slice':<8} {'step':<7} {'program':<8} "
             f"{'rows':>5} {'GFLOP':>9} "
             f"{'GB':>8} {'est. ms':>8} {'src':<8} {'cond':>4} {'while':>5} {'peak GiB':>8} "
             f"{'HBM GiB':>7} {'compile s':>9}"]
    for r in results:
        w = r["workload"]
        for step in ("decode", "prefill"):
            for p in r[step]["programs"]:
                rows = p["num_tokens"] or p["num_sampled"]
                flow = p["control_flow"] or {}
                figures = (f"{p['flops'] / 1e9:9.1f} {p['bytes_accessed'] / 1e9:8.3f} "
                           f"{p['estimated_seconds'] * 1e3:8.3f}" if p["ok"] else
                           f"{'FAIL: ' + (p['error'] or '')[:60]}")
                lines.append(f"{w['label']:<13} {variant(w):<8} {w['topology']:<8} {step:<7} "
                             f"{p['program']:<8} "
                             f"{rows:>5} {figures} {p['seconds_from']:<8} "
                             f"{flow.get('conditional', '-'):>4} {flow.get('while', '-'):>5} "
                             f"{p['peak_bytes'] / 2**30:8.2f} {r[step]['hbm_bytes'] / 2**30:7.2f} "
                             f"{p['compile_s']:9.0f}")
    return "\n".join(lines)


def bytes_row(r: dict[str, Any], step: str) -> str:
    s, roof, xla = r[step], r["roofline"][step], xla_step(r[step])
    layer, fwd = s["layer_roofline"], s["programs"][0]
    rest = (s["layer_bytes"] - layer["kernel"]) / layer["weights"]
    outside = (fwd["bytes_accessed"] - r["layers"] * s["layer_bytes"]) / 1e6 if fwd["ok"] \
        else float("nan")
    roof_bytes, roof_layer = roof["weight_bytes"] + roof["kv_bytes"], layer["weights"] + layer["kv"]
    whole = (f"{xla['bytes'] / 1e9:12.3f} {roof_bytes / 1e9:7.3f} {xla['bytes'] / roof_bytes:5.1f}"
             if xla else f"{'FAIL':>12} {'':>7} {'':>5}")
    return (f"{r['workload']['label']:<13} {variant(r['workload']):<8} "
            f"{r['workload']['topology']:<8} {step:<7} "
            f"{s['layer_bytes'] / 1e6:13.1f} {layer['weights'] / 1e6:7.1f} "
            f"{layer['kernel'] / 1e6:7.1f} {rest:6.1f} {roof_layer / 1e6:7.1f} "
            f"{outside:10.1f} {whole} {roof['weight_bytes'] / 1e9:16.3f} "
            f"{roof['kv_bytes'] / 1e9:7.3f} {roof['flops'] / 1e12:7.3f} "
            f"{(xla['flops'] / 1e12 if xla else float('nan')):9.3f}")


def bytes_table(results: list[dict[str, Any]]) -> str:
    """XLA's bytes against the roofline's, per chip. One layer: XLA's (the layer compiled on its
    own), the layer's weights, the TPU kernel's estimate, what XLA counts beyond the kernel in
    units of the weights ("rest/w"), the roofline's. "outside": the forward's XLA bytes less
    the layers' (negative where the layer alone counts more than the loop's body). Then the
    whole step (forward + sampler) against the roofline, and the roofline's split."""
    lines = [f"{'workload':<13} {'variant':<8} {'slice':<8} {'step':<7} {'layer: XLA MB':>13} "
             f"{'weights':>7} "
             f"{'kernel':>7} {'rest/w':>6} {'roof MB':>7} {'outside MB':>10} "
             f"{'step: XLA GB':>12} {'roof GB':>7} {'ratio':>5} {'roof: weights GB':>16} "
             f"{'K/V GB':>7} {'TFLOP':>7} {'XLA TFLOP':>9}"]
    lines += [bytes_row(r, step) for r in results for step in ("decode", "prefill")]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="SmolLM2's shape on v5e:2x2, small B")
    p.add_argument("--only", action="append", default=None, metavar="TEXT",
                   help="only the workloads whose label, shape, topology or variant (bf16, "
                        "int8+fp8) contains TEXT; repeatable: any of them")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    args = p.parse_args()
    problem = aot.libtpu_problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    chosen = [w for w in (QUICK if args.quick else WORKLOADS) if args.only is None
              or any(t in s for t in args.only for s in (w.label, w.shape, w.topology, variant(w)))]
    start, results = time.perf_counter(), []
    for w in chosen:
        results.append(estimate(w))
    elapsed = time.perf_counter() - start
    print(f"\nlibtpu {importlib.metadata.version('libtpu')}, jax {jax.__version__}; "
          f"{len(chosen)} workloads in {elapsed:.0f} s; estimates, no TPU run")
    for r in results:
        print(f"{r['workload']['topology']}: {r['device_kind']}, {r['hbm_bytes_per_s'] / 1e9:.0f} "
              f"GB/s, {r['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s bf16 per chip ({r['peaks_from']})")
    for table in (summary_table, programs_table, bytes_table):
        print("\n" + table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"elapsed_s": elapsed, "results": results}, indent=1))
    failed = [r for r in results for s in ("decode", "prefill") if xla_step(r[s]) is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

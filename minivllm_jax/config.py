"""Engine configuration: every knob the LLM constructor takes, declared and validated once.

`EngineConfig` holds what the user asked for (None or "auto" meaning "pick a default"); `resolve`
fills the sizes that depend on the model, and `plan.make_plan` the platform-dependent choices.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from minivllm_jax.backends import ATTENTION_BACKENDS, LAYER_LAYOUTS
from scheduler import POLICIES as SCHEDULING_POLICIES
from scheduler.spec_decode import SpeculativeConfig

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


DTYPES = ("auto", "float32", "bfloat16", "float16")
# weight quantization (`quantization`): None (the model dtype), or "int8": weight-only int8, one
# scale per output channel, for every linear layer (models/quantization.py)
QUANTIZATIONS = ("int8",)
# `kv_cache_dtype`, vLLM's names: "auto" (the plan's choice from the model dtype) or an 8-bit cache
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def check_quantization(quantization: str | None) -> str | None:
    """``quantization`` itself when it is None or one of `QUANTIZATIONS`; else ValueError
    (TypeError for a non-string): the one check of the field, for `EngineConfig` and the loader."""
    if quantization is None:
        return None
    if not isinstance(quantization, str):
        raise TypeError(f"quantization must be None or a string, got {quantization!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    return quantization


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           metavar: str | None = None, alias: str | None = None, shown: str | None = None,
           none: str | None = None) -> Any:
    """A field the command line exposes as ``--its-name`` (`cli.args.add_engine_options` makes
    the flag from the field: its type, default, ``choices`` and ``help``; ``shown``: the default
    as the help states it, when the field's own default is None; ``none``: the choice that
    stands for None, e.g. "auto")."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, choices=choices, metavar=metavar, alias=alias, shown=shown, none=none))


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Invariants after `__post_init__`: all given sizes are positive ints,
    block_size is a power of two, max_num_batched_tokens >= max_num_seqs, and without chunked
    prefill max_num_batched_tokens >= max_model_len (whichever are known). Fields made with
    `option` are the command line's engine flags."""

    max_num_seqs: int = option(128, "the most sequences one step runs (more samples of a "
                                    "request run in waves)")
    max_num_batched_tokens: int | None = option(
        None, "the token budget of one step", shown=f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, or "
                                                   "max-num-seqs if larger")
    max_model_len: int | None = option(None, "the context length",
                                       shown="the model's, lowered to what the KV cache holds")
    block_size: int = option(16, "tokens per KV cache block (a power of two)")
    num_kv_blocks: int | None = option(
        None, "KV cache blocks, the null block included",
        shown="sized from device memory, or a CPU byte budget")
    gpu_memory_utilization: float = option(
        0.9, "the share of an accelerator's memory the engine may use (weights, cache, work)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a shared prompt prefix")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps")
    dtype: str = option("auto", "the weights' and activations' dtype (auto: float32 on a CPU, "
                                "else the checkpoint's 16-bit dtype)", choices=DTYPES)
    # weight-only quantization (QUANTIZATIONS), applied when the checkpoint is loaded
    quantization: str | None = option(
        None, "int8: weight-only int8 with a scale per output channel for every linear layer",
        choices=QUANTIZATIONS, shown="none")
    # the KV cache's dtype (KV_CACHE_DTYPES): "auto" follows the model dtype (plan.kv_cache_dtype)
    kv_cache_dtype: str = option("auto", "fp8: a float8 e4m3 KV cache (twice the blocks of a "
                                         "16-bit one); auto: the model's dtype",
                                 choices=tuple(KV_CACHE_DTYPES))
    tensor_parallel_size: int = option(1, "shard weights and KV cache over this many devices")
    seed: int = 0
    # one of backends.ATTENTION_BACKENDS, or "auto" (plan.make_plan)
    attention_backend: str = option(
        "auto", "xla: tuned XLA attention (CPU default); pallas: the Triton GPU kernel (GPU "
                "default); pallas-tpu: the Mosaic TPU kernel (TPU default; interpret mode "
                "elsewhere); reference: plain jnp", choices=("auto", *ATTENTION_BACKENDS))
    # Hugging Face checkpoint conversions are cached here (loader/cache.py; None: the default)
    cache_dir: str | None = None
    # byte budget of an automatically sized KV cache on the CPU (accelerators profile memory)
    cpu_kv_cache_bytes: int = 256 << 20
    # one of backends.LAYER_LAYOUTS (models/llama.py); switched needs one device; None: plan.make_plan
    layer_layout: str | None = option(
        None, "stacked (nn.scan) or switched (a scan over per-layer weights); auto: switched on "
              "one CPU device, else stacked", choices=LAYER_LAYOUTS, alias="--layers", none="auto")
    # schedule and dispatch step N+1 before collecting step N (engine.py); None: plan.make_plan
    async_scheduling: bool | None = option(
        None, "dispatch step N+1 before collecting step N (auto: on for accelerators, off on CPU)",
        shown="auto")
    # the scheduler's queue order (SchedulerConfig.policy): "fcfs", or "priority" (lower
    # `priority` values first, then earlier arrivals; preemption takes the largest)
    scheduling_policy: str = option(
        "fcfs", "priority: a request's `priority` orders the queue (lower first)",
        choices=SCHEDULING_POLICIES)
    # keep compiled step programs on disk for later processes (executable_cache.ExecutableCache):
    # True for its default directory (executable_cache.default_compile_cache_dir), a path, or False
    compile_cache: bool | str = True
    # n-gram speculative decoding (scheduler/spec_decode.py): a SpeculativeConfig or its dict
    # (vLLM's keys), stored as a SpeculativeConfig; None: off. With async scheduling, the step in
    # flight is collected before the next is scheduled (drafts need its tokens): see engine.py.
    speculative_config: SpeculativeConfig | None = option(
        None, 'n-gram speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": '
              '4}\' (vLLM\'s keys)', metavar="JSON")

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if not isinstance(self.compile_cache, (bool, str)) or self.compile_cache == "":
            raise TypeError(f"compile_cache must be a bool or a directory path, got {self.compile_cache!r}")
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
        if self.attention_backend not in ("auto", *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be 'auto' or one of {tuple(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if not isinstance(self.dtype, str):
            raise TypeError(f"dtype must be a string such as 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        check_quantization(self.quantization)
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
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
        if self.layer_layout == "switched" and self.tensor_parallel_size > 1:
            raise ValueError(f"layer_layout={self.layer_layout!r} needs tensor_parallel_size == 1 "
                             "(tensor parallelism runs stacked layers)")
        tokens, seqs, length = self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len
        if tokens is not None and tokens < seqs:
            raise ValueError(f"max_num_batched_tokens ({tokens}) must be >= max_num_seqs ({seqs})")
        if (not self.enable_chunked_prefill and tokens is not None and length is not None
                and tokens < length):
            raise ValueError(f"max_num_batched_tokens ({tokens}) must be >= max_model_len ({length}) "
                             "when enable_chunked_prefill is False")

    @classmethod
    def from_kwargs(cls, caller: str, kwargs: dict[str, object]) -> "EngineConfig":
        """The config of ``caller``'s keyword arguments; an unknown name is a TypeError that
        lists the known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"{caller} got unexpected keyword argument(s) {unknown}; the engine's "
                            f"options are {sorted(names)}")
        return cls(**kwargs)  # type: ignore[arg-type]  # each field validates its own type

    def resolve(self, max_position_embeddings: int) -> "EngineConfig":
        """Fill max_model_len (default: the model's own limit; the runner may lower a default
        to what the KV cache holds, `fit_kv_cache`) and max_num_batched_tokens."""
        if self.max_model_len is not None and self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({max_position_embeddings})")
        length = self.max_model_len or max_position_embeddings
        tokens = self.max_num_batched_tokens
        if tokens is None:
            tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
            if not self.enable_chunked_prefill:
                tokens = max(tokens, length)
        return dataclasses.replace(self, max_model_len=length, max_num_batched_tokens=tokens)

    def fit_kv_cache(self, num_blocks: int) -> "EngineConfig":
        """This resolved config with max_model_len lowered, when needed, to the whole blocks a
        cache of `num_blocks` (null block included) holds for one request."""
        fit = (num_blocks - 1) * self.block_size
        if self.max_model_len is None or self.max_model_len <= fit:
            return self
        if fit < 2:
            raise ValueError(f"a KV cache of {num_blocks} blocks of {self.block_size} tokens holds "
                             "no request of 2 tokens or more")
        return dataclasses.replace(self, max_model_len=fit)

    @property
    def max_blocks_per_seq(self) -> int:
        if self.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet: call resolve() first")
        return -(-self.max_model_len // self.block_size)

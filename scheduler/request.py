"""Sampling parameters, request state and request status.

A request is a token list that grows: `all_token_ids = prompt_token_ids + output_token_ids`.
The scheduler's only job is to let `num_computed_tokens` (tokens whose KV is in the cache, or
will be once the step scheduled for them has run) catch up with `num_tokens`.
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from scheduler.errors import InvalidFieldError, InvalidFieldTypeError
from scheduler.structured import StructuredOutputsParams

# OpenAI's limits on logit_bias: at most this many entries, each bias in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
# the most top-k entries `logprobs` / `prompt_logprobs` may ask for (vLLM's default cap)
MAX_LOGPROBS = 20
# the most stop_token_ids a request may give (each is masked per step while min_tokens holds)
MAX_STOP_TOKEN_IDS = 64
# samples of one request: each is a sequence of its own, run in waves past max_num_seqs (OpenAI
# takes up to 128)
MAX_N = 4096
# stop strings: the engine checks each new piece of text against every one, so their count and
# total length are bounded (OpenAI takes 4; vLLM's users send a handful)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 8192
# bounds that keep every value exact and finite in the sampler's int32 / float32 arrays
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
# a temperature below this samples as greedy (vLLM's _SAMPLING_EPS): dividing float32 logits
# by a smaller one can overflow to inf
MIN_SAMPLING_TEMPERATURE = 1e-5
# repetition_penalty divides or multiplies logits: in this range they stay finite and non-zero
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _check_int(name: str, value: object, minimum: int | None = None,
               maximum: int | None = None, field: str | None = None) -> None:
    """An int (not bool) in [minimum, maximum]; errors name `field` (default: `name`)."""
    field = field or name
    if type(value) is not int:  # rejects bool and float on purpose
        raise InvalidFieldTypeError(field, f"{name} must be an int, got {type(value).__name__} "
                                           f"({value!r:.40})")
    if minimum is not None and value < minimum:
        raise InvalidFieldError(field, f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidFieldError(field, f"{name} must be <= {maximum}, got {value}")


def _check_number(name: str, value: object, low: float, high: float,
                  open_low: bool = False) -> None:
    """A real number (not bool, not NaN) in [low, high], or (low, high] with `open_low`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidFieldTypeError(name, f"{name} must be a number, got {type(value).__name__} "
                                          f"({value!r:.40})")
    if value != value:
        raise InvalidFieldError(name, f"{name} must not be NaN")
    if not (low < value if open_low else low <= value) or not value <= high:
        raise InvalidFieldError(name, f"{name} must be in {'(' if open_low else '['}{low:g}, "
                                      f"{high:g}], got {value!r:.40}")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops.

    temperature 0 (or anything below MIN_SAMPLING_TEMPERATURE) means greedy; top_k 0 or -1
    means off (vLLM's -1); min_p 0 means off (a token is kept when its probability is at least
    min_p times the most likely token's). `logit_bias` maps token ids to a bias added to their
    logits before anything else, greedy rows included; it is stored as a dict of int -> float
    (the engine checks the ids against its vocabulary). `stop` strings are applied by the engine
    at detokenization; the scheduler only stores them. `n` samples per prompt share the prompt's
    KV. Penalties: `repetition_penalty` (in REPETITION_PENALTY_RANGE, 1 is off; transformers'
    rule over prompt and output tokens), `presence_penalty` and `frequency_penalty` (in [-2, 2],
    0 is off; OpenAI's rule over output tokens). `logprobs` / `prompt_logprobs` (None or
    0..MAX_LOGPROBS): the model's own log-probabilities of each sampled / prompt token plus that
    many most likely tokens. While fewer than `min_tokens` tokens were generated, EOS (unless
    `ignore_eos`) and `stop_token_ids` cannot be sampled (vLLM's rule). `structured_outputs`
    constrains the output to a JSON schema, regex, choice or grammar (`StructuredOutputsParams`;
    a dict of its fields is converted): only tokens it allows are sampled, EOS only where it is
    complete.
    Every field is validated at construction and a bad value raises ValueError/TypeError naming
    the field; every number is bounded so that no value can fail a step (ints fit int32, seeds
    int64, floats stay finite in float32).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties is on (the sampler then reads token counts)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def __post_init__(self) -> None:
        """Every number within bounds that no step can fail on (int32 / float32 exact and
        finite); vocabulary-dependent bounds (top_k, token ids) are the engine's check."""
        _check_number("temperature", self.temperature, 0.0, FLOAT32_MAX)
        _check_number("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _check_int("top_k", self.top_k, -1, INT32_MAX)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_int("n", self.n, 1, MAX_N)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.min_tokens > self.max_tokens:
            raise InvalidFieldError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= "
                                                  f"max_tokens ({self.max_tokens})")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise InvalidFieldTypeError("stop_token_ids", "stop_token_ids must be a sequence of "
                                                          f"ints, got {self.stop_token_ids!r:.60}")
        ids = tuple(self.stop_token_ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidFieldError("stop_token_ids", f"stop_token_ids has {len(ids)} entries; at "
                                                      f"most {MAX_STOP_TOKEN_IDS}")
        for t in ids:
            _check_int("stop_token_ids", t, 0, INT32_MAX)
        object.__setattr__(self, "stop_token_ids", ids)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if type(getattr(self, name)) is not bool:
                raise InvalidFieldTypeError(name, f"{name} must be a bool, got "
                                                  f"{getattr(self, name)!r:.40}")
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        stop = self.stop
        if stop is not None:
            strs = [stop] if isinstance(stop, str) else stop
            if not isinstance(strs, (list, tuple)) or not all(isinstance(s, str) and s for s in strs):
                raise InvalidFieldError("stop", "stop must be a non-empty string or a list of "
                                                f"them, got {stop!r:.60}")
            total = sum(len(s) for s in strs)
            if len(strs) > MAX_STOP_STRINGS or total > MAX_STOP_CHARS:
                raise InvalidFieldError("stop", f"stop has {len(strs)} strings of {total} characters "
                                                f"in all; at most {MAX_STOP_STRINGS} strings of "
                                                f"{MAX_STOP_CHARS} characters are allowed")
            object.__setattr__(self, "stop", list(strs))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams.from_dict(self.structured_outputs))

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are the argmax: temperature below MIN_SAMPLING_TEMPERATURE."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE


def _check_logit_bias(bias: object) -> dict[int, float] | None:
    """A dict of token id (int >= 0; numeric strings too, as JSON keys arrive) -> finite bias in
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]; None when empty."""
    if not isinstance(bias, Mapping):
        raise InvalidFieldTypeError("logit_bias", "logit_bias must be a dict of token id -> "
                                                  f"bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidFieldError("logit_bias", f"logit_bias has {len(bias)} entries; at most "
                                              f"{MAX_LOGIT_BIAS_ENTRIES}")
    out = {}
    for key, value in bias.items():
        tok = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        _check_int("logit_bias token id", tok, 0, INT32_MAX, field="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidFieldError("logit_bias", f"logit_bias[{key!r}] must be a finite number, "
                                                  f"got {value!r}")
        if abs(value) > MAX_LOGIT_BIAS:
            raise InvalidFieldError("logit_bias", f"logit_bias[{key!r}] must be in "
                                                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}")
        out[tok] = float(value)
    return out or None


class RequestStatus(enum.IntEnum):
    """Lifecycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING)* -> one FINISHED_* status."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a model step it was part of failed

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        """"stop", "length", "abort" or "error" for a finished status, None otherwise."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# request -> hashes of its full blocks not yet in request.block_hashes; see block_pool.BlockHasher
BlockHasherFn = Callable[["Request"], list[bytes]]
_NEVER = 1 << 62


class Request:
    """One generation request.

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `0 <= num_computed_tokens <= num_tokens + num_output_placeholders`, where
    `num_output_placeholders` counts tokens scheduled to be sampled whose ids the scheduler has
    not been given yet (at most 2 with async scheduling, 0 between a sync step's update and the
    next schedule); when a block hasher is attached, `block_hashes`
    holds exactly one hash per full block of `all_token_ids` (each block hashed once, when it
    fills). Status and stop_reason stay readable after the request finishes. A request with a
    `fork_of` lead (a sibling sample, same prompt) takes the lead's full prompt blocks by
    reference when it is admitted.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 *, eos_token_id: int | None = None, arrival_time: float | None = None,
                 priority: int = 0, cache_salt: str | None = None,
                 fork_of: "Request | None" = None, parent_id: str | None = None,
                 sample_index: int = 0) -> None:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # the lead sample of the same prompt (n > 1), whose full prompt blocks this one shares
        self.fork_of = fork_of
        self.parent_id = parent_id  # the caller's request id, for one of its n samples
        self.sample_index = sample_index
        # prompt_logprobs need every prompt token's logits, so nothing is read from the cache
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        # speculative decoding: the draft tokens to verify in the next step (set before
        # `schedule()`, consumed by it), and this request's drafted / accepted totals
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self._block_hasher: BlockHasherFn | None = None
        self._block_size = 0
        self._next_hash_at = _NEVER  # num_tokens at which the next block becomes full
        self.set_stop_filter(None)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    @property
    def has_block_hasher(self) -> bool:
        return self._block_hasher is not None

    def set_block_hasher(self, hasher: BlockHasherFn, block_size: int) -> None:
        """Attach the block hasher and hash every block that is already full."""
        self._block_hasher = hasher
        self._block_size = block_size
        self.block_hashes = []
        self.block_hashes.extend(hasher(self))
        self._next_hash_at = (len(self.block_hashes) + 1) * block_size

    def set_stop_filter(self, max_model_len: int | None) -> None:
        """Stop-rule pre-filter for the scheduler's hot path: only a token in `stop_candidates`
        or reaching `length_limit` tokens can trigger a stop rule."""
        sp = self.sampling_params
        self.stop_candidates = frozenset(sp.stop_token_ids) | (
            frozenset() if self.eos_token_id is None or sp.ignore_eos else {self.eos_token_id})
        self.length_limit = self.num_prompt_tokens + sp.max_tokens
        if max_model_len is not None:
            self.length_limit = min(self.length_limit, max_model_len)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled tokens (Python or numpy ints), hashing blocks that become full."""
        if isinstance(token_ids, (list, tuple)):
            token_ids = [int(t) for t in token_ids]
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        else:
            if type(token_ids) is not int:
                token_ids = int(token_ids)
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        if len(self.all_token_ids) >= self._next_hash_at:
            self.hash_new_blocks()

    def hash_new_blocks(self) -> None:
        """Extend block_hashes with the blocks that filled up since the last call."""
        self.block_hashes.extend(self._block_hasher(self))
        self._next_hash_at = (len(self.block_hashes) + 1) * self._block_size

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")

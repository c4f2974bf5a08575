"""Speculative decoding's configuration and its n-gram (prompt lookup) draft proposer.

`SpeculativeConfig` is what `LLM(speculative_config={...})` and `--speculative-config '<JSON>'`
give, validated: `method == "ngram"`, `1 <= num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS`,
`1 <= prompt_lookup_min <= prompt_lookup_max <= MAX_PROMPT_LOOKUP`. Every refusal is an
`InvalidFieldError` (`InvalidFieldTypeError` for a wrong type) whose field is
"speculative_config" and whose message starts with `speculative_config.<key>`. Defaults are
vLLM's: neither lookup bound given -> both 5; one given -> the other equals it.

`NgramProposer` is vLLM V1's "ngram" method (`vllm/v1/spec_decode/ngram_proposer.py`); its
drafts depend on nothing but its config and the tokens it is given. For a sequence `t` of length
T (prompt + output token ids) it proposes `t[e+1 : e+1+m]`, where
- `n` is the largest length in [prompt_lookup_min, prompt_lookup_max] such that the suffix
  `t[T-n:]` also occurs as `t[e-n+1 : e+1]` with `e <= T-2`: any occurrence other than the suffix
  itself, overlapping it allowed (in `[1, 1, 1]` with n = 2 the occurrence `t[0:2]` matches);
- among those occurrences of the suffix of length n, the earliest (smallest `e`), as vLLM V1;
- `m = min(num_speculative_tokens, max_tokens, T-1-e)`: at least one token, fewer than k when
  the sequence ends first (drafts never wrap around or repeat themselves).
No occurrence of any allowed length, or `max_tokens <= 0` -> an empty array. A draft has its
input's dtype and is never a view of it (a batch's empty drafts may share one array). The whole
sequence is searched, like vLLM; the caller's `max_tokens` carries both limits: the request's
remaining `max_tokens` and `max_model_len - T`. `propose` is the rule for one sequence;
`propose_padded(buf, n, m)[i] == propose(buf[i, :n[i]], m[i])` is what the engine calls on its
input batch: the same drafts, found for the whole batch by numpy calls whose number does not grow
with the batch (besides slicing out each draft found).
"""
from __future__ import annotations

import json
import operator
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np

from scheduler.errors import InvalidFieldError, InvalidFieldTypeError
from scheduler.request import Request

FIELD = "speculative_config"
SUPPORTED_METHODS = ("ngram",)
_METHOD_ALIASES = MappingProxyType({"[ngram]": "ngram"})  # vLLM's older spelling, normalised
# each verified request runs 1 + k query tokens a step: beyond 16 drafts (vLLM's examples use
# 2..10) a rejected draft only wastes compute
MAX_NUM_SPECULATIVE_TOKENS = 16
# the proposer's cost grows with prompt_lookup_max (one pass per n-gram length over the matches)
MAX_PROMPT_LOOKUP = 64
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given
# a request stops drafting for good once this many of its draft tokens were verified and fewer
# than AUTO_OFF_ACCEPTANCE of them accepted (vLLM drafts on): where prompt lookup keeps missing,
# the verified positions cost step time and emit nothing
AUTO_OFF_MIN_DRAFT_TOKENS = 16
AUTO_OFF_ACCEPTANCE = 0.25
_REQUIRED = ("method", "num_speculative_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings; after construction both lookup bounds are ints.

    `num_speculative_tokens` (k): the most draft tokens proposed per request per step.
    `prompt_lookup_max` / `prompt_lookup_min`: the longest / shortest n-gram matched (None:
    vLLM's default, see the module docstring).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        if type(self.method) is not str:
            raise InvalidFieldTypeError(FIELD, f"{FIELD}.method must be a string, one of "
                                               f"{list(SUPPORTED_METHODS)}, got {_show(self.method)}")
        method = _METHOD_ALIASES.get(self.method, self.method)
        if method not in SUPPORTED_METHODS:
            raise InvalidFieldError(FIELD, f"{FIELD}.method {self.method!r:.40} is not supported; "
                                           f"supported: {list(SUPPORTED_METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, MAX_NUM_SPECULATIVE_TOKENS)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if value is not None:
                _check_int(name, value, MAX_PROMPT_LOOKUP)
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise InvalidFieldError(FIELD, f"{FIELD}.prompt_lookup_min ({lo}) must be <= "
                                           f"prompt_lookup_max ({hi})")
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, value: Mapping[str, object] | SpeculativeConfig) -> SpeculativeConfig:
        """The config of a user's dict (the `speculative_config=` argument, or the parsed JSON of
        `--speculative-config`); a SpeculativeConfig is returned as is. Keys: `method` and
        `num_speculative_tokens` (required), `prompt_lookup_max`, `prompt_lookup_min`."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise InvalidFieldTypeError(FIELD, f"{FIELD} must be a dict (a JSON object) with keys "
                                               f"{_keys()}, got {_show(value)}")
        for key in value:
            if key not in _keys():
                raise InvalidFieldError(FIELD, f"{FIELD}.{key!s:.40} is not a known key; "
                                               f"known keys: {_keys()}")
        for key in _REQUIRED:
            if key not in value:
                raise InvalidFieldError(FIELD, f"{FIELD}.{key} is required (keys: {_keys()})")
        return cls(**value)  # type: ignore[arg-type]  # each value is checked in __post_init__

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config of `--speculative-config`'s JSON text (an object; see `from_dict`)."""
        if type(text) is not str:
            raise InvalidFieldTypeError(FIELD, f"{FIELD} must be JSON text, got {_show(text)}")
        try:
            value = json.loads(text)
        except ValueError as e:
            raise InvalidFieldError(FIELD, f"{FIELD} must be a JSON object, could not parse "
                                           f"{_show(text)}: {e}") from None
        return cls.from_dict(value)


def _keys() -> list[str]:
    return [f.name for f in fields(SpeculativeConfig)]


def _show(value: object) -> str:
    return f"{type(value).__name__} ({value!r:.40})"


def _check_int(name: str, value: object, maximum: int) -> None:
    if type(value) is not int:  # bool and float refused on purpose
        raise InvalidFieldTypeError(FIELD, f"{FIELD}.{name} must be an int, got {_show(value)}")
    if not 1 <= value <= maximum:
        raise InvalidFieldError(FIELD, f"{FIELD}.{name} must be in [1, {maximum}], got {value}")


def draft_limit(request: Request, k: int, max_model_len: int) -> int:
    """How many drafts `request` may verify in its next step (0: none). It must be a decode with
    no token in flight; at most k, and fewer where max_tokens or max_model_len would be passed or
    where min_tokens' mask would change within them (the sampler gives all of a row's positions
    one mask); none for a structured-output request (its grammar masks its first position only)
    or one whose drafts are mostly rejected (AUTO_OFF_MIN_DRAFT_TOKENS)."""
    sp = request.sampling_params
    if (request.num_computed_tokens != request.num_tokens - 1 or request.num_output_placeholders
            or sp.structured_outputs is not None):
        return 0
    drafted = request.num_draft_tokens
    if (drafted >= AUTO_OFF_MIN_DRAFT_TOKENS
            and request.num_accepted_tokens < AUTO_OFF_ACCEPTANCE * drafted):
        return 0
    n_out = len(request.output_token_ids)
    m = min(k, sp.max_tokens - n_out - 1, max_model_len - request.num_tokens - 1)
    if n_out < sp.min_tokens:
        m = min(m, sp.min_tokens - 1 - n_out)
    return max(m, 0)


class NgramProposer:
    """Prompt-lookup drafts (see the module docstring for exactly which tokens).

    Holds only its settings and a scratch workspace that `propose_padded` reuses across calls
    (so that a step's large temporary array is not freshly allocated and page-faulted each
    time): one instance must not be used by two threads at once.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        if not isinstance(config, SpeculativeConfig):
            raise TypeError(f"NgramProposer needs a SpeculativeConfig, got {type(config).__name__}")
        self.k: int = config.num_speculative_tokens
        self.min_n: int = config.prompt_lookup_min  # type: ignore[assignment]  # int after init
        self.max_n: int = config.prompt_lookup_max  # type: ignore[assignment]
        self._mask = np.empty(0, bool)  # workspace: which positions hold their row's last token

    def propose(self, token_ids: np.ndarray, max_tokens: int) -> np.ndarray:
        """Up to min(k, max_tokens) draft tokens continuing `token_ids` (1-D ints)."""
        seq = _as_tokens(token_ids)
        limit = min(self.k, operator.index(max_tokens))
        if limit <= 0 or seq.shape[0] <= self.min_n:
            return np.empty(0, seq.dtype)
        end = _match_end(self.min_n, self.max_n, seq)
        return seq[end + 1:end + 1 + limit].copy() if end >= 0 else np.empty(0, seq.dtype)

    def propose_padded(self, token_ids: np.ndarray, num_tokens: np.ndarray,
                       max_tokens: np.ndarray | Sequence[int]) -> list[np.ndarray]:
        """`[propose(token_ids[i, :num_tokens[i]], max_tokens[i]) for i ...]` for a 2-D token
        buffer (a runner's input batch), without making the row views or copying the rows.
        Costs O(rows x max(num_tokens)): for a batch of similar lengths."""
        token_ids, num_tokens, max_tokens = map(np.asarray, (token_ids, num_tokens, max_tokens))
        rows, width = token_ids.shape if token_ids.ndim == 2 else (-1, -1)
        if any(a.dtype.kind not in "iu" and a.size for a in (token_ids, num_tokens, max_tokens)) \
                or num_tokens.shape != (rows,) or max_tokens.shape != (rows,) \
                or not ((0 <= num_tokens) & (num_tokens <= width)).all():
            raise ValueError(f"propose_padded needs a 2-D integer token_ids and, per row, an "
                             f"integer num_tokens in [0, width] and max_tokens; got token_ids "
                             f"{token_ids.shape} {token_ids.dtype}, num_tokens {num_tokens.shape} "
                             f"{num_tokens.dtype}, max_tokens {max_tokens.shape} {max_tokens.dtype}")
        num_tokens = num_tokens.astype(np.int64, copy=False)
        limits = np.minimum(self.k, max_tokens.astype(np.int64, copy=False))
        live = np.where((limits > 0) & (num_tokens > self.min_n), num_tokens, 0)
        empty = np.empty(0, token_ids.dtype)  # zero-size: safe to share
        out = [empty] * rows
        if not live.any():
            return out
        used = int(live.max())
        last = token_ids[np.arange(rows), np.maximum(live - 1, 0)]
        mask = self._mask_buffer(rows * used).reshape(rows, used)
        np.equal(token_ids[:, :used], last[:, None], out=mask)
        idx = np.flatnonzero(mask)
        row, col = np.divmod(idx, used)
        keep = col < live[row] - 1  # inside the sequence, and not its last token
        row, col = row[keep], col[keep]
        flat = token_ids.reshape(-1)  # a view when the rows are contiguous
        starts = np.arange(rows, dtype=np.int64) * width
        best = _deepest_first(flat, starts, starts + live - 1, row * width + col, row,
                              self.min_n, self.max_n)
        stop = np.minimum(best + 1 + limits, live)  # the draft ends with the sequence at most
        for i in np.flatnonzero(best >= 0).tolist():
            out[i] = token_ids[i, best[i] + 1:stop[i]].copy()
        return out

    def _mask_buffer(self, n: int) -> np.ndarray:
        if self._mask.shape[0] < n:
            self._mask = np.empty(max(n, 2 * self._mask.shape[0]), bool)
        return self._mask[:n]


def _deepest_first(flat: np.ndarray, starts: np.ndarray, lasts: np.ndarray, cand: np.ndarray,
                   row: np.ndarray, min_n: int, max_n: int) -> np.ndarray:
    """Per row, the offset from `starts[row]` of the earliest end of the longest (capped at
    max_n, at least min_n) suffix n-gram occurrence, or -1. Row r's tokens are
    `flat[starts[r] : lasts[r] + 1]`; `cand` (flat positions, sorted) and `row` (their rows) are
    the positions before `lasts[row]` that hold their row's last token: the occurrences of length
    1. Each level keeps the candidates that can and do extend one token to the left; a row's
    first candidate at the deepest level >= min_n wins."""
    best = np.full(starts.shape[0], -1, np.int64)
    for level in range(1, max_n + 1):
        if level > 1:
            left = cand - (level - 1)  # reads outside the row (clipped) are masked by the bound
            keep = flat.take(left, mode="clip") == flat[lasts[row] - (level - 1)]
            keep &= left >= starts[row]
            cand, row = cand[keep], row[keep]
        if cand.size == 0:
            break
        if level >= min_n:
            first = np.empty(row.shape[0], bool)
            first[0] = True
            np.not_equal(row[1:], row[:-1], out=first[1:])
            best[row[first]] = cand[first] - starts[row[first]]
    return best


def _as_tokens(seq: np.ndarray) -> np.ndarray:
    if type(seq) is not np.ndarray:
        seq = np.asarray(seq)
    if seq.ndim == 1 and seq.size == 0 and seq.dtype.kind not in "iu":
        return np.empty(0, np.int64)  # an empty list
    if seq.ndim != 1 or seq.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be a 1-D integer array, got shape {seq.shape} "
                         f"dtype {seq.dtype}")
    return seq


def _match_end(min_n: int, max_n: int, seq: np.ndarray) -> int:
    """The index `e` of the last token of the earliest occurrence of the longest suffix n-gram
    of `seq` (n in [min_n, max_n], e <= T-2, T = len(seq) > min_n) that occurs earlier, or -1.

    `cand` holds the positions `e` that end an occurrence of the suffix of length `level`, in
    increasing order; each level keeps those that can and do extend one token to the left.
    """
    t = seq.shape[0]
    cand = np.flatnonzero(seq[:t - 1] == seq[t - 1])
    best = -1
    for level in range(1, max_n + 1):
        if level > 1:
            j = level - 1
            if cand[0] < j:  # no room to extend left of the sequence's start (cand is sorted)
                cand = cand[np.searchsorted(cand, j):]
            cand = cand[seq[cand - j] == seq[t - 1 - j]]
        if cand.size == 0:
            break
        if level >= min_n:
            best = int(cand[0])
    return best

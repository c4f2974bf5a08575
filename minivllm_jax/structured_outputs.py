"""Structured outputs on the host: each constraint compiled once (llguidance), a matcher per
sample, and each step's token bitmask, which the sampler program applies on the device
(`sampler.apply_token_bitmask`).

Invariants:
- A sample's matcher has consumed exactly its request's output tokens once `advance` has run
  after a step is collected (it catches up, or rolls back should the tokens shrink); so the mask
  a step's row gets is the grammar's next-token set after every token the row has generated.
- A grammar is compiled once per `StructuredOutputsParams.key` (an LRU of pristine matchers);
  a sample's matcher is a copy. A constraint that does not compile is an `InvalidFieldError`
  naming ``structured_outputs``, raised when the request is added.
- Bitmask row r, bit t (word t // 32, bit t % 32) set: token t may be sampled. Rows of samples
  without a constraint allow every token. EOS is allowed only where the constraint is complete,
  and once it can take nothing more (the matcher has stopped) EOS is all it allows.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import llguidance
import llguidance.hf
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from scheduler.errors import InvalidFieldError
from scheduler.structured import FIELD, StructuredOutputsParams

logger = logging.getLogger(__name__)

# llguidance's default limits, but errors without a dump of the parser's state
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# compiled grammars kept (pristine matchers, least recently used dropped first)
MAX_CACHED_GRAMMARS = 256


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of one constraint (not yet checked: `compile` does)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": not params.disable_any_whitespace})
    try:  # llguidance's own: a choice is a Lark alternation, a grammar Lark or GBNF
        return llguidance.grammar_from(kind, list(params.choice) if kind == "choice" else params.spec)
    except ValueError as e:
        raise InvalidFieldError(FIELD, f"{FIELD}.{kind} cannot be compiled: {e}") from None


@dataclass
class _Sample:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens consumed


class StructuredOutputManager:
    """Grammars, matchers and bitmasks of one engine's tokenizer and vocabulary."""

    def __init__(self, tokenizer: object, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s)
        self._executor: llguidance.LLExecutor | None = None
        self._grammars: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._samples: dict[str, _Sample] = {}

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer; InvalidFieldError (``structured_outputs``) for a
        tokenizer it cannot read (it needs a fast tokenizer with a byte-level or
        SentencePiece-style decoder)."""
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)
            except Exception as e:  # noqa: BLE001 - llguidance raises ValueError or its own
                raise InvalidFieldError(FIELD, f"{FIELD} is not supported with this model's "
                                               f"tokenizer: {e}") from None
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The pristine matcher of a constraint, compiled on first use; InvalidFieldError
        (``structured_outputs``) when it does not compile."""
        key = params.key
        matcher = self._grammars.get(key)
        if matcher is not None:
            self._grammars.move_to_end(key)
            return matcher
        grammar = grammar_text(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=_LIMITS)
        matcher = None if error else llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                                          limits=_LIMITS)
        if error or matcher.is_error():
            reason = (error or matcher.get_error()).strip().splitlines()[0][:300]
            raise InvalidFieldError(FIELD, f"{FIELD}.{params.kind} cannot be compiled: {reason}")
        self._grammars[key] = matcher
        if len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return matcher

    def add(self, req_id: str, params: StructuredOutputsParams) -> None:
        """Give a sample its own matcher (at the start of its output)."""
        self._samples[req_id] = _Sample(self.compile(params).deep_copy())

    def remove(self, req_id: str) -> None:
        self._samples.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._samples

    def __len__(self) -> int:
        return len(self._samples)

    def advance(self, req_id: str, output_token_ids: Sequence[int]) -> bool:
        """Bring a sample's matcher to its request's output tokens; False when the grammar
        refuses one (the request's output no longer satisfies its constraint)."""
        s = self._samples.get(req_id)
        if s is None:
            return True
        n = len(output_token_ids)
        if n < s.consumed:
            s.matcher.rollback(s.consumed - n)
            s.consumed = n
        if n > s.consumed:
            new = output_token_ids[s.consumed:]
            s.consumed = n
            # one at a time: consume_tokens refuses EOS once the matcher has stopped
            if not all(s.matcher.consume_token(t) for t in new):
                logger.warning("request %s: its grammar refused a token: %s", req_id,
                               s.matcher.get_error())
                return False
        return True

    def bitmask(self, req_ids: Sequence[str], rows: int) -> np.ndarray:
        """The bitmask [rows, words] of a step whose sampled rows are `req_ids` (in order; the
        rest padding): each constrained row's next-token set, every other row all ones."""
        mask = np.full((rows, self.words), -1, np.int32)
        todo = [(s.matcher, i) for i, r in enumerate(req_ids) if (s := self._samples.get(r)) is not None]
        if todo:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            fill_next_token_bitmask_par(self._executor, todo, mask)
        return mask

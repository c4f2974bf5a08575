"""Structured outputs on the host: each constraint checked in isolation and compiled once
(llguidance), a matcher per sample, and each step's token bitmask, which the sampler program
applies on the device (`sampler.apply_token_bitmask`).

Invariants:
- Admission does all of a constraint's grammar work before its request is added (`prepare`,
  thread-safe, so a server runs it off its engine thread and event loop; llguidance releases
  the GIL while it compiles): the pure-Python checks of `StructuredOutputsParams`, then a first
  compile and first mask in a child process (`grammar_worker`: a native crash or a compile over
  `COMPILE_TIMEOUT_S` kills only that process), then the compile here, within `PARSER_LIMITS`,
  and the first mask's check that some output is possible. Every refusal is an
  `InvalidFieldError` naming ``structured_outputs`` and the reason or the limit.
- A sample's matcher has consumed exactly its request's output tokens once `advance` has run
  after a step is collected (it catches up, or rolls back should the tokens shrink); so the mask
  a step's row gets is the grammar's next-token set after every token the row has generated.
- A step's mask lets a row end only where its constraint is complete: EOS and the row's stop
  token ids are cleared while the matcher is not accepting. A row with no token left, or whose
  matcher failed (a per-token limit of `PARSER_LIMITS` tripped), is reported by `bitmask` and
  its request ends alone, with the reason; the step goes on for every other row.
- Bitmask row r, bit t (word t // 32, bit t % 32) set: token t may be sampled. Rows of samples
  without a constraint allow every token.
"""
from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from minivllm_jax.structured_output.grammar_worker import GrammarWorker, compile_and_mask
from scheduler.errors import InvalidFieldError
from scheduler.structured import FIELD, StructuredOutputsParams

# llguidance's parser limits, explicit (README, "Structured outputs"): grammar symbols; regex
# analysis fuel at compile time (~50k a ms); per generated token, lexer fuel (~14k a ms) and
# Earley items (~20k a ms), so one row's mask costs at most ~15 ms; branches of one grammar row
# (a choice is a regex alternation, so thousands of choices stay within it); lexer states
PARSER_LIMITS = dict(max_grammar_size=500_000, initial_lexer_fuel=1_000_000,
                     step_lexer_fuel=200_000, step_max_items=50_000, max_items_in_row=2_000,
                     max_lexer_states=100_000, verbose_errors=False)
# a constraint's first compile and first mask, in the grammar worker, at most this long
COMPILE_TIMEOUT_S = 10.0
# compiled grammars kept (pristine matchers, least recently used dropped first)
MAX_CACHED_GRAMMARS = 256
# constraints that passed the worker's check, by digest (a bounded record)
MAX_CHECKED = 65_536


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def _refusal(params: StructuredOutputsParams, reason: str) -> InvalidFieldError:
    """The 400 of a constraint the grammar library refused, in words: nothing can match it, a
    limit of `PARSER_LIMITS` or `COMPILE_TIMEOUT_S`, or the library's own reason."""
    head = f"{FIELD}.{params.kind}"
    if "NoExtensionBias" in reason:
        return InvalidFieldError(FIELD, f"{head} admits no complete output (nothing can match it)")
    if any(w in reason for w in ("too many", "limit", "fuel", "longer than")):
        return InvalidFieldError(FIELD, f"{head} exceeds a limit of the grammar engine (README, "
                                        f"\"Structured outputs\"): {reason}")
    return InvalidFieldError(FIELD, f"{head} cannot be compiled: {reason}")


def _limit_tripped(reason: str) -> str:
    """Why a request's constraint ended it mid-generation: a per-token limit of the grammar
    engine (`PARSER_LIMITS`), in the library's words."""
    return (f"{FIELD}: generation stopped, a per-token limit of the grammar engine was exceeded "
            f"(README, \"Structured outputs\"): {reason[:200]}")


def _clear_bits(row: np.ndarray, tokens: Sequence[int]) -> None:
    """Clear the bits of `tokens` in one int32 bitmask row, in place."""
    words = row.view(np.uint32)
    for t in tokens:
        words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)


def _digest(key: tuple) -> bytes:
    return hashlib.sha256(repr(key).encode()).digest()


@dataclass
class _Sample:
    matcher: llguidance.LLMatcher
    key: tuple
    stop_ids: tuple[int, ...]  # its stop token ids: like EOS, only where the constraint is complete
    consumed: int = 0  # output tokens consumed


class StructuredOutputManager:
    """Grammars, matchers and bitmasks of one engine's tokenizer and vocabulary."""

    def __init__(self, tokenizer: object, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._eos = list(eos_token_ids)
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s)
        self._tokenizer_json: str | None = None
        self._worker: GrammarWorker | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()  # the caches: `prepare` runs on any thread
        self._grammars: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._checked: OrderedDict[bytes, None] = OrderedDict()
        self._samples: dict[str, _Sample] = {}
        self._failed: dict[str, str] = {}  # `bitmask`'s failures, until `errors_after_step`

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer; InvalidFieldError (``structured_outputs``) for a
        tokenizer it cannot read (it needs a fast tokenizer with a byte-level or
        SentencePiece-style decoder)."""
        with self._lock:
            if self._tokenizer is None:
                try:
                    backend = copy.copy(self._hf_tokenizer.backend_tokenizer)
                    backend.no_padding()
                    backend.no_truncation()
                    text = backend.to_str()
                    self._tokenizer = llguidance.LLTokenizer(
                        text, n_vocab=self.vocab_size, eos_token=self._eos or None)
                    self._tokenizer_json = text
                except Exception as e:  # noqa: BLE001 - llguidance raises ValueError or its own
                    raise InvalidFieldError(FIELD, f"{FIELD} is not supported with this model's "
                                                   f"tokenizer: {e}") from None
            return self._tokenizer

    @property
    def worker(self) -> GrammarWorker:
        """The child process constraints are first compiled in (started on first use)."""
        tokenizer = self.tokenizer
        with self._lock:
            if self._worker is None:
                eos = self._eos or [tokenizer.eos_token]
                self._worker = GrammarWorker(self._tokenizer_json, self.vocab_size, eos,
                                             PARSER_LIMITS, COMPILE_TIMEOUT_S)
            return self._worker

    def start_worker(self) -> None:
        """Build llguidance's tokenizer here and now (it reads the HF tokenizer, which no other
        thread may use meanwhile: a server calls this before its engine thread starts), and
        start the grammar worker process in the background, not at the first request."""
        worker = self.worker
        threading.Thread(target=worker.start, name="minivllm-grammar-start", daemon=True).start()

    def prepare(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """All of a constraint's grammar work (the module's invariants), once per constraint:
        returns its pristine matcher. Thread-safe; InvalidFieldError (``structured_outputs``)
        naming the reason when the constraint cannot be served."""
        key = params.key
        with self._lock:
            matcher = self._grammars.get(key)
            if matcher is not None:
                self._grammars.move_to_end(key)
                return matcher
            checked = _digest(key) in self._checked
        if not checked:
            result = self.worker.check(params)
            if result.error is not None:
                raise _refusal(params, result.error)
        try:
            matcher = compile_and_mask(self.tokenizer, params, self._limits)
        except ValueError as e:
            raise _refusal(params, str(e)) from None
        self._check_first_mask(matcher, params)
        with self._lock:
            self._checked[_digest(key)] = None
            if len(self._checked) > MAX_CHECKED:
                self._checked.popitem(last=False)
            self._grammars[key] = matcher
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return matcher

    compile = prepare

    def _check_first_mask(self, matcher: llguidance.LLMatcher, params: StructuredOutputsParams) -> None:
        """InvalidFieldError unless some output can begin: a token other than EOS allowed, or
        the empty output complete (a grammar that needs EOS inside itself cannot be served:
        EOS ends the output)."""
        probe = matcher.deep_copy()
        mask = np.frombuffer(probe.compute_bitmask(), np.int32).copy()
        if probe.is_error():
            raise _refusal(params, probe.get_error().strip().splitlines()[0][:300])
        if not probe.is_accepting():
            _clear_bits(mask, self._eos)
            if not mask.any():
                raise InvalidFieldError(FIELD, f"{FIELD}.{params.kind} admits no complete output "
                                               "(no token can begin one; an end-of-sequence token "
                                               "inside the constraint cannot be generated)")

    def add(self, req_id: str, params: StructuredOutputsParams,
            stop_token_ids: Sequence[int] = ()) -> None:
        """Give a sample its own matcher (at the start of its output); `stop_token_ids` end it
        only where its constraint is complete, as EOS does."""
        matcher = self.prepare(params).deep_copy()
        self._samples[req_id] = _Sample(matcher, params.key, tuple(stop_token_ids))

    def remove(self, req_id: str) -> None:
        self._samples.pop(req_id, None)
        self._failed.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._samples

    def __len__(self) -> int:
        return len(self._samples)

    def advance(self, req_id: str, output_token_ids: Sequence[int]) -> str | None:
        """Bring a sample's matcher to its request's output tokens; the reason, naming
        ``structured_outputs``, when it cannot (a per-token limit tripped consuming one, or the
        grammar refuses one: its output no longer satisfies the constraint), else None."""
        s = self._samples.get(req_id)
        if s is None:
            return None
        n = len(output_token_ids)
        if n < s.consumed:
            s.matcher.rollback(s.consumed - n)
            s.consumed = n
        if n > s.consumed:
            new = output_token_ids[s.consumed:]
            s.consumed = n
            # one at a time: consume_tokens refuses EOS once the matcher has stopped
            if not all(s.matcher.consume_token(t) for t in new):
                error = s.matcher.get_error().strip().splitlines()
                if s.matcher.is_error() and error and "satisfy the grammar" not in error[0]:
                    return _limit_tripped(error[0])
                return f"{FIELD}: the constraint's grammar refused a sampled token"
        return None

    def accepts_text(self, req_id: str, text: str) -> bool:
        """Whether `text`, as a whole output, satisfies the sample's constraint (a stop string
        ends a constrained output only where this holds); True for unconstrained samples."""
        s = self._samples.get(req_id)
        if s is None:
            return True
        with self._lock:
            pristine = self._grammars.get(s.key)
        if pristine is None:  # evicted: the sample's own matcher, rolled back to its start
            probe = s.matcher.deep_copy()
            probe.rollback(s.consumed)
        else:
            probe = pristine.deep_copy()
        tokens = self.tokenizer.tokenize_str(text)
        return all(probe.consume_token(t) for t in tokens) and probe.is_accepting()

    def bitmask(self, req_ids: Sequence[str], rows: int) -> tuple[np.ndarray, dict[str, str]]:
        """The bitmask [rows, words] of a step whose sampled rows are `req_ids` (in order; the
        rest padding): each constrained row's next-token set, every other row all ones; and the
        samples that cannot go on, with the reason (their rows are then meaningless; kept for
        `errors_after_step`)."""
        mask = np.full((rows, self.words), -1, np.int32)
        todo = [(s, i) for i, r in enumerate(req_ids) if (s := self._samples.get(r)) is not None]
        failed: dict[str, str] = {}
        if not todo:
            return mask, failed
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for s, i in todo], mask)
        for s, i in todo:
            if s.matcher.is_error():
                failed[req_ids[i]] = _limit_tripped(s.matcher.get_error().strip().splitlines()[0])
                continue
            if not s.matcher.is_accepting():
                _clear_bits(mask[i], (*self._eos, *s.stop_ids))
                if not mask[i].any():
                    failed[req_ids[i]] = (f"{FIELD}: generation stopped, the constraint allows no "
                                          "token here that the model can generate")
        self._failed.update(failed)
        return mask, failed

    def errors_after_step(self, sampled: Iterable[str], outputs: Mapping[str, Sequence[int]]
                          ) -> dict[str, str]:
        """After a step is collected: of its `sampled` samples, those still running (`outputs`:
        their output token ids) whose constraint cannot go on, with the reason: a failure the
        step's `bitmask` found, else the grammar refusing a token or a limit tripped consuming
        it (`advance`). The sampled samples' bitmask failures are consumed."""
        errors = {}
        for r in sampled:
            error = self._failed.pop(r, None)
            if r in outputs:
                error = error or self.advance(r, outputs[r])
                if error is not None:
                    errors[r] = error
        return errors

    def close(self) -> None:
        """Stop the grammar worker process (it also ends with this process)."""
        if self._worker is not None:
            self._worker.close()

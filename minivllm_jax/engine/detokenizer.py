"""Incremental detokenization of one request's output tokens, and stop strings.

Invariants:
- `output_text` always equals tokenizer.decode(token_ids, skip_special_tokens=True,
  clean_up_tokenization_spaces=False) of the tokens seen so far, less the text of trailing tokens
  that still ends in an incomplete character (held until it completes), and truncated at the
  first stop string once one is matched.
- The work per token does not grow with the output length: a fast (Rust-backed) tokenizer steps
  a `tokenizers` DecodeStream (~1 us per token); any other tokenizer, or a stream that fails
  mid-way, decodes each token with a short window of preceding tokens (prefix/read offsets, which
  the stream path keeps current so that the fallback resumes where the stream stopped).
- `take_delta()` hands out each character once; while the request runs it holds back the last
  (longest stop string - 1) characters, which could still become the start of a stop string.
- With `accepts` (a constrained output's test), a stop string ends the output only where the text
  cut there satisfies the constraint; a match elsewhere is passed over.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # an old tokenizers: the windowed path only
    _RustTokenizer = DecodeStream = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False,
                 accepts: Callable[[str], bool] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.accepts = accepts
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        fast = _RustTokenizer is not None and isinstance(backend, _RustTokenizer)
        self._backend = backend if fast else None
        self._stream = DecodeStream(skip_special_tokens=True) if fast else None

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # a checkpoint without tokenizer files: token ids only
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears in the text (then the text
        is truncated there and later updates are ignored), else None."""
        if self.stop_reason is not None:
            return None
        for token in new_token_ids:
            self.token_ids.append(int(token))
            new_text = self._next_text()
            if not new_text:
                continue  # an incomplete UTF-8 sequence (or nothing visible) so far
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            self.output_text += new_text
            if self.stop and self._check_stop(len(new_text)):
                return self.stop_reason
        return None

    def _next_text(self) -> str | None:
        """Text the last token completes (None or "" while a character is still partial)."""
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, self.token_ids[-1])
            except Exception:  # e.g. a byte sequence the stream cannot resume: use the window
                self._stream = None
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return full[len(prefix):]

    def _check_stop(self, num_new_chars: int) -> bool:
        matches = []
        for s in self.stop:
            start = max(0, len(self.output_text) - num_new_chars - len(s) + 1)
            idx = self.output_text.find(s, start)
            while idx >= 0:
                matches.append((idx, s))
                if self.accepts is None:
                    break
                idx = self.output_text.find(s, idx + 1)
        for idx, s in sorted(matches, key=lambda m: m[0]):  # stable: the list order breaks ties
            text = self.output_text[:idx + len(s) if self.include_stop else idx]
            if self.accepts is None or self.accepts(text):
                self.output_text, self.stop_reason = text, s
                return True
        return False

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet (all of it once finished)."""
        end = len(self.output_text)
        if not finished and self.stop and not self.include_stop:
            end -= max(len(s) for s in self.stop) - 1
        if end <= self._emitted:
            return ""
        delta = self.output_text[self._emitted:end]
        self._emitted = end
        return delta

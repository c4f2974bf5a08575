"""Incremental detokenization vs the tokenizer's full decode, and stop-string truncation, with the
SmolLM2 tokenizer (byte-level BPE: multi-byte characters span several tokens)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from minivllm_jax.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Paris is the capital of France. Its population is about 2.1 million.",
    "Emoji 🎉🚀 and accents: café, naïve, Zürich; CJK: 東京は日本の首都です。",
    "def f(x):\n    return x ** 2  # squares\n\n\tTabs\tand  double  spaces",
]


def _decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    for i, t in enumerate(ids):
        assert detok.update([t]) is None
        pieces.append(detok.take_delta(finished=i == len(ids) - 1))
        # never a replacement character from a half-decoded multi-byte sequence
        assert "\ufffd" not in detok.output_text
        assert _decode(tokenizer, ids[:i + 1]).startswith(detok.output_text)
    assert detok.output_text == _decode(tokenizer, ids) == "".join(pieces)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(tokenizer: Any, include: bool) -> None:
    text = TEXTS[0]
    ids = tokenizer.encode(text)
    stops = ["capital of Fr", "million"]  # the first match wins, even mid-token
    detok = IncrementalDetokenizer(tokenizer, stops, include_stop_str_in_output=include)
    streamed, matched, used = [], None, 0
    for t in ids:
        used += 1
        matched = detok.update([t])
        streamed.append(detok.take_delta(finished=matched is not None))
        if matched:
            break
    idx = text.index("capital of Fr")
    want = text[:idx + len("capital of Fr")] if include else text[:idx]
    assert matched == "capital of Fr" and detok.stop_reason == matched
    assert detok.output_text == want == "".join(streamed)
    assert used < len(ids)
    assert detok.update(ids[used:]) is None and detok.output_text == want  # ignored after a stop


def test_streaming_holds_back_possible_stop_prefix(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(tokenizer, ["XYZW"])
    for t in ids:
        detok.update([t])
    partial = detok.take_delta(finished=False)
    assert partial == detok.output_text[:-3]  # the last 3 chars could start "XYZW"
    assert partial + detok.take_delta(finished=True) == "one two three four"


class _SlowView:
    """The tokenizer without its Rust backend: IncrementalDetokenizer takes the windowed path."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def decode(self, *a: Any, **kw: Any) -> str:
        return self._tok.decode(*a, **kw)


class _FailingStream:
    """A DecodeStream stand-in that works for `ok` tokens, then raises (as a real stream can on
    a byte sequence it cannot resume)."""

    def __init__(self, ok: int) -> None:
        from tokenizers.decoders import DecodeStream

        self.inner, self.left = DecodeStream(skip_special_tokens=True), ok

    def step(self, backend: Any, token: int) -> str | None:
        if self.left == 0:
            raise RuntimeError("cannot resume")
        self.left -= 1
        return self.inner.step(backend, token)


def _check_against_full_decode(tok: Any, ids: list[int], detok: IncrementalDetokenizer) -> None:
    """After every token: output_text is the full decode, less at most the text of the trailing
    tokens when that text ends in an incomplete character."""
    for i, t in enumerate(ids):
        detok.update([t])
        want = _decode(tok, ids[:i + 1])
        assert want.startswith(detok.output_text), (ids[:i + 1], detok.output_text, want)
        held = want[len(detok.output_text):]
        assert not held or held.endswith("\ufffd"), (ids[:i + 1], detok.output_text, want)


def _random_id_lists(vocab: int, special: list[int], n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        ids = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 24)))]
        if i % 3 == 0:  # special tokens mid-text are skipped, like decode(skip_special_tokens=True)
            ids[len(ids) // 2:len(ids) // 2] = special
        out.append(ids)
    return out


@pytest.mark.parametrize("path", ["stream", "window", "stream_fails"])
def test_random_ids_match_full_decode(tokenizer: Any, path: str) -> None:
    """Random ids split multi-byte characters anywhere; all three paths keep the invariant."""
    cases = [tokenizer.encode(t) for t in TEXTS] + _random_id_lists(
        len(tokenizer), list(tokenizer.all_special_ids), 60)
    for ids in cases:
        detok = IncrementalDetokenizer(_SlowView(tokenizer) if path == "window" else tokenizer)
        assert (detok._stream is None) == (path == "window")
        if path == "stream_fails":
            detok._stream = _FailingStream(ok=len(ids) // 2)
        _check_against_full_decode(tokenizer, ids, detok)


def test_sentencepiece_style_tokenizer_matches_full_decode() -> None:
    """A Metaspace-style BPE with byte fallback (Llama-2 / Mistral family), trained here: the
    leading-space and byte-fallback rules of its decoder hold token by token."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = TEXTS * 10
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    cases = [tok.encode(t) for t in TEXTS] + _random_id_lists(len(tok), [1, 2], 60)
    for ids in cases:
        for view in (tok, _SlowView(tok)):
            _check_against_full_decode(tok, ids, IncrementalDetokenizer(view))
    assert IncrementalDetokenizer(tok).update(tok.encode(TEXTS[0])) is None

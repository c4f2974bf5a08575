"""Incremental detokenization vs the tokenizer's full decode, and stop-string truncation, with the
SmolLM2 tokenizer (byte-level BPE: multi-byte characters span several tokens)."""
from __future__ import annotations

from typing import Any

import pytest

from minivllm_jax.detokenizer import IncrementalDetokenizer

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

"""Prompts: the one place where a prompt is checked.

- `prompt_token_ids(prompt, tokenizer)`: a prompt as a caller gives it (a non-empty string, which
  the tokenizer encodes; token ids; for `LLM`, a dict with `prompt_token_ids` or `prompt`) ->
  its text and token ids. `LLM` and the server's request parser call it.
- `check_token_ids(ids, vocab_size, max_model_len)`: the rules of a tokenized prompt (a non-empty
  sequence of ints in [0, vocab_size), shorter than max_model_len so that one token can be
  generated). `prompt_token_ids` applies them to ids it is given (the vocabulary and context
  length unknown there); `LLMEngine.check_request` applies them with its own.

Every refusal is an `InvalidFieldError` (an `InvalidFieldTypeError` for a wrong type) naming
`prompt` or `prompt_token_ids`. Imports nothing of the engine (no jax).
"""
from __future__ import annotations

import numbers
from typing import Any

from scheduler.errors import InvalidFieldError, InvalidFieldTypeError
from scheduler.scheduler import prompt_length_error


def is_token_ids(value: object) -> bool:
    """A non-empty list or tuple of ints (bools excluded): a prompt given as token ids."""
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value))


def check_token_ids(ids: object, vocab_size: int | None = None,
                    max_model_len: int | None = None) -> list[int]:
    """`ids` as a list of ints, once they are a non-empty sequence of ints (bools excluded) in
    [0, vocab_size) (non-negative when `vocab_size` is None), fewer than `max_model_len` (when
    given). Raises InvalidFieldError naming `prompt_token_ids`."""
    field = "prompt_token_ids"
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
        raise InvalidFieldTypeError(field, f"prompt_token_ids must be a sequence of ints, got "
                                           f"{type(ids).__name__}")
    ids = list(ids)  # type: ignore[call-overload]
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
               and (vocab_size is None or t < vocab_size) for t in ids):
        bound = "non-negative ints" if vocab_size is None else f"ints in [0, {vocab_size})"
        raise InvalidFieldError(field, f"prompt_token_ids must be {bound}")
    if not ids:
        raise InvalidFieldError(field, "prompt_token_ids is empty")
    too_long = None if max_model_len is None else prompt_length_error(len(ids), max_model_len)
    if too_long:
        raise InvalidFieldError(field, too_long)
    return [int(t) for t in ids]


def prompt_token_ids(prompt: object, tokenizer: Any, *, dicts: bool = False
                     ) -> tuple[str | None, list[int]]:
    """A prompt's text (None when it came as token ids only) and token ids: a non-empty string,
    encoded by `tokenizer` (None: the model has none, so strings are refused), or token ids
    (`check_token_ids`); with `dicts`, also `{"prompt_token_ids": ids}` (an optional `prompt`
    text kept with them) or `{"prompt": text}`."""
    if dicts and isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            return text if isinstance(text, str) else None, check_token_ids(prompt["prompt_token_ids"])
        if not isinstance(prompt.get("prompt"), str):
            raise InvalidFieldError("prompt", "a prompt dict needs 'prompt_token_ids' (or 'prompt')")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidFieldError("prompt", "prompt must not be an empty string")
        if tokenizer is None:
            raise InvalidFieldError("prompt", "this model has no tokenizer: pass prompts as token ids")
        return prompt, [int(t) for t in tokenizer.encode(prompt)]
    if not is_token_ids(prompt):
        forms = ("a non-empty string, a non-empty list of token ids, or a dict with "
                 "'prompt_token_ids'" if dicts else "a non-empty string or a non-empty list of token ids")
        raise InvalidFieldTypeError("prompt", f"each prompt must be {forms}, got {prompt!r:.60}")
    return None, check_token_ids(prompt)

"""Request bodies: bytes -> JSON -> `GenerationRequest`, run on the app's parser thread.

Invariants:
- `parse_body` returns what the protocol parser returns, or raises `APIError` (400 / 404); of
  Python's exception texts only the JSON decoder's syntax error reaches a message. A body whose
  JSON cannot be held as Python values (a lone UTF-16 surrogate in a string, an integer longer
  than `int()` converts, nesting deeper than the decoder recurses) is a 400 naming the
  top-level field it is under (None when it is not under one).
- The happy path costs one `json.loads` and one scan of the bytes for surrogate escapes; the
  slower field-finding passes run only when that scan or the decoder says something is wrong.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Iterator

from minivllm_jax.serving.protocol import GenerationRequest, ParseContext, bad_request

Parse = Callable[[object, ParseContext], GenerationRequest]

# what may decode to a lone surrogate: a \uD800-\uDFFF escape, or the (CESU-style) UTF-8 bytes of
# one, which json.loads decodes with "surrogatepass"; a valid escaped pair matches too (harmless)
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# a JSON string, or one structural character: enough to track the depth and the top-level key
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]', re.S)
_GIVE_UP_DEPTH = 10_000


class TooManyDigits:
    """What an integer longer than `int()` converts decodes to (a marker, never a number)."""


def _int_or_marker(digits: str) -> int | TooManyDigits:
    try:
        return int(digits)
    except ValueError:
        return TooManyDigits()


def _leaves(value: object) -> Iterator[object]:
    """Every string (dict keys included) and marker inside `value`, depth first."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, (str, TooManyDigits)):
            yield v


def _check_values(body: object) -> None:
    """A 400 naming the top-level field of the first lone surrogate or over-long integer."""
    fields = body.items() if isinstance(body, dict) else [(None, body)]
    for name, value in fields:
        if name is not None and _SURROGATE.search(name):
            raise bad_request("a field name holds a lone UTF-16 surrogate, which is not text")
        for leaf in _leaves(value):
            if isinstance(leaf, TooManyDigits):
                raise bad_request(f"{name or 'the body'} holds an integer out of range", name)
            if _SURROGATE.search(leaf):  # type: ignore[arg-type]
                raise bad_request(f"{name or 'the body'} holds a lone UTF-16 surrogate "
                                  "(an unpaired \\ud800-\\udfff escape), which is not text", name)


def deepest_field(raw: bytes) -> str | None:
    """The top-level key whose value nests deepest in `raw` (scanned until the depth passes
    `_GIVE_UP_DEPTH`); None when that is not under a key."""
    depth, key, best, best_key, last = 0, None, 0, None, b""
    for m in _TOKEN.finditer(raw):
        tok = m.group()
        if tok in (b"[", b"{"):
            depth += 1
            if depth > best:
                best, best_key = depth, key
                if depth > _GIVE_UP_DEPTH:
                    break
        elif tok in (b"]", b"}"):
            depth -= 1
        elif tok == b":" and depth == 1 and last.startswith(b'"'):
            try:
                key = json.loads(last)
            except ValueError:
                key = None
        last = tok
    return best_key if isinstance(best_key, str) and not _SURROGATE.search(best_key) else None


def decode_json(raw: bytes) -> object:
    """The JSON value of `raw`, its strings valid text and its integers numbers; else a 400."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}", None, "invalid_json") from None
    except ValueError:  # an integer past sys.get_int_max_str_digits(): find its field
        body = json.loads(raw, parse_int=_int_or_marker)
        _check_values(body)
    if _MAYBE_SURROGATE.search(raw):
        _check_values(body)
    return body


def parse_body(raw: bytes, parse: Parse, ctx: ParseContext) -> GenerationRequest:
    """`parse(decode_json(raw), ctx)`; nesting too deep for the decoder or the parser is a 400
    naming its field. Call it from one thread only (the parser tokenizes)."""
    try:
        return parse(decode_json(raw), ctx)
    except RecursionError:
        field = deepest_field(raw)
        raise bad_request(f"{field or 'the request body'} nests too deep", field) from None


"""`StructuredOutputsParams`: the one constraint a request's output must satisfy (vLLM's names).

Invariants:
- Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set; `kind` names it and
  `spec` is its value in a canonical hashable form, so `(kind, spec, disable_any_whitespace)` is
  the key a compiled grammar is cached under.
- Only what pure Python can decide is checked here (no grammar library): the value's shape; its
  size (`MAX_SCHEMA_BYTES` of canonical JSON, `MAX_PATTERN_BYTES`, `MAX_GRAMMAR_BYTES`,
  `MAX_CHOICES` entries of `MAX_CHOICE_BYTES` in all); and a schema's numbers, `$ref`s and
  satisfiability (`json_schema.check_schema`).
- Whether a schema, pattern or grammar compiles is the engine's check when the request is added;
  both raise an `InvalidFieldError` whose field is ``structured_outputs``, its message starting
  with the field's path (``structured_outputs.json ...``).
"""
from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from scheduler.errors import InvalidFieldError, InvalidFieldTypeError
from scheduler.json_schema import FIELD, check_schema

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Limits on a constraint's size, in bytes of UTF-8 (a schema's: of its canonical JSON, `spec`).
# The grammar library's work and memory grow with them, and no request needs more.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_PATTERN_BYTES = 16 * 1024      # `regex`
MAX_GRAMMAR_BYTES = 64 * 1024      # `grammar`
MAX_CHOICES = 16384                # `choice` entries ...
MAX_CHOICE_BYTES = 1024 * 1024     # ... and their bytes, all together
_INT64 = (-2 ** 63, 2 ** 63 - 1)   # the integers a JSON number carries everywhere


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the output. `json`: a JSON Schema (a dict, or a string of one); `regex`:
    a pattern the whole output matches; `choice`: the output is one of these strings;
    `grammar`: a Lark / EBNF grammar (llguidance's syntax, GBNF accepted); `json_object`: any
    JSON object. `disable_any_whitespace` (JSON only) makes the output compact, no whitespace
    outside strings: True by default here (vLLM's default is False), since a small model left
    free to add whitespace can loop on newlines until `max_tokens`."""

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidFieldError(FIELD, f"{FIELD} must set exactly one of {', '.join(KINDS)}; "
                                           f"got {', '.join(given) if given else 'none'}")
        if type(self.disable_any_whitespace) is not bool:
            raise InvalidFieldTypeError(FIELD, f"{FIELD}.disable_any_whitespace must be a bool, "
                                               f"got {self.disable_any_whitespace!r:.40}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidFieldTypeError(FIELD, f"{FIELD}.{name} must be a non-empty string, "
                                                   f"got {value!r:.60}")
            if value is not None:
                limit = MAX_PATTERN_BYTES if name == "regex" else MAX_GRAMMAR_BYTES
                _check_size(f"{FIELD}.{name} is", _utf8_len(value), "bytes", limit)
        if self.choice is not None:
            choice = self.choice
            if (isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise InvalidFieldTypeError(FIELD, f"{FIELD}.choice must be a non-empty list of "
                                                   f"non-empty strings, got {choice!r:.60}")
            _check_size(f"{FIELD}.choice has", len(choice), "entries", MAX_CHOICES)
            _check_size(f"{FIELD}.choice is", sum(map(_utf8_len, choice)),
                        "bytes of UTF-8 in total", MAX_CHOICE_BYTES)
            object.__setattr__(self, "choice", tuple(choice))
        if self.json_object is not None and self.json_object is not True:
            raise InvalidFieldTypeError(FIELD, f"{FIELD}.json_object must be True when given, "
                                               f"got {self.json_object!r:.40}")

    @property
    def kind(self) -> str:
        """The constraint set: one of `KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str | tuple[str, ...] | bool:
        """The constraint's value, hashable: a schema as canonical JSON text."""
        value = getattr(self, self.kind)
        return jsonlib.dumps(value, sort_keys=True) if self.kind == "json" else value

    @property
    def key(self) -> tuple[str, str | tuple[str, ...] | bool, bool]:
        """What a compiled grammar is cached under."""
        return self.kind, self.spec, self.disable_any_whitespace

    @classmethod
    def from_dict(cls, value: object, field: str = FIELD) -> "StructuredOutputsParams":
        """vLLM's request field: a dict of the keys above (unknown keys refused)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise InvalidFieldTypeError(field, f"{field} must be an object with one of "
                                               f"{', '.join(KINDS)}, got {type(value).__name__}")
        known = {*KINDS, "disable_any_whitespace"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidFieldError(field, f"{field} has unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**value)
        except InvalidFieldError as e:  # name the caller's field
            raise type(e)(field, str(e).replace(FIELD, field, 1)) from None


def _schema(value: object) -> dict[str, Any]:
    """A JSON Schema as a dict: a dict (JSON-serialisable), or a string holding one. Refused when
    its canonical JSON is over `MAX_SCHEMA_BYTES`, when it holds a number JSON cannot carry, or
    when it admits no finite value."""
    try:
        if isinstance(value, str):
            try:
                value = jsonlib.loads(value)
            except ValueError as e:
                raise InvalidFieldError(FIELD, f"{FIELD}.json is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise InvalidFieldTypeError(FIELD, f"{FIELD}.json must be a JSON Schema object (a dict "
                                               f"or its JSON text), got {type(value).__name__}")
        try:
            text = jsonlib.dumps(value, sort_keys=True)  # `spec`: ASCII, so len() counts bytes
        except (TypeError, ValueError) as e:
            raise InvalidFieldError(FIELD, f"{FIELD}.json is not JSON-serialisable: {e}") from None
        _check_size(f"{FIELD}.json is", len(text), "bytes of JSON", MAX_SCHEMA_BYTES)
        doc = jsonlib.loads(text)  # plain dicts and lists, string keys: what the checks read
    except RecursionError:
        raise InvalidFieldError(FIELD, f"{FIELD}.json is nested too deeply") from None
    check_schema(doc)
    return dict(value)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _check_size(what: str, size: int, unit: str, limit: int) -> None:
    """Refuse `size` over `limit`: "<what> <size> <unit>; the limit is <limit>"."""
    if size > limit:
        raise InvalidFieldError(FIELD, f"{what} {size:,} {unit}; the limit is {limit:,}")

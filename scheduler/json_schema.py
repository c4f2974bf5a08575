"""What pure Python can tell of a JSON Schema before any grammar library sees it
(`check_schema`): numbers JSON cannot carry, local `$ref`s that point nowhere, and schemas that
admit no finite value.

Invariants:
- Numbers: integers must fit in 64 bits and floats be finite, at any depth (lists included).
- Satisfiability is a least fixpoint over the schema's subschemas (`_Schemas`), as for a
  context-free grammar's productive non-terminals, so a required property that refers back to
  its own schema is refused instead of generating until `max_tokens`. It is conservative: what
  it does not understand counts as satisfiable, and a schema without `type` may be any type
  (JSON Schema's rule, llguidance's too). Its work is linear in the schema and never recursive.
- Every refusal is an `InvalidFieldError` of ``structured_outputs`` whose message starts with
  ``structured_outputs.json``.
"""
from __future__ import annotations

import itertools
import json as jsonlib
import math
import re
from collections import deque
from typing import Any
from urllib.parse import unquote

from scheduler.errors import InvalidFieldError

FIELD = "structured_outputs"
_INT64 = (-2 ** 63, 2 ** 63 - 1)   # the integers a JSON number carries everywhere


def check_schema(doc: dict[str, Any]) -> None:
    """Refuse a schema (plain dicts and lists, string keys) that holds a number JSON cannot
    carry, a local `$ref` it uses that points nowhere, or that admits no finite value."""
    _check_numbers(doc)
    schemas = _Schemas(doc)
    satisfiable = schemas.satisfiable()
    if () not in satisfiable:
        raise InvalidFieldError(FIELD, f"{FIELD}.json admits no finite value: "
                                       f"{schemas.explain(satisfiable)}")


def _check_numbers(doc: object) -> None:
    """Refuse a float that is not finite or an integer outside 64 bits anywhere in `doc` (the
    grammar library reads JSON numbers as doubles and 64-bit integers). Walked with a stack, in
    document order; a value's place is kept as a (parent's place, key) chain, spelled out only
    for the error."""
    stack: list[tuple[object, tuple | None]] = [(doc, None)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, (where, k)) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, (where, i)) for i, v in reversed(list(enumerate(value))))
        elif (isinstance(value, float) and not math.isfinite(value)) or (
                _is_int(value) and not _INT64[0] <= value <= _INT64[1]):
            text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise InvalidFieldError(FIELD, f"{FIELD}.json holds a number JSON cannot carry at "
                                           f"{_json_path(where)}: {text} (integers must fit in 64 "
                                           f"bits, floats be finite)")


def _json_path(where: tuple | None) -> str:
    """A (parent, key) chain as a JSONPath: $.properties.a.enum[0], $['a b']."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    return "$" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" if _NAME.fullmatch(k)
                         else f"[{k!r}]" for k in reversed(keys))


_NAME = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_INDEX = re.compile(r"0|[1-9][0-9]*")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list(schema: dict, key: str) -> list:
    value = schema.get(key)
    return value if isinstance(value, list) else []


def _has_id(schema: object) -> bool:
    return isinstance(schema, dict) and isinstance(schema.get("$id"), str)


def _pointer(loc: tuple) -> str:
    """A location (keys and indices from the root) as a JSON pointer fragment: #/$defs/a."""
    return "#" + "".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in loc)


class _Schemas:
    """Whether a JSON Schema admits a finite value: its subschemas, each keyed by its location
    (the tuple of keys and indices from the root), with the conditions that must all hold for
    it to be satisfiable, as (kind, payload, why):
      ("false", None, why)        never holds (`false`, `enum: []`, ...)
      ("ref", loc, None)          the schema `$ref` points to (at loc) is satisfiable
      ("child", loc, why)         the subschema at loc is (a required property, an allOf, ...)
      ("any", alternatives, why)  all the conditions of one alternative hold (anyOf, type lists)
      ("atleast", (n, locs), why) at least n of the schemas at locs are (minProperties)
    Satisfiable is then a least fixpoint, as for a context-free grammar's productive symbols:
    nothing is known satisfiable at first, and a schema becomes so once its conditions hold.
    Only what is sure is a condition: other keywords, remote refs and `$ref`s below a nested
    `$id` (which moves their base) are taken as satisfiable. Nothing here recurses on the
    schema's depth: a chain of refs or properties may be thousands deep."""

    def __init__(self, doc: dict) -> None:
        self.doc = doc
        self.conditions: dict[tuple, list[tuple]] = {}
        self._resolved: dict[str, tuple] = {}
        self._todo: deque[tuple[tuple, object, bool]] = deque([((), doc, False)])
        while self._todo:  # breadth-first from the root: each subschema the analysis reads
            loc, schema, foreign = self._todo.popleft()
            if loc not in self.conditions:
                self.conditions[loc] = self._node(loc, schema, foreign)

    def _node(self, loc: tuple, schema: object, foreign: bool) -> list[tuple]:
        """The conditions of the schema at `loc`; queues the subschemas they name."""
        if not isinstance(schema, dict):
            return [("false", None, "is false")] if schema is False else []
        self._walk(loc, schema, foreign)
        out: list[tuple] = []
        ref = schema.get("$ref")
        if isinstance(ref, str) and not foreign:
            target = self._resolve(ref)
            if target is not None:
                self._todo.append(target)
                out.append(("ref", target[0], None))
        if schema.get("enum") == []:
            out.append(("false", None, "has an empty enum"))
        out += [("child", loc + ("allOf", i), f"requires allOf[{i}]")
                for i in range(len(_list(schema, "allOf")))]
        for key in ("anyOf", "oneOf"):
            if key in schema and isinstance(schema[key], list):
                alternatives = [[("child", loc + (key, i), f"requires {key}[{i}]")]
                                for i in range(len(schema[key]))]
                out += _either(alternatives, f"has no satisfiable alternative in {key}",
                               f"has an empty {key}")
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if isinstance(types, list) and all(isinstance(t, str) for t in types):
            alternatives = [self._object(loc, schema) if t == "object" else
                            self._array(loc, schema) if t == "array" else [] for t in types]
            out += _either(alternatives, f"has no satisfiable type among {types}",
                           "has an empty type list")
        return out

    def _walk(self, loc: tuple, schema: dict, foreign: bool) -> None:
        """Queue the subschemas of `schema` the analysis reads (so their `$ref`s are checked)."""
        subs: list[tuple[tuple, object]] = []
        for key in ("properties", "patternProperties"):
            if isinstance(schema.get(key), dict):
                subs += [((key, name), sub) for name, sub in schema[key].items()]
        for key in ("additionalProperties", "items", "additionalItems"):
            if isinstance(schema.get(key), (dict, bool)):
                subs.append(((key,), schema[key]))
        for key in ("items", "prefixItems", "allOf", "anyOf", "oneOf"):
            subs += [((key, i), sub) for i, sub in enumerate(_list(schema, key))]
        self._todo.extend((loc + tokens, sub, foreign or _has_id(sub)) for tokens, sub in subs)

    def _object(self, loc: tuple, schema: dict) -> list[tuple]:
        """An object's conditions: each required property can be present; `minProperties` of
        them can, when `additionalProperties: false` closes the names."""
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = schema.get("additionalProperties", True)
        patterns = schema.get("patternProperties")
        open_names = isinstance(patterns, dict) and bool(patterns)  # not analysed: may match
        out: list[tuple] = []
        for name in dict.fromkeys(n for n in _list(schema, "required") if isinstance(n, str)):
            why = f"requires property {name!r}"
            if name in props:
                out.append(("child", loc + ("properties", name), why))
            elif open_names:
                continue
            elif extra is False:
                out.append(("false", None, f"{why}, which additionalProperties: false forbids"))
            elif isinstance(extra, dict):
                out.append(("child", loc + ("additionalProperties",),
                            f"{why}, which falls to additionalProperties"))
        least = schema.get("minProperties")
        if _is_int(least) and least > 0 and extra is False and not open_names:
            names = [loc + ("properties", name) for name in props]
            out.append(("atleast", (least, names), f"needs minProperties {least}, more than "
                                                   f"the properties it can hold"))
        return out

    def _array(self, loc: tuple, schema: dict) -> list[tuple]:
        """An array's conditions: its first `minItems` items can be present."""
        least = schema.get("minItems")
        if not (_is_int(least) and least > 0):
            return []
        if isinstance(schema.get("items"), list):  # before 2020-12: items as a tuple
            first, rest = "items", "additionalItems"
        else:
            first, rest = "prefixItems", "items"
        count = len(_list(schema, first))
        out = [("child", loc + (first, i), f"requires item {i} (minItems {least})")
               for i in range(min(least, count))]
        if least > count and isinstance(schema.get(rest), (dict, bool)):
            out.append(("child", loc + (rest,), f"requires item {count} (minItems {least})"))
        return out

    def _resolve(self, ref: str) -> tuple[tuple, object, bool] | None:
        """A local `$ref` (a JSON pointer into the root) as (location, schema, below a nested
        `$id`); None for one this does not follow (remote, relative, an `$anchor`). Refuses a
        pointer to nothing, or to what is no schema."""
        if ref in self._resolved:
            return self._resolved[ref]
        fragment = unquote(ref[1:]) if ref.startswith("#") else None
        if fragment is None or (fragment and not fragment.startswith("/")):
            return None
        value, loc, foreign = self.doc, [], False
        for token in fragment.split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(value, dict) and token in value:
                value = value[token]
                loc.append(token)
            elif isinstance(value, list) and _INDEX.fullmatch(token) and int(token) < len(value):
                value = value[int(token)]
                loc.append(int(token))
            else:
                raise InvalidFieldError(FIELD, f"{FIELD}.json: $ref {ref!r:.80} points nowhere "
                                               f"in the schema")
            foreign = foreign or _has_id(value)
        if not isinstance(value, (dict, bool)):
            raise InvalidFieldError(FIELD, f"{FIELD}.json: $ref {ref!r:.80} points to "
                                           f"{jsonlib.dumps(value)[:40]}, not a schema")
        self._resolved[ref] = (tuple(loc), value, foreign)
        return self._resolved[ref]

    def satisfiable(self) -> set[tuple]:
        """The locations of the satisfiable schemas, found as a context-free grammar's productive
        symbols are (a count-down, linear in the conditions): each schema, each alternative of
        an "any" and each "atleast" is a gate counting the inputs it still needs; a gate whose
        count reaches 0 fires, counting down the gates it feeds. What fires has a finite
        derivation, so a cycle with no way out never fires: the least fixpoint."""
        needs: dict[object, int] = {}
        feeds: dict[object, list[object]] = {}
        fired: deque[object] = deque()
        gates = itertools.count()  # ids of the gates that are no schema (locations are tuples)

        def gate(key: object, inputs: list[object], count: int) -> None:
            needs[key] = count
            for x in inputs:
                feeds.setdefault(x, []).append(key)
            if count == 0:
                fired.append(key)

        def conjunction(key: object, conditions: list[tuple]) -> None:
            inputs, blocked = [], 0
            for kind, payload, _ in conditions:
                if kind in ("ref", "child"):
                    inputs.append(payload)
                elif kind == "any":
                    inputs.append(either := next(gates))
                    alternatives = [next(gates) for _ in payload]
                    for alternative, alternative_conditions in zip(alternatives, payload):
                        conjunction(alternative, alternative_conditions)
                    gate(either, alternatives, 1)
                elif kind == "atleast":
                    inputs.append(least := next(gates))
                    gate(least, payload[1], payload[0])
                else:  # "false": an input that never fires
                    blocked += 1
            gate(key, inputs, len(inputs) + blocked)

        for loc, conditions in self.conditions.items():
            conjunction(loc, conditions)
        sat: set[tuple] = set()
        while fired:
            done = fired.popleft()
            if isinstance(done, tuple):
                sat.add(done)
            for key in feeds.get(done, ()):
                needs[key] -= 1
                if needs[key] == 0:
                    fired.append(key)
        return sat

    def explain(self, sat: set[tuple]) -> str:
        """Why the root is unsatisfiable: from it, the first failing condition of each schema in
        turn, until one fails by itself or the path comes back to a schema already on it."""
        def failing(loc: tuple) -> tuple:
            return next(c for c in self.conditions[loc] if not _holds(c, sat))

        loc, seen = (), {()}
        while (c := failing(loc))[0] == "ref" and c[1] not in seen:  # start where refs lead
            loc = c[1]
            seen.add(loc)
        words = [_pointer(loc)]
        while True:
            kind, target, why = failing(loc)
            if kind == "ref":
                words.append(f"refers back to {_pointer(target)}" if target in seen else
                             f"refers to {_pointer(target)}, which")
            elif kind == "child":
                words.append(f"{why}, whose schema is {_pointer(target)} again" if target in seen
                             else f"{why}, whose schema")
            else:
                words.append(why)
            if kind not in ("ref", "child") or target in seen:
                break
            loc = target
            seen.add(loc)
        return " ".join(words if len(words) <= 12 else words[:6] + ["..."] + words[-5:])


def _either(alternatives: list[list[tuple]], why: str, empty: str) -> list[tuple]:
    """The conditions of "one of these alternatives holds"."""
    if not alternatives:
        return [("false", None, empty)]
    if any(not a for a in alternatives):  # one alternative needs nothing
        return []
    return alternatives[0] if len(alternatives) == 1 else [("any", alternatives, why)]


def _holds(condition: tuple, sat: set[tuple]) -> bool:
    kind, payload, _ = condition
    if kind in ("ref", "child"):
        return payload in sat
    if kind == "any":
        return any(all(_holds(c, sat) for c in alternative) for alternative in payload)
    if kind == "atleast":
        return sum(loc in sat for loc in payload[1]) >= payload[0]
    return False

"""The pure-Python refusals of `StructuredOutputsParams`: sizes over the limits, numbers JSON
cannot carry, and JSON schemas that admit no finite value (checked against hand-written answers
and a brute-force search for instances), each an InvalidFieldError naming the field."""
from __future__ import annotations

import itertools
import json
import random
import time

import pytest

from scheduler import InvalidFieldError, StructuredOutputsParams, structured
from scheduler.structured import (MAX_CHOICE_BYTES, MAX_CHOICES, MAX_GRAMMAR_BYTES,
                                  MAX_PATTERN_BYTES, MAX_SCHEMA_BYTES)

S = StructuredOutputsParams


def refused(match: str | None = None, **kwargs) -> str:
    """The message of the InvalidFieldError that constructing S(**kwargs) raises."""
    with pytest.raises(InvalidFieldError) as e:
        S(**kwargs)
    assert e.value.field == "structured_outputs"
    message = str(e.value)
    assert message.startswith("structured_outputs")
    if match is not None:
        assert match in message, message
    return message


def test_limits_are_the_documented_values() -> None:
    assert (MAX_SCHEMA_BYTES, MAX_PATTERN_BYTES, MAX_GRAMMAR_BYTES, MAX_CHOICES,
            MAX_CHOICE_BYTES) == (65536, 16384, 65536, 16384, 1048576)


# ----------------------------------------------------------------------------- sizes

def _schema_of_size(n: int) -> dict:
    """A schema whose canonical JSON (json.dumps, sorted keys) is exactly n bytes."""
    empty = len(json.dumps({"description": ""}, sort_keys=True))
    schema = {"description": "x" * (n - empty)}
    assert len(json.dumps(schema, sort_keys=True).encode()) == n
    return schema


def test_schema_size_boundary() -> None:
    at_limit = S(json=_schema_of_size(65536))
    assert len(at_limit.spec) == 65536
    message = refused(json=_schema_of_size(65537))
    assert message == "structured_outputs.json is 65,537 bytes of JSON; the limit is 65,536"
    refused("318,127 bytes of JSON; the limit is 65,536", json=_schema_of_size(318127))


def test_schema_size_counts_canonical_json_not_the_text_given() -> None:
    schema = _schema_of_size(65536)
    text = json.dumps(schema, indent=40)  # whitespace the canonical form drops
    assert len(text) > 65536
    assert S(json=text).spec == S(json=schema).spec
    # non-ASCII counts as canonical JSON writes it: a \u escape, 6 bytes for "é"
    widened = {"description": "é" + schema["description"][1:]}
    refused("65,541 bytes of JSON; the limit is 65,536", json=widened)


@pytest.mark.parametrize("name, limit", [("regex", 16384), ("grammar", 65536)])
def test_pattern_and_grammar_size_boundary(name: str, limit: int) -> None:
    S(**{name: "a" * limit})
    assert refused(**{name: "a" * (limit + 1)}) == \
        f"structured_outputs.{name} is {limit + 1:,} bytes; the limit is {limit:,}"
    S(**{name: "é" * (limit // 2)})  # two bytes of UTF-8 each: exactly the limit
    refused(f"is {limit + 2:,} bytes; the limit is {limit:,}", **{name: "é" * (limit // 2 + 1)})


def test_choice_count_boundary() -> None:
    assert len(S(choice=[str(i) for i in range(16384)]).choice) == 16384
    assert refused(choice=[str(i) for i in range(16385)]) == \
        "structured_outputs.choice has 16,385 entries; the limit is 16,384"


def test_choice_bytes_boundary() -> None:
    big = "x" * (1024 * 1024 - 3)
    S(choice=[big, "a", "bc"])  # 1 MiB exactly
    S(choice=[big[:-1], "a", "€"])  # "€" is 3 bytes of UTF-8: 1 MiB exactly
    assert refused(choice=[big, "a", "bcd"]) == \
        "structured_outputs.choice is 1,048,577 bytes of UTF-8 in total; the limit is 1,048,576"
    refused("1,048,577 bytes of UTF-8", choice=[big, "a", "€"])


def test_existing_shape_checks_still_come_first() -> None:
    refused("must be a non-empty string", regex="")
    refused("must be a non-empty list of non-empty strings", choice=["a", ""])
    refused("must set exactly one of", regex="a", grammar="b")
    refused("is not valid JSON", json="{not json")
    refused("must be a JSON Schema object", json="false")
    refused("must set exactly one of", json=False)


# ----------------------------------------------------------------------------- numbers

@pytest.mark.parametrize("schema, path, shown", [
    ({"enum": [2 ** 100]}, "$.enum[0]", "1267650600228229401496703205376"),
    ({"type": "integer", "maximum": float("inf")}, "$.maximum", "inf"),
    ({"type": "number", "minimum": float("-inf")}, "$.minimum", "-inf"),
    ({"const": float("nan")}, "$.const", "nan"),
    ({"properties": {"a": {"default": 2 ** 63}}}, "$.properties.a.default", str(2 ** 63)),
    ({"properties": {"a b": {"examples": [1, 2, -2 ** 63 - 1]}}},
     "$.properties['a b'].examples[2]", str(-2 ** 63 - 1)),
    ({"allOf": [{"properties": {"x": {"enum": [True, [0, [1.5, float("inf")]]]}}}]},
     "$.allOf[0].properties.x.enum[1][1][1]", "inf"),
    ({"$defs": {"n": {"multipleOf": 1e308, "x-extra": {"deep": [[[-(2 ** 64)]]]}}}},
     "$.$defs.n['x-extra'].deep[0][0][0]", str(-(2 ** 64))),
])
def test_numbers_json_cannot_carry_are_refused_with_their_path(schema: dict, path: str,
                                                               shown: str) -> None:
    assert refused(json=schema) == (f"structured_outputs.json holds a number JSON cannot carry "
                                    f"at {path}: {shown} (integers must fit in 64 bits, floats "
                                    f"be finite)")


def test_numbers_in_json_text() -> None:
    refused("at $.maximum: inf", json='{"type": "number", "maximum": 1e999}')
    refused("at $.enum[1]: -inf", json='{"enum": [1, -1e999]}')
    refused("at $.const: 9223372036854775808", json='{"const": 9223372036854775808}')
    S(json='{"const": 9223372036854775807, "default": 1e308}')


def test_numbers_that_fit_and_booleans_are_accepted() -> None:
    S(json={"enum": [2 ** 63 - 1, -2 ** 63, 0, -1, 1.5, -1e308, 5e-324, True, False, None]})
    S(json={"type": "boolean", "const": True, "default": False,
            "properties": {"a": {"examples": [[True, False], {"x": True}]}}})
    refused("at $.enum[0]: 9223372036854775808", json={"enum": [2 ** 63 - 1 + 1]})
    refused("at $.enum[0]: -9223372036854775809", json={"enum": [-2 ** 63 - 1]})


def test_a_huge_integer_is_shown_shortened() -> None:
    message = refused(json={"const": 10 ** 200})
    assert "at $.const: 1000000000" in message and "..." in message and len(message) < 200


# ----------------------------------------------------------------------------- satisfiability

SELF = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                        "required": ["x"]}}, "$ref": "#/$defs/a"}
CYCLE = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                         "required": ["b"]},
                   "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                         "required": ["a"]}},
         "$ref": "#/$defs/a"}


def _optional(schema: dict, *defs: str) -> dict:
    schema = json.loads(json.dumps(schema))
    for name in defs:
        schema["$defs"][name]["required"] = []
    return schema


UNSATISFIABLE = {
    "self-reference": SELF,
    "two-schema cycle": CYCLE,
    "empty enum": {"enum": []},
    "false via $ref": {"$defs": {"f": False}, "$ref": "#/$defs/f"},
    "required false": {"type": "object", "properties": {"x": False}, "required": ["x"]},
    "allOf with one unsatisfiable": {"allOf": [{"type": "integer"}, {"enum": []}]},
    "array needing an unsatisfiable item": {"type": "array", "items": {"enum": []},
                                            "minItems": 1},
    "prefixItems needing an unsatisfiable item": {"type": "array", "minItems": 2,
                                                  "prefixItems": [{"type": "integer"}, False]},
    "anyOf all unsatisfiable": {"anyOf": [False, {"enum": []}, SELF["$defs"]["a"]],
                                "$defs": SELF["$defs"]},
    "oneOf empty": {"oneOf": []},
    "type list all unsatisfiable": {"type": ["object", "array"], "required": ["x"],
                                    "properties": {"x": False}, "items": False, "minItems": 1},
    "required name additionalProperties forbids": {"type": "object", "required": ["q"],
                                                   "additionalProperties": False},
    "required name under unsatisfiable additionalProperties": {
        "type": "object", "required": ["q"], "additionalProperties": {"enum": []}},
    "minProperties over the names allowed": {
        "type": "object", "properties": {"a": {}, "b": False}, "additionalProperties": False,
        "minProperties": 2},
    "$ref to itself": {"$ref": "#"},
    "$ref beside keywords that fail": {"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i",
                                       "enum": []},
    "$ref beside keywords that hold, to a failing target": {
        "$defs": {"f": {"enum": []}}, "$ref": "#/$defs/f", "type": "integer"},
    "cycle through an array with minItems": {
        "type": "object", "required": ["kids"],
        "properties": {"kids": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}}},
    "cycle through allOf and a pointer with escapes": {
        "$defs": {"a/b": {"allOf": [{"$ref": "#/$defs/c~0d"}]},
                  "c~d": {"type": "object", "properties": {"p": {"$ref": "#/$defs/a~1b"}},
                          "required": ["p"]}},
        "$ref": "#/$defs/a~1b"},
    "cycle through definitions and a nested pointer": {
        "definitions": {"a": {"type": "object", "required": ["n"],
                              "properties": {"n": {"$ref": "#/definitions/a/properties/n/x",
                                                   "x": {"$ref": "#/definitions/a"}},
                                             "m": {}}}},
        "$ref": "#/definitions/a"},
}

SATISFIABLE = {
    "self-reference, optional": _optional(SELF, "a"),
    "cycle, one side optional": _optional(CYCLE, "b"),
    "recursive tree": {"type": "object", "required": ["children"],
                       "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}},
    "anyOf with one unsatisfiable branch": {"anyOf": [{"enum": []}, {"type": "string"}]},
    "cycle with an anyOf way out": {
        "type": "object", "required": ["next"],
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
    "array minItems 0 of an unsatisfiable item": {"type": "array", "items": False},
    "array minItems 1, unsatisfiable item past it": {
        "type": "array", "minItems": 1, "prefixItems": [{"type": "integer"}, False]},
    "type list with a way out": {"type": ["object", "null"], "required": ["x"],
                                 "properties": {"x": False}},
    "no type: any scalar satisfies object keywords": {"properties": {"x": False},
                                                      "required": ["x"]},
    "optional false property": {"type": "object", "properties": {"x": False}},
    "required name left to additionalProperties": {"type": "object", "required": ["q"]},
    "required name under patternProperties": {
        "type": "object", "required": ["q"], "additionalProperties": False,
        "patternProperties": {"^q$": {"type": "integer"}}},
    "minProperties within the names allowed": {
        "type": "object", "properties": {"a": {}, "b": {}}, "additionalProperties": False,
        "minProperties": 2},
    "remote $ref": {"$ref": "http://example.com/schema.json"},
    "$anchor $ref": {"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"},
    "percent-encoded pointer": {"$defs": {"a b": {"type": "integer"}}, "$ref": "#/$defs/a%20b"},
    "$ref below a nested $id": {
        "$defs": {"a": {"$id": "http://example.com/a", "$ref": "#/$defs/b",
                        "$defs": {"b": {"type": "integer"}}}},
        "$ref": "#/$defs/a"},
    "unknown keywords and types": {"type": "object", "x-custom": {"required": ["zz"]},
                                   "properties": {"a": {"type": "tuple"}}, "required": ["a"]},
    "dangling $ref in an unused $defs entry": {"$defs": {"u": {"$ref": "#/nowhere"}},
                                               "type": "integer"},
    "ordinary nested schema": {
        "type": "object", "additionalProperties": False, "required": ["name", "tags", "addr"],
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "minItems": 1, "items": {"enum": ["a", "b"]}},
            "addr": {"type": "object", "required": ["zip"],
                     "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                    "geo": {"anyOf": [{"type": "null"},
                                                      {"$ref": "#/$defs/point"}]}}}},
        "$defs": {"point": {"type": "array", "prefixItems": [{"type": "number"}] * 2,
                            "minItems": 2, "maxItems": 2}}},
}


@pytest.mark.parametrize("name", sorted(UNSATISFIABLE))
def test_unsatisfiable_schemas_are_refused(name: str) -> None:
    refused("structured_outputs.json admits no finite value: ", json=UNSATISFIABLE[name])


@pytest.mark.parametrize("name", sorted(SATISFIABLE))
def test_satisfiable_schemas_are_accepted(name: str) -> None:
    schema = SATISFIABLE[name]
    assert S(json=schema).json == schema and S(json=json.dumps(schema)).spec == \
        json.dumps(schema, sort_keys=True)


def test_unsatisfiable_messages_say_why() -> None:
    assert refused(json=SELF) == ("structured_outputs.json admits no finite value: #/$defs/a "
                                  "requires property 'x', whose schema refers back to #/$defs/a")
    assert refused(json=CYCLE) == (
        "structured_outputs.json admits no finite value: #/$defs/a requires property 'b', whose "
        "schema refers to #/$defs/b, which requires property 'a', whose schema refers back to "
        "#/$defs/a")
    refused("admits no finite value: # has an empty enum", json={"enum": []})
    refused("admits no finite value: # requires property 'x', whose schema is false",
            json=UNSATISFIABLE["required false"])
    refused("#/$defs/f is false", json=UNSATISFIABLE["false via $ref"])


@pytest.mark.parametrize("ref", ["#/$defs/zz", "#/$defs/a/properties/nope", "#/items/3",
                                 "#/items/01", "#/$defs/a~2", "#/%24defs/b", "#/type/x"])
def test_local_refs_that_point_nowhere_are_refused(ref: str) -> None:
    schema = {"$defs": {"a": {"type": "integer"}}, "items": [{}, {}],
              "type": "object", "properties": {"p": {"$ref": ref}}}
    assert refused(json=schema) == \
        f"structured_outputs.json: $ref '{ref}' points nowhere in the schema"


def test_refs_to_what_is_no_schema_are_refused() -> None:
    refused("$ref '#/$defs/a' points to [1], not a schema", json={"$defs": {"a": [1]},
                                                                  "$ref": "#/$defs/a"})
    S(json={"items": [{"type": "integer"}], "$ref": "#/items/0"})  # a pointer into a list


def _chain(n: int, last: object, ref_only: bool = False) -> dict:
    """$defs 0 ... n-1, each an object requiring a property that refers to the next (or, with
    `ref_only`, just a `$ref` to it); the last is `last`."""
    defs: dict[str, object] = {
        str(i): {"$ref": f"#/$defs/{i + 1}"} if ref_only else
        {"type": "object", "required": ["n"], "properties": {"n": {"$ref": f"#/$defs/{i + 1}"}}}
        for i in range(n - 1)}
    defs[str(n - 1)] = last
    return {"$defs": defs, "$ref": "#/$defs/0"}


def _timed(schema: dict) -> float:
    """The CPU seconds this thread spends checking `schema`: the analysis's own work (~25 ms for
    1,000 chained properties), not the wall clock, which a busy machine or another thread
    holding the GIL stretched to 1.35 s in one CI run."""
    start = time.thread_time()
    S(json=schema)
    return time.thread_time() - start


def test_long_chains_are_finite_and_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(S(json=_chain(650, {"type": "integer"})).spec) <= MAX_SCHEMA_BYTES
    assert len(S(json=_chain(1000, {"type": "integer"}, ref_only=True)).spec) <= MAX_SCHEMA_BYTES
    refused("admits no finite value", json=_chain(1000, {"enum": []}, ref_only=True))
    # 1000 required properties in a chain are ~92 KB of JSON: lift the size limit to see the
    # analysis itself go that deep (and deeper) without recursion
    monkeypatch.setattr(structured, "MAX_SCHEMA_BYTES", 1 << 20)
    for n in (1000, 5000):
        elapsed = _timed(_chain(n, {"type": "integer"}))
        assert elapsed < 0.5 * n / 1000, (n, elapsed)
        message = refused(json=_chain(n, {"enum": []}))
        assert message.endswith(f"#/$defs/{n - 1}, which has an empty enum"), message
        assert len(message) < 1000
        refused("#/$defs/0 requires property 'n'", json=_chain(n, {"$ref": "#/$defs/0"}))
    # the same chain listed the other way round: 999 requires 998 ... 0, an integer
    backwards = {"$defs": {str(i): {"type": "object", "required": ["n"],
                                    "properties": {"n": {"$ref": f"#/$defs/{i - 1}"}}}
                           for i in range(999, 0, -1)}, "$ref": "#/$defs/999"}
    backwards["$defs"]["0"] = {"type": "integer"}
    assert _timed(backwards) < 0.5


def test_deep_nesting_is_analysed_without_recursion() -> None:
    schema: object = {"type": "integer"}
    for _ in range(300):  # within what json.dumps nests (the default recursion limit)
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    S(json=schema)
    bottom: object = False
    for _ in range(300):
        bottom = {"type": "object", "properties": {"a": bottom}, "required": ["a"]}
    refused("admits no finite value", json=bottom)
    refused("is nested too deeply", json="[" * 100000 + "]" * 100000)
    refused("must be a JSON Schema object", json="[" * 100 + "]" * 100)


def test_a_64_kib_schema_checks_fast() -> None:
    props = {f"field_{i}": {"type": "object", "required": ["v", "w"],
                            "properties": {"v": {"$ref": f"#/$defs/t{i % 50}"},
                                           "w": {"anyOf": [{"type": "integer", "minimum": 0},
                                                           {"enum": ["x", "y"]}]},
                                           "u": {"type": "array", "items": {"$ref": "#"}}}}
             for i in range(240)}
    defs = {f"t{j}": {"type": "array", "minItems": 1,
                      "items": {"type": "object", "required": ["k"],
                                "properties": {"k": {"$ref": f"#/$defs/t{j + 1}"}
                                               if j < 49 else {"type": "string"}}}}
            for j in range(50)}
    schema = {"type": "object", "properties": props, "required": sorted(props)[::2],
              "$defs": defs}
    size = len(json.dumps(schema, sort_keys=True))
    while size < 65000:  # pad towards 64 KiB with a description
        schema.setdefault("description", "")
        schema["description"] += "x" * (65000 - size)
        size = len(json.dumps(schema, sort_keys=True))
    assert 65000 <= size <= MAX_SCHEMA_BYTES
    assert _timed(schema) < 0.5
    # 850 required properties that become satisfiable one at a time, in their listed order
    # (an analysis that rescans its conditions would go quadratic here)
    n = 850
    props = {f"p{i:04d}": {"$ref": f"#/$defs/{i}"} for i in range(n)}
    ladder = {"type": "object", "required": sorted(props), "properties": props,
              "minProperties": n, "additionalProperties": False,
              "$defs": {str(i): {"$ref": f"#/$defs/{i - 1}"} if i else {} for i in range(n)}}
    assert 60000 <= len(json.dumps(ladder, sort_keys=True)) <= MAX_SCHEMA_BYTES, n
    assert _timed(ladder) < 0.5


# --------------------------------------------------- brute force on random schema graphs

def _random_graph(rng: random.Random) -> dict:
    """3-5 $defs, each an object of 0-2 properties that refer to a def or are integers (now and
    then `false`), each required or not; the root refers to d0."""
    n = rng.randint(3, 5)
    defs = {}
    for i in range(n):
        props, required = {}, []
        for p in range(rng.randint(0, 2)):
            roll = rng.random()
            props[f"p{p}"] = ({"$ref": f"#/$defs/d{rng.randrange(n)}"} if roll < 0.75 else
                              {"type": "integer"} if roll < 0.95 else False)
            if rng.random() < 0.6:
                required.append(f"p{p}")
        defs[f"d{i}"] = {"type": "object", "properties": props, "required": required}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _valid(value: object, schema: object, root: dict) -> bool:
    """A validator for the family above (written for this test, JSON Schema's meaning)."""
    if schema is False:
        return False
    if "$ref" in schema:
        return _valid(value, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if schema.get("type") == "integer":
        return type(value) is int
    return (isinstance(value, dict) and all(k in value for k in schema["required"])
            and all(_valid(v, schema["properties"][k], root) for k, v in value.items()))


def _instances(schema: object, depth: int, root: dict) -> list[object]:
    """Valid values of `schema` nested at most `depth` objects deep, at most two of them: for an
    object, every choice of present properties, each of every value found for it one level
    down, kept if the validator passes it. Two (any one) per level keep the search small and
    lose no depth at which some value exists."""
    if schema is not False and "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if schema is False or (schema.get("type") != "integer" and depth == 0):
        return []
    if schema.get("type") == "integer":
        return [0]
    names = sorted(schema["properties"])
    options = [[ABSENT] + _instances(schema["properties"][k], depth - 1, root) for k in names]
    found = []
    for chosen in itertools.product(*options):
        value = {k: v for k, v in zip(names, chosen) if v is not ABSENT}
        if _valid(value, schema, root) and value not in found:
            found.append(value)
    return found[:2]


ABSENT = object()


def _brute_force_satisfiable(schema: dict) -> bool:
    return bool(_instances(schema, len(schema["$defs"]) + 1, schema))


def _accepted(schema: dict) -> bool:
    try:
        S(json=schema)
    except InvalidFieldError as e:
        assert "admits no finite value" in str(e), e
        return False
    return True


def test_analysis_matches_brute_force_on_random_graphs() -> None:
    rng = random.Random(20240611)
    outcomes = []
    for _ in range(400):
        schema = _random_graph(rng)
        expected = _brute_force_satisfiable(schema)
        assert _accepted(schema) == expected, json.dumps(schema)
        outcomes.append(expected)
    assert outcomes.count(True) > 50 and outcomes.count(False) > 50, outcomes.count(True)


# ----------------------------------------------------------------------------- field names

@pytest.mark.parametrize("value, start", [
    ({"json": SELF}, "guided_json.json admits no finite value: #/$defs/a"),
    ({"json": {"enum": [2 ** 64]}}, "guided_json.json holds a number JSON cannot carry at $.enum[0]"),
    ({"json": _schema_of_size(65537)}, "guided_json.json is 65,537 bytes of JSON"),
    ({"json": {"$ref": "#/$defs/zz"}}, "guided_json.json: $ref '#/$defs/zz' points nowhere"),
    ({"regex": "a" * 16385}, "guided_json.regex is 16,385 bytes"),
    ({"choice": ["a"] * 16385}, "guided_json.choice has 16,385 entries"),
])
def test_from_dict_names_the_callers_field(value: dict, start: str) -> None:
    with pytest.raises(InvalidFieldError) as e:
        S.from_dict(value, field="guided_json")
    assert e.value.field == "guided_json"
    assert str(e.value).startswith(start), str(e.value)
    assert "structured_outputs" not in str(e.value)

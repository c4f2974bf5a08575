"""The tool-call and reasoning parsers (minivllm_jax/serving/output_parsers.py) on fixed model
outputs: a single call, several, text before a call, malformed JSON left as text, unclosed blocks;
and streaming in every chunking equal to the whole parse.

Truths: the outputs' known pieces (written here by hand), json.loads of each call's arguments,
and the parser's own whole-text parse for the streaming check (itself checked by the fixed cases).
"""
from __future__ import annotations

import json
import random

import pytest

from minivllm_jax.serving.output_parsers import (CallListParser, Delta, NamedCallParser,
                                                 OutputParser, reasoning_parser, tool_parser)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TWO = CALL + '\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
BAD = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
# (output, content, [(name, arguments as a dict)])
TOOL_CASES = {
    "single": (CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),
    "several": (TWO, None, [("get_weather", {"city": "Paris", "days": 2}),
                            ("get_time", {"tz": "CET"})]),
    "text before": ("Let me look that up.\n" + CALL, "Let me look that up.\n",
                    [("get_weather", {"city": "Paris", "days": 2})]),
    "malformed left as text": ("Hmm " + BAD, "Hmm " + BAD, []),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"arguments": {}}</tool_call>', []),
    "unclosed": ('ok <tool_call>{"name": "a"', 'ok <tool_call>{"name": "a"', []),
    "plain text with a lone <": ("a < b and <tool", "a < b and <tool", []),
    "no arguments": ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {})]),
}


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _stream(parser, chunks: list[str]) -> list[Delta]:
    return [d for c in chunks for d in parser.feed(c)] + parser.finish()


def _reassembled(deltas: list[Delta]) -> tuple[str, str, list[tuple[str, str]]]:
    """(content, reasoning, [(name, arguments)]) of streamed deltas; each call's first delta
    must carry its index, id and name, before any of its arguments."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.index not in calls:
            assert d.id and d.name and not d.arguments, d
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    return ("".join(d.content for d in deltas), "".join(d.reasoning for d in deltas),
            [tuple(c) for c in calls.values()])  # type: ignore[misc]


@pytest.mark.parametrize("case", TOOL_CASES)
def test_hermes_fixed_outputs(case: str) -> None:
    """Content and calls as written; each call's arguments parse to its object; ids unique."""
    text, content, calls = TOOL_CASES[case]
    parsed = tool_parser("hermes").parse(text)
    assert parsed.content == content and parsed.reasoning is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize("case", TOOL_CASES)
def test_hermes_streaming_equals_whole(case: str) -> None:
    """Fed in 50 random chunkings (one character at a time included): the content deltas
    concatenate to those of the whole text fed at once (the whole parse's content, or only
    whitespace where it has none); each call's first delta carries its index, id and
    name, and its argument pieces concatenate to the whole parse's arguments; held-back text is
    never released out of order."""
    text, _, _ = TOOL_CASES[case]
    whole = tool_parser("hermes").parse(text)
    want = "".join(d.content for d in _stream(tool_parser("hermes"), [text]))
    assert whole.content == (want if want.strip() else None)
    rng = random.Random(0)
    for chunks in [list(text)] + [_chunks(text, rng) for _ in range(50)]:
        deltas = _stream(tool_parser("hermes"), chunks)
        assert "".join(d.content for d in deltas) == want, chunks
        calls = {}
        for d in deltas:
            if d.index is None:
                continue
            if d.index not in calls:
                assert d.id and d.name, d
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
        assert [tuple(c) for c in calls.values()] == [(c.name, c.arguments)
                                                      for c in whole.tool_calls]


REASONING_CASES = {
    "qwen3": [("<think>\nstep one\n</think>\n\nParis.", "\nstep one\n", "Paris."),
              ("Paris.", None, "Paris."),
              ("<think>still thinking", "still thinking", None),
              ("<thinking is not a tag", None, "<thinking is not a tag")],
    "deepseek_r1": [("step one</think>Paris.", "step one", "Paris."),
                    ("<think>step one</think>\nParis.", "step one", "Paris."),
                    ("no end tag", "no end tag", None)],
}


@pytest.mark.parametrize("name", REASONING_CASES)
def test_reasoning_fixed_and_streamed(name: str) -> None:
    """Reasoning and content as written, and the same from 30 random chunkings each."""
    rng = random.Random(1)
    for text, reasoning, content in REASONING_CASES[name]:
        parsed = reasoning_parser(name).parse(text)
        assert (parsed.reasoning, parsed.content) == (reasoning, content), text
        for chunks in [list(text)] + [_chunks(text, rng) for _ in range(30)]:
            deltas = _stream(reasoning_parser(name), chunks)
            assert "".join(d.reasoning for d in deltas) == (reasoning or ""), (text, chunks)
            assert "".join(d.content for d in deltas) == (content or ""), (text, chunks)


def test_reasoning_then_tool_call() -> None:
    """Calls are parsed from the answer only: a call inside the reasoning stays reasoning."""
    text = "<think>maybe " + CALL + "</think>\n" + CALL
    split = reasoning_parser("qwen3").parse(text)
    assert split.reasoning == "maybe " + CALL
    calls = tool_parser("hermes").parse(split.content).tool_calls
    assert [c.name for c in calls] == ["get_weather"]


def test_unknown_parser_names_the_known_ones() -> None:
    for make, field in ((tool_parser, "tool_call_parser"), (reasoning_parser, "reasoning_parser")):
        with pytest.raises(ValueError, match=field):
            make("llama9")


# tool_choice "required": vLLM's JSON array of {"name", "parameters"} (tools.required_schema)
LIST = '[{"name":"get_weather","parameters":{"city":"Paris","days":2}},{"name":"get_time","parameters":{}}]'
LIST_CASES = {  # (output, content, [(name, arguments as a dict)])
    "two calls": (LIST, None, [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    "spaced": ('[ {"name": "ping", "parameters": {"a": [1, {"b": "]"}]}} ]', None,
               [("ping", {"a": [1, {"b": "]"}]})]),
    "cut short": (LIST[:70], LIST[LIST.index("},{") + 1:70], [("get_weather", {"city": "Paris", "days": 2})]),
    "not an array": ('{"name": "x"}', '{"name": "x"}', []),
    "not a call": ('[{"name": "x"}]', '{"name": "x"}]', []),
}


@pytest.mark.parametrize("case", LIST_CASES)
def test_call_list_fixed_and_streamed(case: str) -> None:
    """Calls as written (arguments: the parameters' json.dumps); what is no complete call stays
    content, verbatim from where the calls end; the same in 40 random chunkings."""
    text, content, calls = LIST_CASES[case]
    whole = CallListParser().parse(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert all(c.arguments == json.dumps(json.loads(c.arguments)) for c in whole.tool_calls)
    rng = random.Random(2)
    for chunks in [list(text)] + [_chunks(text, rng) for _ in range(40)]:
        got = _reassembled(_stream(CallListParser(), chunks))
        assert got == (content or "", "", [(c.name, c.arguments) for c in whole.tool_calls]), chunks


def test_named_call_streams_the_output_as_arguments() -> None:
    """A named choice's output is its one call's arguments, verbatim, in every chunking; an
    empty output is no call."""
    text = '{"city":"Paris","days":2}'
    whole = NamedCallParser("get_weather").parse(text)
    assert whole.content is None and [(c.name, c.arguments) for c in whole.tool_calls] == \
        [("get_weather", text)]
    rng = random.Random(3)
    for chunks in [list(text)] + [_chunks(text, rng) for _ in range(20)]:
        assert _reassembled(_stream(NamedCallParser("get_weather"), chunks)) == \
            ("", "", [("get_weather", text)])
    assert NamedCallParser("f").parse("").tool_calls == ()


COMBINED = {  # (output, reasoning, content, call names) through qwen3 + hermes
    "think then call": ("<think>need weather</think>\n" + CALL, "need weather", None,
                        ["get_weather"]),
    "call inside the thinking": ("<think>" + CALL + "</think>ok", CALL, "ok", []),
    "text, no think": ("Paris. " + CALL, None, "Paris. ", ["get_weather"]),
}


@pytest.mark.parametrize("case", COMBINED)
def test_reasoning_and_tools_together(case: str) -> None:
    """OutputParser: reasoning split first, calls parsed from the answer only; `called` says
    whether a call was released; streamed equals whole in 30 chunkings."""
    text, reasoning, content, names = COMBINED[case]
    whole = OutputParser(reasoning_parser("qwen3"), tool_parser("hermes")).parse(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert [c.name for c in whole.tool_calls] == names
    rng = random.Random(4)
    for chunks in [list(text)] + [_chunks(text, rng) for _ in range(30)]:
        parser = OutputParser(reasoning_parser("qwen3"), tool_parser("hermes"))
        got = _reassembled(_stream(parser, chunks))
        assert got == (content or "", reasoning or "",
                       [(c.name, c.arguments) for c in whole.tool_calls]), chunks
        assert parser.called == bool(names)

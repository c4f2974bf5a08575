"""Tool calling in-process (minivllm_jax/serving/tools.py, docs/API.md §4a): the server's options,
a request's tools and tool_choice checked and turned into a constraint and an output parser,
tool conversations rendered through the tools template the tests ship, vLLM's chat template
options (`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`) on a
template written here, and a streamed choice's
deltas reassembled (as a client does) equal to its non-streamed message. The servers' tests
(test_serve.py, test_serve_tools.py) run the same end to end; the bad bodies are in
helpers/hostile_bodies.py.

Truths: `jsonschema` for what the "required" schema admits, the rendered prompt's text for the
template, the message of the whole text for the stream, hand-written expectations otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from tool_helpers import (SCHEMAS, TEMPLATE, TIME, TOOLS, WEATHER,  # noqa: E402
                          WEATHER_CHOICE)
from tiny_configs import save_byte_tokenizer  # noqa: E402

from minivllm_jax.cli.serve import main as serve_main  # noqa: E402
from minivllm_jax.serving.errors import APIError  # noqa: E402
from minivllm_jax.serving.output_parsers import (CallListParser, HermesToolParser,  # noqa: E402
                                                 NamedCallParser)
from minivllm_jax.serving.protocol import ParseContext, parse_chat_request  # noqa: E402
from minivllm_jax.serving.tools import (ChatOutput, ToolOptions, parse_tools,  # noqa: E402
                                        required_schema)

AUTO = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_tool_options_are_checked() -> None:
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ToolOptions(tool_call_parser="llama9")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ToolOptions(reasoning_parser="llama9")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ToolOptions(enable_auto_tool_choice=True)


def _call(name: str, args: object) -> dict[str, Any]:
    return {"name": name, "parameters": args}


def test_required_schema_admits_exactly_calls_of_the_tools() -> None:
    """jsonschema: one or more {name, parameters} of the tools, each with valid arguments; not
    none, not an unknown name, not a bad argument, not a second key; at most one call when not
    parallel."""
    functions = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    schema = required_schema(functions)
    good = [[_call("get_weather", {"city": "Oslo", "unit": "celsius"})],
            [_call("get_time", {"hour": 3}), _call("get_weather", {"city": "Rome", "unit": "fahrenheit"})]]
    bad = [[], [_call("get_sun", {})], [_call("get_time", {"hour": 24})],
           [_call("get_time", {"hour": 1, "extra": 0})], [{**_call("get_time", {"hour": 1}), "id": 1}],
           [{"name": "get_time"}], {"name": "get_time", "parameters": {"hour": 1}}]
    for instance in good:
        jsonschema.validate(instance, schema)
    for instance in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, schema)
    single = required_schema(functions, parallel=False)
    jsonschema.validate(good[0], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[1], single)


def test_required_schema_hoists_defs() -> None:
    """A function's `#/$defs/...` references still resolve once its schema is nested."""
    point = {"type": "object", "$defs": {"coord": {"type": "integer", "minimum": 0}},
             "properties": {"x": {"$ref": "#/$defs/coord"}}, "required": ["x"]}
    schema = required_schema({"move": point})
    jsonschema.validate([_call("move", {"x": 3})], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([_call("move", {"x": -3})], schema)


def test_tool_choice_picks_the_constraint_and_the_parser() -> None:
    """Default: auto when the server parses calls, else none (vLLM's); required constrains to
    required_schema, a named choice to its function's schema; auto and none constrain nothing;
    every request with tools has its tools' schema checked; parallel_tool_calls False allows one."""
    cases = [({}, AUTO, None, HermesToolParser), ({}, ToolOptions(), None, None),
             ({"tool_choice": "none"}, AUTO, None, None),
             ({"tool_choice": "required"}, ToolOptions(), "required", CallListParser),
             ({"tool_choice": WEATHER_CHOICE}, ToolOptions(), WEATHER, NamedCallParser)]
    for fields, options, constraint, parser in cases:
        got = parse_tools({"tools": TOOLS, **fields}, options)
        assert got.tools == TOOLS
        check = required_schema(SCHEMAS)
        assert [(name, c.json) for name, c in got.checks] == [("tools", check)]
        want = check if constraint == "required" else constraint
        assert (got.constraint.json if got.constraint else None) == want, fields
        assert (type(got.output.parser().tools) if got.output else None) is parser, fields
    single = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                         ToolOptions())
    assert single.constraint.json["maxItems"] == 1 and not single.output.parallel
    none = parse_tools({}, ToolOptions(reasoning_parser="qwen3"))
    assert none.tools is None and none.checks == () and none.output.reasoning_parser == "qwen3"
    assert parse_tools({}, ToolOptions()).output is None


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools",
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters, digits"),
    ({"tools": [*TOOLS, TOOLS[0]]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools", "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}]},
     "tools", "tools[0].function.parameters: $ref"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_sun"}}},
     "tool_choice", "'get_sun'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_bad_tools_name_the_field_and_the_path(fields: dict[str, Any], param: str,
                                               words: str) -> None:
    with pytest.raises(APIError) as e:
        parse_tools(fields, ToolOptions())
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value.body()


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> ParseContext:
    """A parse context with a byte-level tokenizer (it has no template of its own) and the tools
    template the tests ship."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("byte_tokenizer")
    save_byte_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    options = ToolOptions(TEMPLATE.read_text(), True, "hermes", "qwen3")
    return ParseContext("m", 4096, tok, 64, None, {}, options)


def _prompt(context: ParseContext, body: dict[str, Any]) -> str:
    gen = parse_chat_request(body, context)
    return context.tokenizer.decode(gen.prompts[0].token_ids)


def test_tool_conversations_render_through_the_template(context: ParseContext) -> None:
    """The tools are listed in the system turn; an assistant turn's calls (arguments given as a
    JSON string, content null) and the tool results render as the template writes them."""
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    prompt = _prompt(context, {"messages": turn, "tools": TOOLS})
    assert json.dumps(TOOLS[0]) in prompt and "# Tools" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris", "unit": "celsius"}}\n</tool_call><|im_end|>\n') in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny, 21\n</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n")
    plain = _prompt(context, {"messages": ASK})
    assert "# Tools" not in plain and plain.startswith("<|im_start|>system\nYou are a helpful")


THINKING = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
            "{% endif %}")


@pytest.mark.parametrize("fields,text", [
    ({}, "<|user|>hi<|end|><|assistant|>The answer<|end|><|assistant|>"),
    ({"chat_template_kwargs": {"enable_thinking": False}},
     "<|user|>hi<|end|><|assistant|>The answer<|end|><|assistant|><think></think>"),
    ({"chat_template_kwargs": {}, "add_generation_prompt": False},
     "<|user|>hi<|end|><|assistant|>The answer<|end|>"),
    ({"add_generation_prompt": False, "continue_final_message": True},
     "<|user|>hi<|end|><|assistant|>The answer"),
])
def test_chat_template_options_reach_the_template(context: ParseContext, fields: dict[str, Any],
                                                  text: str) -> None:
    """vLLM's chat_template_kwargs, add_generation_prompt and continue_final_message on a
    template written here: the prompt is the template's text for them, tokenized."""
    ctx = ParseContext("m", 4096, context.tokenizer, 64, None, {}, ToolOptions(THINKING))
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "The answer"}], **fields}
    ids = parse_chat_request(body, ctx).prompts[0].token_ids
    assert list(ids) == context.tokenizer.encode(text, add_special_tokens=False)


def test_a_request_template_needs_the_trust_flag(context: ParseContext) -> None:
    """A request's own chat_template: a 400 naming it on a server without
    --trust-request-chat-template; with it, the prompt is that template's text (and a template
    Jinja cannot parse is a 400 naming it and the line)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": THINKING}
    with pytest.raises(APIError) as e:
        parse_chat_request(body, context)
    assert e.value.param == "chat_template" and "--trust-request-chat-template" in e.value.message
    trusted = ParseContext("m", 4096, context.tokenizer, 64, None, {},
                           ToolOptions(trust_request_chat_template=True))
    ids = parse_chat_request(body, trusted).prompts[0].token_ids
    assert list(ids) == context.tokenizer.encode("<|user|>hi<|end|><|assistant|>",
                                                 add_special_tokens=False)
    with pytest.raises(APIError) as e:
        parse_chat_request({**body, "chat_template": "{% for m in messages %}\n{{ m }"}, trusted)
    assert e.value.param == "chat_template" and "line 2" in e.value.message, e.value.body()
    args = ["--trust-request-chat-template"]
    from minivllm_jax.cli.serve import build_parser, tool_options

    assert tool_options(build_parser().parse_args(args)).trust_request_chat_template
    assert not tool_options(build_parser().parse_args([])).trust_request_chat_template


@pytest.mark.parametrize("fields,param,words", [
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "'add_generation_prompt'"),
    ({"add_generation_prompt": 1}, "add_generation_prompt", "boolean"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
])
def test_bad_chat_template_options_name_the_field(context: ParseContext, fields: dict[str, Any],
                                                  param: str, words: str) -> None:
    with pytest.raises(APIError) as e:
        parse_chat_request({"messages": ASK, **fields}, context)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value.body()


@pytest.mark.parametrize("messages,words", [
    ([*ASK, {"role": "tool", "content": "sunny"}], "messages[1].tool_call_id"),
    ([*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([*ASK, {"role": "assistant", "tool_calls": [{"function": {}}]}], "messages[1].tool_calls[0]"),
    ([*ASK, {"role": "assistant", "tool_calls": "f"}], "messages[1].tool_calls"),
])
def test_bad_tool_messages_name_messages(context: ParseContext, messages: list[Any],
                                         words: str) -> None:
    with pytest.raises(APIError) as e:
        parse_chat_request({"messages": messages, "tools": TOOLS}, context)
    assert (e.value.status, e.value.param) == (400, "messages") and words in e.value.message


def test_constraining_choices_set_the_output_constraint(context: ParseContext) -> None:
    """required / named: the request's constraint (its refusal named `tools`); another
    constraint beside one is a 400 naming that field."""
    gen = parse_chat_request({"messages": ASK, "tools": TOOLS, "tool_choice": WEATHER_CHOICE},
                             context)
    assert gen.params[0].structured_outputs.json == WEATHER
    assert gen.renamed["structured_outputs"] == "tools" and gen.checks[0][0] == "tools"
    for extra in ({"response_format": {"type": "json_object"}}, {"guided_regex": "a"}):
        with pytest.raises(APIError) as e:
            parse_chat_request({"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                **extra}, context)
        assert e.value.param == next(iter(extra)), e.value.body()
    auto = parse_chat_request({"messages": ASK, "tools": TOOLS, "guided_regex": "a+"}, context)
    assert auto.params[0].structured_outputs.regex == "a+"  # auto constrains nothing itself


def _client_view(output: ChatOutput, pieces: list[str]) -> dict[str, Any]:
    """The deltas of an output streamed in `pieces`, accumulated as a client does, in
    `message` form."""
    parser, msg = output.parser(), {"content": "", "reasoning_content": "", "tool_calls": {}}
    deltas = [output.delta(parser.feed(p)) for p in pieces] + [output.delta(parser.finish())]
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for t in d.get("tool_calls", []):
            call = msg["tool_calls"].setdefault(t["index"], {"function": {"arguments": ""}})
            if "id" in t:
                call.update(id=t["id"], type=t["type"], function={**t["function"]})
            else:
                call["function"]["arguments"] += t["function"]["arguments"]
    return msg


@pytest.mark.parametrize("choice,text", [
    ("auto", '<think>hm</think>Sure. <tool_call>{"name": "get_time", "arguments": {"hour": 3}}'
             '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
    ("required", '[{"name":"get_time","parameters":{"hour":3}},{"name":"get_time","parameters":{}}]'),
    (WEATHER_CHOICE, '{"city":"Rome","unit":"celsius"}'),
    ("none", '<think>hm</think><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
])
@pytest.mark.parametrize("parallel", [True, False])
def test_stream_deltas_reassemble_to_the_message(choice: Any, text: str, parallel: bool) -> None:
    """Streamed a character at a time and in 7-character pieces, the deltas a client
    accumulates equal the whole text's message (ids aside); parallel_tool_calls False keeps
    the first call only."""
    output = parse_tools({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel},
                         ToolOptions(None, True, "hermes", "qwen3")).output
    whole = output.message(text)
    calls = [c["function"] for c in whole.get("tool_calls", [])]
    want = {"content": whole["content"] or "", "reasoning_content": whole["reasoning_content"] or "",
            "calls": calls}
    for pieces in (list(text), [text[i:i + 7] for i in range(0, len(text), 7)]):
        got = _client_view(output, pieces)
        assert all(c["id"].startswith("call_") and c["type"] == "function"
                   for c in got["tool_calls"].values())
        got["calls"] = [c["function"] for _, c in sorted(got.pop("tool_calls").items())]
        assert got == want
    expected = {"auto": 2, "required": 2, "none": 0}.get(choice, 1) if isinstance(choice, str) else 1
    assert len(calls) == (min(expected, 1) if not parallel else expected)
    if choice == "none":
        assert whole["content"].startswith("<tool_call>")


@pytest.mark.parametrize("argv,words", [
    (["--chat-template", "/nonexistent/tools.jinja"], "--chat-template: cannot read"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "llama9"], "--tool-call-parser"),
])
def test_bad_tool_options_are_one_line(argv: list[str], words: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_a_template_that_is_not_jinja_is_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A file's template and an inline one (vLLM's rule: a value with a brace or a newline is
    the template itself) that Jinja cannot parse: one line naming the flag and the line."""
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m }")
    for value, where in ((str(bad), str(bad)), ("{% for m in messages %}\n{{ m }", "inline")):
        assert serve_main(["--chat-template", value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--chat-template" in err and where in err, err
        assert f"line {value.count(chr(10)) + 1}" in err, err


def test_an_inline_template_is_the_template() -> None:
    """--chat-template's value is read as a file unless it holds a brace or a newline."""
    from minivllm_jax.cli.serve import build_parser, tool_options

    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert tool_options(build_parser().parse_args(["--chat-template", inline])).chat_template == inline
    from_file = tool_options(build_parser().parse_args(["--chat-template", str(TEMPLATE)]))
    assert from_file.chat_template == TEMPLATE.read_text()

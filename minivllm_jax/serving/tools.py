"""Tool calling and reasoning in /v1/chat/completions (docs/API.md §4a): the server's options
(`ToolOptions`), a request's `tools`, `tool_choice`, `parallel_tool_calls` and tool-call messages
checked (`parse_tools`, `template_message`), the constraint a constraining choice puts on
generation, and how a choice's text becomes OpenAI's message or stream deltas (`ChatOutput`).

Invariants:
- A refusal is a 400 whose `param` is the top-level request field (`tools`, `tool_choice`,
  `parallel_tool_calls`, `messages`) and whose message names the exact path
  (`tools[1].function.name`), as protocol.py names `messages[i].role`.
- `tool_choice="required"` constrains the output to `required_schema` (a JSON array of
  `{"name", "parameters"}` objects, vLLM's), a named choice to that function's `parameters`:
  what the grammar engine lets through is one or more calls (or the named one) whose arguments
  validate against their function's schema, unless generation is cut short (`finish_reason`
  "length").
- Every request with tools has its tools' schema (`required_schema`) compiled by the grammar
  engine whatever its `tool_choice` (`ToolRequest.checks`; cached per tool set), so a schema the
  engine cannot serve is a 400 naming `tools` at once, not when a later request requires a call.
- `arguments` is the text `output_parsers` gives: for a named choice the model's own text (its
  pieces stream as generated), otherwise the parsed object's `json.dumps`; streamed pieces
  concatenate to exactly the non-streamed string (`ChatOutput.parser` runs both).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping

from minivllm_jax.serving.errors import bad_request
from minivllm_jax.serving.output_parsers import (TOOL_PARSERS, CallListParser, Delta,
                                                 NamedCallParser, OutputParser, Parsed, ToolCall,
                                                 reasoning_parser, tool_parser)
from scheduler import InvalidFieldError, StructuredOutputsParams

JSON = dict[str, object]
ToolParserFactory = Callable[[], object]
# OpenAI's rule for a function's name
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# a function that declares no parameters takes none (OpenAI's reading of an absent `parameters`)
NO_PARAMETERS: JSON = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolOptions:
    """The server's tool options (vLLM's flags): `chat_template`, a Jinja template's text that
    replaces the tokenizer's; `enable_auto_tool_choice` (needs `tool_call_parser`, a
    `TOOL_PARSERS` name) lets `tool_choice="auto"` parse calls out of free output;
    `reasoning_parser`, a `REASONING_PARSERS` name, splits reasoning from every chat answer."""

    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # a chat request may bring its own `chat_template` (vLLM's --trust-request-chat-template:
    # a template runs code of the client's choosing, loops included)
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)  # a ValueError naming the known ones
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             f"(one of {sorted(TOOL_PARSERS)})")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("--chat-template is empty")


def check_jinja(template: str, what: str) -> str:
    """``template`` when Jinja parses it (with the loop controls transformers enables);
    otherwise ValueError ``"{what} line N: why"``."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{what} line {e.lineno}: {e.message}") from None
    return template


@dataclass(frozen=True)
class ChatOutput:
    """How a chat choice's text becomes OpenAI's message: reasoning split off
    (`reasoning_parser`), then calls parsed from the answer (`tool_parser`, a factory of fresh
    parsers), the rest `content`. `parallel` False keeps only the first call."""

    reasoning_parser: str | None = None
    tool_parser: ToolParserFactory | None = None
    parallel: bool = True

    def parser(self) -> OutputParser:
        """A fresh parser of one choice's output (streamed: `feed`, `finish`)."""
        reasoning = reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        return OutputParser(reasoning, self.tool_parser() if self.tool_parser else None)

    def _calls(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        return calls if self.parallel else calls[:1]

    def message(self, text: str) -> JSON:
        """OpenAI's `message` of a whole output: content (None when only whitespace is left),
        `reasoning_content` with a reasoning parser, `tool_calls` when there are calls."""
        parsed: Parsed = self.parser().parse(text)
        msg: JSON = {"role": "assistant", "content": parsed.content}
        if self.reasoning_parser is not None:
            msg["reasoning_content"] = parsed.reasoning
        calls = self._calls(parsed.tool_calls)
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
        return msg

    def delta(self, deltas: list[Delta]) -> JSON:
        """OpenAI's stream `delta` of a parser's deltas: content, reasoning_content, and
        tool_calls entries (a call's first: index, id, type, name and arguments ""; then
        `{"index", "function": {"arguments": piece}}`)."""
        out: JSON = {}
        content = "".join(d.content for d in deltas)
        reasoning = "".join(d.reasoning for d in deltas)
        if content:
            out["content"] = content
        if reasoning:
            out["reasoning_content"] = reasoning
        calls: list[JSON] = []
        for d in deltas:
            if d.index is None or (not self.parallel and d.index > 0):
                continue
            if d.id is not None:
                calls.append({"index": d.index, "id": d.id, "type": "function",
                              "function": {"name": d.name, "arguments": ""}})
            elif calls and calls[-1]["index"] == d.index and "id" not in calls[-1]:
                calls[-1]["function"]["arguments"] += d.arguments  # type: ignore[index]
            else:
                calls.append({"index": d.index, "function": {"arguments": d.arguments}})
        if calls:
            out["tool_calls"] = calls
        return out


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason of a choice: "tool_calls" when it stopped having made calls."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, checked: `tools` for the chat template (None: none given),
    `constraint` (with `tool_choice` "required" or named), `checks` (the constraints the grammar
    engine must compile, by the request field they came in), and `output` (None: the text is
    the content, verbatim)."""

    tools: list[JSON] | None
    constraint: StructuredOutputsParams | None
    checks: tuple[tuple[str, StructuredOutputsParams], ...]
    output: ChatOutput | None


def _schema(params: object, i: int) -> StructuredOutputsParams:
    """A function's `parameters` as the constraint of its arguments (an object schema), its
    pure-Python checks done (refs, numbers, size)."""
    where = f"tools[{i}].function.parameters"
    if params is None:
        params = NO_PARAMETERS
    if not isinstance(params, dict):
        raise bad_request(f"{where} must be a JSON Schema object, got {params!r:.60}", "tools")
    if params.get("type", "object") != "object":
        raise bad_request(f"{where} must describe an object (arguments are a JSON object), "
                          f"got type {params.get('type')!r:.40}", "tools")
    try:
        return StructuredOutputsParams(json={"type": "object", **params})
    except InvalidFieldError as e:
        raise bad_request(str(e).replace("structured_outputs.json", where, 1), "tools") from None


def _functions(body: Mapping[str, object]) -> dict[str, StructuredOutputsParams]:
    """Each function's name -> its arguments' constraint, in order ({} for no tools)."""
    tools = body.get("tools")
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {type: function, function: {name, "
                          "parameters}} objects", "tools")
    out: dict[str, StructuredOutputsParams] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] must be an object of type 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"tools[{i}].function must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                              f"underscores or dashes, got {name!r:.60}", "tools")
        if name in out:
            raise bad_request(f"tools[{i}].function.name {name!r} is given twice", "tools")
        out[name] = _schema(fn.get("parameters"), i)
    return out


def required_schema(functions: Mapping[str, JSON], parallel: bool = True) -> JSON:
    """vLLM's schema of `tool_choice="required"`: a JSON array of at least one (at most one
    when not `parallel`) `{"name": <a function's name>, "parameters": <its arguments>}`. Each
    function's `$defs` move to the root, where its `#/$defs/...` references then point."""
    defs: JSON = {}
    items = []
    for i, (name, params) in enumerate(functions.items()):
        params = dict(params)
        for key, value in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:
                raise bad_request(f"tools[{i}].function.parameters.$defs.{key} differs from "
                                  "another function's definition of the same name", "tools")
        items.append({"type": "object", "additionalProperties": False,
                      "required": ["name", "parameters"],
                      "properties": {"name": {"const": name}, "parameters": params}})
    schema: JSON = {"type": "array", "minItems": 1,
                    "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _tool_choice(body: Mapping[str, object], functions: Mapping[str, object],
                 options: ToolOptions) -> tuple[str, str | None]:
    """(one of `CHOICES`, None), or ("function", the named function's name)."""
    choice = body.get("tool_choice")
    if choice is None:  # vLLM's default: auto when the server parses calls, else none
        return ("auto" if functions and options.enable_auto_tool_choice else "none"), None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice as an object must be {"type": "function", "function": '
                              '{"name": ...}}', "tool_choice")
        if name not in functions:
            raise bad_request(f"tool_choice names the function {name!r:.80}, which is not in "
                              f"tools", "tool_choice")
        return "function", name
    if choice not in CHOICES:
        raise bad_request(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, "
                          f"got {choice!r:.60}", "tool_choice")
    if choice != "none" and not functions:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "auto" and not options.enable_auto_tool_choice:
        raise bad_request('tool_choice "auto" needs the server started with '
                          "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
    return str(choice), None


def parse_tools(body: Mapping[str, object], options: ToolOptions) -> ToolRequest:
    """A chat body's tools, tool_choice and parallel_tool_calls, checked (a 400 naming the
    field), and what they make of the request."""
    functions = _functions(body)
    choice, name = _tool_choice(body, functions, options)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls must be a boolean, got {parallel!r:.40}",
                          "parallel_tool_calls")
    constraint, make = None, None
    checks: tuple[tuple[str, StructuredOutputsParams], ...] = ()
    if functions:
        try:
            schemas = {n: f.json for n, f in functions.items()}
            check = StructuredOutputsParams(json=required_schema(schemas, parallel))
        except InvalidFieldError as e:  # the size limit, all tools together
            raise bad_request(str(e).replace("structured_outputs.json", "tools (all functions' "
                                              "parameters together)", 1), "tools") from None
        checks = (("tools", check),)
        if choice == "required":
            constraint, make = check, CallListParser
        elif name is not None:
            constraint = functions[name]
            make = partial(NamedCallParser, name)
        elif choice == "auto":
            make = partial(tool_parser, options.tool_call_parser)
    output = None
    if make is not None or options.reasoning_parser is not None:
        output = ChatOutput(options.reasoning_parser, make, parallel)
    tools = body.get("tools") if functions else None
    return ToolRequest(tools, constraint, checks, output)  # type: ignore[arg-type]


def template_message(i: int, message: Mapping[str, object], entry: JSON) -> JSON:
    """`entry` (a message's role and text content) with what a chat template reads of a tool
    conversation: an assistant turn's `tool_calls` (their `arguments` as objects, as templates
    index them), a tool turn's `tool_call_id` (required) and `name`."""
    if entry["role"] == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"messages[{i}].tool_call_id must be the id of the call this "
                              "tool message answers", "messages")
        entry["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
    calls = message.get("tool_calls")
    if entry["role"] != "assistant" or calls is None:
        return entry
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list of calls", "messages")
    entry["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(calls)]
    return entry


def _template_call(i: int, j: int, call: object) -> JSON:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must be {{id, type: function, function: {{name, arguments}}}}",
                          "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object's text", "messages")
    return {"id": call.get("id"), "type": "function",  # type: ignore[union-attr]
            "function": {"name": fn["name"], "arguments": args}}


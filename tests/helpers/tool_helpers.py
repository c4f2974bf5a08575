"""What the tool-calling tests share (tests/serving/test_tools.py, test_serve.py,
test_serve_tools.py): the tools chat template the tests ship, tools whose arguments are short and
bounded, the truth check of a response's calls (each
call's arguments validated by `jsonschema` against its function's schema), and a stream
reassembled as a client does it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "smollm2_tools.jinja"
# serve.py's tool options, as an agent deployment gives them
TOOL_ARGS = ("--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["hour"],
        "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                       "zone": {"type": "string", "maxLength": 6}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                           "description": "What time it is in a zone"}}]
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


def check_calls(choice: Any, names: Iterable[str] = SCHEMAS,
                content: str | None = None) -> list[tuple[str, str]]:
    """A non-streamed choice that made calls: finish_reason "tool_calls", `content` (null by
    default), and every call a function of `names` whose arguments parse and validate against
    its schema. Returns [(name, arguments)]."""
    import jsonschema

    msg = choice.message
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, msg)
    assert msg.tool_calls and msg.content == content, msg
    out = []
    for call in msg.tool_calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        assert call.function.name in set(names), call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        out.append((call.function.name, call.function.arguments))
    assert len({c.id for c in msg.tool_calls}) == len(out)
    return out


def reassemble(chunks: Iterable[Any]) -> dict[int, dict[str, Any]]:
    """Each choice of a chat stream (openai chunk objects) as a client accumulates it: its
    content, reasoning_content, finish_reason and calls [(name, arguments)]. A call's first
    delta must carry its index, id, type and name (arguments empty), before any argument
    piece, and only its first."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            acc = out.setdefault(c.index, {"content": "", "reasoning": "", "calls": {},
                                           "finish_reason": None})
            acc["content"] += c.delta.content or ""
            acc["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            for t in c.delta.tool_calls or []:
                if t.index not in acc["calls"]:
                    assert t.id and t.type == "function" and t.function.name, t
                    assert not t.function.arguments, t
                    acc["calls"][t.index] = [t.function.name, ""]
                else:
                    assert t.id is None and t.function.name is None, t
                acc["calls"][t.index][1] += t.function.arguments or ""
            if c.finish_reason is not None:
                assert acc["finish_reason"] is None
                acc["finish_reason"] = c.finish_reason
    for acc in out.values():
        acc["calls"] = [tuple(v) for _, v in sorted(acc["calls"].items())]
    return out


def as_reassembled(choice: Any) -> dict[str, Any]:
    """A non-streamed choice in `reassemble`'s shape."""
    msg = choice.message
    return {"content": msg.content or "", "reasoning": getattr(msg, "reasoning_content", None) or "",
            "calls": [(t.function.name, t.function.arguments) for t in msg.tool_calls or []],
            "finish_reason": choice.finish_reason}

"""Hostile request bodies shared by test_serve_hostile.py (parsed in-process) and test_serve.py
(sent to the server): each with the top-level field its 400 must name."""
from __future__ import annotations

MAX_BODY = 8 * 1024 * 1024  # the default --max-body-bytes
LEAKS = ("Error:", "Traceback", "TypeError", "ValueError", "RecursionError", "OverflowError",
         "Exceeds the limit", "TextEncodeInput", "injected")
DEEP = 100_000


def no_leak(text: str) -> None:
    for needle in LEAKS:
        assert needle not in text, (needle, text[:300])


def nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


DIGITS = b"9" * 5001  # more than int() converts
_HI = b'{"messages": [{"role": "user", "content": "hi"}]'  # a chat body, its closing brace left off
_F = b'{"type": "function", "function": {"name": "f"}}'  # a good tool
BAD_BODIES = [  # (raw body, chat?, the field the 400 names)
    (rb'{"prompt": "\ud800 hi", "max_tokens": 2}', False, "prompt"),
    (b'{"prompt": "\xed\xa0\x80 hi"}', False, "prompt"),  # the UTF-8 bytes of a surrogate
    (rb'{"messages": [{"role": "user", "content": "\udc00"}]}', True, "messages"),
    (rb'{"model": "\ud800", "prompt": [1]}', False, "model"),
    (rb'{"prompt": [1], "stop": ["ok", "\udfff"]}', False, "stop"),
    (rb'{"prompt": [1], "logit_bias": {"\ud800": 1}}', False, "logit_bias"),
    (rb'{"prompt": [1], "user": "\ud800"}', False, "user"),
    (b'{"prompt": [1], "max_tokens": ' + DIGITS + b"}", False, "max_tokens"),
    (b'{"prompt": [1, ' + DIGITS + b"]}", False, "prompt"),
    (b'{"prompt": [1], "seed": -' + DIGITS + b"}", False, "seed"),
    (b'{"prompt": [1], "logit_bias": {"1": ' + DIGITS + b"}}", False, "logit_bias"),
    (b'{"prompt": [1], "logit_bias": {"1": ' + b"9" * 400 + b"}}", False, "logit_bias"),
    (b'{"prompt": [1], "temperature": ' + b"9" * 400 + b"}", False, "temperature"),
    (b'{"model": "m", "prompt": ' + nested(DEEP) + b', "n": 1}', False, "prompt"),
    (b'{"messages": [{"role": "user", "content": ' + nested(DEEP) + b"}]}", True, "messages"),
    (b'{"prompt": [1], "stop": [{"a": ' + nested(5000) + b"}]}", False, "stop"),
    (b'{"prompt": [1], "n": 1000000}', False, "n"),
    # 1032 samples, more than --max-waiting-requests (1024)
    (b'{"prompt": [' + b", ".join([b"[1]"] * 129) + b'], "n": 8}', False, "prompt"),
    # structured outputs: a malformed constraint, or a second one, names its own field
    (b'{"prompt": [1], "response_format": {"type": "json_schema"}}', False, "response_format"),
    (b'{"prompt": [1], "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
     b'"schema": [1]}}}', False, "response_format"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}',
     True, "response_format"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": "json"}', True,
     "response_format"),
    (b'{"prompt": [1], "structured_outputs": {"regex": "a", "choice": ["a"]}}', False,
     "structured_outputs"),
    (b'{"prompt": [1], "structured_outputs": {"pattern": "a"}}', False, "structured_outputs"),
    (b'{"prompt": [1], "structured_outputs": {"json_object": true, "disable_any_whitespace": 1}}',
     False, "structured_outputs"),
    (b'{"prompt": [1], "structured_outputs": "json"}', False, "structured_outputs"),
    (b'{"prompt": [1], "guided_json": "{not json"}', False, "guided_json"),
    (b'{"prompt": [1], "guided_json": [1]}', False, "guided_json"),
    (b'{"prompt": [1], "guided_regex": 5}', False, "guided_regex"),
    (b'{"prompt": [1], "guided_choice": []}', False, "guided_choice"),
    (b'{"prompt": [1], "guided_choice": "yes"}', False, "guided_choice"),
    (b'{"prompt": [1], "guided_grammar": ""}', False, "guided_grammar"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
     b'"json_object"}, "guided_regex": "a+"}', True, "guided_regex"),
    (b'{"prompt": [1], "guided_choice": ["a"], "structured_outputs": {"regex": "a"}}', False,
     "structured_outputs"),
    # tool calling: a bad tool, tool_choice or tool message names its field (before tokenizing)
    (_HI + b', "tools": {"name": "f"}}', True, "tools"),
    (_HI + b', "tools": [{"type": "function", "function": {"parameters": {}}}]}', True, "tools"),
    (_HI + b', "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}',
     True, "tools"),
    (_HI + b', "tools": [{"type": "function", "function": {"name": "f", "parameters": '
     b'{"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}]}', True, "tools"),
    (_HI + b', "tools": [' + _F + b'], "tool_choice": {"type": "function", "function": '
     b'{"name": "g"}}}', True, "tool_choice"),
    (_HI + b', "tools": [' + _F + b'], "tool_choice": "always"}', True, "tool_choice"),
    (_HI + b', "tool_choice": "required"}', True, "tool_choice"),
    (_HI + b', "tools": [' + _F + b'], "parallel_tool_calls": 1}', True, "parallel_tool_calls"),
    (_HI + b', "tools": [' + _F + b'], "tool_choice": "required", "response_format": '
     b'{"type": "json_object"}}', True, "response_format"),
    (rb'{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "20C"}]}',
     True, "messages"),
    (rb'{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", '
     rb'"arguments": "{not json"}}]}]}', True, "messages"),
    (_HI + rb', "tools": [{"type": "function", "function": {"name": "\ud800"}}]}', True, "tools"),
    (_HI + b', "tools": [{"type": "function", "function": {"name": "f", "parameters": '
     + nested(DEEP) + b"}}]}", True, "tools"),
    # chat template options: the renderer's own names and flags are not template variables
    (_HI + b', "chat_template_kwargs": {"messages": []}}', True, "chat_template_kwargs"),
    (_HI + b', "chat_template_kwargs": [1]}', True, "chat_template_kwargs"),
    (_HI + b', "continue_final_message": true}', True, "continue_final_message"),
    (_HI + b', "chat_template": "{{ messages }}"}', True, "chat_template"),  # not trusted
]


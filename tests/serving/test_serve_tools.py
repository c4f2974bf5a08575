"""Tool calls on a tiny random-weight model through the official `openai` client: scripts/serve.py
serves a 2-layer random Llama with a byte-level tokenizer (every token one byte, so the grammar
engine steers each character) and the tools template the tests ship. Its outputs are
arbitrary, so only the constraint makes them calls: for "required" and a named function, greedy
and 4 samples at temperature 1, every call's arguments validate against its function's schema
(`jsonschema`), streams reassemble to exactly the non-streamed answers (the same seed), and a
second turn carrying the tool's result is served. (test_serve.py does the same on SmolLM2.)"""
from __future__ import annotations

from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("jsonschema")

from server_helpers import API_KEY, ServerProcess  # noqa: E402
from tool_helpers import (SCHEMAS, TOOL_ARGS, TOOLS, WEATHER_CHOICE, as_reassembled,  # noqa: E402
                          check_calls, reassemble)
from tiny_configs import save_byte_tokenizer  # noqa: E402

MODEL = "tiny-tools"
# the template's prompt with both tools is ~1,100 byte tokens: a longer context, prefilled in
# 512-token steps
ARGS = ("--max-num-seqs", "8", "--max-model-len", "2048", "--max-num-batched-tokens", "512",
        "--num-kv-blocks", "1100", "--served-model-name", MODEL, "--api-key", API_KEY)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, make_tiny_llama: Any) -> Iterator[Any]:
    out = make_tiny_llama(tmp_path_factory.mktemp("tools_llama"), seed=5, vocab_size=259)
    save_byte_tokenizer(out)
    srv = ServerProcess("--model", str(out), *ARGS, *TOOL_ARGS)
    try:
        yield openai.OpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0, timeout=180)
        assert "Traceback" not in srv.stderr()
    finally:
        srv.close()


@pytest.mark.parametrize("choice,parallel", [("required", False), ("required", True),
                                             (WEATHER_CHOICE, True)])
def test_constrained_calls_of_a_random_model(client: Any, choice: Any, parallel: bool) -> None:
    """Greedy and 4 seeded samples at temperature 1: each a call (one when not parallel, the
    named one when named) of valid arguments, finish_reason "tool_calls"; each streamed the same
    (same seed) reassembles to exactly its non-streamed answer."""
    names = ["get_weather"] if isinstance(choice, dict) else SCHEMAS
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
              parallel_tool_calls=parallel, max_tokens=400)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "n": 4, "seed": 3}):
        got = client.chat.completions.create(**kw, **sampling)
        for c in got.choices:
            calls = check_calls(c, names)
            assert parallel or len(calls) == 1
        streamed = reassemble(client.chat.completions.create(**kw, **sampling, stream=True))
        assert streamed == {c.index: as_reassembled(c) for c in got.choices}


def test_second_turn_with_the_tool_result(client: Any) -> None:
    """The call and its result go back (the prompt, one token a byte, grows by at least their
    bytes); the named choice's answer is again a valid call."""
    kw = dict(model=MODEL, tools=TOOLS, tool_choice=WEATHER_CHOICE, temperature=0, max_tokens=200)
    first = client.chat.completions.create(messages=ASK, **kw)
    check_calls(first.choices[0], ["get_weather"])
    call = first.choices[0].message.tool_calls[0]
    turn = [*ASK, first.choices[0].message,
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(messages=turn, **kw)
    check_calls(second.choices[0], ["get_weather"])
    grown = len(call.function.arguments.encode()) + len(b"sunny")
    assert second.usage.prompt_tokens >= first.usage.prompt_tokens + grown

"""scripts/serve.py with the embedded model, through the official `openai` client and raw HTTP:
answers equal the in-process engine's (`LLM.generate` / `LLM.chat` with the server's engine
options, truth.py), usage counts equal its prompt and output token ids, structured outputs
(response_format json_schema, guided_regex) are valid for their constraint, 32 concurrent streams
equal the same requests served alone, bad input gets OpenAI's error shapes, a disconnect frees the
request's KV blocks, and SIGTERM ends in-flight streams and the process cleanly. Then hostile
bodies over HTTP (test_serve_hostile.py has them in-process): big bodies never stall a running
stream (over --max-body-bytes: 413 before it is parsed; a prompt string too long in characters:
400 before it is tokenized), a bad string or number is a 400 naming its field, never a 500, no
error body carries Python exception text, and a request the engine can never admit is a 400.
The server runs with the tool options (tool_helpers.TOOL_ARGS: the tools template the tests
ship, which renders a conversation without tools exactly as SmolLM2's own, so the chat answers
still equal the in-process engine's; auto tool choice with the hermes parser; the qwen3
reasoning parser): tool calls for "required" and named choices validate against their schemas,
"auto" parses the output, reasoning is split, and streams reassemble to the non-streamed
answers. One server for the module (tests run in file order; the last one stops it)."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import threading
import time
from typing import Any, Iterable, Iterator

import pytest

openai = pytest.importorskip("openai")

import truth as engine_truth  # noqa: E402
from hostile_bodies import BAD_BODIES, MAX_BODY, no_leak  # noqa: E402
from server_helpers import (API_KEY, ENGINE_ARGS, RawStream, ServerProcess, auth,  # noqa: E402
                            check_error, engine_options, metric, request, wait_until)
from tool_helpers import (SCHEMAS, TEMPLATE, TOOL_ARGS, TOOLS, WEATHER_CHOICE,  # noqa: E402
                          as_reassembled, check_calls, reassemble)

from minivllm_jax.serving.output_parsers import HermesToolParser  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, there was a"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SUBJECTS = ("cats", "the sea", "Paris", "music", "winter", "robots", "bread", "the moon")
TEMPLATES = ("Write one sentence about {}.", "Three facts about {}:", "A poem about {}:\n",
             "My favourite thing about {} is")
CONCURRENT = [t.format(s) for t in TEMPLATES for s in SUBJECTS]  # 32 prompts
CONCURRENT_TOKENS = 4  # each: a prefill, then 3 steps decoding in a batch
MAX_NUM_SEQS = engine_options()["max_num_seqs"]  # the server's
Truth = dict[str, list[dict[str, Any]]]  # each job's RequestOutputs (truth.as_json)
GREEDY = {"temperature": 0.0}
# logprobs 3, as the chat test's top_logprobs: one sampler program (logprobs bucket 4) for both
SAMPLED = {"n": 3, "temperature": 0.8, "seed": 7, "max_tokens": 8, "logprobs": 3}
JOBS = {
    "chat": {"kind": "chat", "messages": QUESTION, "params": {**GREEDY, "max_tokens": 24}},
    "chat_logprobs": {"kind": "chat", "messages": QUESTION,
                      "params": {**GREEDY, "max_tokens": 6, "logprobs": 3}},
    "completions": {"kind": "generate", "prompts": PROMPTS, "params": {**GREEDY, "max_tokens": 16}},
    "sampled": {"kind": "generate", "prompts": PROMPTS[:1], "params": SAMPLED},
    "alone": {"kind": "alone", "prompts": CONCURRENT,
              "params": {**GREEDY, "max_tokens": CONCURRENT_TOKENS}},
}


@pytest.fixture(scope="module")
def server_and_truth(loaded_model: Any) -> Iterator[tuple[ServerProcess, Truth]]:
    """The module's server and each job's RequestOutputs from the in-process engine (truth.py,
    in this process). The server starts first: it imports and loads its model (the param cache
    `loaded_model` filled) while the truth is computed, and it compiles nothing before its first
    request, so each program the truth needs is compiled once, by the truth, and the server
    loads it (the shared compile cache)."""
    srv = ServerProcess(*ENGINE_ARGS, "--api-key", API_KEY, *TOOL_ARGS, wait=False)
    try:
        answers = engine_truth.answers(loaded_model, engine_options(), JOBS)
        srv.wait_ready()
        yield srv, answers
    finally:
        srv.close()


@pytest.fixture(scope="module")
def truth(server_and_truth: tuple[ServerProcess, Truth]) -> Truth:
    return server_and_truth[1]


@pytest.fixture(scope="module")
def server(server_and_truth: tuple[ServerProcess, Truth]) -> ServerProcess:
    return server_and_truth[0]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def kv_idle(server: ServerProcess) -> dict[str, Any]:
    status, health = request(server.port, "GET", "/health")
    assert status == 200, health
    return health


def test_models_health_and_auth(server: ServerProcess, client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = kv_idle(server)
    assert health["status"] == "ok" and health["num_free_kv_blocks"] == health["num_kv_blocks"] - 1
    for headers in ({}, auth("wrong-key")):
        status, body = request(server.port, "GET", "/v1/models", headers=headers)
        assert status == 401 and check_error(body)["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["param"] == "model"
    assert request(server.port, "GET", "/metrics")[0] == 200  # /health and /metrics need no key


def test_chat_answers_paris(client: Any, truth: dict[str, Any]) -> None:
    want = truth["chat"][0]
    got = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in got.choices[0].message.content
    assert got.choices[0].message.content == want["outputs"][0]["text"]
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == want["outputs"][0]["finish_reason"]
    prompt, completion = len(want["prompt_token_ids"]), len(want["outputs"][0]["token_ids"])
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        prompt, completion, prompt + completion)
    assert got.object == "chat.completion" and got.model == MODEL and got.id.startswith("chatcmpl-")


def test_completions_equal_generate(client: Any, truth: dict[str, Any]) -> None:
    want = truth["completions"]
    got = client.completions.create(model=MODEL, prompt=PROMPTS, temperature=0, max_tokens=16)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w["outputs"][0]["text"] for w in want]
    assert [c.finish_reason for c in got.choices] == [w["outputs"][0]["finish_reason"] for w in want]
    assert got.usage.prompt_tokens == sum(len(w["prompt_token_ids"]) for w in want)
    assert got.usage.completion_tokens == sum(len(w["outputs"][0]["token_ids"]) for w in want)
    # token-id prompts are the same requests
    ids = client.completions.create(model=MODEL, prompt=[w["prompt_token_ids"] for w in want],
                                    temperature=0, max_tokens=16)
    assert [c.text for c in ids.choices] == [c.text for c in got.choices]


def test_stream_equals_non_stream(client: Any) -> None:
    for kind in ("chat", "completion"):
        if kind == "chat":
            kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)  # ends (EOS) after 8
            create, text_of = client.chat.completions.create, lambda c: c.message.content
            piece_of = lambda c: c.delta.content or ""  # noqa: E731
        else:
            kw = dict(model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=12)
            create, text_of, piece_of = client.completions.create, lambda c: c.text, lambda c: c.text
        full = create(**kw)
        chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
        assert "".join(piece_of(c.choices[0]) for c in chunks if c.choices) == text_of(full.choices[0])
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == [full.choices[0].finish_reason]
        assert not chunks[-1].choices and chunks[-1].usage.model_dump() == full.usage.model_dump()
        assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_stop_strings(client: Any, truth: dict[str, Any]) -> None:
    """A stop string cut from the greedy text ends the completion just before it."""
    text = truth["completions"][2]["outputs"][0]["text"]
    stop = next(w for w in text.split()[2:] if len(w) > 2)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=16,
                                    stop=[stop, "never-in-the-output"])
    assert got.choices[0].text == text[:text.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=0,
                                         max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text


def ranked(position: dict[str, list[Any]], k: int) -> list[list[Any]]:
    """truth.py's logprobs of one position: the top-k [logprob, rank, text] by rank."""
    return sorted((v for v in position.values() if v[1] <= k), key=lambda v: v[1])


def test_n_and_logprobs(client: Any, truth: dict[str, Any]) -> None:
    want = truth["sampled"][0]["outputs"]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], **SAMPLED)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert got.usage.completion_tokens == sum(len(w["token_ids"]) for w in want)
    for c, w in zip(got.choices, want):
        assert c.text == w["text"]
        chosen = [pos[str(t)] for t, pos in zip(w["token_ids"], w["logprobs"])]
        assert c.logprobs.tokens == [lp[2] for lp in chosen]
        assert c.logprobs.token_logprobs == pytest.approx([lp[0] for lp in chosen], abs=1e-4)
        for top, pos in zip(c.logprobs.top_logprobs, w["logprobs"]):
            assert list(top) == [v[2] for v in ranked(pos, SAMPLED["logprobs"])]
    # chat, greedy: each token is its own top-1 alternative
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                          max_tokens=6, logprobs=True, top_logprobs=3)
    ref = truth["chat_logprobs"][0]["outputs"][0]
    content = chat.choices[0].logprobs.content
    assert len(content) == len(ref["token_ids"])
    for entry, tid, pos in zip(content, ref["token_ids"], ref["logprobs"]):
        assert [t.token for t in entry.top_logprobs] == [v[2] for v in ranked(pos, 3)]
        assert entry.top_logprobs[0].token == entry.token == pos[str(tid)][2]
        assert entry.logprob == pytest.approx(pos[str(tid)][0], abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


# short outputs: bounded string, enum, bounded integer; compact JSON (no whitespace outside strings)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}}}
PHONE = r"[0-9]{3}-[0-9]{4}"


def test_structured_outputs(server: ServerProcess, client: Any) -> None:
    """response_format json_schema (4 samples at temperature 1, and greedy) and guided_regex:
    every output that stopped is valid for its constraint; a constraint that does not compile
    is a 400 naming the field the request gave it in, before anything runs."""
    import jsonschema

    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    sampled = client.chat.completions.create(model=MODEL, messages=ask, response_format=person,
                                             temperature=1.0, n=4, seed=3, max_tokens=48)
    greedy = client.chat.completions.create(model=MODEL, messages=ask, response_format=person,
                                            temperature=0, max_tokens=48)
    stopped = [c for c in [*sampled.choices, *greedy.choices] if c.finish_reason == "stop"]
    assert len(stopped) >= 3, [(c.finish_reason, c.message.content) for c in sampled.choices]
    for c in stopped:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, n=2,
                                      temperature=1.0, seed=1, extra_body={"guided_regex": PHONE})
    assert all(c.finish_reason == "stop" and re.fullmatch(PHONE, c.text) for c in phone.choices), \
        [c.text for c in phone.choices]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    for kw, param in (({"response_format": bad_schema}, "response_format"),
                      ({"extra_body": {"guided_regex": "a{5,2}"}}, "guided_regex"),
                      ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
        assert e.value.body["message"].startswith(param) and "cannot be compiled" in e.value.body["message"]
    assert kv_idle(server)["num_free_kv_blocks"] == kv_idle(server)["num_kv_blocks"] - 1


# ---- tool calling and reasoning (docs/API.md §4a) ---------------------------------------------
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris? Call a tool."}]


def test_required_and_named_tool_calls(client: Any) -> None:
    """tool_choice "required" and a named function, greedy and 4 samples at temperature 1
    (parallel_tool_calls false: test_serve_tools.py): every call's arguments parse and validate against its function's
    schema (jsonschema), its name is a tool's (the named one's), finish_reason is "tool_calls",
    content null; the greedy stream reassembles to exactly the non-streamed answer."""
    for choice, parallel, names in (("required", True, SCHEMAS),
                                    (WEATHER_CHOICE, True, ["get_weather"])):
        kw = dict(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice=choice,
                  parallel_tool_calls=parallel, max_tokens=96)
        greedy = client.chat.completions.create(**kw, temperature=0)
        sampled = client.chat.completions.create(**kw, temperature=1.0, n=4, seed=11)
        for c in [*greedy.choices, *sampled.choices]:
            calls = check_calls(c, names)
            assert parallel or len(calls) == 1
        streamed = reassemble(client.chat.completions.create(**kw, temperature=0, stream=True))
        assert streamed == {0: as_reassembled(greedy.choices[0])}


def test_second_turn_with_the_tool_result(client: Any, tokenizer: Any) -> None:
    """The assistant's message (as the client returned it) and the tool's result go back: the
    server renders them through the template, its prompt as many tokens as the template makes of
    the conversation here, and answers."""
    kw = dict(model=MODEL, tools=TOOLS, temperature=0)
    first = client.chat.completions.create(messages=WEATHER_ASK, tool_choice=WEATHER_CHOICE,
                                           max_tokens=48, **kw)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    turn = [*WEATHER_ASK, first.choices[0].message,
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    second = client.chat.completions.create(messages=turn, max_tokens=8, **kw)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    conversation = [*WEATHER_ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        turn[2]]
    want = tokenizer.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True,
                                         chat_template=TEMPLATE.read_text(), tokenize=False)
    assert "sunny, 21 degrees" in want and json.dumps(json.loads(call.function.arguments)) in want
    assert second.usage.prompt_tokens == len(tokenizer(want, add_special_tokens=False)["input_ids"])


def test_auto_tool_choice_parses_the_output(client: Any) -> None:
    """"auto" (this server's default with tools): its message is the hermes parser's split of the
    free output ("none" on the same prompt gives that output as content); outputs forced by
    guided_choice: a call, text before a call, malformed JSON left as text; the stream of the
    text before a call reassembles to its non-streamed answer (test_tools.py streams every
    case in-process)."""
    kw = dict(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, temperature=0, max_tokens=48)
    free = dict(kw, max_tokens=24)  # SmolLM2's own output: whatever it is, the parser's split
    raw = client.chat.completions.create(**free, tool_choice="none").choices[0]
    auto = client.chat.completions.create(**free).choices[0]
    want = HermesToolParser().parse(raw.message.content or "")
    assert auto.message.content == want.content
    assert [(t.function.name, t.function.arguments) for t in auto.message.tool_calls or []] == \
        [(c.name, c.arguments) for c in want.tool_calls]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    for text, content, calls in ((call, None, True), ("Let me check. " + call, "Let me check. ", True),
                                 (bad, bad, False)):
        forced = dict(kw, extra_body={"guided_choice": [text]})
        got = client.chat.completions.create(**forced).choices[0]
        assert got.message.content == content, got.message
        if calls:  # arguments: the parsed object's json.dumps
            assert check_calls(got, content=content) == [
                ("get_weather", json.dumps({"city": "Oslo", "unit": "celsius"}))]
        else:
            assert got.finish_reason == "stop" and not got.message.tool_calls
        if content and calls:
            streamed = reassemble(client.chat.completions.create(**forced, stream=True))
            assert streamed == {0: as_reassembled(got)}


def test_reasoning_is_split_from_the_answer(client: Any) -> None:
    """Outputs forced to think first (guided_regex; SmolLM2 does not think on its own): the text
    inside <think> is reasoning_content, the rest content, together the output the regex
    matched; a call after the thinking is parsed from the answer; streamed equals whole."""
    think = r"<think>[a-z ]{1,20}</think>[A-Za-z][A-Za-z ]{0,19}"
    kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=48,
              extra_body={"guided_regex": think})
    got = client.chat.completions.create(**kw).choices[0]
    reasoning, content = got.message.reasoning_content, got.message.content
    assert got.finish_reason == "stop" and reasoning and content
    assert re.fullmatch(think, f"<think>{reasoning}</think>{content}"), (reasoning, content)
    assert reassemble(client.chat.completions.create(**kw, stream=True)) == {0: as_reassembled(got)}
    then_call = (r'<think>[a-z ]{1,12}</think><tool_call>\{"name": "get_time", "arguments": '
                 r'\{"hour": [0-9]\}\}</tool_call>')
    kw = dict(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, temperature=0, max_tokens=64,
              extra_body={"guided_regex": then_call})
    got = client.chat.completions.create(**kw).choices[0]
    assert re.fullmatch("[a-z ]{1,12}", got.message.reasoning_content)
    assert [name for name, _ in check_calls(got)] == ["get_time"]
    assert reassemble(client.chat.completions.create(**kw, stream=True)) == {0: as_reassembled(got)}


def test_tool_schemas_the_grammar_engine_refuses_are_400s(server: ServerProcess, client: Any) -> None:
    """A parameters schema the grammar engine cannot compile (a lookahead, which its regexes
    lack) is a 400 naming `tools` whatever the tool_choice, before anything runs; the server
    serves on with every KV block free."""
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)b"}}}}}]
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=bad,
                                           tool_choice=choice, max_tokens=4)
        assert e.value.body["param"] == "tools" and e.value.body["message"].startswith("tools"), \
            e.value.body
    assert kv_idle(server)["num_free_kv_blocks"] == kv_idle(server)["num_kv_blocks"] - 1


def test_bad_requests(server: ServerProcess) -> None:
    """Each bad request is a 400 naming its field, and the server keeps serving."""
    port, h = server.port, auth()
    status, body = request(port, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens":', h)
    assert status == 400 and check_error(body)["code"] == "invalid_json"
    cases = [
        ({"prompt": "Hi", "temperature": -1}, "temperature"),
        ({"prompt": "Hi", "top_p": "high"}, "top_p"),
        ({"prompt": "Hi", "n": 0}, "n"),
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "Hi", "max_tokens": 600}, "max_tokens"),
        ({"prompt": [1] * 600, "max_tokens": 4}, "prompt"),
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": "Hi", "logit_bias": {"999999": 5}}, "logit_bias"),
        ({"prompt": "Hi", "priority": 3}, "priority"),  # this server schedules fcfs
        ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "Hi", "presence_penalty": 3.0}, "presence_penalty"),
        ({"prompt": "Hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ]
    for body_in, param in cases:
        status, body = request(port, "POST", "/v1/completions", {"model": MODEL, **body_in}, h)
        assert status == 400, (body_in, body)
        check_error(body, param)
    for messages, param in (([], "messages"), ([{"role": "robot", "content": "x"}], "messages")):
        status, body = request(port, "POST", "/v1/chat/completions", {"messages": messages}, h)
        assert status == 400
        check_error(body, param)
    status, body = request(port, "POST", "/v1/chat/completions",
                           {"messages": QUESTION, "max_completion_tokens": 4, "top_logprobs": 2}, h)
    assert status == 400 and check_error(body, "top_logprobs")
    status, body = request(port, "GET", "/v1/nowhere", headers=h)
    assert status == 404 and check_error(body)
    status, body = request(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, h)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert kv_idle(server)["num_free_kv_blocks"] == kv_idle(server)["num_kv_blocks"] - 1


def test_metrics_count_exactly(server: ServerProcess, client: Any) -> None:
    def scrape() -> str:
        status, text = request(server.port, "GET", "/metrics")
        assert status == 200
        return text

    names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
             "vllm:inter_token_latency_seconds_count")
    before = scrape()
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=5)
    after = scrape()
    delta = {n: metric(after, n) - metric(before, n) for n in names}
    assert delta["vllm:prompt_tokens_total"] == got.usage.prompt_tokens
    assert delta["vllm:generation_tokens_total"] == got.usage.completion_tokens == 5
    assert delta["vllm:time_to_first_token_seconds_count"] == 1
    assert delta["vllm:e2e_request_latency_seconds_count"] == 1
    assert delta["vllm:inter_token_latency_seconds_count"] == 4  # one per step after the first
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "minivllm:num_free_kv_blocks"):
        metric(after, name)
    assert metric(after, "vllm:num_requests_running") == 0
    for _ in range(2):  # the second meets the first's prompt blocks in the prefix cache
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=2)
    hits = metric(scrape(), "vllm:prefix_cache_hits_total") - metric(after, "vllm:prefix_cache_hits_total")
    assert hits >= 16  # at least one full block of the chat template's prompt


def test_32_concurrent_streams_equal_alone(server: ServerProcess, truth: dict[str, Any]) -> None:
    """32 streams at once, four times the server's batch (max_num_seqs 8): their prompts are
    prefilled in 8-token chunks, most wait for a slot while others decode in one batch and are
    admitted as those finish; each stream's text equals its request served alone by the
    in-process engine, and every KV block is free afterwards."""
    alone = [w["outputs"][0]["text"] for w in truth["alone"]]

    async def one(aclient: Any, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                  max_tokens=CONCURRENT_TOKENS, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                                     timeout=180)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in CONCURRENT))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == alone
    health = kv_idle(server)
    assert health["num_requests_running"] == health["num_requests_waiting"] == 0
    assert health["num_free_kv_blocks"] == health["num_kv_blocks"] - 1


def test_disconnect_mid_stream_aborts(server: ServerProcess) -> None:
    def running() -> float:
        return metric(request(server.port, "GET", "/metrics")[1], "vllm:num_requests_running")

    stream = RawStream(server.port, "/v1/completions",
                       {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
                        "stream": True})
    events = stream.events()
    for _ in range(3):
        assert next(events) != "[DONE]"
    assert running() == 1
    stream.close()
    assert wait_until(lambda: running() == 0, timeout=3.0) < 2.0
    health = kv_idle(server)
    assert health["num_free_kv_blocks"] == health["num_kv_blocks"] - 1


# ---- hostile bodies over HTTP (test_serve_hostile.py parses them in-process) ----------------
def post(port: int, path: str, body: bytes | Iterable[bytes], timeout: float = 60.0) -> tuple[int, str]:
    """(status, raw response text) of a POST; an iterable body goes chunked (no Content-Length)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        chunked = not isinstance(body, bytes)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **auth()},
                     encode_chunked=chunked)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def served(port: int) -> None:
    """The server still answers a normal request."""
    status, body = request(port, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}, auth())
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - start


def idle(port: int) -> dict[str, Any]:
    """/health once no request runs; every KV block (but the null block) is free then."""
    health: dict[str, Any] = {}

    def no_running() -> bool:
        health.update(request(port, "GET", "/health")[1])
        return health["num_requests_running"] == health["num_requests_waiting"] == 0

    wait_until(no_running, timeout=10)
    assert health["status"] == "ok" and health["num_free_kv_blocks"] == health["num_kv_blocks"] - 1
    return health


AFTER = 5  # stream chunks read after the last big body was refused


def test_big_bodies_do_not_stall_streams(server: ServerProcess) -> None:
    """While a stream runs, three big bodies are refused, each within 2 s; the stream's chunks
    keep coming throughout: no gap of 1 s or more between two chunks, from a second before the
    first big body until AFTER chunks after the last refusal. Then the client drops the stream
    (it needs no more tokens to show that): aborted, its KV blocks freed, and the server serves
    on."""
    port = server.port
    stream = RawStream(port, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                                 "max_tokens": 450, "ignore_eos": True,
                                                 "stream": True})
    events: list[tuple[float, str]] = []  # (arrival, data) of each chunk
    end = [float("inf")]  # when the last big body was refused

    def read() -> None:
        for event in stream.events():
            events.append((time.monotonic(), event))
            if sum(t > end[0] for t, _ in events) >= AFTER:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while len(events) < 3:
        assert reader.is_alive()
        time.sleep(0.01)
    start = time.monotonic()
    # (a) 10 MB with a Content-Length: refused unread
    (status, text), took = timed(post, port, "/v1/completions",
                                 json.dumps({"model": MODEL, "prompt": "a " * 5_000_000}).encode())
    assert status == 413 and check_error(json.loads(text))["code"] == "request_too_large"
    assert took < 2.0, took
    # the same, chunked (no Content-Length): refused once 8 MiB were read
    (status, text), took = timed(post, port, "/v1/completions", (b"a" * 65536 for _ in range(200)))
    assert status == 413 and check_error(json.loads(text))["code"] == "request_too_large"
    assert took < 2.0, took
    # (b) just under the limit, one prompt string far too long to fit: refused untokenized
    head, tail = b'{"model": "%s", "max_tokens": 4, "prompt": "' % MODEL.encode(), b'"}'
    body = head + b"a " * ((MAX_BODY - 1 - len(head) - len(tail)) // 2) + tail
    assert MAX_BODY - 2 <= len(body) < MAX_BODY
    (status, text), took = timed(post, port, "/v1/completions", body)
    assert status == 400, text
    assert check_error(json.loads(text), "prompt")["code"] == "context_length_exceeded"
    assert took < 2.0, took
    end[0] = time.monotonic()
    reader.join(timeout=120)
    assert not reader.is_alive()
    stream.close()
    data = [e for _, e in events]  # no error chunk, and still running when dropped
    assert "[DONE]" not in data and not any('"error"' in e for e in data), data[-2:]
    arrivals = [t for t, _ in events]
    assert arrivals[-1] > end[0], "the stream ended before the big bodies were refused"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > start - 1.0]
    assert max(gaps) < 1.0, (max(gaps), end[0] - start)
    idle(port)
    served(port)


# constraints a hostile client sends (tests/structured_output/test_structured_outputs.py has more,
# offline): (request fields, the param of the 400, words of its message)
DEEP_LARK = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(3000)) + 'r3000: "y"\n'
SELF_REF = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                            "required": ["x"]}}, "$ref": "#/$defs/a"}
HOSTILE_CONSTRAINTS = [
    ({"guided_grammar": DEEP_LARK}, "guided_grammar", "crashed"),  # the library's segfault
    ({"guided_json": SELF_REF}, "guided_json", "admits no finite value"),
    ({"guided_regex": r"[^\s\S]"}, "guided_regex", "admits no complete output"),
    ({"structured_outputs": {"grammar": 'start: <[2]> "a"'}}, "structured_outputs",
     "end-of-sequence token inside"),
    ({"guided_regex": "a{1000000}"}, "guided_regex", "exceeds a limit"),
    ({"stop": [f"s{i:06d}" for i in range(300_000)]}, "stop", "at most 64 strings"),
]


def test_hostile_constraints_never_crash_fail_or_stall_the_server(server: ServerProcess) -> None:
    """While a greedy stream runs, hostile constraints (HOSTILE_CONSTRAINTS, one crashing the
    grammar library in its worker process, and 1e999 in a response_format's schema) are 400s
    naming the request's field; 4,000 choices with n=6 at temperature 1 and 20 requests with
    constraints of their own are served, every output one of its choices; the stream's chunks
    keep coming, no gap of 1 s or more; the server serves on with every KV block free."""
    port = server.port
    stream = RawStream(port, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                                 "max_tokens": 450, "ignore_eos": True, "stream": True})
    arrivals: list[float] = []
    done = threading.Event()

    def read() -> None:
        for _ in stream.events():
            arrivals.append(time.monotonic())
            if done.is_set():
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while len(arrivals) < 3:
        assert reader.is_alive()
        time.sleep(0.01)
    start = time.monotonic()
    base = {"model": MODEL, "prompt": "Pick one:", "max_tokens": 8}
    for fields, param, words in HOSTILE_CONSTRAINTS:
        status, text = post(port, "/v1/completions", json.dumps({**base, **fields}).encode())
        error = check_error(json.loads(text), param)
        assert status == 400 and words in error["message"], (param, status, text[:300])
    # a number JSON cannot carry: json.dumps cannot write 1e999, so the body is written by hand
    raw = json.dumps({**base, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"const": 0}}}}).replace('"const": 0', '"const": 1e999').encode()
    status, text = post(port, "/v1/completions", raw)
    assert status == 400 and "cannot carry" in check_error(json.loads(text), "response_format")["message"]
    assert server.proc.poll() is None
    choices = [f"option {i}" for i in range(4000)]
    served_ok: list[bool] = []

    def choose(fields: dict[str, Any], allowed: list[str]) -> None:
        status, body = request(port, "POST", "/v1/completions", {**base, **fields}, auth())
        served_ok.append(status == 200 and all(
            c["finish_reason"] == "stop" and c["text"] in allowed for c in body["choices"]))

    jobs = [threading.Thread(target=choose, args=({"guided_choice": choices, "n": 6,
                                                    "temperature": 1.0, "seed": 5}, choices))]
    jobs += [threading.Thread(target=choose, args=({"guided_choice": [f"x{i}", f"y{i}"],
                                                    "temperature": 1.0, "seed": i}, [f"x{i}", f"y{i}"]))
             for i in range(20)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=180)
    assert served_ok == [True] * len(jobs)
    end = time.monotonic()
    done.set()
    reader.join(timeout=60)
    stream.close()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if start - 1.0 < b <= end]
    assert arrivals[-1] > end - 1.0 and max(gaps) < 1.0, (max(gaps), end - start)
    idle(port)
    served(port)


def test_bad_bodies_over_http_are_400s(server: ServerProcess) -> None:
    port = server.port
    for raw, chat, param in BAD_BODIES:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, text = post(port, path, raw)
        assert status == 400, (raw[:80], text[:300])
        check_error(json.loads(text), param)
        no_leak(text)
    served(port)
    assert "Traceback" not in server.stderr()  # nothing reached the 500 handler


def test_lone_surrogate_prompt_is_400_not_500(server: ServerProcess) -> None:
    """What a client sends: a JSON-escaped lone surrogate (the tokenizer cannot take it)."""
    for path, body, param in (
            ("/v1/completions", {"model": MODEL, "prompt": "\ud800 hi", "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udbff"}]},
             "messages"),
            ("/v1/completions", {"model": "\ud800", "prompt": "hi"}, "model")):
        status, out = request(port := server.port, "POST", path, body, auth())
        assert status == 400, out
        no_leak(json.dumps(check_error(out, param)))
    served(port)
    assert "Traceback" not in server.stderr()


def test_n_that_can_never_be_admitted_is_400(server: ServerProcess) -> None:
    """n over the waiting room is a 400 (it could never be admitted), not a 503; n over
    --max-num-seqs is served, its samples in waves, as vLLM's are."""
    status, body = request(server.port, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "Hi", "n": 1_000_000, "max_tokens": 2}, auth())
    assert status == 400 and "may wait" in check_error(body, "n")["message"], body
    status, body = request(server.port, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "Hi", "n": MAX_NUM_SEQS + 2, "max_tokens": 1},
                           auth())
    assert status == 200 and sorted(c["index"] for c in body["choices"]) == list(range(MAX_NUM_SEQS + 2))


def test_long_prompt_that_fits_is_served(server: ServerProcess) -> None:
    """32,000 characters of SmolLM2's longest tokens (up to 80 characters each) fit 512 tokens:
    served, not refused for its length in characters."""
    status, body = request(server.port, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "#" * 32_000, "max_tokens": 2}, auth())
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] <= 510


# every SamplingParams field as a request field, fed hostile values (json.dumps writes NaN and
# Infinity, which the server's decoder reads)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                   "stop_token_ids", "ignore_eos", "seed", "stop", "include_stop_str_in_output",
                   "logit_bias", "n", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logprobs", "prompt_logprobs")
EXTREMES = (2**31, 2**63, -2**63 - 1, -1, 10**30, float("nan"), float("inf"), -float("inf"),
            1e-300, 1e300, [2**31], {"2147483648": 1}, {"5": float("inf")}, "x")


def test_extreme_sampling_values_are_400s_naming_the_field_or_served(server: ServerProcess) -> None:
    """The critical one first (top_k 2**31 once killed the engine for everyone); then every
    sampling field with every extreme value: a 400 naming that field, or a served answer, never
    another status; the server answers normally after each refusal."""
    port = server.port
    status, body = request(port, "POST", "/v1/completions",
                           {"prompt": "hi", "max_tokens": 2, "top_k": 2147483648}, auth())
    assert status == 400 and "top_k" in check_error(body, "top_k")["message"]
    served(port)
    answered = refused = 0
    for field in SAMPLING_FIELDS:
        for value in EXTREMES:
            body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value})
            status, text = post(port, "/v1/completions", body.encode())
            if status == 200:
                answered += 1
                continue
            assert status == 400, (field, value, text[:300])
            check_error(json.loads(text), field)
            no_leak(text)
            refused += 1
        served(port)
    assert refused > 150 and answered > 5
    idle(port)
    assert "Traceback" not in server.stderr()


def test_sigterm_ends_streams_and_exits(server: ServerProcess) -> None:
    """Last: stops the module's server."""
    stream = RawStream(server.port, "/v1/chat/completions",
                       {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True,
                        "stream": True})
    events = stream.events()
    for _ in range(3):
        assert next(events) != "[DONE]"
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rest = list(events)
    assert time.monotonic() - start < 5.0
    assert rest[-1] == "[DONE]" and '"error"' in rest[-2]  # an error chunk ends the stream
    assert server.stop(timeout=10) == 0 and time.monotonic() - start < 10.0
    assert "Traceback" not in server.stderr()

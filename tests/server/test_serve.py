"""scripts/serve.py with the embedded model, through the official `openai` client and raw HTTP:
answers equal the in-process engine's (`LLM.generate` / `LLM.chat` with the server's engine
options, run by truth.py), usage counts equal its prompt and output token ids, 32 concurrent
streams equal the same requests served alone, bad input gets OpenAI's error shapes, a disconnect
frees the request's KV blocks, and SIGTERM ends in-flight streams and the process cleanly. One
server for the module (tests run in file order; the last one stops it)."""
from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")

from server_helpers import (API_KEY, ENGINE_ARGS, RawStream, ServerProcess, auth,  # noqa: E402
                            check_error, metric, request, wait_until)

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, there was a"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SUBJECTS = ("cats", "the sea", "Paris", "music", "winter", "robots", "bread", "the moon")
TEMPLATES = ("Write one sentence about {}.", "Three facts about {}:", "A poem about {}:\n",
             "My favourite thing about {} is")
CONCURRENT = [t.format(s) for t in TEMPLATES for s in SUBJECTS]  # 32 prompts
GREEDY = {"temperature": 0.0}
SAMPLED = {"n": 3, "temperature": 0.8, "seed": 7, "max_tokens": 8, "logprobs": 2}
JOBS = {
    "chat": {"kind": "chat", "messages": QUESTION, "params": {**GREEDY, "max_tokens": 24}},
    "chat_logprobs": {"kind": "chat", "messages": QUESTION,
                      "params": {**GREEDY, "max_tokens": 6, "logprobs": 3}},
    "completions": {"kind": "generate", "prompts": PROMPTS, "params": {**GREEDY, "max_tokens": 16}},
    "sampled": {"kind": "generate", "prompts": PROMPTS[:1], "params": SAMPLED},
    "alone": {"kind": "alone", "prompts": CONCURRENT, "params": {**GREEDY, "max_tokens": 8}},
}


@pytest.fixture(scope="module")
def truth() -> dict[str, list[dict[str, Any]]]:
    """Each job's RequestOutputs from the in-process engine (truth.py), computed before the
    server starts so that each program compiles once (the shared compilation cache), and once
    per test session: pytest-xdist workers share it through a locked file next to the session's
    caches (tests/conftest.py)."""
    it = iter(ENGINE_ARGS)
    engine = {flag[2:].replace("-", "_"): int(value) for flag, value in zip(it, it)}
    spec = json.dumps({"engine": engine, "jobs": JOBS}, sort_keys=True)
    root = Path(os.environ["MINIVLLM_JAX_COMPILE_CACHE"]).parent
    root.mkdir(parents=True, exist_ok=True)
    done = root / f"server_truth_{hashlib.sha256(spec.encode()).hexdigest()[:16]}.json"
    with open(root / "server_truth.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            r = subprocess.run([sys.executable, str(Path(__file__).parent / "truth.py")],
                               input=spec, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, r.stderr
            done.write_text(r.stdout)
        return json.loads(done.read_text())


@pytest.fixture(scope="module")
def server(truth: dict[str, Any]) -> Iterator[ServerProcess]:
    srv = ServerProcess(*ENGINE_ARGS, "--api-key", API_KEY)
    try:
        yield srv
    finally:
        srv.close()


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
            kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
            create, text_of = client.chat.completions.create, lambda c: c.message.content
            piece_of = lambda c: c.delta.content or ""  # noqa: E731
        else:
            kw = dict(model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=20)
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
            assert list(top) == [v[2] for v in ranked(pos, 2)]
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
    alone = [w["outputs"][0]["text"] for w in truth["alone"]]

    async def one(aclient: Any, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                  max_tokens=8, stream=True)
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

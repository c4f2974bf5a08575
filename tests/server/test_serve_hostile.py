"""Hostile request bodies: one big body never stalls other streams (over --max-body-bytes: 413
before it is parsed; a prompt string too long in characters: 400 before it is tokenized), a bad
string or number is a 400 naming its top-level field (never a 500), no error body carries Python
exception text, and a request the engine can never admit is a 400, not a 503.

The first tests run in-process on the parsing and error-mapping functions; the rest on one
scripts/serve.py (the embedded model, tests/server's small engine)."""
from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any, Iterable, Iterator

import pytest

pytest.importorskip("fastapi")

from server_helpers import ENGINE_ARGS, RawStream, ServerProcess, check_error, request  # noqa: E402

from minivllm_jax.serving.api import (ServerConfig, api_error, internal_error,  # noqa: E402
                                      read_body)
from minivllm_jax.serving.async_engine import (EngineDeadError, EngineUnavailable,  # noqa: E402
                                               Overloaded, RequestRejected)
from minivllm_jax.serving.body import parse_body  # noqa: E402
from minivllm_jax.serving.protocol import (APIError, ParseContext,  # noqa: E402
                                           chars_per_token_bound, field_param, parse_chat_request,
                                           parse_completion_request)
from scheduler import InvalidFieldError  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
MAX_BODY = 8 * 1024 * 1024  # the default --max-body-bytes
LEAKS = ("Error:", "Traceback", "TypeError", "ValueError", "RecursionError", "OverflowError",
         "Exceeds the limit", "TextEncodeInput", "injected")
DEEP = 100_000


def no_leak(text: str) -> None:
    for needle in LEAKS:
        assert needle not in text, (needle, text[:300])


class NeverEncode:
    """A tokenizer that must not be asked to tokenize."""

    chat_template = "{{ messages }}"

    def encode(self, text: str) -> list[int]:
        raise AssertionError(f"tokenized {len(text)} characters")


def ctx(**kw: Any) -> ParseContext:
    return ParseContext(**{"model_name": MODEL, "max_model_len": 512, "tokenizer": None,
                           "max_num_seqs": 32, "max_waiting_samples": 1024, **kw})


def refusal(raw: bytes, chat: bool = False, context: ParseContext | None = None) -> APIError:
    parse = parse_chat_request if chat else parse_completion_request
    with pytest.raises(APIError) as e:
        parse_body(raw, parse, context or ctx())
    no_leak(json.dumps(e.value.body()))
    return e.value


def nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


DIGITS = b"9" * 5001  # more than int() converts
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
    (b'{"prompt": [1], "n": 33}', False, "n"),
    (b'{"prompt": [' + b", ".join([b"[1]"] * 33) + b'], "n": 32}', False, "prompt"),  # 1056 samples
]


@pytest.mark.parametrize("raw,chat,param", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_bodies_are_400s_naming_the_field(raw: bytes, chat: bool, param: str) -> None:
    e = refusal(raw, chat, ctx(tokenizer=NeverEncode()))
    assert (e.status, e.param) == (400, param), e.body()


def test_refusals_name_the_field_of_the_exception() -> None:
    """A SamplingParams or prompt refusal's `param` is its InvalidFieldError's `field` through
    protocol.FIELD_PARAMS (max_tokens: the name the request used), never its message's words."""
    for raw, param in ((b'{"prompt": [1], "max_completion_tokens": 2, "min_tokens": 5}', "min_tokens"),
                       (b'{"prompt": [1], "max_completion_tokens": 0}', "max_completion_tokens"),
                       (b'{"prompt": [1], "max_tokens": 0}', "max_tokens"),
                       (b'{"prompt": [1], "stop_token_ids": [-1]}', "stop_token_ids"),
                       (b'{"prompt": [1], "logit_bias": {"-3": 1}}', "logit_bias"),
                       (b'{"prompt": [[1], [-1]]}', "prompt"),
                       (b'{"prompt": ["ok", ""]}', "prompt"),
                       (b'{"prompt": [[1], {"prompt_token_ids": [1]}]}', "prompt"),
                       (b'{"prompt": "no tokenizer for this"}', "prompt")):
        e = refusal(raw)
        assert (e.status, e.param) == (400, param), (raw, e.body())
    assert [field_param(f, k) for f, k in (("prompt_token_ids", "chat"), ("prompt", "completion"),
                                           ("logprobs", "chat"), ("logprobs", "completion"),
                                           ("sampling_params", "chat"), (None, "chat"))] == \
        ["messages", "prompt", "top_logprobs", "logprobs", None, None]


def test_valid_oddities_still_parse() -> None:
    """A surrogate pair is one character; a big but convertible int where one is allowed is
    fine; nesting the decoder can hold is no error of its own."""
    gen = parse_body(rb'{"prompt": [1, 2], "user": "\ud83d\ude00", "seed": 1234567890123456789}',
                     parse_completion_request, ctx())
    assert gen.user == "\U0001F600" and gen.prompts[0].token_ids == [1, 2]
    assert refusal(b'{"prompt": [1], "stop": ' + nested(50) + b"}").param == "stop"
    assert refusal(b"[" * 5000).param is None and refusal(b'{"prompt": ').code == "invalid_json"


def test_text_that_cannot_fit_is_refused_untokenized() -> None:
    c = ctx(tokenizer=NeverEncode(), chars_per_token=10)  # 5120 characters fit at most
    e = refusal(json.dumps({"prompt": "a " * 2561}).encode(), context=c)
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")
    e = refusal(json.dumps({"prompt": ["ok", "x" * 5121]}).encode(), context=c)
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")
    messages = [{"role": "user", "content": "x" * 3000}, {"role": "assistant", "content": "y" * 3000}]
    e = refusal(json.dumps({"messages": messages}).encode(), chat=True, context=c)
    assert (e.param, e.code) == ("messages", "context_length_exceeded")
    e = refusal(json.dumps({"prompt": [7] * 100_000}).encode(), context=c)  # ids: no tokenizer
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")


def tiny_tokenizer(kind: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the cat sat on the mat", "=" * 40, "hello world, hello cats"] * 20
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_chars_per_token_bound_never_refuses_what_fits() -> None:
    bpe = tiny_tokenizer("bpe")
    longest = max(map(len, bpe.get_vocab()))
    assert chars_per_token_bound(bpe) == 2 * longest and longest >= 20
    # WordPiece makes one [UNK] of a word it cannot split, however long: no bound
    assert chars_per_token_bound(tiny_tokenizer("wordpiece")) is None
    assert chars_per_token_bound(None) is None
    for text in ("=" * 40 * 60, "the cat sat on the mat " * 30, "hello world, hello cats"):
        num_tokens = len(bpe.encode(text))  # the tightest context this text fits
        c = ctx(tokenizer=bpe, chars_per_token=chars_per_token_bound(bpe),
                max_model_len=num_tokens + 1)
        gen = parse_body(json.dumps({"prompt": text}).encode(), parse_completion_request, c)
        assert len(gen.prompts[0].token_ids) == num_tokens
        assert c.max_prompt_chars is not None and c.max_prompt_chars >= len(text)


def test_engine_errors_name_the_field_and_hide_exception_text() -> None:
    """A refusal's `param` is the request field of the engine's `InvalidFieldError.field`."""
    cases = [("n", "n must be at most 32 (max_num_seqs), got 1000000", "completion", "n"),
             ("top_k", "top_k must be at most 50, got 99", "completion", "top_k"),
             ("stop_token_ids", "stop_token_ids has token ids outside the vocabulary", "completion",
              "stop_token_ids"),
             ("seed", "seed must be an int", "chat", "seed"),
             ("prompt_token_ids", "prompt_token_ids must be ints in [0, 49152)", "completion", "prompt"),
             ("prompt_token_ids", "prompt_token_ids must be ints in [0, 49152)", "chat", "messages"),
             ("priority", "priority=3 needs scheduling_policy='priority'", "completion", "priority"),
             ("logit_bias", "logit_bias has token ids outside the vocabulary", "chat", "logit_bias"),
             ("logprobs", "logprobs must be at most 20", "chat", "top_logprobs"),
             (None, "penalties and prompt_logprobs are not supported in multi-host runs", "chat", None),
             ("sampling_params", "sampling_params must be a SamplingParams", "completion", None)]
    for field, message, kind, param in cases:
        error = ValueError(message) if field is None else InvalidFieldError(field, message)
        e = api_error(RequestRejected.of(error), kind)  # type: ignore[arg-type]
        assert (e.status, e.param, e.message) == (400, param, message)
    # the field, not the message's words: a message that starts with another field's name
    e = api_error(RequestRejected.of(InvalidFieldError("top_k", "n is no part of it")), "chat")
    assert e.param == "top_k"
    secret = "RuntimeError: injected secret fault at 0xdeadbeef"
    for err, status in ((EngineDeadError(f"the engine failed: {secret}"), 500),
                        (EngineUnavailable(f"the engine is dead: {secret}"), 503)):
        e = api_error(err, "completion")
        assert e.status == status and "secret" not in json.dumps(e.body())
    assert api_error(Overloaded("the server has 3 requests waiting"), "chat").code == "overloaded"


def test_internal_errors_are_generic() -> None:
    import asyncio

    from starlette.requests import Request

    req = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []})
    resp = asyncio.run(internal_error(req, KeyError("secret internal detail")))
    assert resp.status_code == 500 and b"secret" not in resp.body and b"KeyError" not in resp.body
    check_error(json.loads(resp.body))


def test_read_body_caps_what_it_reads() -> None:
    import asyncio

    from starlette.requests import Request

    def run(chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[bytes | int, int]:
        sent = iter([*chunks, b""])
        reads = 0

        async def receive() -> dict[str, Any]:
            nonlocal reads
            reads += 1
            chunk = next(sent)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunk)}

        req = Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)
        try:
            return asyncio.run(read_body(req, 10)), reads
        except APIError as e:
            assert e.code == "request_too_large" and e.param is None
            return e.status, reads

    assert run([b"12345", b"67890"], []) == (b"1234567890", 3)
    assert run([b"12345", b"678901", b"x" * 100, b"y"], []) == (413, 2)  # chunked: stops at once
    assert run([b"1"], [(b"content-length", b"11")]) == (413, 0)  # not read at all
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServerConfig(MODEL, 512, max_body_bytes=0)


def test_cli_max_body_bytes() -> None:
    from minivllm_jax.cli.serve import parse_args

    assert parse_args([]).max_body_bytes == MAX_BODY
    assert parse_args(["--max-body-bytes", "1024"]).max_body_bytes == 1024
    with pytest.raises(ValueError, match="--max-body-bytes"):
        parse_args(["--max-body-bytes", "0"])


# ---- over HTTP ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(*ENGINE_ARGS)
    try:
        yield srv
    finally:
        srv.close()


def post(port: int, path: str, body: bytes | Iterable[bytes], timeout: float = 60.0) -> tuple[int, str]:
    """(status, raw response text) of a POST; an iterable body goes chunked (no Content-Length)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        chunked = not isinstance(body, bytes)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"},
                     encode_chunked=chunked)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def served(port: int) -> None:
    """The server still answers a normal request."""
    status, body = request(port, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - start


def test_big_bodies_do_not_stall_streams(server: ServerProcess) -> None:
    port = server.port
    stream = RawStream(port, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                                 "max_tokens": 200, "ignore_eos": True,
                                                 "stream": True}, key="")
    arrivals: list[float] = []

    def read() -> None:
        for _ in stream.events():
            arrivals.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while len(arrivals) < 3:
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
    end = time.monotonic()
    reader.join(timeout=120)
    assert not reader.is_alive() and len(arrivals) > 100
    assert arrivals[-1] > end, "the stream ended before the big bodies were refused"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > start - 1.0]
    assert max(gaps) < 1.0, (max(gaps), end - start)
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
        status, out = request(port := server.port, "POST", path, body)
        assert status == 400, out
        no_leak(json.dumps(check_error(out, param)))
    served(port)
    assert "Traceback" not in server.stderr()


def test_n_that_can_never_be_admitted_is_400(server: ServerProcess) -> None:
    for n in (33, 1_000_000):  # max_num_seqs is 32
        status, body = request(server.port, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "Hi", "n": n, "max_tokens": 2})
        assert status == 400 and "max_num_seqs" in check_error(body, "n")["message"], body
    status, body = request(server.port, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "Hi", "n": 32, "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == 32


def test_long_prompt_that_fits_is_served(server: ServerProcess) -> None:
    """32,000 characters of SmolLM2's longest tokens (up to 80 characters each) fit 512 tokens:
    served, not refused for its length in characters."""
    status, body = request(server.port, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "#" * 32_000, "max_tokens": 2})
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
                           {"prompt": "hi", "max_tokens": 2, "top_k": 2147483648})
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
    h = request(port, "GET", "/health")[1]
    assert h["status"] == "ok" and h["num_free_kv_blocks"] == h["num_kv_blocks"] - 1
    assert "Traceback" not in server.stderr()

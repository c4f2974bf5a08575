"""Hostile request bodies, in-process on the parsing and error-mapping functions: a bad string
or number is a 400 naming its top-level field (never a 500), a prompt string too long in
characters is refused before it is tokenized, a body over --max-body-bytes is a 413 before it is
parsed, no error body carries Python exception text, and a request the engine can never admit is
a 400, not a 503. The same bodies over HTTP, and big bodies that must never stall other streams,
run on test_serve.py's server (one server process for both)."""
from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("fastapi")

from hostile_bodies import BAD_BODIES, MAX_BODY, nested, no_leak  # noqa: E402
from server_helpers import check_error  # noqa: E402

from minivllm_jax.serving.api import (ServerConfig, api_error, internal_error,  # noqa: E402
                                      read_body)
from minivllm_jax.serving.async_engine import (EngineDeadError, EngineUnavailable,  # noqa: E402
                                               Overloaded, RequestRejected)
from minivllm_jax.serving.body import parse_body  # noqa: E402
from minivllm_jax.serving.protocol import (APIError, ParseContext,  # noqa: E402
                                           chars_per_token_bound, field_param, parse_chat_request,
                                           parse_completion_request)
from scheduler import InvalidFieldError, StructuredOutputsParams  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


class NeverEncode:
    """A tokenizer that must not be asked to tokenize."""

    chat_template = "{{ messages }}"

    def encode(self, text: str) -> list[int]:
        raise AssertionError(f"tokenized {len(text)} characters")


def ctx(**kw: Any) -> ParseContext:
    return ParseContext(**{"model_name": MODEL, "max_model_len": 512, "tokenizer": None,
                           "max_waiting_samples": 1024, **kw})


def refusal(raw: bytes, chat: bool = False, context: ParseContext | None = None) -> APIError:
    parse = parse_chat_request if chat else parse_completion_request
    with pytest.raises(APIError) as e:
        parse_body(raw, parse, context or ctx())
    no_leak(json.dumps(e.value.body()))
    return e.value


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


SCHEMA = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}},
          "required": ["age"]}
SO = StructuredOutputsParams
# (request fields, the StructuredOutputsParams they give, the field a refusal of it must name)
CONSTRAINTS = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "age", "schema": SCHEMA, "strict": True}}},
     SO(json=SCHEMA), "response_format"),
    ({"response_format": {"type": "json_object"}}, SO(json_object=True), "response_format"),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": False}},
     SO(regex="[0-9]+", disable_any_whitespace=False), "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA}}, SO(json=SCHEMA), "structured_outputs"),
    ({"guided_json": SCHEMA}, SO(json=SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, SO(json=SCHEMA), "guided_json"),
    ({"guided_regex": "[a-z]{3}"}, SO(regex="[a-z]{3}"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, SO(choice=["yes", "no"]), "guided_choice"),
    ({"guided_grammar": 'start: "a"+'}, SO(grammar='start: "a"+'), "guided_grammar"),
    # response_format text is no constraint: the other field gives it
    ({"response_format": {"type": "text"}, "guided_choice": ["x"]}, SO(choice=["x"]),
     "guided_choice"),
    ({"response_format": {"type": "text"}}, None, None),
    ({"guided_regex": None}, None, None),
]


def chat_ctx() -> ParseContext:
    tok = tiny_tokenizer("bpe")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return ctx(tokenizer=tok)


@pytest.mark.parametrize("fields,want,param", CONSTRAINTS, ids=range(len(CONSTRAINTS)))
def test_each_way_of_giving_a_constraint(fields: dict[str, Any], want: Any, param: str | None) -> None:
    """On both endpoints, each request field that carries a constraint gives every prompt's
    SamplingParams that StructuredOutputsParams; the engine's refusal of it (a constraint that
    does not compile: its field is structured_outputs) is a 400 naming the field the request
    used."""
    chat, completion = chat_ctx(), ctx()
    for gen in (parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                       **fields}).encode(), parse_chat_request, chat),
                parse_body(json.dumps({"prompt": [[1], [2]], "max_completion_tokens": 4,
                                       **fields}).encode(), parse_completion_request, completion)):
        assert [sp.structured_outputs for sp in gen.params] == [want] * len(gen.prompts)
        compile_error = InvalidFieldError("structured_outputs", "structured_outputs.regex cannot "
                                                                "be compiled: unclosed group")
        e = api_error(RequestRejected.of(compile_error), gen.kind, gen.renamed)
        assert (e.status, e.param) == (400, param or "structured_outputs")
    # the same request's other renamed field still maps: max_tokens as max_completion_tokens
    e = api_error(RequestRejected.of(InvalidFieldError("max_tokens", "x")), gen.kind, gen.renamed)
    assert e.param == "max_completion_tokens"


def test_valid_oddities_still_parse() -> None:
    """A surrogate pair is one character; a big but convertible int where one is allowed is
    fine; nesting the decoder can hold is no error of its own."""
    gen = parse_body(rb'{"prompt": [1, 2], "user": "\ud83d\ude00", "seed": 1234567890123456789}',
                     parse_completion_request, ctx())
    assert gen.user == "\U0001F600" and gen.prompts[0].token_ids == [1, 2]
    assert refusal(b'{"prompt": [1], "stop": ' + nested(50) + b"}").param == "stop"
    assert refusal(b"[" * 5000).param is None and refusal(b'{"prompt": ').code == "invalid_json"


def test_checkpoint_sampling_defaults_fill_what_a_request_leaves_out() -> None:
    """The checkpoint's generation_config sampling fields (as the server's Routes pass them,
    through `sampling_defaults`) stand in for OpenAI's defaults; a request's own value wins; a
    rejected set of defaults is dropped."""
    from minivllm_jax.serving.api import sampling_defaults

    defaults = sampling_defaults({"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.1})
    context = ctx(sampling_defaults=defaults)
    left_out = parse_body(b'{"prompt": [1, 2]}', parse_completion_request, context).params[0]
    assert (left_out.temperature, left_out.top_k, left_out.repetition_penalty, left_out.top_p) == (0.0, 20, 1.1, 1.0)
    given = parse_body(b'{"prompt": [1, 2], "temperature": 0.7, "top_k": -1}', parse_completion_request,
                       context).params[0]
    assert (given.temperature, given.repetition_penalty) == (0.7, 1.1) and given.top_k <= 0  # off
    plain = parse_body(b'{"prompt": [1, 2]}', parse_completion_request, ctx()).params[0]
    assert (plain.temperature, plain.repetition_penalty) == (1.0, 1.0) and plain.top_k <= 0
    assert sampling_defaults({"temperature": -3.0}) == {"temperature": 1.0}  # refused: vLLM's


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

"""OpenAI's API shapes: request bodies in, responses, stream chunks and errors out.

Invariants:
- `parse_chat_request` / `parse_completion_request` either return a `GenerationRequest` whose
  prompts fit the context, whose `SamplingParams` are valid and which the engine can ever admit
  (its samples fit the waiting room; n may exceed max_num_seqs: samples run in waves), or raise `APIError` (400, 404) whose `param`
  names the offending request field. They never touch the engine, and tokenize no prompt text
  longer than `ParseContext.max_prompt_chars` (it cannot fit: refused untokenized). Whether a
  structured-outputs constraint compiles is the engine's check, when the request is submitted.
- A request gives at most one output constraint, through one of `STRUCTURED_FIELDS`
  (`response_format` of type text is none); the engine's refusal of a field is a 400 naming
  the request field that carried it: `field_param` through `GenerationRequest.renamed`
  (`structured_outputs` as that field, max_tokens as max_completion_tokens when given), else
  FIELD_PARAMS.
- An `APIError`'s message is valid text (a lone surrogate in it is escaped), so its body encodes.
- A chat request's `tools`, `tool_choice` and tool messages are checked by tools.py; a
  `tool_choice` that requires a call is the request's output constraint (its refusal named
  `tools`), and a chat choice's text becomes its message through `GenerationRequest.output`.
- One `GenerationRequest` is one engine request per prompt; choice `i * n + j` of a response is
  sample `j` of prompt `i`.
- `usage` counts are the prompts' token ids (once per prompt, however many samples) and every
  sample's generated token ids, stop-string tokens included.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Mapping, Sequence

from minivllm_jax.outputs import CompletionOutput, PositionLogprobs, RequestOutput, StepDelta
from minivllm_jax.engine.prompts import is_token_ids, prompt_token_ids
from minivllm_jax.serving.errors import APIError, bad_request
from minivllm_jax.serving.output_parsers import OutputParser
from minivllm_jax.serving.tools import (ChatOutput, ToolOptions, check_jinja, finish_reason,
                                        parse_tools, template_message)
from scheduler import InvalidFieldError, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

JSON = dict[str, object]
Kind = Literal["chat", "completion"]

# vLLM's cap on logprobs / top_logprobs (OpenAI's: 20 for chat, 5 for completions)
MAX_TOP_LOGPROBS = 20
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}
# OpenAI fields this server cannot honour: set to anything but these values, they are a 400
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (None, False), "suffix": (None, ""), "functions": (None, []),
    "prompt_logprobs": (None,),
}
# the chat request fields of tool calling (tools.py reads them) and of the template's rendering
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "add_generation_prompt",
                   "continue_final_message")
# vLLM's older request fields of one constraint each: the StructuredOutputsParams field they set
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# the request fields that may carry the output constraint (SamplingParams.structured_outputs)
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)
# every request field the parsers read: the `param` an error may name
REQUEST_FIELDS = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "min_p", "top_k", "n", "best_of", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
    "include_stop_str_in_output", "logit_bias", "priority", "stream", "stream_options", "user",
    *STRUCTURED_FIELDS, *_UNSUPPORTED, *TOOL_FIELDS, *TEMPLATE_FIELDS})
# the request field (OpenAI's `param`) of an engine or SamplingParams field (an
# `InvalidFieldError.field`) that has another name there, by endpoint; any other field is its own
# request field when it is one (`field_param`). The names that depend on the request (max_tokens,
# structured_outputs) are its `GenerationRequest.renamed`.
FIELD_PARAMS: dict[tuple[str, Kind], str] = {
    ("prompt", "completion"): "prompt", ("prompt", "chat"): "messages",
    ("prompt_token_ids", "completion"): "prompt", ("prompt_token_ids", "chat"): "messages",
    ("logprobs", "chat"): "top_logprobs",
}


@dataclass(frozen=True)
class PromptInput:
    """One prompt: its token ids and, when it came as a string, that string."""

    token_ids: list[int]
    text: str | None = None


@dataclass(frozen=True)
class ParseContext:
    """What parsing needs to know of the server: its model's name, the context length, a
    tokenizer used only by the thread that parses (None: the model has none), the most samples
    that may wait for the engine's batch (`max_waiting_samples`; None: no cap), `chars_per_token`, a bound on the characters one token of the tokenizer stands
    for (None: none known, so every prompt string is tokenized; see `chars_per_token_bound`),
    `sampling_defaults`, the checkpoint's generation_config sampling fields, which a request
    that leaves them out gets instead of OpenAI's defaults (vLLM's `--generation-config auto`),
    and `tools`, the server's tool options (its chat template among them)."""

    model_name: str
    max_model_len: int
    tokenizer: PreTrainedTokenizerBase | None
    max_waiting_samples: int | None = None
    chars_per_token: int | None = None
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    tools: ToolOptions = field(default_factory=ToolOptions)

    @property
    def max_prompt_chars(self) -> int | None:
        """A prompt text longer than this has more than max_model_len tokens."""
        return None if self.chars_per_token is None else self.max_model_len * self.chars_per_token


def chars_per_token_bound(tokenizer: PreTrainedTokenizerBase | None) -> int | None:
    """Twice the longest vocabulary or added token string, for a fast BPE tokenizer that encodes
    every byte (byte-level, or with byte fallback); None for any other.

    Why it is a bound on the characters of prompt text per token: such a tokenizer turns a text
    into tokens that cover it, each a vocabulary or added token standing for at most as many
    characters as its string has (a byte-level string has one character per byte, and a character
    is at least one byte; a byte-fallback `<0x..>` token stands for less than one character), and
    it has no unknown token that could swallow a run of characters (WordPiece's and Unigram's
    can: no bound for them). The factor 2 is room for a normalizer that merges characters
    (NFC / NFKC compose a few into one); byte-level BPE vocabularies have none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if tokenizer is None or backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    byte_level = '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    strings = [*tokenizer.get_vocab(), *tokenizer.all_special_tokens]
    return 2 * max(len(s) for s in strings)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated chat or completion request: one `SamplingParams` per prompt (the default
    max_tokens fills each prompt's context). `top_logprobs` is the number of alternatives each
    token's logprobs list (None: no logprobs); `user` is an opaque tag kept with the request.
    `renamed`: the request field of an engine field that this request named its own way
    (max_tokens: max_completion_tokens; structured_outputs: the field that gave the constraint),
    for `field_param`. `checks`: constraints the grammar engine must compile before the request
    runs, by the request field to name when one cannot be (tools.py); `output`: how a chat
    choice's text becomes its message (None: verbatim content)."""

    kind: Kind
    model: str
    prompts: list[PromptInput]
    params: list[SamplingParams]
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None
    priority: int = 0
    user: str | None = None
    renamed: Mapping[str, str] = field(default_factory=dict)
    checks: tuple[tuple[str, StructuredOutputsParams], ...] = ()
    output: ChatOutput | None = None

    @property
    def n(self) -> int:
        return self.params[0].n


# ---- field readers: JSON types checked here, ranges by SamplingParams -----------------------------
def _field(body: Mapping[str, object], name: str, ok: Callable[[object], bool],
           what: str) -> object:
    """``body[name]``, None when absent or null; a 400 naming the field unless ``ok(value)``."""
    v = body.get(name)
    if v is not None and not ok(v):
        raise bad_request(f"{name} must be {what}, got {v!r:.60}", name)
    return v


def _is_finite(v: object) -> bool:
    """A JSON number a float can hold (an int of 400 digits cannot)."""
    try:
        return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    except OverflowError:
        return False


def _number(body: Mapping[str, object], name: str) -> float | int | None:
    return _field(body, name, _is_finite, "a finite number")


def _int(body: Mapping[str, object], name: str) -> int | None:
    return _field(body, name, lambda v: not isinstance(v, bool) and isinstance(v, int), "an integer")


def _bool(body: Mapping[str, object], name: str) -> bool | None:
    return _field(body, name, lambda v: isinstance(v, bool), "a boolean")


def _str(body: Mapping[str, object], name: str) -> str | None:
    return _field(body, name, lambda v: isinstance(v, str), "a string")


def field_param(field: str | None, kind: Kind, renamed: Mapping[str, str] | None = None) -> str | None:
    """The request field (OpenAI's `param`) of the engine's or SamplingParams' `field` (an
    `InvalidFieldError.field`): the request's own name of it (`renamed`, a
    `GenerationRequest.renamed`), else through FIELD_PARAMS; None when it is no request field."""
    if field is None:
        return None
    param = (renamed or {}).get(field) or FIELD_PARAMS.get((field, kind), field)
    return param if param in REQUEST_FIELDS else None


def error_param(e: BaseException, kind: Kind, renamed: Mapping[str, str] | None = None) -> str | None:
    """`field_param` of an exception's `field` (None for an exception that names none)."""
    return field_param(e.field if isinstance(e, InvalidFieldError) else None, kind, renamed)


def _no_room(num_tokens: int, ctx: ParseContext, field: str) -> APIError:
    return bad_request(f"This model's maximum context length is {ctx.max_model_len} tokens; your "
                       f"request has {num_tokens} input tokens, which leaves no room to generate. "
                       f"Please shorten the {field}.", field, "context_length_exceeded")


def _check_chars(num_chars: int, ctx: ParseContext, field: str) -> None:
    """A 400 for text that cannot fit the context, before it is tokenized."""
    limit = ctx.max_prompt_chars
    if limit is not None and num_chars > limit:
        raise bad_request(f"This model's maximum context length is {ctx.max_model_len} tokens; "
                          f"your {field} has {num_chars} characters, more than that many tokens "
                          f"can hold. Please shorten the {field}.", field, "context_length_exceeded")


def _check_admissible(body: Mapping[str, object], num_prompts: int, ctx: ParseContext,
                      field: str) -> None:
    """A 400 for a request the engine can never admit: more samples than may wait (it would be
    'overloaded' forever). Cheap: before any prompt is tokenized. (n over max_num_seqs is
    admitted: its samples run in waves, as vLLM's do.)"""
    n = _int(body, "n")
    n = 1 if n is None else n
    limit = ctx.max_waiting_samples
    if limit is not None and num_prompts * n > limit:
        raise bad_request(f"this request asks for {num_prompts} prompt(s) x n={n} samples; at most "
                          f"{limit} may wait for this server's batch", "n" if n > limit else field)


def _check_body(body: object, ctx: ParseContext) -> tuple[Mapping[str, object], str]:
    """The body as a JSON object and the model it names (404 for another model), once no field
    asks for what this server does not support."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = _str(body, "model")
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{ctx.model_name}`", param="model", type="NotFoundError",
                       code="model_not_found")
    for name, fine in _UNSUPPORTED.items():
        if name in body and body[name] not in fine:
            raise bad_request(f"{name} is not supported by this server", name)
    return body, ctx.model_name


def _response_format(fmt: object) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: type text (None: no constraint), json_object, or json_schema
    with its `json_schema.schema` object."""
    name = "response_format"
    if not isinstance(fmt, dict):
        raise bad_request(f"{name} must be an object with a type, got {fmt!r:.60}", name)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"{name}.type must be one of 'text', 'json_object', 'json_schema', "
                          f"got {kind!r:.60}", name)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request(f"{name} of type json_schema needs json_schema: {{name, schema}} with "
                          f"schema a JSON Schema object, got {spec!r:.60}", name)
    return StructuredOutputsParams(json=spec["schema"])


Constraint = tuple[StructuredOutputsParams | None, str | None]


def _structured_outputs(body: Mapping[str, object]) -> Constraint:
    """The request's output constraint and the request field that gave it (None, None: none);
    a 400 naming the field when it is malformed, or naming the second of two fields given.
    Cheap (no grammar is compiled): parsed before any prompt is tokenized."""
    given = [name for name in body if name in STRUCTURED_FIELDS and body[name] is not None]
    out: Constraint = (None, None)
    for name in given:
        value, key = body[name], GUIDED_FIELDS.get(name)
        try:
            if name == "response_format":
                params = _response_format(value)
            else:  # structured_outputs, or a guided_* field: the one key it sets
                params = StructuredOutputsParams.from_dict(value if key is None else {key: value},
                                                           field=name)
        except InvalidFieldError as e:  # "guided_regex.regex must be" -> "guided_regex must be"
            message = str(e) if key is None else str(e).replace(f"{name}.{key}", name, 1)
            raise bad_request(message, name) from None
        if params is not None and out[1] is not None:
            raise bad_request(f"give at most one of {', '.join(STRUCTURED_FIELDS)}; this request "
                              f"gives {out[1]} and {name}", name)
        out = (params, name) if params is not None else out
    return out


def _stream_options(body: Mapping[str, object], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options.include_usage must be a boolean", "stream_options")
    return include


def _sampling_params(body: Mapping[str, object], prompts: list[PromptInput], ctx: ParseContext,
                     logprobs: int | None, kind: Kind,
                     structured: Constraint) -> tuple[list[SamplingParams], dict[str, str]]:
    """One SamplingParams per prompt (`structured`: `_structured_outputs(body)`), and the
    request's `renamed` fields; raises a 400 naming the field (prompts too long for the context
    included)."""
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name)
    constraint, constraint_name = structured
    renamed = {"max_tokens": max_name}
    if constraint_name is not None:
        renamed["structured_outputs"] = constraint_name
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if isinstance(stop, list) and not stop:
        stop = None
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None:
        stop_token_ids = []
    if not isinstance(stop_token_ids, list):
        raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
    kw: dict[str, object] = {"stop": stop, "stop_token_ids": tuple(stop_token_ids), "logprobs": logprobs,
                             "structured_outputs": constraint}
    defaults = ctx.sampling_defaults
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        v = _number(body, name)
        kw[name] = defaults.get(name, default) if v is None else v
    for name, default in (("n", 1), ("top_k", 0), ("min_tokens", 0)):
        v = _int(body, name)
        kw[name] = defaults.get(name, default) if v is None else v
    kw["seed"] = _int(body, "seed")
    for name in ("ignore_eos", "include_stop_str_in_output"):
        kw[name] = bool(_bool(body, name))
    bias = body.get("logit_bias")
    if bias is not None and not (isinstance(bias, dict) and all(map(_is_finite, bias.values()))):
        raise bad_request("logit_bias must be an object of token id -> finite bias", "logit_bias")
    kw["logit_bias"] = bias or None
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != kw["n"]:
        raise bad_request("best_of other than n is not supported", "best_of")
    prompt_field = "messages" if kind == "chat" else "prompt"
    out = []
    for p in prompts:
        room = ctx.max_model_len - len(p.token_ids)
        if room <= 0:
            raise _no_room(len(p.token_ids), ctx, prompt_field)
        if max_tokens is not None and max_tokens > room:
            raise bad_request(f"This model's maximum context length is {ctx.max_model_len} tokens; "
                              f"you requested {len(p.token_ids) + max_tokens} tokens "
                              f"({len(p.token_ids)} in the {prompt_field}, {max_tokens} in the "
                              f"completion). Please reduce the length of the {prompt_field} or "
                              f"{max_name}.", max_name, "context_length_exceeded")
        try:
            out.append(SamplingParams(max_tokens=room if max_tokens is None else max_tokens, **kw))  # type: ignore[arg-type]
        except (ValueError, TypeError, OverflowError) as e:  # an InvalidFieldError names its field
            raise bad_request(str(e), error_param(e, kind, renamed)) from None
    return out, renamed


def _priority(body: Mapping[str, object]) -> int:
    v = _int(body, "priority")
    return 0 if v is None else v


# ---- chat ---------------------------------------------------------------------------------------
def _chat_messages(body: Mapping[str, object]) -> list[dict[str, object]]:
    """The messages as the chat template reads them: role, text content (None: ""), and a tool
    conversation's fields (tools.template_message)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r:.40}",
                              "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append(template_message(i, m, {"role": _ROLES[str(role)], "content": content}))
    return out


def _request_template(req: Mapping[str, object], ctx: ParseContext) -> str | None:
    """A chat request's own `chat_template` (None when absent): a 400 naming it unless the
    server trusts request templates, or when Jinja cannot parse it."""
    template = _str(req, "chat_template")
    if template is None:
        return None
    if not ctx.tools.trust_request_chat_template:
        raise bad_request("chat_template is refused: the server was not started with "
                          "--trust-request-chat-template", "chat_template")
    try:
        return check_jinja(template, "chat_template")
    except ValueError as e:
        raise bad_request(str(e), "chat_template") from None


def parse_chat_request(body: object, ctx: ParseContext) -> GenerationRequest:
    """A /v1/chat/completions body, its messages rendered with the tokenizer's chat template."""
    req, model = _check_body(body, ctx)
    messages = _chat_messages(req)
    tools = parse_tools(req, ctx.tools)
    structured = _structured_outputs(req)
    if tools.constraint is not None:  # tool_choice "required" or named: the output's constraint
        if structured[1] is not None:
            raise bad_request(f"{structured[1]} cannot be given with a tool_choice that requires "
                              "a call (the call's schema constrains the output)", structured[1])
        structured = (tools.constraint, "tools")
    template = _request_template(req, ctx) or ctx.tools.chat_template
    if ctx.tokenizer is None or (template or getattr(ctx.tokenizer, "chat_template", None)) is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    _check_admissible(req, 1, ctx, "messages")
    _check_chars(sum(len(str(m["content"])) for m in messages), ctx, "messages")  # templates add text
    from jinja2 import TemplateError

    from minivllm_jax.llm import check_chat_options, render_chat

    generation_prompt, continued = (_bool(req, f) for f in ("add_generation_prompt",
                                                             "continue_final_message"))
    flags = {"add_generation_prompt": generation_prompt is not False,  # vLLM's defaults
             "continue_final_message": bool(continued)}
    try:
        template_kwargs = check_chat_options(req.get("chat_template_kwargs"), **flags)
    except (TypeError, ValueError) as e:  # each message starts with its field's name
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
    try:
        ids = list(render_chat(ctx.tokenizer, messages, tools=tools.tools, chat_template=template,
                               template_kwargs=template_kwargs, **flags))
    except Exception as e:  # a template's own raise_exception(...), e.g. roles out of order
        why = f": {e}" if isinstance(e, TemplateError) else ""  # other texts are not the user's
        raise bad_request(f"the chat template rejected the messages{why}", "messages") from None
    stream = bool(_bool(req, "stream"))
    want = _bool(req, "logprobs")
    top = _int(req, "top_logprobs")
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    k = (top or 0) if want else None
    prompts = [PromptInput(ids)]
    params, renamed = _sampling_params(req, prompts, ctx, k, "chat", structured)
    return GenerationRequest("chat", model, prompts, params, stream, _stream_options(req, stream),
                             k, _priority(req), _str(req, "user"), renamed, tools.checks,
                             tools.output)


# ---- completions --------------------------------------------------------------------------------
def _completion_prompts(body: Mapping[str, object], ctx: ParseContext) -> list[PromptInput]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or is_token_ids(prompt):
        items: list[object] = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = list(prompt)
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                          "list of such lists", "prompt")
    _check_admissible(body, len(items), ctx, "prompt")
    for item in items:  # before tokenizing any
        if isinstance(item, str):
            _check_chars(len(item), ctx, "prompt")
    out = []
    for item in items:
        if is_token_ids(item) and len(item) >= ctx.max_model_len:  # OpenAI's words and code
            raise _no_room(len(item), ctx, "prompt")
        try:
            text, ids = prompt_token_ids(item, ctx.tokenizer)
        except InvalidFieldError as e:
            raise bad_request(str(e), error_param(e, "completion")) from None
        out.append(PromptInput(ids, text))
    return out


def parse_completion_request(body: object, ctx: ParseContext) -> GenerationRequest:
    """A /v1/completions body: one engine request per prompt."""
    req, model = _check_body(body, ctx)
    structured = _structured_outputs(req)
    prompts = _completion_prompts(req, ctx)
    stream = bool(_bool(req, "stream"))
    k = _int(req, "logprobs")
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}", "logprobs")
    params, renamed = _sampling_params(req, prompts, ctx, k, "completion", structured)
    return GenerationRequest("completion", model, prompts, params, stream,
                             _stream_options(req, stream), k, _priority(req), _str(req, "user"),
                             renamed)


# ---- responses ----------------------------------------------------------------------------------
def new_response_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def _token_bytes(token: str | None) -> list[int] | None:
    return None if token is None else list(token.encode("utf-8"))


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, float, str]]:
    """The k most likely tokens of a position: (id, logprob, text), by rank."""
    ranked = sorted((lp.rank, tid, lp) for tid, lp in position.items() if lp.rank <= k)
    return [(tid, lp.logprob, lp.decoded_token or "") for _, tid, lp in ranked[:k]]


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], k: int) -> JSON:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos[tid]
        content.append({"token": chosen.decoded_token or "", "logprob": chosen.logprob,
                        "bytes": _token_bytes(chosen.decoded_token),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": _token_bytes(t)}
                                         for _, lp, t in _top(pos, k)]})
    return {"content": content}


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], k: int,
                        offset: int = 0) -> JSON:
    """OpenAI completions `logprobs`: parallel lists of tokens, their logprobs, the top-k
    alternatives and each token's offset in the text (from `offset`)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, positions):
        chosen = pos[tid]
        text = chosen.decoded_token or ""
        tokens.append(text)
        lps.append(chosen.logprob)
        tops.append({t: lp for _, lp, t in _top(pos, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


@dataclass
class ResponseBuilder:
    """Builds one request's response or stream chunks; `id`, `created` and `model` are shared
    by all of them. Keeps per-choice text offsets for streamed completion logprobs, and
    per-choice output parsers for a chat request's `output` (a streamed choice's message
    pieces concatenate to its non-streamed message: output_parsers' invariant)."""

    request: GenerationRequest
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)
    _parsers: dict[int, OutputParser] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = self.id or new_response_id(self.request.kind)

    @property
    def object(self) -> str:
        return "chat.completion" if self.request.kind == "chat" else "text_completion"

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.request.n + sample_index

    def usage(self, outputs: Sequence[RequestOutput]) -> JSON:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _choice(self, index: int, c: CompletionOutput) -> JSON:
        k = self.request.top_logprobs
        stop_reason = c.stop_reason if isinstance(c.stop_reason, (str, int)) else None
        if self.request.kind == "chat":
            lp = None if k is None or c.logprobs is None else chat_logprobs(c.token_ids, c.logprobs, k)
            output, reason = self.request.output, c.finish_reason
            message: JSON = {"role": "assistant", "content": c.text}
            if output is not None:
                message = output.message(c.text)
                reason = finish_reason(reason, "tool_calls" in message)
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason,
                    "stop_reason": stop_reason}
        lp = None if k is None or c.logprobs is None else completion_logprobs(c.token_ids, c.logprobs, k)
        return {"index": index, "text": c.text, "logprobs": lp,
                "finish_reason": c.finish_reason, "stop_reason": stop_reason}

    def response(self, outputs: Sequence[RequestOutput]) -> JSON:
        """The non-streamed response of every prompt's finished output, in prompt order."""
        choices = [self._choice(self.choice_index(i, c.index), c)
                   for i, o in enumerate(outputs) for c in sorted(o.outputs, key=lambda c: c.index)]
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.request.model, "choices": choices, "usage": self.usage(outputs)}

    # ---- streaming ------------------------------------------------------------------------
    def _chunk(self, choices: list[JSON]) -> JSON:
        chunk: JSON = {"id": self.id, "object": f"{self.object}.chunk" if self.request.kind == "chat"
                       else self.object, "created": self.created, "model": self.request.model,
                       "choices": choices}
        if self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def role_chunk(self, num_choices: int) -> JSON:
        """Chat's first chunk: each choice's role, no content."""
        return self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None} for i in range(num_choices)])

    def delta_chunk(self, prompt_index: int, delta: StepDelta) -> JSON | None:
        """The chunk of one engine delta (one per step that made tokens, even when they do not
        complete a character yet); None when it has no token and no finish."""
        index = self.choice_index(prompt_index, delta.index)
        k = self.request.top_logprobs
        lp: JSON | None = None
        if k is not None and delta.new_logprobs:
            if self.request.kind == "chat":
                lp = chat_logprobs(delta.new_token_ids, delta.new_logprobs, k)
            else:
                lp = completion_logprobs(delta.new_token_ids, delta.new_logprobs, k,
                                         self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + len(delta.new_text)
        if not delta.new_token_ids and delta.finish_reason is None:
            return None
        choice: JSON = {"index": index, "logprobs": lp,
                        "finish_reason": delta.finish_reason}
        if self.request.kind == "chat" and self.request.output is not None:
            choice["delta"] = self._parsed_delta(self.request.output, index, delta)
            if delta.finish_reason is not None:
                called = self._parsers.pop(index).called
                choice["finish_reason"] = finish_reason(delta.finish_reason, called)
        elif self.request.kind == "chat":
            choice["delta"] = {"content": delta.new_text} if delta.new_text else {}
        else:
            choice["text"] = delta.new_text
        return self._chunk([choice])

    def _parsed_delta(self, output: ChatOutput, index: int, delta: StepDelta) -> JSON:
        """A chat choice's stream delta through its output parser (made at its first delta)."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = output.parser()
        pieces = parser.feed(delta.new_text)
        if delta.finish_reason is not None:
            pieces += parser.finish()
        return output.delta(pieces)

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> JSON:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        chunk = self._chunk([])
        chunk["usage"] = self.usage(outputs)
        return chunk


def model_card(model_name: str, max_model_len: int, created: int) -> JSON:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "minivllm-jax",
            "root": model_name, "parent": None, "max_model_len": max_model_len}

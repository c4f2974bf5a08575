"""The FastAPI app: OpenAI's endpoints over an `AsyncEngine`.

Invariants:
- Every error leaves as OpenAI's `{"error": {message, type, param, code}}` with its status: 400
  bad input (malformed JSON included), 401 a wrong api key, 404 an unknown model or path, 413 a
  body over `max_body_bytes`, 503 overloaded / shutting down / engine dead before the request was
  taken, 500 a failed model step of this request (the engine serves on), a dead engine (on a
  stream: an error chunk, then `data: [DONE]`) or a bug. No error body carries a Python exception's text: engine failures and bugs answer fixed
  messages (a bug's traceback goes to the log; the engine's failure to /health).
- The event loop neither decodes JSON nor tokenizes: it reads a body (no more than
  `max_body_bytes` of it), and the app's one parser thread decodes and parses it. That thread
  alone uses the parse copy of the tokenizer (a HF fast tokenizer must not be used by two threads
  at once); the engine thread uses its own.
- A request whose client goes away (a closed stream, or a disconnect while a non-streamed
  response is computed) has its engine requests aborted; the engine frees their KV blocks at its
  next step.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm_jax.llm import default_sampling_params
from minivllm_jax.outputs import RequestOutput
from minivllm_jax.serving.async_engine import (AsyncEngine, EngineDeadError, EngineError,
                                               EngineRequest, EngineUnavailable, Overloaded,
                                               RequestFailed, RequestRejected, ShuttingDown,
                                               Submission)
from minivllm_jax.serving.body import Parse, parse_body
from minivllm_jax.serving.metrics import CONTENT_TYPE, ServerMetrics
from minivllm_jax.serving.protocol import (JSON, APIError, GenerationRequest, Kind, ParseContext,
                                           ResponseBuilder, bad_request, chars_per_token_bound,
                                           field_param, model_card, parse_chat_request,
                                           parse_completion_request)
from minivllm_jax.serving.tools import ToolOptions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """`model_name`: the one name `model` may take; `api_key`: when set, /v1 requests must send
    `Authorization: Bearer <api_key>`; `max_body_bytes`: a larger request body is a 413, unread past that;
    `tools`: the chat template, tool-call and reasoning options (docs/API.md §4a)."""

    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tools: ToolOptions = field(default_factory=ToolOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")
        b = self.max_body_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"max_body_bytes must be an int >= 1, got {b!r}")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def api_error(e: EngineError, kind: Kind, renamed: Mapping[str, str] | None = None) -> APIError:
    """The HTTP error of an engine error (see the module invariants for the statuses). A message
    that may carry a Python exception's text (a dead engine's) is replaced by a fixed one.
    `renamed`: the request's `GenerationRequest.renamed`."""
    if isinstance(e, RequestRejected):  # `param`: the request field of the engine's field
        param, message = field_param(e.field, kind, renamed), str(e)
        if e.field == "structured_outputs" and param and message.startswith(e.field):
            message = param + message[len(e.field):]  # the constraint's own request field
        return bad_request(message, param)
    if isinstance(e, (Overloaded, ShuttingDown)):  # their messages are the engine's own words
        return APIError(503, str(e), type="ServiceUnavailableError",
                        code="overloaded" if isinstance(e, Overloaded) else "unavailable")
    if isinstance(e, EngineUnavailable):  # its message may carry the engine's exception text
        return APIError(503, "the server is not taking requests (shutting down, or its engine "
                             "failed: see /health)", type="ServiceUnavailableError", code="unavailable")
    if isinstance(e, EngineDeadError):
        return APIError(500, "the engine failed while serving this request (see /health)",
                        type="InternalServerError", code="engine_dead")
    if isinstance(e, RequestFailed):  # one failed model step: the engine serves on
        return APIError(500, str(e), type="InternalServerError", code="step_failed")
    return APIError(500, "the engine failed to serve this request", type="InternalServerError",
                    code="internal_error")


async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
    return error_response(APIError(e.status_code, str(e.detail), type=kind))


async def internal_error(request: Request, e: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered with a fixed message (Starlette then re-raises
    it to the server, which logs it too)."""
    logger.error("internal error answering %s %s", request.method, request.url.path, exc_info=e)
    return error_response(APIError(500, "internal server error", type="InternalServerError",
                                   code="internal_error"))


def authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect API key provided", type="invalid_request_error",
                       code="invalid_api_key")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once its Content-Length or the bytes read pass `limit` (the rest is
    not read into memory)."""
    too_large = APIError(413, f"the request body is larger than this server takes ({limit} bytes)",
                         code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdecimal() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _sse(payload: JSON | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request) -> None:
    """Returns once the client closed its connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sampling_defaults(generation_defaults: dict[str, float]) -> dict[str, float]:
    """The checkpoint's generation_config sampling fields as `LLM` takes them (all of them
    dropped, with a warning, if SamplingParams rejects them)."""
    params = default_sampling_params(generation_defaults)
    return {k: getattr(params, k) for k in generation_defaults}


class Routes:
    """The app's handlers and what they share: the engine, the parse context (its own copy of
    the tokenizer) and the one parser thread that uses it."""

    def __init__(self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase | None,
                 config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        tok = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.ctx = ParseContext(config.model_name, config.max_model_len, tok,
                                engine.config.max_waiting_requests, chars_per_token_bound(tok),
                                sampling_defaults(engine.engine.generation_defaults),
                                config.tools)
        self.parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-parse")
        self.created = int(time.time())

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """Starts the engine thread; stops it (in-flight requests end with ShuttingDown) and the
        parser thread."""
        self.engine.start()
        try:
            yield
        finally:
            await self.engine.stop()
            self.parser.shutdown(wait=False, cancel_futures=True)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat_request)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion_request)

    async def _generate(self, request: Request, parse: Parse) -> Response:
        authorize(request, self.config.api_key)
        raw = await read_body(request, self.config.max_body_bytes)
        loop = asyncio.get_running_loop()
        gen = await loop.run_in_executor(self.parser, parse_body, raw, parse, self.ctx)
        builder = ResponseBuilder(gen)
        reqs = [EngineRequest(f"{builder.id}-{i}", p.token_ids, sp, p.text, gen.priority, gen.checks)
                for i, (p, sp) in enumerate(zip(gen.prompts, gen.params))]
        try:
            sub = await self.engine.submit(reqs)
        except EngineError as e:
            raise api_error(e, gen.kind, gen.renamed) from None
        if gen.stream:
            return StreamingResponse(self._stream(sub, gen, builder), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._complete(request, sub, builder)

    async def _complete(self, request: Request, sub: Submission, builder: ResponseBuilder) -> Response:
        results = asyncio.ensure_future(sub.results())
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not results.done():  # the client left: nobody to answer
                return Response(status_code=499)
            outputs: list[RequestOutput] = results.result()
        except EngineError as e:
            raise api_error(e, builder.request.kind, builder.request.renamed) from None
        finally:
            for task in (results, gone):
                task.cancel()
            self.engine.abort(sub)
        return JSONResponse(builder.response(outputs))

    async def _stream(self, sub: Submission, gen: GenerationRequest,
                      builder: ResponseBuilder) -> AsyncIterator[str]:
        try:
            if gen.kind == "chat":
                yield _sse(builder.role_chunk(gen.n))
            async for i, delta in sub.deltas():
                chunk = builder.delta_chunk(i, delta)
                if chunk is not None:
                    yield _sse(chunk)
            if gen.include_usage:
                yield _sse(builder.usage_chunk([o for o in sub.outputs if o is not None]))
        except EngineError as e:
            yield _sse(api_error(e, gen.kind, gen.renamed).body())
        finally:
            self.engine.abort(sub)  # a no-op unless the client went away first
        yield _sse("[DONE]")

    async def models(self, request: Request) -> JSONResponse:
        authorize(request, self.config.api_key)
        card = model_card(self.config.model_name, self.config.max_model_len, self.created)
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self) -> JSONResponse:
        h = self.engine.health()
        s = h.stats
        return JSONResponse({"status": h.status, "error": h.error,
                             "num_requests_running": s.num_running_reqs,
                             "num_requests_waiting": s.num_waiting_reqs,
                             "num_kv_blocks": s.num_kv_blocks,
                             "num_free_kv_blocks": s.num_free_kv_blocks},
                            status_code=200 if h.healthy else 503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(self.engine.stats()), media_type=CONTENT_TYPE)


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e)


def build_app(engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase | None, config: ServerConfig,
              metrics: ServerMetrics) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it (in-flight requests end with
    ShuttingDown). `engine` must not be started yet."""
    routes = Routes(engine, tokenizer, config, metrics)
    app = FastAPI(title="minivllm-jax OpenAI-compatible server", lifespan=routes.lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.prometheus, methods=["GET"])
    return app

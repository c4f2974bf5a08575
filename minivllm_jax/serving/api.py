"""The FastAPI app: OpenAI's endpoints over an `AsyncEngine`.

Invariants:
- Every error leaves as OpenAI's `{"error": {message, type, param, code}}` with its status: 400
  bad input (malformed JSON included), 401 a wrong api key, 404 an unknown model or path, 503
  overloaded / shutting down / engine dead before the request was taken, 500 an engine failure
  while it ran (on a stream: an error chunk, then `data: [DONE]`).
- A request whose client goes away (a closed stream, or a disconnect while a non-streamed
  response is computed) has its engine requests aborted; the engine frees their KV blocks at its
  next step.
- The handlers parse with their own copy of the tokenizer, so the engine thread's never sees
  two threads.
"""
from __future__ import annotations

import asyncio
import copy
import json
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm_jax.outputs import RequestOutput
from minivllm_jax.serving.async_engine import (AsyncEngine, EngineDeadError, EngineError,
                                               EngineRequest, EngineUnavailable, Overloaded,
                                               RequestRejected, ShuttingDown, Submission)
from minivllm_jax.serving.metrics import CONTENT_TYPE, ServerMetrics
from minivllm_jax.serving.protocol import (JSON, APIError, GenerationRequest, ParseContext,
                                           ResponseBuilder, bad_request, model_card,
                                           parse_chat_request, parse_completion_request)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ServerConfig:
    """`model_name`: the one name `model` may take; `api_key`: when set, /v1 requests must send
    `Authorization: Bearer <api_key>`."""

    model_name: str
    max_model_len: int
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def api_error(e: EngineError, prompt_field: str) -> APIError:
    """The HTTP error of an engine error (see the module invariants for the statuses)."""
    if isinstance(e, RequestRejected):
        word = str(e).split(" ", 1)[0].split("=", 1)[0]
        param = {"prompt_token_ids": prompt_field, "logit_bias": "logit_bias", "priority": "priority",
                 "penalties": None}.get(word, None)
        return bad_request(str(e), param)
    if isinstance(e, (Overloaded, EngineUnavailable, ShuttingDown)):
        return APIError(503, str(e), type="ServiceUnavailableError",
                        code="overloaded" if isinstance(e, Overloaded) else "unavailable")
    code = "engine_dead" if isinstance(e, EngineDeadError) else "internal_error"
    return APIError(500, str(e), type="InternalServerError", code=code)


def _sse(payload: JSON | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request) -> None:
    """Returns once the client closed its connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase | None, config: ServerConfig,
              metrics: ServerMetrics) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it (in-flight requests end with
    ShuttingDown). `engine` must not be started yet."""
    ctx = ParseContext(config.model_name, config.max_model_len,
                       copy.deepcopy(tokenizer) if tokenizer is not None else None)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="minivllm-jax OpenAI-compatible server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return error_response(APIError(500, f"{type(e).__name__}: {e}", type="InternalServerError"))

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(),
                                                                    config.api_key.encode()):
            raise APIError(401, "Incorrect API key provided", type="invalid_request_error",
                           code="invalid_api_key")

    async def json_body(request: Request) -> object:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"malformed JSON body: {e}", None, "invalid_json") from None

    async def generate(request: Request, parse: Callable[[object, ParseContext], GenerationRequest]) -> Response:
        authorize(request)
        gen = parse(await json_body(request), ctx)
        builder = ResponseBuilder(gen)
        prompt_field = "messages" if gen.kind == "chat" else "prompt"
        reqs = [EngineRequest(f"{builder.id}-{i}", p.token_ids, sp, p.text, gen.priority, gen.user)
                for i, (p, sp) in enumerate(zip(gen.prompts, gen.params))]
        try:
            sub = await engine.submit(reqs)
        except EngineError as e:
            raise api_error(e, prompt_field) from None
        if gen.stream:
            return StreamingResponse(stream(sub, gen, builder, prompt_field),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await complete(request, sub, builder, prompt_field)

    async def complete(request: Request, sub: Submission, builder: ResponseBuilder,
                       prompt_field: str) -> Response:
        results = asyncio.ensure_future(sub.results())
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not results.done():  # the client left: nobody to answer
                return Response(status_code=499)
            outputs: list[RequestOutput] = results.result()
        except EngineError as e:
            raise api_error(e, prompt_field) from None
        finally:
            for task in (results, gone):
                task.cancel()
            engine.abort(sub)
        return JSONResponse(builder.response(outputs))

    async def stream(sub: Submission, gen: GenerationRequest, builder: ResponseBuilder,
                     prompt_field: str) -> AsyncIterator[str]:
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
            yield _sse(api_error(e, prompt_field).body())
        finally:
            engine.abort(sub)  # a no-op unless the client went away first
        yield _sse("[DONE]")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat_request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion_request)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list",
                             "data": [model_card(config.model_name, config.max_model_len, created)]})

    @app.get("/health")
    async def health() -> JSONResponse:
        h = engine.health()
        s = h.stats
        return JSONResponse({"status": h.status, "error": h.error,
                             "num_requests_running": s.num_running_reqs,
                             "num_requests_waiting": s.num_waiting_reqs,
                             "num_kv_blocks": s.num_kv_blocks,
                             "num_free_kv_blocks": s.num_free_kv_blocks},
                            status_code=200 if h.healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(engine.stats()), media_type=CONTENT_TYPE)

    return app

"""The FastAPI app: routes, the API key, and OpenAI-style errors.

    app = create_app(engine_loop, model_name="m", api_key=None)   # engine_loop None: still loading
    attach_engine(app, engine_loop, default_params)                # /health turns 200

default_params: what a request's missing sampling fields take (LLM.get_default_sampling_params:
the model's generation_config.json); SamplingParams() when not given.

Request bodies are read and validated here (protocol.py, strict), not by FastAPI's own
parsing, so every problem comes back as one OpenAI error body naming the field. A generation
request is prepared (chat template, tokenization: on a worker thread, so a huge prompt never
stalls the other clients) and submitted before any response byte: a bad one is a 400, and it
never reaches (or disturbs) the running batch. From its submission on, one Generation holds the
request's engine requests, and whatever ends the response (its end, an error, the client
leaving at any point) closes it, which aborts what still runs.

A client may bound a generation request's time with the header `X-Request-Timeout: SECONDS`
(counted from its arrival): past it the request is aborted, and answered 408 (a stream ends
with an error event and [DONE]).
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hybrid_engine.sampling_params import SamplingParams

from . import chat, completions
from .chat_template import render_chat
from .engine_client import EngineClient
from .errors import APIError, bad_request_from_validation, error_response, lone_surrogate_error
from .limits import DEFAULT_MAX_WAITING_REQUESTS
from .metrics import ServerMetrics, read_engine_gauges
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                       ModelCard, ModelList, TokenizeRequest, TokenizeResponse, now)
from .sse import DONE, EventStreamResponse, event

TIMEOUT_HEADER = "x-request-timeout"


class ServeState:
    """What the routes share: the served name, and the engine client once the model has loaded."""

    def __init__(self, model_name: str, max_waiting_requests: int):
        self.model_name = model_name
        self.max_waiting_requests = max_waiting_requests
        self.client: EngineClient | None = None
        self.metrics: ServerMetrics | None = None
        self.created = now()

    def ready_client(self) -> EngineClient:
        if self.client is None:
            raise APIError(503, "the model is still loading; retry when /health answers 200")
        self.client.check_admitting()
        return self.client

    async def drain(self, timeout: float, stop_now: Callable[[], bool]) -> None:
        """Shutdown (server.py): new requests get 503 from now on, requests in flight get up to
        timeout seconds to finish, the rest are aborted with an error."""
        if self.client is not None:   # else the model is still loading: nothing to wait for
            await self.client.drain(timeout, stop_now)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`", "model")


def create_app(engine_loop=None, model_name: str = "default", api_key: str | None = None,
               default_params: SamplingParams | None = None,
               max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS) -> FastAPI:
    app = FastAPI(title="hybrid-engine", docs_url=None, redoc_url=None, openapi_url=None)
    state = app.state.serve = ServeState(model_name, max_waiting_requests)
    if engine_loop is not None:
        attach_engine(app, engine_loop, default_params)

    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):   # a bug or an engine fault: still an OpenAI body
        return error_response(500, f"{type(e).__name__}: {e}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.get("/health")
    async def health():
        try:
            state.ready_client()
        except APIError as e:
            return e.response()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        client = state.ready_client()
        return ModelList(data=[ModelCard(id=state.model_name, created=state.created, root=client.engine.config.model,
                                         max_model_len=client.engine.max_model_len)]).model_dump()

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        return await _generate(request, CompletionRequest, completions)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        return await _generate(request, ChatCompletionRequest, chat)

    async def _generate(request: Request, model_cls, endpoint):
        deadline = _deadline(request)
        req = await _parse(request, model_cls)
        state.check_model(req.model)
        client = state.ready_client()
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed with stream true", "stream_options")
        try:
            plan = await asyncio.to_thread(endpoint.prepare, req, client)
            gen = client.generate(plan.choices, plan.request_id, deadline)
        except ValueError as e:   # the engine's validation: the message names the field
            raise APIError(400, str(e)) from None
        # From here on every way out closes gen (nothing awaits before the response takes it).
        name = state.model_name
        if req.stream:
            return EventStreamResponse(_guarded(endpoint.events(req, plan, gen, client, name)), on_close=gen.close)
        try:
            result = await _unless_disconnected(request, endpoint.complete(req, plan, gen, client, name))
        finally:
            gen.close()
        return JSONResponse(result.model_dump())

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse(request, TokenizeRequest)
        state.check_model(req.model)
        engine = state.ready_client().engine
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if engine.tokenizer is None:
            raise APIError(400, "the model has no tokenizer")
        ids = await asyncio.to_thread(_tokenize, engine.tokenizer, req)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await _parse(request, DetokenizeRequest)
        state.check_model(req.model)
        engine = state.ready_client().engine
        if engine.tokenizer is None:
            raise APIError(400, "the model has no tokenizer")
        vocab = engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens)).model_dump()

    @app.get("/metrics")
    async def metrics():
        gauges = None
        if state.client is not None and not state.client.engine_loop.is_dead:   # a dead loop would never answer
            loop = state.client.engine_loop
            gauges = await asyncio.to_thread(loop.run_on_loop, read_engine_gauges)
        body = (state.metrics or ServerMetrics(state.model_name)).render(gauges)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def attach_engine(app: FastAPI, engine_loop, default_params: SamplingParams | None = None) -> None:
    """The model has loaded: serve it."""
    state: ServeState = app.state.serve
    state.metrics = ServerMetrics(state.model_name, engine_loop.engine.num_speculative_tokens)
    state.client = EngineClient(engine_loop, state.metrics, state.max_waiting_requests,
                                default_params or SamplingParams())


def _deadline(request: Request) -> float | None:
    """X-Request-Timeout (seconds, from now) as a time.monotonic() deadline."""
    given = request.headers.get(TIMEOUT_HEADER)
    if given is None:
        return None
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise APIError(400, f"X-Request-Timeout: must be a positive number of seconds, got {given!r}",
                       "X-Request-Timeout")
    return time.monotonic() + seconds


async def _parse(request: Request, model_cls):
    try:
        body = await request.body()
    except ClientDisconnect:   # not a server error: nobody is left to answer
        raise APIError(499, "the client closed the request before sending all of it") from None
    try:
        return model_cls.model_validate_json(body or b"{}")
    except pydantic.ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors()):
            raise lone_surrogate_error(body) or bad_request_from_validation(e) from None
        raise bad_request_from_validation(e) from None


def _tokenize(tokenizer, req: TokenizeRequest) -> list[int]:
    text = req.prompt if req.prompt is not None else render_chat(
        tokenizer, req.messages, req.tools, req.chat_template_kwargs, req.add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)


async def _guarded(events):
    """After the first byte the status is sent: a failure becomes an error event, then [DONE]."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as e:
        if not isinstance(e, APIError):
            e = APIError(400 if isinstance(e, ValueError) else 500, str(e) or type(e).__name__)
        yield event(e.body())
        yield DONE
    finally:
        await events.aclose()


class APIKeyCheck:
    """`Authorization: Bearer <key>` on every path but /health. Plain ASGI (not an
    @app.middleware), so streamed responses and disconnects pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key: send `Authorization: Bearer <key>`")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _unless_disconnected(request: Request, work):
    """Runs a non-streaming request's work, cancelling it (its finally aborts the engine
    requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise APIError(499, "the client closed the request")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

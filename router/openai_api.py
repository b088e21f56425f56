"""The router's OpenAI-compatible HTTP API: ``create_app(router)`` builds the FastAPI application.

A request's path:

    POST /v1/completions | /v1/chat/completions
      -> CompletionRequest / ChatCompletionRequest (openai_protocol.py)  shape and types     -> 400, param named
      -> .sampling_params()                                               values and ranges   -> 400, param named
      -> chat only: router.apply_chat_template(messages)                  the prompt text     -> StatusError
      -> router.make_request(prompt, params)                              tokenized, checked  -> StatusError
      -> router.generate(request): OutputDelta..., then one Completion     routed to the pods  -> StatusError
      -> stream: the first item is awaited before any byte is sent, so an error that comes before it
                 (429 full, 503 no pod, 504 deadline) is still an HTTP status; then one SSE event per
                 delta, a finish chunk, a usage chunk if stream_options.include_usage, and [DONE].
                 An error after that is an ``{"error": ...}`` event, then [DONE].
         or not: the deltas are joined into one response.

A client that hangs up stops its request: the generator of ``router.generate`` is closed (``aclose``), which
is how the router learns to cancel the pods' work. Streams notice through Starlette's disconnect listener;
a non-streamed request races the generation against the connection's ``http.disconnect`` message.

Every error is OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status
that ``StatusError.http_status`` gives its gRPC code; ``code`` is the gRPC code's name, lower case, so that
HTTP and gRPC clients read the same reason. Also served: ``GET /v1/models``, ``GET /health`` (200 when a
decode-capable pod is known, else 503), ``GET /pods`` (every pod the router knows: role, whether it routes to
it, its last load report) and ``GET /metrics`` (Prometheus).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing, suppress
from typing import TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.openai_protocol import (
    ChatCompletionFormatter,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    InvalidParameter,
    ModelCard,
    ModelList,
    TextCompletionFormatter,
)
from router.router import Completion, OutputDelta, Router
from runtime.errors import StatusError

logger = logging.getLogger(__name__)

T = TypeVar("T")
RouterOutputs = AsyncGenerator[OutputDelta | Completion, None]
Formatter = TextCompletionFormatter | ChatCompletionFormatter

_DONE_EVENT = "data: [DONE]\n\n"
_REQUEST_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)

# OpenAI's error types by HTTP status; a status not listed gets the 4xx or 5xx default.
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_error",
    499: "cancelled_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(StatusError):
    """A ``StatusError`` raised by the HTTP layer itself, naming the request field at fault (``param``)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(code, message)
        self.param = param


def create_app(router: Router) -> FastAPI:
    """The HTTP API in front of ``router``; serve it with uvicorn."""
    app = FastAPI(title="splitserve router", summary="OpenAI-compatible API of a disaggregated LLM server")
    api = OpenAIRoutes(router)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/pods", api.pods, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_exception_handler(StatusError, _answer_router_error)
    app.add_exception_handler(InvalidParameter, _answer_invalid_parameter)
    app.add_exception_handler(RequestValidationError, _answer_validation_error)
    app.add_exception_handler(StarletteHTTPException, _answer_http_exception)
    app.add_middleware(UnexpectedErrorsAsJSON)
    return app


class OpenAIRoutes:
    """The endpoints, bound to one router."""

    def __init__(self, router: Router):
        self.router = router
        self.model_card = ModelCard(id=router.model_name, created=int(time.time()))

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        return await self._generate(request, body, body.prompt, TextCompletionFormatter)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        prompt = self.router.apply_chat_template(body.chat_messages())
        return await self._generate(request, body, prompt, ChatCompletionFormatter)

    async def models(self) -> ModelList:
        return ModelList(data=[self.model_card])

    async def model(self, model_id: str) -> ModelCard:
        self._check_model(model_id)
        return self.model_card

    async def health(self) -> JSONResponse:
        if self.router.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "no decode-capable pod is known"}, status_code=503)

    async def pods(self) -> JSONResponse:
        return JSONResponse({"pods": self.router.pods()})

    async def metrics(self) -> Response:
        exposition, content_type = self.router.metrics.exposition()
        return Response(exposition, media_type=content_type)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.router.model_name:
            raise APIError(grpc.StatusCode.NOT_FOUND,
                           f"the model {model!r} does not exist; this server serves {self.router.model_name!r}",
                           param="model")

    async def _generate(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                        prompt: str | list[int], formatter_class: type[Formatter]) -> Response:
        router_request = self.router.make_request(prompt, body.sampling_params())
        formatter = formatter_class(router_request.request_id, self.router.model_name, self._token_text,
                                    router_request.params.logprobs)
        outputs = self.router.generate(router_request)
        if body.stream:
            first = await _first_output(request, outputs)
            return ServerSentEvents(_events(first, outputs, formatter, body.include_usage))
        deltas, completion = await _until_disconnected(request, _collect(outputs))
        _raise_unless_finished(completion, formatter.response_id)
        return _json(formatter.response(deltas, completion))

    def _token_text(self, token_id: int) -> str:
        # A token's own text, special tokens included: logprobs describe every token the model produced.
        return self.router.tokenizer.decode([token_id], skip_special_tokens=False)


# ------------------------------------------------------------------------------------------- generation


async def _first_output(request: Request, outputs: RouterOutputs) -> OutputDelta | Completion:
    """The first output, awaited before the response starts, so that an early error is still an HTTP status."""
    try:
        return await _until_disconnected(request, anext(outputs))
    except BaseException:
        await outputs.aclose()
        raise


async def _collect(outputs: RouterOutputs) -> tuple[list[OutputDelta], Completion]:
    async with aclosing(outputs):
        *deltas, completion = [output async for output in outputs]
    return deltas, completion


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client hangs up first: then ``work`` is cancelled (which closes the router's
    generator inside it) and the request ends as CANCELLED."""
    work_task = asyncio.ensure_future(work)
    hangup_task = asyncio.ensure_future(_hangup(request))
    try:
        await asyncio.wait((work_task, hangup_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with suppress(asyncio.CancelledError):
                await work_task  # let the router's generator finish its cleanup before we go on
    if work_task.cancelled():
        raise APIError(grpc.StatusCode.CANCELLED, "the client closed the connection")
    return work_task.result()


async def _hangup(request: Request) -> None:
    """Returns when the client closes the connection. The body is read by now, so the next message the
    server has for us is ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _raise_unless_finished(completion: Completion, response_id: str) -> None:
    """"stop" and "length" are answers; "abort" and "error", which OpenAI's API has no words for, are errors."""
    if completion.finish_reason == "abort":
        raise APIError(grpc.StatusCode.CANCELLED, f"request {response_id} was aborted before it finished")
    if completion.finish_reason == "error":
        raise completion.error or APIError(grpc.StatusCode.INTERNAL, f"request {response_id} failed on the pods")


# --------------------------------------------------------------------------------------------- streaming


class ServerSentEvents(StreamingResponse):
    """A ``text/event-stream`` response that closes its event generator however the response ends (finished,
    client gone, server stopping). That closes the router's generator, which cancels the pods' work."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]):
        # Neither caches nor proxies (nginx) may hold events back: each must reach the client when produced.
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


async def _events(first: OutputDelta | Completion, outputs: RouterOutputs, formatter: Formatter,
                  include_usage: bool) -> AsyncGenerator[str, None]:
    """The SSE body: opening chunks, one chunk per delta, the finish chunk, the usage chunk, then [DONE];
    an error on the way becomes an ``{"error": ...}`` event before [DONE]."""
    async with aclosing(outputs):
        try:
            for chunk in formatter.opening_chunks():
                yield _event(chunk)
            output = first
            while isinstance(output, OutputDelta):
                chunk = formatter.delta_chunk(output)
                if chunk is not None:
                    yield _event(chunk)
                output = await anext(outputs)
            _raise_unless_finished(output, formatter.response_id)
            yield _event(formatter.finish_chunk(output))
            if include_usage:
                yield _event(formatter.usage_chunk(output))
        except Exception as error:  # the status line is gone: the error can only be an event now
            if not isinstance(error, StatusError):
                logger.exception("stream of %s failed", formatter.response_id)
            yield _event(_error_response(error))
    yield _DONE_EVENT


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


# ------------------------------------------------------------------------------------------------ errors


async def _answer_router_error(request: Request, error: StatusError) -> Response:
    headers = None if error.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    return _json(_error_response(error), error.http_status, headers=headers)


async def _answer_invalid_parameter(request: Request, error: InvalidParameter) -> Response:
    return await _answer_router_error(request, APIError(grpc.StatusCode.INVALID_ARGUMENT, error.message, error.param))


async def _answer_validation_error(request: Request, error: RequestValidationError) -> Response:
    """pydantic's first complaint about the body, with the field it is about as ``param``."""
    first = error.errors()[0]
    param = _param_path(first["loc"])
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return await _answer_router_error(request, APIError(grpc.StatusCode.INVALID_ARGUMENT, message, param))


async def _answer_http_exception(request: Request, error: StarletteHTTPException) -> Response:
    # Routing's own errors (404 no such route, 405 wrong method) have no gRPC code.
    body = ErrorResponse(error=ErrorInfo(message=str(error.detail), type=_error_type(error.status_code)))
    return _json(body, error.status_code, headers=error.headers)


class UnexpectedErrorsAsJSON:
    """ASGI middleware: an exception no handler knows (a bug) is logged and answered 500 in OpenAI's shape.

    Not ``add_exception_handler(Exception, ...)``: Starlette re-raises after such a handler answers, and uvicorn
    then closes the connection, failing whatever request the client sends next on it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response_started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as error:
            if response_started:  # too late for a status: let the server end the connection
                raise
            logger.exception("%s %s failed", scope["method"], scope["path"])
            await _json(_error_response(error), 500)(scope, receive, send)


def _error_response(error: Exception) -> ErrorResponse:
    if not isinstance(error, StatusError):
        error = StatusError(grpc.StatusCode.INTERNAL, "internal server error")
    param = error.param if isinstance(error, APIError) else _field_named_in(error)
    info = ErrorInfo(message=error.message, type=_error_type(error.http_status), param=param,
                     code=error.code.name.lower())
    return ErrorResponse(error=info)


def _field_named_in(error: StatusError) -> str | None:
    """The router starts its INVALID_ARGUMENT messages with the field at fault ("prompt: must not be empty")."""
    name, colon, _ = error.message.partition(":")
    if error.code == grpc.StatusCode.INVALID_ARGUMENT and colon and name in _REQUEST_FIELDS:
        return name
    return None


def _error_type(http_status: int) -> str:
    return _ERROR_TYPES.get(http_status, "invalid_request_error" if http_status < 500 else "server_error")


def _param_path(loc: tuple[int | str, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"; None when the error is not about a field
    (the body is missing, or not JSON)."""
    if len(loc) < 2 or loc[0] != "body" or not isinstance(loc[1], str):
        return None
    path = loc[1]
    for part in loc[2:]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _json(model: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, headers=headers, media_type="application/json")

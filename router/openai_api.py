"""The router's OpenAI-compatible HTTP API: ``create_app(router)`` builds the FastAPI application.

A request's path:

    middleware (outermost first): CORS (when cors_allowed_origins) -> API key (when api_keys; 401)
      -> body size (max_request_bytes; 413, before the body is parsed) -> X-Request-Id on every answer
    POST /v1/completions | /v1/chat/completions
      -> CompletionRequest / ChatCompletionRequest (openai_requests.py)  shape and types     -> 400, param named
      -> the request id: X-Request-Id header or request_id field         validated           -> 400
      -> .sampling_params()                                               values and ranges   -> 400, param named
      -> chat only: router.apply_chat_template(messages, options)         the prompt text     -> StatusError
      -> router.make_request(prompt, params, id)                          limits, tokenized   -> StatusError
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
HTTP and gRPC clients read the same reason. Also served: ``GET /v1/models`` (with ``max_model_len``),
``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), ``GET /version``, ``GET /health`` (200 when a
decode-capable pod is known, else 503), ``GET /pods`` (every pod the router knows: role, whether it routes to
it, its last load report) and ``GET /metrics`` (Prometheus). With API keys configured, every path but
``auth_exempt_paths`` (``/health`` and ``/metrics`` by default) needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Iterator
from contextlib import aclosing, contextmanager, suppress
from importlib import metadata
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api_keys import APIKeys
from router.openai_format import ChatCompletionFormatter, TextCompletionFormatter
from router.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InvalidParameter,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    tokenize_request,
)
from router.openai_responses import (
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from router.router import Completion, OutputDelta, Router, check_request_id
from runtime.errors import StatusError

logger = logging.getLogger(__name__)

T = TypeVar("T")
RouterOutputs = AsyncGenerator[OutputDelta | Completion, None]
Formatter = TextCompletionFormatter | ChatCompletionFormatter
GenerationRequest = CompletionRequest | ChatCompletionRequest

_DONE_EVENT = "data: [DONE]\n\n"
REQUEST_ID_HEADER = "X-Request-Id"

# OpenAI's error types by HTTP status; a status not listed gets the 4xx or 5xx default.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
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
    """The HTTP API in front of ``router`` (its ``config`` sets the limits, API keys and CORS); serve it with
    uvicorn."""
    config = router.config
    app = FastAPI(title="splitserve router", summary="OpenAI-compatible API of a disaggregated LLM server",
                  version=package_version())
    api = OpenAIRoutes(router)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/pods", api.pods, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_exception_handler(StatusError, _answer_router_error)
    app.add_exception_handler(InvalidParameter, _answer_invalid_parameter)
    app.add_exception_handler(RequestValidationError, _answer_validation_error)
    app.add_exception_handler(StarletteHTTPException, _answer_http_exception)
    # Added innermost first: a request meets CORS, the API key check, the body limit, then the request id.
    app.add_middleware(UnexpectedErrorsAsJSON)
    app.add_middleware(RequestIdHeader)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    if config.api_keys:
        app.add_middleware(APIKeyAuth, keys=APIKeys(config.api_keys), exempt_paths=config.auth_exempt_paths)
    if config.cors_allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_allowed_origins,
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
                           expose_headers=[REQUEST_ID_HEADER])
    return app


def package_version() -> str:
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


class OpenAIRoutes:
    """The endpoints, bound to one router."""

    def __init__(self, router: Router):
        self.router = router
        self.model_card = ModelCard(id=router.model_name, root=router.model_name, created=int(time.time()),
                                    max_model_len=router.config.max_model_len)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        return await self._generate(request, body, body.prompt, TextCompletionFormatter)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        return await self._generate(request, body, None, ChatCompletionFormatter)

    async def tokenize(self, request: Request) -> TokenizeResponse:
        data = await _json_body(request)
        body = _validated(tokenize_request(data), data)  # a prompt or a chat, told apart as vLLM does
        self._check_model(body.model)
        with _params_named_by(body):
            prompt = body.prompt if isinstance(body, TokenizeCompletionRequest) else await self._render_chat(body)
            tokens = await self.router.tokenize(prompt, body.add_special_tokens)
        token_strs = [self.router.tokenizer.id_to_token(t) or "" for t in tokens] if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.router.config.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        with _params_named_by(body):
            return DetokenizeResponse(prompt=await self.router.detokenize(body.tokens))

    async def version(self) -> VersionResponse:
        return VersionResponse(version=package_version())

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

    async def _render_chat(self, body: ChatCompletionRequest | TokenizeChatRequest) -> str:
        return await self.router.apply_chat_template(
            body.chat_messages(), add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, template_kwargs=body.chat_template_kwargs)

    async def _generate(self, request: Request, body: GenerationRequest, prompt: str | list[int] | None,
                        formatter_class: type[Formatter]) -> Response:
        request_id = _request_id(request, body.request_id)
        with _params_named_by(body):
            params = body.sampling_params()  # the cheap checks before the chat template and the tokenizer
            if prompt is None:
                prompt = await self._render_chat(body)
            router_request = await self.router.make_request(prompt, params, request_id,
                                                            add_special_tokens=body.add_special_tokens)
        request.state.request_id = router_request.request_id  # the X-Request-Id of the answer
        formatter = formatter_class(router_request.request_id, self.router.model_name, self._token_text,
                                    router_request.params.logprobs, len(router_request.prompt_token_ids),
                                    body.continuous_usage)
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


def _request_id(request: Request, in_body: str | None) -> str | None:
    """The client's id for the request: the X-Request-Id header or vLLM's ``request_id`` field (None: the router
    makes one). Both given must agree."""
    header = request.headers.get(REQUEST_ID_HEADER)
    if header is not None:
        try:
            check_request_id(header, REQUEST_ID_HEADER)
        except StatusError as error:
            raise APIError(error.code, error.message) from None
        if in_body is not None and in_body != header:
            raise APIError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"request_id: {in_body!r} differs from the {REQUEST_ID_HEADER} header {header!r}",
                           param="request_id")
    return header if header is not None else in_body


@contextmanager
def _params_named_by(body: BaseModel) -> Iterator[None]:
    """Within it, a router error naming a field (``"prompt: ..."``) names it as ``body`` spells it (a chat's
    prompt is its ``messages``, its ``logprobs`` are ``top_logprobs``...)."""
    try:
        yield
    except APIError:
        raise
    except StatusError as error:
        param = _field_named_in(error, body)
        if param is None:
            raise
        raise APIError(error.code, _renamed(error.message, param), param) from None


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as error:  # not JSON, or not UTF-8
        raise APIError(grpc.StatusCode.INVALID_ARGUMENT, f"the body is not valid JSON: {error}") from None


def _validated(model: type[T], data: Any) -> T:
    """``model`` from a request's JSON body; errors as FastAPI's own body validation reports them."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None


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
    complaint = _UNKNOWN_FIELD if first["type"] == "extra_forbidden" else first["msg"]
    message = f"{param}: {complaint}" if param else complaint
    return await _answer_router_error(request, APIError(grpc.StatusCode.INVALID_ARGUMENT, message, param))


_UNKNOWN_FIELD = "unknown field; this server refuses fields it does not know rather than ignore them (docs/api.md)"


async def _answer_http_exception(request: Request, error: StarletteHTTPException) -> Response:
    # Routing's own errors (404 no such route, 405 wrong method) have no gRPC code; a body FastAPI could not
    # read (not UTF-8) is a bad argument like any other.
    message, code = str(error.detail), None
    if isinstance(error.__cause__, UnicodeDecodeError):
        message, code = f"the body is not valid UTF-8: {error.__cause__}", "invalid_argument"
    body = ErrorResponse(error=ErrorInfo(message=message, type=_error_type(error.status_code), code=code))
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


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 before any of it is parsed. A declared
    Content-Length over the limit is refused unread; a body sent in chunks is read up to the limit, then refused.
    The body read here is handed on whole, so the application reads it as usual."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(int(declared), scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._refuse(size, scope, receive, send, read_all=not more)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect listener's turn

        await self.app(scope, replay, send)

    async def _refuse(self, size: int, scope: Scope, receive: Receive, send: Send, read_all: bool = True) -> None:
        error = APIError(grpc.StatusCode.INVALID_ARGUMENT, f"the request body ({'at least ' if not read_all else ''}"
                         f"{size} bytes) is larger than the limit of {self.max_bytes} bytes (max_request_bytes)")
        # The connection cannot be reused with an unread body behind the answer: close it.
        await _json(_error_response(error), 413, headers={"Connection": "close"})(scope, receive, send)


class APIKeyAuth:
    """ASGI middleware: every path but ``exempt_paths`` needs ``Authorization: Bearer <key>`` with one of the
    router's API keys (``router.api_keys``); else 401 in OpenAI's shape."""

    def __init__(self, app: ASGIApp, keys: APIKeys, exempt_paths: list[str]):
        self.app = app
        self.keys = keys
        self.exempt_paths = frozenset("/" + path.lstrip("/") for path in exempt_paths)  # "health" is "/health"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        problem = self.keys.problem(Headers(scope=scope).get("authorization"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        error = APIError(grpc.StatusCode.UNAUTHENTICATED, problem)
        await _json(_error_response(error), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


class RequestIdHeader:
    """ASGI middleware: every answer to a request with an id carries it in X-Request-Id: the router's id of a
    generation (the client's, or the one the router made), or else the valid X-Request-Id the client sent."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                request_id = scope.get("state", {}).get("request_id") or _valid_header_id(scope)
                if request_id is not None:
                    MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def _valid_header_id(scope: Scope) -> str | None:
    header = Headers(scope=scope).get(REQUEST_ID_HEADER)
    try:
        check_request_id(header, REQUEST_ID_HEADER) if header is not None else None
    except StatusError:
        return None
    return header


def _error_response(error: Exception) -> ErrorResponse:
    if not isinstance(error, StatusError):
        error = StatusError(grpc.StatusCode.INTERNAL, "internal server error")
    param = error.param if isinstance(error, APIError) else None
    info = ErrorInfo(message=error.message, type=_error_type(error.http_status), param=param,
                     code=error.code.name.lower())
    return ErrorResponse(error=info)


def _field_named_in(error: StatusError, body: BaseModel) -> str | None:
    """The body's name for the field an INVALID_ARGUMENT message starts with ("prompt: must not be empty",
    "stop[3]: ..."), keeping its index or sub-field; None when the message names no field of the body."""
    prefix, colon, _ = error.message.partition(":")
    named = re.fullmatch(r"([A-Za-z_]+)((?:\[\d+\]|\.[A-Za-z_]+)*)", prefix)
    if error.code != grpc.StatusCode.INVALID_ARGUMENT or not colon or named is None:
        return None
    field, rest = named.groups()
    if hasattr(body, "param_name"):
        param = body.param_name(field)
    else:
        fields = type(body).model_fields
        param = "messages" if field == "prompt" and "messages" in fields else field if field in fields else None
    return None if param is None else param + rest


def _renamed(message: str, param: str) -> str:
    """``message`` with the field it starts with replaced by ``param``."""
    return param + ":" + message.partition(":")[2]


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

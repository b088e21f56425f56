"""The HTTP API's ASGI middleware, outermost first as ``create_app`` stacks it (CORS, Starlette's own, outside):

    APIKeyAuth (when api_keys; 401) -> BodySizeLimit (max_request_bytes; 413, before the body is parsed)
      -> RequestIdHeader (X-Request-Id on every answer) -> UnexpectedErrorsAsJSON (a bug: 500, logged)

Each is plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, so that a streamed answer passes through
untouched and a refusal is sent before the application reads a byte of the body.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import grpc
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.router.api_keys import APIKeys
from splitserve.router.intake import check_request_id
from splitserve.router.openai.errors import APIError, error_response, json_response
from splitserve.runtime.errors import StatusError

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"


class _HTTPMiddleware(ABC):
    """An ASGI middleware of HTTP requests: everything else (lifespan events) passes through to ``app`` untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    @abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The middleware's work on one HTTP request."""


class UnexpectedErrorsAsJSON(_HTTPMiddleware):
    """ASGI middleware: an exception no handler knows (a bug) is logged and answered 500 in OpenAI's shape.

    Not ``add_exception_handler(Exception, ...)``: Starlette re-raises after such a handler answers, and uvicorn
    then closes the connection, failing whatever request the client sends next on it."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
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
            await json_response(error_response(error), 500)(scope, receive, send)


class BodySizeLimit(_HTTPMiddleware):
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 before any of it is parsed. A declared
    Content-Length over the limit is refused unread; a body sent in chunks is read up to the limit, then refused.
    The body read here is handed on whole, so the application reads it as usual."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        await json_response(error_response(error), 413, headers={"Connection": "close"})(scope, receive, send)


class APIKeyAuth(_HTTPMiddleware):
    """ASGI middleware: every path but ``exempt_paths`` needs ``Authorization: Bearer <key>`` with one of the
    router's API keys (``splitserve.router.api_keys``); else 401 in OpenAI's shape."""

    def __init__(self, app: ASGIApp, keys: APIKeys, exempt_paths: list[str]):
        super().__init__(app)
        self.keys = keys
        self.exempt_paths = frozenset("/" + path.lstrip("/") for path in exempt_paths)  # "health" is "/health"

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        problem = self.keys.problem(Headers(scope=scope).get("authorization"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        error = APIError(grpc.StatusCode.UNAUTHENTICATED, problem)
        await json_response(error_response(error), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


class RequestIdHeader(_HTTPMiddleware):
    """ASGI middleware: every answer to a request with an id carries it in X-Request-Id: the router's id of a
    generation (the client's, or the one the router made), or else the valid X-Request-Id the client sent."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:

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

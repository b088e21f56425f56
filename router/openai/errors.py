"""The HTTP API's errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error answer goes through ``error_response``: its HTTP status is the one ``StatusError.http_status`` gives
its gRPC code, ``type`` is OpenAI's name for that status, and ``code`` is the gRPC code's name, lower case, so that
HTTP and gRPC clients read the same reason. ``add_error_handlers`` answers the errors a request can raise:

- ``StatusError`` (the router's, and ``APIError``, the HTTP layer's own, which names the field at fault), with
  ``Retry-After`` when the error carries a hint (429, 503);
- ``InvalidParameter`` (a request model's ``sampling_params()``) and FastAPI's ``RequestValidationError``
  (pydantic's first complaint, its field as ``param``): 400;
- Starlette's own ``HTTPException`` (404 no such route, 405 wrong method, a body that is not UTF-8).

``field_named_in`` maps the field an INVALID_ARGUMENT message starts with to the body's name for it.
"""

from __future__ import annotations

import math
import re

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.router.openai.fields import InvalidParameter
from splitserve.router.openai.responses import ErrorInfo, ErrorResponse
from splitserve.runtime.errors import StatusError

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



def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(StatusError, _answer_router_error)
    app.add_exception_handler(InvalidParameter, _answer_invalid_parameter)
    app.add_exception_handler(RequestValidationError, _answer_validation_error)
    app.add_exception_handler(StarletteHTTPException, _answer_http_exception)


async def _answer_router_error(request: Request, error: StatusError) -> Response:
    headers = None if error.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    return json_response(error_response(error), error.http_status, headers=headers)


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
    return json_response(body, error.status_code, headers=error.headers)

def error_response(error: Exception) -> ErrorResponse:
    if not isinstance(error, StatusError):
        error = StatusError(grpc.StatusCode.INTERNAL, "internal server error")
    param = error.param if isinstance(error, APIError) else None
    info = ErrorInfo(message=error.message, type=_error_type(error.http_status), param=param,
                     code=error.code.name.lower())
    return ErrorResponse(error=info)


def field_named_in(error: StatusError, body: BaseModel) -> str | None:
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


def renamed(message: str, param: str) -> str:
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


def json_response(model: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, headers=headers, media_type="application/json")

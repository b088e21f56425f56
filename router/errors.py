"""``RouterError``: the router's one error model, a gRPC status code and a message for a human.

Every failure the router reports, whatever caused it (bad input, no pod, full pods, a pod's own error status,
a timeout), becomes a ``RouterError`` before it leaves ``Router``. The gRPC API aborts the call with its code;
the HTTP API answers with ``http_status``. A pod's error status keeps its code on the way through
(``from_pod_error``), so that a client learns why, not just that, a request failed.
"""

from __future__ import annotations

import grpc

# The HTTP answer for each gRPC code the router uses. 499 is nginx's "client closed request", the usual
# spelling of CANCELLED in HTTP logs.
HTTP_STATUS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class RouterError(Exception):
    """A request failed with ``code`` (a ``grpc.StatusCode``); ``message`` says why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS_BY_CODE.get(self.code, 500)

    def __repr__(self) -> str:
        return f"RouterError({self.code.name}, {self.message!r})"


def from_pod_error(error: grpc.aio.AioRpcError, pod_address: str) -> RouterError:
    """A pod's failed call, with the pod named so that logs and clients can tell which one failed."""
    return RouterError(error.code(), f"pod {pod_address}: {error.details() or error.code().name}")

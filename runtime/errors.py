"""``StatusError``: the one error model of every splitserve process, a gRPC status code and a message for a human.

Every failure a request meets, whatever caused it (bad input, no pod, full pods, a bad KV chunk, a pod's own
error status, a timeout), becomes a ``StatusError`` before it leaves the module that saw it. A gRPC servicer
aborts the call with its ``code``; the router's HTTP API answers with ``http_status``. A peer's error status
keeps its code on the way through (``from_rpc_error``), so that a client learns why, not just that, a request
failed.
"""

from __future__ import annotations

import grpc

# The HTTP answer for each gRPC code. CANCELLED is 499 (nginx's "client closed request"): it only ever reaches
# a client whose own cancellation it reports; a server-side cancellation is turned into UNAVAILABLE first.
HTTP_STATUS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class StatusError(Exception):
    """A request failed with ``code`` (a ``grpc.StatusCode``); ``message`` says why. ``retry_after_s``: when a
    refused request (RESOURCE_EXHAUSTED) is worth sending again (HTTP ``Retry-After``, gRPC
    ``grpc-retry-pushback-ms``). ``peer``: the address of the process whose call failed, where a peer's status
    it is (``from_rpc_error``)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 peer: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.peer = peer

    @property
    def http_status(self) -> int:
        return HTTP_STATUS_BY_CODE.get(self.code, 500)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.message!r})"


def from_rpc_error(error: grpc.aio.AioRpcError, peer: str) -> StatusError:
    """A peer's failed call, with the peer named so that logs and clients can tell which one failed."""
    return StatusError(error.code(), f"pod {peer}: {error.details() or error.code().name}", peer=peer)

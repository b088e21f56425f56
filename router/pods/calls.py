"""One request's calls to its pods, as its run (``router/request_run.py``) holds them: ``PodCalls``, and
``DecodeStream``, the decode pod's stream of the request.

- every call is ``track``-ed, so that ``abort`` (the client's Abort) and ``cancel`` (the request ended) cancel them
  all: a pod whose call is cancelled aborts the request there and frees its blocks;
- every call is awaited through ``await_pod`` / ``read``, which turn a pod's failure into a ``StatusError``: a pod's
  own CANCELLED (it was shutting down) is UNAVAILABLE, a call past the request's deadline is DEADLINE_EXCEEDED, and a
  call cancelled by ``abort`` is CANCELLED;
- ``hold`` counts the request on a pod (``PodInfo``'s router-side load: a request in flight, its prompt tokens to
  prefill, the KV blocks it is about to take) until the hold is released, so that placement sees the router's own
  newest requests before the pods' next load reports do; ``release_holds`` ends them all.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from splitserve.router.intake import RouterRequest
from splitserve.router.pods.registry import PodInfo
from splitserve.runtime.errors import StatusError, from_rpc_error
from splitserve.v1 import decode_pb2


@dataclass
class PodHold:
    """One request counted on one pod (``PodInfo``'s router-side load) until released."""

    pod: PodInfo
    prompt_tokens: int  # counted in pod.queued_prompt_tokens until the first token (or the end)
    released: bool = False

    def prompt_done(self) -> None:
        self.pod.queued_prompt_tokens -= self.prompt_tokens
        self.prompt_tokens = 0

    def release(self) -> None:
        if not self.released:
            self.prompt_done()
            self.pod.active_requests -= 1
            self.released = True


class AnsweredCall:
    """Stands for the pod call of a ``DecodeStream`` whose every message is already in hand (a prompt scored on a
    prefill pod: nothing to decode, so no decode pod is called)."""

    def cancel(self) -> bool:
        return False

    async def read(self) -> object:
        return grpc.aio.EOF


@dataclass
class DecodeStream:
    """D's Decode call, with the messages already taken from it (or made from P's first token)."""

    call: Any
    pod: PodInfo
    hold: PodHold  # the request counted on D while the stream lasts
    prefetched: list[decode_pb2.DecodeResponse]

    @property
    def pod_address(self) -> str:
        return self.pod.address


class PodCalls:
    """The pod calls and holds of one request, which must end within ``timeout_s`` of its arrival."""

    def __init__(self, request: RouterRequest, timeout_s: float):
        self.request_id = request.request_id
        self.timeout_s = timeout_s
        self.deadline = request.arrival_time + timeout_s  # time.monotonic()
        self.aborted = False
        self._calls: list[Any] = []  # grpc.aio calls started for it
        self._holds: list[PodHold] = []

    def track(self, call: Any) -> Any:
        self._calls.append(call)
        return call

    def hold(self, pod: PodInfo, prompt_tokens: int = 0, kv_tokens: int = 0) -> PodHold:
        """Count the request on ``pod`` (until released): one more request in flight there, with ``prompt_tokens``
        to prefill and the KV of ``kv_tokens`` about to take its blocks."""
        pod.active_requests += 1
        pod.queued_prompt_tokens += prompt_tokens
        pod.blocks_since_report += pod.blocks_for(kv_tokens) if kv_tokens else 0
        hold = PodHold(pod, prompt_tokens)
        self._holds.append(hold)
        return hold

    def abort(self) -> None:
        """The client's Abort: every call cancelled, and those still awaited end as CANCELLED."""
        self.aborted = True
        self.cancel()

    def cancel(self) -> None:
        for call in self._calls:
            call.cancel()  # a no-op for calls already done

    def release_holds(self) -> None:
        for hold in self._holds:
            hold.release()
        self._holds.clear()

    def time_left(self) -> float:
        """Seconds until the request's deadline; DEADLINE_EXCEEDED when it passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"request {self.request_id} passed its {self.timeout_s:g} s deadline")
        return left

    def out_of_time(self) -> bool:
        return time.monotonic() >= self.deadline

    async def await_pod(self, call: Any, pod_address: str) -> Any:
        """The call's result; its failure as a StatusError, and abort() (which cancels it) as CANCELLED."""
        try:
            return await call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.aborted and current is not None and not current.cancelling():
                raise StatusError(grpc.StatusCode.CANCELLED, "aborted") from None
            raise  # the client went away: let the cancellation through
        except grpc.aio.AioRpcError as error:
            raise self._pod_error(error, pod_address) from None

    async def read(self, stream: DecodeStream) -> decode_pb2.DecodeResponse:
        """The stream's next message; a stream that ends without its complete message failed (INTERNAL)."""
        message = await self.await_pod(stream.call.read(), stream.pod_address)
        if message is grpc.aio.EOF:
            raise StatusError(grpc.StatusCode.INTERNAL,
                              f"pod {stream.pod_address}: the Decode stream ended without a complete message")
        return message

    def _pod_error(self, error: grpc.aio.AioRpcError, pod_address: str) -> StatusError:
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self.out_of_time():
            return StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"request {self.request_id} passed its {self.timeout_s:g} s "
                               f"deadline (waiting on pod {pod_address})")
        if code == grpc.StatusCode.CANCELLED:
            # Not ours (ours surfaces as asyncio.CancelledError): the pod cancelled it, shutting down.
            return StatusError(grpc.StatusCode.UNAVAILABLE,
                               f"pod {pod_address} cancelled the request ({error.details() or 'shutting down'})",
                               peer=pod_address)
        return from_rpc_error(error, pod_address)

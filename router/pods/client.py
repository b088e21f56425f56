"""``PodClient``: the router's connection to one pod, and ``PodClientPool``, one client per pod address.

The router talks to a pod only through these calls, all on one ``grpc.aio`` channel per pod:

- ``watch_health()`` / ``watch_load()``: the streams a ``PodMonitor`` follows (liveness; load after each step);
- ``prefill(...)``: on a prefill pod, prefill a prompt and push its KV to the chosen decode pod; returns the
  first token;
- ``decode(...)``: on a decode or mixed pod, the stream of the request's remaining tokens. The returned call
  is an async iterator of ``DecodeResponse``; cancelling it makes the pod abort the request and free its blocks;
- ``abort(request_id)``: frees a request wherever it is on the pod (e.g. KV pushed and never claimed); ``drop``
  does the same for a request's leftovers, where a pod out of reach is no error (its lease frees them).

Every message the router sends a pod, or makes in a pod's stead, is built here, from the router's ``RouterRequest``
and what placement decided:

- ``prefill_request``: which prompt tokens P prefills, with which sampling parameters (a split prefill's prefix:
  greedy, one token, only its KV wanted; the first of n samples: the prompt's n), which decode pod receives the KV,
  under which codec and lease;
- ``decode_request``: a prompt to prefill on D, a prompt whose KV was pushed there with its first token, a migrated
  request's tokens so far, or a split prefill's prefix pushed there;
- ``first_token_response``: the first message of D's stream when P sampled the first token (with P's prompt
  logprobs), as the router hands it to the request's run before D's own messages;
- ``scored_responses``: the whole stream of a prompt scored on P alone (max_tokens 0: no decode pod is called).

``PodClientPool.drop_in_background`` asks a pod to drop a request's leftovers without keeping the caller waiting.

Errors are left as ``grpc.aio.AioRpcError``: the router decides which ones are worth a retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.engine.sampling.params import SamplingParams
from splitserve.protos.convert import sampling_params_to_proto
from splitserve.router.intake import RouterRequest
from splitserve.runtime import transport
from splitserve.runtime.roles import Role
from splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    pod_status_pb2,
    pod_status_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
# A split prefill's prefix on P: only its KV is wanted.
SPLIT_PREFIX_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class PodClient:
    """Stubs for one pod's services, as its role serves them: Prefill for prefill pods, Decode for decode and
    mixed pods; health and PodStatus on every pod."""

    def __init__(self, address: str, role: Role, tls: transport.TLSConfig = transport.PLAINTEXT):
        self.address, self.role = address, Role(role)
        self._channel = transport.open_channel(address, tls)
        self._prefill = prefill_pb2_grpc.PrefillStub(self._channel) if self.role is Role.PREFILL else None
        self._decode = decode_pb2_grpc.DecodeStub(self._channel) if self.role.can_decode else None
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._status = pod_status_pb2_grpc.PodStatusStub(self._channel)

    def watch_health(self):
        """The pod's health, as a stream of ``HealthCheckResponse`` (the first at once, then each change)."""
        return self._health.Watch(health_pb2.HealthCheckRequest(service=""))

    def watch_load(self):
        """The pod's load, as a stream of ``PodLoad`` (the first at once, then after each engine step)."""
        return self._status.WatchLoad(pod_status_pb2.WatchLoadRequest())

    def prefill(self, request: prefill_pb2.PrefillRequest, timeout_s: float):
        """The Prefill call: await it for the ``PrefillResponse``; ``cancel()`` aborts it on the pod."""
        return self._prefill.Prefill(request, timeout=timeout_s)

    def decode(self, request: decode_pb2.DecodeRequest, timeout_s: float):
        """The Decode call: an async iterator of ``DecodeResponse``; ``cancel()`` aborts it on the pod."""
        return self._decode.Decode(request, timeout=timeout_s)

    async def abort(self, request_id: str, timeout_s: float = ABORT_TIMEOUT_S) -> bool:
        stub = self._prefill or self._decode
        response = await stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=timeout_s)
        return response.found

    async def drop(self, request_id: str) -> bool:
        """``abort`` a request's leftovers (KV pushed here and not claimed); a pod that is gone or busy frees them by
        their lease anyway, so a failure is only logged. False: the pod could not be reached (UNAVAILABLE)."""
        try:
            await self.abort(request_id)
        except grpc.aio.AioRpcError as error:
            log.debug("request %s: Abort on pod %s failed: %s", request_id, self.address, error.code().name)
            return error.code() != grpc.StatusCode.UNAVAILABLE
        return True

    async def close(self) -> None:
        await self._channel.close()


class PodClientPool:
    """One ``PodClient`` per pod address, created on first use and kept for the router's lifetime; ``tls``: the
    router's TLS towards pods."""

    def __init__(self, tls: transport.TLSConfig = transport.PLAINTEXT) -> None:
        self._clients: dict[tuple[str, Role], PodClient] = {}
        self._tls = tls
        self._background: set[asyncio.Task] = set()  # drop_in_background's calls, kept until they end

    def get(self, address: str, role: Role) -> PodClient:
        key = (address, Role(role))
        if key not in self._clients:
            self._clients[key] = PodClient(address, role, self._tls)
        return self._clients[key]

    def drop_in_background(self, address: str, role: Role, request_id: str) -> None:
        """``PodClient.drop`` of a request's leftovers on a pod, whose caller does not wait for it. Outside the event
        loop (a request's generator closed by the garbage collector) nothing is sent: the pod's leases free them."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self.get(address, role).drop(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


def prefill_request(req: RouterRequest, decode_address: str, kv_codec: str, kv_lease_s: float,
                    prefix_tokens: int = 0) -> prefill_pb2.PrefillRequest:
    """P prefills the prompt (a split prefill: its first ``prefix_tokens``) and pushes its KV to the decode pod at
    ``decode_address`` (none: scoring), in ``kv_codec``, to wait there ``kv_lease_s`` seconds."""
    # The first of n samples prefills for all of them (decode_address set: not when scoring). A prefix's KV is all
    # that is wanted of it: the token P samples after it is dropped.
    params = (SPLIT_PREFIX_PARAMS if prefix_tokens else
              req.samples.params if req.leads_samples and decode_address else req.params)
    return prefill_pb2.PrefillRequest(
        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids[:prefix_tokens or None],
        sampling_params=sampling_params_to_proto(params), decode_address=decode_address,
        kv_codec=kv_codec, kv_lease_seconds=kv_lease_s, priority=req.priority)


def decode_request(req: RouterRequest, tpot_target_s: float, *, first_token_id: int | None = None,
                   first_token_logprob: common_pb2.TokenLogprob | None = None, kv_request_id: str = "",
                   resume_token_ids: Sequence[int] = (), kv_prefix_tokens: int = 0) -> decode_pb2.DecodeRequest:
    """D runs the request: with ``first_token_id``, on the KV a prefill pod pushed there (under ``kv_request_id``
    when not the request's own id); without, D prefills the prompt (and a migrated request's ``resume_token_ids``;
    after a split prefill, only past the ``kv_prefix_tokens`` whose KV was pushed there)."""
    # The TPOT target travels with it (a hybrid decode pod keeps it while it prefills lent prompts), and so does
    # the priority (the pod's queue order and preemptions).
    request = decode_pb2.DecodeRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                       sampling_params=sampling_params_to_proto(req.params),
                                       tpot_target_seconds=tpot_target_s, priority=req.priority,
                                       kv_request_id=kv_request_id, resume_token_ids=resume_token_ids,
                                       kv_prefix_tokens=kv_prefix_tokens)
    if first_token_id is not None:
        request.first_token_id = first_token_id
    if first_token_logprob is not None:
        request.first_token_logprob.CopyFrom(first_token_logprob)
    return request


def first_token_response(first: prefill_pb2.PrefillResponse, first_token_id: int,
                         first_token_logprob: common_pb2.TokenLogprob | None) -> decode_pb2.DecodeResponse:
    """D's stream's first message for a request P prefilled: the first token P sampled (``first_token_id``: P's own,
    or one of ``more_first_token_ids`` for another of n samples), its logprob, and P's prompt logprobs."""
    chunk = decode_pb2.DecodeChunk(token_ids=[first_token_id])
    if first.HasField("prompt_logprobs"):
        chunk.prompt_logprobs.CopyFrom(first.prompt_logprobs)
    if first_token_logprob is not None:
        chunk.logprobs.tokens.append(first_token_logprob)
    return decode_pb2.DecodeResponse(chunk=chunk)


def scored_responses(req: RouterRequest, scored: prefill_pb2.PrefillResponse) -> list[decode_pb2.DecodeResponse]:
    """The whole Decode stream of a prompt scored on P (max_tokens 0): its prompt logprobs, then the end."""
    chunk = decode_pb2.DecodeChunk()
    if scored.HasField("prompt_logprobs"):
        chunk.prompt_logprobs.CopyFrom(scored.prompt_logprobs)
    complete = decode_pb2.DecodeComplete(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage(
        prompt_tokens=len(req.prompt_token_ids), cached_tokens=scored.num_cached_tokens))
    return [decode_pb2.DecodeResponse(chunk=chunk), decode_pb2.DecodeResponse(complete=complete)]

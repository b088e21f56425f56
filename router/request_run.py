"""``RequestRun``: one request in flight, from its first pod call to its ``Completion``; the router's per-request state.

``Router.generate`` makes one per request; the placement (``placement.py``) opens its pod calls, and then the run
turns D's stream into what the client gets:

1. pod calls: every call is ``track``-ed (``abort`` and a client gone cancel them all), and awaited through
   ``await_pod``/``read``, which turn a pod's failure into a ``StatusError`` (a pod's own CANCELLED, it was
   shutting down, is UNAVAILABLE; a call past the request's deadline is DEADLINE_EXCEEDED) and ``abort`` into
   CANCELLED. ``hold`` counts the request on a pod (``PodInfo``'s router-side load) until ``release_holds``;
2. streaming (``stream``): each chunk's tokens go through the run's ``IncrementalDetokenizer`` and out as an
   ``OutputDelta``; the first one's moment is the TTFT. A stop string ends the request here: the run stops
   reading and cancels D's stream, which makes D abort the request and free its blocks;
3. the end (``complete``): exactly one ``Completion`` (finish reason, usage, where the time went), whose numbers go
   to the router's metrics (latencies, tokens, goodput against ``slo_ttft_s``/``slo_tpot_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

from splitserve.engine.sequence import FinishReason
from splitserve.engine.text.detokenizer import IncrementalDetokenizer
from splitserve.protos.convert import finish_reason_from_proto, prompt_logprobs_from_proto, token_logprob_to_dict
from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.outputs import Completion, OutputDelta
from splitserve.router.pods.registry import PodInfo
from splitserve.router.route_plan import SLOTargets, blocks_for
from splitserve.runtime.errors import StatusError, from_rpc_error
from splitserve.runtime.metrics import RouterMetrics
from splitserve.v1 import decode_pb2, prefill_pb2

log = logging.getLogger(__name__)


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


@dataclass
class RequestRun:
    """One request in flight: its pod calls (to cancel), its text state, and its progress (for the metrics)."""

    request: RouterRequest
    detokenizer: IncrementalDetokenizer
    config: RouterConfig
    metrics: RouterMetrics
    on_first_token: Callable[[], None]  # the router's count of requests waiting for their first token
    calls: list[Any] = field(default_factory=list)  # grpc.aio calls started for it
    holds: list[PodHold] = field(default_factory=list)  # where it is counted
    aborted: bool = False
    finish_reason: FinishReason | None = None  # set once its Completion is made
    kv_sent_to: list[PodInfo] = field(default_factory=list)  # decode pods a prefill pod was asked to push its KV to
    # Decode pods that failed it after its first token, and when (time.monotonic()): passed over by migrations
    # unless they began to serve again since (restarted).
    failed_decode_pods: dict[str, float] = field(default_factory=dict)
    migrations: int = 0  # moves to another decode pod so far (placement.py), at most max_migrations
    output_token_ids: list[int] = field(default_factory=list)  # every token the client has been sent
    prompt_logprobs_sent: bool = False  # a pod that prefills it again (migration) sends them again: not the client
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0
    # What the pod that prefilled reported, in seconds: queue, prefill and (disaggregated) kv_transfer.
    # Missing when that report never came (a stop string ended a request prefilled on D before D's summary).
    pod_timings: dict[str, float] = field(default_factory=dict)
    # A split prefill (placement.py): a prefill pod prefilled this many leading prompt tokens and D the rest.
    split_prefix_tokens: int = 0
    # Drawn for a shadow check (shadow.py): the logprob of every token the client has been sent (the pods were asked
    # for them), which the client gets only if ``client_logprobs``. None: not drawn.
    shadow_logprobs: list[float] | None = None
    client_logprobs: bool = True

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def timeout_s(self) -> float:
        return self.config.request_timeout_s if self.request.timeout_s is None else self.request.timeout_s

    # -- its pod calls ----------------------------------------------------------------------------------------

    def track(self, call: Any) -> Any:
        self.calls.append(call)
        return call

    def cancel_calls(self) -> None:
        for call in self.calls:
            call.cancel()  # a no-op for calls already done

    def hold(self, pod: PodInfo, prompt_tokens: int = 0, kv_tokens: int = 0) -> PodHold:
        """Count this request on ``pod`` (until ``release_holds``): one more request in flight there, with
        ``prompt_tokens`` to prefill and the KV of ``kv_tokens`` about to take its blocks."""
        pod.active_requests += 1
        pod.queued_prompt_tokens += prompt_tokens
        pod.blocks_since_report += blocks_for(kv_tokens, pod) if kv_tokens else 0
        hold = PodHold(pod, prompt_tokens)
        self.holds.append(hold)
        return hold

    # -- what its pods did: placement reports, the run keeps ------------------------------------------------

    def kv_pushed_to(self, pod: PodInfo) -> None:
        """A prefill pod was asked to push the prompt's KV to decode pod ``pod``: dropped there if unclaimed."""
        self.kv_sent_to.append(pod)

    def prefilled(self, first: prefill_pb2.PrefillResponse) -> None:
        """A prefill pod's answer is the request's report: cached tokens, queue/prefill/transfer seconds."""
        self.cached_tokens = first.num_cached_tokens
        self.pod_timings.update(queue=first.queue_seconds, prefill=first.prefill_seconds,
                                kv_transfer=first.kv_transfer.exposed_transfer_seconds)

    def split_at(self, prefix_tokens: int) -> None:
        """A split prefill started on D: D's summary adds to P's report of the first ``prefix_tokens``."""
        self.split_prefix_tokens = prefix_tokens

    def decode_pod_failed(self, address: str) -> None:
        """The decode pod at ``address`` failed the request after its first token: migrations pass it over."""
        self.failed_decode_pods[address] = time.monotonic()

    def migrated(self) -> None:
        self.migrations += 1

    def release_holds(self) -> None:
        for hold in self.holds:
            hold.release()
        self.holds.clear()

    def time_left(self) -> float:
        """Seconds until the request's deadline; DEADLINE_EXCEEDED when it passed."""
        left = self.request.arrival_time + self.timeout_s - time.monotonic()
        if left <= 0:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"request {self.request.request_id} passed its {self.timeout_s:g} s deadline")
        return left

    def out_of_time(self) -> bool:
        return time.monotonic() >= self.request.arrival_time + self.timeout_s

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
        message = await self.await_pod(stream.call.read(), stream.pod_address)
        if message is grpc.aio.EOF:
            raise StatusError(grpc.StatusCode.INTERNAL,
                              f"pod {stream.pod_address}: the Decode stream ended without a complete message")
        return message

    def _pod_error(self, error: grpc.aio.AioRpcError, pod_address: str) -> StatusError:
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self.out_of_time():
            return StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"request {self.request.request_id} passed its {self.timeout_s:g} s "
                               f"deadline (waiting on pod {pod_address})")
        if code == grpc.StatusCode.CANCELLED:
            # Not ours (ours surfaces as asyncio.CancelledError): the pod cancelled it, shutting down.
            return StatusError(grpc.StatusCode.UNAVAILABLE,
                               f"pod {pod_address} cancelled the request ({error.details() or 'shutting down'})",
                               peer=pod_address)
        return from_rpc_error(error, pod_address)

    # -- tokens to text, and the end --------------------------------------------------------------------------

    async def stream(self, stream: DecodeStream) -> AsyncIterator[OutputDelta | Completion]:
        """D's messages as deltas, then the Completion; raises StatusError if the stream breaks."""
        while True:
            message = stream.prefetched.pop(0) if stream.prefetched else await self.read(stream)
            if message.HasField("complete"):
                tail = self.detokenizer.finish()  # text held back for a stop string that never came
                if tail:
                    yield OutputDelta([], tail)
                yield self._complete_from_pod(message.complete, stream.pod_address)
                return
            delta = self._take_chunk(message.chunk)
            if delta.token_ids or delta.text or delta.prompt_logprobs is not None:
                yield delta
            if self.detokenizer.stopped_by is not None:
                stream.call.cancel()  # D aborts the request and frees its blocks
                yield self.complete(FinishReason.STOP, self.detokenizer.stopped_by)
                return

    def _take_chunk(self, chunk: decode_pb2.DecodeChunk) -> OutputDelta:
        """The chunk's tokens as text, up to and including the token that completes a stop string."""
        token_ids, text = [], []
        for token_id in chunk.token_ids:
            token_ids.append(token_id)
            text.append(self.detokenizer.add(token_id))
            if self.detokenizer.stopped_by is not None:
                break  # D's tokens past the stop string are not the client's
        entries = chunk.logprobs.tokens[:len(token_ids)]
        if self.shadow_logprobs is not None:
            self.shadow_logprobs += [entry.logprob for entry in entries]
        logprobs = None
        if self.request.params.logprobs is not None and self.client_logprobs:
            logprobs = [token_logprob_to_dict(entry) for entry in entries]
        self._count_tokens(token_ids)
        prompt_logprobs = None
        if chunk.HasField("prompt_logprobs") and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = prompt_logprobs_from_proto(chunk.prompt_logprobs), True
        return OutputDelta(token_ids, "".join(text), logprobs, prompt_logprobs)

    def _count_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self.on_first_token()
            self.metrics.time_to_first_token.observe(now - self.request.arrival_time)
            self.metrics.prompt_tokens.inc(len(self.request.prompt_token_ids))
        else:
            # One observation per chunk: a chunk is one decode step's output on D.
            self.metrics.inter_token_latency.observe(now - self.last_token_at)
        self.last_token_at = now
        self.output_token_ids.extend(token_ids)
        self.metrics.generation_tokens.inc(len(token_ids))

    def _complete_from_pod(self, complete: decode_pb2.DecodeComplete, pod_address: str) -> Completion:
        if not self.pod_timings:  # no prefill pod reported: D prefilled, and its summary is the report
            self.cached_tokens = complete.usage.cached_tokens
            self.pod_timings.update(queue=complete.queue_seconds, prefill=complete.prefill_seconds)
        elif self.split_prefix_tokens:  # P reported the prefix; D's summary adds the rest (its prefix hit is P's KV)
            self.cached_tokens += max(0, complete.usage.cached_tokens - self.split_prefix_tokens)
            self.pod_timings["queue"] += complete.queue_seconds
            self.pod_timings["prefill"] += complete.prefill_seconds
        stop_reason = complete.stop_token_id if complete.HasField("stop_token_id") else None
        finish_reason = finish_reason_from_proto(complete.finish_reason)
        error = None
        if finish_reason is FinishReason.ERROR:
            error = StatusError(grpc.StatusCode.INTERNAL, f"pod {pod_address} ended the request with an error")
            log.error("request %s: %s", self.request.request_id, error.message)
        return self.complete(finish_reason, stop_reason, error)

    def complete(self, finish_reason: FinishReason, stop_reason: int | str | None,
                 error: StatusError | None = None) -> Completion:
        """The request's ``Completion``, observed in the metrics; made once, as the last output."""
        e2e = time.monotonic() - self.request.arrival_time
        ttft = self.first_token_at - self.request.arrival_time if self.first_token_at is not None else 0.0
        self.finish_reason = finish_reason
        self._observe_completion(finish_reason, e2e, ttft)
        return Completion(
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=self.num_output_tokens,
            cached_tokens=self.cached_tokens,
            timings={"queue": 0.0, "prefill": 0.0, "kv_transfer": 0.0, **self.pod_timings, "ttft": ttft, "e2e": e2e},
            error=error,
        )

    def _observe_completion(self, finish_reason: FinishReason, e2e: float, ttft: float) -> None:
        metrics = self.metrics
        metrics.finished(finish_reason)
        metrics.e2e_request_latency.observe(e2e)
        reported = {"queue": metrics.request_queue_time, "prefill": metrics.request_prefill_time,
                    "kv_transfer": metrics.kv_transfer_time}
        for name, seconds in self.pod_timings.items():
            reported[name].observe(seconds)
        tpot = (e2e - ttft) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0
        if self.num_output_tokens > 1:
            metrics.time_per_output_token.observe(tpot)
        answered = finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and self.first_token_at is not None
        targets = SLOTargets.of(self.request, self.config)
        if answered and ttft <= targets.ttft_s and tpot <= targets.tpot_s:
            metrics.requests_within_slo.inc()

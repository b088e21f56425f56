"""``RequestRun``: one request in flight, from admission to its ``Completion``; the one owner of its state.

``Router.generate`` makes one per request and iterates ``serve()``, which drives it through these steps, each a
method here. The run asks ``Placement`` (``placement.py``) for every decision and acts on the answer; it keeps its
pod calls and holds in ``PodCalls`` (``pods/calls.py``), sends the messages ``pods/client.py`` builds, and turns
what the pods send into what the client gets through ``RunOutput`` (``outputs.py``):

1. admit (``_admit``): ``Placement.admit``, counting the router's requests waiting for their first token;
2. place (``_place``): wait for a decode pod while none serves (``decode_pod_wait_s``, within the deadline), then
   ``Placement.route`` gives a ``RoutePlan``, and the route starts. A failure before the first token goes to
   ``Placement.retry``: the decode pod it found gone is held suspect, and after a backoff the request is placed
   again on other pods, ``max_retries`` times (when every prefill pod failed, the retry prefills on the decode pod);
   KV that P pushed to D for the failed attempt (a split's prefix D refused, a prompt whose P failed after its
   push) is dropped there first (``_drop_pushed_kv``);
3. the first token, by route (``_start_route``):
   - disaggregated (``_start_disaggregated``): ``P.Prefill(decode_address=D)`` prefills, pushes the KV to D and
     returns the first token; ``D.Decode(first_token)`` claims the KV (``_claim``) and streams the rest;
   - split (``_start_split``): P prefills the prompt's first ``plan.prefix_tokens`` tokens and pushes their KV to
     D; ``D.Decode`` without a first token takes that prefix, prefills the rest and samples the first token;
   - on D (``_start_on_decode_pod``): ``D.Decode`` without a first token prefills there; its first message carries
     the first token, and until it arrives a failure may still be retried;
   - scored (``_score_on_prefill_pod``): a request that generates nothing (``max_tokens`` 0) is prefilled on P
     alone, for its prompt logprobs: no KV moves, no decode pod is called (on D alone when the plan prefills there);
   - shared (``_start_on_shared_kv``): the n samples of one prompt (``SampleGroup``): the first one's placement
     prefills for all of them and shares the KV it pushed; the others claim it with their own first tokens, and go
     on their own when it shares none;
4. stream (``_stream``): D's messages through ``RunOutput`` as ``OutputDelta`` text; a stop string ends the request
   here: the run stops reading and cancels D's stream, which makes D abort the request and free its blocks;
5. migrate (``_migrate``): when D goes away mid-stream, ``Placement.after_break`` says whether another decode pod is
   worth it and ``Placement.migration_target`` which one; it prefills the prompt and the tokens already sent
   (``resume_token_ids``) and goes on from there: the client sees every token once. A target that fails too
   before its first message is passed over for the next, ``max_migrations`` moves in all;
6. complete: exactly one ``Completion``, the last output, observed in the metrics; then, however the request ended,
   ``_end`` cancels its pod calls, releases its holds on the pods and, for a request that ended early (the client
   went away, or aborted), asks the decode pods its KV was pushed to to drop it (P's cancelled call cannot take
   back KV D acknowledged, and D would hold the blocks until the lease expires).

Errors: before any output, ``serve`` raises ``StatusError`` (no pod: UNAVAILABLE; pods full or queues too long:
RESOURCE_EXHAUSTED; timeout: DEADLINE_EXCEEDED; ...); after output started, a failure that migration cannot mend
ends the stream with ``Completion(finish_reason="error", error=...)``. ``abort()`` cancels the pod calls; an aborted
request still ends with ``Completion(finish_reason="abort")``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from splitserve.engine.sequence import FinishReason
from splitserve.engine.text.detokenizer import IncrementalDetokenizer
from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.latency import HybridPlacement
from splitserve.router.outputs import Completion, OutputDelta, RunOutput
from splitserve.router.placement import Placement
from splitserve.router.pods.calls import AnsweredCall, DecodeStream, PodCalls, PodHold
from splitserve.router.pods.client import (
    PodClientPool,
    decode_request,
    first_token_response,
    prefill_request,
    scored_responses,
)
from splitserve.router.pods.registry import PodInfo, PodRegistry
from splitserve.router.route_plan import RoutePlan, SLOTargets
from splitserve.runtime.errors import StatusError
from splitserve.runtime.metrics import RouterMetrics
from splitserve.v1 import common_pb2, prefill_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterParts:
    """What every run of one router shares."""

    config: RouterConfig
    metrics: RouterMetrics
    registry: PodRegistry
    placement: Placement
    pod_clients: PodClientPool
    num_pending: Callable[[], int]  # the router's requests waiting for their first token

    @property
    def hybrid(self) -> HybridPlacement | None:
        return self.placement.policy.hybrid


class RequestRun:
    """One request in flight: its pod calls and holds, where its KV went, the pods that failed it, and its output."""

    def __init__(self, request: RouterRequest, detokenizer: IncrementalDetokenizer, parts: RouterParts,
                 shadow_checked: bool = False, client_logprobs: bool = True):
        self.request = request
        self._parts = parts
        timeout_s = parts.config.request_timeout_s if request.timeout_s is None else request.timeout_s
        self.calls = PodCalls(request, timeout_s)
        self.output = RunOutput(request, detokenizer, parts.config, parts.metrics, shadow_checked, client_logprobs)
        self.kv_sent_to: list[PodInfo] = []  # decode pods a prefill pod was asked to push its KV to
        # Decode pods that failed it after its first token, and when (time.monotonic()): passed over by migrations
        # unless they began to serve again since (restarted).
        self.failed_decode_pods: dict[str, float] = {}
        self.migrations = 0  # moves to another decode pod so far, at most max_migrations

    @property
    def aborted(self) -> bool:
        return self.calls.aborted

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.output.finish_reason

    @property
    def waiting_for_first_token(self) -> bool:
        return self.output.first_token_at is None

    def abort(self) -> None:
        """The client's Abort: the pod calls cancelled (the pods abort the request and free its blocks)."""
        self.calls.abort()

    # -- the request's path ---------------------------------------------------------------------------------------

    async def serve(self) -> AsyncIterator[OutputDelta | Completion]:
        """The request's outputs, its Completion last; raises StatusError when refused before any output."""
        try:
            self._admit()
            try:
                stream = await self._start()
            except StatusError:
                if not self.aborted:
                    raise
                yield self.output.complete(FinishReason.ABORT, None)
                return
            while True:
                try:
                    async for output in self._stream(stream):
                        yield output
                    return
                except StatusError as error:
                    stream.call.cancel()
                    stream.hold.release()
                    if not self.aborted:
                        try:
                            stream = await self._migrate(stream.pod_address, error)
                            continue
                        except StatusError as failed:
                            error = failed
                    if self.aborted:
                        yield self.output.complete(FinishReason.ABORT, None)
                        return
                    log.error("request %s failed after %d output tokens: %s", self.request.request_id,
                              self.output.num_output_tokens, error.message)
                    yield self.output.complete(FinishReason.ERROR, None, error)
                    return
        finally:
            self._end()

    def _end(self) -> None:
        """However the request ended: its pod calls cancelled, its KV dropped where no one will claim it, its holds
        released."""
        self.calls.cancel()
        if self.request.leads_samples:
            self.request.samples.share(None)  # refused before it placed: the other samples go on their own
        if self.output.finish_reason in (None, FinishReason.ABORT):
            for pod in self.kv_sent_to:  # an unknown id is a no-op there
                self._parts.pod_clients.drop_in_background(pod.address, pod.role, self.request.request_id)
        self.calls.release_holds()

    # -- 1: admission ---------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        self._parts.placement.admit(self._parts.num_pending(), self._parts.registry.snapshot())

    # -- 2: placing it, with retries before the first token -------------------------------------------------------

    async def _start(self) -> DecodeStream:
        """D's stream of the request, its first message taken; for the n samples of a prompt, from the KV the
        first one shares."""
        group = self.request.samples
        if group is None:
            return await self._place()
        if self.request.leads_samples:
            try:
                return await self._place()
            finally:
                group.share(None)  # unless it shared its KV already (_start_disaggregated)
        try:
            shared = await asyncio.wait_for(asyncio.shield(group.shared), self.calls.time_left())
        except TimeoutError:
            self.calls.time_left()  # raises DEADLINE_EXCEEDED
            raise
        self._raise_if_aborted()
        if shared is not None:
            return self._start_on_shared_kv(*shared)
        return await self._place()

    async def _place(self) -> DecodeStream:
        """Placed on a pair of pods, and placed again on others while that may help."""
        parts, avoid, attempt = self._parts, frozenset(), 0
        while True:
            await self._wait_for_decode_pods("no decode pod is serving", lambda: bool(parts.registry.decode_pods()))
            plan = parts.placement.route(self.request, parts.registry.snapshot(), avoid)
            try:
                return await self._start_route(plan)
            except StatusError as error:
                attempt += 1
                retry = parts.placement.retry(error, plan, attempt)
                parts.registry.suspect(retry.suspect)
                if not retry.again or self.aborted or self.calls.out_of_time():
                    raise
                log.warning("request %s: %s; retrying on other pods", self.request.request_id, error.message)
                parts.metrics.count(parts.metrics.retries, error.code.name)
                avoid |= retry.avoid
                await asyncio.sleep(min(retry.backoff_s, self.calls.time_left()))

    async def _wait_for_decode_pods(self, why: str, found: Callable[[], bool]) -> None:
        """While ``found()`` does not hold, wait for it (a decode pod restarting, a rollout), at most
        ``decode_pod_wait_s`` and within the request's deadline; then the caller goes on either way."""
        if found():
            return
        parts = self._parts
        wait_s = min(parts.config.decode_pod_wait_s, self.calls.time_left())
        if wait_s <= 0:
            return
        log.warning("request %s: %s; waiting up to %.1f s for one", self.request.request_id, why, wait_s)
        started = time.monotonic()
        await parts.registry.wait_until(lambda: found() or self.aborted, wait_s)
        outcome = "found" if found() else "none"
        parts.metrics.count(parts.metrics.decode_pod_waits, outcome)
        log.info("request %s: waited %.2f s for a decode pod: %s", self.request.request_id,
                 time.monotonic() - started, outcome)

    def _raise_if_aborted(self) -> None:
        if self.aborted:
            raise StatusError(grpc.StatusCode.CANCELLED, "aborted")

    # -- 3: the first token, by route -----------------------------------------------------------------------------

    async def _start_route(self, plan: RoutePlan) -> DecodeStream:
        self._raise_if_aborted()
        metrics = self._parts.metrics
        metrics.count(metrics.routing_decisions, plan.decision)
        scoring = plan.prefill is not None and self.request.params.max_tokens == 0
        for pod in (plan.prefill,) if scoring else (plan.prefill, plan.decode):
            if pod is not None:
                metrics.count(metrics.pod_requests, pod.address, str(pod.role))
        if plan.prefill is None:
            return await self._start_on_decode_pod(plan.decode)
        if scoring:
            return await self._score_on_prefill_pod(plan.prefill)
        if plan.prefix_tokens:
            return await self._start_split(plan)
        return await self._start_disaggregated(plan)

    async def _score_on_prefill_pod(self, pod: PodInfo) -> DecodeStream:
        """P prefills the prompt for its prompt logprobs and answers; no decode pod is called and no KV moves."""
        hold = self.calls.hold(pod, prompt_tokens=len(self.request.prompt_token_ids))
        try:
            scored = await self._prefill(pod, decode_address="")
        finally:
            hold.release()
        return DecodeStream(AnsweredCall(), pod, hold, scored_responses(self.request, scored))

    async def _start_disaggregated(self, plan: RoutePlan) -> DecodeStream:
        req = self.request
        num_prompt = len(req.prompt_token_ids)
        decode_hold = self.calls.hold(plan.decode, kv_tokens=num_prompt)  # the KV lands there during the prefill
        self.kv_sent_to.append(plan.decode)
        try:
            first = await self._prefill_pushing(plan)
        except BaseException:
            decode_hold.release()
            raise
        self._observe_transfer(num_prompt, first)
        if req.leads_samples:  # the first of n samples: the others claim the same KV with their first tokens
            group = req.samples
            group.share((plan.decode, first) if len(first.more_first_token_ids) == len(group.request_ids) - 1
                        else None)
        # The KV now waits on D under a lease: claim it at once. D's stream starts after the first token.
        first_logprob = first.first_token_logprob if first.HasField("first_token_logprob") else None
        return self._claim(plan.decode, decode_hold, first, first.first_token_id, first_logprob)

    async def _start_split(self, plan: RoutePlan) -> DecodeStream:
        """P prefills the prompt's first ``plan.prefix_tokens`` tokens, as a prompt of their own, and pushes their KV
        to D; D takes it (``DecodeRequest.kv_prefix_tokens``), prefills the rest and samples the first token."""
        prefix_tokens, num_tokens = plan.prefix_tokens, len(self.request.prompt_token_ids)
        # D's share of the prompt counts there from now: later placements must not promise D's time to others.
        decode_hold = self.calls.hold(plan.decode, prompt_tokens=num_tokens - prefix_tokens, kv_tokens=num_tokens)
        self.kv_sent_to.append(plan.decode)
        try:
            pushed = await self._prefill_pushing(plan)
        finally:
            decode_hold.release()
        self._observe_transfer(prefix_tokens, pushed)
        try:
            stream = await self._start_on_decode_pod(plan.decode, prefix_tokens=prefix_tokens)
        except StatusError:
            # D refused (full, draining) or failed before it claimed the prefix P pushed there: drop it now.
            await self._drop_pushed_kv(plan.decode)
            raise
        self.output.split_at(prefix_tokens)  # D's summary adds to P's report (not after a retry elsewhere)
        return stream

    def _start_on_shared_kv(self, pod: PodInfo, first: prefill_pb2.PrefillResponse) -> DecodeStream:
        """Sample i > 0 of a prompt: its first token came with sample 0's (P's ``more_first_token_ids``), and its
        Decode call claims the KV pushed once for all of them, on the same decode pod."""
        group = self.request.samples
        index = group.request_ids.index(self.request.request_id) - 1
        self.output.prefilled(first)
        metrics = self._parts.metrics
        metrics.count(metrics.pod_requests, pod.address, str(pod.role))
        logprobs = first.more_first_token_logprobs
        return self._claim(pod, self.calls.hold(pod), first, first.more_first_token_ids[index],
                           logprobs[index] if logprobs else None, kv_request_id=group.kv_request_id)

    async def _start_on_decode_pod(self, pod: PodInfo, resume_token_ids: list[int] = (),
                                   prefix_tokens: int = 0) -> DecodeStream:
        """D prefills the prompt (and, for a migrated request, the tokens already sent; after a split prefill, the
        prompt past the ``prefix_tokens`` whose KV a prefill pod pushed there) and streams the rest."""
        req = self.request
        num_tokens = len(req.prompt_token_ids) + len(resume_token_ids)
        hold = self.calls.hold(pod, prompt_tokens=num_tokens - prefix_tokens, kv_tokens=num_tokens)
        request = decode_request(req, self._tpot_target_s(), resume_token_ids=resume_token_ids,
                                 kv_prefix_tokens=prefix_tokens)
        client = self._parts.pod_clients.get(pod.address, pod.role)
        stream = DecodeStream(self.calls.track(client.decode(request, self.calls.time_left())), pod, hold, [])
        # Its first message carries the next token: until it arrives, a failure may still be retried.
        try:
            stream.prefetched.append(await self.calls.read(stream))
        except BaseException:
            hold.release()
            raise
        hold.prompt_done()
        return stream

    def _claim(self, pod: PodInfo, hold: PodHold, first: prefill_pb2.PrefillResponse, first_token_id: int,
               first_logprob: common_pb2.TokenLogprob | None, kv_request_id: str = "") -> DecodeStream:
        """D's stream of a request whose prompt's KV waits there (pushed by P's ``first``, under ``kv_request_id``
        when not the request's own id), with its first token."""
        claim = decode_request(self.request, self._tpot_target_s(), first_token_id=first_token_id,
                               first_token_logprob=first_logprob, kv_request_id=kv_request_id)
        client = self._parts.pod_clients.get(pod.address, pod.role)
        call = self.calls.track(client.decode(claim, self.calls.time_left()))
        return DecodeStream(call, pod, hold, [first_token_response(first, first_token_id, first_logprob)])

    async def _prefill_pushing(self, plan: RoutePlan) -> prefill_pb2.PrefillResponse:
        """P's answer for ``plan`` (disaggregated, or a split's prefix), its KV pushed to D. When P's call fails, its
        push may have reached D all the same (P killed after D acknowledged it, before P answered): that KV, which
        no Decode call will claim, is dropped on D before the failure goes on to a retry, not left to its lease."""
        num_tokens = plan.prefix_tokens or len(self.request.prompt_token_ids)
        hold = self.calls.hold(plan.prefill, prompt_tokens=num_tokens)
        try:
            return await self._prefill(plan.prefill, plan.decode.address, plan.prefix_tokens)
        except StatusError:
            await self._drop_pushed_kv(plan.decode)
            raise
        finally:
            hold.release()

    async def _prefill(self, pod: PodInfo, decode_address: str, prefix_tokens: int = 0) -> prefill_pb2.PrefillResponse:
        """P's answer: it prefilled the prompt (its first ``prefix_tokens``: a split) and pushed the KV to the decode
        pod at ``decode_address`` (none: scoring); its report is the request's queue/prefill/transfer time."""
        config = self._parts.config
        request = prefill_request(self.request, decode_address, config.kv_codec, config.kv_lease_s, prefix_tokens)
        client = self._parts.pod_clients.get(pod.address, pod.role)
        call = self.calls.track(client.prefill(request, self.calls.time_left()))
        first = await self.calls.await_pod(call, pod.address)
        self.output.prefilled(first)
        return first

    async def _drop_pushed_kv(self, pod: PodInfo) -> None:
        """KV pushed to ``pod`` that no one will claim, freed now, not by its lease (a retry may push again)."""
        if not await self._parts.pod_clients.get(pod.address, pod.role).drop(self.request.request_id):
            self._parts.registry.suspect(pod.address)  # out of reach

    def _observe_transfer(self, num_tokens: int, first: prefill_pb2.PrefillResponse) -> None:
        """Hybrid placement learns the link's cost from every push (``HybridPlacement.observe_transfer``)."""
        if self._parts.hybrid is not None:
            self._parts.hybrid.observe_transfer(num_tokens, first.kv_transfer.exposed_transfer_seconds)

    def _tpot_target_s(self) -> float:
        return SLOTargets.of(self.request, self._parts.config).tpot_s

    # -- 4: streaming ---------------------------------------------------------------------------------------------

    async def _stream(self, stream: DecodeStream) -> AsyncIterator[OutputDelta | Completion]:
        """D's messages as deltas, then the Completion; raises StatusError if the stream breaks."""
        output = self.output
        while True:
            message = stream.prefetched.pop(0) if stream.prefetched else await self.calls.read(stream)
            if message.HasField("complete"):
                tail = output.finish_text()
                if tail:
                    yield OutputDelta([], tail)
                yield output.complete_from_pod(message.complete, stream.pod_address)
                return
            delta = output.take_chunk(message.chunk)
            if delta.token_ids or delta.text or delta.prompt_logprobs is not None:
                yield delta
            if output.stopped_by is not None:
                stream.call.cancel()  # D aborts the request and frees its blocks
                yield output.complete(FinishReason.STOP, output.stopped_by)
                return

    # -- 5: migration ---------------------------------------------------------------------------------------------

    async def _migrate(self, failed_address: str, error: StatusError) -> DecodeStream:
        """The request, whose decode pod went away (``error``), continued on another one from the tokens the client
        has. Raises the last failure when no pod is left or none is worth it."""
        parts, target_failed = self._parts, False
        while True:
            self.failed_decode_pods[failed_address] = time.monotonic()
            migration = parts.placement.after_break(error, failed_address, self.migrations, target_failed)
            parts.registry.suspect(migration.suspect)
            # Past the deadline, a target that failed too is the end: nothing is worth another pod.
            if not migration.again or self.aborted or (target_failed and self.calls.out_of_time()):
                raise error
            pod = self._migration_target()
            if pod is None:
                await self._wait_for_decode_pods(
                    f"no decode pod to continue on after {failed_address}",
                    lambda: bool(Placement.migration_targets(self.failed_decode_pods, parts.registry.decode_pods())))
                if self.aborted:
                    raise error
                pod = self._migration_target()
            if pod is None:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{error.message}; no other decode pod to continue "
                                  f"the request on after {self.output.num_output_tokens} tokens")
            log.warning("request %s: %s after %d output tokens; migrating it to decode pod %s",
                        self.request.request_id, error.message, self.output.num_output_tokens, pod.address)
            self.migrations += 1
            parts.metrics.migrations.inc()
            parts.metrics.count(parts.metrics.pod_requests, pod.address, str(pod.role))
            try:
                return await self._start_on_decode_pod(pod, list(self.output.output_token_ids))
            except StatusError as failed:
                failed_address, error, target_failed = pod.address, failed, True

    def _migration_target(self) -> PodInfo | None:
        token_ids = self.request.prompt_token_ids + self.output.output_token_ids
        return self._parts.placement.migration_target(token_ids, self.failed_decode_pods,
                                                      self._parts.registry.decode_pods())

"""``Placement``: where a request runs, and where it goes when a pod fails it; the router's scheduling state machine.

For each request ``Router.generate`` walks it through these states, each a method here:

1. admission (``admit``): a request is refused at once with RESOURCE_EXHAUSTED and a retry-after hint (HTTP 429)
   when the router already has ``max_pending_requests`` waiting for their first token, or (``start``) when the pod
   it would prefill on has more queued prompt tokens than it prefills in ``max_queue_time_s`` (its own measured
   rate): shed now, rather than answer after the client gave up;
2. placing (``start``): the registry's routable pods (serving, not draining) go to the routing policy, which
   returns a ``RoutePlan``: a decode pod D, and a prefill pod P unless the prompt is short or mostly cached on D
   (conditional disaggregation);
3. first token: disaggregated, ``P.Prefill(decode_address=D)`` prefills, pushes the KV to D and returns the
   first token; then ``D.Decode(first_token)`` is opened. Prefilling on D, ``D.Decode`` without a first token
   prefills there and its first chunk holds the first token. A request that generates nothing (``max_tokens`` 0,
   scoring its prompt) is prefilled on P alone, for its prompt logprobs: no KV moves, no decode pod is called
   (on D alone when the plan prefills there). A failure before the first token (a pod gone, full
   or draining, P's push to D failing, corrupt or late) is retried on other pods, ``max_retries`` times
   (``_before_retry``: a decode pod a call found gone is suspect at once, and the retry backs off and waits for
   a decode pod as a migration does; KV that P pushed to D for the failed attempt, a split's prefix D refused or
   a prompt whose P failed after its push, is dropped there first); when every prefill pod failed, the retry
   prefills on the decode pod. ``start`` returns D's ``DecodeStream`` with that first message
   in it;
4. migration (``migrate``): when D goes away mid-stream, another decode pod prefills the prompt and the tokens
   already sent (``resume_token_ids``) and goes on from there; the client sees every token once. Every pod that
   failed the request is left out of later choices, and a target that fails too before its first message is
   passed over for the next, ``max_migrations`` moves in all.

While a request runs, it is counted on its pods (``RequestRun.hold``: ``PodInfo.active_requests``,
``queued_prompt_tokens``, ``blocks_since_report``), so that placement sees its own newest requests before the
pods' next load reports do. The stream itself (tokens to text, the end) is the run's (``request_run.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from splitserve.engine.sampling.params import SamplingParams
from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.pods.client import PodClientPool, decode_request, prefill_request
from splitserve.router.pods.registry import PodInfo, PodRegistry
from splitserve.router.policies import RoutingPolicy
from splitserve.router.request_run import AnsweredCall, DecodeStream, PodHold, RequestRun
from splitserve.router.route_plan import RoutePlan, SLOTargets
from splitserve.runtime.errors import StatusError
from splitserve.runtime.metrics import RouterMetrics
from splitserve.v1 import common_pb2, decode_pb2, prefill_pb2

log = logging.getLogger(__name__)

# Before the first token, worth another pair of pods: the pod is gone, full or draining, or P could not hand the
# KV to D (refused, corrupt, or past the transfer's own deadline while the request still has time).
RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS,
                   grpc.StatusCode.DEADLINE_EXCEEDED)
# A split prefill's prefix on P: only its KV is wanted.
SPLIT_PREFIX_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
# After output started, a stream that broke this way moves to another decode pod.
MIGRATABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
# A retry's first pause (seconds), doubled for each later one: a pod that just died is seen as down by its health
# stream within about a second, and a full one frees room as its requests finish; a retry at once finds the same.
RETRY_BACKOFF_S = 0.1


class Placement:
    """Admits requests and places them on pods, with retries before the first token and migrations after it."""

    def __init__(self, config: RouterConfig, registry: PodRegistry, policy: RoutingPolicy,
                 pod_clients: PodClientPool, metrics: RouterMetrics):
        self.config = config
        self.registry = registry
        self.policy = policy
        self.pod_clients = pod_clients
        self.metrics = metrics
        self.num_pending = 0  # requests admitted that have no first token yet

    # -- step 1: admission ------------------------------------------------------------------------------------

    def admit(self, run: RequestRun) -> None:
        """Shed load before any work: RESOURCE_EXHAUSTED (HTTP 429) with a hint of when to retry."""
        limit = self.config.max_pending_requests
        if limit and self.num_pending > limit:  # this request is counted already
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.num_pending - 1} requests are already waiting for their first token (the "
                              f"router's max_pending_requests is {limit}); retry later",
                              retry_after_s=self._queue_wait_estimate())

    def _queue_wait_estimate(self) -> float:
        """Seconds until the least-queued prefilling pod would start a new prompt, from its measured rate."""
        waits = [pod.prefill_wait_s for pod in self.registry.prefill_pods() or self.registry.decode_pods()]
        return min((w for w in waits if w is not None), default=1.0)

    def _check_queue_time(self, plan: RoutePlan) -> None:
        limit = self.config.max_queue_time_s
        pod = plan.prefill or plan.decode
        # Hybrid placement's whole TTFT (a lent prompt's chunks too), else the queue at the pod's rate; an infinite
        # one (no chunk fits beside D's decodes now; D prefills it as they end) is not a wait forever: the queue's.
        predicted = plan.predicted_ttft_s
        wait = predicted if predicted is not None and predicted != float("inf") else pod.prefill_wait_s
        if limit and wait is not None and wait > limit:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the least loaded pod would start this prompt in about {wait:.1f} s "
                              f"({pod.queued_tokens} prompt tokens queued at {pod.load.prefill_tokens_per_second:.0f} "
                              f"tokens/s), past the router's max_queue_time_s ({limit:g} s); retry later",
                              retry_after_s=wait - limit)

    # -- steps 2 and 3: placing the request and getting its first token ---------------------------------------

    async def start(self, run: RequestRun) -> DecodeStream:
        """D's stream of ``run``, its first message taken. The n samples of a prompt (``SampleGroup``): the first
        one's placement prefills for all of them and shares the KV it pushed, which the others claim; they go on
        their own when it shares none."""
        group = run.request.samples
        if group is None:
            return await self._place(run)
        if run.request.leads_samples:
            try:
                return await self._place(run)
            finally:
                group.share(None)  # unless it shared its KV already (_start_disaggregated)
        try:
            shared = await asyncio.wait_for(asyncio.shield(group.shared), run.time_left())
        except TimeoutError:
            run.time_left()  # raises DEADLINE_EXCEEDED
            raise
        if run.aborted:
            raise StatusError(grpc.StatusCode.CANCELLED, "aborted")
        if shared is not None:
            return await self._start_on_shared_kv(run, *shared)
        return await self._place(run)

    async def _place(self, run: RequestRun) -> DecodeStream:
        """Placed on a pair of pods, retried on others while that may help."""
        retries_left = self.config.max_retries
        avoid: set[str] = set()  # pods of failed attempts: the next attempt prefers others
        while True:
            await self._wait_for_decode_pods(run, "no decode pod is serving",
                                             lambda: bool(self.registry.decode_pods()))
            plan = self._plan(run.request, avoid)
            self._check_queue_time(plan)
            try:
                return await self._start(run, plan)
            except StatusError as error:
                if error.code not in RETRYABLE_CODES or retries_left == 0 or run.aborted or run.out_of_time():
                    self._suspect_if_gone(error)
                    raise
                log.warning("request %s: %s; retrying on other pods", run.request.request_id, error.message)
                self.metrics.count(self.metrics.retries, error.code.name)
                retries_left -= 1
                avoid |= {pod.address for pod in (plan.prefill, plan.decode) if pod is not None}
                await self._before_retry(run, error, attempt=self.config.max_retries - retries_left)

    async def _before_retry(self, run: RequestRun, error: StatusError, attempt: int) -> None:
        """After failed attempt number ``attempt``: a decode pod found gone is suspect at once (``_suspect_if_gone``),
        so neither this retry nor other requests go there before its health stream says; then a pause, doubling
        per attempt, before the loop's wait for a decode pod (``decode_pod_wait_s``, as a migration has): a sole
        decode pod that died is waited for, not failed twice at once."""
        self._suspect_if_gone(error)
        await asyncio.sleep(min(RETRY_BACKOFF_S * 2 ** (attempt - 1), run.time_left()))

    def _suspect_if_gone(self, error: StatusError) -> None:
        """A decode pod's own call that failed UNAVAILABLE makes it suspect. Not a prefill pod's: it answers
        UNAVAILABLE for a push its decode pod broke off, and the retry passes it over anyway."""
        pod = self.registry.pods.get(error.peer) if error.peer else None
        if error.code is grpc.StatusCode.UNAVAILABLE and pod is not None and pod.can_decode:
            self.registry.suspect(pod.address)

    async def _wait_for_decode_pods(self, run: RequestRun, why: str, found: Callable[[], bool]) -> None:
        """While ``found()`` does not hold, wait for it (a decode pod restarting, a rollout), at most
        ``decode_pod_wait_s`` and within the request's deadline; then the caller goes on either way."""
        if found():
            return
        wait_s = min(self.config.decode_pod_wait_s, run.time_left())
        if wait_s <= 0:
            return
        log.warning("request %s: %s; waiting up to %.1f s for one", run.request.request_id, why, wait_s)
        started = time.monotonic()
        await self.registry.wait_until(lambda: found() or run.aborted, wait_s)
        outcome = "found" if found() else "none"
        self.metrics.count(self.metrics.decode_pod_waits, outcome)
        log.info("request %s: waited %.2f s for a decode pod: %s", run.request.request_id,
                 time.monotonic() - started, outcome)

    def _plan(self, req: RouterRequest, avoid: set[str]) -> RoutePlan:
        # Pods that failed this request are left out: prefill pods even if none remain (then D prefills the prompt),
        # decode pods unless none would remain.
        prefill = [pod for pod in self.registry.prefill_pods() if pod.address not in avoid]
        decode = [pod for pod in self.registry.decode_pods() if pod.address not in avoid] or self.registry.decode_pods()
        plan = self.policy.choose_pair(req, prefill, decode, SLOTargets.of(req, self.config))
        log.debug("request %s: prefill %s, decode %s (%s)", req.request_id,
                  plan.prefill.address if plan.prefill else "-", plan.decode.address, plan.reason)
        return plan

    async def _start(self, run: RequestRun, plan: RoutePlan) -> DecodeStream:
        if run.aborted:
            raise StatusError(grpc.StatusCode.CANCELLED, "aborted")
        metrics = self.metrics
        metrics.count(metrics.routing_decisions, plan.decision)
        scoring = plan.prefill is not None and run.request.params.max_tokens == 0
        for pod in (plan.prefill,) if scoring else (plan.prefill, plan.decode):
            if pod is not None:
                metrics.count(metrics.pod_requests, pod.address, str(pod.role))
        if plan.prefill is None:
            return await self._start_on_decode_pod(run, plan.decode)
        if scoring:
            return await self._score_on_prefill_pod(run, plan.prefill)
        if plan.prefix_tokens:
            return await self._start_split(run, plan)
        return await self._start_disaggregated(run, plan)

    async def _score_on_prefill_pod(self, run: RequestRun, pod: PodInfo) -> DecodeStream:
        """A request that generates nothing (max_tokens 0, scoring its prompt): P prefills it for its prompt logprobs
        and answers; no decode pod is called and no KV moves."""
        hold = run.hold(pod, prompt_tokens=len(run.request.prompt_token_ids))
        try:
            scored = await self._prefill(run, pod, self._prefill_request(run.request, decode_address=""))
        finally:
            hold.release()
        chunk = decode_pb2.DecodeChunk()
        if scored.HasField("prompt_logprobs"):
            chunk.prompt_logprobs.CopyFrom(scored.prompt_logprobs)
        complete = decode_pb2.DecodeComplete(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage(
            prompt_tokens=len(run.request.prompt_token_ids), cached_tokens=scored.num_cached_tokens))
        return DecodeStream(AnsweredCall(), pod, hold, [decode_pb2.DecodeResponse(chunk=chunk),
                                                         decode_pb2.DecodeResponse(complete=complete)])

    async def _start_disaggregated(self, run: RequestRun, plan: RoutePlan) -> DecodeStream:
        num_prompt = len(run.request.prompt_token_ids)
        decode_hold = run.hold(plan.decode, kv_tokens=num_prompt)  # the KV lands there during the prefill
        run.kv_pushed_to(plan.decode)
        prefill_hold = run.hold(plan.prefill, prompt_tokens=num_prompt)
        try:
            first = await self._prefill(run, plan.prefill, self._prefill_request(run.request, plan.decode.address))
        except BaseException as error:
            decode_hold.release()
            if isinstance(error, StatusError):  # P failed, maybe after its push reached D (killed before it answered)
                await self._drop_pushed_kv(run, plan.decode)
            raise
        finally:
            prefill_hold.release()
        if self.policy.hybrid is not None:
            self.policy.hybrid.observe_transfer(num_prompt, first.kv_transfer.exposed_transfer_seconds)
        group = run.request.samples
        if run.request.leads_samples:  # the first of n samples: the others claim the same KV with their first tokens
            group.share((plan.decode, first) if len(first.more_first_token_ids) == len(group.request_ids) - 1
                        else None)
        # The KV now waits on D under a lease: claim it at once. D's stream starts after the first token.
        first_logprob = first.first_token_logprob if first.HasField("first_token_logprob") else None
        return self._claim(run, plan.decode, decode_hold, first, first.first_token_id, first_logprob)

    async def _start_split(self, run: RequestRun, plan: RoutePlan) -> DecodeStream:
        """P prefills the prompt's first ``plan.prefix_tokens`` tokens, as a prompt of their own, and pushes their KV
        to D; D takes it (``DecodeRequest.kv_prefix_tokens``), prefills the rest and samples the first token."""
        req, prefix_tokens = run.request, plan.prefix_tokens
        # D's share of the prompt counts there from now: later placements must not promise D's time to others.
        num_tokens = len(req.prompt_token_ids)
        decode_hold = run.hold(plan.decode, prompt_tokens=num_tokens - prefix_tokens, kv_tokens=num_tokens)
        run.kv_pushed_to(plan.decode)
        prefill_hold = run.hold(plan.prefill, prompt_tokens=prefix_tokens)
        try:
            pushed = await self._prefill(run, plan.prefill,
                                         self._prefill_request(req, plan.decode.address, prefix_tokens))
        finally:
            decode_hold.release()
            prefill_hold.release()
        if self.policy.hybrid is not None:
            self.policy.hybrid.observe_transfer(prefix_tokens, pushed.kv_transfer.exposed_transfer_seconds)
        try:
            stream = await self._start_on_decode_pod(run, plan.decode, prefix_tokens=prefix_tokens)
        except StatusError:
            # D refused (full, draining) or failed before it claimed the prefix P pushed there: drop it now.
            await self._drop_pushed_kv(run, plan.decode)
            raise
        run.split_at(prefix_tokens)  # D's summary adds to P's report (not after a retry elsewhere)
        return stream

    async def _drop_pushed_kv(self, run: RequestRun, pod: PodInfo) -> None:
        """KV pushed to ``pod`` for ``run`` that no one will claim, freed now, not by its lease (a retry may push again)."""
        if not await self.pod_clients.get(pod.address, pod.role).drop(run.request.request_id):
            self.registry.suspect(pod.address)  # out of reach

    async def _start_on_shared_kv(self, run: RequestRun, pod: PodInfo,
                                  first: prefill_pb2.PrefillResponse) -> DecodeStream:
        """Sample i > 0 of a prompt: its first token came with sample 0's (P's ``more_first_token_ids``), and its
        Decode call claims the KV pushed once for all of them, on the same decode pod."""
        group = run.request.samples
        index = group.request_ids.index(run.request.request_id) - 1
        run.prefilled(first)
        self.metrics.count(self.metrics.pod_requests, pod.address, str(pod.role))
        logprobs = first.more_first_token_logprobs
        return self._claim(run, pod, run.hold(pod), first, first.more_first_token_ids[index],
                           logprobs[index] if logprobs else None, kv_request_id=group.kv_request_id)

    def _claim(self, run: RequestRun, pod: PodInfo, hold: PodHold, first: prefill_pb2.PrefillResponse,
               first_token_id: int, first_logprob: common_pb2.TokenLogprob | None,
               kv_request_id: str = "") -> DecodeStream:
        """D's stream of a request whose prompt's KV waits there (pushed by P's ``first``, under ``kv_request_id``
        when not the request's own id), with its first token."""
        claim = decode_request(run.request, self._tpot_target_s(run.request), first_token_id=first_token_id,
                               first_token_logprob=first_logprob, kv_request_id=kv_request_id)
        first_chunk = decode_pb2.DecodeChunk(token_ids=[first_token_id])
        if first.HasField("prompt_logprobs"):
            first_chunk.prompt_logprobs.CopyFrom(first.prompt_logprobs)
        if first_logprob is not None:
            first_chunk.logprobs.tokens.append(first_logprob)
        decode_pod = self.pod_clients.get(pod.address, pod.role)
        decode_call = run.track(decode_pod.decode(claim, run.time_left()))
        return DecodeStream(decode_call, pod, hold, [decode_pb2.DecodeResponse(chunk=first_chunk)])

    def _prefill_request(self, req: RouterRequest, decode_address: str,
                         prefix_tokens: int = 0) -> prefill_pb2.PrefillRequest:
        """P prefills the prompt (a split prefill: its first ``prefix_tokens``) and pushes its KV to the decode pod at
        ``decode_address`` (none: scoring), with the router's codec and lease."""
        # The first of n samples prefills for all of them (decode_address set: not when scoring). A prefix's KV is
        # all that is wanted of it: the token P samples after it is dropped.
        params = (SPLIT_PREFIX_PARAMS if prefix_tokens else
                  req.samples.params if req.leads_samples and decode_address else req.params)
        return prefill_request(req, params, decode_address, self.config.kv_codec, self.config.kv_lease_s,
                               prefix_tokens)

    async def _prefill(self, run: RequestRun, pod: PodInfo,
                       request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        """P's answer to ``request``; P's report is the request's queue/prefill/transfer time."""
        prefill_pod = self.pod_clients.get(pod.address, pod.role)
        call = run.track(prefill_pod.prefill(request, run.time_left()))
        first = await run.await_pod(call, pod.address)
        run.prefilled(first)
        return first

    async def _start_on_decode_pod(self, run: RequestRun, pod: PodInfo, resume_token_ids: list[int] = (),
                                   prefix_tokens: int = 0) -> DecodeStream:
        """D prefills the prompt (and, for a migrated request, the tokens already sent; after a split prefill, the
        prompt past the ``prefix_tokens`` whose KV a prefill pod pushed there) and streams the rest."""
        req = run.request
        num_tokens = len(req.prompt_token_ids) + len(resume_token_ids)
        hold = run.hold(pod, prompt_tokens=num_tokens - prefix_tokens, kv_tokens=num_tokens)
        request = decode_request(req, self._tpot_target_s(req), resume_token_ids=resume_token_ids,
                                 kv_prefix_tokens=prefix_tokens)
        client = self.pod_clients.get(pod.address, pod.role)
        stream = DecodeStream(run.track(client.decode(request, run.time_left())), pod, hold, [])
        # Its first message carries the next token: until it arrives, a failure may still be retried.
        try:
            stream.prefetched.append(await run.read(stream))
        except BaseException:
            hold.release()
            raise
        hold.prompt_done()
        return stream

    def _tpot_target_s(self, req: RouterRequest) -> float:
        return SLOTargets.of(req, self.config).tpot_s

    # -- step 4: migration ------------------------------------------------------------------------------------

    def _migration_targets(self, run: RequestRun) -> list[PodInfo]:
        """Serving decode pods that have not failed this request, or began to serve again since they did (a pod
        restarted at the same address is a new process)."""
        failed = run.failed_decode_pods
        return [pod for pod in self.registry.decode_pods()
                if pod.address not in failed or pod.serving_since > failed[pod.address]]

    async def migrate(self, run: RequestRun, failed_address: str, error: StatusError) -> DecodeStream:
        """Continue a request whose decode pod went away (``error``) on another one, from the tokens the client has.

        Never on a pod that failed this request before, and while ``max_migrations`` allows: a target that fails
        too before its first message is passed over for the next. Raises the last failure when no pod is left."""
        worth_another_pod = MIGRATABLE_CODES  # how a stream breaks mid-way when its pod goes away
        while True:
            run.decode_pod_failed(failed_address)
            if error.code is grpc.StatusCode.UNAVAILABLE:
                self.registry.suspect(failed_address)
            if error.code not in worth_another_pod or run.migrations >= self.config.max_migrations or run.aborted:
                raise error
            await self._wait_for_decode_pods(run, f"no decode pod to continue on after {failed_address}",
                                             lambda: bool(self._migration_targets(run)))
            if run.aborted:
                raise error
            others = self._migration_targets(run)
            if not others:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{error.message}; no other decode pod to continue "
                                  f"the request on after {run.num_output_tokens} tokens")
            pod = self.policy.choose_decode(run.request.prompt_token_ids + run.output_token_ids, others)
            log.warning("request %s: %s after %d output tokens; migrating it to decode pod %s",
                        run.request.request_id, error.message, run.num_output_tokens, pod.address)
            run.migrated()
            self.metrics.migrations.inc()
            self.metrics.count(self.metrics.pod_requests, pod.address, str(pod.role))
            try:
                return await self._start_on_decode_pod(run, pod, list(run.output_token_ids))
            except StatusError as failed:
                failed_address, error = pod.address, failed
                # The target failed before its first message: worth the next one as a first attempt is retried
                # (gone, full, draining), or as a stream that broke; past the deadline, nothing is.
                worth_another_pod = () if run.out_of_time() else MIGRATABLE_CODES + RETRYABLE_CODES


"""``Placement``: the router's scheduling decisions, made as vLLM v1's scheduler makes them: synchronous, over a
snapshot of the pods (``PodSnapshot``), returning plain values. It calls no pod, awaits nothing and keeps no
request's state: the request's run (``request_run.py``) asks, acts on the answer and keeps what happened.

The decisions, in the order a request meets them:

1. ``admit(num_pending, pods)``: refuse at once with RESOURCE_EXHAUSTED and a retry-after hint (HTTP 429) when the
   router already has ``max_pending_requests`` waiting for their first token (this one counted);
2. ``route(request, pods, avoid)``: a ``RoutePlan`` from the routing policy over the routable pods: a decode pod D,
   and a prefill pod P unless the prompt is short or mostly cached on D (conditional disaggregation). Pods in
   ``avoid`` (they failed this request) are left out: prefill pods even if none remains (then D prefills the
   prompt), decode pods unless none would remain. Refused (RESOURCE_EXHAUSTED) when the pod that would prefill has
   more queued than it prefills in ``max_queue_time_s``: shed now, rather than answer after the client gave up;
3. ``retry(error, plan, attempt)``: after attempt number ``attempt`` failed before the first token, a ``Retry``:
   whether to try again (a pod gone, full or draining, P's push to D failing, corrupt or late:
   ``RETRYABLE_CODES``, at most ``max_retries`` times), after what backoff (doubling per attempt: a pod that just
   died is seen as down by its health stream within about a second, and a full one frees room as its requests
   finish), which pods to leave out next time, and which decode pod to hold suspect (its call failed as if it
   were gone);
4. ``after_break(error, migrations)`` and ``migration_target(token_ids, failed, pods)``: when D's stream broke off
   after output started, a ``Migration`` (whether another decode pod is worth it, which pod to hold suspect), and
   which decode pod continues the request: never one that failed it, unless it began to serve again since (a
   restart), and ``max_migrations`` moves in all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.pods.registry import PodInfo, PodSnapshot
from splitserve.router.policies import RoutingPolicy
from splitserve.router.route_plan import RoutePlan, SLOTargets
from splitserve.runtime.errors import StatusError

log = logging.getLogger(__name__)

# Before the first token, worth another pair of pods: the pod is gone, full or draining, or P could not hand the
# KV to D (refused, corrupt, or past the transfer's own deadline while the request still has time).
RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS,
                   grpc.StatusCode.DEADLINE_EXCEEDED)
# After output started, a stream that broke this way moves to another decode pod.
MIGRATABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
# A retry's first pause (seconds), doubled for each later one: a pod that just died is seen as down by its health
# stream within about a second, and a full one frees room as its requests finish; a retry at once finds the same.
RETRY_BACKOFF_S = 0.1


@dataclass(frozen=True)
class Retry:
    """What follows a failure before the first token."""

    again: bool  # False: give up, the failure is the request's answer
    avoid: frozenset[str]  # the failed attempt's pods: the next attempt prefers others
    backoff_s: float  # the pause before the next attempt
    suspect: str | None  # a decode pod whose call failed as if it were gone: out of placement until its health says


@dataclass(frozen=True)
class Migration:
    """What follows a decode pod's failure after the first token."""

    again: bool  # False: give up, the failure ends the request
    suspect: str | None  # the pod, when it failed as if it were gone


class Placement:
    """Admission, routes, retries and migrations for the router's requests (module docstring)."""

    def __init__(self, config: RouterConfig, policy: RoutingPolicy):
        self.config = config
        self.policy = policy

    # -- 1: admission -------------------------------------------------------------------------------------------

    def admit(self, num_pending: int, pods: PodSnapshot) -> None:
        """Shed load before any work: RESOURCE_EXHAUSTED (HTTP 429) with a hint of when to retry. ``num_pending``:
        the router's requests waiting for their first token, this one counted."""
        limit = self.config.max_pending_requests
        if limit and num_pending > limit:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{num_pending - 1} requests are already waiting for their first token (the "
                              f"router's max_pending_requests is {limit}); retry later",
                              retry_after_s=self._queue_wait_estimate(pods))

    @staticmethod
    def _queue_wait_estimate(pods: PodSnapshot) -> float:
        """Seconds until the least-queued prefilling pod would start a new prompt, from its measured rate."""
        waits = [pod.prefill_wait_s for pod in pods.prefill or pods.decode]
        return min((wait for wait in waits if wait is not None), default=1.0)

    # -- 2: the route -------------------------------------------------------------------------------------------

    def route(self, req: RouterRequest, pods: PodSnapshot, avoid: frozenset[str] = frozenset()) -> RoutePlan:
        """Where ``req`` runs, leaving out the pods in ``avoid`` (they failed it): prefill pods even if none remains
        (D then prefills the prompt), decode pods unless none would remain. Refused (RESOURCE_EXHAUSTED) past
        ``max_queue_time_s``; the policy refuses when no decode pod serves (UNAVAILABLE) or has room."""
        prefill = [pod for pod in pods.prefill if pod.address not in avoid]
        decode = _prefer_others(pods.decode, avoid)
        plan = self.policy.choose_pair(req, prefill, decode, SLOTargets.of(req, self.config))
        log.debug("request %s: prefill %s, decode %s (%s)", req.request_id,
                  plan.prefill.address if plan.prefill else "-", plan.decode.address, plan.reason)
        self._check_queue_time(plan)
        return plan

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

    # -- 3: a failure before the first token --------------------------------------------------------------------

    def retry(self, error: StatusError, plan: RoutePlan, attempt: int) -> Retry:
        """After attempt number ``attempt`` (1: the first) on ``plan`` failed with ``error`` before the first token.

        A decode pod's own call that failed UNAVAILABLE makes it suspect, so that neither the retry nor other
        requests go there before its health stream says; not a prefill pod's: it answers UNAVAILABLE for a push its
        decode pod broke off, and the retry passes it over anyway. The retry then waits for a decode pod as a
        migration does (``decode_pod_wait_s``): a sole decode pod that died is waited for, not failed twice."""
        gone = error.code is grpc.StatusCode.UNAVAILABLE and error.peer == plan.decode.address
        tried = frozenset(pod.address for pod in (plan.prefill, plan.decode) if pod is not None)
        return Retry(again=error.code in RETRYABLE_CODES and attempt <= self.config.max_retries, avoid=tried,
                     backoff_s=RETRY_BACKOFF_S * 2 ** (attempt - 1), suspect=plan.decode.address if gone else None)

    # -- 4: a decode pod lost after the first token -------------------------------------------------------------

    def after_break(self, error: StatusError, failed_address: str, migrations: int,
                    target_failed: bool = False) -> Migration:
        """After the decode pod at ``failed_address`` failed the request with ``error``, ``migrations`` moves made:
        a stream that broke (``MIGRATABLE_CODES``), or a migration's target that failed before its first message
        (``target_failed``: also as a first attempt is retried, gone, full or draining), is worth another pod while
        ``max_migrations`` allows."""
        worth = MIGRATABLE_CODES + RETRYABLE_CODES if target_failed else MIGRATABLE_CODES
        gone = error.code is grpc.StatusCode.UNAVAILABLE
        return Migration(again=error.code in worth and migrations < self.config.max_migrations,
                         suspect=failed_address if gone else None)

    def migration_target(self, token_ids: list[int], failed: Mapping[str, float],
                         decode_pods: Sequence[PodInfo]) -> PodInfo | None:
        """The decode pod that continues a request from ``token_ids`` (its prompt and the tokens sent); None when
        every serving one failed it (``failed``: address -> when, ``time.monotonic()``) and has not restarted."""
        others = self.migration_targets(failed, decode_pods)
        return self.policy.choose_decode(token_ids, others) if others else None

    @staticmethod
    def migration_targets(failed: Mapping[str, float], decode_pods: Sequence[PodInfo]) -> list[PodInfo]:
        """Serving decode pods that have not failed the request, or began to serve again since they did (a pod
        restarted at the same address is a new process)."""
        return [pod for pod in decode_pods if pod.address not in failed or pod.serving_since > failed[pod.address]]


def _prefer_others(pods: list[PodInfo], avoid: frozenset[str]) -> list[PodInfo]:
    """Pods not in ``avoid`` (those that failed this request), or all of them when no other is left."""
    return [pod for pod in pods if pod.address not in avoid] or pods

"""``Router``: the router's requests, from the client API to the pods and back, as token ids inside and text at the
edge.

The HTTP and gRPC layers call ``make_request`` (validate, tokenize) and then iterate ``generate(request)``. The
way reads through these files, one per concept:

1. ``intake.py`` (``RequestIntake``): the request -> token ids within the server's limits: ``make_request``,
   ``tokenize``, ``detokenize``, ``apply_chat_template``, which ``Router`` hands through;
2. ``request_run.py`` (``RequestRun``): the request in flight, and the one owner of its state: it drives the request
   through admission, placement, its first token, its stream and migrations to exactly one ``Completion``;
3. ``placement.py`` (``Placement``): the decisions the run asks for (admit or refuse, which pods, retry or give up,
   where to migrate), synchronous, over a snapshot of the pods.

This file ties them together: ``generate`` makes the run, registers it (for ``abort`` and for admission's count of
requests waiting for their first token) and iterates it; a finished answer may then be checked by serving it again
through another path (``shadow.py``, off by default). The router writes no field of its runs: it asks them.

Errors: before any output, ``generate`` raises ``StatusError`` (no pod: UNAVAILABLE; pods full or queues too
long: RESOURCE_EXHAUSTED; timeout: DEADLINE_EXCEEDED; ...). A pod's own CANCELLED (it was shutting down) is
UNAVAILABLE here: only the client's own cancellation is CANCELLED. After output started, a failure that migration
cannot mend ends the stream with ``Completion(finish_reason="error", error=...)`` and a log line.
``abort(request_id)`` and a client that stops iterating (generator closed, task cancelled) cancel the pod
calls; an aborted request still ends with ``Completion(finish_reason="abort")``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import FinishReason
from splitserve.engine.text.detokenizer import IncrementalDetokenizer
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.router.config import RouterConfig, Scheduling
from splitserve.router.intake import DEFAULT_SERVICE, RequestIntake, RouterRequest, ServiceLevel, invalid
from splitserve.router.latency import HybridPlacement
from splitserve.router.outputs import Completion, OutputDelta
from splitserve.router.placement import Placement
from splitserve.router.pods.client import PodClientPool
from splitserve.router.pods.monitor import PodMonitor
from splitserve.router.pods.registry import PodInfo, PodRegistry, RedisRegistry, StaticRegistry
from splitserve.router.policies import LocalPrefill, RoutingPolicy, make_policy
from splitserve.router.request_run import RequestRun, RouterParts
from splitserve.router.shadow import ShadowChecks
from splitserve.runtime.discovery import RegistryKind
from splitserve.runtime.errors import StatusError
from splitserve.runtime.metrics import RouterMetrics

log = logging.getLogger(__name__)


class Router:
    """Validates, tokenizes and places requests on prefill/decode pods; streams their output back as text."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None,
                 registry: PodRegistry | None = None, metrics: RouterMetrics | None = None,
                 policy: RoutingPolicy | None = None):
        self.config = config
        self.model_name = config.model
        self.intake = RequestIntake(config, tokenizer if tokenizer is not None else load_tokenizer(config.model))
        self.metrics = metrics if metrics is not None else RouterMetrics(config.model)
        self.pod_clients = PodClientPool(config.tls)
        self.registry = registry if registry is not None else self._build_registry()
        if policy is None:
            hybrid = HybridPlacement() if config.scheduling is Scheduling.HYBRID else None
            policy = make_policy(config.policy, LocalPrefill(config.conditional_prefill_threshold,
                                                              config.conditional_cached_fraction,
                                                              config.conditional_prefill_queue_s), hybrid=hybrid)
        self.placement = Placement(config, policy)
        self.shadow_checks = ShadowChecks(config, self.registry, self.pod_clients, self.metrics)
        self._runs: dict[str, RequestRun] = {}
        self._parts = RouterParts(config, self.metrics, self.registry, self.placement, self.pod_clients,
                                  num_pending=self.num_pending)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.intake.tokenizer

    async def start(self) -> None:
        await self.registry.start()

    async def stop(self) -> None:
        for request_id in list(self._runs):  # requests still running end as aborted
            await self.abort(request_id)
        await self.shadow_checks.stop()
        await self.registry.stop()
        await self.pod_clients.close()
        self.intake.close()

    def ready(self) -> bool:
        """Whether a request could be placed now: some decode-capable pod serves and is not draining."""
        return bool(self.registry.decode_pods())

    def pods(self) -> list[dict[str, Any]]:
        """The pods as the router sees them now (``GET /pods``): role, weight format (null before the pod's first
        report), whether it routes to them, their load."""
        now = time.monotonic()
        return [{"address": pod.address, "role": str(pod.role), "quantization": pod.load.quantization or None,
                 "healthy": pod.healthy, "serving": pod.serving,
                 "seconds_since_report": round(now - pod.load_at, 3) if pod.load_at else None,
                 "load": dataclasses.asdict(pod.load), "cached_blocks": len(pod.block_hashes),
                 "router_requests": pod.active_requests, "router_queued_prompt_tokens": pod.queued_prompt_tokens}
                for pod in sorted(self.registry.pods.values(), key=lambda pod: (pod.role, pod.address))]

    def _build_registry(self) -> PodRegistry:
        config = self.config
        watch = dict(monitor_factory=self._monitor, on_change=self._pod_changed, on_leave=self._pod_left)
        if config.registry is RegistryKind.REDIS:
            return RedisRegistry(config.redis_url, config.pod_ttl_s, **watch)
        return StaticRegistry(config.prefill_pods, config.decode_pods, config.mixed_pods, **watch)

    def _monitor(self, pod: PodInfo) -> PodMonitor:
        return PodMonitor(pod, self.pod_clients.get(pod.address, pod.role), self.registry.on_change)

    def _pod_changed(self, pod: PodInfo) -> None:
        labels = (self.metrics.role, self.model_name, pod.address, str(pod.role))
        metrics, load = self.metrics, pod.load
        metrics.pod_healthy.labels(*labels).set(1 if pod.healthy else 0)
        metrics.pod_running.labels(*labels).set(load.num_running)
        metrics.pod_waiting.labels(*labels).set(load.num_waiting)
        metrics.pod_queued_prefill_tokens.labels(*labels).set(load.queued_prefill_tokens)
        if load.total_kv_blocks:
            metrics.pod_kv_cache_usage.labels(*labels).set(1 - load.free_kv_blocks / load.total_kv_blocks)

    def _pod_left(self, pod: PodInfo) -> None:
        self.metrics.forget_pod(pod.address, str(pod.role))

    # -- the intake (intake.py) -------------------------------------------------------------------------------

    async def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
                           add_special_tokens: bool = True, timeout_s: float | None = None,
                           service: ServiceLevel = DEFAULT_SERVICE) -> RouterRequest:
        """``RequestIntake.make_request``: a request checked against the limits, its prompt as token ids."""
        return await self.intake.make_request(prompt, params, request_id, add_special_tokens=add_special_tokens,
                                              timeout_s=timeout_s, service=service)

    async def tokenize(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        return await self.intake.tokenize(text, add_special_tokens, field)

    async def detokenize(self, token_ids: list[int], field: str = "tokens") -> str:
        return await self.intake.detokenize(token_ids, field)

    async def apply_chat_template(self, messages: list[dict[str, Any]], **options: Any) -> str:
        """``RequestIntake.apply_chat_template``: the conversation as the model's chat template renders it."""
        return await self.intake.apply_chat_template(messages, **options)

    # -- the request's path -----------------------------------------------------------------------------------

    async def generate(self, req: RouterRequest) -> AsyncIterator[OutputDelta | Completion]:
        if req.request_id in self._runs:
            raise invalid(f"request_id: {req.request_id!r} is already in flight")
        params = req.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                                             params.stop, params.include_stop_str_in_output)
        checked = self.shadow_checks.draw(req)  # the pods then give its tokens' logprobs, for the check
        run = RequestRun(checked or req, detokenizer, self._parts, shadow_checked=checked is not None,
                         client_logprobs=params.logprobs is not None)
        self._runs[req.request_id] = run
        self.metrics.num_requests_running.inc()
        try:
            async with aclosing(run.serve()) as outputs:
                async for output in outputs:
                    yield output
        except StatusError as error:  # refused before any output
            self.metrics.count(self.metrics.rejected, error.code.name)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            if run.finish_reason is None:
                log.info("request %s: the client went away; cancelling its pod calls", req.request_id)
                self.metrics.finished(FinishReason.ABORT)
            raise
        finally:
            if run.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self.shadow_checks.consider(run)
            self.metrics.num_requests_running.dec()
            del self._runs[req.request_id]

    def num_pending(self) -> int:
        """Requests admitted or being admitted that have no first token yet (``Placement.admit`` bounds them)."""
        return sum(run.waiting_for_first_token for run in self._runs.values())

    async def abort(self, request_id: str) -> bool:
        """Ends a request in flight with finish_reason "abort"; False if there is none with this id."""
        run = self._runs.get(request_id)
        if run is None:
            return False
        run.abort()  # the pods abort the request and free its blocks
        return True

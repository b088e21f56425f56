"""Answers checked while serving: a share of finished requests served again through another path, and compared.

A KV hand-off that silently corrupts answers (a codec bug, a stale peer, a layout mismatch the handshake missed)
shows in no latency or error metric. Greedy and seeded answers are the same whatever path served them ("Same
answer, any topology", DESIGN.md), so the router can check its own: with ``--shadow-check-fraction`` set,
``ShadowChecks.consider(run)`` is told of every request that finished, and for that share of the greedy or seeded
ones (one prompt, not n samples):

1. after the answer went to the client (in the background: the client waits for nothing), it picks the other
   path: a request a prefill pod prefilled (disaggregated or split) is prefilled on a decode pod, preferring
   another one than its KV went to; a request prefilled on its decode pod goes through a prefill pod, its KV
   pushed to a decode pod and claimed there;
2. it runs the request there, as ``shadow-<request id>``, for as many tokens as the client got, straight on the
   pods (``PodClient``: the router's request metrics and load counts see only real requests);
3. it compares the tokens: ``splitserve_router_shadow_checks_total{outcome="match"|"diverged"|"failed"}``, and for a
   divergence the first differing output position (``splitserve_router_shadow_divergence_position``) and a warning
   naming the request, the two paths and both tokens there.

Tokens only: logprobs are not compared (a lossy KV codec moves them a little without changing an answer; the tokens
are what a user sees). One check runs at a time; a request finishing meanwhile is not checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random

import grpc

from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.pods.client import PodClientPool, decode_request, prefill_request
from splitserve.router.pods.registry import PodRegistry
from splitserve.router.request_run import RequestRun
from splitserve.runtime.metrics import RouterMetrics

log = logging.getLogger(__name__)


def first_divergence(served: list[int], again: list[int]) -> int | None:
    """The first output position where ``again`` differs from ``served`` (``again`` ending early counts), or None."""
    for position, token_id in enumerate(served):
        if position >= len(again) or again[position] != token_id:
            return position
    return None


class ShadowChecks:
    """Serves a share of finished greedy or seeded requests again through another path (module docstring)."""

    def __init__(self, config: RouterConfig, registry: PodRegistry, pod_clients: PodClientPool,
                 metrics: RouterMetrics, rng: random.Random | None = None):
        self.config, self.registry, self.pod_clients, self.metrics = config, registry, pod_clients, metrics
        self._rng = rng or random.Random()
        self._running: asyncio.Task | None = None

    def consider(self, run: RequestRun) -> None:
        """``run`` finished: check it in the background if it is drawn and replayable (greedy or seeded, one
        sample, tokens out, nothing already being checked)."""
        req, tokens = run.request, list(run.output_token_ids)
        fraction = self.config.shadow_check_fraction
        if not fraction or not tokens or req.samples is not None or run.aborted:
            return
        if not (req.params.is_greedy or req.params.seed is not None) or self._rng.random() >= fraction:
            return
        if self._running is not None and not self._running.done():
            return
        remote = bool(run.kv_sent_to)  # a prefill pod pushed its KV: check it prefilled on a decode pod
        avoid = {pod.address for pod in run.kv_sent_to}
        self._running = asyncio.get_running_loop().create_task(self._check(req, tokens, remote, avoid),
                                                               name=f"shadow-{req.request_id}")

    async def stop(self) -> None:
        if self._running is not None:
            self._running.cancel()
            await asyncio.gather(self._running, return_exceptions=True)

    async def _check(self, req: RouterRequest, served: list[int], remote: bool, avoid: set[str]) -> None:
        shadow = dataclasses.replace(req, request_id=f"shadow-{req.request_id}",
                                     params=dataclasses.replace(req.params, max_tokens=len(served)), samples=None)
        path = "prefilled on a decode pod" if remote else "through a prefill pod"
        try:
            again = await asyncio.wait_for(self._run(shadow, remote, avoid), self.config.request_timeout_s)
        except (grpc.aio.AioRpcError, TimeoutError, LookupError) as error:
            log.info("shadow check of request %s %s did not finish: %r", req.request_id, path, error)
            self.metrics.count(self.metrics.shadow_checks, "failed")
            return
        position = first_divergence(served, again)
        if position is None:
            self.metrics.count(self.metrics.shadow_checks, "match")
            return
        self.metrics.count(self.metrics.shadow_checks, "diverged")
        self.metrics.shadow_divergence_position.observe(position)
        log.warning("shadow check of request %s: served %s, %s gave %s at output position %d of %d",
                    req.request_id, served[position], path, again[position] if position < len(again) else "its end",
                    position, len(served))

    async def _run(self, req: RouterRequest, remote: bool, avoid: set[str]) -> list[int]:
        """``req``'s output tokens, prefilled on a decode pod (``remote``: the original was not) or through a prefill
        pod; LookupError when no pod serves that path now."""
        decode_pods, prefill_pods = self.registry.decode_pods(), self.registry.prefill_pods()
        if not decode_pods or not (remote or prefill_pods):
            raise LookupError("no pod serves the other path now")
        decode = next((pod for pod in decode_pods if pod.address not in avoid), decode_pods[0])
        decode_client = self.pod_clients.get(decode.address, decode.role)
        tpot_s = req.slo_tpot_s or self.config.slo_tpot_s
        if remote:
            return await self._tokens(decode_client.decode(decode_request(req, tpot_s), self.config.request_timeout_s))
        prefill = prefill_pods[0]
        pushed = prefill_request(req, req.params, decode.address, self.config.kv_codec, self.config.kv_lease_s)
        first = await self.pod_clients.get(prefill.address, prefill.role).prefill(pushed, self.config.request_timeout_s)
        claim = decode_request(req, tpot_s, first_token_id=first.first_token_id)
        try:
            return [first.first_token_id, *await self._tokens(decode_client.decode(claim, self.config.request_timeout_s))]
        except BaseException:
            await decode_client.drop(req.request_id)  # the KV pushed there, if the claim never took it
            raise

    @staticmethod
    async def _tokens(call) -> list[int]:
        """The tokens of a Decode call's stream."""
        return [token_id async for message in call if message.HasField("chunk") for token_id in message.chunk.token_ids]

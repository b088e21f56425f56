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
3. it compares the tokens and their logprobs: ``splitserve_router_shadow_checks_total{outcome="match"|"diverged"|
   "failed"}``; for a divergence the first output position where a token differs or a token's logprob differs by
   more than ``LOGPROB_TOLERANCE`` (``splitserve_router_shadow_divergence_position``) and a warning naming the
   request, the two paths and what differs there; for every compared check the largest logprob difference over the
   tokens both runs share (``splitserve_router_shadow_logprob_delta``).

The served answer's logprobs are needed for that, and a client rarely asks for them: the share of requests to check is
drawn when a request arrives (``draw``), and the pods are asked for the sampled token's logprob of the drawn ones
(one log-softmax per token, already computed for sampling); the client gets logprobs only if it asked. One check runs
at a time; a drawn request finishing meanwhile is not checked.
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

# Natural-log units, on the logprob of the same token in the same place. Two lossless paths compute it from the same
# weights and the same KV in other batch shapes and prefill chunkings: on SmolLM2 they differed by at most 1e-6
# (measured: docs/RELIABILITY.md; tests/test_shadow_checks.py bounds them at 1e-3). int8 KV moved each check's
# largest logprob by 0.01 to 0.05 there, a 4-bit one by up to 0.5, and a KV that is wrong (a stale peer, a codec
# bug, a corrupt block) moves them by tenths before it flips a greedy token: 5e-3 (a 0.5% change in the
# probability of the token the user got) is 5,000x the lossless noise and below what int8 does, so int8's checks
# show it, as a lossy codec's are meant to.
LOGPROB_TOLERANCE = 5e-3


def first_divergence(served: list[int], again: list[int]) -> int | None:
    """The first output position where ``again`` differs from ``served`` (``again`` ending early counts), or None."""
    for position, token_id in enumerate(served):
        if position >= len(again) or again[position] != token_id:
            return position
    return None


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two runs of one request compared: where they first differ (None: nowhere), how, and the largest logprob
    difference over the tokens both gave alike (None: no logprobs to compare)."""

    position: int | None
    what: str  # "" (they match), "token" or "logprob"
    max_logprob_delta: float | None


def compare(served: list[int], served_logprobs: list[float] | None, again: list[int],
            again_logprobs: list[float] | None, tolerance: float = LOGPROB_TOLERANCE) -> Comparison:
    """The first position where the tokens differ, or, before it, where the same token's logprobs differ by more than
    ``tolerance``; logprobs are compared where both runs have them (a run without them compares tokens only)."""
    token_position = first_divergence(served, again)
    same = len(served) if token_position is None else token_position
    if served_logprobs is None or again_logprobs is None:
        deltas = []
    else:
        deltas = [abs(a - b) for a, b in zip(served_logprobs[:same], again_logprobs[:same])]
    logprob_position = next((i for i, delta in enumerate(deltas) if delta > tolerance), None)
    max_delta = max(deltas, default=None)
    if logprob_position is not None:
        return Comparison(logprob_position, "logprob", max_delta)
    return Comparison(token_position, "" if token_position is None else "token", max_delta)


class ShadowChecks:
    """Serves a share of finished greedy or seeded requests again through another path (module docstring)."""

    def __init__(self, config: RouterConfig, registry: PodRegistry, pod_clients: PodClientPool,
                 metrics: RouterMetrics, rng: random.Random | None = None):
        self.config, self.registry, self.pod_clients, self.metrics = config, registry, pod_clients, metrics
        self._rng = rng or random.Random()
        self._running: asyncio.Task | None = None

    @property
    def running(self) -> asyncio.Task | None:
        """The last check started (running or over); None while none has been."""
        return self._running

    def draw(self, req: RouterRequest) -> RouterRequest | None:
        """A request arrives: None if it is not to be checked (not drawn, or not replayable: greedy or seeded, one
        sample, tokens out); else the request the pods are to run, asking for its tokens' logprobs."""
        fraction = self.config.shadow_check_fraction
        if not fraction or req.samples is not None or req.params.max_tokens == 0:
            return None
        if not (req.params.is_greedy or req.params.seed is not None) or self._rng.random() >= fraction:
            return None
        if req.params.logprobs is not None:
            return req
        return dataclasses.replace(req, params=dataclasses.replace(req.params, logprobs=0))

    def consider(self, run: RequestRun) -> None:
        """``run`` finished: check it in the background if it was drawn (``draw``), gave tokens and nothing is being
        checked now."""
        req, output = run.request, run.output
        tokens = list(output.output_token_ids)
        if output.shadow_logprobs is None or not tokens or run.aborted:
            return
        if self._running is not None and not self._running.done():
            return
        served_logprobs = output.shadow_logprobs if len(output.shadow_logprobs) == len(tokens) else None
        remote = bool(run.kv_sent_to)  # a prefill pod pushed its KV: check it prefilled on a decode pod
        avoid = {pod.address for pod in run.kv_sent_to}
        self._running = asyncio.get_running_loop().create_task(
            self._check(req, tokens, served_logprobs, remote, avoid), name=f"shadow-{req.request_id}")

    async def stop(self) -> None:
        if self._running is not None:
            self._running.cancel()
            await asyncio.gather(self._running, return_exceptions=True)

    async def _check(self, req: RouterRequest, served: list[int], served_logprobs: list[float] | None, remote: bool,
                     avoid: set[str]) -> None:
        # ``req`` is the drawn request (``draw``): it asks for its tokens' logprobs already.
        shadow = dataclasses.replace(req, request_id=f"shadow-{req.request_id}", samples=None,
                                     params=dataclasses.replace(req.params, max_tokens=len(served)))
        path = "prefilled on a decode pod" if remote else "through a prefill pod"
        try:
            again, again_logprobs = await asyncio.wait_for(self._run(shadow, remote, avoid),
                                                           self.config.request_timeout_s)
        except (grpc.aio.AioRpcError, TimeoutError, LookupError) as error:
            log.info("shadow check of request %s %s did not finish: %r", req.request_id, path, error)
            self.metrics.count(self.metrics.shadow_checks, "failed")
            return
        found = compare(served, served_logprobs, again, again_logprobs if len(again_logprobs) == len(again) else None)
        if found.max_logprob_delta is not None:
            self.metrics.shadow_logprob_delta.observe(found.max_logprob_delta)
        if found.position is None:
            self.metrics.count(self.metrics.shadow_checks, "match")
            return
        self.metrics.count(self.metrics.shadow_checks, "diverged")
        self.metrics.shadow_divergence_position.observe(found.position)
        at = found.position
        if found.what == "token":
            detail = f"token {served[at]}, {path} gave {again[at] if at < len(again) else 'its end'}"
        else:
            detail = (f"token {served[at]} with logprob {served_logprobs[at]:.4f}, {path} with "
                      f"{again_logprobs[at]:.4f} (tolerance {LOGPROB_TOLERANCE:g})")
        log.warning("shadow check of request %s diverged (%s) at output position %d of %d: served %s",
                    req.request_id, found.what, at, len(served), detail)

    async def _run(self, req: RouterRequest, remote: bool, avoid: set[str]) -> tuple[list[int], list[float]]:
        """``req``'s output tokens and their logprobs, prefilled on a decode pod (``remote``: the original was not) or
        through a prefill pod; LookupError when no pod serves that path now."""
        decode_pods, prefill_pods = self.registry.decode_pods(), self.registry.prefill_pods()
        if not decode_pods or not (remote or prefill_pods):
            raise LookupError("no pod serves the other path now")
        decode = next((pod for pod in decode_pods if pod.address not in avoid), decode_pods[0])
        decode_client = self.pod_clients.get(decode.address, decode.role)
        tpot_s = req.slo_tpot_s or self.config.slo_tpot_s
        if remote:
            return await self._tokens(decode_client.decode(decode_request(req, tpot_s), self.config.request_timeout_s))
        prefill = prefill_pods[0]
        pushed = prefill_request(req, decode.address, self.config.kv_codec, self.config.kv_lease_s)
        try:  # P's call too: P may fail after its push reached D (killed before it answered)
            first = await self.pod_clients.get(prefill.address, prefill.role).prefill(pushed,
                                                                                      self.config.request_timeout_s)
            claim = decode_request(req, tpot_s, first_token_id=first.first_token_id,
                                   first_token_logprob=first.first_token_logprob)
            tokens, logprobs = await self._tokens(decode_client.decode(claim, self.config.request_timeout_s))
        except BaseException:
            await decode_client.drop(req.request_id)  # the KV pushed there, if no claim took it
            raise
        # D's stream begins after the first token P sampled (the router's own claim puts it in D's first chunk).
        return [first.first_token_id, *tokens], [first.first_token_logprob.logprob, *logprobs]

    @staticmethod
    async def _tokens(call) -> tuple[list[int], list[float]]:
        """The tokens of a Decode call's stream and their logprobs."""
        tokens: list[int] = []
        logprobs: list[float] = []
        async for message in call:
            if message.HasField("chunk"):
                tokens += message.chunk.token_ids
                logprobs += [entry.logprob for entry in message.chunk.logprobs.tokens]
        return tokens, logprobs

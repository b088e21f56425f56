"""Routing policies: which decode pod D and which prefill pod P serve a request, and whether it needs P at all.

``RoutingPolicy.choose_pair(request, prefill_pods, decode_pods)`` walks the same steps for every policy:

1. keep the decode-capable pods (decode and mixed) with room in their KV cache for the prompt; none
   -> ``RESOURCE_EXHAUSTED`` (back-pressure: the client should retry later);
2. D = ``pick_decode(...)``, the policy's choice;
3. conditional disaggregation (``LocalPrefill``): no prefill pod, a prompt shorter than
   ``conditional_prefill_threshold``, or one whose prefix D mostly holds already is cheaper to prefill on D
   than to prefill on P and ship over the network; and, load-aware, a prompt that would wait at least
   ``conditional_prefill_queue_s`` behind every prefill pod's queue starts sooner on a D with no prompt of its own
   queued -> ``RoutePlan(prefill=None, decode=D)``;
4. P = ``pick_prefill(...)`` -> ``RoutePlan(prefill=P, decode=D)``.

With hybrid scheduling (``HybridPlacement``), step 3 is decided from predicted latency instead of these rules:
the prompt prefills where its first token is predicted to come first, on a prefill pod (remote) or lent to D in
chunks bounded by its running requests' TPOT slack (``router/latency.py``).

Policies differ only in steps 2 and 4, and are picked by name (``make_policy``):

- ``round_robin``: in turn, by address order;
- ``least_loaded``: D with the fewest requests (running and waiting), then the most free KV blocks; P with the
  fewest prompt tokens queued for prefill;
- ``power_of_two``: two random candidates, the less loaded of them (cheap, and robust to a stale view);
- ``prefix_aware``: the pod holding the longest cached prefix of the prompt, ties to the least loaded.

Load is ``PodInfo``'s view: the pod's last report, raised to what this router knows it sent there since (its own
requests in flight, the KV blocks they took), so a burst between two reports does not pile onto one pod.

Prefix matching uses the chained block hashes the pods compute (``splitserve.engine.block_manager``), at each pod's
block size: a pod's published hash of block i names the prompt's whole prefix up to the end of block i.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from splitserve.router.config import PolicyName
from splitserve.router.latency import HybridPlacement
from splitserve.router.pods.registry import PodInfo
from splitserve.router.route_plan import PromptBlocks, RoutePlan, SLOTargets
from splitserve.runtime.config import member
from splitserve.runtime.errors import StatusError

if TYPE_CHECKING:
    from splitserve.router.intake import RouterRequest

# No decode pod serving usually means one loading or restarting (seconds, under `splitserve up`'s supervisor or a
# Kubernetes restart): the 503 tells clients to come back after this long (Retry-After, grpc-retry-pushback-ms).
NO_DECODE_POD_RETRY_S = 2.0
# Tests of the split path's faults on real pods (tests/reliability/test_split_faults.py): with N in the router's
# environment, hybrid placement splits every prompt that may split and is longer than N tokens at N (whole blocks of
# the decode pod), whatever it predicts, so that a split is made by the test and not by the machine's timing.
FORCE_SPLIT_ENV = "SPLITSERVE_TEST_FORCE_SPLIT_TOKENS"


def has_room(pod: PodInfo, num_prompt_tokens: int) -> bool:
    """Room for the prompt's KV and the first output token. A pod that has not reported its pool yet may have
    room: it says RESOURCE_EXHAUSTED itself if not."""
    if not pod.load.total_kv_blocks:
        return True
    return pod.free_kv_blocks >= pod.blocks_for(num_prompt_tokens + 1)


def decode_load(pod: PodInfo) -> tuple:
    """Sort key, least loaded first: fewest requests (a decode step's time grows with its batch), then most free
    KV blocks; the address breaks ties."""
    return pod.busy, -pod.free_kv_blocks, pod.address


def prefill_load(pod: PodInfo) -> tuple:
    """Sort key, least loaded first: fewest prompt tokens queued, then fewest requests."""
    return pod.queued_tokens, pod.busy, pod.address


@dataclass(frozen=True)
class LocalPrefill:
    """Conditional disaggregation: when the decode pod D prefills a prompt itself instead of a prefill pod.

    By the prompt (``threshold``, ``cached_fraction``) and by load (``queue_s``), as Dynamo's conditional
    disaggregation decides by prompt length and prefill queue size, here in seconds: when even the least queued
    prefill pod would start the prompt ``queue_s`` or more from now (its queued prompt tokens at its measured
    prefill rate) and D has no prompt of its own queued, D starts it at its next step. That lends the decode pod's
    cycles to prefill when the prefill pods fall behind, at the price of one prefill's stall of D's running
    decodes; at most one such prompt is queued on D at a time. 0 turns the load rule off.
    """

    threshold: int = 32
    cached_fraction: float = 0.8
    queue_s: float = 0.0

    def reason(self, num_prompt_tokens: int, cached_on_decode: int, prefill_pods: list[PodInfo],
               decode: PodInfo) -> str | None:
        """Why ``decode`` should prefill this prompt itself, or None if a prefill pod should."""
        if not prefill_pods:
            return "no prefill pod: prefill on the decode pod"
        if num_prompt_tokens < self.threshold:
            return f"short prompt ({num_prompt_tokens} < {self.threshold} tokens): prefill on the decode pod"
        fraction = cached_on_decode / num_prompt_tokens
        if fraction >= self.cached_fraction:
            return f"{fraction:.0%} of the prompt cached on the decode pod: prefill there"
        if self.queue_s and decode.queued_tokens == 0:
            waits = [pod.prefill_wait_s for pod in prefill_pods]
            if all(wait is not None and wait >= self.queue_s for wait in waits):
                return (f"every prefill pod is at least {min(waits):.1f} s behind (conditional_prefill_queue_s "
                        f"{self.queue_s:g} s): prefill on the decode pod")
        return None


class RoutingPolicy:
    """Base policy: the shared steps of ``choose_pair``; subclasses pick among candidates."""

    name: PolicyName

    def __init__(self, local_prefill: LocalPrefill | None = None, hybrid: HybridPlacement | None = None):
        self.local_prefill = local_prefill or LocalPrefill()
        self.hybrid = hybrid  # None: step 3 by LocalPrefill's rules
        self.forced_split_tokens = int(os.environ.get(FORCE_SPLIT_ENV, "0"))  # 0: hybrid placement decides

    def choose_pair(self, request: RouterRequest, prefill_pods: list[PodInfo],
                    decode_pods: list[PodInfo], targets: SLOTargets | None = None) -> RoutePlan:
        prompt = PromptBlocks(request.prompt_token_ids)
        num_tokens = len(prompt.token_ids)
        decode = self._choose_decode(prompt, decode_pods)
        if self.hybrid is not None and targets is not None:
            prefill = self.pick_prefill(prefill_pods, prompt) if prefill_pods else None
            may_split = request.may_split_prefill and _one_prefill_format(prefill, decode)
            forced = self.forced_split_tokens
            if prefill is not None and may_split and 0 < forced < num_tokens:
                return RoutePlan(prefill, decode, f"split at {forced} tokens ({FORCE_SPLIT_ENV})", prefix_tokens=forced)
            return self.hybrid.decide(prompt, prefill, decode, targets, may_split)
        local_reason = self.local_prefill.reason(num_tokens, prompt.cached_tokens(decode), prefill_pods, decode)
        if local_reason is not None:
            return RoutePlan(None, decode, local_reason)
        return RoutePlan(self.pick_prefill(prefill_pods, prompt), decode, "disaggregated")

    def choose_decode(self, token_ids: list[int], decode_pods: list[PodInfo]) -> PodInfo:
        """Steps 1 and 2 alone: the decode pod for ``token_ids`` (a migrated request's prompt and output so far)."""
        return self._choose_decode(PromptBlocks(token_ids), decode_pods)

    def _choose_decode(self, prompt: PromptBlocks, decode_pods: list[PodInfo]) -> PodInfo:
        num_tokens = len(prompt.token_ids)
        if not decode_pods:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "no decode pod is serving",
                              retry_after_s=NO_DECODE_POD_RETRY_S)
        roomy = [pod for pod in decode_pods if has_room(pod, num_tokens)]
        if not roomy:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"no decode pod has room for a {num_tokens}-token prompt; retry later")
        return self.pick_decode(roomy, prompt)

    def pick_decode(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        raise NotImplementedError

    def pick_prefill(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        raise NotImplementedError


class RoundRobinPolicy(RoutingPolicy):
    name = PolicyName.ROUND_ROBIN

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._turns = {"prefill": 0, "decode": 0}

    def pick_decode(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        return self._next("decode", pods)

    def pick_prefill(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        return self._next("prefill", pods)

    def _next(self, phase: str, pods: list[PodInfo]) -> PodInfo:
        ordered = sorted(pods, key=lambda pod: pod.address)
        pod = ordered[self._turns[phase] % len(ordered)]
        self._turns[phase] += 1
        return pod


class LeastLoadedPolicy(RoutingPolicy):
    name = PolicyName.LEAST_LOADED

    def pick_decode(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        return min(pods, key=decode_load)

    def pick_prefill(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        return min(pods, key=prefill_load)


class PowerOfTwoPolicy(RoutingPolicy):
    name = PolicyName.POWER_OF_TWO

    def __init__(self, *args, seed: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._rng = random.Random(seed)

    def pick_decode(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        return min(self._two(pods), key=decode_load)

    def pick_prefill(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        return min(self._two(pods), key=prefill_load)

    def _two(self, pods: list[PodInfo]) -> list[PodInfo]:
        ordered = sorted(pods, key=lambda pod: pod.address)  # the same seed draws the same pods
        return ordered if len(ordered) <= 2 else self._rng.sample(ordered, 2)


class PrefixAwarePolicy(RoutingPolicy):
    name = PolicyName.PREFIX_AWARE

    def pick_decode(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        return min(pods, key=lambda pod: (-prompt.cached_tokens(pod), decode_load(pod)))

    def pick_prefill(self, pods: list[PodInfo], prompt: PromptBlocks) -> PodInfo:
        return min(pods, key=lambda pod: (-prompt.cached_tokens(pod), prefill_load(pod)))


POLICIES: dict[PolicyName, type[RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobinPolicy, LeastLoadedPolicy, PowerOfTwoPolicy, PrefixAwarePolicy)
}
assert set(POLICIES) == set(PolicyName), "every policy name has its class"


def make_policy(name: PolicyName | str, local_prefill: LocalPrefill | None = None,
                seed: int | None = None, hybrid: HybridPlacement | None = None) -> RoutingPolicy:
    """The policy called ``name``; ``seed`` fixes power_of_two's draws (tests); ``hybrid``: step 3 from predicted
    latency."""
    name = member(PolicyName, "policy", name)
    extra = {"seed": seed} if name is PolicyName.POWER_OF_TWO else {}
    return POLICIES[name](local_prefill, hybrid=hybrid, **extra)


def _one_prefill_format(prefill: PodInfo | None, decode: PodInfo) -> bool:
    """A prompt split across ``prefill`` and ``decode`` gets one K/V format: both pods compute prefill in the same
    format (or one has not said yet). A tensor- or pipeline-parallel pod computes float32 under ``auto`` beside
    bfloat16 pods: a prefix in one format and the rest in the other would be neither pod's answer, nor the offline
    engine's in either format, so such a pair never splits (a whole prompt, lent or pushed, is one pod's)."""
    if prefill is None:
        return True
    formats = {prefill.load.prefill_compute_dtype, decode.load.prefill_compute_dtype}
    return len(formats - {""}) <= 1


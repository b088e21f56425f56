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
chunks bounded by its running requests' TPOT slack (see the class).

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

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from splitserve.engine.block_manager import chained_block_hashes
from splitserve.engine.step_time import PROBE_TOKENS, StepTimeModel, attention_positions
from splitserve.router.config import PolicyName
from splitserve.router.pods.registry import PodInfo
from splitserve.runtime.config import member
from splitserve.runtime.errors import StatusError

if TYPE_CHECKING:
    from splitserve.router.config import RouterConfig
    from splitserve.router.intake import RouterRequest

# No decode pod serving usually means one loading or restarting (seconds, under `splitserve up`'s supervisor or a
# Kubernetes restart): the 503 tells clients to come back after this long (Retry-After, grpc-retry-pushback-ms).
NO_DECODE_POD_RETRY_S = 2.0


@dataclass
class RoutePlan:
    prefill: PodInfo | None  # None: D prefills the prompt itself
    decode: PodInfo
    reason: str  # why this shape, for logs
    predicted_ttft_s: float | None = None  # hybrid placement's prediction (None: not predicted)
    prefix_tokens: int = 0  # a split prefill: P prefills this many leading prompt tokens, D the rest

    @property
    def decision(self) -> str:
        """The routing-decision metric's label."""
        if self.prefill is None:
            return "prefill_on_decode"
        return "split" if self.prefix_tokens else "disaggregated"


@dataclass(frozen=True)
class SLOTargets:
    """A request's latency targets, seconds: the router's --slo-ttft-s / --slo-tpot-s or the request's own."""

    ttft_s: float
    tpot_s: float

    @classmethod
    def of(cls, req: RouterRequest, config: RouterConfig) -> SLOTargets:
        """``req``'s own targets where it named them, else the router's."""
        return cls(req.slo_ttft_s or config.slo_ttft_s, req.slo_tpot_s or config.slo_tpot_s)


class PromptBlocks:
    """A prompt's chained block hashes, computed once per block size and reused for every candidate pod."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self._hashes_by_block_size: dict[int, list[int]] = {}

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes_by_block_size:
            self._hashes_by_block_size[block_size] = chained_block_hashes(self.token_ids, block_size)
        return self._hashes_by_block_size[block_size]

    def cached_tokens(self, pod: PodInfo) -> int:
        """Prompt tokens at the start of the prompt whose blocks ``pod`` has in its prefix cache."""
        if not pod.block_hashes:
            return 0
        matched = 0
        for block_hash in self.hashes(pod.load.block_size):
            if block_hash not in pod.block_hashes:
                break
            matched += 1
        return matched * pod.load.block_size


def blocks_for(num_tokens: int, pod: PodInfo) -> int:
    """KV blocks ``num_tokens`` take on ``pod``."""
    return math.ceil(num_tokens / pod.load.block_size)


def has_room(pod: PodInfo, num_prompt_tokens: int) -> bool:
    """Room for the prompt's KV and the first output token. A pod that has not reported its pool yet may have
    room: it says RESOURCE_EXHAUSTED itself if not."""
    if not pod.load.total_kv_blocks:
        return True
    return pod.free_kv_blocks >= blocks_for(num_prompt_tokens + 1, pod)


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


@dataclass(frozen=True)
class PrefillEstimate:
    """One way to prefill a prompt, predicted: its TTFT and what it costs the decodes already running on D."""

    ttft_s: float  # math.inf: this way cannot prefill it now
    detail: str  # the inputs, for the debug log
    tpot_cost_s: float = 0.0  # time added to each running request's next tokens on D, over the whole prefill


@dataclass(frozen=True)
class PrefillOption:
    """A candidate placement of one prompt: remote (``prefix_tokens`` = the whole prompt on P), lent (0) or split."""

    name: str
    prefix_tokens: int  # leading prompt tokens prefilled on P
    prefill_work: int  # prompt tokens P computes (its cached prefix left out)
    estimate: PrefillEstimate


# A lent prompt's chunks start, on average, this far into what D has to prefill (its attention grows with it).
MEAN_CHUNK_START = 0.5
# Weight of the newest KV transfer in the router's average transfer time per prompt token.
TRANSFER_RECENT_WEIGHT = 0.2
# Split prefills considered: P takes this fraction of the prompt (to D's block size), D the rest.
SPLIT_FRACTIONS = (0.25, 0.5, 0.75)
# P is the bottleneck once its queue takes this fraction of a request's TTFT target: work moves off it from then on.
BACKLOG_FRACTION = 0.25
# Moving work off P, an option counts as meeting the TTFT target when predicted within this fraction of it: the
# predictions err both ways, and the least work that only just meets the target would miss it half the time.
TTFT_HEADROOM = 0.8


class HybridPlacement:
    """Per request, from predicted latency: prefill on a prefill pod and ship the KV (remote), lend the prompt to the
    decode pod D, which prefills it in chunks interleaved with its decodes (lent), or split it: P prefills a prefix
    and ships its KV, D prefills the rest (split).

    remote   TTFT = P's queue (its queued prompt tokens at its measured rate) + the prompt's uncached tokens on P
             at P's measured step-time model + the KV transfer's exposed time (the router's running average per
             prompt token, for its codec); it costs D's decodes one more row.
    lent     D prefills what it has queued and then the prompt's uncached tokens on D, in chunks: each step the
             largest chunk D's measured model fits in the allowance it reports (its decoding requests' smallest
             TPOT slack, or its default target's when none decodes: ``PodLoad.tpot_allowance_seconds``), so
             TTFT = steps x that step's time; D with no TPOT to keep prefills in whole steps at its model's rate;
             D with no model (not warmed up) cannot be lent to.
    split    P's part as remote, for the first k tokens (k: ``SPLIT_FRACTIONS`` of the prompt, or P's cached
             prefix, in whole blocks of D and past D's own cached prefix); D's part as lent, for the tokens after k,
             once both the prefix's KV has arrived and D's own queue is prefilled: TTFT = max(P's part, D's queue)
             + D's part.

    Which one: while P's queue is short (under ``BACKLOG_FRACTION`` of the request's TTFT target, at P's measured
    rate), the prompt goes where its first token is predicted to come first (ties to P, which keeps D's steps
    short; a split wins only where it is strictly sooner, e.g. a prefix cached on P). Past that, P is the
    bottleneck: of the options predicted to meet the request's TTFT target (within ``TTFT_HEADROOM`` of it), the one
    that leaves P the least work (DynaServe's and TaiChi's point: move work off the saturated phase while the request
    still meets its target, which shortens the queue every later prompt waits in); when none does, again the
    soonest. A prefix cached on either pod counts there. The TPOT target is kept by D itself, which never takes a
    chunk that breaks it.
    """

    def __init__(self) -> None:
        self.transfer_s_per_token = 0.0  # exposed KV transfer time per prompt token, measured (router's average)

    def observe_transfer(self, num_prompt_tokens: int, exposed_s: float) -> None:
        """A remote prefill's exposed KV transfer time, for the next predictions."""
        if num_prompt_tokens <= 0:
            return
        per_token = exposed_s / num_prompt_tokens
        weight = TRANSFER_RECENT_WEIGHT if self.transfer_s_per_token else 1.0
        self.transfer_s_per_token += weight * (per_token - self.transfer_s_per_token)

    def decide(self, prompt: PromptBlocks, prefill: PodInfo | None, decode: PodInfo, targets: SLOTargets,
               may_split: bool = True) -> RoutePlan:
        if prefill is None:
            return RoutePlan(None, decode, "no prefill pod: prefill on the decode pod")
        options = self.options(prompt, prefill, decode, may_split)
        wait_s = prefill.prefill_wait_s or 0.0
        if wait_s >= BACKLOG_FRACTION * targets.ttft_s:
            meeting = [option for option in options if option.estimate.ttft_s <= TTFT_HEADROOM * targets.ttft_s]
            chosen = (min(meeting, key=lambda option: (option.prefill_work, option.estimate.ttft_s)) if meeting
                      else min(options, key=lambda option: option.estimate.ttft_s))
            rule = f"P's queue {wait_s:.3f} s: the least P work that meets the target"
        else:
            chosen = min(options, key=lambda option: option.estimate.ttft_s)  # the first of equals: remote
            rule = f"P's queue {wait_s:.3f} s: the soonest first token"
        verdict = "meets" if chosen.estimate.ttft_s <= targets.ttft_s else "misses"
        predictions = "; ".join(f"{option.name} {option.estimate.ttft_s:.3f} s [{option.estimate.detail}]"
                                for option in options)
        reason = (f"hybrid {chosen.name} ({rule}): predicted TTFT {predictions}; {verdict} the {targets.ttft_s:g} s "
                  "TTFT target")
        if chosen.prefix_tokens == 0:
            return RoutePlan(None, decode, reason, chosen.estimate.ttft_s)
        whole = chosen.prefix_tokens == len(prompt.token_ids)
        return RoutePlan(prefill, decode, reason, chosen.estimate.ttft_s, 0 if whole else chosen.prefix_tokens)

    def options(self, prompt: PromptBlocks, prefill: PodInfo, decode: PodInfo,
                may_split: bool = True) -> list[PrefillOption]:
        """Remote first, then the splits by growing share on D, then lent."""
        num_tokens = len(prompt.token_ids)
        cached_on_p = prompt.cached_tokens(prefill)
        options = [PrefillOption("remote", num_tokens, num_tokens - cached_on_p, self.remote(prompt, prefill))]
        if may_split:
            for prefix in self.split_points(prompt, cached_on_p, decode):
                options.append(PrefillOption(f"split {prefix}/{num_tokens}", prefix, prefix - min(cached_on_p, prefix),
                                             self.split(prompt, prefix, prefill, decode)))
        options.append(PrefillOption("lent", 0, 0, self.lent(prompt, decode)))
        return options

    @staticmethod
    def split_points(prompt: PromptBlocks, cached_on_p: int, decode: PodInfo) -> list[int]:
        """Prefix lengths worth splitting at, longest first: whole blocks of D, past what D has cached already and
        short of the whole prompt."""
        num_tokens, block = len(prompt.token_ids), decode.load.block_size or 1
        cached_on_d = prompt.cached_tokens(decode)
        points = {int(num_tokens * fraction) // block * block for fraction in SPLIT_FRACTIONS}
        points.add(cached_on_p // block * block)
        return sorted((k for k in points if cached_on_d < k < num_tokens), reverse=True)

    def remote(self, prompt: PromptBlocks, pod: PodInfo, num_tokens: int | None = None) -> PrefillEstimate:
        """P prefills the prompt's first ``num_tokens`` (all of them by default) and ships their KV."""
        num_tokens = len(prompt.token_ids) if num_tokens is None else num_tokens
        cached = min(prompt.cached_tokens(pod), num_tokens)
        todo = num_tokens - cached
        model = pod.load.step_time
        if model.known:
            prefill_s = model.predict(0, todo, attention_positions(cached, todo))
        elif pod.load.prefill_tokens_per_second > 0:
            prefill_s = todo / pod.load.prefill_tokens_per_second
        else:
            prefill_s = 0.0  # nothing measured yet: the prefill pod is the default
        queue_s = pod.prefill_wait_s or 0.0
        transfer_s = self.transfer_s_per_token * num_tokens
        return PrefillEstimate(queue_s + prefill_s + transfer_s,
                               f"queue {queue_s:.3f} + prefill {prefill_s:.3f} ({todo} tokens) + transfer "
                               f"{transfer_s:.3f}")

    def lent(self, prompt: PromptBlocks, pod: PodInfo) -> PrefillEstimate:
        cached = prompt.cached_tokens(pod)
        return self.on_decode_pod(pod, cached, pod.queued_tokens + len(prompt.token_ids) - cached)

    def split(self, prompt: PromptBlocks, prefix_tokens: int, prefill: PodInfo, decode: PodInfo) -> PrefillEstimate:
        on_p = self.remote(prompt, prefill, prefix_tokens)
        queued = self.on_decode_pod(decode, 0, decode.queued_tokens) if decode.queued_tokens else None
        rest = self.on_decode_pod(decode, prefix_tokens, len(prompt.token_ids) - prefix_tokens)
        start_s = max(on_p.ttft_s, queued.ttft_s if queued else 0.0)
        return PrefillEstimate(start_s + rest.ttft_s, f"P: {on_p.detail}; then D: {rest.detail}"
                               + (f", after its queue's {queued.ttft_s:.3f} s" if queued else ""), rest.tpot_cost_s)

    @staticmethod
    def on_decode_pod(pod: PodInfo, start: int, todo: int) -> PrefillEstimate:
        """D prefills ``todo`` prompt tokens from position ``start``, in chunks that keep its TPOT allowance."""
        model: StepTimeModel = pod.load.step_time
        if not model.known:
            return PrefillEstimate(math.inf, "no step-time model")
        rows, context = pod.load.num_running, pod.load.running_context_tokens
        allowance = pod.load.tpot_allowance_seconds
        if allowance is None:  # no TPOT to keep: the token budget alone bounds its steps
            return PrefillEstimate(model.predict(rows, todo, context + attention_positions(start, todo)),
                                   f"{todo} tokens in one step, no TPOT to keep")
        middle = start + int(MEAN_CHUNK_START * todo)
        chunk = model.largest_chunk(rows, context, allowance, middle)
        if chunk == 0 and rows == 0:
            chunk = PROBE_TOKENS  # nothing decodes there: the pod prefills anyway, in probe-sized chunks
        if chunk == 0:
            return PrefillEstimate(math.inf, f"no slack: allowance {allowance:.3f} s beside {rows} decodes")
        steps = math.ceil(todo / chunk)
        step_s = model.predict(rows, chunk, context + attention_positions(middle, chunk))
        decode_s = model.predict(rows, 0, context)
        return PrefillEstimate(steps * step_s,
                               f"{steps} chunks of {chunk} tokens at {step_s:.3f} s beside {rows} decodes, "
                               f"allowance {allowance:.3f} s", tpot_cost_s=steps * (step_s - decode_s))


class RoutingPolicy:
    """Base policy: the shared steps of ``choose_pair``; subclasses pick among candidates."""

    name: PolicyName

    def __init__(self, local_prefill: LocalPrefill | None = None, hybrid: HybridPlacement | None = None):
        self.local_prefill = local_prefill or LocalPrefill()
        self.hybrid = hybrid  # None: step 3 by LocalPrefill's rules

    def choose_pair(self, request: RouterRequest, prefill_pods: list[PodInfo],
                    decode_pods: list[PodInfo], targets: SLOTargets | None = None) -> RoutePlan:
        prompt = PromptBlocks(request.prompt_token_ids)
        num_tokens = len(prompt.token_ids)
        decode = self._choose_decode(prompt, decode_pods)
        if self.hybrid is not None and targets is not None:
            prefill = self.pick_prefill(prefill_pods, prompt) if prefill_pods else None
            return self.hybrid.decide(prompt, prefill, decode, targets, request.may_split_prefill)
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

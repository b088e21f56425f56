"""Hybrid placement: where a prompt's first token is predicted to come first, from the pods' measured latency.

``HybridPlacement.decide`` predicts each way to prefill one prompt (``PrefillEstimate``, per ``PrefillOption``):
on a prefill pod with its KV shipped to D (remote), lent to D in chunks that keep its decodes' TPOT (lent), or
split between them; and picks one by the rule in the class's docstring. The routing policy (``policies.py``)
calls it at its step 3 when the router schedules hybrid; ``placement.py`` feeds it each transfer's measured time
(``observe_transfer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.engine.step_time import (
    MAX_GAP_TARGETS,
    PROBE_TOKENS,
    SLACK_HEADROOM,
    StepTimeModel,
    attention_positions,
)
from splitserve.router.pods.registry import PodInfo
from splitserve.router.route_plan import PromptBlocks, RoutePlan, SLOTargets


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
# A lent prompt's steps predicted one by one (D's decodes' banked TPOT slack changing with each), at most this many;
# the rest at the last step's allowance.
SIMULATED_STEPS = 64
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
             TTFT = steps x that step's time; beside decodes, predicted step by step, as their slack is banked by
             steps shorter than their target and spent by longer ones (``_banked_chunks``); D with no TPOT to
             keep prefills in whole steps at its model's rate; D with no model (not warmed up) cannot be lent to.
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
    chunk that breaks it; a D that does not chunk by TPOT (no allowance reported) is lent a prompt only while the
    whole prefill step fits the request's TPOT target beside its decodes, else it is not lent to at all.
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
        options = self.options(prompt, prefill, decode, may_split, targets.tpot_s)
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

    def options(self, prompt: PromptBlocks, prefill: PodInfo, decode: PodInfo, may_split: bool = True,
                tpot_s: float | None = None) -> list[PrefillOption]:
        """Remote first, then the splits by growing share on D, then lent; ``tpot_s``: the TPOT target a prefill on D
        must keep where D keeps none itself."""
        num_tokens = len(prompt.token_ids)
        cached_on_p = prompt.cached_tokens(prefill)
        options = [PrefillOption("remote", num_tokens, num_tokens - cached_on_p, self.remote(prompt, prefill))]
        if may_split:
            for prefix in self.split_points(prompt, cached_on_p, decode):
                options.append(PrefillOption(f"split {prefix}/{num_tokens}", prefix, prefix - min(cached_on_p, prefix),
                                             self.split(prompt, prefix, prefill, decode, tpot_s)))
        options.append(PrefillOption("lent", 0, 0, self.lent(prompt, decode, tpot_s)))
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

    def lent(self, prompt: PromptBlocks, pod: PodInfo, tpot_s: float | None = None) -> PrefillEstimate:
        cached = prompt.cached_tokens(pod)
        return self.on_decode_pod(pod, cached, pod.queued_tokens + len(prompt.token_ids) - cached, tpot_s)

    def split(self, prompt: PromptBlocks, prefix_tokens: int, prefill: PodInfo, decode: PodInfo,
              tpot_s: float | None = None) -> PrefillEstimate:
        on_p = self.remote(prompt, prefill, prefix_tokens)
        queued = self.on_decode_pod(decode, 0, decode.queued_tokens) if decode.queued_tokens else None
        rest = self.on_decode_pod(decode, prefix_tokens, len(prompt.token_ids) - prefix_tokens, tpot_s)
        start_s = max(on_p.ttft_s, queued.ttft_s if queued else 0.0)
        return PrefillEstimate(start_s + rest.ttft_s, f"P: {on_p.detail}; then D: {rest.detail}"
                               + (f", after its queue's {queued.ttft_s:.3f} s" if queued else ""), rest.tpot_cost_s)

    @staticmethod
    def on_decode_pod(pod: PodInfo, start: int, todo: int, tpot_s: float | None = None) -> PrefillEstimate:
        """D prefills ``todo`` prompt tokens from position ``start``, in chunks that keep its TPOT allowance; where D
        reports none (it does not chunk by TPOT), in one step, which must fit ``tpot_s`` beside any decode running
        there: the router stops lending rather than break its decodes' TPOT target."""
        model: StepTimeModel = pod.load.step_time
        if not model.known:
            return PrefillEstimate(math.inf, "no step-time model")
        # The decodes the chunks run beside: those D reports, or more where this router has more in flight there
        # (prompts prefilling on P whose KV lands on D, lent prompts queued there): they join within the prefill,
        # and a chunk that fits an idle pod's allowance would stall behind them, or break their TPOT target.
        rows, context = max(pod.load.num_running, pod.active_requests), pod.load.running_context_tokens
        allowance = pod.load.tpot_allowance_seconds
        if allowance is None:  # D keeps no TPOT itself: the token budget alone bounds its steps
            step_s = model.predict(rows, todo, context + attention_positions(start, todo))
            if rows and tpot_s is not None and step_s > tpot_s:
                return PrefillEstimate(math.inf, f"{todo} tokens in one {step_s:.3f} s step would break the "
                                                 f"{tpot_s:g} s TPOT target of {rows} decodes")
            return PrefillEstimate(step_s, f"{todo} tokens in one step, no TPOT to keep")
        if rows > pod.load.num_running and tpot_s:  # decodes on their way: they join with no slack banked
            allowance = min(allowance, SLACK_HEADROOM * tpot_s)
        if rows and tpot_s:
            return _banked_chunks(model, rows, context, start, todo, allowance, tpot_s)
        return _even_chunks(model, rows, context, start, todo, allowance)


def _even_chunks(model: StepTimeModel, rows: int, context: int, start: int, todo: int,
                 allowance: float) -> PrefillEstimate:
    """``todo`` tokens from ``start`` in chunks of the one size ``allowance`` fits beside ``rows`` decodes (each
    priced at the prompt's middle, where its attention is average); with no decode there, probe-sized chunks at
    least: the pod prefills anyway."""
    middle = start + int(MEAN_CHUNK_START * todo)
    chunk = model.largest_chunk(rows, context, allowance, middle)
    if chunk == 0 and rows == 0:
        chunk = PROBE_TOKENS
    if chunk == 0:
        return PrefillEstimate(math.inf, f"no slack: allowance {allowance:.3f} s beside {rows} decodes")
    chunk = min(chunk, todo)  # a prompt shorter than the chunk that fits is one step of its own length
    steps = math.ceil(todo / chunk)
    step_s = model.predict(rows, chunk, context + attention_positions(middle, chunk))
    added_s = step_s - model.predict(rows, 0, context) if rows else 0.0  # no decode there, none delayed
    return PrefillEstimate(steps * step_s, f"{steps} chunks of {chunk} tokens at {step_s:.3f} s beside {rows} decodes, "
                                           f"allowance {allowance:.3f} s", tpot_cost_s=steps * added_s)


def _banked_chunks(model: StepTimeModel, rows: int, context: int, start: int, todo: int, allowance: float,
                   tpot_s: float) -> PrefillEstimate:
    """D prefills ``todo`` tokens in chunks beside ``rows`` decodes whose TPOT slack it keeps
    (engine/prefill_budget.py): each step fills the decodes' allowance, which starts at the one D reported and, after a
    step of s seconds, is what their banked slack has left (headroom applied: allowance - h s + h tpot_s, at least h
    tpot_s, at most ``MAX_GAP_TARGETS`` targets' worth): steps shorter than the target bank time for longer ones, a long
    chunk spends it. A step where no prompt token fits decodes alone, and banks."""
    floor, cap = SLACK_HEADROOM * tpot_s, SLACK_HEADROOM * MAX_GAP_TARGETS * tpot_s
    decode_s = model.predict(rows, 0, context)
    first = min(allowance, cap)
    done, elapsed_s, added_s, chunks = 0, 0.0, 0.0, 0
    for _ in range(SIMULATED_STEPS):
        within = min(allowance, cap)
        chunk = min(todo - done, model.largest_chunk(rows, context, within, start + done))
        if chunk:
            step_s = model.predict(rows, chunk, context + attention_positions(start + done, chunk))
            added_s += step_s - decode_s
            done, chunks = done + chunk, chunks + 1
        else:
            step_s = decode_s
        elapsed_s += step_s
        after = min(cap, max(floor, allowance - SLACK_HEADROOM * (step_s - tpot_s)))
        if done == todo:
            break
        if not chunk and after <= allowance:  # the decodes bank nothing: no chunk will ever fit
            return PrefillEstimate(math.inf, f"no slack: allowance {allowance:.3f} s beside {rows} decodes")
        allowance = after
    detail = f"{chunks} chunks beside {rows} decodes, allowance {first:.3f} s at first (their banked slack)"
    if done < todo:  # the rest at the last allowance, in chunks of its size
        rest = _even_chunks(model, rows, context, start + done, todo - done, min(allowance, cap))
        if rest.ttft_s == math.inf:
            return rest
        return PrefillEstimate(elapsed_s + rest.ttft_s, f"{detail}; then {rest.detail}", added_s + rest.tpot_cost_s)
    return PrefillEstimate(elapsed_s, detail, tpot_cost_s=added_s)

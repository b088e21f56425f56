"""How many prompt tokens one step may prefill beside running decodes, so that each keeps its TPOT target.

A decode pod lent prefill work (a prompt the router placed there, or the rest of one) prefills it in chunks
interleaved with its decode steps. ``TPOTSlackBudget.tokens(decoding, now)`` sizes the chunk of the next step:

1. each decoding sequence with a TPOT target (its own, ``Sequence.tpot_target_s``, else the pod's default) has a
   *slack*: how long its next token may take and keep its TPOT, the average of its gaps, within the target. That
   is the larger of two: the target less the part of its current gap already gone (since
   ``Sequence.last_token_time``: a request is never held to gaps shorter than its target for having been slow
   before, so a lent prompt is not starved by a decode's history), and what its earlier gaps left unspent (its
   *bank*: k tokens here since its first one here at t1, ``Sequence.tpot_anchor``, keep the average within the
   target while the next comes by t1 + k x target). A request decoding at 10 ms a token under a 74 ms target
   banks 64 ms a token: a lent prompt then runs in a few long steps rather than many short ones, each of which pays
   the prefill pass again. No gap is let past ``MAX_GAP_TARGETS`` targets, however large the bank: a stream may
   pause, not stall;
2. the step's allowance is the smallest slack, times ``headroom`` (the model's error and the loop's own overhead).
   With no decoding sequence, the pod's default target's while a request's KV is on its way here (it may join at
   any step, and must not wait behind a whole prompt), else ``MAX_GAP_TARGETS`` of them: a request routed here
   later, whose prompt has still to be prefilled elsewhere, waits at most that long for its second token, the
   longest gap a banked slack may cause anyway; and an idle pod prefills a lent prompt in a few long chunks, not many
   short ones that each pay the prefill pass (SmolLM2, bf16, one core: a 512-token prompt in 2 steps of 0.2 s
   rather than 11 of 54 ms);
3. the chunk is the most tokens the measured ``StepTimeModel`` predicts to fit in that allowance beside those
   decode rows (``largest_chunk``); 0 when none fits, so the prompt waits a step and the decodes go on. With no
   decode running, a prompt always moves: when not even one token fits the default target's allowance (a pod
   slower than its target, a machine under load), it takes ``probe_tokens``, since waiting would only idle the
   pod; without that floor such a pod would step forever and never finish the prompt.

No target anywhere (no decoding sequence has one, and no default): None, no bound (the scheduler's token budget
applies as ever). A model that has not measured a prompt token yet allows ``probe_tokens``, so that it can.
"""

from __future__ import annotations

from typing import Callable

from splitserve.engine.sequence import Sequence
from splitserve.engine.step_time import MAX_GAP_TARGETS, PROBE_TOKENS, SLACK_HEADROOM, StepTimeModel


class TPOTSlackBudget:
    """The per-step prefill chunk of a decode pod (module docstring); engine thread only."""

    def __init__(self, model: Callable[[], StepTimeModel], default_target_s: float = 0.0,
                 headroom: float = SLACK_HEADROOM, probe_tokens: int = PROBE_TOKENS):
        self._model = model  # the pod's latest fit
        self.default_target_s = default_target_s
        self.headroom = headroom
        self.probe_tokens = probe_tokens

    def slack_s(self, seq: Sequence, now: float) -> float | None:
        """How long ``seq``'s next token may take and keep its TPOT target; None: it has no target."""
        target = seq.tpot_target_s or self.default_target_s
        if not target:
            return None
        if seq.last_token_time is None:
            return target
        gap = now - seq.last_token_time
        slack = target - gap
        if seq.tpot_anchor is not None:
            since, outputs = seq.tpot_anchor
            slack = max(slack, target * (seq.num_output_tokens - outputs + 1) - (now - since))
        return min(slack, MAX_GAP_TARGETS * target - gap)

    def allowance_s(self, decoding: list[Sequence], now: float, awaiting_kv: bool = False) -> float | None:
        """The longest step the decoding sequences allow (headroom applied); None: none of them has a target.
        ``awaiting_kv``: a request prefilled elsewhere may join at any step (its KV is on its way here)."""
        slacks = [s for s in (self.slack_s(seq, now) for seq in decoding) if s is not None]
        if not slacks:
            if not self.default_target_s:
                return None
            return self.headroom * self.default_target_s * (1.0 if awaiting_kv else MAX_GAP_TARGETS)
        return self.headroom * min(slacks)

    def tokens(self, decoding: list[Sequence], now: float, chunk_start: int = 0,
               awaiting_kv: bool = False) -> int | None:
        """Prompt tokens the next step may prefill beside ``decoding`` (each decodes one token); None: no bound.
        ``chunk_start``: tokens of the prompt already computed (the chunk's attention reads them)."""
        allowance = self.allowance_s(decoding, now, awaiting_kv)
        if allowance is None:
            return None
        model = self._model()
        if not model.known:
            return self.probe_tokens
        context = sum(seq.num_tokens for seq in decoding)  # each decode row attends to all its tokens
        chunk = model.largest_chunk(len(decoding), context, allowance, chunk_start)
        return chunk if chunk or decoding else self.probe_tokens  # nothing decodes: the prompt must move

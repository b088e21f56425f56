"""A simulated pod: the engine's own ``Scheduler`` and ``BlockManager`` stepping on a virtual clock, with a step-time
model (``PhaseProfile``) in place of the model.

A step, as ``LLMEngine.step`` runs it, but timed by the profile instead of computed:

  ``Scheduler.schedule()``  -> which sequences run and how many tokens each (chunked prefill budget, batch cap,
                               KV blocks, preemption: all the real scheduler's decisions)
  ``step_seconds(out)``     -> the profile's prefill and decode forms over that batch, plus the pod loop's overhead
  at the step's end         -> ``Scheduler.update_from_output`` with one token for every sequence that samples
                               (the outputs are forced lengths, ``ignore_eos``, so the token ids do not matter);
                               the cluster hears of each token (``on_token``); the next step starts at once if
                               anything is left, else the pod idles until a request arrives (``wake``).

``info`` is the pod as the router sees it (``router.registry.PodInfo``): its ``load`` is refreshed after every step
and admission, as a real pod's ``LoadTracker`` publishes one within milliseconds of each step.

Lending (issue 20's hybrid scheduling) plugs in here: a pod's ``role`` only decides which router lists it is in,
and ``scheduler.add`` / ``admit_prefilled`` are open to any pod, so a decode pod lent to prefill is a ``SimPod``
that the placement hands a prompt with ``max_tokens = 1`` (what a prefill pod gets) and whose KV the cluster then
ships to another decode pod (``SimCluster._prefilled``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bench.phase_profile import PhaseProfile
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from router.registry import PodInfo, PodLoad
from runtime.pod_status import RECENT_WEIGHT
from runtime.roles import Role
from simulator.events import EventLoop

SAMPLED = [(0, None)]  # the token every sampling step appends (any id: no EOS is configured, lengths are forced)


def step_seconds(profile: PhaseProfile, out: SchedulerOutput) -> tuple[float, int]:
    """The profile's time for one scheduled batch, and its prefill tokens: prefill chunks by the prefill form,
    decoding sequences (one new token at the end of their known tokens) by the decode form's context and batch
    terms, and the decode form's constant when the step has no prefill in it."""
    tokens = attention = context = batch = 0
    for item in out.scheduled:
        if item.num_new_tokens == 1 and item.start == item.seq.num_tokens - 1:
            context += item.start + 1
            batch += 1
        else:  # a prompt chunk (or a preempted sequence's recompute)
            tokens += item.num_new_tokens
            attention += item.num_new_tokens * (item.start + item.num_new_tokens)
    seconds = profile.step_overhead_s + profile.decode.b * context + profile.decode.c * batch
    return seconds + (profile.prefill_s(tokens, attention) if tokens else profile.decode.a), tokens


class SimPod:
    """One pod; ``on_token(pod, seq, now)`` hears of every sampled token (the first of a prefill included)."""

    def __init__(self, name: str, role: Role, profile: PhaseProfile, scheduler_config: SchedulerConfig,
                 num_blocks: int, block_size: int, max_model_len: int, loop: EventLoop,
                 on_token: Callable[["SimPod", Sequence, float], None]):
        self.name, self.role, self.profile, self.loop, self.on_token = name, role, profile, loop, on_token
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(scheduler_config, self.block_manager, eos_token_ids=[],
                                   max_model_len=max_model_len)
        self.info = PodInfo(address=name, role=role, serving=True)
        self.stepping = False
        self.busy_s = 0.0  # seconds spent in steps
        self.num_steps = 0
        self.num_preemptions = 0
        self._prefill_rate = 0.0  # recent prompt tokens/s, as LoadTracker measures it
        self._decode_step_s = 0.0
        self.publish()

    # ---- requests in ------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A prompt to prefill here (``Scheduler.add``); the pod starts stepping if it was idle."""
        self.scheduler.add(seq)
        self.publish()
        self.wake()

    def reserve(self, seq: Sequence) -> bool:
        """Blocks for a prompt whose KV a prefill pod will push (``LLMEngine.reserve_for_transfer``)."""
        return self.block_manager.allocate_slots(seq, seq.num_prompt_tokens)

    def admit_prefilled(self, seq: Sequence) -> None:
        """The pushed KV arrived and the first token with it (``LLMEngine.admit_prefilled``)."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(*SAMPLED[0])
        self.scheduler.add_prefilled(seq)
        self.publish()
        self.wake()

    # ---- steps ------------------------------------------------------------------------------------------

    def wake(self) -> None:
        if not self.stepping and self.scheduler.has_unfinished():
            self._start_step()

    def _start_step(self) -> None:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return  # nothing fits until a request finishes elsewhere; an admission wakes the pod again
        seconds, prefill_tokens = step_seconds(self.profile, out)
        self.num_preemptions += len(out.preempted)
        self.stepping = True
        self.busy_s += seconds
        self.num_steps += 1
        self.loop.after(seconds, self._end_step, out, seconds, prefill_tokens)

    def _end_step(self, out: SchedulerOutput, seconds: float, prefill_tokens: int) -> None:
        sampled = {item.seq.request_id: SAMPLED for item in out.scheduled if item.samples}
        updated = self.scheduler.update_from_output(out, sampled)
        if prefill_tokens:
            self._prefill_rate = _recent(self._prefill_rate, prefill_tokens / seconds)
        else:
            self._decode_step_s = _recent(self._decode_step_s, seconds)
        self.stepping = False
        self.publish()
        now = self.loop.now
        for seq in updated:
            self.on_token(self, seq, now)
        self.wake()

    # ---- the router's view ------------------------------------------------------------------------------

    def publish(self) -> None:
        """The pod's load report, as ``runtime.pod_status.LoadTracker`` snapshots it after each step."""
        scheduler, blocks = self.scheduler, self.block_manager
        queued = sum(seq.num_tokens - seq.num_computed_tokens for seq in scheduler.waiting)
        queued += sum(max(0, seq.num_tokens - 1 - seq.num_computed_tokens) for seq in scheduler.running)
        self.info.take_report(PodLoad(
            num_waiting=scheduler.num_waiting, num_running=scheduler.num_running,
            free_kv_blocks=blocks.num_free_blocks, total_kv_blocks=blocks.num_blocks, block_size=blocks.block_size,
            queued_prefill_tokens=queued, prefill_tokens_per_second=self._prefill_rate,
            decode_step_seconds=self._decode_step_s))

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_manager.block_size)


def _recent(average: float, value: float) -> float:
    return value if average == 0 else (1 - RECENT_WEIGHT) * average + RECENT_WEIGHT * value

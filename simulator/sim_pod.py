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

Steady decoding goes faster in *spans* (``span_s`` > 0): when every running sequence is decoding and none waits,
the next k decode steps are one ``schedule()`` in which each sequence verifies k - 1 proposed tokens (the
scheduler's own speculative path: its budget, ``max_tokens``, context and KV checks apply) and all are accepted,
each step timed on its own by the decode form as the batch thins out. Anything that reaches the pod meanwhile
(``interrupt``: a request placed here, a prefilled one admitted) cuts the span after the step in flight, as the
scheduler cuts rejected drafts (their slots stay allocated and are written over), so the pod's own schedule is
exactly the one of single steps. The router's view is kept too: each sequence that ends inside a span is reported
at its last step's end (``on_finish``: the pod's count and blocks, the router's hold), as a real pod's per-step
report would show it; only the blocks the span's tokens fill are reported at the span's end (at most ``span_s``
seconds late), so spans are taken only while at least a quarter of the KV pool stays free.

``info`` is the pod as the router sees it (``splitserve.router.pods.registry.PodInfo``): its ``load`` is refreshed after
every step and admission, as a real pod's ``LoadTracker`` publishes one within milliseconds of each step.

Lending (issue 20's hybrid scheduling): a decode pod whose ``SchedulerConfig.tpot_slack_chunking`` is set gets the
engine's ``TPOTSlackBudget``, as ``LLMEngine`` builds it, over the pod's step-time model (``profile_step_time``: the
profile's forms behind the engine's ``StepTimeModel`` interface), and the scheduler runs on the virtual clock, so a
prompt lent to it prefills in chunks that keep its decoding requests within their TPOT target. The pod's load report
carries what the router's ``HybridPlacement`` reads (the step-time model, the TPOT allowance, the decoding context),
from the same function a real pod's ``LoadTracker`` uses (``splitserve.runtime.pod_status.scheduler_load``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import SchedulerConfig
from splitserve.engine.prefill_budget import TPOTSlackBudget
from splitserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_time import StepSample, StepTimeFit, StepTimeModel, attention_positions
from splitserve.measure.phase_profile import PhaseProfile
from splitserve.router.pods.registry import PodInfo, PodLoad
from splitserve.runtime.pod_status import RECENT_WEIGHT, scheduler_load
from splitserve.runtime.roles import Role
from splitserve.simulator.events import EventLoop

SAMPLED = [(0, None)]  # the token every sampling step appends (any id: no EOS is configured, lengths are forced)
DRAFT = 0  # the proposed token a span's sequences verify (the same id: every proposal is accepted)
MAX_SPAN_STEPS = 256


def step_seconds(profile: PhaseProfile, out: SchedulerOutput) -> tuple[float, int]:
    """The profile's time for one scheduled batch, and its prefill tokens (``form_seconds``)."""
    tokens = attention = context = batch = 0
    for item in out.scheduled:
        if item.num_new_tokens == 1 and item.start == item.seq.num_tokens - 1:
            context += item.start + 1
            batch += 1
        else:  # a prompt chunk (or a preempted sequence's recompute)
            tokens += item.num_new_tokens
            attention += item.num_new_tokens * (item.start + item.num_new_tokens)
    return form_seconds(profile, tokens, attention, context, batch), tokens


def form_seconds(profile: PhaseProfile, tokens: int, attention: int, context: int, batch: int) -> float:
    """A step of prompt chunks (``tokens`` = sum(n), ``attention`` = sum(n * (s + n))) beside ``batch`` decoding
    sequences (``context``: their tokens): the prefill form over the chunks, the decode form's context and batch
    terms over the decodes, the decode form's constant when the step has no prefill in it, the pod loop's
    overhead."""
    seconds = profile.step_overhead_s + profile.decode.b * context + profile.decode.c * batch
    return seconds + (profile.prefill_s(tokens, attention) if tokens else profile.decode.a)


# The steps ``profile_step_time`` fits its mixed-step estimate on: rows decoding at a context each beside a chunk of a
# prompt from a start, as a decode pod lent prompts runs them.
FIT_ROWS = (1, 2, 4, 8, 16, 32)
FIT_CONTEXTS = (128, 512, 1536)
FIT_CHUNKS = (8, 32, 128, 512)
FIT_STARTS = (0, 256, 1024)


@dataclass(frozen=True)
class ProfileStepTime(StepTimeModel):
    """The step-time model of a pod running at ``profile``'s speed, as its ``PodLoad.step_time`` publishes it and
    its ``TPOTSlackBudget`` sizes chunks with it (``profile_step_time``)."""

    profile: PhaseProfile | None = field(default=None, repr=False)

    def predict(self, decode_rows: int, chunk_tokens: int, context_tokens: int) -> float:
        """The profile's forms where the figures say what they are: decodes alone, or one chunk alone (its start
        follows from its attention positions); a chunk beside decodes (their context and its attention in one
        figure) by the fitted linear model."""
        if chunk_tokens == 0:
            return form_seconds(self.profile, 0, 0, context_tokens, decode_rows)
        if decode_rows == 0:
            n = chunk_tokens
            start = (context_tokens - attention_positions(0, n)) / n
            return form_seconds(self.profile, n, round(n * (start + n)), 0, 0)
        return super().predict(decode_rows, chunk_tokens, context_tokens)

    def largest_chunk(self, decode_rows: int, context_tokens: int, within_s: float, chunk_start: int = 0) -> int:
        """``StepTimeModel.largest_chunk`` by the profile's own forms (a chunk of n from s beside the rows)."""
        profile = self.profile

        def fits(n: int) -> bool:
            return form_seconds(profile, n, n * (chunk_start + n), context_tokens, decode_rows) <= within_s

        if not fits(1):
            return 0
        low, high = 1, 2
        while fits(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low


@functools.cache
def profile_step_time(profile: PhaseProfile) -> ProfileStepTime:
    """The step-time model of a pod at ``profile``'s speed. The engine's model (``engine/step_time.py``: base + per
    decode row + per prompt token + per attention position) has not the profile's form (the profile has a prefill
    constant apart from the decode one, and prices a chunk's attention with the prefill form's own coefficient), so
    a small adapter answers by the profile's forms wherever the question says which tokens are which: the chunk a
    decode pod lends (``largest_chunk``, what ``TPOTSlackBudget`` asks), a step of decodes alone, a chunk alone (a
    prompt on a prefill pod). A chunk beside decodes, given as one context figure (the router's estimate of a lent
    chunk's step), goes by the engine's linear model fitted (``StepTimeFit``) over such steps timed by the
    profile. A real pod's online fit has an error the simulated pod has not; the budget's headroom is for it."""
    samples = []
    for rows, per_row, chunk, start in itertools.product(FIT_ROWS, FIT_CONTEXTS, FIT_CHUNKS, FIT_STARTS):
        seconds = form_seconds(profile, chunk, chunk * (start + chunk), rows * per_row, rows)
        samples.append(StepSample(rows, chunk, rows * per_row + attention_positions(start, chunk), seconds))
    fit = StepTimeFit(prior_steps=len(samples))
    for sample in samples:
        fit.observe(sample)
    return ProfileStepTime(*fit.model.as_tuple(), num_samples=fit.model.num_samples, profile=profile)


class SimPod:
    """One pod; ``on_token(pod, seq, times)`` hears of the tokens a sequence sampled and when (one per step; a
    prefill's first included), ``on_finish(pod, seq)`` of a sequence that ends inside a span, at its last step."""

    def __init__(self, name: str, role: Role, profile: PhaseProfile, scheduler_config: SchedulerConfig,
                 num_blocks: int, block_size: int, max_model_len: int, loop: EventLoop,
                 on_token: Callable[["SimPod", Sequence, list[float]], None], span_s: float = 0.0,
                 on_finish: Callable[["SimPod", Sequence], None] = lambda pod, seq: None,
                 prefix_caching: bool = False):
        self.name, self.role, self.profile, self.loop, self.on_token = name, role, profile, loop, on_token
        self.on_finish = on_finish
        self.scheduler_config, self.max_model_len, self.span_s = scheduler_config, max_model_len, span_s
        self.span: _Span | None = None
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching)
        self.step_time = profile_step_time(profile)
        budget = (TPOTSlackBudget(lambda: self.step_time, scheduler_config.default_tpot_target_s)
                  if scheduler_config.tpot_slack_chunking else None)  # as LLMEngine builds it
        self.scheduler = Scheduler(scheduler_config, self.block_manager, eos_token_ids=[],
                                   max_model_len=max_model_len, prefill_budget=budget, clock=lambda: loop.now)
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
        self.interrupt()
        self.scheduler.add(seq)
        self.publish()
        self.wake()

    def add_after_prefix(self, pushed: Sequence, seq: Sequence) -> None:
        """A split prefill: the KV of ``pushed`` (a prefix of ``seq``'s prompt) arrived; it goes to the prefix cache
        and ``seq`` prefills the rest here (``LLMEngine.cache_transferred_prefix``, then ``add``)."""
        self.interrupt()
        self.scheduler.cache_transferred_prefix(pushed)
        self.add(seq)

    def reserve(self, seq: Sequence) -> bool:
        """Blocks for a prompt whose KV a prefill pod will push (``LLMEngine.reserve_for_transfer``)."""
        self.interrupt()
        return self.scheduler.reserve_transfer(seq)

    def admit_prefilled(self, seq: Sequence) -> None:
        """The pushed KV arrived and the first token with it (``LLMEngine.admit_prefilled``)."""
        self.interrupt()
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
        if self.span_s and self._start_span():
            return
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
        now = [self.loop.now]
        for seq in updated:
            self.on_token(self, seq, now)
        self.wake()

    # ---- spans of steady decoding -----------------------------------------------------------------------

    def _start_span(self) -> bool:
        """Start a span of decode steps (the module docstring) if the pod is steadily decoding; False if not."""
        scheduler, blocks = self.scheduler, self.block_manager
        running = scheduler.running
        if scheduler.waiting or not running or any(seq.num_computed_tokens != seq.num_tokens - 1 for seq in running):
            return False
        steps = min(MAX_SPAN_STEPS, self.scheduler_config.max_num_batched_tokens // len(running))
        lengths = [min(steps, seq.sampling_params.max_tokens - seq.num_output_tokens,
                       self.max_model_len - seq.num_tokens) for seq in running]
        size = blocks.block_size
        needed = sum(-(-(seq.num_computed_tokens + n) // size) - len(seq.block_table)
                     for seq, n in zip(running, lengths))
        if max(lengths) < 2 or blocks.num_free_blocks - needed < blocks.num_blocks // 4:
            return False
        ends = self._span_step_ends(running, lengths)
        lengths = [min(n, len(ends)) for n in lengths]
        if len(ends) < 2:
            return False
        for seq, n in zip(running, lengths):
            seq.draft_token_ids = [DRAFT] * (n - 1)
        finishing = [seq.sampling_params.max_tokens - seq.num_output_tokens == n for seq, n in zip(running, lengths)]
        out = scheduler.schedule()
        assert [item.num_new_tokens for item in out.scheduled] == lengths, "a span's steps must all fit"
        self.span = _Span(out, ends, self.loop.now)
        self.stepping = True
        self.loop.at(ends[-1], self._end_span, self.span, 0)
        for item, n, ends_here in zip(out.scheduled, lengths, finishing):
            if ends_here and n < len(ends):
                self.loop.at(ends[n - 1], self._finish_in_span, item, n)
        return True

    def _finish_in_span(self, item: ScheduledSeq, n: int) -> None:
        """A sequence's last token inside a span, unless an interrupt cut the span before it."""
        if item.num_new_tokens == n:
            self.info.load.num_running -= 1
            self.info.load.free_kv_blocks += len(item.seq.block_table)
            self.on_finish(self, item.seq)

    def _span_step_ends(self, running: list[Sequence], lengths: list[int]) -> list[float]:
        """Absolute end times of the span's steps, each timed by the decode form over the sequences still in it,
        as long as they end within ``span_s``."""
        profile, now = self.profile, self.loop.now
        base = profile.step_overhead_s + profile.decode.a
        order = sorted(zip(lengths, (seq.num_tokens for seq in running)))
        context, batch = sum(ctx for _, ctx in order), len(order)
        ends, done, t = [], 0, now
        for i in range(order[-1][0]):
            while order[done][0] <= i:  # sequences whose last token came in an earlier step
                context -= order[done][1]
                batch -= 1
                done += 1
            t += base + profile.decode.b * (context + i * batch) + profile.decode.c * batch
            if t - now > self.span_s and ends:
                break
            ends.append(t)
        return ends

    def interrupt(self) -> None:
        """Something reached the pod: a span in flight ends after its step in flight, as single steps would."""
        span = self.span
        if span is None:
            return
        now = self.loop.now
        started = sum(1 for start in [span.start] + span.ends[:-1] if start < now)
        keep = max(1, started)
        if keep >= len(span.ends):
            return
        for item in span.out.scheduled:
            item.num_new_tokens = min(item.num_new_tokens, keep)
            item.draft_token_ids = item.draft_token_ids[:item.num_new_tokens - 1]
        del span.ends[keep:]
        span.version += 1
        self.loop.at(span.ends[-1], self._end_span, span, span.version)

    def _end_span(self, span: "_Span", version: int) -> None:
        if version != span.version:
            return  # cut short by an interrupt: its new end is scheduled
        self.span = None
        lengths = {item.seq.request_id: item.num_new_tokens for item in span.out.scheduled}
        updated = self.scheduler.update_from_output(span.out, {rid: SAMPLED * n for rid, n in lengths.items()})
        seconds = span.ends[-1] - span.start
        self.busy_s += seconds
        self.num_steps += len(span.ends)
        self._decode_step_s = _recent(self._decode_step_s, seconds / len(span.ends))
        self.stepping = False
        self.publish()
        for seq in updated:
            self.on_token(self, seq, span.ends[:lengths[seq.request_id]])
        self.wake()

    # ---- the router's view ------------------------------------------------------------------------------

    def publish(self) -> None:
        """The pod's load report, as ``splitserve.runtime.pod_status.LoadTracker`` snapshots it after each step."""
        self.info.take_report(PodLoad(
            **scheduler_load(self.scheduler, self.loop.now), prefill_tokens_per_second=self._prefill_rate,
            decode_step_seconds=self._decode_step_s, step_time=self.step_time))


@dataclass
class _Span:
    """A span of decode steps in flight: the scheduler's output, each step's end, and a version that an interrupt
    bumps when it moves the end."""

    out: SchedulerOutput
    ends: list[float]
    start: float
    version: int = 0


def _recent(average: float, value: float) -> float:
    return value if average == 0 else (1 - RECENT_WEIGHT) * average + RECENT_WEIGHT * value

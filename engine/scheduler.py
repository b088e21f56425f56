"""Continuous batching: which sequences run in the next step, and how many of their tokens.

A request's path through the scheduler:

- ``add`` puts it in ``waiting``, behind every request of its priority or a more urgent one (``Sequence.priority``,
  vLLM's: lower first; all 0 is first come, first served) (``add_prefilled`` skips the queue: its KV arrived from a
  prefill pod, so it joins ``running`` directly);
- ``schedule`` first gives every ``running`` sequence its next tokens (a prefill chunk, or one token when decoding, plus
  the draft tokens proposed for it when speculating, as far as the budget, ``max_tokens`` and the context allow:
  engine/speculative/proposer.py), then admits ``waiting`` sequences in order, after a prefix-cache lookup (none for a
  request still owed its prompt logprobs: it computes its whole prompt), while the token budget, the sequence cap and
  the block pool allow. On a pod that lends its decode steps to prefills (``SchedulerConfig.tpot_slack_chunking``), the
  prompt tokens of a step are bounded as well, by the chunk that keeps every decoding sequence within its TPOT target
  (``engine/prefill_budget.py``). When a running sequence needs a block and none is left, the least urgent one (the
  highest priority value, the most recently admitted among equals) is preempted, even if this step had scheduled it
  already: its blocks are freed and it goes back to ``waiting`` ahead of its equals, to be recomputed later (cheaply,
  from its prefix-cached blocks). As in vLLM, a waiting request never preempts a running one: priority orders the queue
  and picks the victims;
- ``update_from_output`` records the step: computed tokens advance, newly full blocks enter the prefix cache,
  sampled tokens are appended (several when drafts were accepted, each checked before the next), and a sequence
  that hits EOS, a stop token id or its length limit is finished and its blocks freed, its later tokens dropped;
  one that generates nothing (``max_tokens`` 0, scoring its prompt) finishes with ``length`` once its prompt is
  computed, without sampling;
- ``abort`` finishes a request wherever it is and frees its blocks.

Progress is counted in tokens, as in vLLM v1: each step schedules up to ``num_tokens - num_computed_tokens``
tokens of a sequence, and a sequence samples when its scheduled tokens reach the end of its known tokens.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import SchedulerConfig
from splitserve.engine.prefill_budget import TPOTSlackBudget
from splitserve.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens ``[start, start + num_new_tokens)`` get computed."""

    seq: Sequence
    num_new_tokens: int  # draft tokens included
    start: int  # seq.num_computed_tokens before the step
    samples: bool  # the scheduled tokens reach the end of the known tokens: the step samples the next one
    # Proposed tokens verified after the sequence's last token (the last num_new_tokens - 1 computed positions).
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: list[int], max_model_len: int,
        prefill_budget: TPOTSlackBudget | None = None, clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.clock = clock  # seconds, for token times and TPOT slack (the simulator passes its virtual clock)
        self.prefill_budget = prefill_budget  # None: prompt tokens are bounded by the token budget alone
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._unfinished: dict[str, Sequence] = {}
        self._prefill_left: int | None = None  # this step's prompt tokens still allowed (None: no bound)
        # Requests whose prompt's KV is on its way here (reserve_transfer): each may join the running batch at any
        # step (the TPOT slack budget keeps room for it).
        self.awaiting_kv: set[str] = set()
        # A sequence can hold at most the whole pool (its last sampled token needs no slot), less a scaled pool's open
        # block: past that it finishes with LENGTH, instead of preempting itself and coming back forever.
        self._pool_tokens = (block_manager.num_blocks - block_manager.keeps_open_blocks) * block_manager.block_size
        # A sequence cannot outgrow the pool, unless a sliding window bounds what it holds (``_tokens_held``).
        window_bound = block_manager.window is not None
        self._max_len = max_model_len if window_bound else min(max_model_len, self._pool_tokens + 1)

    # ---- requests in and out ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request; raises ValueError for one that could never run. A request resumed with output
        tokens it generated elsewhere (a migrated one) that already meets a stop condition finishes here."""
        self._check_admissible(seq)
        seq.status = SequenceStatus.WAITING
        self._unfinished[seq.request_id] = seq
        if seq.output_token_ids:
            self._check_stop(seq)
            if seq.is_finished:
                return
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, preempted: bool = False) -> None:
        """Into ``waiting`` by priority, first come first served among equals; a preempted sequence goes ahead of its
        equals (it was running before any of them was admitted)."""
        place = bisect.bisect_left if preempted else bisect.bisect_right  # ``waiting`` stays sorted by priority
        self.waiting.insert(place(self.waiting, seq.priority, key=lambda other: other.priority), seq)

    def _check_admissible(self, seq: Sequence) -> None:
        if seq.request_id in self._unfinished:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.num_prompt_tokens == 0:
            raise ValueError("prompt must contain at least one token")
        if seq.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_prompt_tokens} tokens, more than the model's context ({self.max_model_len})"
            )
        if self._tokens_held(seq.num_tokens) > self._pool_tokens:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens, more than the whole KV cache holds "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens)"
            )

    def _tokens_held(self, num_tokens: int) -> int:
        """The most tokens whose blocks a sequence of ``num_tokens`` holds at once: all of them, or under a sliding
        window a step's chunk and the window before it (and the blocks' rounding)."""
        manager = self.block_manager
        if manager.window is None:
            return num_tokens
        return min(num_tokens, manager.window + self.config.chunk_tokens + manager.block_size)

    # ---- a prompt whose KV a prefill pod pushes here: reserved, then admitted (add_prefilled) or let go ----
    def reserve_transfer(self, seq: Sequence) -> bool:
        """Blocks for ``seq``'s prompt, whose KV is on its way (``awaiting_kv`` until admitted or let go); False
        when the pool has no room. Under a sliding window, only the blocks from ``window_start`` on."""
        if not self.block_manager.allocate_slots(seq, seq.num_prompt_tokens, pushed=True):
            return False
        self.awaiting_kv.add(seq.request_id)
        return True

    def cache_transferred_prefix(self, seq: Sequence) -> None:
        """A split prefill's pushed prefix: its full blocks to the prefix cache, the reservation let go."""
        self.awaiting_kv.discard(seq.request_id)
        self.block_manager.cache_and_free(seq)

    def release_transfer(self, seq: Sequence) -> None:
        """A reservation that will never be admitted: its blocks back to the pool."""
        self.awaiting_kv.discard(seq.request_id)
        self.block_manager.free(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Admit a sequence prefilled elsewhere: its blocks are allocated, its prompt's KV written, and its
        first output token sampled. It joins ``running`` at once; if that first token already ends it
        (EOS, a stop id, ``max_tokens == 1``), it finishes here instead and its blocks are freed."""
        self.awaiting_kv.discard(seq.request_id)
        if seq.num_computed_tokens != seq.num_tokens - 1:
            raise ValueError(
                f"a prefilled sequence must have all but its last token computed; {seq.request_id!r} has "
                f"{seq.num_computed_tokens} of {seq.num_tokens}"
            )
        self._check_admissible(seq)
        if self.block_manager.keeps_open_blocks:
            # A scaled pool's open block (engine/kv_formats/open_keys.py) holds float16 keys no hand-off carries: the
            # prompt's last, partly filled block is computed again here, to the bits the prefill pod computed (a
            # prefill row's bits do not depend on its chunk).
            seq.num_computed_tokens -= seq.num_prompt_tokens % self.block_manager.block_size
        self._unfinished[seq.request_id] = seq
        self._mark_scheduled(seq)
        seq.mark_token_time(self.clock())  # its first token here is the one it brought
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
        self._check_stop(seq)
        if not seq.is_finished:
            self.running.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish the request wherever it is and free its blocks; None if it is unknown or already finished."""
        seq = self._unfinished.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, FinishReason.ABORT)
        return seq

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished request with this id (None once it finished)."""
        return self._unfinished.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ---------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._prefill_left = self._step_prefill_budget()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # A preemption means the pool is full: admitting someone now would only preempt again.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _step_prefill_budget(self) -> int | None:
        """Prompt tokens this step may compute beside its decodes (None: no bound but the token budget)."""
        if self.prefill_budget is None:
            return None
        decoding = [seq for seq in self.running if _decodes(seq)]
        prefilling = next((seq for seq in self.running if not _decodes(seq)), self.waiting[0] if self.waiting else None)
        if prefilling is None:
            return None
        return self.prefill_budget.tokens(decoding, self.clock(), prefilling.num_computed_tokens,
                                          awaiting_kv=bool(self.awaiting_kv))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            start = seq.num_computed_tokens
            if self._prefill_left == 0 and not _decodes(seq):
                index += 1  # its next chunk waits for a step with slack to spare
                continue
            drafts = self._drafts_to_verify(seq, budget)
            if drafts and not self.block_manager.allocate_slots(seq, 1 + len(drafts)):
                drafts = []  # no room for them: decode one token, preempting for it if need be
            num_new_tokens = self._num_new_tokens(seq, start, budget) + len(drafts)
            while not self.block_manager.allocate_slots(seq, num_new_tokens):
                at = self._preemption_victim()
                victim = self.running.pop(at)
                budget += self._unschedule(out, victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break  # it was the least urgent: the ones after it (more urgent) go on
                if at < index:
                    index -= 1  # one scheduled before it left running
            else:
                out.scheduled.append(self._scheduled(seq, num_new_tokens, start, drafts))
                budget -= num_new_tokens
                index += 1
        return budget

    def _preemption_victim(self) -> int:
        """The index in ``running`` of the least urgent sequence: the highest priority value, the most recently
        admitted among equals (without priorities: the last one)."""
        return max(range(len(self.running)), key=lambda i: (self.running[i].priority, i))

    @staticmethod
    def _unschedule(out: SchedulerOutput, seq: Sequence) -> int:
        """Take ``seq``'s share out of this step (when it had one); the tokens it gives back to the budget."""
        for i, item in enumerate(out.scheduled):
            if item.seq is seq:
                del out.scheduled[i]
                return item.num_new_tokens
        return 0

    def _drafts_to_verify(self, seq: Sequence, budget: int) -> list[int]:
        """The proposed tokens of a decoding sequence that fit: a step emits up to one more token than it verifies
        drafts, and none may pass the token budget, ``max_tokens`` or the context."""
        if not seq.draft_token_ids or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        room = min(budget, self._max_len - seq.num_tokens) - 1
        if seq.sampling_params.max_tokens is not None:
            room = min(room, seq.sampling_params.max_tokens - seq.num_output_tokens - 1)
        return seq.draft_token_ids[:max(room, 0)]

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: dropping the KV is free, and prefix-cached blocks make the re-prefill cheap.
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, preempted=True)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0 and self._prefill_left != 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            # Positions served from the prefix cache would have no logprobs: a request still owed its prompt
            # logprobs computes its whole prompt (vLLM recomputes them the same way).
            computed_blocks, num_cached_tokens = (
                ([], 0) if seq.needs_prompt_logprobs else self.block_manager.get_computed_blocks(seq))
            num_new_tokens = self._num_new_tokens(seq, num_cached_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new_tokens, computed_blocks):
                break  # no room: later requests wait too, so a long prompt is not starved by short ones
            self.waiting.popleft()
            self._admit(seq, num_cached_tokens)
            out.scheduled.append(self._scheduled(seq, num_new_tokens, num_cached_tokens))
            budget -= num_new_tokens

    def _admit(self, seq: Sequence, num_cached_tokens: int) -> None:
        if seq.first_scheduled_time is None:
            seq.num_cached_tokens = num_cached_tokens  # the prompt's cache hit, counted once per request
        self._mark_scheduled(seq)
        seq.num_computed_tokens = num_cached_tokens
        self.running.append(seq)

    def _mark_scheduled(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()

    def _num_new_tokens(self, seq: Sequence, num_computed_tokens: int, budget: int) -> int:
        # The chunk cap keeps one long prompt from stalling every running decode for a whole step.
        num_new = min(seq.num_tokens - num_computed_tokens, budget, self.config.long_prefill_token_threshold)
        if self._prefill_left is None or num_computed_tokens == seq.num_tokens - 1:
            return num_new  # no slack bound, or a decode
        num_new = min(num_new, self._prefill_left)
        self._prefill_left -= num_new
        return num_new

    @staticmethod
    def _scheduled(seq: Sequence, num_new_tokens: int, start: int, drafts: list[int] = ()) -> ScheduledSeq:
        # A request that generates nothing (max_tokens 0: scoring its prompt) never samples.
        samples = start + num_new_tokens - len(drafts) == seq.num_tokens and seq.sampling_params.max_tokens != 0
        return ScheduledSeq(seq, num_new_tokens, start, samples, list(drafts))

    # ---- after the step ---------------------------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[tuple[int, dict[int, float] | None]]]
    ) -> list[Sequence]:
        """Record a step's results; returns the sequences that got a token (finished ones included), in batch
        order. ``sampled`` maps request id -> [(token id, logprobs or None)] for each scheduled seq that samples:
        one token, or up to 1 + its drafts when speculating (the accepted drafts and the token after them)."""
        updated = []
        for item in out.scheduled:
            seq = item.seq
            seq.draft_token_ids = []
            if seq.is_finished:
                continue  # aborted while the step ran: its blocks are already free
            tokens = sampled[seq.request_id] if item.samples else []
            # A rejected draft's KV stays in its slot past the computed tokens, to be written over by the next step.
            num_rejected = len(item.draft_token_ids) + 1 - len(tokens) if item.draft_token_ids else 0
            seq.num_computed_tokens += item.num_new_tokens - num_rejected
            block_size = self.block_manager.block_size
            last_block = (item.start + item.num_new_tokens - 1) // block_size * block_size
            if num_rejected and self.block_manager.keeps_open_blocks and seq.num_computed_tokens < last_block:
                # A scaled pool's open block holds the keys of the block of the step's last position: a rejection
                # back into an earlier block recomputes that block's accepted tokens (decode rows: the same bits).
                seq.num_computed_tokens = seq.num_computed_tokens // block_size * block_size
            # Blocks whose tokens are known (an accepted draft's becomes known as it is appended, below).
            self.block_manager.cache_full_blocks(seq, min(seq.num_computed_tokens, seq.num_tokens))
            if item.samples:
                self._append_sampled(seq, tokens)
                updated.append(seq)
            elif seq.sampling_params.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                seq.first_token_time = self.clock()  # its prompt logprobs are its whole output
                self._finish(seq, FinishReason.LENGTH)
                updated.append(seq)
        self.running = [seq for seq in self.running if not seq.is_finished]
        return updated

    def _append_sampled(self, seq: Sequence, tokens: list[tuple[int, dict[int, float] | None]]) -> None:
        for token_id, logprobs in tokens:
            seq.append_token(token_id, logprobs)
            if seq.num_output_tokens == 1:
                seq.first_token_time = self.clock()
            seq.mark_token_time(self.clock())
            self._check_stop(seq)
            if seq.is_finished:
                return  # the tokens after a stop are not the request's
        if len(tokens) > 1:
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)

    def _check_stop(self, seq: Sequence) -> None:
        params = seq.sampling_params
        last_token = seq.output_token_ids[-1]
        # min_tokens holds back EOS and stop ids only; the length limits always apply.
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and last_token in self.eos_token_ids:
            self._finish(seq, FinishReason.STOP, stop_reason=last_token)
        elif may_stop and last_token in params.stop_token_ids:
            self._finish(seq, FinishReason.STOP, stop_reason=last_token)
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, FinishReason.LENGTH)
        elif seq.num_tokens >= self._max_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | None = None) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        del self._unfinished[seq.request_id]


def _decodes(seq: Sequence) -> bool:
    """All its tokens but the last are computed: its next step decodes (not a prefill chunk)."""
    return seq.num_computed_tokens == seq.num_tokens - 1

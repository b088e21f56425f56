"""Scheduler over a real BlockManager with fake sizes (block_size 4); the model is simulated by feeding tokens.

Each step is checked as its exact plan: (request id, start, new tokens, samples) per scheduled sequence.
"""

import pytest

from splitserve.engine.block_manager import BlockManager, chained_block_hashes
from splitserve.engine.config import SchedulerConfig
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.sequence import FinishReason, Sequence, SequenceStatus

BLOCK_SIZE = 4
EOS = 2


def make_scheduler(num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8, chunk=64, max_model_len=128):
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=chunk,
    )
    return Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE), [EOS], max_model_len)


def make_seq(request_id: str, prompt: list[int], **params) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(**{"max_tokens": 16, **params}))


def add(scheduler: Scheduler, request_id: str, prompt: list[int], priority: int = 0, **params) -> Sequence:
    seq = make_seq(request_id, prompt, **params)
    seq.priority = priority
    scheduler.add(seq)
    return seq


def fake_token(seq: Sequence) -> int:
    return 1000 + seq.num_output_tokens


def step(scheduler: Scheduler, **tokens: int) -> tuple[SchedulerOutput, list[Sequence]]:
    """One engine step: the "model" samples ``tokens[request_id]``, or 1000 + the output index."""
    out = scheduler.schedule()
    sampled = {
        item.seq.request_id: [(tokens.get(item.seq.request_id, fake_token(item.seq)), None)]
        for item in out.scheduled
        if item.samples
    }
    return out, scheduler.update_from_output(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(item.seq.request_id, item.start, item.num_new_tokens, item.samples) for item in out.scheduled]


def ids(seqs: list[Sequence]) -> list[str]:
    return [seq.request_id for seq in seqs]


def ref_counts(scheduler: Scheduler) -> list[int]:
    return [block.ref_count for block in scheduler.block_manager.blocks]


def assert_all_free(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    assert ref_counts(scheduler) == [0] * manager.num_blocks
    assert manager.num_free_blocks == manager.num_blocks
    assert not scheduler.has_unfinished()
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 0)


def test_new_requests_join_running_decodes():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [11, 12, 13, 14, 15, 16], max_tokens=3)
    out, updated = step(scheduler)
    assert plan(out) == [("a", 0, 6, True)]
    assert ids(updated) == ["a"]
    assert a.block_table == [0, 1]
    assert a.first_scheduled_time is not None and a.first_token_time is not None

    b = add(scheduler, "b", [21, 22, 23, 24, 25], max_tokens=2)
    out, updated = step(scheduler)
    assert plan(out) == [("a", 6, 1, True), ("b", 0, 5, True)]
    assert out.num_batched_tokens == 6
    assert b.block_table == [2, 3]

    out, updated = step(scheduler)
    assert plan(out) == [("a", 7, 1, True), ("b", 5, 1, True)]
    assert ids(updated) == ["a", "b"]
    assert a.output_token_ids == [1000, 1001, 1002] and a.finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == [1000, 1001] and b.finish_reason is FinishReason.LENGTH
    assert a.status is b.status is SequenceStatus.FINISHED
    assert scheduler.get("a") is None
    assert_all_free(scheduler)


def test_long_prompt_is_prefilled_in_chunks_beside_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=7, chunk=6)
    add(scheduler, "a", [11, 12, 13], max_tokens=6)
    assert plan(step(scheduler)[0]) == [("a", 0, 3, True)]

    b = add(scheduler, "b", list(range(100, 120)), max_tokens=2)  # 20 tokens, in chunks of 6
    assert plan(step(scheduler)[0]) == [("a", 3, 1, True), ("b", 0, 6, False)]
    assert plan(step(scheduler)[0]) == [("a", 4, 1, True), ("b", 6, 6, False)]
    assert plan(step(scheduler)[0]) == [("a", 5, 1, True), ("b", 12, 6, False)]
    assert plan(step(scheduler)[0]) == [("a", 6, 1, True), ("b", 18, 2, True)]
    assert b.num_computed_tokens == 20
    assert b.output_token_ids == [1000]

    # The budget caps a chunk too: 7 tokens, of which the two decodes take 2.
    c = add(scheduler, "c", list(range(200, 210)))
    assert plan(step(scheduler)[0]) == [("a", 7, 1, True), ("b", 20, 1, True), ("c", 0, 5, False)]
    assert plan(step(scheduler)[0]) == [("c", 5, 5, True)]
    scheduler.abort(c.request_id)
    assert_all_free(scheduler)


def test_budget_and_seq_cap_hold_back_waiting_requests():
    scheduler = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    for request_id in "abc":
        add(scheduler, request_id, [1, 2, 3, 4, 5], max_tokens=2)
    out, _ = step(scheduler)
    assert plan(out) == [("a", 0, 5, True), ("b", 0, 5, True)]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)

    out, _ = step(scheduler)  # a and b finish; c may only start next step
    assert plan(out) == [("a", 5, 1, True), ("b", 5, 1, True)]
    out, _ = step(scheduler)
    assert plan(out) == [("c", 4, 1, True)]  # a's first block is a prefix hit
    assert scheduler.get("c").num_cached_tokens == 4
    step(scheduler)
    assert_all_free(scheduler)


def test_preemption_takes_the_last_admitted_and_it_resumes_later():
    scheduler = make_scheduler(num_blocks=4)
    a = add(scheduler, "a", [1, 2, 3, 4, 5, 6, 7], max_tokens=4)
    b = add(scheduler, "b", [11, 12, 13, 14, 15, 16, 17], max_tokens=3)
    assert plan(step(scheduler)[0]) == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert plan(step(scheduler)[0]) == [("a", 7, 1, True), ("b", 7, 1, True)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])

    # a's 9th token needs a third block: b (admitted last) is preempted, and a takes b's tail block.
    out, _ = step(scheduler)
    assert plan(out) == [("a", 8, 1, True)]
    assert out.preempted == [b]
    assert a.block_table == [0, 1, 3]
    assert (b.status, b.num_computed_tokens, b.num_preemptions, b.block_table) == (
        SequenceStatus.WAITING,
        0,
        1,
        [],
    )
    assert list(scheduler.waiting) == [b]
    assert ref_counts(scheduler) == [1, 1, 0, 1]

    # b's first block is still cached, but it needs two more blocks and only that one is free.
    out, _ = step(scheduler)
    assert plan(out) == [("a", 9, 1, True)]
    assert a.finish_reason is FinishReason.LENGTH
    assert list(scheduler.waiting) == [b]

    # a finished: b resumes from its cached first block and recomputes the rest, outputs included.
    out = scheduler.schedule()
    assert plan(out) == [("b", 4, 5, True)]
    assert b.block_table == [2, 3, 1]
    scheduler.update_from_output(out, {"b": [(1002, None)]})
    assert b.output_token_ids == [1000, 1001, 1002]
    assert b.finish_reason is FinishReason.LENGTH
    assert b.num_cached_tokens == 0  # the cache hit of its first admission
    assert_all_free(scheduler)


def test_last_running_sequence_is_preempted_when_blocks_are_held_elsewhere():
    scheduler = make_scheduler(num_blocks=2)
    # A block held outside the scheduler, as a decode pod's KV-transfer lease does.
    lease = make_seq("lease", [0, 0, 0, 0])
    assert scheduler.block_manager.allocate_slots(lease, 4)
    a = add(scheduler, "a", [1, 2, 3, 4], max_tokens=2)
    assert plan(step(scheduler)[0]) == [("a", 0, 4, True)]

    out, updated = step(scheduler)
    assert (plan(out), out.preempted, updated) == ([], [a], [])
    assert (a.status, a.num_preemptions, list(scheduler.waiting)) == (SequenceStatus.WAITING, 1, [a])

    scheduler.block_manager.free(lease)
    out, _ = step(scheduler)
    assert plan(out) == [("a", 4, 1, True)]
    assert a.output_token_ids == [1000, 1001]
    assert_all_free(scheduler)


def test_waiting_requests_start_by_priority_first_come_first_served_among_equals():
    scheduler = make_scheduler(max_num_batched_tokens=5)
    for i, (request_id, priority) in enumerate([("a", 0), ("b", 1), ("c", -1), ("d", 0), ("e", -1)]):
        add(scheduler, request_id, [10 * i + k for k in range(5)], priority, max_tokens=1)
    assert ids(scheduler.waiting) == ["c", "e", "a", "d", "b"]  # vLLM's meaning: lower first
    started = [plan(step(scheduler)[0])[0][0] for _ in range(5)]  # one prompt per step
    assert started == ["c", "e", "a", "d", "b"]
    assert_all_free(scheduler)


def test_preemption_takes_the_least_urgent_even_one_scheduled_earlier_in_the_step():
    scheduler = make_scheduler(num_blocks=4)
    a = add(scheduler, "a", [1, 2, 3, 4, 5], priority=1, max_tokens=5)  # admitted first, but less urgent
    assert plan(step(scheduler)[0]) == [("a", 0, 5, True)]
    b = add(scheduler, "b", [11, 12, 13, 14, 15, 16, 17], max_tokens=3)
    assert plan(step(scheduler)[0]) == [("a", 5, 1, True), ("b", 0, 7, True)]
    assert plan(step(scheduler)[0]) == [("a", 6, 1, True), ("b", 7, 1, True)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])

    # a's next token fits its blocks and is scheduled; b's needs a third block: a is preempted after all, its
    # share of the step taken back, and b decodes in its place.
    out, _ = step(scheduler)
    assert plan(out) == [("b", 8, 1, True)]
    assert out.preempted == [a]
    assert (a.status, a.num_computed_tokens, a.block_table, list(scheduler.waiting)) == (
        SequenceStatus.WAITING, 0, [], [a])
    assert b.finish_reason is FinishReason.LENGTH  # its third token, in a's freed block

    while scheduler.has_unfinished():  # b finishes, then a resumes and recomputes its prompt and outputs
        step(scheduler)
    assert (a.output_token_ids, b.output_token_ids) == ([1000, 1001, 1002, 1003, 1004], [1000, 1001, 1002])
    assert a.num_preemptions == 1
    assert_all_free(scheduler)


def test_a_sequence_that_is_the_least_urgent_gives_way_itself_and_the_ones_after_it_run():
    scheduler = make_scheduler(num_blocks=4)
    a = add(scheduler, "a", [1, 2, 3, 4, 5, 6, 7], priority=1, max_tokens=4)
    step(scheduler)
    b = add(scheduler, "b", [11, 12, 13, 14, 15, 16, 17], max_tokens=3)
    assert plan(step(scheduler)[0]) == [("a", 7, 1, True), ("b", 0, 7, True)]
    # a, first in the batch, needs a third block and finds none. Without priorities b (admitted last) would give
    # way; here a is the least urgent, so a leaves and b, after it, still decodes.
    out, _ = step(scheduler)
    assert (plan(out), out.preempted, ids(scheduler.running)) == ([("b", 7, 1, True)], [a], ["b"])


def test_a_preempted_sequence_waits_ahead_of_its_equals_and_behind_more_urgent_ones():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=1)
    a = add(scheduler, "a", [1, 2, 3, 4, 5, 6, 7], max_tokens=8)
    step(scheduler)
    add(scheduler, "later", [20 + k for k in range(9)], max_tokens=1)
    add(scheduler, "urgent", [40 + k for k in range(9)], priority=-1, max_tokens=1)
    # Hold two blocks outside the scheduler (as a KV-transfer lease does): a's next block comes from preempting a.
    lease = make_seq("lease", [0] * 8)
    assert scheduler.block_manager.allocate_slots(lease, 8)
    while a.status is SequenceStatus.RUNNING:
        step(scheduler)
    assert ids(scheduler.waiting) == ["urgent", "a", "later"]


def test_abort_while_waiting():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [1, 2, 3])
    assert scheduler.abort("a") is a
    assert (a.status, a.finish_reason) == (SequenceStatus.FINISHED, FinishReason.ABORT)
    assert scheduler.abort("a") is None
    assert scheduler.abort("never-added") is None
    assert plan(scheduler.schedule()) == []
    assert_all_free(scheduler)


def test_abort_while_running():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [1, 2, 3, 4, 5])
    step(scheduler)
    assert a.block_table == [0, 1]
    assert scheduler.abort("a") is a
    assert a.block_table == []
    assert a.finish_reason is FinishReason.ABORT
    assert_all_free(scheduler)


def test_abort_between_schedule_and_update():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [1, 2, 3, 4, 5], max_tokens=2)
    b = add(scheduler, "b", [6, 7, 8], max_tokens=2)
    out = scheduler.schedule()
    scheduler.abort("b")
    updated = scheduler.update_from_output(out, {"a": [(50, None)], "b": [(60, {60: -0.5})]})
    assert updated == [a]
    assert (a.num_computed_tokens, a.output_token_ids) == (5, [50])
    assert (b.num_computed_tokens, b.output_token_ids, b.finish_reason) == (0, [], FinishReason.ABORT)
    assert ref_counts(scheduler)[:3] == [1, 1, 0]
    step(scheduler)
    assert_all_free(scheduler)


def test_eos_stops_with_its_token_as_stop_reason():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [1, 2, 3])
    step(scheduler, a=7)
    _, updated = step(scheduler, a=EOS)
    assert updated == [a]
    assert (a.output_token_ids, a.finish_reason, a.stop_reason) == ([7, EOS], FinishReason.STOP, EOS)
    assert_all_free(scheduler)


def test_ignore_eos_runs_to_max_tokens():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [1, 2, 3], ignore_eos=True, max_tokens=3)
    for _ in range(3):
        step(scheduler, a=EOS)
    assert (a.output_token_ids, a.finish_reason, a.stop_reason) == ([EOS, EOS, EOS], FinishReason.LENGTH, None)
    assert_all_free(scheduler)


def test_stop_token_ids_stop():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [1, 2, 3], stop_token_ids=[9])
    step(scheduler, a=8)
    step(scheduler, a=9)
    assert (a.output_token_ids, a.finish_reason, a.stop_reason) == ([8, 9], FinishReason.STOP, 9)
    assert_all_free(scheduler)


def test_min_tokens_holds_back_eos_and_stop_ids():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [1, 2, 3], stop_token_ids=[9], min_tokens=3)
    step(scheduler, a=9)
    step(scheduler, a=EOS)
    assert not a.is_finished
    step(scheduler, a=EOS)  # the 3rd token: min_tokens reached
    assert (a.output_token_ids, a.finish_reason, a.stop_reason) == ([9, EOS, EOS], FinishReason.STOP, EOS)
    assert_all_free(scheduler)


def test_max_model_len_and_pool_size_cap_the_length():
    scheduler = make_scheduler(max_model_len=6)
    a = add(scheduler, "a", [1, 2, 3, 4], max_tokens=None)
    step(scheduler)
    step(scheduler)
    assert (a.num_tokens, a.finish_reason) == (6, FinishReason.LENGTH)
    assert_all_free(scheduler)

    # 2 blocks of 4 hold 8 tokens: the 9th can be sampled, never computed, so the sequence stops there.
    scheduler = make_scheduler(num_blocks=2, max_model_len=100)
    b = add(scheduler, "b", [1, 2, 3, 4], max_tokens=None)
    for _ in range(5):
        step(scheduler)
    assert (b.num_tokens, b.finish_reason) == (9, FinishReason.LENGTH)
    assert_all_free(scheduler)


def test_logprobs_are_appended_with_the_token():
    scheduler = make_scheduler()
    a = add(scheduler, "a", [1, 2, 3], max_tokens=1)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": [(5, {5: -0.25, 6: -1.5})]})
    assert (a.output_token_ids, a.output_logprobs) == ([5], [{5: -0.25, 6: -1.5}])
    assert_all_free(scheduler)


def prefilled_seq(scheduler: Scheduler, request_id: str, prompt: list[int], first_token: int, **params) -> Sequence:
    """What a decode pod holds after a KV transfer: blocks allocated, prompt computed, first token sampled."""
    seq = make_seq(request_id, prompt, **params)
    assert scheduler.block_manager.allocate_slots(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    seq.append_token(first_token)
    return seq


def test_add_prefilled_joins_running_and_decodes():
    scheduler = make_scheduler()
    a = prefilled_seq(scheduler, "a", [1, 2, 3, 4, 5, 6, 7, 8], 50, max_tokens=3)
    scheduler.add_prefilled(a)
    assert (a.status, scheduler.num_running, scheduler.num_waiting) == (SequenceStatus.RUNNING, 1, 0)
    assert scheduler.block_manager.block_hashes_of(a) == chained_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BLOCK_SIZE)

    assert plan(step(scheduler)[0]) == [("a", 8, 1, True)]
    assert a.block_table == [0, 1, 2]
    assert plan(step(scheduler)[0]) == [("a", 9, 1, True)]
    assert (a.output_token_ids, a.finish_reason) == ([50, 1001, 1002], FinishReason.LENGTH)
    assert_all_free(scheduler)


def test_add_prefilled_whose_first_token_already_ends_it():
    scheduler = make_scheduler()
    a = prefilled_seq(scheduler, "a", [1, 2, 3], EOS)
    scheduler.add_prefilled(a)
    assert (a.finish_reason, a.stop_reason, a.block_table) == (FinishReason.STOP, EOS, [])
    b = prefilled_seq(scheduler, "b", [1, 2, 3], 7, max_tokens=1)
    scheduler.add_prefilled(b)
    assert b.finish_reason is FinishReason.LENGTH
    assert_all_free(scheduler)


def test_add_prefilled_rejects_a_sequence_not_ready_to_decode():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="all but its last token computed"):
        scheduler.add_prefilled(make_seq("a", [1, 2, 3]))
    assert_all_free(scheduler)


def test_requests_that_could_never_run_are_rejected():
    scheduler = make_scheduler(num_blocks=2, max_model_len=6)
    with pytest.raises(ValueError, match="more than the model's context"):
        scheduler.add(make_seq("a", [1] * 7))
    scheduler = make_scheduler(num_blocks=2, max_model_len=100)
    with pytest.raises(ValueError, match="more than the whole KV cache holds"):
        scheduler.add(make_seq("a", [1] * 9))
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.add(make_seq("a", []))
    add(scheduler, "a", [1] * 8)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add(make_seq("a", [1]))
    scheduler.abort("a")
    assert_all_free(scheduler)

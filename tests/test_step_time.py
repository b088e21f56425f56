"""The measured step-time model (engine/step_time.py) on synthetic step logs, and the TPOT-slack prefill chunk
(engine/prefill_budget.py) driving the real Scheduler on a fake step-time model and a fake clock."""

import random

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import SchedulerConfig
from splitserve.engine.prefill_budget import TPOTSlackBudget
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_time import MAX_GAP_TARGETS, StepSample, StepTimeFit, StepTimeModel, attention_positions

TRUE = StepTimeModel(base=0.010, per_decode_row=0.002, per_prefill_token=0.003, per_context_token=2e-7,
                     prefill_pass=0.015, num_samples=1)


def synthetic_steps(model: StepTimeModel, count: int, rng: random.Random, prefill_share: float = 0.3,
                    noise: float = 0.03) -> list[StepSample]:
    steps = []
    for _ in range(count):
        rows = rng.randint(0, 8)
        chunk = rng.choice([0, 16, 64, 200, 384]) if rng.random() < prefill_share or rows == 0 else 0
        context = rows * rng.randint(50, 600) + attention_positions(rng.randint(0, 300), chunk)
        seconds = model.predict(rows, chunk, context) * (1 + rng.uniform(-noise, noise))
        steps.append(StepSample(rows, chunk, context, seconds))
    return steps


def fitted(steps: list[StepSample], **kwargs) -> StepTimeModel:
    fit = StepTimeFit(**kwargs)
    for sample in steps:
        fit.observe(sample)
    return fit.model


def test_the_fit_recovers_the_coefficients_of_a_mixed_step_log():
    model = fitted(synthetic_steps(TRUE, 300, random.Random(0)))
    # Rows and context grow together in a decode batch, so their split is loose; what a step costs is not.
    assert model.base == pytest.approx(TRUE.base, rel=0.1)
    assert model.per_prefill_token == pytest.approx(TRUE.per_prefill_token, rel=0.05)
    for rows, chunk, context in ((1, 0, 300), (8, 0, 3000), (0, 384, 74000), (4, 64, 9000), (8, 200, 40000)):
        assert model.predict(rows, chunk, context) == pytest.approx(TRUE.predict(rows, chunk, context), rel=0.05)
    assert model.num_samples > 300 - 8  # refitted every 8 steps


def test_decode_only_steps_keep_the_prompt_token_cost_of_the_prior():
    rng = random.Random(1)
    steps = synthetic_steps(TRUE, 32, rng)  # the prior: the pod's first steps, prefills among them
    steps += synthetic_steps(TRUE, 400, rng, prefill_share=0.0)  # then a window of decodes only
    model = fitted(steps, window=128, prior_steps=32)
    assert model.per_prefill_token == pytest.approx(TRUE.per_prefill_token, rel=0.2)
    assert model.base == pytest.approx(TRUE.base, rel=0.15)


def test_a_mixed_step_pays_both_passes_though_the_fit_saw_none():
    """The decode pod's case (issue 35): its fit has seen prefills only in its prior (warm-up) and decodes since,
    never a step that does both; a lent chunk beside decodes is still predicted at both fixed costs (the file's
    blocks for the decode rows, the prefill copies for the chunk), not at the decode step's alone."""
    rng = random.Random(3)
    prior = synthetic_steps(TRUE, 32, rng, prefill_share=0.0)[:16]
    prior += [StepSample(0, n, attention_positions(0, n), TRUE.predict(0, n, attention_positions(0, n)))
              for n in (16, 64, 128, 256) * 4]
    model = fitted(prior + synthetic_steps(TRUE, 300, rng, prefill_share=0.0), window=128, prior_steps=32)
    mixed = model.predict(3, 3, 3 * 400 + attention_positions(100, 3))
    assert mixed == pytest.approx(TRUE.predict(3, 3, 3 * 400 + attention_positions(100, 3)), rel=0.1)
    assert mixed > model.predict(3, 0, 3 * 400) + 0.9 * TRUE.prefill_pass
    # The chunk a 25 ms target allows beside 3 decodes: none, where one intercept would have let 2 ms of tokens in.
    assert model.largest_chunk(3, 3 * 400, within_s=0.8 * 0.025, chunk_start=100) == 0


def test_recent_chunks_that_contradict_the_warm_up_keep_its_token_cost():
    """A decode pod lent prompts chunks them at nearly one size, on a loaded machine: the recent steps' times say
    nothing of the chunk's fixed pass and its token cost apart (the pass is most of a small chunk's time, as with bf16
    prefill here), and noise can make the larger chunks look faster. A plain fit then turns the token cost negative,
    clipped to 0: a model that knows no prompt token's cost and lends nothing more (as measured under load). The fit
    keeps the warm-up's token cost and refits the rest."""
    pod = StepTimeModel(base=0.008, per_decode_row=0.0005, per_prefill_token=0.0003, per_context_token=2e-8,
                        prefill_pass=0.020, num_samples=1)  # SmolLM2 on a bf16 decode pod, roughly
    rng = random.Random(4)
    prior = synthetic_steps(pod, 32, rng)  # the warm-up: chunk sizes 16 to 384, decodes
    window = []
    for k in range(200):
        rows, chunk = 1 + k % 3, (0, 16, 0, 24)[k % 4]
        context = rows * 400 + attention_positions(100, chunk)
        noise = {0: 0.0, 16: 0.005, 24: -0.005}[chunk]  # the larger chunks measured faster
        window.append(StepSample(rows, chunk, context, pod.predict(rows, chunk, context) + noise))
    model = fitted(prior + window, window=128, prior_steps=32)
    warm_up = fitted(prior, prior_steps=32)
    assert model.known and model.per_prefill_token == pytest.approx(warm_up.per_prefill_token)
    seen = (2, 20, 800 + attention_positions(100, 20))  # the chunks it sees: still predicted as measured
    assert model.predict(*seen) == pytest.approx(pod.predict(*seen), rel=0.1)


def test_the_fit_follows_the_pod_getting_slower():
    rng = random.Random(2)
    slower = StepTimeModel(*(2 * c for c in TRUE.as_tuple()), num_samples=1)
    model = fitted(synthetic_steps(TRUE, 64, rng) + synthetic_steps(slower, 256, rng), window=128, prior_steps=32)
    for rows, chunk, context in ((1, 0, 300), (4, 64, 9000), (0, 300, 45000)):
        assert model.predict(rows, chunk, context) == pytest.approx(slower.predict(rows, chunk, context), rel=0.15)


@pytest.mark.parametrize("rows,context,within", [(0, 0, 0.5), (3, 900, 0.1), (8, 4000, 0.05), (8, 4000, 0.03)])
def test_largest_chunk_is_the_largest_that_fits(rows, context, within):
    chunk = TRUE.largest_chunk(rows, context, within, chunk_start=100)
    def predicted(n: int) -> float:
        return TRUE.predict(rows, n, context + attention_positions(100, n))

    assert chunk == 0 or predicted(chunk) <= within
    assert predicted(chunk + 1) > within


def test_an_unmeasured_model_sizes_no_chunk():
    assert StepTimeModel().largest_chunk(1, 100, 10.0) == 0
    assert TRUE.largest_chunk(4, 100, within_s=0.001) == 0  # the decodes alone take longer


# ---- the slack-bounded chunk in the scheduler ---------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lending_scheduler(model: StepTimeModel, target_s: float, clock: FakeClock, monkeypatch) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, long_prefill_token_threshold=2048,
                             tpot_slack_chunking=True, default_tpot_target_s=target_s)
    budget = TPOTSlackBudget(lambda: model, target_s)
    return Scheduler(config, BlockManager(512, 16), [2], 4096, budget, clock=clock)


def run_step(scheduler: Scheduler, model: StepTimeModel, clock: FakeClock):
    """One step on the fake model: the clock advances by the step's predicted time; returns the plan and the
    allowance the budget gave it."""
    decoding = [seq for seq in scheduler.running if seq.num_computed_tokens == seq.num_tokens - 1]
    allowance = scheduler.prefill_budget.allowance_s(decoding, clock.now, bool(scheduler.awaiting_kv))
    out = scheduler.schedule()
    rows = sum(1 for item in out.scheduled if item.samples and item.start >= item.seq.num_prompt_tokens)
    chunk = sum(item.num_new_tokens for item in out.scheduled) - rows
    context = sum(attention_positions(item.start, item.num_new_tokens) for item in out.scheduled)
    seconds = model.predict(rows, chunk, context)
    clock.now += seconds
    sampled = {item.seq.request_id: [(1000, None)] for item in out.scheduled if item.samples}
    scheduler.update_from_output(out, sampled)
    return chunk, seconds, allowance


# 15 ms: the 4 decodes alone take longer (18 ms), bank nothing, so the prompt waits for them to finish (no chunk
# breaks it); at 40 ms they bank 22 ms a token, enough for chunks of a few tokens.
@pytest.mark.parametrize("target_s,interleaved", [(0.015, False), (0.04, True), (0.08, True), (0.3, True)])
def test_a_lent_prompt_prefills_in_chunks_that_never_break_the_slack(target_s, interleaved, monkeypatch):
    clock = FakeClock()
    scheduler = lending_scheduler(TRUE, target_s, clock, monkeypatch)
    for i in range(4):  # running decodes, admitted with their first token from a prefill pod
        seq = Sequence(f"d{i}", list(range(10, 10 + 200 + 50 * i)), SamplingParams(max_tokens=400, ignore_eos=True))
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(1000)
        assert scheduler.block_manager.allocate_slots(seq, seq.num_prompt_tokens)
        scheduler.add_prefilled(seq)
    lent = Sequence("lent", list(range(5, 5 + 700)), SamplingParams(max_tokens=4))
    scheduler.add(lent)
    last_token_at = {seq.request_id: clock.now for seq in scheduler.running}
    chunks = []
    while lent.num_output_tokens == 0:
        decodes_before = any(seq.request_id != "lent" for seq in scheduler.running)
        chunk, seconds, allowance = run_step(scheduler, TRUE, clock)
        chunks.append(chunk)
        if chunk and decodes_before:  # (once they finished, a pod slower than the target takes probe chunks)
            assert seconds <= allowance  # the step it prefilled in fits what the decodes allowed
        for seq in scheduler.running:
            if seq.request_id != "lent":
                # A step that prefilled keeps each decode's TPOT (the average of its gaps since its first token
                # here) within the target, or else its gap (decodes alone may not: not ours), and no gap past
                # MAX_GAP_TARGETS targets.
                gap = clock.now - last_token_at[seq.request_id]
                since, outputs = seq.tpot_anchor
                average_kept = clock.now - since <= (seq.num_output_tokens - outputs) * target_s + 1e-9
                assert not chunk or ((gap <= target_s or average_kept) and gap <= MAX_GAP_TARGETS * target_s)
                last_token_at[seq.request_id] = clock.now
        assert len(chunks) < 2000, "the lent prompt never finished"
    assert sum(chunks) == 700
    decodes_running = all(scheduler.get(f"d{i}") is not None for i in range(4))
    assert (max(chunks) < 700 and decodes_running) == interleaved  # in chunks beside the decodes


def test_decodes_ahead_of_their_target_lend_their_banked_slack_to_a_longer_step(monkeypatch):
    """Decodes at ~25 ms a token under a 80 ms target bank ~55 ms a token: after 20 tokens a lent prompt's first
    chunk runs in one step longer than the target (fewer steps, each paying the prefill pass once), within the
    decodes' average and the gap cap. Without the bank the step would be held to the target's 64 ms."""
    clock, target_s = FakeClock(), 0.08
    scheduler = lending_scheduler(TRUE, target_s, clock, monkeypatch)
    seq = Sequence("d", list(range(10, 210)), SamplingParams(max_tokens=400, ignore_eos=True))
    seq.num_computed_tokens = seq.num_prompt_tokens
    seq.append_token(1000)
    assert scheduler.block_manager.allocate_slots(seq, seq.num_prompt_tokens)
    scheduler.add_prefilled(seq)
    for _ in range(20):
        assert run_step(scheduler, TRUE, clock)[0] == 0
    scheduler.add(Sequence("lent", list(range(5, 5 + 1500)), SamplingParams(max_tokens=4)))
    chunk, seconds, allowance = run_step(scheduler, TRUE, clock)
    assert chunk > 0 and target_s < seconds <= allowance <= 0.8 * MAX_GAP_TARGETS * target_s
    since, outputs = seq.tpot_anchor
    assert clock.now - since <= (seq.num_output_tokens - outputs) * target_s  # its TPOT still within the target


def test_without_targets_the_prompt_takes_the_whole_token_budget(monkeypatch):
    clock = FakeClock()
    scheduler = lending_scheduler(TRUE, 0.0, clock, monkeypatch)
    scheduler.add(Sequence("p", list(range(5, 605)), SamplingParams(max_tokens=2)))
    chunk, _, allowance = run_step(scheduler, TRUE, clock)
    assert (chunk, allowance) == (600, None)


@pytest.mark.parametrize("awaiting", [True, False])
def test_with_no_decode_running_the_chunk_still_leaves_room_for_one_to_join(awaiting, monkeypatch):
    """Nothing decodes. A request whose KV is on its way here may join at any step: the chunk keeps the default
    target's room for its next token. With none on its way, one routed here later has its prompt to prefill
    elsewhere first and waits at most the gap cap: the chunk may fill that."""
    clock = FakeClock()
    scheduler = lending_scheduler(TRUE, 0.3, clock, monkeypatch)
    if awaiting:
        scheduler.awaiting_kv.add("joining")
    scheduler.add(Sequence("p", list(range(5, 605)), SamplingParams(max_tokens=2)))
    chunk, seconds, allowance = run_step(scheduler, TRUE, clock)
    expected = 0.8 * 0.3 * (1 if awaiting else MAX_GAP_TARGETS)
    assert allowance == pytest.approx(expected) and 0 < chunk < 600 and seconds <= allowance


def test_a_pod_slower_than_its_target_still_prefills_when_nothing_decodes(monkeypatch):
    """Not even one token fits the default target's allowance (the pod's step is slower than its target): with no
    decode to keep, the prompt still moves, in probe-sized chunks, and finishes (it used to wait forever)."""
    clock = FakeClock()
    slow = StepTimeModel(0.05, 0.002, 0.0005, 1e-7, prefill_pass=0.05, num_samples=100)  # 50 ms steps vs 30 ms
    scheduler = lending_scheduler(slow, 0.03, clock, monkeypatch)
    scheduler.awaiting_kv.add("joining")  # a request's KV on its way: the default target's allowance holds
    scheduler.add(Sequence("p", list(range(5, 105)), SamplingParams(max_tokens=2)))
    chunks = []
    while scheduler.get("p").num_output_tokens == 0:
        chunks.append(run_step(scheduler, slow, clock)[0])
        assert len(chunks) < 50, "the prompt never finished"
    assert sum(chunks) == 100 and max(chunks) == scheduler.prefill_budget.probe_tokens


def test_a_decode_behind_its_target_lets_no_chunk_in(monkeypatch):
    clock = FakeClock()
    scheduler = lending_scheduler(TRUE, 0.05, clock, monkeypatch)
    seq = Sequence("d", list(range(10, 60)), SamplingParams(max_tokens=100))
    seq.num_computed_tokens = seq.num_prompt_tokens
    seq.append_token(1000)
    assert scheduler.block_manager.allocate_slots(seq, seq.num_prompt_tokens)
    scheduler.add_prefilled(seq)
    seq.last_token_time = clock.now - 0.045  # 45 ms of its 50 ms gap gone already, and no slack banked before
    seq.tpot_anchor = (clock.now - 0.045, seq.num_output_tokens)
    scheduler.add(Sequence("lent", list(range(5, 305)), SamplingParams(max_tokens=2)))
    chunk, _, _ = run_step(scheduler, TRUE, clock)
    assert chunk == 0

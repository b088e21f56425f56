"""Sampler: filters against transformers' logits processors, penalties against OpenAI's formula, seeded draws
keyed by (seed, position), the draw's distribution, min_tokens, and raw-distribution logprobs."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sampling.sampler import (
    TOP_P_HEAD,
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    seeded_draw_key,
)

V = 1000
EOS = 3
NO_IDS = torch.zeros(4, 1, dtype=torch.long)  # HF warpers take input_ids but do not read them


def random_logits(n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale  # [n, V]


def row(prompt=(1, 2), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output))


def sampler(seed: int = 0, vocab: int = V) -> Sampler:
    return Sampler(vocab_size=vocab, eos_token_ids=[EOS], seed=seed)


# --- filters vs transformers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 1.9])
def test_temperature_matches_hf(temperature):
    logits = random_logits(4, seed=1)
    ours = sampler().warp(logits, [SamplingParams(temperature=temperature)] * 4)
    assert torch.equal(ours, TemperatureLogitsWarper(temperature)(NO_IDS, logits))


@pytest.mark.parametrize("k", [1, 2, 50, 999])
def test_top_k_matches_hf(k):
    logits = random_logits(4, seed=2)
    ours = sampler().warp(logits, [SamplingParams(top_k=k)] * 4)
    assert torch.equal(ours, TopKLogitsWarper(k)(NO_IDS, logits))
    assert (ours > float("-inf")).sum(dim=-1).tolist() == [k] * 4


def test_top_k_keeps_ties_with_the_kth_logit_like_hf():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    kept = apply_top_k(logits, torch.tensor([2])) > float("-inf")
    assert kept.tolist() == [[True, True, True, True, False]]
    assert torch.equal(apply_top_k(logits, torch.tensor([2])), TopKLogitsWarper(2)(NO_IDS[:1], logits))


def test_top_k_at_or_above_vocab_is_off():
    logits = random_logits(2, seed=3)
    for k in (0, -1, V, V + 5):
        assert torch.equal(sampler().warp(logits, [SamplingParams(top_k=k)] * 2), logits)


def assert_same_nucleus_as_hf(ours: torch.Tensor, logits: torch.Tensor, top_p: list[float]) -> None:
    """Equal to HF's TopPLogitsWarper, except for tokens on the cutoff itself: HF sums float32 probabilities
    bottom-up over the whole vocabulary, we sum top-down over the head, and a token whose mass above equals
    top_p to within float32 rounding may land on either side (the float64 sum cannot settle it either)."""
    hf = torch.cat([TopPLogitsWarper(p)(NO_IDS[:1], logits[i : i + 1]) for i, p in enumerate(top_p)])
    differ = (ours == float("-inf")) != (hf == float("-inf"))
    probs = logits.double().softmax(dim=-1)
    for r, token in differ.nonzero().tolist():
        mass_above = probs[r][probs[r] > probs[r, token]].sum().item()
        assert abs(mass_above - top_p[r]) < 1e-6, (r, token, mass_above)
    assert differ.sum(dim=-1).max() <= 1
    assert torch.equal(ours[~differ], hf[~differ])


@pytest.mark.parametrize("p", [0.01, 0.3, 0.75, 0.9, 0.999])
def test_top_p_matches_hf(p):
    logits = random_logits(4, seed=4)
    assert_same_nucleus_as_hf(sampler().warp(logits, [SamplingParams(top_p=p)] * 4), logits, [p] * 4)


def test_top_p_may_differ_from_hf_by_one_token_on_the_rounding_edge():
    # Row 3 has a token whose mass above is 0.999 to within 1e-7 (0.99899990 summing float32 probabilities,
    # 0.99900010 from a float64 softmax): we keep it, HF's float32 cumulative sum drops it.
    logits = random_logits(4, seed=4)
    ours = sampler().warp(logits, [SamplingParams(top_p=0.999)] * 4)
    hf = TopPLogitsWarper(0.999)(NO_IDS, logits)
    assert (ours > float("-inf")).sum(dim=-1).tolist() == [560, 535, 602, 473]
    assert (hf > float("-inf")).sum(dim=-1).tolist() == [560, 535, 602, 472]


def test_top_p_falls_back_to_a_full_sort_when_the_nucleus_is_wider_than_the_head():
    logits = random_logits(4, seed=4, scale=0.5)  # flat: the 0.9-nucleus holds far more than TOP_P_HEAD tokens
    top_p = [0.9, 0.05] * 2
    ours = sampler().warp(logits, [SamplingParams(top_p=p) for p in top_p])
    kept = (ours > float("-inf")).sum(dim=-1)
    assert kept[0] > TOP_P_HEAD and kept[1] < TOP_P_HEAD
    assert_same_nucleus_as_hf(ours, logits, top_p)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.2: 0.75 needs the first two; 0.4 only the first (never less than one token).
    logits = torch.tensor([0.5, 0.3, 0.2]).log().repeat(2, 1)
    kept = apply_top_p(logits, torch.tensor([[0.75], [0.4]])) > float("-inf")
    assert kept.tolist() == [[True, True, False], [True, False, False]]


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(min_p):
    logits = random_logits(4, seed=5)
    ours = sampler().warp(logits, [SamplingParams(min_p=min_p)] * 4)
    assert torch.equal(ours, MinPLogitsWarper(min_p)(NO_IDS, logits))


def test_min_p_is_relative_to_the_most_probable_token():
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    kept = apply_min_p(logits, torch.tensor([[0.4]])) > float("-inf")  # threshold 0.24
    assert kept.tolist() == [[True, True, False]]


def test_full_warper_chain_matches_hf_in_hf_order():
    logits = random_logits(4, seed=6)
    params = SamplingParams(temperature=0.8, top_k=200, top_p=0.9, min_p=0.05)
    expected = logits
    for warper in (TemperatureLogitsWarper(0.8), TopKLogitsWarper(200), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)):
        expected = warper(NO_IDS, expected)
    assert torch.equal(sampler().warp(logits, [params] * 4), expected)


def test_each_row_gets_its_own_parameters():
    logits = random_logits(4, seed=7)
    params = [
        SamplingParams(temperature=0.5, top_k=10),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=1.3),
        SamplingParams(min_p=0.2, top_k=300),
    ]
    hf_chains = [
        [TemperatureLogitsWarper(0.5), TopKLogitsWarper(10)],
        [TopPLogitsWarper(0.5)],
        [TemperatureLogitsWarper(1.3)],
        [TopKLogitsWarper(300), MinPLogitsWarper(0.2)],
    ]
    ours = sampler().warp(logits, params)
    for i, chain in enumerate(hf_chains):
        expected = logits[i : i + 1]
        for warper in chain:
            expected = warper(NO_IDS[:1], expected)
        assert torch.equal(ours[i : i + 1], expected), i


# --- penalties ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_hf_over_prompt_and_output(penalty):
    logits = random_logits(4, seed=8)
    histories = [([5, 9, 9], [11, 5]), ([0, 1, 2], [3, 4]), ([7, 7, 7], [7, 7]), ([999, 500, 1], [2, 998])]
    rows = [row(prompt, output, repetition_penalty=penalty) for prompt, output in histories]
    input_ids = torch.tensor([prompt + output for prompt, output in histories])  # [4, 5]
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    assert torch.equal(sampler().penalize(logits, rows), expected)


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = random_logits(1, seed=9)
    output = [5, 5, 5, 7, 12, 12]
    ours = sampler().penalize(logits, [row([9, 5], output, presence_penalty=0.5, frequency_penalty=0.25)])
    expected = logits.clone()
    for token in set(output):  # mu[j] - c[j] * alpha_frequency - [c[j] > 0] * alpha_presence
        expected[0, token] = logits[0, token].item() - output.count(token) * 0.25 - 0.5
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[output] = False  # the prompt-only token 9 stays untouched
    assert torch.equal(ours[0, untouched], logits[0, untouched])
    assert (ours[0, [5, 7, 12]] - expected[0, [5, 7, 12]]).abs().max().item() <= 1e-6  # float32 vs float64 order
    assert math.isclose(ours[0, 5].item(), logits[0, 5].item() - 1.25, abs_tol=1e-6)


def test_penalties_apply_only_to_the_rows_that_ask_and_leave_the_input_alone():
    logits = random_logits(3, seed=10)
    before = logits.clone()
    rows = [row([1], [2], repetition_penalty=1.5), row([1], [2]), row([1], [2], frequency_penalty=1.0)]
    ours = sampler().penalize(logits, rows)
    assert torch.equal(logits, before)
    assert torch.equal(ours[1], logits[1])
    assert not torch.equal(ours[0], logits[0]) and not torch.equal(ours[2], logits[2])
    assert torch.equal(ours[2, 1], logits[2, 1])  # frequency penalty ignores prompt tokens


# --- greedy ------------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_on_the_fast_path_and_with_logprobs():
    logits = random_logits(4, seed=11)
    expected = logits.argmax(dim=-1).tolist()
    assert sampler().sample(logits, [row(temperature=0)] * 4).token_ids == expected
    out = sampler().sample(logits, [row(temperature=0, logprobs=2)] * 4)
    assert out.token_ids == expected


def test_greedy_takes_argmax_after_penalties():
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 20] = 5.0, 4.0
    out = sampler().sample(logits, [row([10], [], temperature=0, repetition_penalty=2.0)])  # 5 / 2 < 4
    assert out.token_ids == [20]


def test_sampling_leaves_the_callers_logits_alone():
    logits = random_logits(3, seed=13)
    before = logits.clone()
    rows = [
        row(min_tokens=1, repetition_penalty=1.2, top_k=5, top_p=0.9, min_p=0.1, seed=1, logprobs=2),
        row(output=[5], temperature=0, presence_penalty=1.0),
        row(top_p=0.5),
    ]
    sampler().sample(logits, rows)
    assert torch.equal(logits, before)


def test_logits_of_the_wrong_shape_are_rejected():
    with pytest.raises(ValueError, match=r"logits must be \[2, 1000\]"):
        sampler().sample(torch.zeros(2, V + 1), [row(), row()])


# --- seeded and unseeded draws -----------------------------------------------------------------------------------


def test_draw_key_is_stable_across_processes_and_63_bit():
    # Prefill and decode pods must derive the same key: pin the value.
    assert seeded_draw_key(42, 7) == seeded_draw_key(42, 7) == 7945043480932604829
    keys = {seeded_draw_key(seed, position) for seed in range(20) for position in range(20)}
    assert len(keys) == 400 and max(keys) < 2**63


def test_seeded_draw_depends_only_on_seed_and_position():
    logits = torch.zeros(1, V)  # uniform: the draw is all noise
    target = row(prompt=range(10), output=[4, 4], seed=1234, temperature=1.0)
    alone = sampler(seed=0).sample(logits, [target]).token_ids[0]
    others = [row(seed=7), row(), row(temperature=0), row(output=[1], seed=1234), row(top_k=5)]
    batch = torch.zeros(len(others) + 1, V)
    for position in range(len(others) + 1):
        rows = others[:position] + [target] + others[position:]
        assert sampler(seed=position + 1).sample(batch, rows).token_ids[position] == alone
    # same seed and position reached through another prompt/output split: same token
    assert sampler().sample(logits, [row(range(11), [4], seed=1234)]).token_ids[0] == alone


def test_seeded_draws_differ_across_positions():
    logits = torch.zeros(1, V)
    tokens = [sampler().sample(logits, [row(range(n), seed=99)]).token_ids[0] for n in range(1, 11)]
    assert len(set(tokens)) == 10


def test_unseeded_draws_differ_across_steps_and_replay_from_the_sampler_seed():
    logits = torch.zeros(4, V)
    rows = [row()] * 4
    first, second = sampler(seed=5), sampler(seed=5)
    steps = [first.sample(logits, rows).token_ids for _ in range(3)]
    assert len({tuple(step) for step in steps}) == 3
    assert [second.sample(logits, rows).token_ids for _ in range(3)] == steps


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Critical value of chi-square with 5 degrees of freedom at p = 0.001.
CHI2_5_DOF_999 = 20.52


def test_seeded_draws_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    draws = 4000
    rows = [SamplingRow(SamplingParams(seed=seed, temperature=0.8), [1], []) for seed in range(draws)]
    tokens = sampler(vocab=6).sample(logits.repeat(draws, 1), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float()
    assert chi_square(counts, torch.softmax(logits / 0.8, dim=-1)) < CHI2_5_DOF_999


def test_unseeded_filtered_draws_follow_the_renormalized_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -8.0])
    draws = 4000
    rows = [SamplingRow(SamplingParams(top_k=6), [1], [])] * draws
    tokens = sampler(seed=3, vocab=8).sample(logits.repeat(draws, 1), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    assert counts[6:].tolist() == [0.0, 0.0]  # outside the top 6: never drawn
    assert chi_square(counts[:6], torch.softmax(logits[:6], dim=-1)) < CHI2_5_DOF_999


# --- min_tokens --------------------------------------------------------------------------------------------------


def eos_favoured_logits(n: int) -> torch.Tensor:
    logits = torch.zeros(n, V)
    logits[:, EOS], logits[:, 8], logits[:, 9] = 10.0, 9.0, 8.0  # EOS, then stop id 8, then 9
    return logits


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    rows = [
        row(output=[], temperature=0, min_tokens=2, stop_token_ids=[8]),
        row(output=[1], temperature=0, min_tokens=2, stop_token_ids=[8]),
        row(output=[1, 1], temperature=0, min_tokens=2, stop_token_ids=[8]),
        row(output=[], temperature=0, min_tokens=2, stop_token_ids=[8], ignore_eos=True),
        row(output=[], temperature=0, min_tokens=2, stop_token_ids=[V + 10]),  # outside the vocab: ignored
    ]
    assert sampler().sample(eos_favoured_logits(5), rows).token_ids == [9, 9, EOS, EOS, 8]


def test_min_tokens_blocks_eos_in_random_draws():
    rows = [row(output=[], min_tokens=1, seed=seed) for seed in range(50)]
    tokens = sampler().sample(eos_favoured_logits(50), rows).token_ids
    assert EOS not in tokens


# --- logprobs ----------------------------------------------------------------------------------------------------


def test_logprobs_are_top_n_of_the_raw_distribution_plus_the_sampled_token():
    logits = random_logits(3, seed=12)
    rows = [
        row(logprobs=5, temperature=0.5, repetition_penalty=1.5, seed=1),
        row(),
        row(logprobs=0, top_k=3, seed=2),
    ]
    out = sampler().sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    top5 = raw[0].topk(5)
    expected = dict(zip(top5.indices.tolist(), top5.values.tolist()))
    expected[out.token_ids[0]] = raw[0, out.token_ids[0]].item()
    assert out.logprobs[0] == expected
    assert out.logprobs[1] is None
    assert out.logprobs[2] == {out.token_ids[2]: raw[2, out.token_ids[2]].item()}


def test_logprobs_include_a_sampled_token_outside_the_top_n():
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 20] = 6.0, 5.0
    # The frequency penalty pushes token 10 below 20, but logprobs stay those of the raw logits.
    out = sampler().sample(logits, [row([1], [10, 10], temperature=0, frequency_penalty=1.0, logprobs=1)])
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.token_ids == [20]
    assert out.logprobs == [{10: raw[10].item(), 20: raw[20].item()}]


def test_empty_batch():
    assert sampler().sample(torch.zeros(0, V), []).token_ids == []


# --- token constraints: logit_bias, allowed_token_ids, bad words --------------------------------------------------


def test_allowed_token_ids_leave_only_those_tokens_for_greedy_and_drawn_rows():
    logits = random_logits(2, seed=11)
    allowed = [5, 17, 999]
    rows = [row(temperature=0.0, allowed_token_ids=allowed), row(temperature=1.0, seed=3, allowed_token_ids=allowed)]
    out = sampler().sample(logits, rows)
    assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    for seed in range(20):
        drawn = sampler().sample(logits[1:], [row(temperature=1.0, seed=seed, allowed_token_ids=allowed)]).token_ids[0]
        assert drawn in allowed


def test_logit_bias_adds_to_the_logits_and_leaves_other_rows_alone():
    logits = random_logits(2, seed=12)
    loser = int(logits[0].argmin())
    rows = [row(temperature=0.0, logit_bias={loser: 100.0}), row(temperature=0.0)]
    penalized = sampler().penalize(logits, rows)
    assert penalized[0, loser] == logits[0, loser] + 100.0
    assert torch.equal(penalized[0, :loser], logits[0, :loser]) and torch.equal(penalized[1], logits[1])
    assert sampler().sample(logits, rows).token_ids == [loser, int(logits[1].argmax())]


def test_bad_words_ban_the_token_that_would_complete_one():
    logits = torch.zeros(1, V)
    logits[0, 7] = 5.0  # the greedy choice
    one_token, two_tokens = [[7]], [[4, 7]]
    assert sampler().sample(logits, [row(temperature=0.0, bad_words_token_ids=one_token)]).token_ids != [7]
    # A two-token word is banned only after its first token.
    assert sampler().sample(logits, [row(output=(9,), temperature=0.0, bad_words_token_ids=two_tokens)]).token_ids \
        == [7]
    assert sampler().sample(logits, [row(output=(9, 4), temperature=0.0, bad_words_token_ids=two_tokens)]).token_ids \
        != [7]
    # Only the output counts, not the prompt (vLLM's rule).
    assert sampler().sample(logits, [row(prompt=(1, 4), temperature=0.0, bad_words_token_ids=two_tokens)]).token_ids \
        == [7]


def test_a_rows_grammar_mask_leaves_only_the_tokens_it_allows():
    logits = random_logits(2, seed=13)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[3, 400, 401]] = True
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], allowed), row(temperature=0.0)]
    out = sampler().sample(logits, rows)
    assert out.token_ids == [[3, 400, 401][int(logits[0, [3, 400, 401]].argmax())], int(logits[1].argmax())]
    for seed in range(10):
        drawn = SamplingRow(SamplingParams(temperature=1.0, seed=seed), [1], [], allowed)
        assert sampler().sample(logits[:1], [drawn]).token_ids[0] in (3, 400, 401)

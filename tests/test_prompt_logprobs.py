"""Prompt logprobs and scoring (``SamplingParams.prompt_logprobs``, ``max_tokens=0``) in the engine, on the tiny random
model: each prompt position's entry is the model's distribution after the tokens before it, however the prompt is
computed (one chunk, several, after a prefix-cache hit, after a preemption), and a request that generates nothing
samples nothing and frees every block."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM
from splitserve.engine.sampling.params import SamplingParams

PROMPT = [5 + (7 * k) % 200 for k in range(40)]  # 40 tokens: several 16-token blocks and a partial one


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-random", num_blocks=64)


def score(llm: LLM, prompt: list[int], num_top: int = 3, **params):
    return llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=num_top, **params))[0]


def test_each_entry_is_the_distribution_after_the_tokens_before_it(llm):
    scored = score(llm, PROMPT, num_top=4)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(PROMPT)
    for position in (1, 2, 17, 39):
        entry = scored.prompt_logprobs[position]
        assert entry.token_id == PROMPT[position]
        # The prefix alone, its next token forced to the prompt's: the raw logprobs are those of that position.
        alone = llm.generate(PROMPT[:position], SamplingParams(max_tokens=1, logprobs=4, temperature=0.0,
                                                               allowed_token_ids=[PROMPT[position]]))[0]
        expected = alone.logprobs[0]
        assert entry.logprob == pytest.approx(expected[PROMPT[position]], abs=1e-5)
        assert list(entry.top) == list(expected)[:4]
        assert list(entry.top.values()) == pytest.approx(list(expected.values())[:4], abs=1e-5)
        # rank: 1 + the tokens more probable than the prompt's
        better = [value for value in entry.top.values() if value > entry.logprob]
        assert entry.rank == len(better) + 1 if len(better) < 4 else entry.rank > 4


def test_a_request_that_generates_nothing_samples_nothing_and_frees_its_blocks(llm):
    scored = score(llm, PROMPT)
    assert scored.token_ids == [] and scored.text == "" and scored.finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_chunked_cached_and_generating_requests_get_the_same_entries(llm):
    whole = score(llm, PROMPT)
    again = score(llm, PROMPT)  # its blocks are in the prefix cache now: they must be computed anyway
    assert again.prompt_logprobs == whole.prompt_logprobs
    generating = llm.generate(PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=3, temperature=0.0))[0]
    assert generating.prompt_logprobs == whole.prompt_logprobs and len(generating.token_ids) == 3
    chunked = LLM(model="tiny-random", num_blocks=64, long_prefill_token_threshold=8)
    assert score(chunked, PROMPT).prompt_logprobs == whole.prompt_logprobs


def test_a_request_preempted_inside_its_prompt_keeps_one_entry_per_position(llm):
    # 5 blocks of 16 tokens, prompts in chunks of 8: a 30-token request decoding takes a third block while a 40-token
    # prompt has two, so the prompt is preempted with 32 of its tokens computed, and computes them again.
    engine = LLM(model="tiny-random", num_blocks=5, long_prefill_token_threshold=8).engine
    engine.add_request("decoding", PROMPT[:30], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))
    for _ in range(3):
        engine.step()
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2, temperature=0.0)
    seq = engine.add_request("scored", PROMPT, params)
    entries_when_preempted = []
    while engine.has_unfinished_requests():
        entries, preemptions = len(seq.prompt_logprobs), seq.num_preemptions
        engine.step()
        if seq.num_preemptions > preemptions:
            entries_when_preempted.append(entries)
    assert entries_when_preempted and 0 < min(entries_when_preempted) < len(PROMPT) - 1
    assert [None, *seq.prompt_logprobs] == llm.generate(PROMPT, params)[0].prompt_logprobs

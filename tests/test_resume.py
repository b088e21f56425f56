"""Recomputing a request's KV gives the same continuation as keeping it, on the real engine.

Two paths recompute: preemption (the scheduler frees a running request's blocks and prefills it again later) and
migration (a decode pod that went away; another one is handed the prompt and the tokens already sent as
``resume_token_ids``). Either way greedy and seeded requests must continue exactly as an undisturbed run, with
penalties and ``max_tokens`` counting the earlier tokens as output.
"""

from __future__ import annotations

import re

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.sampling.params import StructuredOutput

PROMPTS = [list(range(5, 5 + n)) for n in (7, 23, 40)]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=12, presence_penalty=0.8, frequency_penalty=0.4, max_tokens=24,
                   ignore_eos=True),
]


def run_to_end(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams, resume=()) -> list[int]:
    engine = llm.engine
    seq = engine.add_request(request_id, prompt, params, resume_token_ids=list(resume))
    while not seq.is_finished:
        engine.step()
    return seq.output_token_ids


@pytest.fixture(scope="module")
def tiny():
    return LLM(model="tiny-random", num_blocks=256)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded", "seeded-penalties"])
@pytest.mark.parametrize("split", [1, 9, 23])
def test_a_resumed_request_continues_exactly_as_an_undisturbed_one(tiny, params, split):
    for index, prompt in enumerate(PROMPTS):
        whole = run_to_end(tiny, f"whole-{index}", prompt, params)
        resumed = run_to_end(tiny, f"resumed-{index}-{split}", prompt, params, resume=whole[:split])
        assert resumed == whole  # the earlier tokens, then the same continuation
    assert tiny.engine.block_manager.num_free_blocks == 256


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
def test_recomputed_outputs_give_the_undisturbed_runs_logprobs_bit_for_bit(cache_dtype):
    """Equal tokens could hide a KV that differs in its last bits (a prefill sums in another order than a decode
    step) until a near tie flips a later token; the recomputed outputs run as decode rows, so every logprob after
    the resume is the undisturbed one exactly."""
    llm = LLM(model="tiny-random", num_blocks=256, cache_dtype=cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    engine = llm.engine
    whole = engine.add_request("whole", PROMPTS[2], params)
    while not whole.is_finished:
        engine.step()
    for split in (1, 17, 39):
        resumed = engine.add_request(f"resumed-{split}", PROMPTS[2], params,
                                     resume_token_ids=whole.output_token_ids[:split])
        while not resumed.is_finished:
            engine.step()
        assert resumed.output_token_ids == whole.output_token_ids
        assert resumed.output_logprobs[-(40 - split):] == whole.output_logprobs[split:]


@pytest.mark.parametrize("cache_dtype", ["float16", "int8"])
@pytest.mark.parametrize("chunk", [39, 16, 1])
def test_a_prompt_prefilled_in_chunks_gives_the_same_bits_as_in_one(chunk, cache_dtype):
    """A chunk of a single prompt token is still summed as a prefill (not as a decode step), so a prompt's KV and the
    answer's logprobs do not depend on where the chunks fell: a migrated request prefilled in other chunks than the
    first time continues exactly."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    pool = dict(num_blocks=64, enable_prefix_caching=False, cache_dtype=cache_dtype)
    whole = LLM(model="tiny-random", **pool).generate([PROMPTS[2]], params)
    chunked = LLM(model="tiny-random", **pool, max_num_batched_tokens=chunk,
                  long_prefill_token_threshold=chunk).generate([PROMPTS[2]], params)
    assert chunked[0].token_ids == whole[0].token_ids
    assert chunked[0].logprobs == whole[0].logprobs


def test_a_resumed_request_that_already_reached_max_tokens_finishes_at_once(tiny):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    whole = run_to_end(tiny, "five", PROMPTS[0], params)
    seq = tiny.engine.add_request("five-again", PROMPTS[0], params, resume_token_ids=whole)
    assert seq.is_finished and seq.finish_reason == "length" and seq.output_token_ids == whole
    assert not tiny.engine.has_unfinished_requests()


def test_resume_token_ids_are_validated(tiny):
    with pytest.raises(ValueError, match=r"resume_token_ids token ids must be integers in \[0, 259\)"):
        tiny.engine.add_request("bad", PROMPTS[0], SamplingParams(), resume_token_ids=[3, 10**6])


def generate_counting_preemptions(llm: LLM, prompts, params):
    """``llm.generate(prompts, params)``, and how many preemptions its steps made."""
    preempted = []
    step = llm.engine.step

    def counting_step():
        updated = step()
        preempted.append(llm.engine.last_step.num_preempted if llm.engine.last_step else 0)
        return updated

    llm.engine.step = counting_step
    try:
        return llm.generate(prompts, params), sum(preempted)
    finally:
        del llm.engine.step  # the class's step again


@pytest.mark.parametrize("cache_dtype", ["float16", "int8"])
def test_preemption_by_recompute_gives_the_same_tokens_as_a_roomy_pool(cache_dtype):
    """Eight requests that outgrow a 20-block pool: the scheduler preempts and recomputes some of them."""
    prompts = [list(range(3 + i, 40 + i)) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(8)]
    tight = LLM(model="tiny-random", num_blocks=20, block_size=16, cache_dtype=cache_dtype)
    roomy = LLM(model="tiny-random", num_blocks=512, block_size=16, cache_dtype=cache_dtype)
    squeezed, num_preempted = generate_counting_preemptions(tight, prompts, params)
    assert num_preempted > 0, "the pool was not tight enough to preempt"
    assert [out.token_ids for out in squeezed] == [out.token_ids for out in roomy.generate(prompts, params)]
    assert tight.engine.block_manager.num_free_blocks == 20


@pytest.mark.model
def test_smollm2_greedy_continues_identically_after_a_resume(smollm2):
    prompt = smollm2.tokenizer.encode("The three most important ideas in computer science are")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    whole = run_to_end(smollm2, "smol-whole", prompt, params)
    for split in (1, 8, 20):
        assert run_to_end(smollm2, f"smol-resumed-{split}", prompt, params, resume=whole[:split]) == whole


@pytest.mark.parametrize("split", [1, 4, 9])
def test_a_resumed_guided_request_rebuilds_its_grammar_from_the_replayed_tokens(tiny, split):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=24,
                            structured_output=StructuredOutput(regex="[a-f]{3,6}-[0-9]{2,8}x"))
    whole = run_to_end(tiny, f"guided-whole-{split}", PROMPTS[1], params)
    text = tiny.tokenizer.decode(whole)
    assert re.fullmatch("[a-f]{3,6}-[0-9]{2,8}x", text), text
    resumed = run_to_end(tiny, f"guided-resumed-{split}", PROMPTS[1], params, resume=whole[:split])
    assert resumed == whole  # the grammar state after the replayed tokens is the undisturbed one

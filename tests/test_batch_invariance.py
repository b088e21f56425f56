"""A request's output does not depend on what it is batched with.

Greedy and seeded requests give identical tokens alone and inside a batch of 16 requests of mixed lengths,
with chunked prefill (small token budget) and with prefix-cache hits (prompts sharing long prefixes).
"""

from __future__ import annotations

import random

import pytest

from splitserve.engine import LLM, SamplingParams


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # a 40-token prefix: 2 full blocks of 16 are shared
    prompts = []
    for i in range(16):
        length = rng.choice([3, 9, 17, 33, 70, 130])
        tail = [rng.randrange(3, vocab) for _ in range(length)]
        prompts.append(shared + tail if i % 3 == 0 else tail)
    return prompts


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.9, seed=1000 + i, max_tokens=12 + i, ignore_eos=True)


@pytest.fixture(scope="module", params=["float32", "bfloat16", "int8"])
def batched_llm(request):
    # A token budget of 64 chunks every prompt longer than that; 48 chunks the 64-token steps further. The KV
    # cache in float32 (the default), in a 16-bit dtype and in int8 rows, which the native kernels also attend over.
    return LLM(model="tiny-random", num_blocks=512, max_num_batched_tokens=64, long_prefill_token_threshold=48,
               cache_dtype=request.param)


def test_outputs_identical_alone_and_in_a_batch_of_16(batched_llm):
    prompts = _prompts(batched_llm.engine.model_config.vocab_size)
    params = [_params(i) for i in range(len(prompts))]
    batched = batched_llm.generate(prompts, params)
    assert batched_llm.engine.block_manager.prefix_hits > 0  # the shared prefixes were served from the cache

    cache_dtype = batched_llm.engine.config.cache.cache_dtype
    alone_llm = LLM(model="tiny-random", num_blocks=512, enable_prefix_caching=False, cache_dtype=cache_dtype)
    for prompt, p, together in zip(prompts, params, batched):
        alone = alone_llm.generate(prompt, p)[0]
        assert together.token_ids == alone.token_ids
        assert len(alone.token_ids) == p.max_tokens
    assert alone_llm.engine.block_manager.num_free_blocks == 512
    assert batched_llm.engine.block_manager.num_free_blocks == 512


def test_seeded_request_repeats_and_differs_by_seed(batched_llm):
    prompt = list(range(10, 40))
    a = batched_llm.generate(prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True))[0]
    b = batched_llm.generate(prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True))[0]
    c = batched_llm.generate(prompt, SamplingParams(temperature=1.0, seed=6, max_tokens=16, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_priorities_change_the_order_requests_start_in_not_their_answers():
    """Two request slots for six requests: given priorities (vLLM's ``LLM.generate(..., priority=)``, lower first),
    they start in priority order, first come first served among equals, and each answer is what it is without
    priorities."""
    llm = LLM(model="tiny-random", num_blocks=512, max_num_seqs=2)
    prompts = _prompts(llm.tokenizer.vocab_size)[:6]
    params = [_params(i) for i in range(6)]
    plain = llm.generate(prompts, params)
    prioritized = llm.generate(prompts, params, priority=[3, 1, 2, 1, 0, 3])
    assert [o.token_ids for o in prioritized] == [o.token_ids for o in plain]
    started = sorted(range(6), key=lambda i: prioritized[i].metrics["first_scheduled_time"])
    assert started == [4, 1, 3, 2, 0, 5]
    with pytest.raises(ValueError, match="got 2 priorities for 6 prompts"):
        llm.generate(prompts, params, priority=[0, 1])

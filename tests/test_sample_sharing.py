"""The n samples of one prompt on a decode pod: the prefill samples every sample's first token from the prompt's one
set of logits (sample i seeded seed + i), and the decode side forks one sequence per sample off the prompt's KV,
which arrived once: the samples share its full blocks and each copies the last, partly filled one. Checked on the
tiny random model the way the pods do it (prefill engine -> KV read out -> reserved and written on a decode engine
-> forks admitted with their first tokens): each sample equals a separate request seeded seed + i, the pool holds
fewer blocks than separate requests would, and every block is free at the end."""

from __future__ import annotations

import dataclasses
import math

import pytest

from splitserve.engine import LLM
from splitserve.engine.sampling.params import SamplingParams

PROMPT = [5 + (7 * k) % 200 for k in range(40)]  # two full 16-token blocks and 8 tokens of a third
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def prefill() -> LLM:
    """The prefill side, and the reference: separate requests run offline."""
    return LLM(model="tiny-random", num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def decode() -> LLM:
    return LLM(model="tiny-random", num_blocks=NUM_BLOCKS)


def prefill_once(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], dict]:
    """Every sample's first token and the prompt's KV, from one prefill of ``params.n`` samples."""
    engine = llm.engine
    seq = engine.add_request(f"p{len(prompt)}", prompt, dataclasses.replace(params, max_tokens=2))
    engine.step()  # the whole prompt: the first tokens are out, the blocks still held
    first_tokens = seq.output_token_ids[:1] + [token for token, _ in seq.sample_first_tokens]
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, len(prompt))
    kv = {(layer, kind): cache.read(layer, kind, slots) for layer in range(cache.num_layers) for kind in "kv"}
    engine.abort_request(seq.request_id)
    return first_tokens, kv


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:32]], ids=["partial-last-block", "full-blocks-only"])
def test_forked_samples_equal_separate_seeded_requests_and_share_the_prompts_blocks(prefill, decode, prompt):
    n, params = 3, SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    first_tokens, kv = prefill_once(prefill, prompt, dataclasses.replace(params, n=n))
    decode = decode.engine
    pool = decode.block_manager
    lease = decode.reserve_for_transfer("kv", prompt, params)
    cache = decode.runner.kv_cache
    slots = cache.slots(lease.block_table, 0, len(prompt))
    for (layer, kind), values in kv.items():
        cache.write(layer, kind, slots, values)
    samples = [decode.admit_prefilled(decode.fork_prefilled(lease, f"s{len(prompt)}-{i}", params.for_sample(i)),
                                      first_tokens[i]) for i in range(n)]
    decode.release_transfer(lease)
    partial = len(prompt) % 16 != 0
    assert NUM_BLOCKS - pool.num_free_blocks == len(prompt) // 16 + (n if partial else 0)
    most_used = 0
    while decode.has_unfinished_requests():
        decode.step()
        most_used = max(most_used, NUM_BLOCKS - pool.num_free_blocks)
    separately = n * math.ceil((len(prompt) + params.max_tokens) / 16)
    assert most_used <= separately - (n - 1) * (len(prompt) // 16) < separately  # the prompt's full blocks once
    assert pool.num_free_blocks == NUM_BLOCKS
    expected = [prefill.generate(prompt, params.for_sample(i))[0].token_ids for i in range(n)]
    assert [seq.output_token_ids for seq in samples] == expected
    assert len({tuple(tokens) for tokens in expected}) == n  # the samples differ: sharing kept them apart


def test_a_fork_with_no_block_for_its_copy_changes_nothing():
    decode = LLM(model="tiny-random", num_blocks=3).engine
    lease = decode.reserve_for_transfer("kv", PROMPT, SamplingParams())  # takes all 3 blocks
    assert decode.fork_prefilled(lease, "s0", SamplingParams()) is None
    assert [decode.block_manager.blocks[b].ref_count for b in lease.block_table] == [1, 1, 1]
    decode.release_transfer(lease)
    assert decode.block_manager.num_free_blocks == 3

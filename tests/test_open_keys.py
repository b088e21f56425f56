"""A scaled pool's open blocks (engine/kv_formats/open_keys.py): each query reads its own block's keys in float16,
every older key as the pool stores it, on every attention path, whatever its chunk or batch."""

import pytest
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import ModelConfig, SchedulerConfig
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.kv_formats import open_keys
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.model.attention import AttentionMetadata, paged_attention
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence
from splitserve.engine.weights.parameter_layout import random_state_dict
from tests.test_speculative import _llms, _prompts

BLOCK = 16


def _pool(num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = kv_rows.row_width(torch.int8, head_dim)
    return tuple(torch.zeros(num_blocks, BLOCK, num_kv_heads, width, dtype=torch.int8) for _ in range(2))


def test_open_keys_round_trip_through_both_halves_of_a_block():
    k_pool, v_pool = _pool(6, 3, 64)
    keys = torch.randn(BLOCK, 3, 64)
    open_keys.write(k_pool, v_pool, torch.full((BLOCK,), 4), torch.arange(32, 32 + BLOCK), keys)
    assert torch.equal(open_keys.read(k_pool, v_pool, torch.tensor([4]))[0], keys.half())
    assert k_pool[:4].eq(0).all() and v_pool[5].eq(0).all()  # no other block touched


def test_the_plan_reads_earlier_steps_keys_from_the_open_block_and_the_steps_own_from_its_new_keys():
    # One sequence: a prefill segment of positions 20..35 (the block of 16..31 started by an earlier step), then two
    # decode rows of positions 36 and 37 (verified drafts): source rows 0..15 are the open block's, 16.. the step's.
    plan = open_keys.OwnKeyPlan.build([16, 1, 1], [36, 37, 38], [7, 7, 7], [1, 2], [0], BLOCK, "cpu")
    assert plan.read_blocks.tolist() == [7]
    assert plan.segment_index[0].tolist() == [0, 1, 2, 3] + list(range(16, 32))  # positions 16..19, then 20..35
    assert plan.decode_index[0].tolist() == [28, 29, 30, 31, 32] + [32] * 11  # positions 32..36, then 36 repeated
    assert plan.decode_index[1].tolist()[:6] == [28, 29, 30, 31, 32, 33]
    # Left in the open block: the keys of the block of its last position (32..37), from the step's rows 12..17.
    assert plan.write_positions.tolist() == list(range(32, 38)) and plan.write_rows.tolist() == list(range(12, 18))
    assert plan.write_blocks.tolist() == [7] * 6


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (7, 1, 40)])
def test_native_attention_reads_own_blocks_as_pytorch_does_and_the_same_bits_in_chunks(num_heads, num_kv_heads,
                                                                                       head_dim, native_kernels):
    # A 150-token prompt attended in one prefill, and in chunks of 37 (each chunk's first rows reading the keys of
    # their block that earlier chunks left in the open block), then two decode steps: the native kernels within
    # 1e-5 of the PyTorch path, the chunked run the same bits as the whole one on each.
    gen = torch.Generator().manual_seed(5)
    n, table, scale = 150, list(range(1, 12)), head_dim**-0.5
    q, k_new, v_new = (torch.randn(n + 2, h, head_dim, generator=gen) for h in (num_heads, num_kv_heads,
                                                                                  num_kv_heads))

    def run(chunks: list[tuple[int, int]], kernels) -> torch.Tensor:
        pools = _pool(13, num_kv_heads, head_dim)
        outs = []
        for lo, hi in chunks + [(n, n + 1), (n + 1, n + 2)]:
            meta = AttentionMetadata.build([hi - lo], [hi], [table], BLOCK, open_blocks=[12],
                                           one_row_prefills=frozenset([0]) if hi - lo == 1 and hi <= n else
                                           frozenset())
            rows = slice(lo, hi)
            outs.append(paged_attention(q[rows], k_new[rows], v_new[rows], *pools, meta, scale, kernels))
        return torch.cat(outs)

    whole = run([(0, n)], native_kernels)
    chunked = run([(lo, min(n, lo + 37)) for lo in range(0, n, 37)], native_kernels)
    assert torch.equal(whole, chunked)
    assert (whole - run([(0, n)], None)).abs().max().item() <= 1e-5
    assert (chunked - run([(lo, min(n, lo + 37)) for lo in range(0, n, 37)], None)).abs().max().item() <= 1e-5


def test_own_block_keys_are_what_the_int8_rows_lose_least_on():
    # The own block's keys are read as float16, not as the pool's rows: the decode output differs from the one
    # that reads every key from the int8 rows, and is closer to attention over float16 keys.
    gen = torch.Generator().manual_seed(9)
    num_heads, num_kv_heads, head_dim, n = 9, 3, 64, 40
    q, k_new, v_new = (torch.randn(n, h, head_dim, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads))
    pools = _pool(5, num_kv_heads, head_dim)
    meta = AttentionMetadata.build([n], [n], [[0, 1, 2]], BLOCK, open_blocks=[4])
    with_open = paged_attention(q, k_new, v_new, *pools, meta, 0.125)
    plain = paged_attention(q, k_new, v_new, *pools, AttentionMetadata.build([n], [n], [[0, 1, 2]], BLOCK), 0.125)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k_new.half().float().repeat_interleave(3, 1).transpose(0, 1),
        kv_rows.load(kv_rows.store(v_new, torch.int8)).repeat_interleave(3, 1).transpose(0, 1), is_causal=True,
        scale=0.125).transpose(0, 1)
    assert not torch.equal(with_open, plain)
    assert (with_open - exact).abs().max() < (plain - exact).abs().max()


def test_a_decode_step_in_one_native_call_reads_and_leaves_the_open_blocks_as_layer_by_layer(native_kernels):
    # Two prompts over an int8 pool (one ending mid-block, one at a block's end), then decode steps: all layers in
    # one native call and layer by layer (a layer_done hook) give the same bits and leave the same pools, open
    # blocks included.
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM.from_state_dict(config, random_state_dict(config, seed=3), cpu_kernels=True)
    tables, opens, lens = [[1, 2], [3, 4, 5]], [6, 7], [21, 32]
    outs, pools = [], []
    for hook in (None, lambda layer: None):
        cache = PagedKVCache(config, 8, BLOCK, torch.int8)
        with torch.inference_mode():
            meta = AttentionMetadata.build(lens, lens, tables, BLOCK, open_blocks=opens)
            model(torch.arange(sum(lens)) % 64, torch.cat([torch.arange(n) for n in lens]), cache, meta)
            for step in range(3):
                meta = AttentionMetadata.build([1, 1], [n + step + 1 for n in lens], tables, BLOCK, open_blocks=opens)
                assert model._decodes_natively(cache, meta)
                positions = torch.tensor([n + step for n in lens])
                outs.append(model(positions % 64, positions, cache, meta, layer_done=hook))
        pools.append(cache.k_blocks + cache.v_blocks)
    assert all(torch.equal(a, b) for a, b in zip(outs[:3], outs[3:]))
    assert all(torch.equal(a, b) for a, b in zip(*pools))
    assert not pools[0][0][7].eq(0).all()  # the second sequence's open block holds its new block's keys


def test_each_sequence_holds_an_open_block_that_admission_counts_and_freeing_returns():
    manager = BlockManager(4, BLOCK, open_blocks=True)
    seq = Sequence("a", list(range(40)), SamplingParams())
    assert not manager.allocate_slots(seq, 64)  # 4 blocks of tokens and the open block: one more than the pool has
    assert manager.allocate_slots(seq, 40) and len(seq.block_table) == 3 and seq.open_block == 3
    assert manager.num_free_blocks == 0
    child = Sequence("b", list(range(40)), SamplingParams())
    assert manager.fork(seq, child) is None  # no room for its copies
    manager.free(seq)
    assert seq.open_block == -1 and manager.num_free_blocks == 4


def test_a_pushed_prompt_computes_its_last_partial_block_again():
    manager = BlockManager(16, BLOCK, open_blocks=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4), manager, [0], 512)
    seq = Sequence("a", list(range(1, 38)), SamplingParams(max_tokens=20))  # 37 prompt tokens: 5 in the last block
    assert scheduler.reserve_transfer(seq)
    seq.num_computed_tokens = seq.num_prompt_tokens
    seq.append_token(7)
    scheduler.add_prefilled(seq)
    assert seq.num_computed_tokens == 32  # the open block's float16 keys were not pushed: tokens 32..36 again
    step = scheduler.schedule()
    assert [(s.start, s.num_new_tokens) for s in step.scheduled] == [(32, 6)]


def test_drafts_rejected_back_into_an_earlier_block_compute_its_tokens_again():
    # A step over positions 30..34 (drafts at 31..34) crosses into the block of 32..47; all rejected, the next
    # query (position 31) reads the keys of 16..30, which the step's open-block write replaced with 32..34's: they
    # are computed again.
    manager = BlockManager(16, BLOCK, open_blocks=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4), manager, [0], 512)
    seq = Sequence("a", list(range(1, 31)), SamplingParams(max_tokens=20))
    scheduler.add(seq)
    scheduler.update_from_output(scheduler.schedule(), {"a": [(9, None)]})
    assert seq.num_computed_tokens == 30
    seq.draft_token_ids = [5, 6, 7, 8]
    step = scheduler.schedule()
    assert [(s.start, s.num_new_tokens) for s in step.scheduled] == [(30, 5)]
    scheduler.update_from_output(step, {"a": [(4, None)]})  # the first draft rejected: one token, at position 31
    assert seq.num_computed_tokens == 16 and seq.num_tokens == 32


def test_speculation_over_an_int8_pool_answers_as_without_it():
    # Verified drafts are decode rows of one sequence in one step: each reads its own block's keys from the step's
    # new keys and the open block; greedy answers are the plain engine's, and every block comes back.
    plain, spec = _llms(cpu_kernels=True, cache_dtype="int8")
    prompts = _prompts(plain.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    before = spec.engine.spec_decode.num_draft_tokens, spec.engine.spec_decode.num_accepted_tokens
    assert [o.token_ids for o in spec.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    drafted = spec.engine.spec_decode.num_draft_tokens - before[0]
    assert 0 < spec.engine.spec_decode.num_accepted_tokens - before[1] < drafted
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks

"""BlockManager with a fake pool (block_size 4): exact block ids, reference counts, prefix hits and evictions."""

import subprocess
import sys
from pathlib import Path

import pytest

import splitserve.engine.block_manager as block_manager_module
from splitserve.engine.block_manager import (
    NULL_BLOCK,
    BlockManager,
    chained_block_hashes,
    hash_block_tokens,
    window_start,
)
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(request_id: str, prompt: list[int]) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=16))


def compute(manager: BlockManager, seq: Sequence, num_new_tokens: int, computed_blocks=None, num_cached=0) -> None:
    """What the scheduler and the model do in one step: allocate, compute the tokens, publish full blocks."""
    assert manager.allocate_slots(seq, num_new_tokens, computed_blocks)
    seq.num_computed_tokens += num_cached + num_new_tokens
    manager.cache_full_blocks(seq, seq.num_computed_tokens)


def ref_counts(manager: BlockManager) -> list[int]:
    return [block.ref_count for block in manager.blocks]


def assert_all_free(manager: BlockManager) -> None:
    assert ref_counts(manager) == [0] * manager.num_blocks
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.usage == 0.0


def test_allocate_prompt_then_free():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    seq = make_seq("a", list(range(1, 11)))  # 10 tokens: 2 full blocks + 2 tokens

    assert manager.allocate_slots(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert ref_counts(manager) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert manager.num_free_blocks == 5
    assert manager.usage == 3 / 8

    seq.num_computed_tokens = 10
    manager.cache_full_blocks(seq, 10)
    assert manager.block_hashes_of(seq) == chained_block_hashes(list(range(1, 9)), BLOCK_SIZE)
    assert [block.block_hash is not None for block in manager.blocks[:3]] == [True, True, False]
    assert manager.blocks[1].token_ids == (5, 6, 7, 8)

    manager.free(seq)
    assert seq.block_table == []
    assert manager.block_hashes_of(seq) == []
    assert_all_free(manager)


def test_decode_appends_a_block_only_when_crossing_a_boundary():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    seq = make_seq("a", list(range(1, 9)))  # exactly 2 blocks
    compute(manager, seq, 8)
    assert seq.block_table == [0, 1]

    seq.append_token(100)  # token 9 needs a third block
    compute(manager, seq, 1)
    assert seq.block_table == [0, 1, 2]
    for token in (101, 102, 103):  # tokens 10..12 fill block 2
        seq.append_token(token)
        compute(manager, seq, 1)
    assert seq.block_table == [0, 1, 2]
    assert manager.blocks[2].token_ids == (100, 101, 102, 103)
    assert len(manager.block_hashes_of(seq)) == 3

    seq.append_token(104)  # token 13 opens block 3
    compute(manager, seq, 1)
    assert seq.block_table == [0, 1, 2, 3]
    assert ref_counts(manager) == [1, 1, 1, 1, 0, 0, 0, 0]

    manager.free(seq)
    assert_all_free(manager)


def test_prefix_hit_shares_blocks_and_counts_references():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_seq("a", list(range(1, 11)))
    compute(manager, first, 10)
    second = make_seq("b", list(range(1, 9)) + [99, 98, 97])

    computed_blocks, num_cached = manager.get_computed_blocks(second)
    assert (computed_blocks, num_cached) == ([0, 1], 8)
    assert (manager.prefix_queries, manager.prefix_hits) == (11, 8)
    compute(manager, second, 3, computed_blocks, num_cached)
    assert second.block_table == [0, 1, 3]
    assert second.num_computed_tokens == 11
    assert ref_counts(manager) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert manager.block_hashes_of(second) == manager.block_hashes_of(first)[:2]

    manager.free(first)
    assert ref_counts(manager) == [1, 1, 0, 1, 0, 0, 0, 0]
    manager.free(second)
    assert_all_free(manager)


def test_whole_cached_prompt_leaves_its_last_block_to_compute():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_seq("a", list(range(1, 9)))
    compute(manager, first, 8)
    # All 8 tokens are cached, but the step must compute at least the last one to get logits.
    assert manager.get_computed_blocks(make_seq("b", list(range(1, 9)))) == ([0], 4)
    assert manager.get_computed_blocks(make_seq("c", list(range(1, 10)))) == ([0, 1], 8)
    manager.free(first)
    assert_all_free(manager)


def test_hashes_are_chained_to_the_parent_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(manager, first, 9)
    # Same tokens as block 1 of "a", under another parent, or as the first block: both misses.
    assert manager.get_computed_blocks(make_seq("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == ([], 0)
    assert manager.get_computed_blocks(make_seq("c", [5, 6, 7, 8, 9])) == ([], 0)
    assert manager.get_computed_blocks(make_seq("d", [1, 2, 3, 4, 0, 6, 7, 8, 9])) == ([0], 4)
    manager.free(first)
    assert_all_free(manager)


def test_hash_collision_is_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent_hash, token_ids: 42)
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_seq("a", [1, 2, 3, 4, 5])
    compute(manager, first, 5)
    assert manager.blocks[0].block_hash == 42

    second = make_seq("b", [7, 7, 7, 7, 5])
    assert manager.get_computed_blocks(second) == ([], 0)
    compute(manager, second, 5)
    assert second.block_table == [2, 3]
    assert manager.blocks[2].block_hash is None  # the hash stays with block 0: block 2 is private

    manager.free(second)
    manager.free(first)
    assert_all_free(manager)
    assert manager.get_computed_blocks(make_seq("c", [1, 2, 3, 4, 5])) == ([0], 4)


def test_eviction_takes_hashless_blocks_first_then_least_recently_freed():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_seq("a", list(range(1, 10)))  # blocks 0, 1 full and cached; block 2 partial
    compute(manager, first, 9)
    manager.free(first)  # tail first: 2 -> hash-less free list, then 1, then 0 -> evictable
    assert_all_free(manager)

    other = make_seq("b", list(range(50, 62)))
    assert manager.allocate_slots(other, 12)
    assert other.block_table == [3, 2, 1]  # hash-less 3 and 2, then the LRU cached block 1
    assert manager.blocks[1].block_hash is None
    assert manager.get_computed_blocks(make_seq("c", list(range(1, 10)))) == ([0], 4)

    last = make_seq("d", [70, 71, 72])
    assert manager.allocate_slots(last, 3)
    assert last.block_table == [0]
    assert manager.get_computed_blocks(make_seq("e", list(range(1, 10)))) == ([], 0)
    assert manager.allocate_slots(last, 5) is False  # a second block: the pool is exhausted
    assert last.block_table == [0]

    manager.free(other)
    manager.free(last)
    assert_all_free(manager)


def test_evictable_cached_block_is_revived_by_a_prefix_hit():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_seq("a", list(range(1, 10)))
    compute(manager, first, 9)
    manager.free(first)

    second = make_seq("b", list(range(1, 9)) + [50, 51])
    computed_blocks, num_cached = manager.get_computed_blocks(second)
    assert (computed_blocks, num_cached) == ([0, 1], 8)
    compute(manager, second, 2, computed_blocks, num_cached)
    assert second.block_table == [0, 1, 3]
    assert ref_counts(manager) == [1, 1, 0, 1]
    assert manager.num_free_blocks == 1

    manager.free(second)
    assert_all_free(manager)


def test_failed_allocation_changes_nothing():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_seq("a", list(range(1, 10)))
    compute(manager, first, 9)
    manager.free(first)  # 2 hash-less free blocks + 2 evictable cached blocks

    # 17 tokens: the 2 cached blocks + 3 new ones. 4 blocks look free, but reviving the 2 cached
    # blocks takes them out of that room, leaving 2 for the 3 new blocks.
    second = make_seq("b", list(range(1, 9)) + list(range(50, 59)))
    computed_blocks, num_cached = manager.get_computed_blocks(second)
    assert (computed_blocks, num_cached) == ([0, 1], 8)
    assert manager.allocate_slots(second, 9, computed_blocks) is False
    assert second.block_table == []
    assert manager.block_hashes_of(second) == []
    assert_all_free(manager)
    assert manager.get_computed_blocks(make_seq("c", list(range(1, 10)))) == ([0, 1], 8)

    # One token fewer fits exactly: 2 revived + 2 new.
    third = make_seq("d", list(range(1, 9)) + list(range(50, 58)))
    computed_blocks, num_cached = manager.get_computed_blocks(third)
    compute(manager, third, 8, computed_blocks, num_cached)
    assert third.block_table == [0, 1, 3, 2]
    assert manager.num_free_blocks == 0
    assert manager.allocate_slots(third, 1) is False
    assert third.block_table == [0, 1, 3, 2]

    manager.free(third)
    assert_all_free(manager)


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    seq = make_seq("a", list(range(1, 10)))
    compute(manager, seq, 9)
    assert manager.reset_prefix_cache() is False
    manager.free(seq)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_seq("b", list(range(1, 10)))) == ([], 0)
    assert all(block.block_hash is None for block in manager.blocks)
    assert_all_free(manager)


def test_prefix_caching_disabled_never_hits():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    seq = make_seq("a", list(range(1, 10)))
    compute(manager, seq, 9)
    assert manager.block_hashes_of(seq) == []
    manager.free(seq)
    assert manager.get_computed_blocks(make_seq("b", list(range(1, 10)))) == ([], 0)
    assert (manager.prefix_queries, manager.prefix_hits) == (0, 0)
    assert all(block.block_hash is None for block in manager.blocks)
    assert_all_free(manager)


def test_block_hashes_are_fixed_values():
    # Pods and the router compare these across processes and versions: the values must never drift.
    assert hash_block_tokens(0, (1, 2, 3, 4)) == 0x2728AB4454AAA05B
    assert chained_block_hashes(list(range(1, 10)), BLOCK_SIZE) == [0x2728AB4454AAA05B, 0x3C2AAA5BB816C738]


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_block_hashes_agree_across_processes(hash_seed):
    code = ("from splitserve.engine.block_manager import chained_block_hashes; "
            "print(chained_block_hashes(list(range(1, 10)), 4))")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env={"PYTHONHASHSEED": hash_seed},
    )
    assert result.stdout.strip() == str(chained_block_hashes(list(range(1, 10)), BLOCK_SIZE))


# ---- a model whose every layer has a sliding window: blocks that left it are freed ---------------------------------

WINDOW = 6  # a query at position p reads keys p - 5 .. p: blocks of 4 before the one holding p - 5 are never read


def windowed(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, window=WINDOW)


def assert_holds_the_window(seq: Sequence) -> None:
    """Every block before the one holding the oldest key of the step's query (the last computed token) is
    NULL_BLOCK, every one from it held."""
    first = max(seq.num_computed_tokens - WINDOW, 0) // BLOCK_SIZE
    assert all(block_id == NULL_BLOCK for block_id in seq.block_table[:first]), seq.block_table
    assert all(block_id != NULL_BLOCK for block_id in seq.block_table[first:]), seq.block_table


def test_a_decoding_sequence_frees_each_block_as_it_leaves_the_window():
    manager = windowed()
    seq = make_seq("a", list(range(1, 11)))
    compute(manager, seq, 10)  # the prompt's queries read from token 0: all three blocks
    assert seq.block_table == [0, 1, 2]
    held = []
    for token in range(100, 130):  # 30 more tokens: 10 blocks' worth through a pool of 8
        seq.append_token(token)
        compute(manager, seq, 1)
        assert_holds_the_window(seq)
        held.append(manager.num_held_blocks(seq))
    assert max(held) == (WINDOW - 1) // BLOCK_SIZE + 2 and len(seq.block_table) == 10
    assert manager.num_free_blocks == 8 - held[-1]
    # The blocks that left are in the prefix cache (evictable), their hashes still chained in the sequence's.
    assert manager.block_hashes_of(seq) == chained_block_hashes(seq.token_ids[:40], BLOCK_SIZE)
    manager.free(seq)
    assert_all_free(manager)


def test_a_prefix_hit_under_a_window_needs_only_the_window_before_its_end():
    manager = windowed()
    first = make_seq("a", list(range(1, 17)) + [50])
    compute(manager, first, 17)
    manager.free(first)  # blocks 0-3 cached; then block 0 evicted (the others not)
    manager._uncache(manager.blocks[0])
    second = make_seq("b", list(range(1, 17)) + [60, 61])
    computed_blocks, num_cached = manager.get_computed_blocks(second)
    # 16 tokens: the query at 16 reads from token 11, in block 2; blocks 0 and 1 are not needed (0 is gone).
    assert (computed_blocks, num_cached) == ([NULL_BLOCK, NULL_BLOCK, 2, 3], 16)
    compute(manager, second, 2, computed_blocks, num_cached)
    assert second.block_table[:4] == [NULL_BLOCK, NULL_BLOCK, 2, 3] and manager.num_held_blocks(second) == 3
    assert manager.block_hashes_of(second) == chained_block_hashes(second.token_ids[:16], BLOCK_SIZE)
    manager.free(second)
    # A sequence whose KV leaves for another pod (which may keep more of it) takes only a whole chain: none here.
    exported = make_seq("c", list(range(1, 17)) + [60, 61])
    exported.exported = True
    assert manager.get_computed_blocks(exported) == ([], 0)
    # Without a window the same cache holds no usable prefix: its first block is gone.
    full = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    compute(full, first := make_seq("a", list(range(1, 17)) + [50]), 17)
    full.free(first)
    full._uncache(full.blocks[0])
    assert full.get_computed_blocks(make_seq("b", list(range(1, 17)) + [60, 61])) == ([], 0)


def test_a_pushed_prompt_gets_blocks_from_its_window_start_and_publishes_only_those():
    manager = windowed()
    prompt = list(range(1, 19))  # 18 tokens; the queries from 16 (the last full block's end) read from 11
    assert window_start(len(prompt), WINDOW, BLOCK_SIZE) == 8  # block 2's first token
    seq = make_seq("pushed", prompt)
    assert manager.allocate_slots(seq, len(prompt), pushed=True)
    assert seq.block_table == [NULL_BLOCK, NULL_BLOCK, 0, 1, 2]
    holder = manager.hold(seq)  # (a prefill pod's hold, or samples sharing it) passes NULL_BLOCK by
    assert ref_counts(manager)[:3] == [2, 2, 2]
    manager.free(holder)
    seq.num_computed_tokens = len(prompt)
    manager.cache_and_free(seq)  # a split prefill's prefix: blocks 2 and 3 (full) enter the cache
    rest = make_seq("rest", prompt + [70, 71, 72])
    assert manager.get_computed_blocks(rest) == ([NULL_BLOCK, NULL_BLOCK, 0, 1], 16)
    assert_all_free(manager)


@pytest.mark.parametrize("num_tokens, window, block_size, start", [
    (18, 6, 4, 8), (16, 6, 4, 8), (15, 6, 4, 4), (5, 6, 4, 0), (150, 40, 16, 96), (150, None, 16, 0)])
def test_window_start_is_the_first_block_the_last_full_blocks_queries_read(num_tokens, window, block_size, start):
    assert window_start(num_tokens, window, block_size) == start

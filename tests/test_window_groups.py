"""A model that mixes sliding-window layers with full-attention ones (Gemma 2 and 3) keeps its windowed layers' KV in
pools of their own (engine/kv_groups.py): a sequence holds its window there and its whole context in the full
layers' pool; a prefill pod pushes the windowed layers' window and the full layers' whole prompt, and the decode pod
keeps exactly that (asserted from both pools), with `transformers`' answer."""

from __future__ import annotations

import pytest

from splitserve.engine.block_manager import NULL_BLOCK, BlockManager, window_start
from splitserve.engine.kv_groups import GroupedBlockManager
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.v1 import common_pb2
from tests.test_model_gemma import SHAPES
from tests.test_pods import Pods
from tests.tiny_checkpoints import VOCAB, Checkpoint

WINDOW = 40  # Gemma 3's two local layers; its third is global
BLOCK = 16
PROMPT = [(41 * k + 3) % VOCAB for k in range(150)]
LAYER_TOKEN_BYTES = 2 * 1 * 256 * 4  # K/V x KV heads x head_dim x float32
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Checkpoint:
    return Checkpoint(tmp_path_factory.mktemp("gemma3-window"), SHAPES["gemma3_text"], "gemma3_text",
                      sliding_window=WINDOW)


def pools(engine) -> tuple[int, int]:
    """Blocks in use in the full layers' pool and in the window pool."""
    manager = engine.block_manager
    return (manager.full.num_blocks - manager.full.num_free_blocks,
            manager.windowed.num_blocks - manager.windowed.num_free_blocks)


def test_a_long_generation_holds_the_window_in_its_own_pool_and_answers_as_transformers(checkpoint):
    llm = checkpoint.llm(num_blocks=16, long_prefill_token_threshold=64)
    engine = llm.engine
    assert isinstance(engine.block_manager, GroupedBlockManager)
    assert engine.runner.kv_cache.window_layers == {0, 1} and engine.block_manager.windowed.window == WINDOW
    seq = engine.add_request("long", PROMPT, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    held = []  # (full, window) blocks after each step that leaves the sequence running
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished:
            held.append((len(seq.block_table), engine.block_manager.window_blocks_held(seq)))
    assert seq.output_token_ids == checkpoint.greedy(PROMPT, 32)
    # Prefill in chunks of 64, 64 and 22, then 30 decode steps that leave it running.
    assert len(held) == 3 + 30 and held[-1][0] == -(-(150 + 31) // BLOCK)
    assert max(window for _, window in held[3:]) == (WINDOW - 1) // BLOCK + 2
    assert pools(engine) == (0, 0)


def test_a_prefix_hit_takes_both_pools_blocks_and_gives_the_same_tokens(checkpoint):
    llm = checkpoint.llm(num_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([PROMPT], params)
    hits = llm.engine.block_manager.prefix_hits
    (second,) = llm.generate([PROMPT + [7, 8, 9]], params)
    assert llm.engine.block_manager.prefix_hits - hits == 144
    (alone,) = checkpoint.llm(num_blocks=32, enable_prefix_caching=False).generate([PROMPT + [7, 8, 9]], params)
    assert second.token_ids == alone.token_ids


@pytest.fixture(scope="module")
def pods(checkpoint):
    pods = Pods(str(checkpoint.directory), cache_dtype="float32", prefill_compute_dtype="float32")
    yield pods
    pods.close()


def test_the_decode_pod_keeps_the_window_of_the_windowed_layers_and_the_whole_prompt_of_the_global_one(
        pods, checkpoint):
    """The push carries the global layer's 150 tokens and the local layers' [96, 150); while the KV waits for its
    Decode call the decode pod holds 10 blocks in the full pool and 4 in the window pool, none more; the answer is
    transformers'."""
    assert window_start(len(PROMPT), WINDOW, BLOCK) == 96
    first = pods.run_prefill("gemma-window", PROMPT, GREEDY)
    assert first.kv_transfer.raw_bytes == (150 + 2 * (150 - 96)) * LAYER_TOKEN_BYTES
    assert pools(pods.decode_pod.engine) == (10, 4)
    tokens, _, _ = pods.run_decode("gemma-window", PROMPT, GREEDY, first)
    assert tokens == checkpoint.greedy(PROMPT, 16)
    assert tokens == pods.offline_tokens(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    pods.wait_all_free("decode")
    assert pools(pods.decode_pod.engine) == (0, 0) and pools(pods.prefill_pod.engine) == (0, 0)


def test_an_allocation_either_fits_both_pools_or_changes_neither():
    """A window pool with no room: the full pool's blocks are not taken either (pure logic, blocks of 4)."""
    manager = GroupedBlockManager(BlockManager(8, 4), BlockManager(2, 4, window=4, table="window_block_table"))
    seq = Sequence("a", list(range(1, 13)), SamplingParams())
    assert not manager.allocate_slots(seq, 12)  # 3 blocks in each pool; the window pool has 2
    assert (seq.block_table, seq.window_block_table, manager.num_free_blocks) == ([], [], 8)
    assert manager.allocate_slots(seq, 8)  # 2 and 2
    assert (seq.block_table, seq.window_block_table) == ([0, 1], [0, 1])
    seq.num_computed_tokens = 8
    assert manager.allocate_slots(seq, 4)  # the window pool frees block 0 (left the window) and takes it back
    assert (seq.block_table, seq.window_block_table) == ([0, 1, 2], [NULL_BLOCK, 1, 0])
    manager.free(seq)
    assert (manager.full.num_free_blocks, manager.windowed.num_free_blocks) == (8, 2)

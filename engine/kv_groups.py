"""``GroupedBlockManager``: the block pools of a model that mixes sliding-window layers with full-attention ones
(Gemma 2 and 3), behind ``BlockManager``'s interface.

Its windowed layers read no key older than their window, its full layers every key: one block table per sequence
cannot free the first without starving the second. So the windowed layers keep their K/V in pools of their own
(``PagedKVCache.window_layers``), addressed by each sequence's ``window_block_table`` and managed by a
``BlockManager`` with the window (its blocks freed as they leave it, engine/block_manager.py), while the full layers'
stay in ``block_table`` under a ``BlockManager`` without one. Every operation runs on both, as one:

- admission: a prefix-cache hit is the longest prefix both pools hold (the full pool's chain, then the window
  pool's window before its end, on the same tokens);
- ``allocate_slots`` plans both tables first and changes neither unless both fit;
- ``cache_full_blocks``, ``free``, ``cache_and_free``, ``hold`` and ``fork`` run on each, ``fork``'s copies named by
  their table.

The full pool is the capacity every figure reports (``num_blocks``, ``num_free_blocks``, the pod's load: what a
request holds grows with its context there); ``usage`` is the fuller of the two. The window pool's blocks a sequence
holds: ``window_blocks_held``.
"""

from __future__ import annotations

import math

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.kv_cache import WINDOW_TABLE
from splitserve.engine.kv_formats import open_keys
from splitserve.engine.sequence import Sequence


def window_group_blocks(config: EngineConfig, model: ModelConfig) -> int:
    """The blocks the window pool of ``model`` needs at most (0: no window pool): every sequence the scheduler may run
    holding its window, a step's chunk and the blocks they reach into. Only a model that mixes windowed and full
    layers, served by one process without a draft model, has one (the ranks' plans and the draft's catch-up address
    one table per sequence: a limit, docs/models.md)."""
    if model.widest_window is None or model.kv_window is not None or _drafts(config) \
            or config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        return 0
    sched = config.scheduler
    return sched.max_num_seqs * (math.ceil((model.widest_window + sched.chunk_tokens) / config.cache.block_size) + 2)


def pushed_window(manager: "BlockManager | GroupedBlockManager", cache) -> tuple[int, tuple[int, ...]]:
    """Under which window this engine keeps a pushed prompt's KV, and in which layers (``window_start``'s tokens
    on): every layer's under a ``BlockManager`` with a window, the window pool's layers' under a grouped one; (0, ())
    where it keeps all of it."""
    if isinstance(manager, GroupedBlockManager):
        return manager.windowed.window, tuple(sorted(cache.window_layers))
    return (manager.window, tuple(range(cache.num_layers))) if manager.window else (0, ())


def _drafts(config: EngineConfig) -> bool:
    """The engine speculates with a draft model, which catches up over the tokens it has not seen (a whole prompt,
    after the target prefilled it) into the same blocks: every block stays while it may still write them."""
    return config.speculative is not None and config.speculative.method == "draft"


def block_managers(config: EngineConfig, model: ModelConfig, cache) -> "BlockManager | GroupedBlockManager":
    """The block manager of an engine's ``PagedKVCache``: grouped where the cache has a window pool; with the window
    of a model whose every layer has one (none with a draft model)."""
    block_size, caching = config.cache.block_size, config.cache.enable_prefix_caching
    opens = open_keys.used_by(cache.dtype)
    if not cache.window_layers:
        return BlockManager(cache.num_blocks, block_size, caching, None if _drafts(config) else model.kv_window,
                            open_blocks=opens)
    return GroupedBlockManager(BlockManager(cache.num_blocks, block_size, caching, open_blocks=opens),
                               BlockManager(cache.window_num_blocks, block_size, caching, model.widest_window,
                                            WINDOW_TABLE, opens))


class GroupedBlockManager:
    def __init__(self, full: BlockManager, windowed: BlockManager):
        if windowed.window is None or full.window is not None or windowed.table == full.table:
            raise ValueError("a grouped pool is a full-attention pool and a windowed pool with tables of their own")
        self.full, self.windowed = full, windowed
        self.block_size = full.block_size
        self.window: int | None = None  # a request holds its whole context (in the full pool)
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def keeps_open_blocks(self) -> bool:
        return self.full.keeps_open_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.windowed.usage)

    def window_blocks_held(self, seq: Sequence) -> int:
        return self.windowed.num_held_blocks(seq)

    def num_held_blocks(self, seq: Sequence) -> int:
        return self.full.num_held_blocks(seq)

    def block_hashes_of(self, seq: Sequence) -> list[int]:
        return self.full.block_hashes_of(seq)

    def cached_block_hashes(self) -> list[int]:
        """The full pool's: a prefix there may still miss the window pool's blocks (a hit then is shorter)."""
        return self.full.cached_block_hashes()

    def get_computed_blocks(self, seq: Sequence) -> tuple[tuple[list[int], list[int]], int]:
        """The longest prefix of whole blocks both pools hold: (full blocks, windowed blocks), and its tokens."""
        if not self.full.enable_prefix_caching:
            return ([], []), 0
        token_ids = seq.token_ids
        lookup = token_ids[: (len(token_ids) - 1) // self.block_size * self.block_size]
        full = self.full.cached_prefix(lookup)
        windowed = self.windowed.cached_prefix(lookup[: len(full) * self.block_size], whole=seq.exported)
        num_blocks = len(windowed)  # never longer than the full pool's, which it was looked up within
        self.prefix_queries += len(token_ids)
        self.prefix_hits += num_blocks * self.block_size
        return (full[:num_blocks], windowed), num_blocks * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: tuple[list[int], list[int]] | list[int] | None = None,
                       pushed: bool = False) -> bool:
        full_blocks, window_blocks = computed_blocks or ([], [])
        plans = [pool.plan_allocation(seq, num_new_tokens, blocks, pushed)
                 for pool, blocks in ((self.full, full_blocks), (self.windowed, window_blocks))]
        if None in plans:
            return False
        self.full.apply_allocation(seq, full_blocks, plans[0])
        self.windowed.apply_allocation(seq, window_blocks, plans[1])
        return True

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        for pool in (self.full, self.windowed):
            pool.cache_full_blocks(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        for pool in (self.full, self.windowed):
            pool.free(seq)

    def cache_and_free(self, seq: Sequence) -> None:
        for pool in (self.full, self.windowed):
            pool.cache_and_free(seq)

    def hold(self, seq: Sequence) -> Sequence:
        return self.windowed.hold(seq, self.full.hold(seq))

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[str, int, int]] | None:
        if self.windowed.num_free_blocks == 0 and parent.num_computed_tokens % self.block_size:
            return None  # (checked first: the full pool's fork would have taken its copy)
        copies = self.full.fork(parent, child)
        return None if copies is None else copies + self.windowed.fork(parent, child)

    def reset_prefix_cache(self) -> bool:
        if self.full.num_free_blocks < self.full.num_blocks or self.windowed.num_free_blocks < self.windowed.num_blocks:
            return False
        return self.full.reset_prefix_cache() and self.windowed.reset_prefix_cache()


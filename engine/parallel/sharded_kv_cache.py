"""``ShardedKVCache``: a tensor-parallel rank's KV pool, which reads and writes every KV head for code outside the
engine.

Each rank's pool holds only its KV heads (``rank_config``), and the model reads and writes it there. The interface of
``PagedKVCache`` for everyone else (the prefill pod's KV export, the decode pod's KV receiver, the benchmarks) speaks
of the model's KV heads, all of them, as a one-process engine's does, so that a KV transfer between engines of
different tensor-parallel sizes needs nothing of either side:

    read(layer, kind, slots) -> [n, Hkv, D]   rank 0 asks the other ranks for theirs and gathers every head, each
                                             from the first rank that holds it (a replicated head is the same on all)
    write(layer, kind, slots, [n, Hkv, D])   rank 0 writes its heads and sends each rank the values to write its own

A read is a collective, so it runs where the ranks run their steps' calls: on the engine's thread, between steps (the
prefill export reads after each step; a tensor-parallel model hands it the layers once the step is done). A write is
not: the decode pod's receiver writes from its own thread, and the write reaches every rank before the step that
admits the request (the calls to the other ranks go in order, under one lock).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.kv_cache import KVKind, PagedKVCache
from splitserve.engine.parallel.layout import RankShard, rank_config
from splitserve.engine.parallel.process_group import TensorParallelGroup

if TYPE_CHECKING:
    from splitserve.engine.parallel.workers import RankWorkers


class ShardedKVCache(PagedKVCache):
    """Rank ``group.rank``'s pool of ``num_blocks`` blocks of its KV heads; ``plan_to``: rank 0's other ranks."""

    def __init__(self, config: ModelConfig, shards: list[RankShard], group: TensorParallelGroup, num_blocks: int,
                 block_size: int, dtype: torch.dtype | str, device: torch.device | str = "cpu"):
        super().__init__(rank_config(config, shards[group.rank]), num_blocks, block_size, dtype, device)
        self.group, self.shards = group, shards
        self.num_kv_heads = config.num_kv_heads  # the model's, which read and write speak of
        self.plan_to: RankWorkers | None = None

    def read(self, layer: int, kind: KVKind, slots: torch.Tensor) -> torch.Tensor | None:
        """Every KV head of ``layer``'s K or V at ``slots``: [len(slots), Hkv, D] on rank 0; None on the others."""
        if self.plan_to is not None:
            self.plan_to.send("kv_read", layer, kind, slots.tolist())
        own = super().read(layer, kind, slots)  # [n, its heads, D]
        as_bytes = own.view(torch.uint8)  # gloo gathers bytes whatever the cache's dtype
        parts = self.group.gather(as_bytes, [b - a for a, b in (s.kv_heads for s in self.shards)])
        if parts is None:
            return None
        owner = {h: (r, h - s.kv_heads[0]) for r, s in reversed(list(enumerate(self.shards)))
                 for h in range(*s.kv_heads)}  # the first rank holding each head wins
        heads = [parts[r][:, i] for r, i in (owner[h] for h in range(self.num_kv_heads))]
        return torch.stack(heads, dim=1).view(own.dtype)

    def write(self, layer: int, kind: KVKind, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` [len(slots), Hkv, D] (every KV head) as ``layer``'s K or V at ``slots``: each rank its
        heads."""
        if self.plan_to is not None:
            self.plan_to.send("kv_write", layer, kind, slots.tolist(), values)
        start, end = self.shards[self.group.rank].kv_heads
        super().write(layer, kind, slots, values[:, start:end])

"""``ShardedKVCache``: a tensor-parallel rank's KV pool, in shared memory that rank 0 maps for every rank, so that KV
leaves and enters a tensor-parallel engine by KV head range, with no collective and no message to the other ranks.

Each rank's pool holds only its KV heads (``rank_config``), and the model reads and writes it there. Rank 0 creates
every rank's pool as an anonymous shared file (``create_pools``: memfd on Linux), maps them all, and hands each
worker its own (workers.py); the pools are as lazily resident as a one-process pool (pages appear as blocks fill).
Code outside the engine (the prefill pod's KV export, the decode pod's KV receiver, the benchmarks) reads and writes
through rank 0:

    read_heads(layer, kind, slots) -> [((start, end), [n, end - start, D]), ...]   one entry per distinct rank head
                                       range, read from the first rank that holds it (a replicated head, more ranks
                                       than KV heads, is the same on all): the prefill pod sends each as chunks of
                                       their own (``KVChunk.heads``), never gathered into one tensor
    write_heads(layer, kind, slots, [n, end - start, D], (start, end))              those heads written into every
                                       rank that holds any of them: a decode pod of another degree re-shards a
                                       chunk as it stores it (P TP 1 -> D TP 2 splits it, P TP 2 -> D TP 1 assembles)
    read(layer, kind, slots) -> [n, Hkv, D] and write(..., [n, Hkv, D])             every KV head, as a one-process
                                       ``PagedKVCache`` speaks (tests, benchmarks)

``read_heads`` and ``write_heads`` at module level do the same for any ``PagedKVCache`` (one process: one range,
all heads), which is what the export and the receiver call.

Why it is safe without a collective. A read: rank 0 reads layer i once its own step has passed layer i's last
all-reduce, which every rank joins only after it wrote layer i's K/V (the shared-memory all-reduce publishes each
rank's arrival after its earlier stores, x86's stores staying in order; gloo's goes through a socket); the blocks
read are the exported prompt's, which no step writes again before the export is over. A write: the decode pod's
receiver writes into a reserved sequence's blocks, which no rank touches until rank 0 admits the sequence and sends
the step that reads them through the worker's pipe, after the writes.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.kv_cache import KVKind, PagedKVCache, bytes_per_block
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.parallel.layout import Range, RankShard, rank_config


def create_pool(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
    """Rank 0: an anonymous shared file sized for a pool of ``num_blocks`` blocks of ``config``'s KV heads and
    layers; its fd, which the caller closes once every rank has mapped it (the mappings stay)."""
    size = num_blocks * bytes_per_block(config.num_kv_heads, config.head_dim, config.num_layers, block_size, dtype)
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("splitserve-kv-pool")
    else:  # no memfd (macOS): an unlinked temporary file does the same
        with tempfile.TemporaryFile() as file:
            fd = os.dup(file.fileno())
    os.ftruncate(fd, size)  # sparse: no page is resident before a block is written
    return fd


def create_pools(config: ModelConfig, shards: list[RankShard], num_blocks: int, block_size: int,
                 dtype: torch.dtype) -> list[int]:
    """Rank 0: each tensor-parallel rank's pool file (``create_pool`` of its ``rank_config``), in rank order."""
    return [create_pool(rank_config(config, shard), num_blocks, block_size, dtype) for shard in shards]


def map_pool(fd: int, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> PagedKVCache:
    """A ``PagedKVCache`` of ``config``'s KV heads (a rank's) over the pool file ``fd``, shared with every process
    that maps it."""
    pool = PagedKVCache(config, num_blocks, block_size, dtype)  # its private pages are never touched: replaced
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads,
             kv_rows.row_width(pool.dtype, config.head_dim))
    memory = torch.frombuffer(mmap.mmap(fd, num_blocks * pool.bytes_per_block()), dtype=pool.dtype).view(shape)
    pool.k_blocks = list(memory[:, 0].unbind(0))
    pool.v_blocks = list(memory[:, 1].unbind(0))
    return pool


class ShardedKVCache(PagedKVCache):
    """Rank ``rank``'s pool of ``num_blocks`` blocks of its KV heads, over the shared file ``fds[rank]``; on rank 0,
    ``fds`` holds every rank's, and ``read_heads`` / ``write_heads`` reach every rank's heads."""

    def __init__(self, config: ModelConfig, shards: list[RankShard], rank: int, fds: dict[int, int], num_blocks: int,
                 block_size: int, dtype: torch.dtype | str):
        super().__init__(rank_config(config, shards[rank]), num_blocks, block_size, dtype)
        self.shards = shards
        self.num_kv_heads = config.num_kv_heads  # the model's, which read and write speak of
        self.pools = {r: map_pool(fd, rank_config(config, shards[r]), num_blocks, block_size, self.dtype)
                      for r, fd in fds.items()}
        self.k_blocks, self.v_blocks = self.pools[rank].k_blocks, self.pools[rank].v_blocks  # what the model uses
        # Each distinct head range and the first rank holding it: what leaves this engine, chunk by chunk.
        firsts: dict[Range, int] = {}
        for shard in shards:
            firsts.setdefault(shard.kv_heads, shard.rank)
        self.head_ranges = list(firsts.items())

    def read_heads(self, layer: int, kind: KVKind, slots: torch.Tensor,
                   rows: bool = False) -> list[tuple[Range, torch.Tensor]]:
        """Copies of ``layer``'s K or V at ``slots``, one [len(slots), end - start, D] per distinct rank head
        range, in head order (rank 0 only: it maps every rank's pool); with ``rows``, the rows as stored."""
        return [(heads, read_pool(self.pools[rank], layer, kind, slots, rows)) for heads, rank in self.head_ranges]

    def write_heads(self, layer: int, kind: KVKind, slots: torch.Tensor, values: torch.Tensor, heads: Range) -> None:
        """Store ``values`` [len(slots), end - start, D], the model's KV heads ``heads``, as ``layer``'s K or V at
        ``slots`` in every rank that holds any of them (rank 0 only)."""
        start, end = heads
        for shard in self.shards:
            lo, hi = max(start, shard.kv_heads[0]), min(end, shard.kv_heads[1])
            if lo < hi:
                own = shard.kv_heads[0]
                write_heads(self.pools[shard.rank], layer, kind, slots, values[:, lo - start:hi - start],
                            (lo - own, hi - own))

    def read(self, layer: int, kind: KVKind, slots: torch.Tensor) -> torch.Tensor:
        """Every KV head of ``layer``'s K or V at ``slots``: [len(slots), Hkv, D] (rank 0 only)."""
        return torch.cat([part for _, part in self.read_heads(layer, kind, slots)], dim=1)

    def write(self, layer: int, kind: KVKind, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` [len(slots), Hkv, D] (every KV head) as ``layer``'s K or V at ``slots``: each rank its
        heads (rank 0 only)."""
        self.write_heads(layer, kind, slots, values, (0, self.num_kv_heads))

    def read_rows(self, layer: int, kind: KVKind, slots: torch.Tensor) -> torch.Tensor:
        """Every KV head of ``layer``'s K or V at ``slots`` as stored rows: [len(slots), Hkv, row] (rank 0 only)."""
        return torch.cat([part for _, part in self.read_heads(layer, kind, slots, rows=True)], dim=1)

    # Rows of the pool's own dtype pass kv_rows.store unchanged: writing them is writing values.
    write_rows = write


def read_heads(cache: PagedKVCache, layer: int, kind: KVKind, slots: torch.Tensor,
               rows: bool = False) -> list[tuple[Range | None, torch.Tensor]]:
    """What leaves ``cache`` of ``layer``'s K or V at ``slots``: a tensor-parallel cache's rank head ranges, each
    with its heads' copy; one process's every head, as (None, [n, Hkv, D]). With ``rows``: the rows as the pool
    stores them, [n, heads, row], for a codec that carries them (``KVCodec.pool_dtype``)."""
    if isinstance(cache, ShardedKVCache):
        return cache.read_heads(layer, kind, slots, rows)
    return [(None, read_pool(cache, layer, kind, slots, rows))]


def read_pool(cache: PagedKVCache, layer: int, kind: KVKind, slots: torch.Tensor, rows: bool) -> torch.Tensor:
    """One pool's copy of ``layer``'s K or V at ``slots``: its rows as stored, or their values."""
    return cache.read_rows(layer, kind, slots) if rows else cache.read(layer, kind, slots)


def write_heads(cache: PagedKVCache, layer: int, kind: KVKind, slots: torch.Tensor, values: torch.Tensor,
                heads: Range) -> None:
    """Store ``values`` [len(slots), end - start, D] as KV heads ``heads`` of ``layer``'s K or V at ``slots``:
    into the ranks that hold them on a tensor-parallel cache; whole heads through ``PagedKVCache.write``; some of
    one pool's heads row by row (numpy copies, as bytes: it has no bfloat16)."""
    if isinstance(cache, ShardedKVCache):
        cache.write_heads(layer, kind, slots, values, heads)
        return
    pool = (cache.k_blocks if kind == "k" else cache.v_blocks)[layer].flatten(0, 1)  # [slots, its heads, D]
    start, end = heads
    if (start, end) == (0, pool.shape[1]):
        cache.write(layer, kind, slots, values)
        return
    values = kv_rows.store(values, pool.dtype).to(device=pool.device)
    if pool.device.type != "cpu" or len(slots) == 0:
        pool[:, start:end].index_copy_(0, slots, values)
        return
    pool.view(torch.uint8).numpy()[slots.numpy(), start:end] = values.contiguous().view(torch.uint8).numpy()

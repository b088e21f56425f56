"""The paged KV block pool: which block holds which tokens of which sequence, and the prefix cache over it.

A sequence's path through the pool:

- admission: ``get_computed_blocks`` finds the longest run of its full blocks already in the prefix cache,
  then ``allocate_slots`` takes a reference on those blocks and allocates fresh ones for the tokens to compute;
- each step: ``allocate_slots`` grows its ``block_table`` for the step's new tokens, and after the step
  ``cache_full_blocks`` gives every block that became full a hash, so later requests can reuse it;
- the samples of one prompt (n > 1): ``fork`` gives each a reference on the prompt's full blocks and a copy of
  its last, partly filled block, so that the prompt's KV is held once, plus one block per sample;
- finish, abort or preemption: ``free`` drops its references. A freed block that has a hash keeps its KV and
  stays in the cache as *evictable*: a later prefix hit revives it; allocation reuses it only when no
  hash-less block is left, least recently freed first.

A block's hash is chained with its parent's, so a hash names the whole prefix up to the end of the block.
The hash is deterministic across processes (blake2b, not Python's salted ``hash``): pods publish block hashes
and the router compares them, so every process must compute the same value for the same tokens.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass

from splitserve.engine.sequence import Sequence

# The parent of a sequence's first block: any fixed 64-bit value works, as long as every pod uses the same.
ROOT_PARENT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: TokenIds[int]) -> int:
    """64-bit hash of one full block: the parent block's hash and this block's token ids, little-endian."""
    data = struct.pack(f"<Q{len(token_ids)}q", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def chained_block_hashes(token_ids: TokenIds[int], block_size: int) -> list[int]:
    """Hashes of every full block of ``token_ids``, each chained to the one before (the router uses this too)."""
    hashes: list[int] = []
    parent = ROOT_PARENT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV pool."""

    block_id: int
    ref_count: int = 0
    # Set only while this block is the prefix cache's entry for the hash; its tokens rule out hash collisions.
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._hashless_free_ids: deque[int] = deque(range(num_blocks))
        # Cached blocks nobody references, least recently freed first: the eviction order.
        self._evictable_ids: OrderedDict[int, None] = OrderedDict()
        self._cached_block_ids: dict[int, int] = {}  # block hash -> block id
        # Chained hashes of each sequence's full blocks, by request id, aligned with its block_table.
        self._seq_block_hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self._hashless_free_ids) + len(self._evictable_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by sequences (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_hashes_of(self, seq: Sequence) -> list[int]:
        return list(self._seq_block_hashes.get(seq.request_id, ()))

    # ---- admission: the prefix cache lookup --------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest run of the sequence's leading full blocks found in the cache, and how many tokens they hold.

        The last token is always left to compute, even when the whole sequence is cached: the step that
        computes it is the one that produces logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        token_ids = seq.token_ids
        lookup_tokens = token_ids[: (len(token_ids) - 1) // self.block_size * self.block_size]
        block_ids = self._cached_prefix(lookup_tokens)
        num_tokens = len(block_ids) * self.block_size
        self.prefix_queries += len(token_ids)
        self.prefix_hits += num_tokens
        return block_ids, num_tokens

    def _cached_prefix(self, token_ids: list[int]) -> list[int]:
        block_ids = []
        for index, block_hash in enumerate(chained_block_hashes(token_ids, self.block_size)):
            block_id = self._cached_block_ids.get(block_hash)
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block_ids.append(block_id)
        return block_ids

    # ---- every step: growing a sequence's block table ----------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make ``seq.block_table`` cover its computed tokens, the cached ``computed_blocks`` and the new tokens.

        Returns False, changing nothing, when the pool has no room. ``computed_blocks`` (from
        ``get_computed_blocks``, only at admission) must directly follow the blocks the sequence already has.
        """
        computed_blocks = computed_blocks or []
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_missing = math.ceil(num_tokens / self.block_size) - len(seq.block_table) - len(computed_blocks)
        # Reviving an evictable computed block takes it out of the free room it is counted in.
        num_revived = sum(1 for block_id in computed_blocks if self.blocks[block_id].ref_count == 0)
        if num_missing > self.num_free_blocks - num_revived:
            return False
        for block_id in computed_blocks:
            self._touch(block_id)
        if computed_blocks:
            seq.block_table.extend(computed_blocks)
            self._seq_block_hashes[seq.request_id] = [self.blocks[block_id].block_hash for block_id in computed_blocks]
        seq.block_table.extend(self._take_free_block() for _ in range(num_missing))
        return True

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable_ids[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self._hashless_free_ids:
            block_id = self._hashless_free_ids.popleft()
        else:
            block_id, _ = self._evictable_ids.popitem(last=False)
            self._uncache(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _uncache(self, block: KVBlock) -> None:
        del self._cached_block_ids[block.block_hash]
        block.block_hash = None
        block.token_ids = ()

    # ---- after a step: publishing newly full blocks ------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hash every block of ``seq`` that is full within its first ``num_tokens`` (computed) tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_block_hashes.setdefault(seq.request_id, [])
        num_full_blocks = num_tokens // self.block_size
        if len(hashes) >= num_full_blocks:
            return
        token_ids = seq.token_ids
        for index in range(len(hashes), num_full_blocks):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            hashes.append(hash_block_tokens(hashes[-1] if hashes else ROOT_PARENT_HASH, tokens))
            self._cache(self.blocks[seq.block_table[index]], hashes[-1], tokens)

    def _cache(self, block: KVBlock, block_hash: int, tokens: tuple[int, ...]) -> None:
        # A hash already cached (same tokens computed twice, or a collision) keeps its first block;
        # this one stays private to its sequence and returns to the hash-less free list when freed.
        if block_hash in self._cached_block_ids:
            return
        self._cached_block_ids[block_hash] = block.block_id
        block.block_hash = block_hash
        block.token_ids = tokens

    # ---- finish, abort, preemption ----------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first, so its tail blocks are the first to be evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                self._hashless_free_ids.append(block_id)
            else:
                self._evictable_ids[block_id] = None
        seq.block_table.clear()
        self._seq_block_hashes.pop(seq.request_id, None)

    def cache_and_free(self, seq: Sequence) -> None:
        """Publish ``seq``'s full blocks (all its tokens computed: KV that arrived from another pod) in the prefix
        cache and drop its references: the next sequence with that prefix finds them at admission, while they stay
        evictable (freed last, so evicted last)."""
        self.cache_full_blocks(seq, seq.num_tokens)
        self.free(seq)

    def hold(self, seq: Sequence) -> Sequence:
        """A second reference to every block of ``seq``, as a holder sequence of its own: the blocks stay allocated,
        their KV intact, until ``free(holder)``, whatever becomes of ``seq`` meanwhile (a prefill pod holds a
        prompt's blocks until the decode pod acknowledged its KV)."""
        holder = Sequence(f"{seq.request_id}#held", seq.prompt_token_ids, seq.sampling_params)
        for block_id in seq.block_table:
            self._touch(block_id)
        holder.block_table = list(seq.block_table)
        return holder

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Give ``child`` the blocks of ``parent``'s first ``parent.num_computed_tokens`` tokens (the samples of one
        prompt): a reference on each full block, and a fresh block for the last, partly filled one, which each
        sample fills with tokens of its own (copy-on-write, copied at once). Returns the (source, copy) block pairs
        whose KV the caller copies (none or one); None, changing nothing, when the pool has no block for the copy."""
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and self.num_free_blocks == 0:
            return None
        for block_id in parent.block_table[:num_full]:
            self._touch(block_id)
        child.block_table = parent.block_table[:num_full]
        if not partial:
            return []
        child.block_table.append(self._take_free_block())
        return [(parent.block_table[num_full], child.block_table[-1])]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights). Refused (False) while any block is in use."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block_id in self._evictable_ids:
            self._uncache(self.blocks[block_id])
            self._hashless_free_ids.append(block_id)
        self._evictable_ids.clear()
        return True

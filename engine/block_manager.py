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

A model whose every layer attends over a sliding window (``window``: the widest, ``ModelConfig.kv_window``) reads no
key older than ``window - 1`` positions before its query. A block that left every later query's window is freed as
the sequence moves on (``allocate_slots``), its place in the block table taken by ``NULL_BLOCK``, and one never
needed is never allocated: a prompt handed over by a prefill pod gets blocks from ``window_start`` on (the tokens
the pushed KV covers), and a prefix-cache hit needs only the blocks of the window before its end. A sequence then
holds at most ``window / block_size + 2`` blocks, however long it grows (docs/models.md, "Sliding windows").

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
# A block table's entry for a block the sequence no longer holds (it left every layer's sliding window). Never an
# index into the pool: ``PagedKVCache.slots`` refuses it, and the windowed attention reads no slot of it.
NULL_BLOCK = -1
# The Sequence attribute of its open block in the pool of each table.
OPEN_BLOCK_ATTRS = {"block_table": "open_block", "window_block_table": "window_open_block"}


def window_start(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first token whose KV a prompt of ``num_tokens`` handed over to a pool of ``block_size`` blocks under
    ``window`` needs (0: all; None: no window): the first of the blocks that the queries from the prompt's last full
    block on may read, so that the blocks it fills are whole (and may enter the prefix cache) and a split prefill's
    pushed prefix serves the prefix-cache hit of the prompt's rest. The prefill pod pushes from here, with the
    decode pod's window and block size (its handshake's ``KVLayout``)."""
    if window is None:
        return 0
    first_query = num_tokens // block_size * block_size
    return max(first_query + 1 - window, 0) // block_size * block_size


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


@dataclass(frozen=True)
class _Allocation:
    """What ``allocate_slots`` will do to a sequence's table, planned before anything changes."""

    skipped: int  # the table's entries before this index are (made) NULL_BLOCK
    num_null: int  # new entries that are NULL_BLOCK from the start
    num_missing: int  # new blocks taken from the pool
    open_block: bool = False  # and one for the sequence's open block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, table: str = "block_table", open_blocks: bool = False):
        self.num_blocks = num_blocks
        # Each sequence holds an open block besides its table (a scaled pool: engine/kv_formats/open_keys.py), in the
        # Sequence attribute named here.
        self.open_attr = (OPEN_BLOCK_ATTRS[table] if open_blocks else None)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # how far back every layer's query reads; None: its whole context
        self.table = table  # the Sequence attribute that holds a sequence's blocks of this pool (kv_cache.table_of)
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
    def keeps_open_blocks(self) -> bool:
        """Whether each sequence holds an open block (a scaled pool's: engine/kv_formats/open_keys.py)."""
        return self.open_attr is not None

    @property
    def num_free_blocks(self) -> int:
        return len(self._hashless_free_ids) + len(self._evictable_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by sequences (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_hashes_of(self, seq: Sequence) -> list[int]:
        return list(self._seq_block_hashes.get(seq.request_id, ()))

    def cached_block_hashes(self) -> list[int]:
        """The hashes of the blocks in the prefix cache, oldest first."""
        return list(self._cached_block_ids)

    def num_held_blocks(self, seq: Sequence) -> int:
        """The blocks ``seq``'s table holds (its ``NULL_BLOCK`` entries left the window)."""
        return sum(block_id != NULL_BLOCK for block_id in self._table(seq))

    def _table(self, seq: Sequence) -> list[int]:
        return getattr(seq, self.table)

    def _first_needed_block(self, first_query: int) -> int:
        """The index of the first block that a query at ``first_query`` or later may read."""
        if self.window is None:
            return 0
        return max(first_query + 1 - self.window, 0) // self.block_size

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
        block_ids = self.cached_prefix(lookup_tokens, whole=seq.exported)
        num_tokens = len(block_ids) * self.block_size
        self.prefix_queries += len(token_ids)
        self.prefix_hits += num_tokens
        return block_ids, num_tokens

    def cached_prefix(self, token_ids: list[int], whole: bool = False) -> list[int]:
        """The leading blocks of ``token_ids`` whose KV the cache holds. Under a window (unless ``whole``: every block
        of the prefix), the longest run of blocks whose end's window is cached: the blocks before that window are
        ``NULL_BLOCK``, never read."""
        block_ids: list[int] = []
        best, run = 0, 0  # the longest usable prefix (blocks), the cached blocks just before the current one
        for index, block_hash in enumerate(chained_block_hashes(token_ids, self.block_size)):
            block_id = self._cached_block_ids.get(block_hash)
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            found = block_id is not None and self.blocks[block_id].token_ids == tokens
            if whole and found:
                block_ids.append(block_id)
                best = index + 1
                continue
            if not found and (self.window is None or whole):
                break
            block_ids.append(block_id if found else NULL_BLOCK)
            run = run + 1 if found else 0
            if run >= index + 1 - self._first_needed_block((index + 1) * self.block_size):
                best = index + 1
        first = 0 if whole else self._first_needed_block(best * self.block_size)
        return [NULL_BLOCK] * first + block_ids[first:best]

    # ---- every step: growing a sequence's block table ----------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None,
                       pushed: bool = False) -> bool:
        """Make the sequence's table cover its computed tokens, the cached ``computed_blocks`` and the new tokens;
        under a window, only from the first block that the first new token's window reads (``pushed``, a prompt whose
        KV a prefill pod pushes here: from ``window_start``), the blocks before it freed.

        Returns False, changing nothing, when the pool has no room. ``computed_blocks`` (from
        ``get_computed_blocks``, only at admission) must directly follow the blocks the sequence already has.
        """
        computed_blocks = computed_blocks or []
        plan = self.plan_allocation(seq, num_new_tokens, computed_blocks, pushed)
        if plan is None:
            return False
        self.apply_allocation(seq, computed_blocks, plan)
        return True

    def plan_allocation(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int],
                        pushed: bool = False) -> _Allocation | None:
        """``allocate_slots``' plan, or None when the pool has no room for it; nothing changes."""
        table = self._table(seq)
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        if pushed:
            skipped = window_start(num_tokens, self.window, self.block_size) // self.block_size
        else:
            skipped = self._first_needed_block(num_computed)
        have = len(table) + len(computed_blocks)
        num_missing = max(math.ceil(num_tokens / self.block_size) - max(have, skipped), 0)
        num_null = max(min(skipped, math.ceil(num_tokens / self.block_size)) - have, 0)
        # Reviving an evictable computed block takes it out of the free room it is counted in; a block left behind
        # by the window and held by this sequence alone returns to it.
        num_revived = sum(1 for block_id in computed_blocks if self._is_free(block_id))
        num_released = sum(1 for block_id in table[:skipped]
                           if block_id != NULL_BLOCK and self.blocks[block_id].ref_count == 1)
        open_block = self.open_attr is not None and getattr(seq, self.open_attr) < 0
        if num_missing + open_block > self.num_free_blocks - num_revived + num_released:
            return None
        return _Allocation(skipped, num_null, num_missing, open_block)

    def apply_allocation(self, seq: Sequence, computed_blocks: list[int], plan: _Allocation) -> None:
        table = self._table(seq)
        self._release_skipped(table, plan.skipped)
        for block_id in computed_blocks:
            if block_id != NULL_BLOCK:
                self._touch(block_id)
        if computed_blocks:
            table.extend(computed_blocks)
            self._seq_block_hashes[seq.request_id] = chained_block_hashes(
                seq.token_ids[: len(computed_blocks) * self.block_size], self.block_size)
        table.extend([NULL_BLOCK] * plan.num_null)
        table.extend(self._take_free_block() for _ in range(plan.num_missing))
        if plan.open_block:
            setattr(seq, self.open_attr, self._take_free_block())

    def _is_free(self, block_id: int) -> bool:
        return block_id != NULL_BLOCK and self.blocks[block_id].ref_count == 0

    def _release_skipped(self, table: list[int], skipped: int) -> None:
        """The blocks before index ``skipped`` of a sequence's table, out of every later query's window, freed."""
        for index, block_id in enumerate(table[:skipped]):
            if block_id != NULL_BLOCK:
                self._release(block_id)
                table[index] = NULL_BLOCK

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
            block_id = self._table(seq)[index]
            if block_id != NULL_BLOCK:  # (a pushed prompt's blocks before the window never came)
                self._cache(self.blocks[block_id], hashes[-1], tokens)

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
        table = self._table(seq)
        for block_id in reversed(table):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        table.clear()
        self._seq_block_hashes.pop(seq.request_id, None)
        if self.open_attr is not None and getattr(seq, self.open_attr) >= 0:
            self._release(getattr(seq, self.open_attr))
            setattr(seq, self.open_attr, -1)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is None:
            self._hashless_free_ids.append(block_id)
        else:
            self._evictable_ids[block_id] = None

    def cache_and_free(self, seq: Sequence) -> None:
        """Publish ``seq``'s full blocks (all its tokens computed: KV that arrived from another pod) in the prefix
        cache and drop its references: the next sequence with that prefix finds them at admission, while they stay
        evictable (freed last, so evicted last)."""
        self.cache_full_blocks(seq, seq.num_tokens)
        self.free(seq)

    def hold(self, seq: Sequence, holder: Sequence | None = None) -> Sequence:
        """A second reference to every block of ``seq``, as a holder sequence of its own (``holder``, or a new one):
        the blocks stay allocated, their KV intact, until ``free(holder)``, whatever becomes of ``seq`` meanwhile (a
        prefill pod holds a prompt's blocks until the decode pod acknowledged its KV)."""
        holder = holder or Sequence(f"{seq.request_id}#held", seq.prompt_token_ids, seq.sampling_params)
        for block_id in self._table(seq):
            if block_id != NULL_BLOCK:
                self._touch(block_id)
        setattr(holder, self.table, list(self._table(seq)))
        return holder

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[str, int, int]] | None:
        """Give ``child`` the blocks of ``parent``'s first ``parent.num_computed_tokens`` tokens (the samples of one
        prompt): a reference on each full block, and a fresh block for the last, partly filled one, which each
        sample fills with tokens of its own (copy-on-write, copied at once). Returns the (table, source, copy) block
        pairs whose KV the caller copies in the layers of that table (the last block's, and the open block's of a
        scaled pool); None, changing nothing, when the pool has no block for the copies."""
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        opens = self.open_attr is not None and getattr(parent, self.open_attr) >= 0
        if (bool(partial) + opens) > self.num_free_blocks:
            return None
        table = self._table(parent)
        for block_id in table[:num_full]:
            if block_id != NULL_BLOCK:
                self._touch(block_id)
        setattr(child, self.table, table[:num_full])
        copies = []
        if partial:
            copy = self._take_free_block()
            self._table(child).append(copy)
            copies.append((self.table, table[num_full], copy))
        if opens:  # the child's open block: a copy of the parent's (its keys live in the block's K and V storage)
            copy = self._take_free_block()
            setattr(child, self.open_attr, copy)
            copies.append((self.table, getattr(parent, self.open_attr), copy))
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights). Refused (False) while any block is in use."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block_id in self._evictable_ids:
            self._uncache(self.blocks[block_id])
            self._hashless_free_ids.append(block_id)
        self._evictable_ids.clear()
        return True

"""The paged KV cache: one pool of K blocks and one of V blocks per layer, sized from a memory budget.

``k_blocks[layer]`` and ``v_blocks[layer]`` are ``[num_blocks, block_size, num_kv_heads, row]``, a row being one
(token, head)'s K or V as the pool stores it (engine/kv_formats/rows.py: ``head_dim`` values of a float dtype, or
int8 codes and their float16 scale). The token at
position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``, i.e. in
slot ``block_id * block_size + offset`` of the flattened pool. Which block belongs to whom is the ``BlockManager``'s
business; this file only owns the memory.

A model that mixes sliding-window layers with full-attention ones (Gemma 2 and 3) keeps its windowed layers' K/V in
pools of their own (``window_layers``, ``window_num_blocks`` blocks): a sequence's tokens there live in the blocks of
its ``window_block_table``, which the block manager frees as they leave the window (engine/kv_groups.py), while the
full layers' stay in its ``block_table``. ``table_of(layer)`` names the table that addresses a layer's pool.

Two kinds of reader and writer:

- the engine's attention and model code (``model/attention.py``, ``model/layers.py``, the native kernels) take the
  pool tensors themselves, ``k_blocks`` / ``v_blocks``, and nothing outside ``engine/`` may
  (``tests/test_kv_cache_interface.py``);
- everyone else (the prefill pod's KV export, the decode pod's KV receiver, the benchmarks) goes through

      slots(block_table, token_start, token_end) -> [n] long     where a token range of a sequence lives (the
                                                                 table of the layers read: ``table_of(layer)``)
      read(layer, kind, slots) -> [n, Hkv, D]                    a copy of that layer's K ("k") or V ("v") values
      write(layer, kind, slots, values [n, Hkv, D])             stored in the cache's format
      read_rows / write_rows(layer, kind, slots[, rows])         the same, as stored rows [n, Hkv, row] (no rounding)

  plus ``dtype`` (what the pool stores; ``read`` returns its values in ``kv_rows.value_dtype`` of it),
  ``element_size`` and ``device``. Slots are computed once per token range and reused for every layer and for K and
  V (the prefill export reads all layers of a step at the same slots).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from splitserve.engine.config import CacheConfig, ModelConfig
from splitserve.engine.kv_formats import rows as kv_rows

# The ``Sequence`` attribute that holds a sequence's blocks of the window pool (``table_of``), beside ``block_table``.
WINDOW_TABLE = "window_block_table"
KVKind = Literal["k", "v"]  # keys or values, as the cache, the codecs and the KV wire name them
KV_KINDS: tuple[KVKind, ...] = ("k", "v")


class PagedKVCache:
    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | str,  # what K/V are stored as (CacheConfig.cache_dtype: kv_rows.POOL_DTYPES)
        device: torch.device | str = "cpu",
        window_layers: frozenset[int] = frozenset(),  # layers whose pools are the window group's
        window_num_blocks: int = 0,
    ):
        if num_blocks <= 0 or (window_layers and window_num_blocks <= 0):
            raise ValueError(f"num_blocks must be > 0, got {num_blocks} (window group: {window_num_blocks})")
        self.num_blocks = num_blocks
        self.window_layers, self.window_num_blocks = frozenset(window_layers), window_num_blocks
        self.block_size = block_size
        self.dtype = kv_rows.pool_dtype(dtype)
        self.head_dim = model_config.head_dim
        row = (block_size, model_config.num_kv_heads, kv_rows.row_width(self.dtype, self.head_dim))
        shapes = [(window_num_blocks if layer in self.window_layers else num_blocks, *row)
                  for layer in range(model_config.num_layers)]
        self.k_blocks = [_zeroed(shape, self.dtype, device) for shape in shapes]
        self.v_blocks = [_zeroed(shape, self.dtype, device) for shape in shapes]

    @classmethod
    def from_config(
        cls, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device | str = "cpu",
        window_blocks: int = 0,
    ) -> "PagedKVCache":
        """A cache of ``cache_config.num_blocks`` blocks, or as many as fit in ``kv_cache_memory_bytes``. With
        ``window_blocks`` (the blocks the windowed layers of a model that mixes them with full ones need at most:
        ``window_group_blocks``), those layers get a group of their own: that many blocks (no more than the full
        layers'), the full layers the rest of the budget; with ``num_blocks`` set, both groups that many."""
        dtype = kv_rows.pool_dtype(cache_config.cache_dtype)
        windowed = model_config.windowed_layers if window_blocks else frozenset()
        num_blocks = cache_config.num_blocks or num_blocks_for_budget(
            model_config, cache_config.block_size, dtype, cache_config.kv_cache_memory_bytes
        )
        if not windowed:
            return cls(model_config, num_blocks, cache_config.block_size, dtype, device)
        window_num_blocks = num_blocks if cache_config.num_blocks else min(num_blocks, window_blocks)
        if not cache_config.num_blocks:  # what the window group leaves of the budget goes to the full layers
            per_layer = bytes_per_block(model_config.num_kv_heads, model_config.head_dim, 1, cache_config.block_size,
                                        dtype)
            full_layers = model_config.num_layers - len(windowed)
            rest = cache_config.kv_cache_memory_bytes - window_num_blocks * len(windowed) * per_layer
            num_blocks = rest // (full_layers * per_layer)
        return cls(model_config, num_blocks, cache_config.block_size, dtype, device, windowed, window_num_blocks)

    @property
    def num_layers(self) -> int:
        return len(self.k_blocks)

    @property
    def device(self) -> torch.device:
        return self.k_blocks[0].device

    @property
    def element_size(self) -> float:
        """Bytes one stored K or V value takes, its row's scale shared out (an int8 pool: 1 + 2 / head_dim)."""
        return kv_rows.row_width(self.dtype, self.head_dim) * _element_size(self.dtype) / self.head_dim

    def bytes_per_block(self) -> int:
        """Bytes one block of the full layers' pools takes across them (every layer's without a window group)."""
        num_kv_heads = self.k_blocks[0].shape[2]
        num_layers = self.num_layers - len(self.window_layers)
        return bytes_per_block(num_kv_heads, self.head_dim, num_layers, self.block_size, self.dtype)

    def table_of(self, layer: int) -> str:
        """The ``Sequence`` attribute whose block ids address ``layer``'s pool: ``block_table``, or
        ``window_block_table`` for a layer of the window group."""
        return WINDOW_TABLE if layer in self.window_layers else "block_table"

    # ---- the interface for code outside the engine ------------------------------------------------------------
    def slots(self, block_table: Sequence[int], token_start: int, token_end: int) -> torch.Tensor:
        """[token_end - token_start] long on the cache's device: the slot of each token in [token_start, token_end)
        of the sequence whose blocks are ``block_table``."""
        if not 0 <= token_start <= token_end <= len(block_table) * self.block_size:
            raise ValueError(f"tokens [{token_start}, {token_end}) are not within {len(block_table)} blocks of "
                             f"{self.block_size}")
        positions = torch.arange(token_start, token_end)
        blocks = torch.tensor(block_table, dtype=torch.long)[positions // self.block_size]
        if len(blocks) and int(blocks.min()) < 0:  # block_manager.NULL_BLOCK
            raise ValueError(f"tokens [{token_start}, {token_end}) reach blocks the sequence no longer holds (they "
                             f"left its sliding window)")
        return (blocks * self.block_size + positions % self.block_size).to(self.device)

    def read(self, layer: int, kind: KVKind, slots: torch.Tensor) -> torch.Tensor:
        """A copy of ``layer``'s K (``kind`` "k") or V ("v") values at ``slots``: [len(slots), Hkv, D], in
        ``kv_rows.value_dtype(dtype)``. A copy, so that it stays valid after the blocks are freed and reused."""
        return kv_rows.load(self.read_rows(layer, kind, slots))

    def read_rows(self, layer: int, kind: KVKind, slots: torch.Tensor) -> torch.Tensor:
        """A copy of ``layer``'s K or V rows at ``slots`` as the pool stores them: [len(slots), Hkv, row]."""
        # index_select, not flat[slots]: advanced indexing gathers the rows ~8x slower on CPU.
        return torch.index_select(self._flat(layer, kind), 0, slots)

    def write(self, layer: int, kind: KVKind, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` [len(slots), Hkv, D] (any float dtype, rounded or quantized to the pool's format) as
        ``layer``'s K or V at ``slots``."""
        self.write_rows(layer, kind, slots, kv_rows.store(values, self.dtype))

    def write_rows(self, layer: int, kind: KVKind, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` [len(slots), Hkv, row], in the pool's format (``read_rows``'s), as ``layer``'s K or V at
        ``slots``, unchanged."""
        flat = self._flat(layer, kind)
        if rows.dtype != flat.dtype or rows.shape[1:] != flat.shape[1:]:
            raise ValueError(f"rows {rows.dtype} {tuple(rows.shape[1:])} are not this pool's "
                             f"{flat.dtype} {tuple(flat.shape[1:])}")
        rows = rows.to(device=flat.device)
        if flat.device.type != "cpu" or len(slots) == 0:  # (numpy cannot shape an empty batch of rows)
            flat.index_copy_(0, slots, rows)
            return
        # On the CPU, numpy copies: whole blocks as rows of block_size * Hkv * D elements where the slots fill them in
        # order (a pushed prompt's blocks but the edges, wherever the pool put them), the rest a row per slot (one
        # memcpy each, ~10x faster than torch's index_copy_, which goes through its generic per-element loop). A
        # 4096-token layer in a pool's blocks, one core of an AMD EPYC: 0.06 CPU-s/GB by blocks, 0.14 by rows: what
        # the decode pod's KV intake runs at. As bytes, because numpy has no bfloat16.
        source = rows.reshape(len(slots), -1).contiguous().view(torch.uint8).numpy()
        targets = slots.numpy()
        pool_rows = flat.view(flat.shape[0], -1).view(torch.uint8).numpy()
        first = min(int(-targets[0] % self.block_size), len(targets))  # before the first block boundary: rows
        num_blocks = (len(targets) - first) // self.block_size
        grid = targets[first:first + num_blocks * self.block_size].reshape(num_blocks, self.block_size)
        if num_blocks == 0 or not (grid[:, 0] % self.block_size == 0).all() or not (np.diff(grid) == 1).all():
            pool_rows[targets] = source  # slots that do not fill whole blocks in order
            return
        blocks = flat.view(flat.shape[0] // self.block_size, -1).view(torch.uint8).numpy()
        blocks[grid[:, 0] // self.block_size] = source[first:first + grid.size].reshape(num_blocks, -1)
        rest = np.r_[0:first, first + grid.size:len(targets)]
        pool_rows[targets[rest]] = source[rest]

    def _flat(self, layer: int, kind: KVKind) -> torch.Tensor:
        """[num_blocks * block_size, Hkv, row], a view of the pool."""
        if kind not in KV_KINDS:
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        return (self.k_blocks if kind == "k" else self.v_blocks)[layer].flatten(0, 1)

    def memory_bytes(self) -> int:
        window = bytes_per_block(self.k_blocks[0].shape[2], self.head_dim, len(self.window_layers), self.block_size,
                                 self.dtype)
        return self.num_blocks * self.bytes_per_block() + self.window_num_blocks * window


def bytes_per_block(num_kv_heads: int, head_dim: int, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together (an int8 pool's scales included)."""
    return 2 * num_layers * block_size * num_kv_heads * kv_rows.row_width(dtype, head_dim) * _element_size(dtype)


def num_blocks_for_budget(model_config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes``; raises when not even one does."""
    per_block = bytes_per_block(
        model_config.num_kv_heads, model_config.head_dim, model_config.num_layers, block_size, dtype
    )
    num_blocks = budget_bytes // per_block
    if num_blocks == 0:
        raise ValueError(f"kv_cache_memory_bytes={budget_bytes} is less than one block ({per_block} bytes)")
    return num_blocks


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A pool tensor of zeros. Zeros, not garbage: a decode step gathers whole blocks and masks the unused slots,
    and a masked score is only harmless when what is behind it is finite (NaN * 0 is NaN).

    On the CPU, fresh private anonymous pages (mmap): the kernel hands them out zeroed on first touch, so the pool
    becomes resident as blocks fill up, not at start (torch.zeros writes every byte, and a 1 GiB pool would be
    resident in an idle pod). Reading a never-written page maps the kernel's shared zero page, which costs nothing."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, math.prod(shape) * _element_size(dtype), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor holds the mapping until it is freed


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


"""The paged KV cache: one pool of K blocks and one of V blocks per layer, sized from a memory budget.

``k[layer]`` and ``v[layer]`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``. The token at position ``p``
of a sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``, i.e. in slot
``block_id * block_size + offset`` of the flattened pool. Which block belongs to whom is the ``BlockManager``'s
business; this file only owns the memory. ``attention.py`` writes and reads it.
"""

from __future__ import annotations

import torch

from engine.config import CacheConfig, ModelConfig


class PagedKVCache:
    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | str,  # what K/V are stored as (CacheConfig.cache_dtype; float16 by default there)
        device: torch.device | str = "cpu",
    ):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = _as_dtype(dtype)
        shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
        # Zeros, not empty: a decode step gathers whole blocks and masks the unused slots, and a masked score
        # is only harmless when the garbage behind it is finite (NaN * 0 is NaN).
        self.k = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(model_config.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(model_config.num_layers)]

    @classmethod
    def from_config(
        cls, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device | str = "cpu"
    ) -> "PagedKVCache":
        """A cache of ``cache_config.num_blocks`` blocks, or as many as fit in ``kv_cache_memory_bytes``."""
        dtype = _as_dtype(cache_config.cache_dtype)
        num_blocks = cache_config.num_blocks or num_blocks_for_budget(
            model_config, cache_config.block_size, dtype, cache_config.kv_cache_memory_bytes
        )
        return cls(model_config, num_blocks, cache_config.block_size, dtype, device)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def bytes_per_block(self) -> int:
        return bytes_per_block(self.k[0].shape[2], self.k[0].shape[3], self.num_layers, self.block_size, self.dtype)

    def memory_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block()


def bytes_per_block(num_kv_heads: int, head_dim: int, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_blocks_for_budget(model_config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes``; raises when not even one does."""
    per_block = bytes_per_block(
        model_config.num_kv_heads, model_config.head_dim, model_config.num_layers, block_size, dtype
    )
    num_blocks = budget_bytes // per_block
    if num_blocks == 0:
        raise ValueError(f"kv_cache_memory_bytes={budget_bytes} is less than one block ({per_block} bytes)")
    return num_blocks


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype

"""The argument checks every typed entry point of the native kernels runs before it passes raw pointers: a wrong
shape, dtype or layout raises ``ValueError`` here instead of corrupting memory there."""

from __future__ import annotations

import torch

from splitserve.engine.kv_formats import rows as kv_rows

# KV cache dtypes the kernels read and write (CacheType in the source): 16-bit caches are widened to float32 as
# they are loaded, int8 rows multiplied by their scales (engine/kv_formats/rows.py), so the attention's arithmetic is
# float32 whatever the cache holds.
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}


def supports_head_dim(head_dim: int) -> bool:
    """The attention kernels take heads of up to 512 in multiples of 8 (AVX2 vectors)."""
    return head_dim % 8 == 0 and head_dim <= 512


def supports_cache_dtype(dtype: torch.dtype) -> bool:
    """The attention kernels read and write float32, bfloat16, float16 and int8 caches."""
    return dtype in CACHE_TYPES


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, what: str, head_dim: int) -> None:
    """Both caches of one ``CACHE_TYPES`` dtype, alike in shape, their rows holding ``head_dim`` values."""
    check_args(k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_TYPES,
           f"{what}: caches must both be one of {', '.join(str(t) for t in CACHE_TYPES)}, "
           f"got {k_cache.dtype} and {v_cache.dtype}")
    check_args(k_cache.shape == v_cache.shape and kv_rows.head_dim_of(k_cache) == head_dim,
               f"{what}: caches {tuple(k_cache.shape)} do not hold rows of head_dim {head_dim}")


def check_args(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_cache_write(positions: torch.Tensor, slot_mapping: torch.Tensor, tokens: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, num_kv_heads: int, head_dim: int, what: str) -> None:
    """The arguments of a step that rotates its tokens' q and k and writes their k and v to the caches: positions and
    slots one per token (int64), caches [num_blocks, block_size, Hkv, row] contiguous, alike, of a ``CACHE_TYPES``
    dtype, their rows holding head_dim values (kv_formats/rows.py)."""
    check_args(positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64
               and len(positions) == tokens == len(slot_mapping), f"{what}: bad positions or slot mapping")
    check_args(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
               and k_cache.shape[2] == num_kv_heads, f"{what}: caches do not match")
    check_caches(k_cache, v_cache, what, head_dim)


def check_own_keys(own_keys: torch.Tensor | None, rows: tuple[int, ...], k_cache: torch.Tensor, what: str) -> None:
    """None, or float16 keys [*rows, Hkv, D] (contiguous) that a scaled pool's queries read for their own blocks'
    (kv_formats/open_keys.py): a decode step's [B, block_size], a prefill segment's [prefix % block_size + n]."""
    shape = (*rows, k_cache.shape[2], kv_rows.head_dim_of(k_cache))
    check_args(own_keys is None or (kv_rows.is_scaled(k_cache.dtype) and own_keys.dtype == torch.float16
                                    and own_keys.is_contiguous() and tuple(own_keys.shape) == shape),
               f"{what}: own keys must be None or float16 {shape}")


def pointer(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, or None (NULL) for an optional argument left out."""
    return None if t is None else t.data_ptr()


HeadNorms = tuple[torch.Tensor, torch.Tensor]  # Qwen3's q and k norm weights, [D] each


def head_norm_pointers(norms: HeadNorms | None, head_dim: int, what: str) -> tuple[int | None, int | None]:
    """The q and k norm weights' pointers for a layer input that normalizes each q and k head over D before RoPE
    (Qwen3); (None, None) without them."""
    if norms is None:
        return None, None
    check_args(all(w.dtype == torch.float32 and w.is_contiguous() and w.shape == (head_dim,) for w in norms),
               f"{what}: q and k norm weights must be float32 [{head_dim}]")
    return norms[0].data_ptr(), norms[1].data_ptr()

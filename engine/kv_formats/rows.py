"""How the KV pool stores one (token, head)'s K or V, a *row*: the one place in Python that knows the pool's formats.

- A float pool (``float32``, ``bfloat16``, ``float16``) stores a row as its ``head_dim`` values in that dtype.
- An ``int8`` pool stores ``head_dim`` int8 codes followed by a float16 scale for each group of ``SCALE_GROUP`` (16)
  consecutive channels, two bytes each (the pool tensor's last dimension is ``head_dim + 2 * ceil(head_dim / 16)``,
  ``head_dim + head_dim / 8`` for a multiple of 16); a value is ``code * its group's scale``. A scale is the group's
  ``amax / 127`` rounded up to a float16 (saturating at float16's largest; an all-zero group gets 0), the codes
  ``round(x / scale)`` (ties to even) in [-127, 127]: the ``int8`` KV codec's scheme (kvtransfer/codecs/symmetric.py),
  so a pool's rows are that codec's payload and scales as they lie. The scales stay within the row: a row is a
  self-contained, write-once unit (a token's rows are final when written, as a float pool's are). A scale per 16
  channels, not one per row: keys have outlier channels, and a row's one scale spends most of the other channels'
  8 bits on them (docs/kv_cache.md has the measured quality of both).

The native kernels read and write the same layout (``CacheElem<kInt8>`` in kernels/csrc/cache_elems.h) and must
agree with ``store`` bit for bit (tests/test_kv_rows.py holds them to it).
"""

from __future__ import annotations

import math

import torch

from splitserve.engine.config import CACHE_DTYPES
from splitserve.engine.kv_formats.scales import (
    divide,
    divide_by_groups,
    group_amax,
    round_up_to_float16,
    times_groups,
)

POOL_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in CACHE_DTYPES}  # by their names
SCALE_GROUP = 16  # channels that share a scale in a scaled pool's row
_SCALED = frozenset({torch.int8})
_INT8_MAX = 127.0
_FLOAT16_MAX = torch.finfo(torch.float16).max


def pool_dtype(name: str | torch.dtype) -> torch.dtype:
    return name if isinstance(name, torch.dtype) else POOL_DTYPES[name]


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether rows of this dtype carry scales (and read back as float32)."""
    return dtype in _SCALED


def scale_groups(head_dim: int) -> int:
    """Scales in a scaled row of ``head_dim`` values."""
    return math.ceil(head_dim / SCALE_GROUP)


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements a row takes in a pool of ``dtype``: its values, and a scaled format's scales (2 bytes each)."""
    return head_dim + 2 * scale_groups(head_dim) if is_scaled(dtype) else head_dim


def head_dim_of(pool: torch.Tensor) -> int:
    """The head_dim of a pool tensor [..., row]: ``row_width``'s inverse (each 16 values of a scaled row come with
    2 bytes of scale, a last, shorter group with 2 more)."""
    width = pool.shape[-1]
    if not is_scaled(pool.dtype):
        return width
    whole, rest = divmod(width, SCALE_GROUP + 2)
    head_dim = whole * SCALE_GROUP + max(rest - 2, 0)
    if row_width(pool.dtype, head_dim) != width:
        raise ValueError(f"a {pool.dtype} row of {width} elements holds no whole head_dim")
    return head_dim


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """What ``load`` returns for rows of ``dtype``: the dtype itself, or float32 for a scaled format (code * scale
    is exact in float32: an 8-bit code times an 11-bit mantissa)."""
    return torch.float32 if is_scaled(dtype) else dtype


def store(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` [..., head_dim] (any float dtype) as rows of ``dtype`` [..., row_width]. A tensor already of
    ``dtype`` is rows of it and passes unchanged (a scaled pool's rows as a push carries them)."""
    if not is_scaled(dtype) or values.dtype == dtype:
        return values.to(dtype)
    x = values.float()
    wanted = divide(group_amax(x, SCALE_GROUP), _INT8_MAX).clamp_(max=_FLOAT16_MAX)
    scales = round_up_to_float16(wanted)  # [..., G] float16
    codes = divide_by_groups(x, scales.float(), SCALE_GROUP).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return join(codes, scales)


def load(rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows [..., row_width] as values [..., head_dim]: in ``dtype`` if given, else ``value_dtype(rows.dtype)``."""
    if not is_scaled(rows.dtype):
        return rows if dtype is None else rows.to(dtype)
    codes, scales = split(rows)
    values = times_groups(codes.float(), scales.float(), SCALE_GROUP)
    return values if dtype is None or dtype == torch.float32 else values.to(dtype)


def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A scaled format's rows [..., row_width] as (codes [..., head_dim], a view, and float16 scales [..., G])."""
    head_dim = head_dim_of(rows)
    return rows[..., :head_dim], rows[..., head_dim:].contiguous().view(torch.float16)


def join(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``split``'s inverse: int8 codes [..., head_dim] and float16 scales [..., G] as rows [..., row_width]."""
    return torch.cat([codes, scales.view(torch.int8)], dim=-1)

"""How the KV pool stores one (token, head)'s K or V, a *row*: the one place in Python that knows the pool's formats.

- A float pool (``float32``, ``bfloat16``, ``float16``) stores a row as its ``head_dim`` values in that dtype.
- An ``int8`` pool stores ``head_dim`` int8 codes followed by the row's scale, a float16 in the next two bytes (the
  pool tensor's last dimension is ``head_dim + 2``); a value is ``code * scale``. The scale is ``amax / 127`` rounded
  up to a float16 (saturating at float16's largest; an all-zero row gets 0), the codes ``round(x / scale)`` (ties to
  even) in [-127, 127]: the ``int8`` KV codec's scheme (kvtransfer/codecs/symmetric.py), so a pool's rows are that
  codec's payload and scales as they lie. One scale per row, not per group of channels: it is what keeps a row a
  self-contained, write-once unit (a token's rows are final when written, as a float pool's are), and at 8 bits the
  keys' outlier channels cost little (docs/kv_cache.md has the measured quality).

The native kernels read and write the same layout (``CacheElem<kInt8>`` in kernels/csrc/cache_elems.h) and must
agree with ``store`` bit for bit (tests/test_kv_rows.py holds them to it).
"""

from __future__ import annotations

import torch

from splitserve.engine.config import CACHE_DTYPES
from splitserve.engine.kv_formats.scales import divide, round_up_to_float16

POOL_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in CACHE_DTYPES}  # by their names
_SCALE_ELEMS = {torch.int8: 2}  # elements after a row's codes that hold its float16 scale
_INT8_MAX = 127.0
_FLOAT16_MAX = torch.finfo(torch.float16).max


def pool_dtype(name: str | torch.dtype) -> torch.dtype:
    return name if isinstance(name, torch.dtype) else POOL_DTYPES[name]


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether rows of this dtype carry a scale (and read back as float32)."""
    return dtype in _SCALE_ELEMS


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements a row takes in a pool of ``dtype``: its values, and a scaled format's scale."""
    return head_dim + _SCALE_ELEMS.get(dtype, 0)


def head_dim_of(pool: torch.Tensor) -> int:
    """The head_dim of a pool tensor [..., row]."""
    return pool.shape[-1] - _SCALE_ELEMS.get(pool.dtype, 0)


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
    wanted = divide(x.abs().amax(dim=-1, keepdim=True), _INT8_MAX).clamp_(max=_FLOAT16_MAX)
    scale = round_up_to_float16(wanted)  # [..., 1] float16
    scale32 = scale.float()
    codes = (x / torch.where(scale32 > 0, scale32, 1.0)).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def load(rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows [..., row_width] as values [..., head_dim]: in ``dtype`` if given, else ``value_dtype(rows.dtype)``."""
    if not is_scaled(rows.dtype):
        return rows if dtype is None else rows.to(dtype)
    codes, scales = split(rows)
    values = codes.float() * scales.float().unsqueeze(-1)
    return values if dtype is None or dtype == torch.float32 else values.to(dtype)


def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A scaled format's rows [..., row_width] as (codes [..., head_dim], float16 scales [...]), views."""
    head_dim = head_dim_of(rows)
    return rows[..., :head_dim], rows[..., head_dim:].contiguous().view(torch.float16).squeeze(-1)


def join(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``split``'s inverse: int8 codes [..., head_dim] and float16 scales [...] as rows [..., head_dim + 2]."""
    return torch.cat([codes, scales.unsqueeze(-1).view(torch.int8)], dim=-1)

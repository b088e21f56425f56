"""How quantizing KV formats store their scales and range ends: float16, rounded outward (the KV codecs, and the
int8 KV pool, engine/kv_formats/rows.py).

A scale or range end is rounded to float16 *away from the data* (scales up, minimums down, maximums up), and the
encoder quantizes with the rounded value it stores. So the quantization grid always covers the data (no value
clips), and the error bound a codec states holds for the very scales its decoder reads. Float16 rather than
float32 keeps the overhead at 2 bytes per scale, which the size targets need (int8, a scale per 16 elements: 1.125
bytes/element).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_FLOAT16_MAX = torch.finfo(torch.float16).max


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device. CUDA divides by a Python number (or a CPU scalar) by
    multiplying with its reciprocal, an ulp off the quotient at times; a divisor on x's own device is divided by.
    Scales and steps must be the same bits wherever they are computed: an encoder on a GPU and one on a CPU write
    the same bytes, and a decoder on either reads them back alike."""
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def by_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [..., D] as its groups of ``group`` consecutive elements, [..., ceil(D / group), group]: a view where D is
    a whole number of groups, else a copy whose last group is padded with zeros. ``from_groups`` undoes it."""
    size = x.shape[-1]
    groups = math.ceil(size / group)
    if groups * group > size:
        x = F.pad(x, (0, groups * group - size))
    return x.view(*x.shape[:-1], groups, group)


def from_groups(x: torch.Tensor, size: int) -> torch.Tensor:
    """``by_group``'s inverse: [..., G, group] -> the first ``size`` elements of each row, [..., size]."""
    flat = x.flatten(-2)
    return flat if flat.shape[-1] == size else flat[..., :size].contiguous()


def group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """The largest magnitude of each group of ``group`` consecutive elements of ``x``'s last dimension [..., D] ->
    [..., ceil(D / group)] (a last, shorter group over the elements left). Several power-of-two groups a row by
    halving maxima (1.6x faster than amax's reduction over 16 elements on a CPU; a maximum is exact, so the same
    result); one group a row, or groups of another size, by amax."""
    if group >= x.shape[-1]:
        return x.abs().amax(dim=-1, keepdim=True)
    magnitudes = by_group(x.abs(), group)  # zero padding: no magnitude
    if group & (group - 1):
        return magnitudes.amax(dim=-1)
    while magnitudes.shape[-1] > 1:
        half = magnitudes.shape[-1] // 2
        magnitudes = torch.maximum(magnitudes[..., :half], magnitudes[..., half:])
    return magnitudes[..., 0]


def divide_by_groups(x: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [..., D] divided by its groups' ``scales`` [..., G] (float32), a zero scale as 1 (its group is all
    zeros): broadcast over each group, never widened to one scale per element."""
    safe = torch.where(scales > 0, scales, 1.0)
    return from_groups(by_group(x, group) / safe.unsqueeze(-1), x.shape[-1])


def times_groups(x: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [..., D] times its groups' ``scales`` [..., G], broadcast over each group."""
    return from_groups(by_group(x, group) * scales.unsqueeze(-1), x.shape[-1])


def round_up_to_float16(x: torch.Tensor) -> torch.Tensor:
    """The smallest float16 >= each element of ``x`` (float32). ValueError beyond float16's range."""
    return _round_to_float16(x, toward=float("inf"))


def round_down_to_float16(x: torch.Tensor) -> torch.Tensor:
    """The largest float16 <= each element of ``x`` (float32). ValueError beyond float16's range."""
    return _round_to_float16(x, toward=float("-inf"))


def _round_to_float16(x: torch.Tensor, toward: float) -> torch.Tensor:
    if bool((x.abs() > _FLOAT16_MAX).any()):
        raise ValueError(f"KV values too large for float16 scales (|value| > {_FLOAT16_MAX:g} after scaling)")
    nearest = x.to(torch.float16)
    # Nearest rounding lands on the wrong side of x about half the time; step one float16 toward `toward` there.
    wrong_side = (nearest.float() < x) if toward > 0 else (nearest.float() > x)
    stepped = torch.nextafter(nearest, torch.full_like(nearest, toward))
    return torch.where(wrong_side, stepped, nearest)

"""The ``int4`` codec, KIVI-style (Liu et al., ICML 2024): keys per channel, values per token, 4-bit asymmetric.

Keys carry outlier *channels*, so each channel is quantized over a group of G = 32 tokens (the last group of a range
may be shorter); values have no such structure and are quantized per (token, head) row. Either way, a set of
elements with range [lo, hi] is coded as q = round((x - lo) / step), step = (hi - lo) / 15, q in 0..15,
and decodes to lo + q * step: error <= step / 2.

Layout:
- ``payload``: the 4-bit codes of the [T, H, D] tensor in C order, two per byte, the first in the low nibble
  (a trailing odd element gets a zero high nibble): ceil(T * H * D / 2) bytes.
- values: ``scales`` = float16 [T, H, 2], (lo, hi) of each row, rounded outward (scales.py).
- keys: n = ceil(T / G) groups; ``scales`` = float16 [n, H, 2], the (lo, hi) of each (group, head) over all its
  tokens and channels, rounded outward; then uint8 [n, H, D, 2], each channel's (lo, hi) as codes on the 255-step
  grid of its head's range (lo rounded down, hi up). Float16 (lo, hi) per channel would cost 4 / G = 0.125
  bytes/element and miss the 3.5x-over-bf16 target; the codes cost 2 / G. The price: a channel's range widens by
  at most two steps of its head's range / 255, so key error <= (channel range + 2 * head range / 255) / 30
  (ranges taken after the float16 outward rounding).

bytes_per_element = (K + V) / 2, K = 1/2 + (4 + 2 * head_dim) / (G * head_dim), V = 1/2 + 4 / head_dim
(0.5635 at head_dim 64, full groups: 3.55x smaller than bf16).
"""

from __future__ import annotations

import math

import torch

from kvtransfer.codecs.base import EncodedKV, KVCodec, KVKind, dtype_name, tensor_from_bytes, tensor_to_bytes
from kvtransfer.codecs.scales import round_down_to_float16, round_up_to_float16

KEY_GROUP_TOKENS = 32  # G
_LEVELS = 15  # 4-bit codes 0..15
_RANGE_CODE_LEVELS = 255  # uint8 codes of a key channel's range ends
_ENDS_BYTES = 4  # a float16 (lo, hi) pair


class Int4Codec(KVCodec):
    name = "int4"

    def bytes_per_element(self, head_dim: int, cache_dtype: torch.dtype = torch.float32) -> float:
        key = 0.5 + (_ENDS_BYTES + 2 * head_dim) / (KEY_GROUP_TOKENS * head_dim)
        value = 0.5 + _ENDS_BYTES / head_dim
        return (key + value) / 2

    def encoded_nbytes(self, shape: tuple[int, ...], kind: KVKind, dtype: str) -> tuple[int, int]:
        tokens, heads, head_dim = shape
        payload = (math.prod(shape) + 1) // 2
        if kind == "v":
            return payload, tokens * heads * _ENDS_BYTES
        groups = -(-tokens // KEY_GROUP_TOKENS)
        return payload, groups * heads * (_ENDS_BYTES + 2 * head_dim)

    def _encode(self, x: torch.Tensor, kind: KVKind) -> EncodedKV:
        encode = _encode_keys if kind == "k" else _encode_values
        codes, scales = encode(x.float())
        payload = tensor_to_bytes(_pack_nibbles(codes))
        return EncodedKV(self.name, kind, dtype_name(x.dtype), tuple(x.shape), payload, scales)

    def _decode(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        packed = tensor_from_bytes(enc.payload, torch.uint8, (len(enc.payload),), device)
        codes = _unpack_nibbles(packed, math.prod(enc.shape)).reshape(enc.shape)  # [T, H, D]
        decode = _decode_keys if enc.kind == "k" else _decode_values
        return decode(codes, enc.scales)


def _encode_values(x: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """x: [T, H, D] float32 -> codes [T, H, D] uint8 and the scales bytes."""
    # amin and amax apart: torch.aminmax is several times slower on CPU.
    lo = round_down_to_float16(x.amin(dim=-1, keepdim=True))  # [T, H, 1]
    hi = round_up_to_float16(x.amax(dim=-1, keepdim=True))
    codes = _quantize(x, lo.float(), hi.float())
    return codes, tensor_to_bytes(torch.cat([lo, hi], dim=-1))


def _decode_values(codes: torch.Tensor, scales: bytes) -> torch.Tensor:
    tokens, heads, _ = codes.shape
    ends = tensor_from_bytes(scales, torch.float16, (tokens, heads, 2), codes.device).float()  # [T, H, 2]
    return _dequantize(codes, ends[..., :1], ends[..., 1:])


def _encode_keys(x: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """x: [T, H, D] float32 -> codes [T, H, D] uint8 and the scales bytes."""
    groups = _token_groups(x)  # [n_i, g_i, H, D] views
    lo = torch.cat([group.amin(dim=1) for group in groups])  # [n, H, D] per channel
    hi = torch.cat([group.amax(dim=1) for group in groups])
    head_lo = round_down_to_float16(lo.amin(dim=-1, keepdim=True))  # [n, H, 1]
    head_hi = round_up_to_float16(hi.amax(dim=-1, keepdim=True))
    lo_code, hi_code = _channel_range_codes(lo, hi, head_lo.float(), head_hi.float())  # [n, H, D] uint8
    channel_lo, channel_hi = _channel_range(lo_code, hi_code, head_lo.float(), head_hi.float())
    codes = _per_group(groups, channel_lo, channel_hi, _quantize)
    scales = tensor_to_bytes(torch.cat([head_lo, head_hi], dim=-1)) + tensor_to_bytes(
        torch.stack([lo_code, hi_code], dim=-1)
    )
    return codes, scales


def _decode_keys(codes: torch.Tensor, scales: bytes) -> torch.Tensor:
    tokens, heads, head_dim = codes.shape
    groups = -(-tokens // KEY_GROUP_TOKENS)
    split = groups * heads * _ENDS_BYTES
    ends = tensor_from_bytes(scales[:split], torch.float16, (groups, heads, 2), codes.device).float()
    range_codes = tensor_from_bytes(scales[split:], torch.uint8, (groups, heads, head_dim, 2), codes.device)
    channel_lo, channel_hi = _channel_range(range_codes[..., 0], range_codes[..., 1], ends[..., :1], ends[..., 1:])
    return _per_group(_token_groups(codes), channel_lo, channel_hi, _dequantize)


def _channel_range_codes(
    lo: torch.Tensor, hi: torch.Tensor, head_lo: torch.Tensor, head_hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's (lo, hi) as uint8 steps above head_lo, rounded outward so the coded range covers it."""
    step = (head_hi - head_lo) / _RANGE_CODE_LEVELS
    safe_step = torch.where(step > 0, step, 1.0)  # a constant head: every code 0
    lo_code = ((lo - head_lo) / safe_step).floor_().clamp_(0, _RANGE_CODE_LEVELS).to(torch.uint8)
    hi_code = ((hi - head_lo) / safe_step).ceil_().clamp_(0, _RANGE_CODE_LEVELS).to(torch.uint8)
    return lo_code, hi_code


def _channel_range(
    lo_code: torch.Tensor, hi_code: torch.Tensor, head_lo: torch.Tensor, head_hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 (lo, hi) a channel's codes stand for; encoder and decoder both quantize with exactly these."""
    step = (head_hi - head_lo) / _RANGE_CODE_LEVELS
    return head_lo + lo_code.float() * step, head_lo + hi_code.float() * step


def _token_groups(t: torch.Tensor) -> list[torch.Tensor]:
    """[T, ...] -> views [n, G, ...] of the full groups, then [1, T % G, ...] of the tail, in token order."""
    full = t.shape[0] // KEY_GROUP_TOKENS * KEY_GROUP_TOKENS
    groups = []
    if full:
        groups.append(t[:full].unflatten(0, (-1, KEY_GROUP_TOKENS)))
    if full < t.shape[0]:
        groups.append(t[full:].unsqueeze(0))
    return groups


def _per_group(groups: list[torch.Tensor], lo: torch.Tensor, hi: torch.Tensor, fn) -> torch.Tensor:
    """Apply ``fn(group, lo, hi)`` to each [n_i, g_i, H, D] group with its [n_i, H, D] ranges; -> [T, H, D]."""
    sizes = [group.shape[0] for group in groups]
    outs = [
        fn(group, group_lo.unsqueeze(1), group_hi.unsqueeze(1)).flatten(0, 1)
        for group, group_lo, group_hi in zip(groups, lo.split(sizes), hi.split(sizes))
    ]
    return torch.cat(outs)


def _quantize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """float32 x within [lo, hi] (broadcast) -> uint8 codes 0..15."""
    step = (hi - lo) / _LEVELS
    safe_step = torch.where(step > 0, step, 1.0)  # a constant row: x - lo is 0
    return (x - lo).div_(safe_step).round_().clamp_(0, _LEVELS).to(torch.uint8)


def _dequantize(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32 lo + q * step, the step computed exactly as ``_quantize`` did."""
    step = (hi - lo) / _LEVELS
    return torch.addcmul(lo, codes.float(), step)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15, any shape -> [ceil(N / 2)] uint8, element 2i in the low nibble of byte i."""
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[ceil(count / 2)] uint8 -> the first ``count`` 4-bit codes, [count] uint8."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)[:count]

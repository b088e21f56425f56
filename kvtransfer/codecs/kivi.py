"""KIVI codecs (Liu et al., ICML 2024): keys per channel, values per token, ``bits``-bit asymmetric; ``kivi8``,
``kivi4``, ``kivi2`` keep the prompt's first ``sinks`` tokens and its last ``window`` tokens in float16, and
``int4`` is the 4-bit one without them (the comparison that shows what the kept tokens buy).

Why: keys carry outlier *channels*, so each channel is quantized over a group of G tokens (``key_group``, 32 by
default); values have no such structure and are quantized per (token, head) row. The first tokens are attention
sinks (every later token attends to them) and the last prompt tokens are what the next tokens attend to most, so
a few of them at 16 bits buy back most of the quantization error where it shows in the answer. Which tokens are
kept depends on where a tensor lies in its prompt (``KVSpan``): the sender and the receiver both know it from the
chunk's token range and the prompt's length, so it costs no bytes.

Quantizing: a set of elements with range [lo, hi] is coded as q = round((x - lo) / step), step = (hi - lo) / L,
L = 2^bits - 1, and decodes to lo + q * step: error <= step / 2.

Layout of a [T, H, D] tensor whose first ``h`` and last ``t`` rows are kept (M = T - h - t quantized rows between):
- ``payload``: the ``bits``-bit codes of the [M, H, D] middle in C order, 8 / bits per byte, the first in the low
  bits (the last byte padded with zero codes): ceil(M * H * D * bits / 8) bytes; then the h kept head rows and
  the t kept tail rows as float16 [h + t, H, D] (exact for a float16 cache, rounded to nearest otherwise).
- values: ``scales`` = float16 [M, H, 2], (lo, hi) of each row, rounded outward (engine/kv_formats/scales.py).
- keys: n = ceil(M / G) groups; ``scales`` = float16 [n, H, 2], the (lo, hi) of each (group, head) over all its
  tokens and channels, rounded outward; then uint8 [n, H, D, 2], each channel's (lo, hi) as codes on the 255-step
  grid of its head's range (lo rounded down, hi up). Float16 (lo, hi) per channel would cost 4 / G bytes/element;
  the codes cost 2 / G. The price: a channel's range widens by at most two steps of its head's range / 255, so key
  error <= (channel range + 2 * head range / 255) / (2 L) (ranges taken after the float16 outward rounding).

bytes_per_element (long ranges, kept rows amortized away) = (K + V) / 2, K = bits/8 + (4 + 2 D) / (G D),
V = bits/8 + 4 / D: at D = 64, int4/kivi4 0.5635 (3.55x smaller than bf16), kivi2 0.3135 (6.4x), kivi8 1.0635.
"""

from __future__ import annotations

import math

import torch

from splitserve.engine.kv_formats.scales import divide, round_down_to_float16, round_up_to_float16
from splitserve.kvtransfer.codecs.base import (
    EncodedKV,
    KVCodec,
    KVKind,
    KVSpan,
    dtype_name,
    tensor_from_bytes,
    tensor_to_bytes,
)

KEY_GROUP_TOKENS = 32  # G
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 32  # R
_RANGE_CODE_LEVELS = 255  # uint8 codes of a key channel's range ends
_ENDS_BYTES = 4  # a float16 (lo, hi) pair
_KEPT_BYTES = 2  # float16 per kept element


class KiviCodec(KVCodec):
    """``bits``-bit KIVI with ``sinks`` first and ``window`` last prompt tokens kept in float16, key channels
    quantized over groups of ``key_group`` tokens. The registry builds each with the defaults; the other settings
    are for measuring (scripts/codec_diagnosis.py): sender and receiver must agree on them."""

    name: str
    bits: int

    def __init__(self, sinks: int = DEFAULT_SINKS, window: int = DEFAULT_WINDOW, key_group: int = KEY_GROUP_TOKENS):
        if sinks < 0 or window < 0 or key_group < 1:
            raise ValueError(f"sinks and window must be >= 0 and key_group >= 1, got {sinks}, {window}, {key_group}")
        self.sinks = sinks
        self.window = window
        self.key_group = key_group
        self.levels = (1 << self.bits) - 1

    def bytes_per_element(self, head_dim: int, cache_dtype: torch.dtype = torch.float32) -> float:
        key = self.bits / 8 + (_ENDS_BYTES + 2 * head_dim) / (self.key_group * head_dim)
        value = self.bits / 8 + _ENDS_BYTES / head_dim
        return (key + value) / 2

    def encoded_nbytes(self, shape: tuple[int, ...], kind: KVKind, dtype: str,
                       span: KVSpan | None = None) -> tuple[int, int]:
        tokens, heads, head_dim = shape
        head, tail = self.kept_rows(tokens, span)
        middle = tokens - head - tail
        payload = -(-middle * heads * head_dim * self.bits // 8) + (head + tail) * heads * head_dim * _KEPT_BYTES
        if kind == "v":
            return payload, middle * heads * _ENDS_BYTES
        groups = -(-middle // self.key_group)
        return payload, groups * heads * (_ENDS_BYTES + 2 * head_dim)

    def kept_rows(self, tokens: int, span: KVSpan | None) -> tuple[int, int]:
        """(h, t): how many of the tensor's first and last rows are kept in float16 (h + t <= tokens)."""
        start, prompt_tokens = span or (0, tokens)
        head = min(tokens, max(0, self.sinks - start))
        tail = min(tokens - head, max(0, start + tokens - max(prompt_tokens - self.window, start)))
        return head, tail

    def _encode(self, x: torch.Tensor, kind: KVKind, span: KVSpan | None) -> EncodedKV:
        tokens = x.shape[0]
        head, tail = self.kept_rows(tokens, span)
        middle = x[head:tokens - tail].float()
        encode = self._encode_keys if kind == "k" else self._encode_values
        codes, scales = encode(middle) if len(middle) else (middle.new_empty(0, dtype=torch.uint8), b"")
        kept = torch.cat([x[:head], x[tokens - tail:]]).to(torch.float16)
        payload = tensor_to_bytes(pack_codes(codes, self.bits)) + tensor_to_bytes(kept)
        return EncodedKV(self.name, kind, dtype_name(x.dtype), tuple(x.shape), payload, scales, span)

    def _decode(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        tokens, heads, head_dim = enc.shape
        head, tail = self.kept_rows(tokens, enc.span)
        middle_shape = (tokens - head - tail, heads, head_dim)
        packed_len = -(-math.prod(middle_shape) * self.bits // 8)
        if not head + tail:
            return self._decode_middle(enc, packed_len, middle_shape, device)
        kept = tensor_from_bytes(enc.payload[packed_len:], torch.float16, (head + tail, heads, head_dim), device)
        if not middle_shape[0]:
            return kept
        middle = self._decode_middle(enc, packed_len, middle_shape, device)
        return torch.cat([kept[:head].float(), middle, kept[head:].float()])

    def _decode_middle(self, enc: EncodedKV, packed_len: int, middle_shape: tuple[int, int, int],
                       device: torch.device) -> torch.Tensor:
        packed = tensor_from_bytes(enc.payload[:packed_len], torch.uint8, (packed_len,), device)
        codes = unpack_codes(packed, math.prod(middle_shape), self.bits).reshape(middle_shape)
        decode = self._decode_keys if enc.kind == "k" else self._decode_values
        return decode(codes, enc.scales)

    def _encode_values(self, x: torch.Tensor) -> tuple[torch.Tensor, bytes]:
        """x: [M, H, D] float32 -> codes [M, H, D] uint8 and the scales bytes."""
        # amin and amax apart: torch.aminmax is several times slower on CPU.
        lo = round_down_to_float16(x.amin(dim=-1, keepdim=True))  # [M, H, 1]
        hi = round_up_to_float16(x.amax(dim=-1, keepdim=True))
        codes = self._quantize(x, lo.float(), hi.float())
        return codes, tensor_to_bytes(torch.cat([lo, hi], dim=-1))

    def _decode_values(self, codes: torch.Tensor, scales: bytes) -> torch.Tensor:
        tokens, heads, _ = codes.shape
        ends = tensor_from_bytes(scales, torch.float16, (tokens, heads, 2), codes.device).float()  # [M, H, 2]
        return self._dequantize(codes, ends[..., :1], ends[..., 1:])

    def _encode_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, bytes]:
        """x: [M, H, D] float32 -> codes [M, H, D] uint8 and the scales bytes."""
        groups = _token_groups(x, self.key_group)  # [n_i, g_i, H, D] views
        lo = torch.cat([group.amin(dim=1) for group in groups])  # [n, H, D] per channel
        hi = torch.cat([group.amax(dim=1) for group in groups])
        head_lo = round_down_to_float16(lo.amin(dim=-1, keepdim=True))  # [n, H, 1]
        head_hi = round_up_to_float16(hi.amax(dim=-1, keepdim=True))
        lo_code, hi_code = _channel_range_codes(lo, hi, head_lo.float(), head_hi.float())  # [n, H, D] uint8
        channel_lo, channel_hi = _channel_range(lo_code, hi_code, head_lo.float(), head_hi.float())
        codes = _per_group(groups, channel_lo, channel_hi, self._quantize)
        scales = tensor_to_bytes(torch.cat([head_lo, head_hi], dim=-1)) + tensor_to_bytes(
            torch.stack([lo_code, hi_code], dim=-1)
        )
        return codes, scales

    def _decode_keys(self, codes: torch.Tensor, scales: bytes) -> torch.Tensor:
        tokens, heads, head_dim = codes.shape
        groups = -(-tokens // self.key_group)
        split = groups * heads * _ENDS_BYTES
        ends = tensor_from_bytes(scales[:split], torch.float16, (groups, heads, 2), codes.device).float()
        range_codes = tensor_from_bytes(scales[split:], torch.uint8, (groups, heads, head_dim, 2), codes.device)
        channel_lo, channel_hi = _channel_range(range_codes[..., 0], range_codes[..., 1], ends[..., :1],
                                                ends[..., 1:])
        return _per_group(_token_groups(codes, self.key_group), channel_lo, channel_hi, self._dequantize)

    def _quantize(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """float32 x within [lo, hi] (broadcast) -> uint8 codes 0..L."""
        step = divide(hi - lo, self.levels)
        safe_step = torch.where(step > 0, step, 1.0)  # a constant row: x - lo is 0
        return (x - lo).div_(safe_step).round_().clamp_(0, self.levels).to(torch.uint8)

    def _dequantize(self, codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """uint8 codes -> float32 lo + q * step, the step computed exactly as ``_quantize`` did."""
        step = divide(hi - lo, self.levels)
        return torch.addcmul(lo, codes.float(), step)


class Kivi8Codec(KiviCodec):
    name = "kivi8"
    bits = 8


class Kivi4Codec(KiviCodec):
    name = "kivi4"
    bits = 4


class Kivi2Codec(KiviCodec):
    name = "kivi2"
    bits = 2


class Int4Codec(KiviCodec):
    """``int4``: 4-bit KIVI with no tokens kept."""

    name = "int4"
    bits = 4

    def __init__(self) -> None:
        super().__init__(sinks=0, window=0)


def _channel_range_codes(
    lo: torch.Tensor, hi: torch.Tensor, head_lo: torch.Tensor, head_hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's (lo, hi) as uint8 steps above head_lo, rounded outward so the coded range covers it."""
    step = divide(head_hi - head_lo, _RANGE_CODE_LEVELS)
    safe_step = torch.where(step > 0, step, 1.0)  # a constant head: every code 0
    lo_code = ((lo - head_lo) / safe_step).floor_().clamp_(0, _RANGE_CODE_LEVELS).to(torch.uint8)
    hi_code = ((hi - head_lo) / safe_step).ceil_().clamp_(0, _RANGE_CODE_LEVELS).to(torch.uint8)
    return lo_code, hi_code


def _channel_range(
    lo_code: torch.Tensor, hi_code: torch.Tensor, head_lo: torch.Tensor, head_hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 (lo, hi) a channel's codes stand for; encoder and decoder both quantize with exactly these."""
    step = divide(head_hi - head_lo, _RANGE_CODE_LEVELS)
    return head_lo + lo_code.float() * step, head_lo + hi_code.float() * step


def _token_groups(t: torch.Tensor, size: int) -> list[torch.Tensor]:
    """[T, ...] -> views [n, G, ...] of the full groups of G = ``size`` tokens, then [1, T % G, ...] of the tail,
    in token order."""
    full = t.shape[0] // size * size
    groups = []
    if full:
        groups.append(t[:full].unflatten(0, (-1, size)))
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


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2^bits, any shape -> [ceil(N * bits / 8)] uint8, element i at bits (i * bits) % 8 of byte
    i * bits // 8 (the low bits first)."""
    flat = codes.reshape(-1)
    per_byte = 8 // bits
    if per_byte == 1:
        return flat
    pad = -flat.numel() % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    lanes = flat.view(-1, per_byte)
    packed = lanes[:, 0].clone()
    for lane in range(1, per_byte):
        packed |= lanes[:, lane] << (lane * bits)
    return packed


def unpack_codes(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The inverse of ``pack_codes``: the first ``count`` codes, [count] uint8."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[:count]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]

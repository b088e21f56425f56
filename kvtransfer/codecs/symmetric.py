"""Symmetric scaled codecs: ``int8`` (a scale per 16 channels of each (token, head) row) and ``fp8`` (float8 e4m3fn, a
scale per row).

Each group of a row's channels (``int8``: 16 consecutive ones, a last, shorter group over those left; ``fp8``: all D)
gets one scale, ``amax / qmax`` over the group, rounded up to float16 (engine/kv_formats/scales.py); the group is
divided by it and cast: rounded to the nearest int8 in [-127, 127], or to the nearest e4m3fn (|y| <= 448). The int8 KV
pool stores its rows by the same rule (engine/kv_formats/rows.py), so its rows are this payload and these scales.
Keys and values are treated alike. An all-zero group gets scale 0 and decodes to zeros.

Layout: ``payload`` = codes [T, H, D] (int8, or e4m3fn bytes), ``scales`` = float16 [T, H, G] (G = ceil(D / 16) for
int8, 1 for fp8). bytes_per_element = 1 + 2 G / D: int8 1.125 (1.78x smaller than bf16), fp8 1.03125 at head_dim 64.
Int8's scales are per 16 channels because keys have outlier channels: one scale per row spends the other channels'
codes on them (top-1 agreement of an int8 KV pool, docs/kv_cache.md).

A variant may scale a kind per (head, channel) over the range's T tokens instead (``per_channel_kinds``; scales
float16 [H, D]), KIVI's remedy for keys' outlier channels. No registered codec does: ``bench codecs`` measures
``fp8@kc`` (fp8, keys per channel; bench/codec_variants.py) and it did not help (docs/PERFORMANCE.md, "KV codecs").

Error per element, ``s`` the stored scale (its group's, or its channel's): int8 <= s / 2; fp8 <= max(|x| / 16, s /
1024) (e4m3 keeps 3 mantissa bits: half an ulp is at most 2^-4 of the value for normals; subnormals are spaced 2^-9
apart in scaled units). So an e4m3 code's error is relative whatever the scale, except for values below e4m3's
normals (2^-6 in scaled units): per-channel scales help fp8 only where a row spans more than e4m3's 2^15 of dynamic
range.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.kv_formats.scales import (
    by_group,
    divide,
    divide_by_groups,
    from_groups,
    group_amax,
    round_up_to_float16,
)
from splitserve.kvtransfer.codecs.base import (
    EncodedKV,
    KVCodec,
    KVKind,
    KVSpan,
    dtype_name,
    tensor_buffer,
    tensor_from_bytes,
    tensor_to_bytes,
)

_SCALE_BYTES = 2  # float16
_FLOAT16_SIGN_AND_E4M3 = -16385  # 0xBFFF as int16: every bit but the float16 exponent's top one


class SymmetricScaledCodec(KVCodec):
    """One float16 scale per group of ``group`` channels of a (token, head) row (0: the whole row); subclasses say
    the code type and its largest magnitude, and may scale a kind per channel instead (``per_channel_kinds``)."""

    code_dtype: torch.dtype
    qmax: float
    group: int = 0  # channels per scale in a row; 0: all of them
    per_channel_kinds: tuple[str, ...] = ()  # kinds scaled per (head, channel) over the range's tokens

    def bytes_per_element(self, head_dim: int, cache_dtype: torch.dtype = torch.float32) -> float:
        per_token_kinds = 2 - len(self.per_channel_kinds)  # a per-channel kind's scales vanish over a long range
        return 1 + _SCALE_BYTES * self._groups(head_dim) / head_dim * per_token_kinds / 2

    def encoded_nbytes(self, shape: tuple[int, ...], kind: KVKind, dtype: str,
                       span: KVSpan | None = None) -> tuple[int, int]:
        return math.prod(shape), math.prod(self._scale_shape(shape, kind)) * _SCALE_BYTES

    def _groups(self, head_dim: int) -> int:
        return math.ceil(head_dim / self._group(head_dim))

    def _scale_shape(self, shape: tuple[int, ...], kind: str) -> tuple[int, int, int]:
        tokens, heads, head_dim = shape
        return (1, heads, head_dim) if kind in self.per_channel_kinds else (tokens, heads, self._groups(head_dim))

    def _encode(self, x: torch.Tensor, kind: KVKind, span: KVSpan | None) -> EncodedKV:
        x32 = x.float()  # [T, H, D]
        if kind in self.per_channel_kinds:
            amax = x32.abs().amax(dim=0, keepdim=True)  # [1, H, D]
        else:
            amax = group_amax(x32, self._group(x32.shape[-1]))  # [T, H, G]
        scale = round_up_to_float16(divide(amax, self.qmax))  # float16, amax's shape
        if self._scales_broadcast(kind, x32.shape[-1]):
            scaled = x32 / torch.where(scale > 0, scale.float(), 1.0)  # all-zero rows and channels stay zero
        else:
            scaled = divide_by_groups(x32, scale.float(), self.group)  # all-zero groups too
        codes = self._to_codes(scaled)  # [T, H, D]
        return EncodedKV(
            self.name, kind, dtype_name(x.dtype), tuple(x.shape), tensor_buffer(codes), tensor_to_bytes(scale)
        )

    def _decode(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        codes = tensor_from_bytes(enc.payload, self.code_dtype, enc.shape, device)  # [T, H, D]
        scale = tensor_from_bytes(enc.scales, torch.float16, self._scale_shape(enc.shape, enc.kind), device).float()
        head_dim = enc.shape[-1]
        if self._scales_broadcast(enc.kind, head_dim):
            return self._dequantize(codes, scale)
        return from_groups(self._dequantize(by_group(codes, self.group), scale.unsqueeze(-1)), head_dim)

    def _group(self, head_dim: int) -> int:
        return self.group or head_dim

    def _scales_broadcast(self, kind: str, head_dim: int) -> bool:
        """Whether a kind's scales ([1, H, D] per channel, or [T, H, 1], one a row) broadcast over its values as they
        lie; else they are [T, H, G], one per group of a row, and meet their values grouped (by_group)."""
        return kind in self.per_channel_kinds or self._groups(head_dim) == 1

    @abstractmethod
    def _to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        """Cast float32 values in [-qmax, qmax] (up to rounding) to codes; may overwrite ``scaled``."""

    @abstractmethod
    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """codes times float32 scales broadcast over them (codes [T, H, D] with scales [1, H, D] or [T, H, 1]; or
        codes by group [T, H, G, group] with scales [T, H, G, 1]) -> float32 of the codes' shape."""


class Int8Codec(SymmetricScaledCodec):
    name = "int8"
    code_dtype = torch.int8
    qmax = 127.0
    group = kv_rows.SCALE_GROUP
    pool_dtype = torch.int8  # an int8 pool's rows are this encoding: codes then their groups' float16 scales

    def _encode_rows(self, rows: torch.Tensor, kind: KVKind, span: KVSpan | None) -> EncodedKV:
        codes, scales = kv_rows.split(rows)
        return EncodedKV(self.name, kind, "float32", tuple(codes.shape), tensor_buffer(codes.contiguous()),
                         tensor_to_bytes(scales), span)

    def _decode_rows(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        codes = tensor_from_bytes(enc.payload, torch.int8, enc.shape, device)
        scales = tensor_from_bytes(enc.scales, torch.float16, self._scale_shape(enc.shape, enc.kind), device)
        return kv_rows.join(codes, scales)

    def _to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return codes.float() * scale


class FP8Codec(SymmetricScaledCodec):
    name = "fp8"
    code_dtype = torch.float8_e4m3fn
    qmax = 448.0  # the largest finite e4m3fn

    def _to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        # Clamp: e4m3fn has no inf, and an out-of-range cast is not guaranteed to saturate on every backend.
        return scaled.clamp_(-self.qmax, self.qmax).to(torch.float8_e4m3fn)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # torch's float8 -> float32 cast is ~6x slower on CPU than moving the bits into float16 by hand:
        # e4m3 "s eeee mmm" placed as float16 "s 0eeee mmm0000000" is the same number times 2^-8
        # (subnormals included). int8 -> int16 sign-extends, so after << 7 bit 14 must be cleared (0xBFFF).
        bits = codes.view(torch.int8).to(torch.int16).bitwise_left_shift_(7).bitwise_and_(_FLOAT16_SIGN_AND_E4M3)
        return bits.view(torch.float16) * (scale * 2.0**8)


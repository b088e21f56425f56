"""Codecs that send the elements themselves, no scales: ``none`` (the cache dtype as is) and ``bf16``.

Layout: ``payload`` is the [T, H, D] tensor's raw bytes in C order, in the cache dtype (``none``) or in bfloat16
(``bf16``); ``scales`` is empty. Encoding copies nothing: the payload is a view of the (converted) tensor, which the
wire layer copies once, into the message. ``none`` is lossless; ``bf16`` rounds to nearest bfloat16 (exact for a
bf16 cache).
"""

from __future__ import annotations

import math

import torch

from splitserve.kvtransfer.codecs import base
from splitserve.kvtransfer.codecs.base import (
    EncodedKV,
    KVCodec,
    KVKind,
    KVSpan,
    dtype_name,
    tensor_buffer,
    tensor_from_bytes,
)


class RawCodec(KVCodec):
    """``none``: bytes_per_element = the cache dtype's size (4 for float32, 2 for bfloat16/float16)."""

    name = "none"
    wire_dtype: torch.dtype | None = None  # None: the cache dtype

    def bytes_per_element(self, head_dim: int, cache_dtype: torch.dtype = torch.float32) -> float:
        return float((self.wire_dtype or cache_dtype).itemsize)

    def encoded_nbytes(self, shape: tuple[int, ...], kind: KVKind, dtype: str,
                       span: KVSpan | None = None) -> tuple[int, int]:
        return math.prod(shape) * (self.wire_dtype or base.CACHE_DTYPES[dtype]).itemsize, 0

    def _encode(self, x: torch.Tensor, kind: KVKind, span: KVSpan | None) -> EncodedKV:
        payload = tensor_buffer(x.to(self.wire_dtype or x.dtype))
        return EncodedKV(self.name, kind, dtype_name(x.dtype), tuple(x.shape), payload, b"")

    def _decode(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        return tensor_from_bytes(enc.payload, self.wire_dtype or base.CACHE_DTYPES[enc.dtype], enc.shape, device)


class BF16Codec(RawCodec):
    """``bf16``: bytes_per_element = 2."""

    name = "bf16"
    wire_dtype = torch.bfloat16

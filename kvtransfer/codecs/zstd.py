"""The ``+zstd`` suffix: any codec, then lossless zstd over its payload and its scales.

Layout: ``payload`` and ``scales`` are each one zstd frame (with its content size) of the inner codec's bytes;
empty scales stay empty. bytes_per_element is the inner codec's, the size before zstd: the real size depends on
the data (zeros and bf16's redundant exponents shrink; int4 codes of noisy data barely do).
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import zstandard

from splitserve.kvtransfer.codecs.base import ZSTD_SUFFIX, EncodedKV, KVCodec, KVKind, KVSpan


class ZstdCodec(KVCodec):
    """``<inner>+zstd``: ``inner``'s encoding with payload and scales zstd-compressed at ``level`` (1..22)."""

    def __init__(self, inner: KVCodec, level: int) -> None:
        if not 1 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"zstd level must be in 1..{zstandard.MAX_COMPRESSION_LEVEL}, got {level}")
        self.inner = inner
        self.level = level
        self.name = inner.name + ZSTD_SUFFIX
        # zstandard's (de)compressor objects are not thread-safe; one pair per thread, reused across calls.
        self._per_thread = threading.local()

    def bytes_per_element(self, head_dim: int, cache_dtype: torch.dtype = torch.float32) -> float:
        return self.inner.bytes_per_element(head_dim, cache_dtype)

    def encoded_nbytes(self, shape: tuple[int, ...], kind: KVKind, dtype: str, span: KVSpan | None = None) -> None:
        return None

    def _encode(self, x: torch.Tensor, kind: KVKind, span: KVSpan | None) -> EncodedKV:
        inner = self.inner.encode(x, kind, span)
        compress = self._compressor().compress
        scales = compress(inner.scales) if inner.scales else b""
        return dataclasses.replace(inner, codec=self.name, payload=compress(inner.payload), scales=scales)

    def _decode(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        payload_size, scales_size = self.inner.encoded_nbytes(enc.shape, enc.kind, enc.dtype, enc.span)
        payload = self._decompress(enc.payload, payload_size)
        scales = self._decompress(enc.scales, scales_size) if enc.scales else b""
        inner = dataclasses.replace(enc, codec=self.inner.name, payload=payload, scales=scales)
        return self.inner.decode(inner, device)

    def _decompress(self, frame: bytes, expected_size: int) -> bytes:
        # Check the frame's declared size first: a corrupt header must not make us allocate gigabytes.
        try:
            declared = zstandard.frame_content_size(frame)
            if declared != expected_size:
                raise ValueError(f"zstd frame declares {declared} bytes, the shape needs {expected_size}")
            return self._decompressor().decompress(frame)
        except zstandard.ZstdError as err:
            raise ValueError(f"corrupt zstd frame in a {self.name} tensor: {err}") from err

    def _compressor(self) -> zstandard.ZstdCompressor:
        if not hasattr(self._per_thread, "compressor"):
            self._per_thread.compressor = zstandard.ZstdCompressor(level=self.level)
        return self._per_thread.compressor

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        if not hasattr(self._per_thread, "decompressor"):
            self._per_thread.decompressor = zstandard.ZstdDecompressor()
        return self._per_thread.decompressor

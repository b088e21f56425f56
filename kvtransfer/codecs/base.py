"""The KV codec interface, the encoded form it produces, and the registry that finds a codec by name.

A codec turns one layer's K or V for a token range of one request, a tensor ``[T, H, D]`` (T tokens, H kv heads,
D head size, in the cache dtype), into an ``EncodedKV`` and back. The path of a chunk through it:

    get_codec("int8+zstd")                 name -> codec; its module is imported on first request
      .encode(x, kind, span) -> EncodedKV   prefill side; kind "k" or "v" (keys and values may be quantized apart);
                                            span: where x lies in its prompt (KIVI keeps its first and last tokens)
      .decode(enc, device) -> Tensor        decode side; the original dtype and shape, on ``device``
      .bytes_per_element(head_dim)          sizing: payload + scales per K/V element
      .encoded_nbytes(shape, kind, dtype, span)  exact (payload, scales) byte counts, or None when data-dependent

Codecs register below by name as "module:Class" and are imported lazily, as vLLM's KV connectors are.
Every name may take the suffix ``+zstd``: the same codec, then zstd over its payload and scales (lossless).

Byte layout: ``payload`` and ``scales`` are the raw little-endian bytes of C-contiguous tensors, in the layout each
codec's module docstring states, so the wire layer copies them into its message unchanged. A payload may be a
read-only view of a tensor's memory (``tensor_buffer``) rather than bytes, which spares a copy of the largest part.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch

from splitserve.engine import config as engine_config
from splitserve.engine.kv_cache import KV_KINDS, KVKind
from splitserve.runtime.kv_codecs import KV_CODECS, ZSTD_SUFFIX, kv_codec_names

if sys.byteorder != "little":  # the byte layout is little-endian and tensors are copied to bytes as they lie
    raise ImportError("kvtransfer codecs need a little-endian host")

# Cache dtypes a codec accepts, by the name an EncodedKV carries: the engine's (engine/config.py).
CACHE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in engine_config.KV_VALUE_DTYPES}


class KVSpan(NamedTuple):
    """Where a [T, H, D] tensor lies in its prompt: tokens [start, start + T) of a prompt of ``prompt_tokens``.

    Both sides of a transfer know it (the chunk's token range, the pushed prompt's length), so it is not sent.
    None where a span is asked for: the tensor is a whole prompt, (0, T)."""

    start: int
    prompt_tokens: int


@dataclass(frozen=True)
class EncodedKV:
    """One encoded K or V tensor: everything its decoder needs, as plain fields."""

    codec: str  # the registry name it was encoded with, e.g. "int8+zstd"
    kind: str  # "k" or "v": some codecs quantize keys and values differently
    dtype: str  # the original torch dtype's name, a key of CACHE_DTYPES
    shape: tuple[int, ...]  # the original [T, H, D]
    payload: bytes | memoryview  # a read-only view where the codec sends a tensor's own memory (tensor_buffer)
    scales: bytes  # scales / zero points, raw little-endian; empty when the codec has none
    span: KVSpan | None = None  # where the tensor lies in its prompt; None: the whole prompt

    @property
    def nbytes(self) -> int:
        """Bytes this tensor costs on the wire, before framing."""
        return len(self.payload) + len(self.scales)


class KVCodec(ABC):
    """Compresses one [T, H, D] K or V tensor. Stateless: one instance serves every request and thread."""

    name: str
    # The KV pool dtype whose rows are this codec's encoding as they lie (engine/kv_formats/rows.py), or None. Between
    # pools of that dtype a push carries the rows unchanged: ``encode_rows`` and ``decode_rows`` only move bytes, and
    # what the decode pod stores is bit for bit what the prefill pod holds.
    pool_dtype: torch.dtype | None = None

    def encode(self, x: torch.Tensor, kind: KVKind, span: KVSpan | None = None) -> EncodedKV:
        """Encode ``x`` ([T, H, D], finite, on any device), which lies at ``span`` of its prompt (None: it is the
        whole prompt). Raises ValueError on a bad tensor, kind or span."""
        check_kv(x, kind)
        check_span(x.shape[0], span)
        encoded = self._encode(x, kind, span)
        return encoded if encoded.span == span else dataclasses.replace(encoded, span=span)

    def decode(self, enc: EncodedKV, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rebuild the [T, H, D] tensor in its original dtype on ``device``. Raises ValueError on a bad ``enc``."""
        dtype = self._check_encoded(enc)
        return self._decode(enc, torch.device(device)).to(dtype)

    def encode_rows(self, rows: torch.Tensor, kind: KVKind, span: KVSpan | None = None) -> EncodedKV:
        """Encode rows [T, H, row] of a ``pool_dtype`` pool as they lie (their values decode as float32)."""
        if self.pool_dtype is None or rows.dtype != self.pool_dtype or rows.dim() != 3:
            raise ValueError(f"{self.name} does not carry {rows.dtype} pool rows of shape {tuple(rows.shape)}")
        check_span(rows.shape[0], span)
        return self._encode_rows(rows, kind, span)

    def decode_rows(self, enc: EncodedKV, device: str | torch.device = "cpu") -> torch.Tensor:
        """The rows [T, H, row] of a ``pool_dtype`` pool that ``enc`` carries, bit for bit."""
        self._check_encoded(enc)
        if self.pool_dtype is None:
            raise ValueError(f"{self.name} carries no pool's rows")
        return self._decode_rows(enc, torch.device(device))

    def _encode_rows(self, rows: torch.Tensor, kind: KVKind, span: KVSpan | None) -> EncodedKV:
        raise NotImplementedError  # only a codec with a pool_dtype has rows to encode

    def _decode_rows(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    @abstractmethod
    def bytes_per_element(self, head_dim: int, cache_dtype: torch.dtype = torch.float32) -> float:
        """Payload plus scale bytes per K/V element, averaged over K and V, for long token ranges.

        ``cache_dtype`` matters only to the lossless ``none`` codec, which sends the cache dtype as it is.
        """

    @abstractmethod
    def encoded_nbytes(self, shape: tuple[int, ...], kind: KVKind, dtype: str,
                       span: KVSpan | None = None) -> tuple[int, int] | None:
        """Exact (payload, scales) lengths of an encoding of ``shape`` at ``span``; None when they depend on the
        data."""

    @abstractmethod
    def _encode(self, x: torch.Tensor, kind: KVKind, span: KVSpan | None) -> EncodedKV:
        """Encode a tensor that ``encode`` has checked."""

    @abstractmethod
    def _decode(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        """Decode a checked ``enc`` to a [T, H, D] floating tensor on ``device`` (any float dtype)."""

    def _check_encoded(self, enc: EncodedKV) -> torch.dtype:
        if enc.codec != self.name:
            raise ValueError(f"codec {self.name!r} cannot decode a tensor encoded with {enc.codec!r}")
        if enc.kind not in KV_KINDS:
            raise ValueError(f"kind must be one of {KV_KINDS}, got {enc.kind!r}")
        if enc.dtype not in CACHE_DTYPES:
            raise ValueError(f"unsupported dtype {enc.dtype!r}; supported: {', '.join(CACHE_DTYPES)}")
        if len(enc.shape) != 3 or min(enc.shape) <= 0:
            raise ValueError(f"shape must be [T, H, D] with positive sizes, got {enc.shape}")
        check_span(enc.shape[0], enc.span)
        expected = self.encoded_nbytes(enc.shape, enc.kind, enc.dtype, enc.span)
        if expected is not None and expected != (len(enc.payload), len(enc.scales)):
            raise ValueError(
                f"{self.name} {enc.kind.upper()} of shape {enc.shape} needs (payload, scales) of {expected} bytes, "
                f"got {(len(enc.payload), len(enc.scales))}"
            )
        return CACHE_DTYPES[enc.dtype]


def check_kv(x: torch.Tensor, kind: str) -> None:
    """Raise ValueError unless ``x`` is a non-empty finite [T, H, D] tensor of a cache dtype and kind is k/v."""
    if kind not in KV_KINDS:
        raise ValueError(f"kind must be one of {KV_KINDS}, got {kind!r}")
    if x.dim() != 3 or x.numel() == 0:
        raise ValueError(f"KV tensor must be [T, H, D] with positive sizes, got {tuple(x.shape)}")
    if dtype_name(x.dtype) not in CACHE_DTYPES:
        raise ValueError(f"unsupported KV dtype {x.dtype}; supported: {', '.join(CACHE_DTYPES)}")
    # A real model's KV is finite; inf/nan here means a broken forward pass, and a quantizer would hide it.
    # Fast path: inf/nan make the sum non-finite; the slow exact check runs only when the sum is not finite, which a
    # finite tensor reaches only by overflow. The sum in the tensor's own dtype: a float16 -> float32 sum is ~40x
    # slower on CPU, a third of a KIVI encode.
    if not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        raise ValueError("KV tensor holds inf or nan values; refusing to encode it")


def check_span(tokens: int, span: KVSpan | None) -> None:
    """Raise ValueError unless ``span`` places ``tokens`` rows inside its prompt."""
    if span is not None and not (0 <= span.start and span.start + tokens <= span.prompt_tokens):
        raise ValueError(f"{tokens} tokens from token {span.start} do not fit a prompt of {span.prompt_tokens}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` in C order (copied to the host if needed)."""
    # Viewed as uint8 because numpy has no bfloat16 or float8.
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` in C order as a read-only view: no copy when ``t`` is a contiguous CPU tensor, whose
    memory the view then keeps alive and which must not change while the view is in use."""
    return memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()).toreadonly()


def tensor_from_bytes(buf: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...],
                      device: torch.device) -> torch.Tensor:
    """The tensor of ``shape`` whose raw bytes are ``buf``, on ``device``: on the CPU a view of ``buf`` itself, no
    copy (the decode pod's one copy is into its KV pool), so it must be read, never written in place (torch's warning
    that the buffer is not writable, about that very choice, is filtered out: _READ_ONLY_VIEW)."""
    return torch.frombuffer(buf, dtype=dtype).reshape(shape).to(device)


_READ_ONLY_VIEW = "The given buffer is not writable"  # torch.frombuffer's warning over a received message's bytes
warnings.filterwarnings("ignore", message=_READ_ONLY_VIEW, category=UserWarning)


# --- registry --------------------------------------------------------------------------------------------------

_CODEC_CLASSES: dict[str, str] = {  # by the names of runtime/kv_codecs.py, which the router checks its setting by
    "none": "splitserve.kvtransfer.codecs.raw:RawCodec",
    "bf16": "splitserve.kvtransfer.codecs.raw:BF16Codec",
    "fp8": "splitserve.kvtransfer.codecs.symmetric:FP8Codec",
    "int8": "splitserve.kvtransfer.codecs.symmetric:Int8Codec",
    "int4": "splitserve.kvtransfer.codecs.kivi:Int4Codec",
    "kivi8": "splitserve.kvtransfer.codecs.kivi:Kivi8Codec",
    "kivi4": "splitserve.kvtransfer.codecs.kivi:Kivi4Codec",
    "kivi2": "splitserve.kvtransfer.codecs.kivi:Kivi2Codec",
}
assert tuple(_CODEC_CLASSES) == KV_CODECS, "every codec name has its class, and no class goes unnamed"
_ZSTD_CODEC_CLASS = "splitserve.kvtransfer.codecs.zstd:ZstdCodec"
DEFAULT_ZSTD_LEVEL = 3


def available_codecs() -> list[str]:
    """Every name ``get_codec`` accepts."""
    return kv_codec_names()


@functools.lru_cache(maxsize=None)
def get_codec(name: str, zstd_level: int = DEFAULT_ZSTD_LEVEL) -> KVCodec:
    """The codec registered as ``name`` (``zstd_level`` applies to ``+zstd`` names). ValueError if unknown."""
    base_name = name.removesuffix(ZSTD_SUFFIX)
    if base_name not in _CODEC_CLASSES:
        raise ValueError(f"unknown KV codec {name!r}; known codecs: {', '.join(available_codecs())}")
    codec = _load_class(_CODEC_CLASSES[base_name])()
    if name != base_name:
        codec = _load_class(_ZSTD_CODEC_CLASS)(codec, zstd_level)
    return codec


def _load_class(spec: str) -> type:
    module_name, class_name = spec.split(":")
    return getattr(importlib.import_module(module_name), class_name)

"""Codec variants ``bench codecs`` measures beside the registered codecs, which no pod serves (issue 37's "keys before
RoPE and per-channel float8 keys"): a suffix on a codec's name in ``--codecs`` picks one.

``X@kc``: X (``fp8`` or ``int8``) with keys scaled per (head, channel) over the range's tokens instead of per
(token, head), values as X does (KIVI: keys have outlier channels, values do not); ``per_channel_kinds`` of
kvtransfer/codecs/symmetric.py.

``X@prerope``: X on keys quantized before RoPE (KVQuant's pre-RoPE key quantization). The cache holds keys after the
rotary embedding, which turns each channel pair (i, i + D/2) by an angle that grows with the token's position, so a
channel's values swing between the pair's two channels along the tokens; that smears the outlier channels a per-channel
key quantizer (KIVI's, int4's) relies on. Here the cached keys are un-rotated at their positions (the inverse rotation,
exact up to float32 rounding), quantized by a codec, decoded and rotated back: what a codec that quantized the pre-RoPE
keys would leave in the cache, without changing the engine. Values pass through the codec unchanged (RoPE does not touch
them).

``kivi4@prerope`` is kivi4 on un-rotated keys; ``fp8@kc@prerope`` combines both. Positions come from the tensor's span
(its first token's position in the prompt), which both sides of a transfer know, so a real codec could do the same; the
engine's RoPE is HF's non-interleaved one (engine/model/rotary.py), whose tables this reads.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.rotary import rope_inv_freq
from splitserve.kvtransfer.codecs import EncodedKV, KVCodec, KVSpan, get_codec
from splitserve.kvtransfer.codecs.base import dtype_name
from splitserve.kvtransfer.codecs.symmetric import SymmetricScaledCodec

PRE_ROPE, CHANNEL_KEYS = "@prerope", "@kc"


def registered_name(name: str) -> str:
    """The registered codec a variant's name starts from: ``fp8`` for ``fp8@kc@prerope``."""
    return name.split("@")[0]


def named_codec(name: str, model_config: ModelConfig) -> KVCodec:
    """``get_codec(name)``, or the variant ``name`` describes (``model_config``: the RoPE to un-rotate with)."""
    if name.endswith(PRE_ROPE):
        return PreRopeKeys(named_codec(name.removesuffix(PRE_ROPE), model_config), rope_inv_freq(model_config))
    if name.endswith(CHANNEL_KEYS):
        return channel_keys(get_codec(name.removesuffix(CHANNEL_KEYS)))
    if "@" in name:
        raise ValueError(f"unknown codec variant {name!r}: X{CHANNEL_KEYS}, X{PRE_ROPE} or X{CHANNEL_KEYS}{PRE_ROPE}")
    return get_codec(name)


def channel_keys(codec: KVCodec) -> KVCodec:
    """``codec`` (fp8 or int8) with its keys scaled per (head, channel), under the name ``X@kc``."""
    if type(codec) not in SymmetricScaledCodec.__subclasses__():  # a name the user gave: ValueError, not TypeError
        raise ValueError(f"{codec.name}{CHANNEL_KEYS}: only fp8 and int8 have per-token key scales to replace")
    variant = copy.copy(codec)
    variant.name, variant.per_channel_kinds = codec.name + CHANNEL_KEYS, ("k",)
    return variant


class PreRopeKeys(KVCodec):
    """``inner`` applied to keys rotated back to position 0 (float32), then rotated again after decoding."""

    def __init__(self, inner: KVCodec, inv_freq: torch.Tensor):
        self.inner, self.inv_freq = inner, inv_freq  # [D / 2] float32
        self.name = inner.name + PRE_ROPE

    def bytes_per_element(self, head_dim: int, cache_dtype: torch.dtype = torch.float32) -> float:
        return self.inner.bytes_per_element(head_dim, cache_dtype)

    def encoded_nbytes(self, shape: tuple[int, ...], kind, dtype: str,
                       span: KVSpan | None = None) -> tuple[int, int] | None:
        return self.inner.encoded_nbytes(shape, kind, "float32", span)

    def _encode(self, x: torch.Tensor, kind, span: KVSpan | None) -> EncodedKV:
        x32 = x.float() if kind == "v" else self._rotate(x.float(), span, inverse=True)
        return dataclasses.replace(self.inner.encode(x32, kind, span), codec=self.name, dtype=dtype_name(x.dtype))

    def _decode(self, enc: EncodedKV, device: torch.device) -> torch.Tensor:
        decoded = self.inner.decode(dataclasses.replace(enc, codec=self.inner.name, dtype="float32"), device)
        return decoded if enc.kind == "v" else self._rotate(decoded, enc.span, inverse=False)

    def _rotate(self, x: torch.Tensor, span: KVSpan | None, inverse: bool) -> torch.Tensor:
        """x [T, H, D] float32 rotated by each token's angle (``inverse``: by its negative), as engine/model/rotary.py's
        ``StepRotary.apply``: x * cos + cat(x2, x1) * cat(-sin, sin)."""
        start = span.start if span is not None else 0
        positions = torch.arange(start, start + x.shape[0], dtype=torch.float32, device=x.device)
        angles = torch.outer(positions, self.inv_freq.to(x.device))  # [T, D / 2]
        cos, sin = angles.cos(), angles.sin()
        if inverse:
            sin = -sin
        cos, sin_signed = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)
        half = x.shape[-1] // 2
        return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), sin_signed)

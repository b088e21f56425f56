"""The KV wire format: one layer's K or V over a token range, cut into checked ``KVChunk`` messages, and back.

A tensor's path through this module:

    prefill pod:  encode_chunks(request, layer, kind, [start, end), tensor [T, H, D], codec, prompt length, heads)
                    -> split along tokens so that each chunk's payload + scales fit in ``max_chunk_bytes``
                    -> codec.encode each piece at its KVSpan (its tokens, the prompt's length: what KIVI keeps
                       in float16 depends on it), CRC-32C over payload then scales, a stream sequence number
                    -> [WireChunk, ...]
                  push_message(chunk) -> the serialized KVPush{chunk}, the payload copied once, into it
    ------------  gRPC (the PushKV stream's own serializer and deserializer: these two functions)
    decode pod:   parse_push(message bytes) -> KVPush (header, trailer) or WireChunk, payload and scales viewed
                  in the message's bytes, not copied
                  decode_chunk(chunk, ExpectedChunks)
                    -> checksum first (DATA_LOSS), then request, codec, layer, range and shape against what
                       this stream may carry (FAILED_PRECONDITION / INVALID_ARGUMENT), then codec.decode at the
                       chunk's span (its token range in the pushed prompt, whose length the header gave)
                    -> DecodedKVChunk(layer, kind, token_start, token_end, heads, tensor [T, H, D])

A chunk carries the KV heads ``heads`` [start, end) of the model's (``KVChunk.heads``; unset: all of them): a
tensor-parallel prefill pod sends each rank's heads as chunks of their own, which the decode pod writes into the
ranks that own them (engine/parallel/sharded_kv_cache.py), whatever either side's degree.

A ``WireChunk`` is a ``KVChunk`` message whose payload and scales travel beside the message's other fields: upb
copies a bytes field whenever it is set or read, and a chunk's payload is most of a push's bytes. The framed bytes
are a valid serialized ``KVPush`` (payload and scales after the other fields, which protobuf parsers accept in any
order), so the wire format is the .proto's and any protobuf client or server reads it as such.

Errors on the KV path are ``StatusError``s carrying the gRPC status the receiving side answers with; a bad
chunk is a ``KVChunkError``. A chunk (``max_chunk_bytes``, 1 MiB by default) and a long prompt's header fit far
below the message limit every channel and server sets (``splitserve.runtime.transport.MAX_MESSAGE_BYTES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import google_crc32c
import grpc
import numpy as np
import torch

from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.kvtransfer.codecs import EncodedKV, KVCodec, KVSpan, get_codec
from splitserve.runtime.errors import StatusError
from splitserve.v1 import kv_transfer_pb2

MAX_CHUNK_BYTES = 1 << 20  # payload + scales of one chunk, the default cut
# A chunk's estimated size may be off for codecs whose size depends on the data (zstd) or on where a token
# range is cut (int4's 32-token key groups); aiming a little under the limit keeps re-cuts rare.
_CHUNK_SIZE_MARGIN = 0.95

KIND_TO_PROTO = {"k": kv_transfer_pb2.KV_KIND_KEY, "v": kv_transfer_pb2.KV_KIND_VALUE}
PROTO_TO_KIND = {proto: kind for kind, proto in KIND_TO_PROTO.items()}


class KVChunkError(StatusError):
    """A chunk that must not be stored: bad checksum (DATA_LOSS), or not what the stream may carry."""


Buffer = bytes | memoryview  # a chunk's payload or scales: the codec's bytes, or a view of a received message


@dataclass
class WireChunk:
    """One chunk of a push: the ``KVChunk`` message's fields, with its payload and scales kept beside it."""

    fields: kv_transfer_pb2.KVChunk  # every field but payload and scales, which it leaves empty
    payload: Buffer
    scales: Buffer

    @property
    def nbytes(self) -> int:
        """Payload and scale bytes: what the chunk costs on the wire, before framing."""
        return len(self.payload) + len(self.scales)

    def message(self) -> kv_transfer_pb2.KVChunk:
        """The whole ``KVChunk`` message, payload and scales copied in: for hand-made streams (tests, tools); the
        push itself frames chunks with ``push_message``."""
        chunk = kv_transfer_pb2.KVChunk()
        chunk.CopyFrom(self.fields)
        chunk.payload, chunk.scales = bytes(self.payload), bytes(self.scales)
        return chunk


def chunk_checksum(payload: Buffer, scales: Buffer) -> int:
    """CRC-32C (Castagnoli) of payload followed by scales."""
    # google_crc32c takes bytes and numpy arrays but not memoryviews; a numpy view of either copies nothing.
    return google_crc32c.extend(google_crc32c.value(_as_array(payload)), _as_array(scales))


def _as_array(buffer: Buffer) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint8)


# ---- framing: WireChunk <-> serialized KVPush ---------------------------------------------------------------

_WIRETYPE_VARINT, _WIRETYPE_LEN = 0, 2
_FIXED_SIZES = {1: 8, 5: 4}  # wire types fixed64 and fixed32: their sizes in bytes
_CHUNK_FIELD = kv_transfer_pb2.KVPush.DESCRIPTOR.fields_by_name["chunk"].number
_PAYLOAD_FIELD, _SCALES_FIELD = (kv_transfer_pb2.KVChunk.DESCRIPTOR.fields_by_name[name].number
                                 for name in ("payload", "scales"))


def push_message(chunk: WireChunk) -> bytes:
    """The serialized ``KVPush{chunk}``: the chunk's fields, then payload and scales (omitted when empty, as
    protobuf omits them), copied once, into the result."""
    body = [chunk.fields.SerializeToString()]
    for number, value in ((_PAYLOAD_FIELD, chunk.payload), (_SCALES_FIELD, chunk.scales)):
        if len(value):
            body += [_key(number, _WIRETYPE_LEN) + _varint(len(value)), value]
    size = sum(len(part) for part in body)
    return b"".join([_key(_CHUNK_FIELD, _WIRETYPE_LEN), _varint(size), *body])


def parse_push(message: bytes) -> kv_transfer_pb2.KVPush | WireChunk:
    """A received ``KVPush``: as a WireChunk when it carries a chunk, its payload and scales then read-only views of
    ``message`` (protobuf parses the other fields); as the message itself otherwise (header, trailer)."""
    push = kv_transfer_pb2.KVPush.FromString(message)  # raises DecodeError on bytes that are not a KVPush
    if push.WhichOneof("item") != "chunk":
        return push
    fields = push.chunk
    payload, scales = _payload_and_scales(message) or (fields.payload, fields.scales)
    fields.ClearField("payload")
    fields.ClearField("scales")
    return WireChunk(fields, payload, scales)


def _payload_and_scales(message: bytes) -> tuple[Buffer, Buffer] | None:
    """Views of the payload and scales in a serialized KVPush{chunk}. None where the chunk, its payload or its
    scales occur more than once (legal protobuf, which merges them; push_message never writes that) or a field has
    a wire type this reader skips no further than (groups)."""
    try:
        chunks = [span for number, span in _fields(message, 0, len(message)) if number == _CHUNK_FIELD and span]
        if len(chunks) != 1:
            return None
        found: dict[int, list[tuple[int, int]]] = {_PAYLOAD_FIELD: [], _SCALES_FIELD: []}
        for number, span in _fields(message, *chunks[0]):
            if number in found and span:
                found[number].append(span)
    except ValueError:
        return None
    if any(len(spans) > 1 for spans in found.values()):
        return None
    view = memoryview(message)
    payload, scales = (view[spans[0][0]:spans[0][1]] if spans else b"" for spans in found.values())
    return payload, scales


def _fields(message: bytes, start: int, end: int) -> Iterator[tuple[int, tuple[int, int] | None]]:
    """(field number, (start, end) of its bytes) for each length-delimited field of the serialized message in
    message[start:end], (field number, None) for the others. Protobuf has parsed ``message``: it is well-formed."""
    pos = start
    while pos < end:
        key, pos = _read_varint(message, pos)
        number, kind = key >> 3, key & 7
        if kind == _WIRETYPE_LEN:
            length, pos = _read_varint(message, pos)
            yield number, (pos, pos + length)
            pos += length
            continue
        if kind == _WIRETYPE_VARINT:
            _, pos = _read_varint(message, pos)
        elif kind in _FIXED_SIZES:
            pos += _FIXED_SIZES[kind]
        else:
            raise ValueError(f"wire type {kind}")
        yield number, None


def _read_varint(message: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = message[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int, kind: int) -> bytes:
    return _varint(number << 3 | kind)


# ---- prefill side -------------------------------------------------------------------------------------------

def encode_chunks(request_id: str, layer: int, kind: str, token_start: int, token_end: int, tensor: torch.Tensor,
                  codec: KVCodec, num_prompt_tokens: int, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                  first_seq: int = 0, heads: tuple[int, int] | None = None) -> list[WireChunk]:
    """Encode ``tensor`` ([token_end - token_start, H, D], the K or V of ``layer`` for those tokens of a prompt of
    ``num_prompt_tokens``; KV heads ``heads`` [start, end) of the model's, None: all of them) as chunks numbered
    from ``first_seq``, each carrying at most ``max_chunk_bytes`` of payload + scales. A tensor of the codec's
    ``pool_dtype`` is that pool's rows [T, H, row], carried as they lie (``KVCodec.encode_rows``)."""
    if (tensor.dim() != 3 or tensor.shape[0] != token_end - token_start or token_start < 0
            or token_end > num_prompt_tokens):
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} does not cover tokens [{token_start}, {token_end}) "
                         f"of a prompt of {num_prompt_tokens}")
    num_tokens, num_heads = tensor.shape[:2]
    head_dim = kv_rows.head_dim_of(tensor)
    bytes_per_token = codec.bytes_per_element(head_dim, tensor.dtype) * num_heads * head_dim
    tokens_per_chunk = max(1, int(max_chunk_bytes * _CHUNK_SIZE_MARGIN // bytes_per_token))
    chunks: list[WireChunk] = []
    for lo in range(0, num_tokens, tokens_per_chunk):
        hi = min(lo + tokens_per_chunk, num_tokens)
        chunks.extend(_encode_fitting(request_id, layer, kind, token_start, lo, hi, tensor, codec, num_prompt_tokens,
                                      max_chunk_bytes))
    for seq, chunk in enumerate(chunks, start=first_seq):
        chunk.fields.seq = seq
        if heads is not None:
            chunk.fields.heads.start, chunk.fields.heads.end = heads
    return chunks


def _encode_fitting(request_id: str, layer: int, kind: str, token_start: int, lo: int, hi: int,
                    tensor: torch.Tensor, codec: KVCodec, num_prompt_tokens: int,
                    max_chunk_bytes: int) -> list[WireChunk]:
    """Encode rows [lo, hi) of ``tensor``; halve the range while the encoding exceeds the limit."""
    encode = codec.encode_rows if tensor.dtype == codec.pool_dtype else codec.encode
    encoded = encode(tensor[lo:hi], kind, KVSpan(token_start + lo, num_prompt_tokens))
    if encoded.nbytes <= max_chunk_bytes:
        return [WireChunk(kv_transfer_pb2.KVChunk(
            request_id=request_id, layer=layer, kind=KIND_TO_PROTO[kind],
            token_start=token_start + lo, token_end=token_start + hi,
            codec=encoded.codec, dtype=encoded.dtype, shape=list(encoded.shape),
            crc32c=chunk_checksum(encoded.payload, encoded.scales),
        ), encoded.payload, encoded.scales)]
    if hi - lo == 1:
        raise ValueError(f"one token of {codec.name} takes {encoded.nbytes} bytes, over max_chunk_bytes="
                         f"{max_chunk_bytes}")
    mid = (lo + hi) // 2
    return (_encode_fitting(request_id, layer, kind, token_start, lo, mid, tensor, codec, num_prompt_tokens,
                            max_chunk_bytes)
            + _encode_fitting(request_id, layer, kind, token_start, mid, hi, tensor, codec, num_prompt_tokens,
                              max_chunk_bytes))


# ---- decode side --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpectedChunks:
    """What the chunks of one request's stream may carry on this receiver."""

    request_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int  # the prompt's length: chunks cover [0, num_tokens), [first_token, num_tokens) in window_layers
    codecs: frozenset[str]  # codec names this receiver accepts
    first_token: int = 0  # where the receiver keeps the prompt's KV from in window_layers (KVLayout.kept_from)
    window_layers: frozenset[int] = frozenset()

    def start(self, layer: int) -> int:
        """The first token the chunks of ``layer`` carry."""
        return self.first_token if layer in self.window_layers else 0


class DecodedKVChunk(NamedTuple):
    layer: int
    kind: str  # "k" or "v"
    token_start: int
    token_end: int
    heads: tuple[int, int]  # the KV heads [start, end) it carries
    # [token_end - token_start, end - start, head_dim] in the sender's value dtype; or, decoded for a pool of the
    # codec's pool_dtype, that pool's rows [..., row] as the sender's pool held them
    tensor: torch.Tensor


def decode_chunk(wire_chunk: WireChunk, expected: ExpectedChunks, device: str | torch.device = "cpu",
                 pool_dtype: torch.dtype | None = None) -> DecodedKVChunk:
    """Check ``wire_chunk`` and decode it (as rows of ``pool_dtype``, the receiving pool's, where the codec carries
    them: ``KVCodec.pool_dtype``); raises ``KVChunkError`` naming what is wrong. Never decodes unchecked bytes."""
    chunk = wire_chunk.fields
    where = f"chunk {chunk.seq} of {chunk.request_id!r}"
    if chunk.request_id != expected.request_id:
        raise KVChunkError(grpc.StatusCode.INVALID_ARGUMENT, f"{where} belongs to another request than "
                           f"{expected.request_id!r}")
    computed = chunk_checksum(wire_chunk.payload, wire_chunk.scales)
    if computed != chunk.crc32c:
        raise KVChunkError(grpc.StatusCode.DATA_LOSS, f"{where} (layer {chunk.layer}, tokens "
                           f"[{chunk.token_start}, {chunk.token_end})) failed its checksum: carries crc32c "
                           f"{chunk.crc32c:#010x}, its bytes give {computed:#010x}")
    codec = _accepted_codec(chunk.codec, expected, where)
    _check_placement(chunk, expected, where)
    try:
        encoded = _encoded(wire_chunk, expected.num_tokens)
        stored = codec.pool_dtype is not None and codec.pool_dtype == pool_dtype
        tensor = codec.decode_rows(encoded, device) if stored else codec.decode(encoded, device)
    except ValueError as err:
        raise KVChunkError(grpc.StatusCode.INVALID_ARGUMENT, f"{where} does not decode: {err}") from err
    return DecodedKVChunk(chunk.layer, PROTO_TO_KIND[chunk.kind], chunk.token_start, chunk.token_end,
                          chunk_heads(chunk, expected.num_kv_heads), tensor)


def chunk_heads(chunk: kv_transfer_pb2.KVChunk, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads [start, end) ``chunk`` carries: its ``heads``, or all ``num_kv_heads`` where unset (end 0)."""
    return (chunk.heads.start, chunk.heads.end) if chunk.heads.end else (0, num_kv_heads)


def _accepted_codec(name: str, expected: ExpectedChunks, where: str) -> KVCodec:
    if name not in expected.codecs:
        raise KVChunkError(grpc.StatusCode.FAILED_PRECONDITION, f"{where} uses codec {name!r}, not accepted here; "
                           f"accepted: {', '.join(sorted(expected.codecs))}")
    try:
        return get_codec(name)
    except ValueError as err:
        raise KVChunkError(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {err}") from err


def _check_placement(chunk: kv_transfer_pb2.KVChunk, expected: ExpectedChunks, where: str) -> None:
    """Layer, kind, token range, head range and shape must fit the receiver's layout and the prompt."""
    problem = None
    start, end = chunk_heads(chunk, expected.num_kv_heads)
    if chunk.kind not in PROTO_TO_KIND:
        problem = f"kind {chunk.kind} is neither KEY nor VALUE"
    elif chunk.layer >= expected.num_layers:
        problem = f"layer {chunk.layer} is out of range: the model has {expected.num_layers} layers"
    elif not expected.start(chunk.layer) <= chunk.token_start < chunk.token_end <= expected.num_tokens:
        kept = f" (kept from {expected.start(chunk.layer)} on)" if expected.start(chunk.layer) else ""
        problem = (f"token range [{chunk.token_start}, {chunk.token_end}) is empty or outside the prompt's "
                   f"{expected.num_tokens} tokens{kept}")
    elif not 0 <= start < end <= expected.num_kv_heads:
        problem = f"KV heads [{start}, {end}) are empty or outside the model's {expected.num_kv_heads}"
    elif list(chunk.shape) != [chunk.token_end - chunk.token_start, end - start, expected.head_dim]:
        problem = (f"shape {list(chunk.shape)} does not match [tokens, num_kv_heads, head_dim] = "
                   f"[{chunk.token_end - chunk.token_start}, {end - start}, {expected.head_dim}]")
    if problem is not None:
        raise KVChunkError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {problem}")


def _encoded(wire_chunk: WireChunk, num_prompt_tokens: int) -> EncodedKV:
    chunk = wire_chunk.fields
    return EncodedKV(chunk.codec, PROTO_TO_KIND[chunk.kind], chunk.dtype, tuple(chunk.shape), wire_chunk.payload,
                     wire_chunk.scales, KVSpan(chunk.token_start, num_prompt_tokens))


def raw_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` in its own dtype: what a chunk would cost uncompressed."""
    return tensor.numel() * tensor.element_size()


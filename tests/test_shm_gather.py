"""A raw codec's chunk gathered straight into a shared-memory arena (``ShmPush.frame_raw``, kvtransfer/shm_arena.py):
the prefill side's one pass over the bytes of codec ``none`` or ``bf16`` through an arena. What it places decodes as
the encoded chunk would; the checksum it takes over the span catches a byte changed in the arena afterwards; a
non-finite tensor is refused and its span freed; what it does not take (another codec, a gRPC link, a range over
the chunk size) falls back to the encoder."""

from __future__ import annotations

import os
import tempfile

import grpc
import pytest
import torch

from splitserve.kvtransfer.codecs import get_codec
from splitserve.kvtransfer.shm import ARENA_PREFIX, ShmArenaViews, with_shm_bytes
from splitserve.kvtransfer.shm_arena import ShmArena, ShmPush
from splitserve.kvtransfer.wire import ExpectedChunks, KVChunkError, decode_chunk, parse_push

NUM_TOKENS, HEADS, HEAD_DIM = 48, 4, 16


@pytest.fixture
def arena():
    directory = tempfile.mkdtemp(prefix="splitserve-test-", dir="/dev/shm")
    arena = ShmArena(directory, f"{ARENA_PREFIX}{'a' * 32}-{'9' * 32}", 1 << 20)
    yield arena
    arena.retire()
    assert os.listdir(directory) == []
    os.rmdir(directory)


def _parts(dtype: torch.dtype, heads: int = HEADS) -> list[torch.Tensor]:
    """A chunked prefill's three steps of one layer's K: 16, 8 and 24 tokens."""
    full = torch.randn(NUM_TOKENS, heads, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    return [full[:16].clone(), full[16:24].clone(), full[24:].clone()]


def _frame(push: ShmPush, parts: list[torch.Tensor], codec: str = "none", limit: int = 1 << 20, seq: int = 0,
           heads: tuple[int, int] | None = None) -> tuple[bytes, int] | None:
    """Layer 2's K of tokens [0, NUM_TOKENS) from ``parts`` as chunk ``seq``."""
    return push.frame_raw("r1", 2, "k", (0, NUM_TOKENS), heads, seq, parts, get_codec(codec), limit)


def _received(message: bytes, arena: ShmArena):
    return with_shm_bytes(parse_push(message), ShmArenaViews(arena.directory).open(arena.name))


def _expected() -> ExpectedChunks:
    return ExpectedChunks("r1", 4, HEADS, HEAD_DIM, NUM_TOKENS, frozenset({"none", "bf16"}))


@pytest.mark.parametrize("codec, dtype", [("none", torch.float32), ("none", torch.float16),
                                          ("bf16", torch.float32)])
def test_parts_gathered_into_the_arena_decode_as_their_encoded_concatenation(arena, codec, dtype):
    parts = _parts(dtype)
    push = ShmPush(arena)
    message, nbytes = _frame(push, parts, codec, seq=7)
    assert len(message) < 200, "the message carries a span, not the bytes"
    received = _received(message, arena)
    assert received.fields.seq == 7 and received.fields.shm.payload_bytes == nbytes
    decoded = decode_chunk(received, _expected())
    expected = get_codec(codec).decode(get_codec(codec).encode(torch.cat(parts), "k"))
    assert (decoded.layer, decoded.kind, decoded.token_start, decoded.token_end) == (2, "k", 0, NUM_TOKENS)
    assert decoded.tensor.dtype == dtype and torch.equal(decoded.tensor, expected)
    assert arena.spans_in_use == 1
    push.release()
    assert arena.spans_in_use == 0


def test_a_byte_changed_in_the_arena_after_the_gather_fails_the_checksum(arena):
    message, _ = _frame(ShmPush(arena), _parts(torch.float32))
    span = parse_push(message).fields.shm
    with open(arena.path, "r+b") as file:  # another process scribbling on the page
        file.seek(span.offset + span.payload_bytes - 1)
        byte = file.read(1)
        file.seek(span.offset + span.payload_bytes - 1)
        file.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(KVChunkError) as caught:
        decode_chunk(_received(message, arena), _expected())
    assert caught.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in caught.value.message


def test_a_non_finite_tensor_is_refused_as_the_encoder_refuses_it_and_its_span_goes_back(arena):
    parts = _parts(torch.float32)
    parts[1][3, 1, 5] = float("nan")
    push = ShmPush(arena)
    with pytest.raises(ValueError, match="inf or nan"):
        _frame(push, parts)
    with pytest.raises(ValueError, match="inf or nan"):
        get_codec("none").encode(torch.cat(parts), "k")
    assert arena.spans_in_use == 0


def test_a_head_range_travels_with_the_gathered_chunk(arena):
    message, _ = _frame(ShmPush(arena), _parts(torch.float32, heads=2), heads=(1, 3))
    decoded = decode_chunk(_received(message, arena), _expected())
    assert decoded.heads == (1, 3) and decoded.tensor.shape == (NUM_TOKENS, 2, HEAD_DIM)


@pytest.mark.parametrize("case", ["another codec", "a gRPC link", "over the chunk size", "a full arena"])
def test_what_the_gather_does_not_take_is_left_to_the_encoder(arena, case):
    parts, codec, limit, push = _parts(torch.float32), "none", 1 << 20, ShmPush(arena)
    if case == "another codec":
        codec = "int8"
    elif case == "a gRPC link":
        push = ShmPush(None)
    elif case == "over the chunk size":
        limit = NUM_TOKENS * HEADS * HEAD_DIM * 4 - 1
    else:
        push.frame_raw("r0", 0, "k", (0, 4064), None, 0, [torch.zeros(4064, 64, 1)], get_codec("none"),
                       1 << 20)  # leaves 8 KiB of the 1 MiB
    assert _frame(push, parts, codec, limit) is None
    push.release()

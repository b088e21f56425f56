"""KV wire framing and the handshake check: chunks fit their size limit, cover their token range exactly, survive
the trip bit for bit (lossless codecs), and anything corrupted or out of place is refused with the right status."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from splitserve.kvtransfer.codecs import get_codec
from splitserve.kvtransfer.handshake import KVLayout, check_compatible
from splitserve.kvtransfer.wire import (
    ExpectedChunks,
    KVChunkError,
    chunk_checksum,
    decode_chunk,
    encode_chunks,
    parse_push,
    push_message,
)
from splitserve.runtime.errors import StatusError
from splitserve.v1 import kv_transfer_pb2

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
ALL_CODECS = frozenset(["none", "int8", "int8+zstd", "int4", "bf16", "kivi2", "kivi4", "kivi4+zstd"])


def kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)  # [T, H, D] float32


def expected(num_tokens: int, codecs=ALL_CODECS) -> ExpectedChunks:
    return ExpectedChunks("req-1", NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, num_tokens, codecs)


def reassemble(chunks, num_tokens: int) -> torch.Tensor:
    out = torch.full((num_tokens, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    for chunk in chunks:
        decoded = decode_chunk(chunk, expected(num_tokens))
        out[decoded.token_start:decoded.token_end] = decoded.tensor
    return out


@pytest.mark.parametrize("codec_name", ["none", "int8+zstd", "int4", "kivi2", "kivi4+zstd"])
def test_chunks_respect_the_size_limit_and_cover_the_range_exactly(codec_name):
    # 300 tokens x 2 heads x 16 dims x 4 bytes = 38400 bytes raw: a 4 KiB limit forces many chunks.
    tensor = kv(300)
    chunks = encode_chunks("req-1", 2, "v", 100, 400, tensor, get_codec(codec_name), 400,
                           max_chunk_bytes=4096,                           first_seq=7)
    assert len(chunks) > 1
    assert all(len(c.payload) + len(c.scales) <= 4096 for c in chunks)
    assert [c.fields.seq for c in chunks] == list(range(7, 7 + len(chunks)))
    # Consecutive, non-overlapping ranges from 100 to 400.
    fields = [c.fields for c in chunks]
    assert [f.token_start for f in fields] == [100] + [f.token_end for f in fields[:-1]]
    assert fields[-1].token_end == 400
    for c, f in zip(chunks, fields):
        assert (f.request_id, f.layer, f.kind, f.codec, f.dtype) == ("req-1", 2, kv_transfer_pb2.KV_KIND_VALUE,
                                                                      codec_name, "float32")
        assert list(f.shape) == [f.token_end - f.token_start, NUM_KV_HEADS, HEAD_DIM]
        assert f.crc32c == chunk_checksum(c.payload, c.scales)


def test_raw_chunks_take_as_many_tokens_as_fit():
    # none: 2 * 16 * 4 = 128 bytes per token; 95% of 4096 bytes is 30 tokens per chunk.
    chunks = encode_chunks("req-1", 0, "k", 0, 100, kv(100), get_codec("none"), 100, max_chunk_bytes=4096)
    assert [(c.fields.token_start, c.fields.token_end) for c in chunks] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    assert [len(c.payload) for c in chunks] == [3840, 3840, 3840, 1280]


@pytest.mark.parametrize("codec_name", ["none", "int8+zstd"])
def test_round_trip(codec_name):
    tensor = kv(130, seed=1)
    chunks = encode_chunks("req-1", 3, "k", 0, 130, tensor, get_codec(codec_name), 130, max_chunk_bytes=2048)
    decoded = decode_chunk(chunks[0], expected(130))
    assert (decoded.layer, decoded.kind, decoded.token_start) == (3, "k", 0)
    out = reassemble(chunks, 130)
    if codec_name == "none":
        assert torch.equal(out, tensor)  # lossless, bit for bit
    else:
        # int8: a float16 scale per 16 channels = their absmax / 127, so the error is at most half a step of the
        # row's absmax.
        step = tensor.abs().amax(dim=-1, keepdim=True) / 127
        assert bool(((out - tensor).abs() <= step * 0.5 + 1e-3).all())


def test_corrupted_payload_fails_the_checksum():
    chunk = encode_chunks("req-1", 1, "k", 0, 20, kv(20), get_codec("none"), 20)[0]
    corrupted = bytearray(chunk.payload)
    corrupted[17] ^= 0x01
    chunk.payload = bytes(corrupted)
    with pytest.raises(KVChunkError) as caught:
        decode_chunk(chunk, expected(20))
    assert caught.value.code == grpc.StatusCode.DATA_LOSS
    assert "failed its checksum" in caught.value.message


def test_fault_injection_corrupts_the_share_of_chunks_asked_for_and_each_fails_its_checksum():
    from splitserve.kvtransfer.sender import KVTransferClient

    layout = KVLayout("tiny-random", NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, block_size=16, cache_dtype="float32")
    for rate, expected_bad in ((0.0, 0), (1.0, 40)):
        client = KVTransferClient(layout, corrupt_chunk_rate=rate)
        chunks = [chunk for seed in range(40) for chunk in encode_chunks("req-1", 0, "k", 0, 20, kv(20, seed),
                                                                        get_codec("none"), 20)]
        originals = [bytes(chunk.payload) for chunk in chunks]
        client.corrupt(chunks)
        bad = 0
        for chunk, original in zip(chunks, originals):
            flipped = sum(a != b for a, b in zip(chunk.payload, original))
            assert flipped in (0, 1)
            if flipped:
                bad += 1
                with pytest.raises(KVChunkError, match="failed its checksum"):
                    decode_chunk(chunk, expected(20))
        assert bad == expected_bad


def test_corrupted_scales_fail_the_checksum():
    chunk = encode_chunks("req-1", 1, "v", 0, 20, kv(20), get_codec("int8"), 20)[0]
    assert chunk.scales
    chunk.scales = bytes(len(chunk.scales))
    with pytest.raises(KVChunkError) as caught:
        decode_chunk(chunk, expected(20))
    assert caught.value.code == grpc.StatusCode.DATA_LOSS


def test_unknown_or_unaccepted_codec_is_refused():
    chunk = encode_chunks("req-1", 0, "k", 0, 8, kv(8), get_codec("none"), 8)[0]
    with pytest.raises(KVChunkError) as caught:
        decode_chunk(chunk, expected(8, codecs=frozenset(["int8"])))
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'none', not accepted here" in caught.value.message
    chunk.fields.codec = "gzip"
    with pytest.raises(KVChunkError) as caught:
        decode_chunk(chunk, expected(8, codecs=frozenset(["gzip"])))
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown KV codec 'gzip'" in caught.value.message


def wrong_layout_cases():
    # Each builds a chunk for another layout than the receiver's [T, 2, 16] with 4 layers and 8 prompt tokens.
    other_heads = torch.randn(8, 4, HEAD_DIM)
    return {
        "heads": (lambda: encode_chunks("req-1", 0, "k", 0, 8, other_heads, get_codec("none"), 8)[0],
                  "does not match [tokens, num_kv_heads, head_dim] = [8, 2, 16]"),
        "layer": (lambda: encode_chunks("req-1", 4, "k", 0, 8, kv(8), get_codec("none"), 8)[0],
                  "layer 4 is out of range"),
        "range": (lambda: encode_chunks("req-1", 0, "k", 4, 12, kv(8), get_codec("none"), 12)[0],
                  "token range [4, 12) is empty or outside the prompt's 8 tokens"),
        "request": (lambda: encode_chunks("req-2", 0, "k", 0, 8, kv(8), get_codec("none"), 8)[0],
                    "belongs to another request"),
    }


@pytest.mark.parametrize("case", ["heads", "layer", "range", "request"])
def test_chunks_that_do_not_fit_the_layout_are_refused(case):
    build, message = wrong_layout_cases()[case]
    with pytest.raises(KVChunkError) as caught:
        decode_chunk(build(), expected(8))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.message


def test_shape_field_inconsistent_with_the_range_is_refused():
    chunk = encode_chunks("req-1", 0, "k", 0, 8, kv(8), get_codec("none"), 8)[0]
    chunk.fields.token_end = 7  # the payload still holds 8 tokens
    with pytest.raises(KVChunkError) as caught:
        decode_chunk(chunk, expected(8))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape [8, 2, 16] does not match" in caught.value.message


def test_tensor_not_covering_its_range_is_a_programming_error():
    with pytest.raises(ValueError, match=r"does not cover tokens \[0, 9\)"):
        encode_chunks("req-1", 0, "k", 0, 9, kv(8), get_codec("none"), 9)


# ---- handshake ------------------------------------------------------------------------------------------------

LAYOUT = KVLayout("tiny-random", NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, block_size=16, cache_dtype="float32")


@pytest.mark.parametrize("field, value, message", [
    ("model_name", "other-model", "model_name: sender 'other-model', receiver 'tiny-random'"),
    ("num_layers", 6, "num_layers: sender 6, receiver 4"),
    ("num_kv_heads", 4, "num_kv_heads: sender 4, receiver 2"),
    ("head_dim", 64, "head_dim: sender 64, receiver 16"),
])
def test_handshake_mismatch_names_the_field(field, value, message):
    sender = dataclasses.replace(LAYOUT, **{field: value})
    assert sender.compat_hash != LAYOUT.compat_hash
    with pytest.raises(StatusError) as caught:
        check_compatible(LAYOUT, sender, sender.compat_hash, "none", ["none"])
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.message == message


def test_block_size_and_cache_dtype_do_not_matter():
    sender = dataclasses.replace(LAYOUT, block_size=32, cache_dtype="bfloat16")
    assert sender.compat_hash == LAYOUT.compat_hash
    check_compatible(LAYOUT, sender, sender.compat_hash, "int8", ["none", "int8"])


def test_handshake_refuses_an_unaccepted_codec_and_a_foreign_hash():
    with pytest.raises(StatusError, match="codec: 'int4' is not accepted by the receiver; accepted: none, int8"):
        check_compatible(LAYOUT, LAYOUT, LAYOUT.compat_hash, "int4", ["none", "int8"])
    with pytest.raises(StatusError, match="compat_hash: sender 'abc'"):
        check_compatible(LAYOUT, LAYOUT, "abc", "none", ["none"])
    check_compatible(LAYOUT, LAYOUT, LAYOUT.compat_hash, "", ["none"])  # layout only: fine


def test_layout_round_trips_through_its_proto():
    assert KVLayout.from_proto(LAYOUT.to_proto()) == LAYOUT


def test_kivi_chunks_keep_the_prompts_first_and_last_tokens_wherever_the_cut_falls():
    """Each side places a chunk in the prompt from its range and the prompt's length: the sinks and the window
    come back exactly however the tensor is cut into chunks."""
    tensor = kv(130, seed=2).half()
    chunks = encode_chunks("req-1", 0, "k", 0, 130, tensor, get_codec("kivi4"), 130, max_chunk_bytes=1024)
    assert len(chunks) > 3
    out = reassemble(chunks, 130)
    assert torch.equal(out[:4].half(), tensor[:4]) and torch.equal(out[-32:].half(), tensor[-32:])
    assert not torch.equal(out[4:-32].half(), tensor[4:-32])  # the middle is quantized


# ---- framing ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec_name", ["none", "int8", "kivi4+zstd"])
def test_a_framed_chunk_is_the_protobuf_message_and_parses_back_without_copying_its_payload(codec_name):
    chunk = encode_chunks("req-1", 3, "v", 0, 40, kv(40), get_codec(codec_name), 40, first_seq=5)[0]
    message = push_message(chunk)
    # Any protobuf reader sees the whole KVPush{chunk}, payload and scales included.
    assert kv_transfer_pb2.KVPush.FromString(message) == kv_transfer_pb2.KVPush(chunk=chunk.message())
    parsed = parse_push(message)
    assert parsed.fields == chunk.fields and not parsed.fields.payload and not parsed.fields.scales
    assert bytes(parsed.payload) == bytes(chunk.payload) and bytes(parsed.scales) == bytes(chunk.scales)
    assert isinstance(parsed.payload, memoryview) and parsed.payload.obj is message and parsed.payload.readonly
    assert torch.equal(decode_chunk(parsed, expected(40)).tensor, decode_chunk(chunk, expected(40)).tensor)


def test_a_chunk_serialized_by_protobuf_itself_parses_the_same():
    chunk = encode_chunks("req-1", 1, "k", 0, 20, kv(20), get_codec("int8"), 20)[0]
    parsed = parse_push(kv_transfer_pb2.KVPush(chunk=chunk.message()).SerializeToString())
    assert parsed.fields == chunk.fields
    assert (bytes(parsed.payload), bytes(parsed.scales)) == (bytes(chunk.payload), bytes(chunk.scales))


def test_a_chunk_spread_over_two_fields_parses_as_protobuf_merges_it():
    # Two serialized KVPush{chunk} back to back are one message whose chunk protobuf merges (the later bytes
    # fields win): legal, though no sender of ours writes it; the views must not pick the first payload.
    first, second = (encode_chunks("req-1", 0, "k", 0, 8, kv(8, seed), get_codec("int8"), 8)[0] for seed in (1, 2))
    message = push_message(first) + push_message(second)
    parsed, merged = parse_push(message), kv_transfer_pb2.KVPush.FromString(message).chunk
    assert (bytes(parsed.payload), bytes(parsed.scales)) == (merged.payload, merged.scales) == (
        bytes(second.payload), bytes(second.scales))


def test_headers_and_trailers_parse_as_messages():
    for push in (kv_transfer_pb2.KVPush(header=kv_transfer_pb2.KVTransferHeader(request_id="req-1")),
                 kv_transfer_pb2.KVPush(trailer=kv_transfer_pb2.KVTransferTrailer(num_chunks=3, num_tokens=8))):
        assert parse_push(push.SerializeToString()) == push

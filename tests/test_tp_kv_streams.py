"""Per-rank KV streams (issue 38): a tensor-parallel prefill engine hands its KV over rank head range by rank head
range, never gathered into one tensor; each range leaves as chunks that say which heads they carry
(``KVChunk.heads``); a decode engine of any degree writes each chunk's heads into the ranks that own them.

The path is the pods' own, short of gRPC: the prefill pod's KV export (prefill_service/kv_export.py) hands a
capturing sender each layer, the chunks are encoded and decoded by kvtransfer/wire.py, and written by
``write_heads`` as the decode pod's receiver writes them; the decode engine then continues the prompt, which must
give the tokens a TP 1 engine gives alone (float32). tests/test_tp_cluster.py runs the same through pods.
"""

from __future__ import annotations

import gc

import grpc
import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.parallel.sharded_kv_cache import write_heads
from splitserve.kvtransfer.codecs import get_codec
from splitserve.kvtransfer.wire import ExpectedChunks, KVChunkError, decode_chunk, encode_chunks
from splitserve.prefill_service.kv_export import PrefillKVExport

SETTINGS = {"model": "tiny-random", "cache_dtype": "float32", "num_blocks": 64, "enable_prefix_caching": False,
            "prefill_compute_dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(3, 40))


class _CapturingSender:
    """What the export hands a ``KVSender``: each layer's token range and its HeadsKV list."""

    def __init__(self):
        self.layers: list[tuple[int, int, int, list]] = []
        self.codec = get_codec("none")
        self.first_token, self.window_layers = 0, frozenset()  # a decode pod without a window keeps all of it

    def submit_layer(self, layer, token_start, token_end, heads) -> None:
        self.layers.append((layer, token_start, token_end, heads))

    def mark_compute_done(self) -> None:
        pass


def _export(engine) -> list[tuple[int, int, int, list]]:
    """The layers a prefill pod's export hands its sender for PROMPT; the request is then finished and freed."""
    export, sender = PrefillKVExport(engine), _CapturingSender()
    engine.kv_export = export
    seq = engine.add_request("p", PROMPT, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    export.register(seq, sender)
    while not seq.is_finished:
        engine.step()
    export.unregister("p")
    engine.kv_export = None
    return sender.layers


def _chunks(layers, num_kv_heads: int, head_dim: int):
    """Every layer's K and V as wire chunks (raw codec), through and back from the wire format."""
    codec, out = get_codec("none"), []
    for layer, start, end, heads in layers:
        for h, k, v in heads:
            for kind, tensor in (("k", k), ("v", v)):
                out += encode_chunks("r", layer, kind, start, end, tensor, codec, len(PROMPT), heads=h)
    expected = ExpectedChunks("r", 4, num_kv_heads, head_dim, len(PROMPT), frozenset({"none"}))
    return out, expected


def _continue(engine, chunks, expected, first_token: int) -> list[int]:
    """The decode pod's side: reserve, write each chunk's heads where they belong, admit with the prefill's first
    token, decode."""
    seq = engine.reserve_for_transfer("d", PROMPT, GREEDY)
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, len(PROMPT))
    for chunk in chunks:
        decoded = decode_chunk(chunk, expected)
        write_heads(cache, decoded.layer, decoded.kind, slots[decoded.token_start:decoded.token_end],
                    decoded.tensor, decoded.heads)
    engine.admit_prefilled(seq, first_token)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return seq.output_token_ids


@pytest.fixture(scope="module")
def reference():
    """TP 1's greedy tokens for PROMPT, alone."""
    llm = LLM(tensor_parallel_size=1, **SETTINGS)
    tokens = llm.generate(PROMPT, GREEDY)[0].token_ids
    del llm
    gc.collect()
    return tokens


@pytest.mark.e2e
def test_each_rank_s_kv_heads_leave_as_chunks_of_their_own_and_any_degree_takes_them(reference):
    one, two = LLM(tensor_parallel_size=1, **SETTINGS).engine, LLM(tensor_parallel_size=2, **SETTINGS).engine
    config = one.model_config  # tiny-random: 2 KV heads, one per rank at TP 2
    from_one, from_two = _export(one), _export(two)
    assert [len(heads) for *_, heads in from_one] == [1] * config.num_layers
    assert {heads[0].heads for *_, heads in from_one} == {None}  # one process: every head, chunks leave heads unset
    # TP 2: each layer as two head ranges, each rank's own heads, not one gathered [T, 2, D] tensor
    assert [[h.heads for h in heads] for *_, heads in from_two] == [[(0, 1), (1, 2)]] * config.num_layers
    assert all(h.k.shape == h.v.shape == (len(PROMPT), 1, config.head_dim) for *_, heads in from_two for h in heads)
    for (_, _, _, theirs), (_, _, _, ours) in zip(from_one, from_two):
        assert torch.allclose(torch.cat([h.k for h in ours], dim=1), theirs[0].k, atol=1e-5)
        assert torch.allclose(torch.cat([h.v for h in ours], dim=1), theirs[0].v, atol=1e-5)

    chunks_one, expected = _chunks(from_one, config.num_kv_heads, config.head_dim)
    chunks_two, _ = _chunks(from_two, config.num_kv_heads, config.head_dim)
    assert not any(c.fields.HasField("heads") for c in chunks_one)
    assert sorted({(c.fields.heads.start, c.fields.heads.end) for c in chunks_two}) == [(0, 1), (1, 2)]
    assert all(list(c.fields.shape)[1] == 1 for c in chunks_two)

    # P TP 1 -> D TP 2: a chunk's heads split over the ranks; P TP 2 -> D TP 1: two chunks fill one pool's rows
    assert _continue(two, chunks_one, expected, reference[0]) == reference
    assert _continue(one, chunks_two, expected, reference[0]) == reference
    assert _continue(two, chunks_two, expected, reference[0]) == reference  # P TP 2 -> D TP 2
    del one, two
    gc.collect()


@pytest.mark.e2e
def test_more_ranks_than_kv_heads_send_each_replicated_head_once(reference):
    """TP 4 on 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1; each head leaves once, from its first rank, and
    a TP 4 decode engine writes it into both ranks that hold it."""
    four = LLM(tensor_parallel_size=4, **SETTINGS).engine
    layers = _export(four)
    assert [[h.heads for h in heads] for *_, heads in layers] == [[(0, 1), (1, 2)]] * four.model_config.num_layers
    chunks, expected = _chunks(layers, four.model_config.num_kv_heads, four.model_config.head_dim)
    assert _continue(four, chunks, expected, reference[0]) == reference
    del four
    gc.collect()


def test_a_chunk_whose_heads_do_not_fit_the_model_is_refused():
    codec = get_codec("none")
    expected = ExpectedChunks("r", 4, 2, 8, 4, frozenset({"none"}))
    (chunk,) = encode_chunks("r", 0, "k", 0, 4, torch.zeros(4, 1, 8), codec, 4, heads=(2, 3))
    with pytest.raises(KVChunkError, match=r"KV heads \[2, 3\) are empty or outside the model's 2") as refused:
        decode_chunk(chunk, expected)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    (chunk,) = encode_chunks("r", 0, "k", 0, 4, torch.zeros(4, 2, 8), codec, 4, heads=(1, 2))  # 2 heads for 1
    with pytest.raises(KVChunkError, match=r"shape \[4, 2, 8\] does not match"):
        decode_chunk(chunk, expected)

"""A prefill pod and a decode pod on loopback, with the tiny random model: the disaggregated path gives the offline
engine's tokens, the KV arrives intact, and every failure (expired lease, corrupt chunk, incompatible peer, full pool,
cancelled stream, bad input) ends with a clear status and every block free again on both pods.

The pods run in this process, on an event loop in a background thread, exactly as ``python -m
splitserve.prefill_service`` / ``decode_service`` build them; the tests call them through ordinary (synchronous) gRPC
stubs. One test starts the real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from splitserve.decode_service.config import DecodeConfig
from splitserve.decode_service.server import build_decode_services
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.block_manager import chained_block_hashes
from splitserve.engine.kernels.cpu_features import bf16_isas, matrix_features, prefill_compute_dtype
from splitserve.engine.llm_engine import WARM_UP_PROMPTS
from splitserve.kvtransfer.codecs import get_codec
from splitserve.kvtransfer.handshake import KVLayout
from splitserve.kvtransfer.link_codec import CodecQuality, LinkCodecChooser, QualityTable
from splitserve.kvtransfer.sender import KVTransferClient
from splitserve.kvtransfer.wire import encode_chunks
from splitserve.prefill_service.config import PrefillConfig
from splitserve.prefill_service.server import build_prefill_services
from splitserve.runtime.config import parse_config
from splitserve.runtime.pod_server import Pod
from splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    pod_status_pb2,
    pod_status_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-random"  # 4 layers, 2 KV heads of 16 dims
CACHE_BYTES = 2  # the pods' default float16 cache: codec "none" moves 2 x 16 x 2 = 64 bytes of K (and of V)
#                  per token and layer
PREFILL_BUDGET = 64  # tokens per prefill step: longer prompts prefill in chunks
DECODE_BLOCKS = 24  # 384 tokens: small enough to fill in a test
ACCEPTED_CODECS = ["none", "int8", "int8+zstd"]  # int4 deliberately left out


class LoopThread:
    """An event loop on its own thread, where the pods serve."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pods-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class Pods:
    """Both pods, their stubs, and the offline engine that gives the reference answers."""

    def __init__(self, model: str = MODEL, **engine) -> None:
        """``engine``: settings of both pods and the offline engine (cache_dtype, prefill_compute_dtype)."""
        self.thread = LoopThread()
        common = dict(host="127.0.0.1", port=0, metrics_port=0, model=model, load_refresh_interval_s=0.2, **engine)
        self.prefill_config = PrefillConfig(num_blocks=64, max_num_batched_tokens=PREFILL_BUDGET,
                                            long_prefill_token_threshold=PREFILL_BUDGET, **common)
        self.decode_config = DecodeConfig(num_blocks=DECODE_BLOCKS, accepted_kv_codecs=ACCEPTED_CODECS, **common)
        self.prefill_pod = Pod(self.prefill_config, "prefill")
        self.decode_pod = Pod(self.decode_config, "decode")
        self.thread.run(self._start())
        self.decode_address = f"127.0.0.1:{self.decode_pod.port}"
        self._channels = [grpc.insecure_channel(f"127.0.0.1:{pod.port}") for pod in (self.prefill_pod, self.decode_pod)]
        self.prefill = prefill_pb2_grpc.PrefillStub(self._channels[0])
        self.decode = decode_pb2_grpc.DecodeStub(self._channels[1])
        self.kv = kv_transfer_pb2_grpc.KVTransferStub(self._channels[1])
        self.prefill_status, self.decode_status = (pod_status_pb2_grpc.PodStatusStub(c) for c in self._channels)
        self.offline = LLM(model=model, num_blocks=64, **engine)

    async def _start(self) -> None:
        prefill_services = await build_prefill_services(self.prefill_pod, self.prefill_config)
        self.kv_client = prefill_services[0].kv_client
        await self.prefill_pod.start(prefill_services)
        decode_services = await build_decode_services(self.decode_pod, self.decode_config)
        self.handoff = decode_services[0].handoff
        await self.decode_pod.start(decode_services)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self.thread.run(self.prefill_pod.stop())
        self.thread.run(self.decode_pod.stop())
        self.thread.close()

    # ---- calls -----------------------------------------------------------------------------------------------

    def run_prefill(self, request_id: str, prompt: list[int], params: common_pb2.SamplingParams, codec: str = "none",
                    lease_s: float = 0.0) -> prefill_pb2.PrefillResponse:
        return self.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
            decode_address=self.decode_address, kv_codec=codec, kv_lease_seconds=lease_s), timeout=60)

    def run_decode(self, request_id: str, prompt: list[int], params: common_pb2.SamplingParams,
                   first: prefill_pb2.PrefillResponse | None = None):
        """All output tokens (the prefill pod's first one included), their logprobs, and the DecodeComplete."""
        request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)
        tokens, logprobs = [], []
        if first is not None:
            request.first_token_id = first.first_token_id
            tokens.append(first.first_token_id)
            if first.HasField("first_token_logprob"):
                request.first_token_logprob.CopyFrom(first.first_token_logprob)
                logprobs.append(first.first_token_logprob)
        complete = None
        for message in self.decode.Decode(request, timeout=60):
            assert complete is None, "nothing may follow DecodeComplete"
            if message.HasField("chunk"):
                tokens += message.chunk.token_ids
                logprobs += message.chunk.logprobs.tokens
            else:
                complete = message.complete
        return tokens, logprobs, complete

    def offline_tokens(self, prompt: list[int], params: SamplingParams) -> list[int]:
        return self.offline.generate([prompt], params)[0].token_ids

    def engine_hits(self, which: str) -> int:
        """Prompt tokens the pod's engine found in its prefix cache so far."""
        pod = self.prefill_pod if which == "prefill" else self.decode_pod
        return pod.engine.block_manager.prefix_hits

    def load(self, which: str) -> common_pb2.PodLoad:
        stub = self.prefill_status if which == "prefill" else self.decode_status
        return stub.GetLoad(pod_status_pb2.LoadRequest(), timeout=10)

    def wait_all_free(self, which: str, timeout_s: float = 5.0) -> common_pb2.PodLoad:
        deadline = time.monotonic() + timeout_s
        while True:
            load = self.load(which)
            if load.free_kv_blocks == load.total_kv_blocks and load.num_running == load.num_waiting == 0:
                return load
            if time.monotonic() > deadline:
                raise AssertionError(f"{which} pod still holds KV blocks: {load}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def pods():
    pods = Pods()
    yield pods
    pods.close()


@pytest.fixture(autouse=True)
def every_block_free_afterwards(request):
    yield
    if "pods" in request.fixturenames:
        pods = request.getfixturevalue("pods")
        for which in ("prefill", "decode"):
            assert pods.wait_all_free(which).total_kv_blocks > 0
        assert len(pods.handoff) == 0
        # no reservation left counted as KV on its way (it would keep lent prompts' chunks short for good)
        assert not pods.decode_pod.engine.scheduler.awaiting_kv


def prompt_of(length: int, seed: int) -> list[int]:
    """Random byte tokens (ids 3..258 of the tiny vocabulary), distinct per seed so tests share no prefix."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (length,), generator=generator).tolist()


GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=16)


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__"):
            list(result)
    return caught.value


# ---- the disaggregated path gives the offline engine's answer --------------------------------------------------

@pytest.mark.parametrize("length", [5, 40, 150])  # under a block; over a block; chunked on the prefill pod (64+64+22)
def test_prefill_then_decode_gives_the_offline_greedy_tokens(pods, length):
    prompt = prompt_of(length, seed=length)
    first = pods.run_prefill(f"greedy-{length}", prompt, GREEDY)
    tokens, _, complete = pods.run_decode(f"greedy-{length}", prompt, GREEDY, first)
    assert tokens == pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (complete.usage.prompt_tokens, complete.usage.completion_tokens) == (length, 16)
    stats = first.kv_transfer
    steps = -(-length // PREFILL_BUDGET)  # each prefill step sends every layer's K and V of its tokens
    assert (stats.codec, stats.num_chunks) == ("none", steps * 4 * 2)
    assert stats.bytes_sent == stats.raw_bytes == length * 4 * 2 * (2 * 16 * CACHE_BYTES)  # tokens x layers x K/V
    assert 0 < stats.transfer_seconds < 10 and 0 <= stats.exposed_transfer_seconds < 10
    assert first.num_cached_tokens == 0 and first.prefill_seconds > 0


def test_seeded_sampling_and_logprobs_match_the_offline_engine(pods):
    prompt = prompt_of(40, seed=1001)
    params = common_pb2.SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=12, logprobs=2)
    first = pods.run_prefill("seeded", prompt, params)
    tokens, logprobs, _ = pods.run_decode("seeded", prompt, params, first)
    reference = pods.offline.generate([prompt], SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=12,
                                                               logprobs=2))[0]
    assert tokens == reference.token_ids
    assert [entry.token_id for entry in logprobs] == tokens
    for entry, expected in zip(logprobs, reference.logprobs):
        assert entry.logprob == pytest.approx(expected[entry.token_id], abs=1e-6)
        assert [top.token_id for top in entry.top_logprobs] == list(expected)[:2]


def test_concurrent_prefills_all_match_the_offline_engine(pods):
    prompts = {f"together-{i}": prompt_of(20 + 7 * i, seed=2000 + i) for i in range(3)}
    futures = {rid: pods.prefill.Prefill.future(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=GREEDY, decode_address=pods.decode_address,
        kv_codec="none"))
        for rid, prompt in prompts.items()}
    firsts = {rid: future.result(timeout=60) for rid, future in futures.items()}
    for rid, prompt in prompts.items():
        tokens, _, _ = pods.run_decode(rid, prompt, GREEDY, firsts[rid])
        assert tokens == pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))


def test_prefix_cache_hit_on_the_prefill_pod_still_ships_the_whole_prompt(pods):
    shared = prompt_of(32, seed=3000)  # two full blocks
    first_prompt, second_prompt = shared + prompt_of(8, seed=3001), shared + prompt_of(9, seed=3002)
    pods.run_decode("prefix-a", first_prompt, GREEDY, pods.run_prefill("prefix-a", first_prompt, GREEDY))
    second = pods.run_prefill("prefix-b", second_prompt, GREEDY)
    assert second.num_cached_tokens == 32
    # The cached prefix was not computed in this step, and still travels: all 41 tokens, in one step.
    assert (second.kv_transfer.num_chunks, second.kv_transfer.raw_bytes) == (8, 41 * 4 * 2 * (2 * 16 * CACHE_BYTES))
    tokens, _, complete = pods.run_decode("prefix-b", second_prompt, GREEDY, second)
    assert tokens == pods.offline_tokens(second_prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert complete.usage.cached_tokens == 0  # the decode pod did not prefill
    labels = {"role": "prefill", "model_name": MODEL}
    assert pods.prefill_pod.metrics.registry.get_sample_value("splitserve_prefix_cache_hits_total", labels) >= 32


def test_decode_without_a_first_token_prefills_locally(pods):
    prompt = prompt_of(40, seed=4000)
    tokens, _, complete = pods.run_decode("local", prompt, GREEDY)
    assert tokens == pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert complete.usage.completion_tokens == 16 and complete.prefill_seconds > 0


# A split prefill: the prefill pod prefills the prompt's first tokens as a prompt of their own and pushes their KV;
# the decode pod takes it through its prefix cache and prefills the rest (router/placement.py, _start_split).
@pytest.mark.parametrize("length,prefix", [(150, 96), (150, 100), (40, 16)])  # whole blocks; 6 blocks + 4; 1 block
def test_a_split_prefill_gives_the_offline_greedy_tokens(pods, length, prefix):
    prompt = prompt_of(length, seed=length * 1000 + prefix)
    loaded, hits = metric(pods.decode_pod, "splitserve_kv_load_total", outcome="loaded"), pods.engine_hits("decode")
    pods.run_prefill(f"split-{length}-{prefix}", prompt[:prefix], common_pb2.SamplingParams(max_tokens=1))
    request = decode_pb2.DecodeRequest(request_id=f"split-{length}-{prefix}", prompt_token_ids=prompt,
                                       sampling_params=GREEDY, kv_prefix_tokens=prefix)
    tokens, complete = tokens_and_complete(pods.decode.Decode(request, timeout=60))
    assert tokens == pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    whole_blocks = prefix // 16 * 16  # the partly filled last block of the prefix is computed again
    assert complete.usage.cached_tokens == whole_blocks and complete.prefill_seconds > 0
    assert pods.engine_hits("decode") - hits == whole_blocks
    assert metric(pods.decode_pod, "splitserve_kv_load_total", outcome="loaded") == loaded + 1


def test_a_split_prefill_whose_prefix_kv_is_gone_computes_it_here(pods):
    prompt = prompt_of(80, seed=4200)
    recomputed = metric(pods.decode_pod, "splitserve_kv_load_total", outcome="recomputed")
    request = decode_pb2.DecodeRequest(request_id="split-gone", prompt_token_ids=prompt, sampling_params=GREEDY,
                                       kv_prefix_tokens=32)  # never pushed (as after its lease expired)
    tokens, complete = tokens_and_complete(pods.decode.Decode(request, timeout=60))
    assert tokens == pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert complete.usage.cached_tokens == 0
    assert metric(pods.decode_pod, "splitserve_kv_load_total", outcome="recomputed") == recomputed + 1


@pytest.mark.parametrize("fields", [dict(kv_prefix_tokens=40), dict(kv_prefix_tokens=-1),
                                    dict(kv_prefix_tokens=16, first_token_id=5),
                                    dict(kv_prefix_tokens=16, resume_token_ids=[5])])
def test_a_split_prefill_outside_the_prompt_or_with_a_first_token_is_refused(pods, fields):
    request = decode_pb2.DecodeRequest(request_id="split-bad", prompt_token_ids=prompt_of(40, seed=4300),
                                       sampling_params=GREEDY, **fields)
    error = rpc_error(pods.decode.Decode, request, timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_prefix_tokens" in error.details()


def tokens_and_complete(stream) -> tuple[list[int], decode_pb2.DecodeComplete]:
    tokens, complete = [], None
    for message in stream:
        if message.HasField("chunk"):
            tokens += message.chunk.token_ids
        else:
            complete = message.complete
    return tokens, complete


def test_first_token_that_ends_the_request_completes_without_a_chunk(pods):
    prompt = prompt_of(20, seed=4500)
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=1)
    first = pods.run_prefill("one-token", prompt, params)
    tokens, _, complete = pods.run_decode("one-token", prompt, params, first)
    assert tokens == [first.first_token_id]
    assert complete.finish_reason == common_pb2.FINISH_REASON_LENGTH and complete.usage.completion_tokens == 1


# ---- the KV itself -----------------------------------------------------------------------------------------------

def offline_prompt_kv(pods, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The offline engine's K and V of the prompt, per layer: [T, H, D] each."""
    engine = pods.offline.engine
    seq = engine.add_request("reference-kv", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    engine.step()  # the whole prompt in one step; the sequence keeps its blocks
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, len(prompt))
    kv = [(cache.read(layer, "k", slots), cache.read(layer, "v", slots)) for layer in range(4)]
    engine.abort_request("reference-kv")
    return kv


@pytest.mark.parametrize("codec", ["none", "int8+zstd"])
def test_kv_that_arrived_equals_the_prefill_kv(pods, codec):
    prompt = prompt_of(40, seed=5000)
    pods.run_prefill(f"kv-{codec}", prompt, GREEDY, codec=codec, lease_s=30)
    seq = pods.handoff.get(f"kv-{codec}").seq
    cache = pods.decode_pod.engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, len(prompt))
    for layer, (k_ref, v_ref) in enumerate(offline_prompt_kv(pods, prompt)):
        for arrived, reference in ((cache.read(layer, "k", slots), k_ref), (cache.read(layer, "v", slots), v_ref)):
            if codec == "none":
                assert torch.equal(arrived, reference)
            else:  # int8: at most half a quantization step of absmax / 127 per (token, head)
                step = reference.abs().amax(dim=-1, keepdim=True) / 127
                assert bool(((arrived - reference).abs() <= step * 0.5 + 1e-3).all())
    assert pods.decode.Abort(common_pb2.AbortRequest(request_id=f"kv-{codec}")).found


# ---- failures end cleanly -------------------------------------------------------------------------------------

def test_an_unclaimed_lease_expires_and_frees_its_blocks(pods):
    prompt = prompt_of(40, seed=6000)
    first = pods.run_prefill("expires", prompt, GREEDY, lease_s=0.3)
    load = pods.load("decode")
    assert load.total_kv_blocks - load.free_kv_blocks == 3  # 40 tokens in blocks of 16
    pods.wait_all_free("decode", timeout_s=3)
    error = rpc_error(pods.run_decode, "expires", prompt, GREEDY, first)
    assert error.code() == grpc.StatusCode.NOT_FOUND and "lease expired" in error.details()


def test_decode_without_pushed_kv_is_not_found(pods):
    request = decode_pb2.DecodeRequest(request_id="never-pushed", prompt_token_ids=[5, 6, 7], sampling_params=GREEDY,
                                       first_token_id=9)
    error = rpc_error(pods.decode.Decode, request)
    assert error.code() == grpc.StatusCode.NOT_FOUND


def handshaken_header(pods, request_id: str, prompt: list[int]) -> kv_transfer_pb2.KVPush:
    layout = KVLayout.of_engine(pods.prefill_pod.engine)
    answer = pods.kv.Handshake(kv_transfer_pb2.HandshakeRequest(layout=layout.to_proto(),
                                                                compat_hash=layout.compat_hash, codec="none"))
    assert list(answer.supported_codecs) == ACCEPTED_CODECS
    return kv_transfer_pb2.KVPush(header=kv_transfer_pb2.KVTransferHeader(
        request_id=request_id, prompt_token_ids=prompt, compat_hash=answer.compat_hash, lease_seconds=30))


def layer_chunks(request_id: str, num_tokens: int, layers=range(4), num_kv_heads: int = 2,
                 head_dim: int = 16) -> list[kv_transfer_pb2.KVPush]:
    chunks = []
    for layer in layers:
        for kind in ("k", "v"):
            chunks += encode_chunks(request_id, layer, kind, 0, num_tokens,
                                    torch.randn(num_tokens, num_kv_heads, head_dim),
                                    get_codec("none"), num_tokens, first_seq=len(chunks))
    return [kv_transfer_pb2.KVPush(chunk=chunk.message()) for chunk in chunks]


def trailer(num_chunks: int, num_tokens: int) -> kv_transfer_pb2.KVPush:
    return kv_transfer_pb2.KVPush(trailer=kv_transfer_pb2.KVTransferTrailer(num_chunks=num_chunks,
                                                                            num_tokens=num_tokens))


def test_a_corrupted_chunk_gets_data_loss_and_frees_the_blocks(pods):
    prompt = prompt_of(20, seed=7000)
    chunks = layer_chunks("corrupt", 20)
    payload = bytearray(chunks[3].chunk.payload)
    payload[100] ^= 0xFF
    chunks[3].chunk.payload = bytes(payload)
    stream = [handshaken_header(pods, "corrupt", prompt), *chunks, trailer(len(chunks), 20)]
    error = rpc_error(pods.kv.PushKV, iter(stream))
    assert error.code() == grpc.StatusCode.DATA_LOSS and "failed its checksum" in error.details()


def test_a_push_missing_a_layer_gets_data_loss_at_the_trailer(pods):
    prompt = prompt_of(20, seed=7100)
    chunks = layer_chunks("incomplete", 20, layers=range(3))
    stream = [handshaken_header(pods, "incomplete", prompt), *chunks, trailer(len(chunks), 20)]
    error = rpc_error(pods.kv.PushKV, iter(stream))
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert "the first at layer 3, K, token 0" in error.details()


def push_error(pods, stream) -> grpc.RpcError:
    return rpc_error(pods.kv.PushKV, iter(stream))


@pytest.mark.parametrize("fault", ["gap", "repeat"])
def test_a_push_refuses_a_gap_or_a_repeat_in_the_chunk_sequence(pods, fault):
    prompt = prompt_of(20, seed=7300)
    chunks = layer_chunks(f"seq-{fault}", 20)
    if fault == "gap":
        del chunks[2]
    else:
        chunks.insert(3, chunks[2])
    error = push_error(pods, [handshaken_header(pods, f"seq-{fault}", prompt), *chunks, trailer(len(chunks), 20)])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"chunk seq {2 if fault == 'repeat' else 3} arrived where" in error.details()


def test_a_push_refuses_a_codec_switch_midway(pods):
    prompt = prompt_of(20, seed=7310)
    chunks = layer_chunks("switch", 20)
    int8 = encode_chunks("switch", 0, "v", 0, 20, torch.randn(20, 2, 16), get_codec("int8"), 20, first_seq=1)
    chunks[1] = kv_transfer_pb2.KVPush(chunk=int8[0].message())
    error = push_error(pods, [handshaken_header(pods, "switch", prompt), *chunks, trailer(len(chunks), 20)])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "uses codec 'int8'; this push uses 'none'" in error.details()


def test_a_push_refuses_a_token_range_it_already_received(pods):
    prompt = prompt_of(20, seed=7320)
    again = encode_chunks("twice", 0, "k", 5, 12, torch.randn(7, 2, 16), get_codec("none"), 20,
                          first_seq=1)
    chunks = layer_chunks("twice", 20)[:1] + [kv_transfer_pb2.KVPush(chunk=again[0].message())]
    error = push_error(pods, [handshaken_header(pods, "twice", prompt), *chunks])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "repeats KV already received (layer 0, K, tokens [5, 12))" in error.details()


@pytest.mark.parametrize("fault", ["chunks", "tokens"])
def test_a_push_refuses_a_trailer_whose_counts_do_not_match(pods, fault):
    prompt = prompt_of(20, seed=7330 + len(fault))
    chunks = layer_chunks(f"trailer-{fault}", 20)  # 8: each layer's K and V in one chunk
    counts = (len(chunks) + 1, 20) if fault == "chunks" else (len(chunks), 21)
    error = push_error(pods, [handshaken_header(pods, f"trailer-{fault}", prompt), *chunks, trailer(*counts)])
    if fault == "chunks":
        assert error.code() == grpc.StatusCode.DATA_LOSS
        assert "trailer says 9 chunks were sent, 8 arrived" in error.details()
    else:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "trailer covers 21 tokens, the header's prompt has 20" in error.details()


def test_a_push_must_start_with_its_header(pods):
    error = push_error(pods, [*layer_chunks("headless", 20), trailer(8, 20)])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in error.details()


def test_a_second_push_for_a_request_id_with_kv_here_is_already_exists(pods):
    prompt = prompt_of(20, seed=7340)
    complete = [handshaken_header(pods, "dup", prompt), *layer_chunks("dup", 20), trailer(8, 20)]
    pods.kv.PushKV(iter(complete))
    error = push_error(pods, complete)
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert pods.decode.Abort(common_pb2.AbortRequest(request_id="dup")).found


def test_a_claim_for_another_prompt_is_refused_and_the_kv_still_waits(pods):
    prompt = prompt_of(20, seed=7350)
    pods.kv.PushKV(iter([handshaken_header(pods, "other", prompt), *layer_chunks("other", 20), trailer(8, 20)]))
    request = decode_pb2.DecodeRequest(request_id="other", prompt_token_ids=prompt_of(20, seed=7351),
                                       sampling_params=GREEDY, first_token_id=7)
    error = rpc_error(pods.decode.Decode, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "differ from the prompt pushed" in error.details()
    assert pods.decode.Abort(common_pb2.AbortRequest(request_id="other")).found


class HeldPush:
    """A PushKV whose header and first chunks are sent, then held open until released or cancelled."""

    def __init__(self, pods, request_id: str, prompt: list[int]):
        self.release = threading.Event()
        chunks = layer_chunks(request_id, len(prompt))
        head = [handshaken_header(pods, request_id, prompt), *chunks[:4]]

        def messages():
            yield from head
            self.release.wait(30)
            yield from chunks[4:]
            yield trailer(len(chunks), len(prompt))

        self.call = pods.kv.PushKV.future(messages())


def wait_transfer_state(pods, request_id: str, state: str) -> None:
    wait_until(lambda: (lease := pods.handoff.get(request_id)) is not None and lease.state.name == state)


def test_a_claim_while_the_kv_is_still_arriving_is_failed_precondition(pods):
    prompt = prompt_of(20, seed=7360)
    push = HeldPush(pods, "arriving", prompt)
    wait_transfer_state(pods, "arriving", "RECEIVING")
    request = decode_pb2.DecodeRequest(request_id="arriving", prompt_token_ids=prompt, sampling_params=GREEDY,
                                       first_token_id=7)
    error = rpc_error(pods.decode.Decode, request)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "RECEIVING" in error.details()
    push.release.set()
    push.call.result(timeout=30)
    assert pods.decode.Abort(common_pb2.AbortRequest(request_id="arriving")).found


@pytest.mark.parametrize("how", ["abort", "cancel"])
def test_an_abort_or_a_cancelled_push_while_receiving_frees_every_block(pods, how):
    prompt = prompt_of(40, seed=7370)
    push = HeldPush(pods, f"held-{how}", prompt)
    wait_transfer_state(pods, f"held-{how}", "RECEIVING")
    assert pods.load("decode").free_kv_blocks == DECODE_BLOCKS - 3  # 40 tokens: 3 blocks reserved
    if how == "abort":
        assert pods.decode.Abort(common_pb2.AbortRequest(request_id=f"held-{how}")).found
        push.release.set()  # the handler sees the abort at its next message
        with pytest.raises(grpc.RpcError) as caught:
            push.call.result(timeout=30)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
    else:
        push.call.cancel()
        push.release.set()
    pods.wait_all_free("decode")  # and the autouse check: every block of both pods, no lease left


def test_a_complete_hand_made_push_is_acknowledged_under_its_lease(pods):
    prompt = prompt_of(20, seed=7200)
    chunks = layer_chunks("by-hand", 20)
    labels = {"role": "decode", "model_name": MODEL, "codec": "none"}
    received_before = pods.decode_pod.metrics.registry.get_sample_value("splitserve_kv_transfer_bytes_total", labels)
    response = pods.kv.PushKV(iter([handshaken_header(pods, "by-hand", prompt), *chunks, trailer(len(chunks), 20)]))
    assert (response.bytes_received, response.num_blocks, response.lease_remaining_seconds) == (8 * 20 * 128, 2, 30)
    received = pods.decode_pod.metrics.registry.get_sample_value("splitserve_kv_transfer_bytes_total", labels)
    assert received - (received_before or 0) == 8 * 20 * 128
    assert pods.decode.Abort(common_pb2.AbortRequest(request_id="by-hand")).found


def test_handshake_mismatch_is_failed_precondition(pods):
    layout = KVLayout.of_engine(pods.prefill_pod.engine)
    wrong = KVLayout(layout.model_name, layout.num_layers, 4, layout.head_dim, layout.block_size, layout.cache_dtype)
    error = rpc_error(pods.kv.Handshake, kv_transfer_pb2.HandshakeRequest(
        layout=wrong.to_proto(), compat_hash=wrong.compat_hash, codec="none"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == "num_kv_heads: sender 4, receiver 2"
    # Through the prefill pod: a codec the decode pod does not take.
    error = rpc_error(pods.run_prefill, "int4-refused", prompt_of(20, seed=8000), GREEDY, codec="int4")
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "codec: 'int4' is not accepted by the receiver" in error.details()


def test_the_handshake_carries_both_weight_formats_which_may_differ(pods, caplog):
    """The KV layout must match, the weights' formats need not: a prefill pod whose weights are int8 handshakes with
    the float decode pod, each learns the other's format (and logs it), and each pod's load report says its own."""
    caplog.set_level(logging.INFO, logger="splitserve.kvtransfer.handshake")
    layout = KVLayout.of_engine(pods.prefill_pod.engine)
    assert layout.quantization == pods.load("prefill").quantization == pods.load("decode").quantization == "none"
    int8_layout = dataclasses.replace(layout, quantization="int8")
    assert int8_layout.compat_hash == layout.compat_hash and KVLayout.from_proto(int8_layout.to_proto()) == int8_layout
    client = KVTransferClient(int8_layout)
    try:
        pods.thread.run(client.handshake(pods.decode_address, "none", timeout_s=10))
    finally:
        pods.thread.run(client.close())
    notes = {re.match(r"(\w+ pod) \S+ keeps its weights as '(\w+)', this pod as '(\w+)'", record.getMessage())
             for record in caplog.records}
    assert {note.groups() for note in notes if note} == {("prefill pod", "int8", "none"),  # the decode pod's note
                                                         ("decode pod", "none", "int8")}  # the prefill side's
    response = pods.kv.Handshake(kv_transfer_pb2.HandshakeRequest(
        layout=int8_layout.to_proto(), compat_hash=int8_layout.compat_hash, codec="none"), timeout=10)
    assert KVLayout.from_proto(response.layout).quantization == "none"


def test_a_full_decode_pod_answers_resource_exhausted_through_prefill(pods):
    for i in range(2):  # 150 tokens = 10 blocks each: 20 of 24 taken
        pods.run_prefill(f"hog-{i}", prompt_of(150, seed=9000 + i), GREEDY, lease_s=30)
    try:
        assert pods.load("decode").free_kv_blocks == DECODE_BLOCKS - 20
        error = rpc_error(pods.run_prefill, "no-room", prompt_of(150, seed=9002), GREEDY)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "no room for the KV of 150 tokens: 4 of 24 blocks free" in error.details()
    finally:  # released whatever happened, so that a failure here stays this test's own
        found = [pods.decode.Abort(common_pb2.AbortRequest(request_id=f"hog-{i}")).found for i in range(2)]
    assert found == [True, True]  # Abort releases a lease that waits for its Decode call


@pytest.mark.parametrize("prefilled", [True, False])
def test_cancelling_a_decode_stream_frees_its_blocks(pods, prefilled):
    prompt = prompt_of(40, seed=10000 + prefilled)
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    request = decode_pb2.DecodeRequest(request_id=f"cancel-{prefilled}", prompt_token_ids=prompt,
                                       sampling_params=params)
    if prefilled:
        request.first_token_id = pods.run_prefill(request.request_id, prompt, params).first_token_id
    stream = pods.decode.Decode(request)
    assert next(stream).HasField("chunk") and next(stream).HasField("chunk")
    assert pods.load("decode").num_running == 1
    stream.cancel()
    pods.wait_all_free("decode")


def test_abort_stops_a_running_decode_with_finish_reason_abort(pods):
    prompt = prompt_of(30, seed=11000)
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    stream = pods.decode.Decode(decode_pb2.DecodeRequest(request_id="aborted", prompt_token_ids=prompt,
                                                         sampling_params=params))
    assert next(stream).HasField("chunk")
    assert pods.decode.Abort(common_pb2.AbortRequest(request_id="aborted")).found
    last = list(stream)[-1]
    assert last.complete.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not pods.decode.Abort(common_pb2.AbortRequest(request_id="aborted")).found  # idempotent


@pytest.mark.parametrize("where, params, prompt, message", [
    ("prefill", common_pb2.SamplingParams(temperature=-1.0), [5, 6, 7],
     "sampling_params.temperature must be >= 0 and finite, got -1.0"),
    ("prefill", GREEDY, [5, 9999], "prompt token ids must be integers in [0, 259)"),
    ("decode", common_pb2.SamplingParams(top_p=2.0), [5, 6, 7], "sampling_params.top_p must be in (0, 1], got 2.0"),
    ("decode", GREEDY, [], "prompt must contain at least one token"),
])
def test_invalid_requests_are_invalid_argument(pods, where, params, prompt, message):
    if where == "prefill":
        error = rpc_error(pods.run_prefill, "invalid", prompt, params)
    else:
        error = rpc_error(pods.run_decode, "invalid", prompt, params)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_both_pods_check_a_request_as_every_pod_does(pods, where):
    """runtime/pod_server.py's checked_params, the one check both pods start with: a request id, valid params."""
    run = pods.run_prefill if where == "prefill" else pods.run_decode
    error = rpc_error(run, "", [5, 6, 7], GREEDY)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id must be set")
    error = rpc_error(run, "bad-params", [5, 6, 7], common_pb2.SamplingParams(max_tokens=-1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("sampling_params.max_tokens")


@pytest.mark.parametrize("codec", ["gzip", ""])
def test_unknown_codec_is_invalid_argument(pods, codec):
    """The router names the codec in every request; the prefill pod has no default to fall back on."""
    error = rpc_error(pods.run_prefill, f"codec-{codec}", [5, 6, 7], GREEDY, codec=codec)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"unknown KV codec '{codec}'" in error.details()


class StallingReceiver(kv_transfer_pb2_grpc.KVTransferServicer):
    """A decode pod that takes the whole push and never acknowledges it: the Prefill call waits on it."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.opened_pushes: list[str] = []
        self.cancelled_pushes: list[str] = []

    async def Handshake(self, request, context):
        return kv_transfer_pb2.HandshakeResponse(layout=self.layout.to_proto(), supported_codecs=["none"],
                                                 compat_hash=self.layout.compat_hash)

    async def PushKV(self, request_iterator, context):
        request_id = None
        try:
            async for push in request_iterator:
                if push.HasField("header"):
                    request_id = push.header.request_id
                    self.opened_pushes.append(request_id)
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled_pushes.append(request_id)
            raise


@pytest.fixture
def stalling_decode_pod(pods):
    receiver = StallingReceiver(KVLayout.of_engine(pods.prefill_pod.engine))

    async def start():
        server = grpc.aio.server()
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(receiver, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = pods.thread.run(start())
    yield receiver, f"127.0.0.1:{port}"
    pods.thread.run(server.stop(None))


def test_the_prefill_pod_holds_the_prompts_blocks_until_the_decode_pod_acknowledges(pods, stalling_decode_pod):
    receiver, address = stalling_decode_pod
    call = pods.prefill.Prefill.future(prefill_request_to(address, "unacknowledged"))
    # The prefill request finishes with its step; its 30 tokens' 2 blocks stay held while the push waits.
    wait_until(lambda: receiver.opened_pushes == ["unacknowledged"]
               and not pods.prefill_pod.engine.has_unfinished_requests())
    load = pods.load("prefill")
    assert load.total_kv_blocks - load.free_kv_blocks == 2
    call.cancel()  # the push fails: the blocks go back (every_block_free_afterwards checks)
    wait_until(lambda: receiver.cancelled_pushes == ["unacknowledged"])


def prefill_request_to(address: str, request_id: str) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_of(30, seed=13000),
                                      sampling_params=GREEDY, decode_address=address, kv_codec="none")


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_prefill_past_its_deadline_is_deadline_exceeded_and_cancels_the_push(pods, stalling_decode_pod):
    receiver, address = stalling_decode_pod
    # Long enough for the push to open even on a busy machine; the receiver never acknowledges it anyway.
    error = rpc_error(pods.prefill.Prefill, prefill_request_to(address, "late"), timeout=3.0)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: receiver.cancelled_pushes == ["late"])


def test_cancelling_a_prefill_call_cancels_its_push(pods, stalling_decode_pod):
    receiver, address = stalling_decode_pod
    call = pods.prefill.Prefill.future(prefill_request_to(address, "walked-away"))
    wait_until(lambda: receiver.opened_pushes == ["walked-away"])
    call.cancel()
    wait_until(lambda: receiver.cancelled_pushes == ["walked-away"])


def test_abort_ends_a_waiting_prefill_with_cancelled(pods, stalling_decode_pod):
    receiver, address = stalling_decode_pod
    call = pods.prefill.Prefill.future(prefill_request_to(address, "abort-me"))
    wait_until(lambda: receiver.opened_pushes == ["abort-me"])
    assert pods.prefill.Abort(common_pb2.AbortRequest(request_id="abort-me")).found
    with pytest.raises(grpc.RpcError) as caught:
        call.result(timeout=10)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert caught.value.details() == "request 'abort-me' was aborted"
    wait_until(lambda: receiver.cancelled_pushes == ["abort-me"])
    assert not pods.prefill.Abort(common_pb2.AbortRequest(request_id="abort-me")).found


def test_pods_answer_health_checks_and_reflection(pods):
    channel = grpc.insecure_channel(f"127.0.0.1:{pods.decode_pod.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "splitserve.v1.Decode", "splitserve.v1.KVTransfer"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"splitserve.v1.Decode", "splitserve.v1.KVTransfer", "grpc.health.v1.Health"} <= services
    channel.close()


def test_metrics_endpoint_serves_the_pod_series(pods):
    with urllib.request.urlopen(f"http://127.0.0.1:{pods.decode_pod.metrics_port}/metrics", timeout=5) as response:
        body = response.read()
    assert b'splitserve_num_requests_running{model_name="tiny-random",role="decode"}' in body
    choice = pods.decode_pod.engine.compute_path  # native where the kernels build, else pytorch
    fmt = prefill_compute_dtype("auto")
    # bf16 prefill runs on the best bf16 ISA the CPU has; float32 on the float32 kernels' (or PyTorch)
    isa = bf16_isas()[0] if fmt == "bfloat16" else choice.kernels.isa if choice.kernels else "pytorch"
    assert (f'splitserve_engine_info{{cache_dtype="float16",cpu_features="{matrix_features()}",device="cpu",'
            f'kernels="{choice.path}",model_name="tiny-random",prefill_compute="{fmt}",prefill_isa="{isa}",'
            f'quantization="none",role="decode"}} 1.0').encode() in body
    for form, nbytes in pods.decode_pod.engine.weight_bytes.items():  # bf16_prefill: 0 where auto is float32
        assert (f'splitserve_weight_memory_bytes{{form="{form}",model_name="tiny-random",role="decode"}} '
                f'{float(nbytes)}').encode() in body


def test_the_prefill_pod_reports_the_weight_forms_it_holds(pods):
    """A prefill pod in bf16 holds the bf16 copies, not the layers' decode form (the decode pod holds both)."""
    prefill, decode = pods.prefill_pod.engine.weight_bytes, pods.decode_pod.engine.weight_bytes
    if prefill_compute_dtype("auto") == "bfloat16":
        assert prefill["bf16_prefill"] == decode["bf16_prefill"] > 0
        assert prefill["model"] < decode["model"]
    else:  # no copies anywhere: the prefill pod computes from the model's own weights
        assert prefill == decode == {"model": decode["model"], "bf16_prefill": 0}
    with urllib.request.urlopen(f"http://127.0.0.1:{pods.prefill_pod.metrics_port}/metrics", timeout=5) as response:
        body = response.read()
    for form, nbytes in prefill.items():
        assert (f'splitserve_weight_memory_bytes{{form="{form}",model_name="tiny-random",role="prefill"}} '
                f'{float(nbytes)}').encode() in body


@pytest.mark.model
def test_a_prefill_pod_fits_its_step_time_model_before_it_serves():
    """The router's hybrid placement predicts a prefill pod's prompts from the step-time model in its load report:
    a pod that has served nothing reports one fitted on its warm-up prompts (without the warm-up it reported none,
    and its first real prompt alone fitted one that put a prompt's whole cost on the attention term), and the
    warm-up holds no block afterwards. On the real model: the tiny one's steps are too short for the fit to tell a
    prompt token's cost from the noise."""
    thread = LoopThread()
    config = PrefillConfig(host="127.0.0.1", port=0, metrics_port=0, model="smollm2-135m", num_threads=1,
                           kv_cache_memory_bytes=64 << 20)
    pod = Pod(config, "prefill")

    async def start() -> None:
        await pod.start(await build_prefill_services(pod, config))

    try:
        thread.run(start())
        with grpc.insecure_channel(f"127.0.0.1:{pod.port}") as channel:
            load = pod_status_pb2_grpc.PodStatusStub(channel).GetLoad(pod_status_pb2.LoadRequest(), timeout=10)
        assert load.step_time.num_samples >= len(WARM_UP_PROMPTS)  # a step per prompt at least
        assert load.step_time.per_prefill_token_seconds > 0
        assert load.free_kv_blocks == load.total_kv_blocks and load.num_running == load.num_waiting == 0
    finally:
        thread.run(pod.stop())
        thread.close()


# ---- kv_load_failure_policy: a push whose KV fails to load -------------------------------------------------------

@pytest.fixture(scope="module")
def recompute_pod(pods):
    """A second decode pod, whose kv_load_failure_policy is recompute, on the pods' event loop."""
    config = dataclasses.replace(pods.decode_config, kv_load_failure_policy="recompute")
    pod = Pod(config, "decode")

    async def start():
        await pod.start(await build_decode_services(pod, config))

    pods.thread.run(start())
    channel = grpc.insecure_channel(f"127.0.0.1:{pod.port}")
    yield pod, decode_pb2_grpc.DecodeStub(channel)
    channel.close()
    pods.thread.run(pod.stop())


@contextlib.contextmanager
def corrupting_every_chunk(pods):
    pods.kv_client.corrupt_chunk_rate = 1.0
    try:
        yield
    finally:
        pods.kv_client.corrupt_chunk_rate = 0.0


def decode_tokens(stub: decode_pb2_grpc.DecodeStub, request: decode_pb2.DecodeRequest) -> list[int]:
    return [token for message in stub.Decode(request, timeout=60) if message.HasField("chunk")
            for token in message.chunk.token_ids]


def test_a_corrupted_push_to_a_recompute_pod_is_recomputed_there_with_the_same_answer(pods, recompute_pod):
    pod, stub = recompute_pod
    prompt = prompt_of(40, seed=14000)
    with corrupting_every_chunk(pods):
        first = pods.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="recomputed", prompt_token_ids=prompt, sampling_params=GREEDY,
            decode_address=f"127.0.0.1:{pod.port}", kv_codec="none"), timeout=60)
    request = decode_pb2.DecodeRequest(request_id="recomputed", prompt_token_ids=prompt, sampling_params=GREEDY,
                                       first_token_id=first.first_token_id)
    tokens = [first.first_token_id, *decode_tokens(stub, request)]
    assert tokens == pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert metric(pod, "splitserve_kv_load_total", outcome="recomputed") == 1
    assert metric(pod, "splitserve_kv_load_total", outcome="loaded") == 0
    assert pod.engine.block_manager.num_free_blocks == pod.engine.block_manager.num_blocks


def test_a_lost_push_is_recomputed_on_a_recompute_pod_and_fails_on_a_fail_pod(pods, recompute_pod):
    pod, stub = recompute_pod
    prompt = prompt_of(20, seed=14100)
    expected = pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    request = decode_pb2.DecodeRequest(request_id="never-arrived", prompt_token_ids=prompt, sampling_params=GREEDY,
                                       first_token_id=expected[0])
    before = metric(pod, "splitserve_kv_load_total", outcome="recomputed")
    assert decode_tokens(stub, request) == expected[1:]
    assert metric(pod, "splitserve_kv_load_total", outcome="recomputed") == before + 1
    failed = metric(pods.decode_pod, "splitserve_kv_load_total", outcome="failed")
    assert rpc_error(pods.decode.Decode, request).code() == grpc.StatusCode.NOT_FOUND
    assert metric(pods.decode_pod, "splitserve_kv_load_total", outcome="failed") == failed + 1


def test_a_corrupted_push_to_a_fail_pod_fails_the_request_and_counts(pods):
    prompt = prompt_of(40, seed=14200)
    failed = metric(pods.decode_pod, "splitserve_kv_load_total", outcome="failed")
    loaded = metric(pods.decode_pod, "splitserve_kv_load_total", outcome="loaded")
    with corrupting_every_chunk(pods):
        error = rpc_error(pods.run_prefill, "refused-bad-kv", prompt, GREEDY)
    # DATA_LOSS, or UNAVAILABLE when a write raced the refusal (sender.py says why); the decode pod counted it.
    assert error.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE), error.details()
    wait_until(lambda: metric(pods.decode_pod, "splitserve_kv_load_total", outcome="failed") == failed + 1)
    first = pods.run_prefill("good-kv", prompt, GREEDY)
    pods.run_decode("good-kv", prompt, GREEDY, first)
    assert metric(pods.decode_pod, "splitserve_kv_load_total", outcome="loaded") == loaded + 1


# ---- kv_codec auto over a real slow link ------------------------------------------------------------------------

class ThrottlingProxy:
    """A TCP proxy on the pods' loop that forwards real bytes both ways at ``rate`` bytes/s (None: as fast as it
    can): the link between the prefill and the decode pod, slowed down."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.rate: float | None = None
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pump(reader, upstream_writer), self._pump(upstream_reader, writer),
                             return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(4096):
                if self.rate is not None:
                    await asyncio.sleep(len(data) / self.rate)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()


@pytest.fixture
def auto_link(pods):
    """The prefill pod reaching the decode pod through a ThrottlingProxy, kv_codec auto choosing from a hand-made
    quality table (int8 clears the floor, fp8 does not; the decode pod accepts none, int8 and int8+zstd). int8 is
    made slow (1 MB/s each way), so that it pays only on a link slower than ~220 KB/s: a loaded machine's loopback
    stays far above that, the proxy's 40 KB/s far below."""
    proxy = ThrottlingProxy(pods.decode_pod.port)
    port = pods.thread.run(proxy.start())
    layout = KVLayout.of_engine(pods.prefill_pod.engine)
    table = QualityTable(MODEL, {"float16": {"none": CodecQuality(1.0, 10000.0, 30000.0),
                                             "int8": CodecQuality(0.99, 1.0, 1.0),
                                             "fp8": CodecQuality(0.5, 1000.0, 1000.0)}})
    shipped = pods.kv_client.link_codecs
    pods.kv_client.link_codecs = LinkCodecChooser(layout, table, min_agreement=0.9)
    pods.kv_client.shm_links.enabled = False  # the proxy stands for a network link: no shared memory across it
    yield proxy, f"127.0.0.1:{port}"
    pods.kv_client.shm_links.enabled = True
    pods.kv_client.link_codecs = shipped
    pods.thread.run(proxy.stop())


def test_auto_switches_codecs_as_the_link_slows_down_and_speeds_up(pods, auto_link):
    proxy, address = auto_link
    prompt = prompt_of(150, seed=15000)
    expected = pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))

    def request(n: int) -> tuple[str, list[int]]:
        request_id = f"auto-{n}"
        first = pods.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=GREEDY, decode_address=address,
            kv_codec="auto"), timeout=60)
        tokens, _, complete = pods.run_decode(request_id, prompt, GREEDY, first)
        assert complete.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(tokens) == 16  # a whole answer
        return first.kv_transfer.codec, tokens

    codec, tokens = request(0)  # a link not measured yet counts as fast: lossless, the offline answer
    assert (codec, tokens) == ("none", expected)
    proxy.rate = 40_000.0  # 40 KB/s: the prompt's 76.8 KB of float16 KV take ~2 s uncompressed
    codecs = [request(n)[0] for n in range(1, 4)]
    assert codecs[0] == "none" and codecs[-1] == "int8", codecs  # measured slow once: int8 from then on
    proxy.rate = None  # fast again: a few measurements outweigh the slow ones
    codecs = [request(n)[0] for n in range(4, 8)]
    assert codecs[0] == "int8" and codecs[-1] == "none", codecs


# ---- the metrics count what the pods did -------------------------------------------------------------------------

def metric(pod: Pod, name: str, **labels: str) -> float:
    """A pod's sample (0 for a labelled counter before its first event)."""
    return pod.metrics.registry.get_sample_value(name, {"role": pod.role, "model_name": MODEL, **labels}) or 0.0


def wait_metric(pod: Pod, name: str, value: float, timeout_s: float = 10.0, **more: float) -> None:
    """Until the gauge ``name`` reads ``value``, and each gauge of ``more`` its value, at one look (gauges follow
    the engine's snapshots, a moment behind it)."""
    expected = {name: value, **more}
    deadline = time.monotonic() + timeout_s
    while (seen := {n: metric(pod, n) for n in expected}) != expected:
        assert time.monotonic() < deadline, f"the gauges read {seen}, not {expected}"
        time.sleep(0.02)


def counts(pods) -> dict[str, float]:
    """The counters a disaggregated request moves, by what they count."""
    prefill, decode = pods.prefill_pod, pods.decode_pod
    return {"prefix tokens queried": metric(prefill, "splitserve_prefix_cache_queries_total"),
            "prefix tokens hit": metric(prefill, "splitserve_prefix_cache_hits_total"),
            "raw bytes sent": metric(prefill, "splitserve_kv_transfer_raw_bytes_total", codec="int8"),
            "wire bytes sent": metric(prefill, "splitserve_kv_transfer_bytes_total", codec="int8"),
            "wire bytes received": metric(decode, "splitserve_kv_transfer_bytes_total", codec="int8"),
            # The pods share this host: their pushes go through a shared-memory arena (kvtransfer/shm.py).
            "pushes through shared memory": metric(prefill, "splitserve_kv_transfers_total", transport="shm")}


def test_kv_usage_prefix_hits_and_transfer_bytes_are_what_the_request_did(pods):
    shared = prompt_of(32, seed=13000)  # two full blocks
    pods.run_decode("metrics-a", shared + [7], GREEDY, pods.run_prefill("metrics-a", shared + [7], GREEDY))
    before = counts(pods)
    prompt = shared + prompt_of(8, seed=13001)  # 40 tokens: 3 blocks, the first two cached on the prefill pod
    first = pods.run_prefill("metrics-b", prompt, GREEDY, codec="int8", lease_s=30)
    try:
        moved = {name: value - before[name] for name, value in counts(pods).items()}
        wait_metric(pods.decode_pod, "splitserve_kv_cache_usage_perc", 3 / DECODE_BLOCKS)  # the leased KV
    finally:
        pods.run_decode("metrics-b", prompt, GREEDY, first)  # claims the lease: its blocks go back
    wait_metric(pods.decode_pod, "splitserve_kv_cache_usage_perc", 0.0)
    raw, wire = first.kv_transfer.raw_bytes, first.kv_transfer.bytes_sent
    assert raw == 40 * 4 * 2 * (2 * 16 * CACHE_BYTES)  # the cache's float16 K and V, every layer
    assert 0.5 <= wire / raw < 0.6  # int8: a byte per element, plus its scales
    assert moved == {"prefix tokens queried": 40, "prefix tokens hit": 32, "raw bytes sent": raw,
                     "wire bytes sent": wire, "wire bytes received": wire, "pushes through shared memory": 1}


def test_a_refused_push_counts_as_a_transfer_failure_by_code(pods):
    failures = metric(pods.prefill_pod, "splitserve_kv_transfer_failures_total", code="FAILED_PRECONDITION")
    error = rpc_error(pods.run_prefill, "refused-int4", prompt_of(20, seed=13100), GREEDY, codec="int4")
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert metric(pods.prefill_pod, "splitserve_kv_transfer_failures_total", code="FAILED_PRECONDITION") \
        == failures + 1
    assert pods.decode_pod.role == "decode" and metric(pods.decode_pod, "splitserve_kv_transfer_failures_total",
                                                       code="FAILED_PRECONDITION") == 0  # prefill pods count them


class SmallDecodePod:
    """One more decode pod on the tests' event loop, with a small pool or few request slots."""

    def __init__(self, thread: LoopThread, **fields):
        self.thread = thread
        self.config = DecodeConfig(host="127.0.0.1", port=0, metrics_port=0, model=MODEL,
                                   load_refresh_interval_s=0.2, **fields)
        self.pod = Pod(self.config, "decode")
        self.thread.run(self._start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.pod.port}")
        self.decode = decode_pb2_grpc.DecodeStub(self.channel)

    async def _start(self) -> None:
        await self.pod.start(await build_decode_services(self.pod, self.config))

    def stream(self, request_id: str, prompt: list[int], max_tokens: int, priority: int = 0):
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.decode.Decode(decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                                           sampling_params=params, priority=priority), timeout=120)

    def close(self) -> None:
        self.channel.close()
        self.thread.run(self.pod.stop())


def tokens_of(stream) -> list[int]:
    return [token for message in stream if message.HasField("chunk") for token in message.chunk.token_ids]


PROMPT_13201 = prompt_of(20, seed=13201)


def test_a_request_beyond_max_num_seqs_waits_and_the_gauges_say_so(pods):
    small = SmallDecodePod(pods.thread, num_blocks=128, max_num_seqs=1)
    try:
        long_stream = small.stream("runs", prompt_of(20, seed=13200), 2000)  # to the end of the context: seconds
        assert next(long_stream).HasField("chunk")
        queued: list[list[int]] = []
        waiter = threading.Thread(target=lambda: queued.append(tokens_of(small.stream("waits", PROMPT_13201, 4))))
        waiter.start()
        # One slot: the second request waits while the first runs.
        wait_metric(small.pod, "splitserve_num_requests_waiting", 1, splitserve_num_requests_running=1)
        long_stream.cancel()
        waiter.join(timeout=60)
        assert queued == [pods.offline_tokens(PROMPT_13201, SamplingParams(temperature=0.0, max_tokens=4,
                                                                           ignore_eos=True))]
        wait_metric(small.pod, "splitserve_num_requests_waiting", 0, splitserve_num_requests_running=0)
    finally:
        small.close()


def test_waiting_requests_start_in_priority_order_first_come_first_served_among_equals(pods):
    """One request slot, held by a long request while three queue: two of priority 0, then one of -1. When the slot
    frees, the last to arrive starts first, then the other two in their order. Each runs 24 steps alone, so the order
    their first tokens reach the client is the order they started in."""
    small = SmallDecodePod(pods.thread, num_blocks=128, max_num_seqs=1)
    started: list[str] = []
    try:
        long_stream = small.stream("holds-the-slot", prompt_of(20, seed=13400), 2000)
        assert next(long_stream).HasField("chunk")

        def run(name: str, priority: int, seed: int) -> None:
            stream = small.stream(name, prompt_of(20, seed=seed), 24, priority)
            next(stream)
            started.append(name)
            tokens_of(stream)

        waiters = []
        for i, (name, priority) in enumerate([("first", 0), ("second", 0), ("urgent", -1)]):
            waiters.append(threading.Thread(target=run, args=(name, priority, 13401 + i)))
            waiters[-1].start()
            wait_metric(small.pod, "splitserve_num_requests_waiting", i + 1, splitserve_num_requests_running=1)
        long_stream.cancel()
        for waiter in waiters:
            waiter.join(timeout=60)
        assert started == ["urgent", "first", "second"]
    finally:
        small.close()


def test_requests_that_outgrow_the_pool_are_preempted_counted_and_still_exact(pods):
    """8 blocks (128 tokens) for two requests that each grow to 7 (20 + 80 tokens): one is preempted and recomputed
    when the other needs its blocks. A pool that holds both preempts nothing."""
    prompt_list = [prompt_of(20, seed=13300 + i) for i in range(2)]
    expected = [pods.offline_tokens(p, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
                for p in prompt_list]
    for num_blocks, preempted in ((16, False), (8, True)):
        small = SmallDecodePod(pods.thread, num_blocks=num_blocks, max_num_seqs=2)
        try:
            answers: dict[int, list[int]] = {}
            threads = [threading.Thread(target=lambda i=i: answers.__setitem__(
                i, tokens_of(small.stream(f"grow-{i}", prompt_list[i], 80)))) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            assert [answers.get(i) for i in range(2)] == expected
            assert (metric(small.pod, "splitserve_num_preemptions_total") > 0) == preempted, num_blocks
        finally:
            small.close()


# ---- the real processes -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_serving(address: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{address} never became SERVING")
            time.sleep(0.2)


@pytest.fixture
def redis_url(tmp_path):
    server_binary = shutil.which("redis-server")
    if server_binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    server = subprocess.Popen([server_binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        wait_until(lambda: _pings(client))
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


@pytest.mark.e2e
def test_pods_as_processes_serve_register_and_shut_down_on_sigterm(redis_url):
    ports = {name: free_port() for name in ("prefill", "decode", "prefill_metrics", "decode_metrics")}
    common = ["--host", "127.0.0.1", "--model", MODEL, "--num-blocks", "32", "--load-refresh-interval-s", "0.2"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    decode_address = f"127.0.0.1:{ports['decode']}"
    decode = subprocess.Popen([sys.executable, "-m", "splitserve.decode_service", *common,
                               "--port", str(ports["decode"]), "--metrics-port", str(ports["decode_metrics"]),
                               "--registry", "redis",
                               "--redis-url", redis_url, "--advertise-address", decode_address,
                               "--heartbeat-ttl-s", "0.6"], cwd=REPO_ROOT, env=env)
    # The baseline without overlap: every layer is sent after the prefill step.
    prefill = subprocess.Popen([sys.executable, "-m", "splitserve.prefill_service", *common,
                                "--port", str(ports["prefill"]), "--metrics-port", str(ports["prefill_metrics"]),
                                "--no-overlap-transfer"],
                               cwd=REPO_ROOT, env=env)
    registry = redis.Redis.from_url(redis_url)
    key = f"splitserve:pods:decode:{decode_address}"
    try:
        wait_serving(decode_address)
        wait_serving(f"127.0.0.1:{ports['prefill']}")
        record = json.loads(registry.get(key))
        assert (record["role"], record["load"]["total_kv_blocks"], record["load"]["block_size"]) == ("decode", 32, 16)
        prompt = prompt_of(40, seed=12000)
        with grpc.insecure_channel(f"127.0.0.1:{ports['prefill']}") as p, grpc.insecure_channel(decode_address) as d:
            first = prefill_pb2_grpc.PrefillStub(p).Prefill(prefill_pb2.PrefillRequest(
                request_id="e2e", prompt_token_ids=prompt, sampling_params=GREEDY, decode_address=decode_address,
                kv_codec="none"),
                timeout=60)
            request = decode_pb2.DecodeRequest(request_id="e2e", prompt_token_ids=prompt, sampling_params=GREEDY,
                                               first_token_id=first.first_token_id)
            tokens = [first.first_token_id]
            for message in decode_pb2_grpc.DecodeStub(d).Decode(request, timeout=60):
                tokens += message.chunk.token_ids
        expected = LLM(model=MODEL, num_blocks=32).generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
        assert tokens == expected[0].token_ids
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['prefill_metrics']}/metrics", timeout=5) as response:
            metrics = response.read()
        sent = 40 * 4 * 2 * (2 * 16 * CACHE_BYTES)  # the 40-token prompt's K and V, every layer
        labels = '{codec="none",model_name="tiny-random",role="prefill"}'
        assert f"splitserve_kv_transfer_bytes_total{labels} {sent:.1f}".encode() in metrics
        # The decode pod now caches the prompt's blocks (and the output's), and says so for prefix-aware routing.
        prompt_blocks = chained_block_hashes(prompt, 16)
        wait_until(lambda: set(prompt_blocks) <= set(json.loads(registry.get(key))["block_hashes"]))
    finally:
        for process in (prefill, decode):
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=30) for process in (prefill, decode)]
    assert codes == [0, 0]
    assert registry.get(key) is None  # deregistered on the way out
    registry.close()


# ---- configuration ------------------------------------------------------------------------------------------------

def test_pod_configs_come_from_flags_and_environment_and_refuse_bad_values():
    config = parse_config(DecodeConfig, ["--role", "mixed", "--accepted-kv-codecs", "none,int8"],
                          env={"SPLITSERVE_KV_LEASE_S": "12.5", "SPLITSERVE_NUM_BLOCKS": "128"})
    assert (config.role, config.accepted_kv_codecs, config.kv_lease_s, config.num_blocks) == (
        "mixed", ["none", "int8"], 12.5, 128)
    assert parse_config(PrefillConfig, ["--no-overlap-transfer"], env={}).overlap_transfer is False
    with pytest.raises(SystemExit):  # the codec is the router's to choose, per request: the prefill pod takes none
        parse_config(PrefillConfig, ["--kv-codec", "int8"], env={})
    for build, message in [
        (lambda: DecodeConfig(role="prefill"), "role must be one of decode, mixed"),
        (lambda: DecodeConfig(accepted_kv_codecs=["gzip"]), "accepted_kv_codecs must name some of"),
        (lambda: PrefillConfig(registry="consul"), "registry must be one of static, redis"),
        (lambda: PrefillConfig(block_size=12), "block_size must be a positive power of two"),
        (lambda: DecodeConfig(cache_dtype="int4"), "cache_dtype must be one of float32, bfloat16, float16, int8"),
    ]:
        with pytest.raises(ValueError, match=message):
            build()

"""The same-host KV hand-off (kvtransfer/shm.py, kvtransfer/shm_arena.py): arenas and their spans, the link's choice,
and real pod processes over loopback handing KV through shared memory: the offline answer token for token, a corrupted
chunk refused by its checksum, a decode pod killed and restarted mid-transfer (the push held there by the prefill pod's
test hook, kvtransfer/push_hold.py; no stale page read, every block and every arena freed).

Each test's pods share a fresh directory under /dev/shm (not /dev/shm itself: other pods may run on this machine),
so that "nothing left behind" is a listing of that directory.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from splitserve.bench.transfer import PodProcess, start_pod, stop_pods, wait_serving
from splitserve.engine.llm import LLM
from splitserve.engine.sampling.params import SamplingParams
from splitserve.kvtransfer.codecs import get_codec
from splitserve.kvtransfer.handshake import KVLayout
from splitserve.kvtransfer.push_hold import MID_PUSH, PushHolds
from splitserve.kvtransfer.shm import (
    ARENA_PREFIX,
    TRANSPORT_GRPC,
    TRANSPORT_SHM,
    ShmArenaViews,
    dir_id,
    host_id,
    sweep_stale,
    with_shm_bytes,
)
from splitserve.kvtransfer.sender import KVSender, KVTransferClient, _LayerKV
from splitserve.kvtransfer.shm_arena import ShmArena, ShmLinks, ShmPush
from splitserve.kvtransfer.wire import ExpectedChunks, KVChunkError, decode_chunk, encode_chunks, parse_push
from splitserve.runtime.errors import StatusError
from splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    pod_status_pb2,
    pod_status_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

MODEL = "tiny-random"  # 4 layers, 2 KV heads of 16 dims
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture
def shm_dir():
    directory = tempfile.mkdtemp(prefix="splitserve-test-", dir="/dev/shm")
    yield directory
    leftovers = os.listdir(directory)
    for name in leftovers:
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)
    assert leftovers == [], "an arena was left behind"


def _chunks(codec: str, num_tokens: int = 24, seed: int = 0):
    tensor = torch.randn(num_tokens, 2, 16, generator=torch.Generator().manual_seed(seed))
    return tensor, encode_chunks("r1", 0, "k", 0, num_tokens, tensor, get_codec(codec), num_tokens)


def _expected(num_tokens: int = 24) -> ExpectedChunks:
    return ExpectedChunks("r1", 4, 2, 16, num_tokens, frozenset({"none", "int8"}))


def _received(message: bytes, views: ShmArenaViews, name: str):
    return with_shm_bytes(parse_push(message), views.open(name))


# ---- arenas ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["none", "int8"])  # int8 has scales beside its payload
def test_a_chunk_placed_in_an_arena_decodes_on_the_other_side_as_it_would_inline(shm_dir, codec):
    arena = ShmArena(shm_dir, f"{ARENA_PREFIX}{'a' * 32}-{'b' * 32}", 1 << 20)
    tensor, [chunk] = _chunks(codec)
    push = ShmPush(arena)
    message = push.frame(chunk)
    assert len(message) < 200, "the message carries a span, not the bytes"
    received = _received(message, ShmArenaViews(shm_dir), arena.name)
    assert received.fields.HasField("shm")
    decoded = decode_chunk(received, _expected())
    inline = decode_chunk(parse_push(ShmPush(None).frame(chunk)), _expected())
    assert torch.equal(decoded.tensor, inline.tensor)
    assert torch.allclose(decoded.tensor, tensor, atol=0.05)
    push.release()
    arena.retire()
    assert not os.path.exists(arena.path)


def test_a_corrupted_byte_in_the_arena_fails_the_chunks_checksum(shm_dir):
    arena = ShmArena(shm_dir, f"{ARENA_PREFIX}{'a' * 32}-{'c' * 32}", 1 << 20)
    _, [chunk] = _chunks("none")
    message = ShmPush(arena).frame(chunk)
    with open(arena.path, "r+b") as file:  # another process scribbling on the page
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(KVChunkError) as caught:
        decode_chunk(_received(message, ShmArenaViews(shm_dir), arena.name), _expected())
    assert caught.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in caught.value.message
    arena.retire()


def test_spans_are_freed_and_merged_and_a_full_arena_sends_chunks_inline(shm_dir):
    _, chunks = _chunks("none", num_tokens=64)  # 64 x 2 x 16 float32: 8 KiB
    arena = ShmArena(shm_dir, f"{ARENA_PREFIX}{'a' * 32}-{'d' * 32}", 20 << 10)  # room for two
    first, second, third = ShmPush(arena), ShmPush(arena), ShmPush(arena)
    assert parse_push(first.frame(chunks[0])).fields.HasField("shm")
    assert parse_push(second.frame(chunks[0])).fields.HasField("shm")
    inline = parse_push(third.frame(chunks[0]))  # full: the bytes travel in the message
    assert not inline.fields.HasField("shm") and len(inline.payload) == chunks[0].nbytes
    assert arena.spans_in_use == 2
    first.release()
    second.release()
    assert arena.spans_in_use == 0
    assert parse_push(ShmPush(arena).frame(chunks[0])).fields.shm.offset == 0  # merged back into one free span
    arena.retire()


def test_a_retired_arena_is_unlinked_at_once_and_unmapped_after_its_last_push(shm_dir):
    arena = ShmArena(shm_dir, f"{ARENA_PREFIX}{'a' * 32}-{'e' * 32}", 1 << 20)
    push = ShmPush(arena)
    push.frame(_chunks("none")[1][0])
    arena.retire()
    assert os.listdir(shm_dir) == []
    assert push.frame(_chunks("none")[1][0])  # no new spans in a retired arena: inline
    push.release()
    assert arena.spans_in_use == 0


def test_injected_corruption_goes_through_the_framing_a_push_uses(shm_dir, monkeypatch):
    """``--inject-corrupt-chunks`` flips a byte of chunks framed as every push frames them: a raw codec through an
    arena is gathered straight into its span (``ShmPush.frame_raw``), and the byte flips there, after the checksum,
    so the decode pod's check of the span refuses it (DATA_LOSS); not chunks encoded another way for the fault."""
    framed = []
    frame_raw = ShmPush.frame_raw
    monkeypatch.setattr(ShmPush, "frame_raw", lambda *args: framed.append(frame_raw(*args)) or framed[-1])
    links = ShmLinks()
    assert links.choose("decode", _response(shm_dir)) == TRANSPORT_SHM
    layout = KVLayout(MODEL, 4, 2, 16, block_size=16, cache_dtype="float32")
    k, v = (torch.randn(24, 2, 16, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))

    async def encode(rate: float) -> list[bytes]:
        client = KVTransferClient(layout, corrupt_chunk_rate=rate, shm_links=links)
        sender = KVSender(client, "decode", "r1", list(range(24)), get_codec("none"), 0.0, None)
        _, _, messages, _ = sender._encode([_LayerKV(0, 0, 24, k, v)], 0)
        return messages

    views = ShmArenaViews(shm_dir)
    arena = os.listdir(shm_dir)[0]
    for rate in (0.0, 1.0):
        framed.clear()
        messages = asyncio.run(encode(rate))
        assert len(messages) == 2 and [message for message, _ in framed] == messages  # K and V, both by frame_raw
        for message in messages:
            chunk = _received(message, views, arena)
            if rate:
                with pytest.raises(KVChunkError) as caught:
                    decode_chunk(chunk, _expected())
                assert caught.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in caught.value.message
            else:
                assert decode_chunk(chunk, _expected()).tensor.shape == (24, 2, 16)
    links.close()


def test_the_arena_of_a_prefill_pod_gone_is_swept_and_a_live_ones_is_not(shm_dir):
    live = ShmArena(shm_dir, f"{ARENA_PREFIX}{'a' * 32}-{'1' * 32}", 1 << 20)
    left = os.path.join(shm_dir, f"{ARENA_PREFIX}{'b' * 32}-{'2' * 32}")  # as a SIGKILLed pod leaves it: no lock
    Path(left).write_bytes(b"\0" * 4096)
    Path(shm_dir, "not-an-arena").write_bytes(b"")
    assert sweep_stale(shm_dir) == [os.path.basename(left)]
    assert sorted(os.listdir(shm_dir)) == sorted([live.name, "not-an-arena"])
    os.unlink(os.path.join(shm_dir, "not-an-arena"))
    live.retire()


@pytest.mark.parametrize("span, problem", [((1 << 20) - 8, "past the arena"), (None, "without an arena")])
def test_a_span_the_arena_does_not_hold_is_refused(shm_dir, span, problem):
    arena = ShmArena(shm_dir, f"{ARENA_PREFIX}{'a' * 32}-{'f' * 32}", 1 << 20)
    message = ShmPush(arena).frame(_chunks("none")[1][0])
    chunk = parse_push(message)
    if span is not None:
        chunk.fields.shm.offset = span
    with pytest.raises(StatusError) as caught:
        with_shm_bytes(chunk, ShmArenaViews(shm_dir).open(arena.name) if span is not None else None)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and problem in caught.value.message
    arena.retire()


@pytest.mark.parametrize("name", ["../../etc/passwd", f"{ARENA_PREFIX}{'a' * 32}-{'0' * 32}", "plain"])
def test_the_decode_side_maps_only_arenas_in_its_own_directory(shm_dir, name):
    with pytest.raises(StatusError) as caught:
        ShmArenaViews(shm_dir).open(name)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION and "handshake again" in caught.value.message
    with pytest.raises(StatusError):
        ShmArenaViews("").open(f"{ARENA_PREFIX}{'a' * 32}-{'0' * 32}")  # a pod that takes no shared memory


# ---- the link's choice -------------------------------------------------------------------------------------------

def _response(directory: str, **fields) -> kv_transfer_pb2.HandshakeResponse:
    return kv_transfer_pb2.HandshakeResponse(boot_id="d" * 32, **{**ShmArenaViews(directory).handshake_fields(),
                                                                  **fields})


def test_a_link_goes_through_shared_memory_only_on_one_host_and_one_directory(shm_dir, tmp_path):
    assert host_id(), "this machine has a kernel boot id"
    links = ShmLinks()
    assert links.choose("same", _response(shm_dir)) == TRANSPORT_SHM
    assert os.listdir(shm_dir)[0].startswith(ARENA_PREFIX)
    assert links.choose("other-host", _response(shm_dir, host_id="another machine")) == TRANSPORT_GRPC
    # The same name on the sender's side is another directory (another tmpfs mount, in a container): not shared.
    assert links.choose("other-dir", _response(shm_dir, shm_dir_id=dir_id(str(tmp_path)))) == TRANSPORT_GRPC
    assert links.choose("no-dir", _response("")) == TRANSPORT_GRPC
    assert ShmLinks(enabled=False).choose("off", _response(shm_dir)) == TRANSPORT_GRPC
    assert [links.transport(a) for a in ("same", "other-host")] == [TRANSPORT_SHM, TRANSPORT_GRPC]
    links.close()
    assert os.listdir(shm_dir) == []


# ---- real pods over loopback -------------------------------------------------------------------------------------

class ShmCluster:
    """A decode pod and a prefill pod, each its own process, sharing ``shm_dir``; the decode pod can be killed and
    restarted on its port."""

    def __init__(self, log_dir: Path, shm_dir: str, prefill_flags: tuple[str, ...] = (),
                 decode_flags: tuple[str, ...] = ()):
        self.log_dir, self.shm_dir, self.decode_flags = log_dir, shm_dir, decode_flags
        self.holds = PushHolds(log_dir / "push-holds")  # the prefill pod's pushes, held where a test arms them
        self.decode = self._start_decode(port=0)
        self.prefill = start_pod("prefill", "splitserve.prefill_service",
                                 ["--model", MODEL, "--max-num-batched-tokens", "64",
                                  "--long-prefill-token-threshold", "64", *prefill_flags], log_dir,
                                 env=self.holds.env())
        for pod in (self.decode, self.prefill):
            wait_serving(pod, 120)
        self.offline = LLM(model=MODEL, num_blocks=64)

    def _start_decode(self, port: int) -> PodProcess:
        return start_pod("decode", "splitserve.decode_service", ["--model", MODEL, "--kv-shm-dir", self.shm_dir,
                                                                 *self.decode_flags], self.log_dir, port=port)

    def restart_decode(self, kill_signal: int = signal.SIGKILL) -> None:
        os.kill(self.decode.popen.pid, kill_signal)
        self.decode.popen.wait(timeout=30)
        self.decode = self._start_decode(port=int(self.decode.address.rsplit(":", 1)[1]))
        wait_serving(self.decode, 120)

    def prefill_call(self, request_id: str, prompt: list[int], codec: str = "none") -> prefill_pb2.PrefillResponse:
        with grpc.insecure_channel(self.prefill.address) as channel:
            return prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling_params=GREEDY,
                decode_address=self.decode.address, kv_codec=codec), timeout=60)

    def answer(self, request_id: str, prompt: list[int], codec: str = "none") -> tuple[list[int], str]:
        """The disaggregated answer's tokens, and the transport its KV took."""
        first = self.prefill_call(request_id, prompt, codec)
        return self.decode_tokens(request_id, prompt, first), first.kv_transfer.transport

    def decode_tokens(self, request_id: str, prompt: list[int], first: prefill_pb2.PrefillResponse) -> list[int]:
        """The answer's tokens, generated on the decode pod from the KV the prefill pod pushed."""
        tokens = [first.first_token_id]
        with grpc.insecure_channel(self.decode.address) as channel:
            for message in decode_pb2_grpc.DecodeStub(channel).Decode(decode_pb2.DecodeRequest(
                    request_id=request_id, prompt_token_ids=prompt, sampling_params=GREEDY,
                    first_token_id=first.first_token_id), timeout=60):
                tokens += message.chunk.token_ids if message.HasField("chunk") else []
        return tokens

    def offline_tokens(self, prompt: list[int]) -> list[int]:
        return self.offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids

    def load(self, pod: PodProcess) -> common_pb2.PodLoad:
        with grpc.insecure_channel(pod.address) as channel:
            return pod_status_pb2_grpc.PodStatusStub(channel).GetLoad(pod_status_pb2.LoadRequest(), timeout=10)

    def wait_every_block_free(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for pod in (self.prefill, self.decode):
            while (load := self.load(pod)).free_kv_blocks != load.total_kv_blocks:
                assert time.monotonic() < deadline, f"{pod.name} pod still holds KV blocks: {load}"
                time.sleep(0.05)

    def stop(self) -> None:
        stop_pods([self.prefill, self.decode])


@pytest.fixture
def cluster(tmp_path, shm_dir):
    running = ShmCluster(tmp_path, shm_dir)
    yield running
    running.stop()


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 259, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.e2e
def test_pods_on_one_host_hand_kv_through_shared_memory_and_answer_as_offline(cluster):
    for length, codec in ((40, "none"), (150, "none"), (150, "int8")):  # 150: three prefill steps
        prompt = prompt_of(length, seed=length)
        tokens, transport = cluster.answer(f"shm-{length}-{codec}", prompt, codec)
        assert transport == TRANSPORT_SHM
        if codec == "none":
            assert tokens == cluster.offline_tokens(prompt)
    assert os.listdir(cluster.shm_dir) == [], "the arena's name goes once the decode pod has mapped it"
    cluster.wait_every_block_free()


@pytest.mark.e2e
def test_a_decode_pod_killed_mid_transfer_and_restarted_gets_a_new_arena_and_exact_answers(cluster):
    cluster.answer("before", prompt_of(40, seed=1))  # the link's arena, mapped by the first decode pod
    failures: list[grpc.RpcError] = []

    def long_prefill() -> None:  # 150 tokens in 64-token steps: the push spans three steps
        try:
            cluster.prefill_call("cut-off", prompt_of(150, seed=2))
        except grpc.RpcError as err:
            failures.append(err)

    # The push held by the prefill pod's test hook once its first layer is written (the decode pod has reserved
    # the prompt's blocks and is receiving): the kill lands mid-push on any machine, however fast.
    cluster.holds.arm(MID_PUSH)
    call = threading.Thread(target=long_prefill)
    call.start()
    try:
        assert cluster.holds.wait_held(MID_PUSH, 60) == "cut-off"
        load = cluster.load(cluster.decode)
        assert load.free_kv_blocks < load.total_kv_blocks  # reserved for the push
        cluster.restart_decode()  # SIGKILL while the push is receiving
    finally:
        cluster.holds.release(MID_PUSH)
    call.join(timeout=60)
    assert failures and failures[0].code() == grpc.StatusCode.UNAVAILABLE, failures
    # The new decode pod: a new boot id, so a new handshake and a new arena; its answers are exact.
    for i in range(2):
        prompt = prompt_of(150, seed=10 + i)
        tokens, transport = cluster.answer(f"after-{i}", prompt)
        assert (tokens, transport) == (cluster.offline_tokens(prompt), TRANSPORT_SHM)
    cluster.wait_every_block_free()
    assert os.listdir(cluster.shm_dir) == []


@pytest.mark.e2e
def test_a_decode_pod_restarted_between_requests_is_found_at_the_handshake_not_by_a_refused_push(cluster):
    """Restarted while no push ran, the decode pod has a new boot id that the prefill pod has not seen: the first
    push after it handshakes first (the connection was lost), so it is not refused as stale (FAILED_PRECONDITION,
    which sends a served request elsewhere: the shared cluster's router counted such a retry after a restart)."""
    cluster.answer("before", prompt_of(40, seed=3))
    cluster.restart_decode(signal.SIGTERM)
    prompt = prompt_of(40, seed=4)
    tokens, transport = cluster.answer("after", prompt)  # raises on a refused push
    assert (tokens, transport) == (cluster.offline_tokens(prompt), TRANSPORT_SHM)
    cluster.wait_every_block_free()


@pytest.mark.e2e
def test_a_corrupted_chunk_over_shared_memory_is_refused_by_its_checksum(tmp_path, shm_dir):
    cluster = ShmCluster(tmp_path, shm_dir, prefill_flags=("--inject-corrupt-chunks", "1.0"))
    try:
        with pytest.raises(grpc.RpcError) as caught:
            cluster.prefill_call("corrupt", prompt_of(40, seed=3))
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in caught.value.details()
        cluster.wait_every_block_free()
    finally:
        cluster.stop()


@pytest.mark.e2e
def test_a_chunked_prefill_held_until_its_end_leaves_as_one_range_per_layer(tmp_path, shm_dir):
    cluster = ShmCluster(tmp_path, shm_dir, prefill_flags=("--no-overlap-transfer",))
    try:
        prompt = prompt_of(150, seed=5)  # three 64-token steps, every layer's parts held until the last
        first = cluster.prefill_call("held", prompt)
        assert (first.kv_transfer.transport, first.kv_transfer.num_chunks) == (TRANSPORT_SHM, 4 * 2)  # not 3 x 8
        assert cluster.decode_tokens("held", prompt, first) == cluster.offline_tokens(prompt)
    finally:
        cluster.stop()


@pytest.mark.e2e
def test_kv_transport_grpc_keeps_pods_of_one_host_on_grpc(tmp_path, shm_dir):
    cluster = ShmCluster(tmp_path, shm_dir, prefill_flags=("--kv-transport", "grpc"))
    try:
        prompt = prompt_of(40, seed=4)
        assert cluster.answer("grpc", prompt) == (cluster.offline_tokens(prompt), TRANSPORT_GRPC)
        assert os.listdir(shm_dir) == []
    finally:
        cluster.stop()


# ---- safe shutdown -----------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_sigtermed_prefill_pod_under_load_loses_no_request_whose_kv_it_had_staged(tmp_path, shm_dir):
    cluster = ShmCluster(tmp_path, shm_dir, prefill_flags=("--shutdown-grace-s", "60"))
    prompts = {f"load-{i}": prompt_of(400 + 40 * i, seed=100 + i) for i in range(6)}
    outcomes: dict[str, prefill_pb2.PrefillResponse | grpc.RpcError] = {}

    def call(request_id: str) -> None:
        try:
            outcomes[request_id] = cluster.prefill_call(request_id, prompts[request_id])
        except grpc.RpcError as err:
            outcomes[request_id] = err

    try:
        calls = [threading.Thread(target=call, args=(request_id,)) for request_id in prompts]
        for thread in calls:
            thread.start()
        deadline = time.monotonic() + 30
        # SIGTERM once the pod holds every prompt (a call still on its way would be refused, and rightly so) and
        # KV is on its way; the 64-token step budget keeps the six prefills running for dozens of steps.
        while (load := cluster.load(cluster.prefill)).num_running + load.num_waiting < len(prompts) or (
                (decode := cluster.load(cluster.decode)).free_kv_blocks == decode.total_kv_blocks):
            assert time.monotonic() < deadline and not outcomes, f"not every prompt was in flight at once: {load}"
            time.sleep(0.005)
        cluster.prefill.popen.send_signal(signal.SIGTERM)
        for thread in calls:
            thread.join(timeout=90)
        assert cluster.prefill.popen.wait(timeout=90) == 0, "the prefill pod did not exit cleanly after its drain"
        # Every prompt it had taken was prefilled and its KV pushed before it exited: each answer is exact.
        failed = {rid: outcome.code() for rid, outcome in outcomes.items() if isinstance(outcome, grpc.RpcError)}
        assert failed == {}, failed
        for request_id, prompt in prompts.items():
            tokens = cluster.decode_tokens(request_id, prompt, outcomes[request_id])
            assert tokens == cluster.offline_tokens(prompt), request_id
        with pytest.raises(grpc.RpcError) as refused:  # gone: new prompts go to another prefill pod
            cluster.prefill_call("after", prompts["load-0"])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert os.listdir(shm_dir) == []
    finally:
        cluster.stop()


# What a call to a pod that stops taking calls gets: refused (UNAVAILABLE), or cancelled as the server stops under it
# (CANCELLED, which the router takes for UNAVAILABLE: router/request_run.py); the router retries either.
REFUSED_WHILE_STOPPING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@pytest.mark.e2e
def test_a_sigtermed_decode_pod_finishes_its_stream_and_refuses_kv_not_yet_claimed_so_the_router_retries(tmp_path,
                                                                                                       shm_dir):
    """On SIGTERM a decode pod drains: a running stream finishes within the grace period; KV pushed here whose claim
    comes once the pod has stopped taking calls is refused, which the router retries on another pair before the first
    token (router/placement.py); the pod then exits cleanly, leaving no arena behind."""
    cluster = ShmCluster(tmp_path, shm_dir, decode_flags=("--shutdown-grace-s", "60"))
    long_answer = common_pb2.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)  # seconds
    ended: list[decode_pb2.DecodeComplete | grpc.RpcError] = []

    def stream(first: prefill_pb2.PrefillResponse, prompt: list[int]) -> None:
        try:
            with grpc.insecure_channel(cluster.decode.address) as channel:
                for message in decode_pb2_grpc.DecodeStub(channel).Decode(decode_pb2.DecodeRequest(
                        request_id="running", prompt_token_ids=prompt, sampling_params=long_answer,
                        first_token_id=first.first_token_id), timeout=120):
                    if message.HasField("complete"):
                        ended.append(message.complete)
        except grpc.RpcError as err:
            ended.append(err)

    try:
        running_prompt = prompt_of(40, seed=20)
        running = threading.Thread(target=stream, args=(cluster.prefill_call("running", running_prompt),
                                                        running_prompt))
        running.start()
        deadline = time.monotonic() + 30
        while cluster.load(cluster.decode).num_running == 0:
            assert time.monotonic() < deadline and not ended, f"the stream never ran: {ended}"
            time.sleep(0.005)
        waiting_prompt = prompt_of(40, seed=21)
        waiting = cluster.prefill_call("waiting", waiting_prompt)  # its KV waits here under a lease
        assert not ended, "the stream ended before the SIGTERM: make it longer"
        cluster.decode.popen.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(cluster.decode.address) as channel:  # until the pod takes no new call
            status = pod_status_pb2_grpc.PodStatusStub(channel)
            while True:
                try:
                    status.GetLoad(pod_status_pb2.LoadRequest(), timeout=5)
                except grpc.RpcError as err:
                    assert err.code() in REFUSED_WHILE_STOPPING, err
                    break
                assert time.monotonic() < deadline + 30, "the decode pod still takes calls 30 s after its SIGTERM"
                time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as refused:
            cluster.decode_tokens("waiting", waiting_prompt, waiting)
        assert refused.value.code() in REFUSED_WHILE_STOPPING  # retried by the router, not a failed request
        running.join(timeout=120)
        assert len(ended) == 1 and isinstance(ended[0], decode_pb2.DecodeComplete), ended
        assert ended[0].usage.completion_tokens == 1500  # to its last token
        assert cluster.decode.popen.wait(timeout=90) == 0, "the decode pod did not exit cleanly after its drain"
        assert os.listdir(shm_dir) == []
    finally:
        cluster.stop()

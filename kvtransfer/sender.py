"""Prefill side of the KV transfer: stream a prompt's KV to a decode pod while later layers still compute.

One request's path through this module:

    KVTransferClient.open(decode_address, codec, request_id, prompt)  asyncio; one cached channel per decode pod,
                                                                      Handshake once per (address, codec); codec
                                                                      "auto": the LinkCodecChooser's pick for
                                                                      that decode pod (kvtransfer/link_codec.py);
                                                                      a new peer boot id: the link's transport
                                                                      chosen (kvtransfer/shm.py)
      -> KVSender
    sender.push()                                                     asyncio task, concurrent with the prefill:
        PushKV: header (request, prompt, lease, compat hash, boot     -> the decode pod reserves blocks
                ids, the link's shared-memory arena if any)
    engine thread, after each layer of each step (prefill_service/kv_export.py):
        sender.submit_layer(layer, token_start, token_end, heads)     copies of that layer's K and V [T, H, D], one
                                                                      HeadsKV per KV head range (a tensor-parallel
                                                                      pod: each rank's heads, no gather)
        sender.mark_compute_done()                                    after the last layer of the last prompt token
    push(), for each layer as it arrives:
        on a worker thread, encode_chunks and ShmPush.frame (bytes    while the engine computes the next layer,
        into the arena, or inline), or ShmPush.frame_raw (codec none
        or bf16 through an arena: gathered straight into it), then
        write the framed messages                                     and the worker encodes the next layer
                                                                      held (one ahead: its chunks' numbers
                                                                      follow this layer's)
    push(): trailer (num_chunks, num_tokens), then the decode pod's acknowledgement -> KVTransferStats; the link
            time (writes held up by flow control, then the wait for the acknowledgement) goes to the chooser

With ``overlap=False`` the layers wait until the prefill step is over (``prefill_finished``) and only then are
encoded and sent: the baseline that shows what the overlap saves. Either way ``exposed_transfer_seconds`` is the
time from the end of the last layer's compute to the acknowledgement: what the transfer adds to TTFT.

A failure of the push (the decode pod's status, a broken connection) surfaces as a ``StatusError`` with the
decode pod's status code, so the prefill pod answers the router with the same code. After FAILED_PRECONDITION or
UNAVAILABLE (the decode pod may have restarted) the next push handshakes again, and so does the first push after the
channel lost its connection: a decode pod restarted in between is found at that handshake (its new boot id), not
by a refused push that would send the request elsewhere.
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import numpy as np
import torch

from splitserve.kvtransfer import push_hold
from splitserve.kvtransfer.codecs import KVCodec, get_codec
from splitserve.kvtransfer.handshake import BOOT_ID, KVLayout, note_formats
from splitserve.kvtransfer.link_codec import LinkCodecChooser
from splitserve.kvtransfer.shm_arena import ShmLinks, ShmPush
from splitserve.kvtransfer.wire import MAX_CHUNK_BYTES, WireChunk, encode_chunks, raw_nbytes
from splitserve.runtime import transport
from splitserve.runtime.errors import StatusError
from splitserve.runtime.kv_codecs import AUTO
from splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, prefill_pb2


class HeadsKV(NamedTuple):
    """One layer's K and V of some KV heads: all of them from one process; one rank's from a tensor-parallel pod,
    whose ranks' heads leave as chunks of their own (``KVChunk.heads``), never gathered into one tensor."""

    heads: tuple[int, int] | None  # the model's KV heads [start, end) k and v hold; None: all of them
    k: torch.Tensor  # [tokens, end - start, head_dim]
    v: torch.Tensor  # same


@dataclass
class _LayerKV:
    """One layer's K and V of some KV heads for tokens [token_start, token_end) of the prompt, copied out of the
    paged cache."""

    layer: int
    token_start: int
    token_end: int
    k: torch.Tensor  # [token_end - token_start, KV heads, head_dim]
    v: torch.Tensor  # same
    heads: tuple[int, int] | None = None  # as HeadsKV's


_PUSH_KV_METHOD = "/{}/PushKV".format(kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name)
CORE_WRITE_FAILURE = "Internal error from Core"  # grpc's own details when it ends a call whose write failed
STATUS_WAIT_S = 5.0  # how long a failed push waits for the call's final status

# Queue markers besides layers: the prefill step is over (overlap=False starts sending), the call ended early.
_PREFILL_FINISHED = object()
_CALL_ENDED = object()


class KVTransferClient:
    """The prefill pod's connections to decode pods: one channel per address, handshakes cached."""

    def __init__(self, layout: KVLayout, max_chunk_bytes: int = MAX_CHUNK_BYTES, overlap: bool = True,
                 encode_threads: int = 2, corrupt_chunk_rate: float = 0.0,
                 link_codecs: LinkCodecChooser | None = None, shm_links: ShmLinks | None = None):
        self.layout = layout
        self.shm_links = shm_links or ShmLinks(enabled=False)
        self.link_codecs = link_codecs or LinkCodecChooser(layout, None, 1.0)
        self.max_chunk_bytes = max_chunk_bytes
        self.overlap = overlap
        # Fault injection (reliability tests, soak runs): this share of chunks leaves with a flipped payload byte,
        # after its checksum was taken, so the decode pod must catch it.
        self.corrupt_chunk_rate = corrupt_chunk_rate
        self._fault_rng = random.Random(0)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._handshaken: set[tuple[str, str]] = set()
        self._accepted: dict[str, list[str]] = {}  # decode address -> the codecs it accepts (its handshake's)
        self._peer_boot_ids: dict[str, str] = {}  # decode address -> its boot id at the handshake
        self._peer_layouts: dict[str, KVLayout] = {}  # decode address -> its layout at the handshake
        # Encoding runs off the event loop, so sockets keep moving; two threads keep K and V of different
        # requests going without oversubscribing the cores the engine computes on.
        self._encoder = ThreadPoolExecutor(encode_threads, thread_name_prefix="kv-encode")

    async def open(self, decode_address: str, codec_name: str, request_id: str, prompt_token_ids: list[int],
                   lease_s: float = 0.0, timeout_s: float | None = None, num_claims: int = 1) -> "KVSender":
        """A sender for one request, after the handshake with ``decode_address`` for ``codec_name`` (AUTO: the
        chooser's pick for that link among the codecs the decode pod accepts; "none" from a pool whose rows a codec
        carries: that codec, ``LinkCodecChooser.lossless``). ``num_claims``: the Decode calls that will claim the KV
        (the samples of an n > 1 request)."""
        if codec_name == AUTO:
            accepted = await self.accepted_codecs(decode_address, timeout_s)
            codec_name = self.link_codecs.choose(decode_address, len(prompt_token_ids), accepted)
        elif codec_name == "none" and self.link_codecs.stored:  # an int8 pool's rows, as they lie
            codec_name = self.link_codecs.lossless(await self.accepted_codecs(decode_address, timeout_s))
        try:
            codec = get_codec(codec_name)
        except ValueError as err:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"kv_codec: {err}") from err
        if self._connection_lost(decode_address):
            # Lost since the handshake, the connection may now lead to a restarted pod: a push would carry the old
            # boot id and be refused (FAILED_PRECONDITION, the request retried elsewhere). Handshake first.
            self.forget_handshake(decode_address)
        await self.handshake(decode_address, codec_name, timeout_s)
        return KVSender(self, decode_address, request_id, prompt_token_ids, codec, lease_s, timeout_s, num_claims)

    async def handshake(self, decode_address: str, codec_name: str, timeout_s: float | None = None) -> None:
        """Check once per (address, codec) that the decode pod takes our KV with this codec."""
        if (decode_address, codec_name) in self._handshaken:
            return
        response = await self._handshake(decode_address, codec_name, timeout_s)
        self._accepted[decode_address] = list(response.supported_codecs)
        self._handshaken.add((decode_address, codec_name))

    async def accepted_codecs(self, decode_address: str, timeout_s: float | None = None) -> list[str]:
        """The codecs ``decode_address`` accepts, from a handshake of the layout alone (once per address)."""
        if decode_address not in self._accepted:
            response = await self._handshake(decode_address, "", timeout_s)
            self._accepted[decode_address] = list(response.supported_codecs)
        return self._accepted[decode_address]

    async def _handshake(self, decode_address: str, codec_name: str,
                         timeout_s: float | None) -> kv_transfer_pb2.HandshakeResponse:
        request = kv_transfer_pb2.HandshakeRequest(layout=self.layout.to_proto(),
                                                   compat_hash=self.layout.compat_hash, codec=codec_name,
                                                   boot_id=BOOT_ID, host_id=self.shm_links.host_id)
        try:
            response = await self.stub(decode_address).Handshake(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise StatusError(err.code(), f"decode pod {decode_address}: {err.details()}") from err
        if response.compat_hash != self.layout.compat_hash:  # the receiver checks too; trust but verify
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"decode pod {decode_address}: compat_hash: sender {self.layout.compat_hash!r}, "
                              f"receiver {response.compat_hash!r}")
        self._peer_layouts[decode_address] = KVLayout.from_proto(response.layout)
        note_formats(self.layout, self._peer_layouts[decode_address], f"decode pod {decode_address}")
        if self._peer_boot_ids.get(decode_address) != response.boot_id:  # a new peer: choose the link anew
            self._peer_boot_ids[decode_address] = response.boot_id
            self.shm_links.choose(decode_address, response)
        return response

    def forget_handshake(self, decode_address: str) -> None:
        """The decode pod refused a push as incompatible or went away (restarted?): handshake again, for every
        codec, and choose the link's transport again."""
        self._handshaken = {handshaken for handshaken in self._handshaken if handshaken[0] != decode_address}
        self._accepted.pop(decode_address, None)
        self._peer_boot_ids.pop(decode_address, None)
        self._peer_layouts.pop(decode_address, None)
        self.shm_links.forget(decode_address)

    def _connection_lost(self, decode_address: str) -> bool:
        """The channel to ``decode_address`` is not connected (it was, for the handshake): the peer went away, or
        the channel idled out. Either way a handshake (one round trip) tells whether it is the same process."""
        channel = self._channels.get(decode_address)
        return channel is not None and channel.get_state() != grpc.ChannelConnectivity.READY

    def peer_boot_id(self, decode_address: str) -> str:
        return self._peer_boot_ids.get(decode_address, "")

    def kept_from(self, decode_address: str, num_tokens: int) -> tuple[int, frozenset[int]]:
        """Where ``decode_address`` keeps a prompt of ``num_tokens`` from, and in which layers (its handshake's
        layout: ``KVLayout.kept_from``)."""
        layout = self._peer_layouts.get(decode_address)
        return layout.kept_from(num_tokens) if layout is not None else (0, frozenset())

    def stub(self, decode_address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        return kv_transfer_pb2_grpc.KVTransferStub(self._channel(decode_address))

    def push_kv(self, decode_address: str) -> grpc.aio.StreamUnaryMultiCallable:
        """The PushKV method, writing chunks as ``push_message`` framed them (bytes) and other messages (header,
        trailer) as protobuf serializes them: the stub's serializer would need the chunk in a KVPush message."""
        return self._channel(decode_address).stream_unary(
            _PUSH_KV_METHOD, request_serializer=_serialize_push,
            response_deserializer=kv_transfer_pb2.PushKVResponse.FromString,
            _registered_method=True)  # as the generated stub calls it

    def _channel(self, decode_address: str) -> grpc.aio.Channel:
        channel = self._channels.get(decode_address)
        if channel is None:
            channel = transport.open_channel(decode_address)  # TLS: the pod process's (configure_process_tls)
            self._channels[decode_address] = channel
        return channel

    def corrupt(self, chunks: list[WireChunk]) -> None:
        """Fault injection: each encoded chunk's payload, after its checksum, flipped at ``corrupt_chunk_rate``."""
        for chunk in chunks:
            at = self._fault_at(len(chunk.payload))
            if at is not None:
                payload = bytearray(chunk.payload)
                payload[at] ^= 0x5A
                chunk.payload = bytes(payload)

    def corrupt_in_place(self, payload: np.ndarray) -> None:
        """Fault injection: at ``corrupt_chunk_rate``, one byte of a chunk's span in an arena (``ShmPush.frame_raw``)
        flipped."""
        at = self._fault_at(len(payload))
        if at is not None:
            payload[at] ^= 0x5A

    def _fault_at(self, size: int) -> int | None:
        """At ``corrupt_chunk_rate``, the byte to flip of a payload of ``size`` bytes; None: it stays whole."""
        if size and self.corrupt_chunk_rate and self._fault_rng.random() < self.corrupt_chunk_rate:
            return self._fault_rng.randrange(size)
        return None

    def encode(self, fn, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._encoder, fn, *args)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._encoder.shutdown(wait=False, cancel_futures=True)
        self.shm_links.close()


class KVSender:
    """One request's push. Layers come in from the engine thread; ``push`` runs on the event loop."""

    def __init__(self, client: KVTransferClient, decode_address: str, request_id: str,
                 prompt_token_ids: list[int], codec: KVCodec, lease_s: float, timeout_s: float | None,
                 num_claims: int = 1):
        self.request_id = request_id
        self.num_claims = num_claims
        self.decode_address = decode_address
        self.codec = codec
        self._client = client
        self._prompt_token_ids = list(prompt_token_ids)
        # Where the decode pod keeps the prompt's KV from, in its windowed layers: the export submits none of their
        # tokens before it.
        self.first_token, self.window_layers = client.kept_from(decode_address, len(self._prompt_token_ids))
        self._lease_s = lease_s
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._compute_done_at: float | None = None  # perf_counter seconds, set on the engine thread
        self._shm = ShmPush(client.shm_links.arena(decode_address),
                            fault=client.corrupt_in_place if client.corrupt_chunk_rate else None)
        self._held_mid_push = False  # the test hook's MID_PUSH point is passed once (kvtransfer/push_hold.py)
        self._stats = prefill_pb2.KVTransferStats(codec=codec.name, transport=self._shm.transport)
        self._first_write_at: float | None = None
        self._last_write_at: float | None = None
        self._write_seconds = 0.0  # time spent in call.write: flow control holding the writes back

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._prompt_token_ids)

    # ---- engine thread ---------------------------------------------------------------------------------------

    def submit_layer(self, layer: int, token_start: int, token_end: int, heads: list[HeadsKV]) -> None:
        """Hand over one layer's K and V, every KV head in ``heads`` (copies, owned by the sender from now on). In
        one put, so that the prompt's last layer is held whole when the push decides it is out."""
        parts = [_LayerKV(layer, token_start, token_end, k, v, h) for h, k, v in heads]
        self._loop.call_soon_threadsafe(self._inbox.put_nowait, parts)

    def mark_compute_done(self) -> None:
        """The last layer of the last prompt token is computed: from here on the transfer is exposed."""
        self._compute_done_at = time.perf_counter()

    # ---- event loop ------------------------------------------------------------------------------------------

    def prefill_finished(self) -> None:
        """The prefill step is over (with overlap=False, sending starts now)."""
        self._inbox.put_nowait(_PREFILL_FINISHED)

    async def push(self) -> prefill_pb2.KVTransferStats:
        """Run the PushKV stream to its acknowledgement. Raises StatusError with the decode pod's status."""
        call = self._client.push_kv(self.decode_address)(timeout=self._timeout_s)
        call.add_done_callback(lambda _: self._inbox.put_nowait(_CALL_ENDED))
        try:
            await self._stream(call)  # the response (bytes received, lease) is the receiver's account
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
            raise await self._failure(call, err) from None
        except BaseException:
            call.cancel()  # the decode pod sees CANCELLED and releases the blocks it reserved
            raise
        finally:
            self._shm.release()  # the call is over: the decode pod reads none of the push's spans any more
        self._shm.acknowledged()
        ack_at = time.perf_counter()
        self._stats.transfer_seconds = ack_at - (self._first_write_at or ack_at)
        self._stats.exposed_transfer_seconds = max(0.0, ack_at - (self._compute_done_at or ack_at))
        link_seconds = self._write_seconds + ack_at - (self._last_write_at or ack_at)
        self._client.link_codecs.observe(self.decode_address, self._stats.bytes_sent, link_seconds)
        return self._stats

    async def _stream(self, call) -> kv_transfer_pb2.PushKVResponse:
        await call.write(kv_transfer_pb2.KVPush(header=kv_transfer_pb2.KVTransferHeader(
            request_id=self.request_id, prompt_token_ids=self._prompt_token_ids,
            compat_hash=self._client.layout.compat_hash, lease_seconds=self._lease_s, num_claims=self.num_claims,
            sender_boot_id=BOOT_ID, receiver_boot_id=self._client.peer_boot_id(self.decode_address),
            shm_arena=self._shm.arena.name if self._shm.arena is not None else "", first_token=self.first_token)))
        held: list[_LayerKV] = []
        sending = self._client.overlap
        while True:
            item = await self._inbox.get()
            if item is _CALL_ENDED:
                return await call  # ended before the trailer: raises the decode pod's status
            if item is _PREFILL_FINISHED:
                sending = True
            else:
                held.extend(item)
            if sending and await self._send_held(call, held):
                break
        await call.write(kv_transfer_pb2.KVPush(trailer=kv_transfer_pb2.KVTransferTrailer(
            num_chunks=self._stats.num_chunks, num_tokens=self.num_prompt_tokens)))
        await call.done_writing()
        return await call

    async def _send_held(self, call, held: list[_LayerKV]) -> bool:
        """Encode and write the held layers in order, encoding each next layer while this one is written; True
        once the prompt's last layer is out."""
        last_sent = False
        encoding = self._encode_next(held)
        try:
            while encoding is not None:
                item, raw_bytes, messages, wire_bytes = await encoding
                self._stats.num_chunks += len(messages)
                encoding = self._encode_next(held)  # numbered after this layer's chunks
                self._first_write_at = self._first_write_at or time.perf_counter()
                for message in messages:
                    started = time.perf_counter()
                    await call.write(message)
                    self._last_write_at = time.perf_counter()
                    self._write_seconds += self._last_write_at - started
                self._stats.bytes_sent += wire_bytes
                self._stats.raw_bytes += raw_bytes
                if not self._held_mid_push:  # the first layer's chunks are written, no later one's
                    self._held_mid_push = True
                    await push_hold.hold(push_hold.MID_PUSH, self.request_id)
                last_sent = (item.layer == self._client.layout.num_layers - 1
                             and item.token_end == self.num_prompt_tokens)
        finally:
            if encoding is not None:  # a write failed: the next layer's encoding is of no use
                encoding.cancel()
        return last_sent

    def _encode_next(self, held: list[_LayerKV]) -> asyncio.Future | None:
        return self._client.encode(self._encode, _take_layer(held), self._stats.num_chunks) if held else None

    def _encode(self, parts: list[_LayerKV], first_seq: int) -> tuple[_LayerKV, int, list[bytes], int]:
        """Worker thread: the layer's K then V as numbered chunks, framed (a raw codec through an arena: gathered
        straight into a span, ShmPush.frame_raw; else encode_chunks); its last part, raw and wire bytes."""
        first, last, messages, wire_bytes = parts[0], parts[-1], [], 0
        max_chunk_bytes = self._shm.max_chunk_bytes(self._client.max_chunk_bytes)
        for kind in ("k", "v"):
            tensors = [getattr(part, kind) for part in parts]
            framed = self._shm.frame_raw(
                self.request_id, first.layer, kind, (first.token_start, last.token_end), first.heads,
                first_seq + len(messages), tensors, self.codec, max_chunk_bytes)
            if framed is not None:
                messages, wire_bytes = messages + [framed[0]], wire_bytes + framed[1]
                continue
            chunks = encode_chunks(self.request_id, first.layer, kind, first.token_start, last.token_end,
                                   tensors[0] if len(tensors) == 1 else torch.cat(tensors), self.codec,
                                   self.num_prompt_tokens, max_chunk_bytes, first_seq + len(messages), first.heads)
            self._client.corrupt(chunks)  # at corrupt_chunk_rate (0: none)
            messages += [self._shm.frame(chunk) for chunk in chunks]
            wire_bytes += sum(chunk.nbytes for chunk in chunks)
        return last, sum(raw_nbytes(part.k) + raw_nbytes(part.v) for part in parts), messages, wire_bytes

    async def _failure(self, call, err: Exception) -> StatusError:
        # The call's own status says why it ended. A write that raced the decode pod's refusal fails on its own
        # terms (InvalidStateError, or INTERNAL "Internal error from Core"), which would hide the refusal.
        try:
            code, details = await asyncio.wait_for(_status(call), timeout=STATUS_WAIT_S)
        except asyncio.TimeoutError:
            code, details = (err.code(), err.details()) if isinstance(err, grpc.aio.AioRpcError) else (
                grpc.StatusCode.UNAVAILABLE, f"the push failed: {err!r}")
        if code == grpc.StatusCode.INTERNAL and details == CORE_WRITE_FAILURE:
            # Sometimes the race is lost for good: gRPC's core ended the call itself when the write failed, before
            # the decode pod's status (DATA_LOSS for a bad checksum, ...) arrived. The push broke off on the way,
            # which is UNAVAILABLE (the router retries it), not a bug in either pod (INTERNAL, which it would not).
            code, details = grpc.StatusCode.UNAVAILABLE, ("the push broke off while writing: the decode pod ended "
                                                          "the stream (its log says why)")
        if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
            self._client.forget_handshake(self.decode_address)
        return StatusError(code, f"decode pod {self.decode_address}: {details}")



def _take_layer(held: list[_LayerKV]) -> list[_LayerKV]:
    """The first held layer and the held parts of the same layer and heads that continue its token range, taken out
    of ``held``: a chunked prefill's steps held together (overlap off, or a link that lags) leave as one range, cut
    into as few chunks as the chunk size allows, since every chunk costs a message and a hop on each side (8 steps
    of a 4096-token prompt were 480 chunks, each about as costly as its bytes)."""
    parts = [held.pop(0)]
    for item in list(held):
        if item.layer == parts[0].layer and item.heads == parts[0].heads and item.token_start == parts[-1].token_end:
            parts.append(item)
            held.remove(item)
    return parts


def _serialize_push(message: kv_transfer_pb2.KVPush | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


async def _status(call) -> tuple[grpc.StatusCode, str]:
    return await call.code(), await call.details()

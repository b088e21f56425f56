"""Decode side of the KV transfer: the ``KVTransfer`` gRPC service, writing pushed KV into the paged cache (the
reserve and receive steps of the hand-off that ``handoff.py`` narrates and owns).

A push's path through ``PushKV``:

    header    compat hash and this pod's boot id checked (FAILED_PRECONDITION: the sender handshakes again); the
              shared-memory arena it names, if any, mapped (kvtransfer/shm.py); KVHandoff.reserve files a
              RECEIVING lease (ALREADY_EXISTS) with the prompt's blocks, reserved on the engine thread
              (RESOURCE_EXHAUSTED when there is no room)
    chunks    parsed by splitserve.kvtransfer.wire.parse_push, the stream's deserializer, payload and scales left in
              the received message's bytes (or, for a chunk with a shared-memory span, viewed in the arena:
              with_shm_bytes); sequence number and codec checked on the event loop (a gap or repeat:
              INVALID_ARGUMENT); then on one of the pod's intake threads (KVIntake, up to INTAKE_IN_FLIGHT chunks
              of a push at a time while the event loop reads the next messages) decode_chunk verifies the checksum
              (DATA_LOSS), codec, range and shape and decodes (for codec none, a view of the message's or the
              arena's bytes), and the tensor is written into the cache (write_heads: the chunk's KV heads at the
              slots of the sequence's tokens, into the ranks that own them on a tensor-parallel pod: the one copy
              on this side). The blocks belong to the reserved sequence alone, which the engine does not schedule
              yet, so writing beside the running engine thread is safe; the handler waits for its workers
              (KVIntake.settle) before it acknowledges or releases the blocks, so no write outlives it
    trailer   every (layer, K/V, KV head, token) of the prompt must have arrived exactly once (else DATA_LOSS);
              KVHandoff.received moves the lease to WAITING and the response tells the sender how long it lasts

Any error or cancellation on the way releases the blocks: nothing of a failed push stays behind. A push whose KV
fails its checks (a bad chunk: DATA_LOSS or INVALID_ARGUMENT from decode_chunk, or an incomplete trailer) follows
the pod's ``kv_load_failure_policy``: ``fail`` answers with that status (counted kv_load outcome "failed");
``recompute`` reads the rest of the stream, keeps nothing, and acknowledges with ``recompute`` set, so the
prefill pod answers the router with its first token and the Decode call prefills the prompt here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import AsyncIterator, Iterable

import grpc
import torch

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.parallel.sharded_kv_cache import write_heads
from splitserve.engine.sequence import Sequence
from splitserve.kvtransfer.handoff import KVHandoff, KVLease
from splitserve.kvtransfer.handshake import BOOT_ID, KVLayout, check_compatible, note_formats
from splitserve.kvtransfer.shm import ShmArenaViews, with_shm_bytes
from splitserve.kvtransfer.wire import (
    DecodedKVChunk,
    ExpectedChunks,
    KVChunkError,
    WireChunk,
    decode_chunk,
    parse_push,
)
from splitserve.runtime.errors import StatusError
from splitserve.runtime.metrics import PodMetrics
from splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

logger = logging.getLogger(__name__)
_KIND_INDEX = {"k": 0, "v": 1}
REFUSAL_DRAIN_S = 2.0  # how long a refused push is read on (discarded) so that the sender sees the refusal's status
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")  # what a decode pod does when pushed KV fails to load
INTAKE_IN_FLIGHT = 2  # chunks of one push checked and written on worker threads while the next one is read
# The pod's intake workers, shared by its pushes: a pool of its own rather than the event loop's default one (up to
# cores + 4 threads), so that pushes at once do not take more cores from the engine; it also cost the decode pod
# 10-30% less CPU per GB received (0.21-0.27 against 0.27-0.32 CPU-s/GB, alternating rounds, AMD EPYC).
INTAKE_THREADS = 2


class KVLoadError(StatusError):
    """The pushed KV itself is bad (a chunk failed its checks, or some never came): the load failure policy
    applies, unlike a malformed stream or a refusal."""


class KVIntake:
    """One push being received: which chunks arrived, and where their tensors go. Chunks are checked and written on
    worker threads, up to ``INTAKE_IN_FLIGHT`` at a time, while the event loop reads the next messages; ``settle``
    waits for them (the trailer, the end of the push whichever way), so no write outlives the handler."""

    def __init__(self, engine_loop: EngineLoop, seq: Sequence, expected: ExpectedChunks, workers: Executor):
        self.seq = seq
        self._workers = workers
        self.expected = expected
        self.next_seq = 0
        self.bytes_received = 0
        self.codec: str | None = None  # the push's codec, fixed by its first chunk
        self._kv_cache = engine_loop.engine.runner.kv_cache
        # [layers, K/V, KV heads, tokens]: which KV has arrived, so that the trailer can tell a complete push.
        # Marked on the event loop as each chunk's work is over, in the stream's order, so that a repeat is the
        # later chunk.
        self._received = torch.zeros(expected.num_layers, 2, expected.num_kv_heads, expected.num_tokens,
                                     dtype=torch.bool)
        self._slots_by_range: dict[tuple[str, int, int], torch.Tensor] = {}
        self._in_flight: collections.deque[asyncio.Future] = collections.deque()

    async def store(self, wire_chunk: WireChunk) -> None:
        """Take the next chunk of the stream: its order and codec checked here, the rest on a worker thread; waits
        only while ``INTAKE_IN_FLIGHT`` chunks are still in the works, and raises the oldest one's failure."""
        chunk = wire_chunk.fields
        if chunk.seq != self.next_seq:
            await self.settle()  # a failure of an earlier chunk is the stream's first
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"chunk seq {chunk.seq} arrived where {self.next_seq} was due")
        self.next_seq += 1
        if self.codec not in (None, chunk.codec):
            await self.settle()
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"chunk {chunk.seq} uses codec {chunk.codec!r}; this push uses {self.codec!r}")
        self.codec = chunk.codec
        self.bytes_received += wire_chunk.nbytes
        while len(self._in_flight) >= INTAKE_IN_FLIGHT or (self._in_flight and self._in_flight[0].done()):
            self._mark_arrived(await self._in_flight.popleft())
        self._in_flight.append(asyncio.get_running_loop().run_in_executor(self._workers, self._check_and_write,
                                                                          wire_chunk))

    def _check_and_write(self, wire_chunk: WireChunk) -> tuple[int, DecodedKVChunk]:
        """Worker thread: the chunk checked (checksum first) and decoded, then written into the sequence's blocks
        (they belong to the reserved sequence alone, which the engine does not schedule yet). A repeat is found
        after its write, by ``_mark_arrived``: its push then fails, and a failed push's blocks are released."""
        try:
            decoded = decode_chunk(wire_chunk, self.expected, self._kv_cache.device, self._kv_cache.dtype)
        except KVChunkError as err:
            raise KVLoadError(err.code, err.message) from err
        write_heads(self._kv_cache, decoded.layer, decoded.kind,
                    self._slots(decoded.layer, decoded.token_start, decoded.token_end), decoded.tensor, decoded.heads)
        return wire_chunk.fields.seq, decoded._replace(tensor=None)  # the tensor may view the message: let it go

    def _mark_arrived(self, written: tuple[int, DecodedKVChunk]) -> None:
        seq, decoded = written
        (h0, h1), (t0, t1) = decoded.heads, (decoded.token_start, decoded.token_end)
        arrived = self._received[decoded.layer, _KIND_INDEX[decoded.kind], h0:h1, t0:t1]
        if bool(arrived.any()):
            some = f" of KV heads [{h0}, {h1})" if h1 - h0 < self.expected.num_kv_heads else ""
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"chunk {seq} repeats KV already received (layer {decoded.layer}, "
                              f"{decoded.kind.upper()}, tokens [{t0}, {t1}){some})")
        arrived.fill_(True)

    def _slots(self, layer: int, token_start: int, token_end: int) -> torch.Tensor:
        """[T] long: where ``layer``'s tokens go; the K and V of a token range go to the same slots in every layer of
        one block table (``PagedKVCache.table_of``)."""
        key = (self._kv_cache.table_of(layer), token_start, token_end)
        if key not in self._slots_by_range:  # two workers may both compute it: the same tensor either way
            self._slots_by_range[key] = self._kv_cache.slots(getattr(self.seq, key[0]), token_start, token_end)
        return self._slots_by_range[key]

    async def settle(self) -> None:
        """Wait for every chunk still in the works, then mark them in the stream's order: raises the first
        failure."""
        in_flight, self._in_flight = list(self._in_flight), collections.deque()
        for outcome in await asyncio.gather(*in_flight, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
            self._mark_arrived(outcome)

    def _missing(self) -> tuple[int, tuple[int, int, int, int] | None]:
        """How many (layer, K/V, KV head, token) entries were not received, each layer's from its first token on, and
        the first of them."""
        count, first = 0, None
        for layer in range(self.expected.num_layers):
            start = self.expected.start(layer)
            missing = ~self._received[layer, ..., start:]
            count += int(missing.sum())
            if first is None and count:
                kind, head, token = missing.nonzero()[0].tolist()
                first = (layer, kind, head, start + token)
        return count, first

    def check_complete(self, trailer: kv_transfer_pb2.KVTransferTrailer) -> None:
        if trailer.num_tokens != self.expected.num_tokens:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"trailer covers {trailer.num_tokens} tokens, "
                              f"the header's prompt has {self.expected.num_tokens}")
        if trailer.num_chunks != self.next_seq:
            raise KVLoadError(grpc.StatusCode.DATA_LOSS,
                              f"trailer says {trailer.num_chunks} chunks were sent, {self.next_seq} arrived")
        count, first = self._missing()
        if count:
            layer, kind, head, token = first
            raise KVLoadError(grpc.StatusCode.DATA_LOSS,
                              f"incomplete KV: {count} (layer, K/V, KV head, token) entries missing, the "
                              f"first at layer {layer}, {'KV'[kind]}, token {token}, KV head {head}")


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    service_name = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name

    def __init__(self, engine_loop: EngineLoop, handoff: KVHandoff, metrics: PodMetrics,
                 accepted_codecs: Iterable[str], load_failure_policy: str = "fail",
                 shm: ShmArenaViews | None = None):
        self._engine_loop = engine_loop
        self.shm = shm or ShmArenaViews("")  # "": KV over gRPC only
        self.load_failure_policy = load_failure_policy
        self._handoff = handoff
        self._metrics = metrics
        self.layout = KVLayout.of_engine(engine_loop.engine)
        self.accepted_codecs = list(accepted_codecs)
        self._intake_workers = ThreadPoolExecutor(INTAKE_THREADS, thread_name_prefix="kv-intake")

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """The generated registration, but PushKV's messages parsed by ``parse_push`` (chunks as WireChunks)."""
        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                self.Handshake, request_deserializer=kv_transfer_pb2.HandshakeRequest.FromString,
                response_serializer=kv_transfer_pb2.HandshakeResponse.SerializeToString),
            "PushKV": grpc.stream_unary_rpc_method_handler(
                self.PushKV, request_deserializer=parse_push,
                response_serializer=kv_transfer_pb2.PushKVResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.service_name, handlers),))
        server.add_registered_method_handlers(self.service_name, handlers)

    async def Handshake(self, request: kv_transfer_pb2.HandshakeRequest, context) -> kv_transfer_pb2.HandshakeResponse:
        sender = KVLayout.from_proto(request.layout)
        try:
            check_compatible(self.layout, sender, request.compat_hash, request.codec, self.accepted_codecs)
        except StatusError as err:
            await context.abort(err.code, err.message)
        note_formats(self.layout, sender, f"prefill pod {context.peer()}")
        return kv_transfer_pb2.HandshakeResponse(layout=self.layout.to_proto(), supported_codecs=self.accepted_codecs,
                                                 compat_hash=self.layout.compat_hash, boot_id=BOOT_ID,
                                                 **self.shm.handshake_fields())

    async def PushKV(self, request_iterator: AsyncIterator[kv_transfer_pb2.KVPush | WireChunk],
                     context) -> kv_transfer_pb2.PushKVResponse:
        lease = intake = None
        acknowledged = False
        try:
            header = await self._header(request_iterator)
            arena = self.shm.open(header.shm_arena) if header.shm_arena else None
            lease = await self._handoff.reserve(header.request_id, list(header.prompt_token_ids),
                                                header.lease_seconds, max(header.num_claims, 1))
            intake = self._intake(lease)
            response = await self._receive(lease, intake, request_iterator, arena)
            acknowledged = True
            return response
        except KVLoadError as err:
            if self.load_failure_policy == "recompute":
                logger.info("KV of request %s failed to load (%s); it will prefill here", lease.request_id,
                            err.message)
                return await self._drain(request_iterator)  # the finally releases the blocks
            self._metrics.kv_loaded("failed")
            await self._refuse(request_iterator, context, err)
        except StatusError as err:
            await self._refuse(request_iterator, context, err)
        finally:
            if lease is not None and not acknowledged:  # refused, cancelled, or an unexpected error
                await asyncio.shield(self._release(lease.request_id, intake))

    async def _release(self, request_id: str, intake: KVIntake | None) -> None:
        """The blocks of a push not acknowledged back to the pool, once no worker writes into them any more."""
        if intake is not None:
            with contextlib.suppress(Exception):
                await intake.settle()
        await self._handoff.release(request_id)

    async def _drain(self, request_iterator) -> kv_transfer_pb2.PushKVResponse:
        """Read the rest of a push whose KV will not be used, then acknowledge it as to be recomputed."""
        await _read_rest(request_iterator)
        return kv_transfer_pb2.PushKVResponse(recompute=True)

    async def _refuse(self, request_iterator, context, err: StatusError) -> None:
        """End the push with ``err``'s status once the sender has stopped writing (its trailer, or
        ``REFUSAL_DRAIN_S``): a status sent while the sender still writes races its next write, and gRPC's core may
        then end the call with its own write failure, so the sender would never learn why (a full pod's
        RESOURCE_EXHAUSTED would read as a broken link)."""
        logger.info("KV push refused: %s", err.message)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_read_rest(request_iterator), REFUSAL_DRAIN_S)
        await context.abort(err.code, err.message)

    async def _header(self, request_iterator) -> kv_transfer_pb2.KVTransferHeader:
        first = await anext(aiter(request_iterator), None)
        if first is None or _item(first) != "header":
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a KV push must start with its header")
        header = first.header
        if header.compat_hash != self.layout.compat_hash:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"compat_hash: sender {header.compat_hash!r}, "
                              f"receiver {self.layout.compat_hash!r} (handshake again)")
        if header.receiver_boot_id and header.receiver_boot_id != BOOT_ID:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, "this decode pod restarted since the sender's "
                              "handshake (boot id differs): handshake again")
        if not header.request_id or header.lease_seconds < 0:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              "a KV push header needs a request_id and lease_seconds >= 0")
        keeps_from, _ = self.layout.kept_from(len(header.prompt_token_ids))
        if header.first_token != keeps_from:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the push starts at prompt token {header.first_token}; this pod keeps the prompt's KV "
                              f"from token {keeps_from} on (its kv_window {self.layout.kv_window}, blocks of "
                              f"{self.layout.block_size}: handshake again)")
        return header

    def _intake(self, lease: KVLease) -> KVIntake:
        """Where the push's chunks go: the blocks ``KVHandoff.reserve`` took for its prompt."""
        layout = self.layout
        num_tokens = lease.seq.num_prompt_tokens
        return KVIntake(self._engine_loop, lease.seq, ExpectedChunks(
            lease.request_id, layout.num_layers, layout.num_kv_heads, layout.head_dim, num_tokens,
            frozenset(self.accepted_codecs), *layout.kept_from(num_tokens)),
            self._intake_workers)

    async def _receive(self, lease: KVLease, intake: KVIntake, request_iterator,
                       arena: memoryview | None) -> kv_transfer_pb2.PushKVResponse:
        async for push in request_iterator:
            if lease.abort_requested:  # the Abort RPC (KVHandoff.abort): the finally releases the blocks
                raise StatusError(grpc.StatusCode.CANCELLED, f"request {lease.request_id!r} was aborted")
            item = _item(push)
            if item == "chunk":
                await intake.store(with_shm_bytes(push, arena))
            else:
                await intake.settle()  # the chunks before it: their failure, if any, comes first
                if item == "trailer":
                    return self._complete(intake, push.trailer)
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a second header in one KV push")
        await intake.settle()
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the KV push ended without a trailer")

    def _complete(self, intake: KVIntake, trailer: kv_transfer_pb2.KVTransferTrailer) -> kv_transfer_pb2.PushKVResponse:
        intake.check_complete(trailer)
        lease_s = self._handoff.received(intake.expected.request_id)
        if intake.codec is not None:
            self._metrics.transfer_bytes(intake.codec).inc(intake.bytes_received)
        num_blocks = self._engine_loop.engine.block_manager.num_held_blocks(intake.seq)
        return kv_transfer_pb2.PushKVResponse(bytes_received=intake.bytes_received, num_blocks=num_blocks,
                                              lease_remaining_seconds=lease_s)


async def _read_rest(request_iterator) -> None:
    """Read a push's messages up to its trailer (or the stream's end), discarding them."""
    async for push in request_iterator:
        if _item(push) == "trailer":
            return


def _item(push: kv_transfer_pb2.KVPush | WireChunk) -> str:
    """What a message of the stream carries: "header", "chunk" or "trailer" (chunks come parsed as WireChunks)."""
    return "chunk" if isinstance(push, WireChunk) else push.WhichOneof("item")

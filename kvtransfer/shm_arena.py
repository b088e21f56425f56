"""The prefill pod's side of the same-host hand-off (kvtransfer/shm.py narrates the whole of it): ``ShmLinks``
chooses each decode pod's transport at the handshake and keeps each shared-memory link's ``ShmArena``, a file in the
decode pod's directory carved into spans; ``ShmPush`` frames one push's chunks into the arena and frees their spans
once the call is over.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from splitserve.kvtransfer.codecs.base import KVCodec, check_kv, dtype_name
from splitserve.kvtransfer.codecs.raw import RawCodec
from splitserve.kvtransfer.handshake import BOOT_ID
from splitserve.kvtransfer.shm import ARENA_PREFIX, TRANSPORT_GRPC, TRANSPORT_SHM, dir_id, host_id, sweep_stale
from splitserve.kvtransfer.wire import KIND_TO_PROTO, WireChunk, chunk_checksum, push_message
from splitserve.v1 import kv_transfer_pb2

logger = logging.getLogger(__name__)

DEFAULT_ARENA_BYTES = 1 << 30  # sparse: tmpfs allocates a page when it is first written
_ALIGN = 64  # span offsets, a cache line: copies in and out run at full width
_MIN_RESERVE = 64 << 20  # an arena's first allocation from the filesystem
SHM_MAX_CHUNK_BYTES = 16 << 20  # a chunk's cut through an arena; within transport.MAX_MESSAGE_BYTES / 2 inline
ARENA_RENEW_S = 600.0  # prefill side: an arena idle this long is replaced before its next push (its pages faulted anew)


# ---- the arena -------------------------------------------------------------------------------------------------

class ShmArena:
    """One link's shared-memory file, carved into spans (first fit) that live from a chunk's write to its push's end.
    Encoding threads place chunks while the event loop frees other pushes' spans: one lock guards the free list."""

    def __init__(self, directory: str, name: str, capacity: int):
        self.directory = directory
        self.name = name
        self.path = os.path.join(directory, name)
        # Made under a name no sweep looks at, locked, then renamed: an arena under its own name is always locked
        # while its prefill pod lives (the lock goes with the process), which is how sweep_stale tells leftovers.
        making = os.path.join(directory, f".{name}")
        self._fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(self._fd, capacity)
            self._map = mmap.mmap(self._fd, capacity)
            os.rename(making, self.path)
        except BaseException:
            os.close(self._fd)
            os.unlink(making)
            raise
        self._reserved = 0  # bytes from 0 the filesystem has allocated (posix_fallocate): safe to write
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)  # numpy copies release the GIL; mmap's do not
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted, neighbours merged
        self._spans: dict[int, int] = {}  # offset -> size of each span in use
        self._lock = threading.Lock()
        self._linked = True
        self.retired = False  # no new spans; closed once the last one is released
        self.last_used = time.monotonic()

    def place(self, chunk: WireChunk) -> tuple[bytes, int] | None:
        """Copy the chunk's payload and scales into a fresh span: the framed message pointing at it and the span's
        offset (to ``release`` after the push), or None when the arena has no room (send the bytes inline)."""
        payload, scales = (np.frombuffer(buffer, dtype=np.uint8) for buffer in (chunk.payload, chunk.scales))
        offset = self._alloc(len(payload) + len(scales))
        if offset is None:
            return None
        self._bytes[offset:offset + len(payload)] = payload
        self._bytes[offset + len(payload):offset + len(payload) + len(scales)] = scales
        fields = kv_transfer_pb2.KVChunk()
        fields.CopyFrom(chunk.fields)
        fields.shm.offset, fields.shm.payload_bytes, fields.shm.scales_bytes = offset, len(payload), len(scales)
        return push_message(WireChunk(fields, b"", b"")), offset

    def gather(self, parts: list[torch.Tensor], wire_dtype: torch.dtype) -> tuple[int, np.ndarray] | None:
        """The parts ([T_i, H, D] each, one token range in order) copied straight into a fresh span, converted to
        ``wire_dtype`` on the way: the one pass over their bytes on this side (no concatenation, no bytes object in
        between). The span's offset and a view of its bytes, or None when the arena has no room."""
        tokens, rest = sum(len(part) for part in parts), parts[0].shape[1:]
        nbytes = tokens * rest.numel() * wire_dtype.itemsize
        offset = self._alloc(nbytes)
        if offset is None:
            return None
        span = self._bytes[offset:offset + nbytes]
        target = torch.from_numpy(span).view(wire_dtype).view(tokens, *rest)
        row = 0
        for part in parts:
            target[row:row + len(part)].copy_(part)
            row += len(part)
        return offset, span

    def _alloc(self, nbytes: int) -> int | None:
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            if self.retired:
                return None
            self.last_used = time.monotonic()
            for i, (offset, free) in enumerate(self._free):
                if free >= size and self._reserve(offset + size):
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    self._spans[offset] = size
                    return offset
        return None

    def _reserve(self, end: int) -> bool:
        """Have the filesystem allocate the file up to ``end`` (at least doubling what it holds, within capacity), so
        that a full tmpfs is an error here (False: the chunk goes inline), never a SIGBUS on the copy."""
        if end <= self._reserved:
            return True
        grow_to = min(len(self._map), max(end, 2 * self._reserved, _MIN_RESERVE))
        try:
            os.posix_fallocate(self._fd, self._reserved, grow_to - self._reserved)
        except OSError as err:
            logger.warning("shared-memory arena %s cannot grow to %d bytes (%s): chunks go inline", self.path,
                           grow_to, err)
            return False
        self._reserved = grow_to
        return True

    def release(self, offsets: list[int]) -> None:
        """Return spans to the free list (their push is over), merging neighbours."""
        with self._lock:
            self._free = _merged(self._free + [(offset, self._spans.pop(offset)) for offset in offsets])
            close = self.retired and not self._spans
        if close:
            self._close()

    @property
    def spans_in_use(self) -> int:
        return len(self._spans)

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay valid): once the decode pod has mapped it, or at the end."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def retire(self) -> None:
        """No more pushes here (the link broke, was renewed, or the pod stops): unlink now, unmap once the pushes
        still writing into it are over."""
        self.unlink()
        with self._lock:
            self.retired = True
            close = not self._spans
        if close:
            self._close()

    def _close(self) -> None:
        del self._bytes
        self._map.close()
        os.close(self._fd)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for offset, size in sorted(spans):
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((offset, size))
    return out


class ShmPush:
    """One push's framing: each chunk placed in the link's arena (None: a gRPC link, every chunk inline), and the
    spans it took, all freed by ``release`` once the call is over. Chunks are framed on encoding threads, and one
    may finish after the push failed: its span then goes back at once. ``fault`` (fault injection only: the
    sender's ``corrupt_in_place``) may flip a byte of each span ``frame_raw`` placed, after its checksum, as a
    corrupted link would."""

    def __init__(self, arena: ShmArena | None, fault: Callable[[np.ndarray], None] | None = None):
        self.arena = arena
        self._fault = fault
        self._spans: list[int] | None = []  # None once released
        self._lock = threading.Lock()

    @property
    def transport(self) -> str:
        return TRANSPORT_SHM if self.arena is not None else TRANSPORT_GRPC

    def max_chunk_bytes(self, grpc_max: int) -> int:
        """How large a chunk to cut: larger through an arena, where a chunk costs a message and a hop of its own
        on each side whatever its size (a chunk that finds no room still fits a gRPC message inline)."""
        return max(grpc_max, SHM_MAX_CHUNK_BYTES) if self.arena is not None else grpc_max

    def frame(self, chunk: WireChunk) -> bytes:
        placed = self.arena.place(chunk) if self.arena is not None else None
        if placed is None:
            return push_message(chunk)
        message, offset = placed
        self._keep(offset)
        return message

    def frame_raw(self, request_id: str, layer: int, kind: str, tokens: tuple[int, int],
                  heads: tuple[int, int] | None, seq: int, parts: list[torch.Tensor], codec: KVCodec,
                  max_chunk_bytes: int) -> tuple[bytes, int] | None:
        """The chunk ``seq`` of a codec that sends the elements themselves (``none``, ``bf16``): ``layer``'s K or V
        (``kind``) of ``tokens`` [start, end) and KV ``heads`` (None: all), gathered from ``parts`` (in token order)
        straight into the arena, no encode pass. The checksum is taken over the span itself, as the decode pod will
        read it, right after the copy (its bytes still in cache), and so is the finite check a codec's encode
        makes. The framed message and the span's bytes; None (nothing placed) for other codecs, a gRPC link, more
        than ``max_chunk_bytes`` or a full arena: the caller encodes as usual."""
        if self.arena is None or not isinstance(codec, RawCodec):
            return None
        wire_dtype = codec.wire_dtype or parts[0].dtype
        if sum(part.numel() for part in parts) * wire_dtype.itemsize > max_chunk_bytes:
            return None
        placed = self.arena.gather(parts, wire_dtype)
        if placed is None:
            return None
        offset, span = placed
        try:
            check_kv(torch.from_numpy(span).view(wire_dtype).view(-1, *parts[0].shape[1:]), kind)
        except ValueError:
            self.arena.release([offset])
            raise
        chunk = kv_transfer_pb2.KVChunk(
            request_id=request_id, layer=layer, kind=KIND_TO_PROTO[kind], token_start=tokens[0], token_end=tokens[1],
            seq=seq, codec=codec.name, dtype=dtype_name(parts[0].dtype), crc32c=chunk_checksum(span, b""),
            shape=[tokens[1] - tokens[0], *parts[0].shape[1:]])
        if heads is not None:
            chunk.heads.start, chunk.heads.end = heads
        chunk.shm.offset, chunk.shm.payload_bytes, chunk.shm.scales_bytes = offset, len(span), 0
        if self._fault is not None:
            self._fault(span)
        self._keep(offset)
        return push_message(WireChunk(chunk, b"", b"")), len(span)

    def _keep(self, offset: int) -> None:
        """The span at ``offset`` belongs to this push until ``release``; at once back if the push is over already."""
        with self._lock:
            late = self._spans is None
            if not late:
                self._spans.append(offset)
        if late:
            self.arena.release([offset])

    def acknowledged(self) -> None:
        """The decode pod took the push, so it has mapped the arena: its name can go."""
        if self.arena is not None:
            self.arena.unlink()

    def release(self) -> None:
        with self._lock:
            spans, self._spans = self._spans, None
        if spans:
            self.arena.release(spans)


class ShmLinks:
    """The prefill pod's shared-memory links: which decode pods get KV through an arena, and the arena of each."""

    def __init__(self, enabled: bool = True, arena_bytes: int = DEFAULT_ARENA_BYTES, boot_id: str = ""):
        self.enabled = enabled
        self.arena_bytes = arena_bytes
        self._boot_id = boot_id or BOOT_ID
        self._host_id = host_id()
        self._arenas: dict[str, ShmArena] = {}  # decode address -> its link's arena

    @property
    def host_id(self) -> str:
        return self._host_id

    def choose(self, decode_address: str, response: kv_transfer_pb2.HandshakeResponse) -> str:
        """After a handshake with ``decode_address``: TRANSPORT_SHM (an arena made for the link) when the decode
        pod is on this host and offers a directory this pod sees too, else TRANSPORT_GRPC."""
        self.forget(decode_address)
        same_host = self.enabled and self._host_id and response.host_id == self._host_id
        if not (same_host and response.shm_dir and dir_id(response.shm_dir) == response.shm_dir_id):
            return TRANSPORT_GRPC
        arena = self._new_arena(decode_address, response.shm_dir)
        return TRANSPORT_SHM if arena is not None else TRANSPORT_GRPC

    def arena(self, decode_address: str) -> ShmArena | None:
        """The link's arena for a new push (renewed when idle for ARENA_RENEW_S), None for a gRPC link."""
        arena = self._arenas.get(decode_address)
        if arena is not None and time.monotonic() - arena.last_used > ARENA_RENEW_S:
            arena.retire()
            arena = self._new_arena(decode_address, arena.directory)
        return arena

    def transport(self, decode_address: str) -> str:
        return TRANSPORT_SHM if decode_address in self._arenas else TRANSPORT_GRPC

    def _new_arena(self, decode_address: str, directory: str) -> ShmArena | None:
        sweep_stale(directory)
        try:
            arena = ShmArena(directory, f"{ARENA_PREFIX}{self._boot_id}-{uuid.uuid4().hex}", self.arena_bytes)
        except OSError as err:
            logger.warning("no shared-memory arena in %s for decode pod %s (%s): KV goes over gRPC", directory,
                           decode_address, err)
            self._arenas.pop(decode_address, None)
            return None
        self._arenas[decode_address] = arena
        return arena

    def forget(self, decode_address: str) -> None:
        """The link broke or its peer changed: its arena goes (once the pushes writing into it are over)."""
        arena = self._arenas.pop(decode_address, None)
        if arena is not None:
            arena.retire()

    def close(self) -> None:
        for address in list(self._arenas):
            self.forget(address)

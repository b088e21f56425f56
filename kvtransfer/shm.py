"""Same-host KV hand-off: a push's chunk bytes go through a shared-memory file, its messages still over gRPC.

Two pods on one machine need not copy KV through a socket: the prefill pod writes each encoded chunk into a file in a
directory both pods see (``/dev/shm`` by default, a memory-backed tmpfs), and the ``PushKV`` stream carries the same
``KVChunk`` messages as over gRPC, but with a ``KVShmSpan`` (offset, sizes) where the payload and scales would be.
Everything else is the gRPC path's: the handshake, the header (request, compat hash, lease, boot ids), sequence
numbers, the CRC-32C the decode pod verifies before decoding, the trailer, the acknowledgement, the lease.

Choosing the transport, once per link, at the handshake (``ShmLinks.choose``, prefill side):

    decode pod's HandshakeResponse   host_id (its kernel's boot id), shm_dir and shm_dir_id ("device:inode"),
                                     empty shm_dir when it takes KV over gRPC only (--kv-shm-dir "")
    prefill pod                      same host_id, and its own stat of shm_dir gives the same shm_dir_id (the two
                                     pods see one directory, not two tmpfs mounts of one name) -> a ShmArena for
                                     the link; otherwise, or with --kv-transport grpc, plain gRPC

A push's path over shared memory:

    prefill pod   ShmArena: one file per (prefill pod, decode pod's boot), created in the decode pod's shm_dir,
                  mapped once and reused by every push on the link, so its pages are faulted in once (a fresh page
                  of tmpfs costs more than the copy into it)
                  header names the arena; for each chunk, encoded and checksummed as for gRPC: ShmArena.place
                    -> a span allocated in the arena, payload and scales copied in -> KVPush{chunk, shm span}
                    (a full arena: the chunk carries its bytes inline, as over gRPC)
                  the call over (acknowledged or failed): the push's spans are freed; nothing is reused before
                  the decode pod is done with it. After the first acknowledgement the file's name is unlinked: the
                  decode pod holds its own mapping by then, so a crash of either pod leaves nothing in shm_dir
    decode pod    ShmArenaViews.open(name) maps the arena once; a chunk's span -> read-only views of its payload and
                  scales (with_shm_bytes) -> the same decode_chunk, checksum first (DATA_LOSS), then the one copy
                  into the paged cache

A restarted decode pod has a new boot id: its first push fails the header's boot-id check (or the link broke),
the prefill pod forgets the handshake and the link's arena, and the next handshake makes a new arena. A mapping the
decode pod has not used for ``ARENA_IDLE_S`` is dropped (its prefill pod may be gone); the prefill pod replaces an
arena idle for ``ARENA_RENEW_S`` before using it again, so it never names one the decode pod dropped. A prefill pod
killed before any push on a link was acknowledged leaves its arena's name behind: every arena is locked (flock) while
its prefill pod lives, and ``sweep_stale`` (a decode pod's start, every new arena) unlinks the unlocked ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import threading
import time
import uuid
from pathlib import Path

import grpc
import numpy as np

from splitserve.kvtransfer.handshake import BOOT_ID
from splitserve.kvtransfer.wire import WireChunk, push_message
from splitserve.runtime.errors import StatusError
from splitserve.v1 import kv_transfer_pb2

logger = logging.getLogger(__name__)

HOST_ID_FILE = Path("/proc/sys/kernel/random/boot_id")  # one value per machine and boot, the same in containers
DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_ARENA_BYTES = 1 << 30  # sparse: tmpfs allocates a page when it is first written
ARENA_PREFIX = "splitserve-kv-"
_ARENA_NAME = re.compile(rf"^{ARENA_PREFIX}[0-9a-f]{{32}}-[0-9a-f]{{32}}$")
_ALIGN = 64  # span offsets, a cache line: copies in and out run at full width
_MIN_RESERVE = 64 << 20  # an arena's first allocation from the filesystem
SHM_MAX_CHUNK_BYTES = 16 << 20  # a chunk's cut through an arena; within transport.MAX_MESSAGE_BYTES / 2 inline
ARENA_RENEW_S = 600.0  # prefill side: an arena idle this long is replaced before its next push (its pages faulted anew)
ARENA_IDLE_S = 1800.0  # decode side: a mapping idle this long is dropped (a dead prefill pod's memory goes)
TRANSPORT_GRPC, TRANSPORT_SHM = "grpc", "shm"


def host_id() -> str:
    """This machine's identity (its kernel's boot id), "" where unknown: then no link is taken for same-host."""
    try:
        return HOST_ID_FILE.read_text().strip()
    except OSError:
        return ""


def dir_id(directory: str) -> str:
    """"device:inode" of ``directory``, "" when it is not a directory: equal ids, the same directory."""
    try:
        st = os.stat(directory)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}" if os.path.isdir(directory) else ""


# ---- prefill side -------------------------------------------------------------------------------------------------

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
    may finish after the push failed: its span then goes back at once."""

    def __init__(self, arena: ShmArena | None):
        self.arena = arena
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
        with self._lock:
            late = self._spans is None
            if not late:
                self._spans.append(offset)
        if late:
            self.arena.release([offset])
        return message

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


# ---- decode side --------------------------------------------------------------------------------------------------

class _Mapping:
    def __init__(self, path: str):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.last_used = time.monotonic()


def sweep_stale(directory: str) -> list[str]:
    """Unlink the arenas in ``directory`` whose prefill pod is gone (killed before the decode pod mapped them, so
    nobody unlinked them): an arena's lock lives as long as its prefill pod. The names removed."""
    removed = []
    for name in os.listdir(directory):
        if not _ARENA_NAME.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # unlinked meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its prefill pod holds it
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(name)
    if removed:
        logger.info("removed %d shared-memory arena(s) of prefill pods gone from %s", len(removed), directory)
    return removed


class ShmArenaViews:
    """The decode pod's side: its shared directory (offered at the handshake) and the arenas it has mapped there;
    at start it sweeps the arenas of prefill pods gone."""

    def __init__(self, directory: str):
        self.directory = directory  # "": KV over gRPC only
        self._host_id = host_id()
        self._mapped: dict[str, _Mapping] = {}
        if directory:
            sweep_stale(directory)

    def handshake_fields(self) -> dict[str, str]:
        """What the HandshakeResponse says of this pod's host and shared directory."""
        directory_id = dir_id(self.directory) if self.directory else ""
        return {"host_id": self._host_id, "shm_dir": self.directory if directory_id else "",
                "shm_dir_id": directory_id}

    def open(self, name: str) -> memoryview:
        """The arena ``name`` a push's header names, mapped once; FAILED_PRECONDITION (the sender handshakes
        again) when this pod takes no shared memory or the arena is not there."""
        mapping = self._mapped.get(name)
        if mapping is None:
            if not self.directory or not _ARENA_NAME.match(name):
                raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"shared-memory arena {name!r}: not taken "
                                  "here (handshake again)")
            self._drop_idle()
            try:
                mapping = _Mapping(os.path.join(self.directory, name))
            except (OSError, ValueError) as err:
                raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"shared-memory arena {name!r}: {err} "
                                  "(handshake again)") from err
            self._mapped[name] = mapping
        mapping.last_used = time.monotonic()
        return memoryview(mapping.map)

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for name, mapping in list(self._mapped.items()):
            if now - mapping.last_used > ARENA_IDLE_S:
                self._unmap(name)

    def _unmap(self, name: str) -> None:
        mapping = self._mapped.pop(name)
        try:
            mapping.map.close()
        except BufferError:  # a chunk's tensor still views it: unmapped when the last view goes
            pass

    @property
    def num_mapped(self) -> int:
        return len(self._mapped)

    def close(self) -> None:
        for name in list(self._mapped):
            self._unmap(name)


def with_shm_bytes(chunk: WireChunk, arena: memoryview | None) -> WireChunk:
    """A received chunk with its payload and scales: its own, or read-only views of the push's arena at its span
    (INVALID_ARGUMENT for a span without an arena or past its end). The checksum is verified afterwards, as for any
    chunk, by decode_chunk."""
    if not chunk.fields.HasField("shm"):
        return chunk
    span = chunk.fields.shm
    end = span.offset + span.payload_bytes + span.scales_bytes
    if arena is None or end > len(arena) or len(chunk.payload) or len(chunk.scales):
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"chunk {chunk.fields.seq}: shared-memory span [{span.offset}, {end}) "
                          + ("without an arena in the header" if arena is None else
                             f"past the arena's {len(arena)} bytes" if end > len(arena) else "beside inline bytes"))
    middle = span.offset + span.payload_bytes
    return WireChunk(chunk.fields, arena[span.offset:middle], arena[middle:end])

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

    prefill pod   ShmArena (kvtransfer/shm_arena.py, with ShmPush and ShmLinks): one file per (prefill pod, decode
                  pod's boot), created in the decode pod's shm_dir, mapped once and reused by every push on the
                  link, so its pages are faulted in once (a fresh page of tmpfs costs more than the copy into it)
                  header names the arena; for each chunk of a codec that sends the elements themselves (none,
                  bf16): ShmPush.frame_raw -> the layer's K (then V) gathered from its held parts straight into a
                  span (one copy, converted to the wire dtype on the way: no concatenation, no encode pass), the
                  finite check and the CRC-32C then over the span itself -> KVPush{chunk, shm span}; other codecs:
                  encoded and checksummed as for gRPC, then ShmArena.place copies payload and scales into a span
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
import stat
import time
from pathlib import Path

import grpc

from splitserve.kvtransfer.wire import WireChunk
from splitserve.runtime.errors import StatusError

logger = logging.getLogger(__name__)

HOST_ID_FILE = Path("/proc/sys/kernel/random/boot_id")  # one value per machine and boot, the same in containers
DEFAULT_SHM_DIR = "/dev/shm"
ARENA_PREFIX = "splitserve-kv-"
ARENA_NAME = re.compile(rf"^{ARENA_PREFIX}[0-9a-f]{{32}}-[0-9a-f]{{32}}$")
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
    return f"{st.st_dev}:{st.st_ino}" if stat.S_ISDIR(st.st_mode) else ""  # the one stat, not a second isdir


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
        if not ARENA_NAME.match(name):
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
            if not self.directory or not ARENA_NAME.match(name):
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

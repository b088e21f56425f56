"""All-reduce through shared memory, for the ranks of one pod on one host: what makes tensor parallelism pay on CPUs.

gloo's all-reduce goes through loopback TCP: ~150-200 us for a decode step's few KiB here (docs/PERFORMANCE.md),
and a step runs two per layer. Ranks on one host can instead meet in a shared mapping, as vLLM's CPU backend does:

    [flags: one int64 per rank, a cache line each][region 0: one slot per rank][region 1: one slot per rank]

Call ``n`` of ``all_reduce`` uses region ``n % 2``: each rank copies its tensor into its slot, then publishes ``n``
in its flag; once every flag reads ``n`` it sums the slots, in rank order (so every rank gets the same bits), into its
tensor. A rank can only write region ``n % 2`` again at call ``n + 2``, after every rank has published ``n + 1``,
that is after every rank has finished reading call ``n``: two regions need no second barrier. A tensor larger than
a slot goes through in pieces, each a call. A rank that never arrives fails the wait after ``timeout_s``, or at once
where ``watch`` (rank 0's check of its workers' processes) sees it gone.

The order of the stores matters: a rank's data must be visible before its flag. x86-64 keeps stores in program
order (TSO), and loads too, so plain stores and loads suffice there; ``available()`` is false on other machines,
and the group uses gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

SLOT_BYTES = 256 << 10  # per rank and region: a decode step's rows in one piece, a prefill chunk in a few
_FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each, so ranks' flags never share a line
_SPIN = 2000  # polls before yielding the core (a rank's peers are usually microseconds behind)


def available() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def mapping_bytes(size: int) -> int:
    return size * _FLAG_STRIDE * 8 + 2 * size * SLOT_BYTES


def create_mapping(size: int) -> str:
    """A new zeroed file in /dev/shm for ``size`` ranks; its path (the creator unlinks it once all have mapped it)."""
    path = f"/dev/shm/splitserve-tp-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, mapping_bytes(size))
    finally:
        os.close(fd)
    return path


class ShmAllReduce:
    """Rank ``rank`` of ``size`` over the mapping at ``path``."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float):
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, mapping_bytes(size))
        finally:
            os.close(fd)
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        buffer = np.frombuffer(self._map, dtype=np.uint8)
        flag_bytes = size * _FLAG_STRIDE * 8
        self._flags = buffer[:flag_bytes].view(np.int64)[::_FLAG_STRIDE]  # [size]
        slots = torch.from_numpy(buffer[flag_bytes:]).view(torch.float32)
        self._slots = slots.view(2, size, SLOT_BYTES // 4)  # [region, rank, float32s]
        self._calls = 0
        self.watch: Callable[[], None] | None = None  # raises when a peer is known to be gone (rank 0 sets it)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum float32 ``t`` over the ranks, in place."""
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
        piece = SLOT_BYTES // 4
        for start in range(0, flat.numel(), piece):
            self._reduce_piece(flat[start:start + piece])
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view_as(t))

    def _reduce_piece(self, piece: torch.Tensor) -> None:
        self._calls += 1
        n, region = len(piece), self._slots[self._calls % 2]
        region[self.rank, :n].copy_(piece)
        self._flags[self.rank] = self._calls  # after the data (x86 stores stay in order)
        self._wait_for(self._calls)
        piece.copy_(region[0, :n])
        for rank in range(1, self.size):
            piece.add_(region[rank, :n])

    def _wait_for(self, call: int) -> None:
        polls, deadline = 0, None
        while self._flags.min() < call:
            polls += 1
            if polls % _SPIN == 0:
                os.sched_yield()
                if self.watch is not None:
                    self.watch()
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    late = [r for r in range(self.size) if self._flags[r] < call]
                    raise RuntimeError(f"shared-memory all-reduce: ranks {late} did not arrive within "
                                       f"{self.timeout_s:.0f} s")

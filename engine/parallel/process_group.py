"""A pod's tensor-parallel process group: gloo over loopback TCP and a shared-memory all-reduce, its collectives,
and their volume.

The ranks meet at a ``torch.distributed.TCPStore`` that rank 0 opens on a free loopback port. The group is a
``ProcessGroupGloo`` of its own, not torch's default group, so that an engine leaves the process's global
``torch.distributed`` state alone (two engines may live in one process, as in the tests). On x86-64 the all-reduces
go through shared memory instead (shm_all_reduce.py: microseconds where gloo takes ~200 us); the logits' gather stays
on gloo.

The collectives a step runs: one ``all_reduce`` after each row-parallel product (two per layer) and after the
vocabulary-parallel embedding lookup, and one ``gather`` of the logits to rank 0. (KV read or written from outside
the engine takes none: rank 0 maps every rank's pool, sharded_kv_cache.py.) ``CollectiveCounts`` adds up their
calls, bytes and seconds, which the benchmark reads (bench/tp.py).

CPU tensors only: NCCL, for CUDA devices, is not built yet (``check_device`` refuses them).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from splitserve.engine.parallel import shm_all_reduce
from splitserve.engine.parallel.shm_all_reduce import ShmAllReduce

# A collective that waits longer than this fails: a rank that hangs or died ends the step with an error, not a hang.
COLLECTIVE_TIMEOUT_S = 120.0


def check_device(device: str) -> None:
    if torch.device(device).type != "cpu":
        raise ValueError(f"tensor_parallel_size > 1 runs on CPU devices (gloo); device {device!r} would need NCCL, "
                         "which is not built yet")


def open_store(rank: int, size: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 opens the store (``port`` 0: a free one, ``store.port``); the others connect to ``port``."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    return dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout, wait_for_workers=False)


@dataclass
class CollectiveCounts:
    """What the group's collectives moved since the counts were last reset: bytes are each rank's payload."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class TensorParallelGroup:
    """Rank ``rank`` of ``size`` in the group that meets at ``store``."""

    def __init__(self, store: dist.Store, rank: int, size: int):
        self.rank, self.size = rank, size
        self.counts = CollectiveCounts()
        self._shm: ShmAllReduce | None = None
        if shm_all_reduce.available():
            path = shm_all_reduce.create_mapping(size) if rank == 0 else store.get("tp/shm").decode()
            if rank == 0:
                store.set("tp/shm", path)
            self._shm = ShmAllReduce(path, rank, size, COLLECTIVE_TIMEOUT_S)
        try:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            # Joining is a rendezvous: once it returns, every rank has mapped the shared memory.
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, options)
        finally:
            if rank == 0 and self._shm is not None:
                os.unlink(path)  # the mappings stay; nothing is left in /dev/shm when the ranks exit

    def watch(self, check: Callable[[], None]) -> None:
        """Have waits for the other ranks call ``check``, which raises when one is gone (gloo's own collectives fail
        when a peer's connection closes)."""
        if self._shm is not None:
            self._shm.watch = check

    @property
    def all_reduce_transport(self) -> str:
        return "shm" if self._shm is not None else "gloo"

    def all_reduce(self, t: torch.Tensor, counted: bool = True, transport: str = "auto") -> None:
        """Sum ``t`` over the ranks, in place: through shared memory where it is available and ``t`` is float32
        (``transport`` "gloo": through gloo regardless, for the benchmark's comparison)."""
        started = time.perf_counter()
        if self._shm is not None and t.dtype == torch.float32 and transport == "auto":
            self._shm.all_reduce(t)
        else:
            self._pg.allreduce([t]).wait()
        if counted:
            self._count(t.numel() * t.element_size(), started)

    def all_to_all_rows(self, t: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """``t``'s rows in runs of ``counts`` (one per rank, in order) to those ranks: the rows every rank sent here,
        in rank order, and how many came from each (gloo's all-to-all, counted)."""
        started = time.perf_counter()
        received = torch.empty(self.size, dtype=torch.long)
        self._pg.alltoall_base(received, torch.tensor(counts), [], [], dist.AllToAllOptions()).wait()
        came = received.tolist()
        out = t.new_empty((sum(came), *t.shape[1:]))
        self._pg.alltoall_base(out, t.contiguous(), came, counts, dist.AllToAllOptions()).wait()
        self._count(t.numel() * t.element_size(), started)
        return out, came

    def all_gather_rows(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's ``t`` [sizes[its rank], ...] concatenated in rank order, on every rank (smaller ones travel
        padded to the largest: gloo gathers equal shapes; counted)."""
        started = time.perf_counter()
        width = max(sizes)
        padded = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, width - len(t))).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._pg.allgather([parts], [padded]).wait()
        self._count(padded.numel() * padded.element_size(), started)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    def gather(self, t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor] | None:
        """Every rank's ``t`` [N, sizes[its rank], ...] on rank 0, in rank order (None on the others): the logits of
        each rank's vocabulary rows. Smaller ones travel padded to the largest (gloo gathers equal shapes)."""
        started = time.perf_counter()
        width = max(sizes)
        padded = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._pg.gather([parts] if parts else [], [padded], options).wait()
        self._count(padded.numel() * padded.element_size(), started)
        return [part[:, :size] for part, size in zip(parts, sizes)] if self.rank == 0 else None

    def send(self, t: torch.Tensor, to: int):
        """Start sending ``t`` to rank ``to`` (a pipeline's rows to its next stage); the returned work's ``wait``
        ends it, and ``t`` must live until then."""
        self.counts.calls += 1
        self.counts.bytes += t.numel() * t.element_size()
        return self._pg.send([t], to, 0)

    def recv(self, t: torch.Tensor, source: int) -> None:
        """Receive into ``t`` what rank ``source`` sends (its shape and dtype)."""
        started = time.perf_counter()
        self._pg.recv([t], source, 0).wait()
        self.counts.seconds += time.perf_counter() - started

    def _count(self, nbytes: int, started: float) -> None:
        self.counts.calls += 1
        self.counts.bytes += nbytes
        self.counts.seconds += time.perf_counter() - started

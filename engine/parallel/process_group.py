"""A pod's tensor-parallel process group: gloo over loopback TCP, its collectives, and their volume.

The ranks meet at a ``torch.distributed.TCPStore`` that rank 0 opens on a free loopback port. The group is a
``ProcessGroupGloo`` of its own, not torch's default group, so that an engine leaves the process's global
``torch.distributed`` state alone (two engines may live in one process, as in the tests).

The collectives a step runs: one ``all_reduce`` after each row-parallel product (two per layer) and after the
vocabulary-parallel embedding lookup, and one ``gather_vocab`` of the logits to rank 0. ``CollectiveCounts`` adds up
their calls, bytes and seconds, which the benchmark reads (bench/tp.py).

CPU tensors only: NCCL, for CUDA devices, is not built yet (``check_device`` refuses them).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, options)
        self.rank, self.size = rank, size
        self.counts = CollectiveCounts()

    def all_reduce(self, t: torch.Tensor, counted: bool = True) -> None:
        """Sum ``t`` over the ranks, in place."""
        started = time.perf_counter()
        self._pg.allreduce([t]).wait()
        if counted:
            self._count(t.numel() * t.element_size(), started)

    def gather_vocab(self, logits: torch.Tensor, vocab: list[tuple[int, int]]) -> torch.Tensor | None:
        """Each rank's logits [N, its vocabulary rows] -> the full [N, V] on rank 0 (None on the others).
        ``vocab``: every rank's [start, end) rows; slices of unequal size travel padded to the largest."""
        started = time.perf_counter()
        width = max(b - a for a, b in vocab)
        padded = torch.nn.functional.pad(logits, (0, width - logits.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._pg.gather([parts] if parts else [], [padded], options).wait()
        self._count(padded.numel() * padded.element_size(), started)
        if self.rank != 0:
            return None
        return torch.cat([part[:, : b - a] for part, (a, b) in zip(parts, vocab)], dim=1)

    def _count(self, nbytes: int, started: float) -> None:
        self.counts.calls += 1
        self.counts.bytes += nbytes
        self.counts.seconds += time.perf_counter() - started

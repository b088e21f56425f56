"""Core lending: a prefill pod computes on a decode pod's CPUs while that pod has nothing to decode.

On one machine the phase split leaves a decode pod's cores idle between its requests while prompts queue on the
prefill pod's. With lending on (``splitserve up --lend-decode-cpus``) each decode pod publishes, after every step
and every admission, how many requests it holds (``DecodeActivity``, one 4-byte counter in a small shared file),
and the prefill pod reads those counters before each engine step (``CoreLender``): with every lending pod idle
the step runs on its own CPUs *and* the lent ones (one torch thread per CPU), else on its own CPUs alone. The
decode pod's requests therefore never share their CPU with a prefill step begun after they arrived; a step
already running when one arrives finishes on both (one prefill chunk, bounded by ``--long-prefill-token-threshold``),
and the lent threads run at the lowest priority (nice 19), so the decode pod's threads take the CPU from them
whenever both are runnable.

The threads: the pod's process stays pinned to its own CPUs (gRPC, asyncio, logging never touch a lent CPU). The
engine thread widens its own affinity, starts torch's OpenMP team at full size (the workers inherit the wide
affinity), then narrows itself back to its own CPUs and lowers the workers' priority. Each step then only sets
torch's thread count (``torch.set_num_threads`` on the engine thread, which the native kernels read too).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from runtime.cpus import format_cpu_list

log = logging.getLogger(__name__)

_COUNTER = struct.Struct("<I")
LENT_THREAD_NICE = 19  # the lent CPUs' workers yield to anything else runnable there (the decode pod)


class DecodeActivity:
    """One pod's count of held requests in a shared file: written by the pod, read by the pods it lends CPUs to.

    A missing or short file reads as busy: a prefill pod never takes a CPU whose owner it cannot hear from."""

    def __init__(self, path: str | Path, writer: bool = False):
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        self._last = -1
        if writer:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as f:
                f.write(_COUNTER.pack(0))
            self._open(write=True)

    def _open(self, write: bool) -> bool:
        try:
            with open(self.path, "r+b" if write else "rb") as f:
                self._map = mmap.mmap(f.fileno(), _COUNTER.size,
                                      access=mmap.ACCESS_WRITE if write else mmap.ACCESS_READ)
        except (OSError, ValueError):
            return False
        return True

    def publish(self, held: int) -> None:
        """Write ``held`` (writer side; called on the engine thread, so cheap when nothing changed)."""
        if held != self._last:
            _COUNTER.pack_into(self._map, 0, held)
            self._last = held

    def held(self) -> int | None:
        """The owner's last published count; None while the file cannot be read."""
        if self._map is None and not self._open(write=False):
            return None
        return _COUNTER.unpack_from(self._map, 0)[0]

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class CoreLender:
    """Sizes each engine step's torch threads: ``own`` CPUs always, plus ``lent`` while every owner is idle."""

    def __init__(self, own: frozenset[int], lent: frozenset[int], owners: Sequence[DecodeActivity]):
        if not own or not lent or own & lent:
            raise ValueError(f"lending needs own CPUs and disjoint lent CPUs, got own {format_cpu_list(own)}, "
                             f"lent {format_cpu_list(lent)}")
        if not owners:
            raise ValueError("lending needs the activity files of the pods that own the lent CPUs")
        self.own, self.lent, self.owners = own, lent, list(owners)
        self.threads = len(own)

    def wanted_threads(self) -> int:
        idle = all(owner.held() == 0 for owner in self.owners)
        return len(self.own) + len(self.lent) if idle else len(self.own)

    def start_on_engine_thread(self) -> None:
        """Set up the engine thread and torch's OpenMP team (see the module docstring). Call it on the engine
        thread, before its first step."""
        wide = self.own | self.lent
        os.sched_setaffinity(0, wide)
        before = _thread_ids()
        torch.set_num_threads(len(wide))
        _start_team()
        workers = _thread_ids() - before - {threading.get_native_id()}
        os.sched_setaffinity(0, self.own)
        for tid in workers:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, LENT_THREAD_NICE)
            except OSError as error:  # the thread ended meanwhile: nothing to lower
                log.debug("could not lower thread %d's priority: %r", tid, error)
        torch.set_num_threads(self.threads)
        log.info("core lending: steps run on CPUs %s, and on %s too while the decode pods there are idle "
                 "(%d lent thread(s) at nice %d)", format_cpu_list(self.own), format_cpu_list(self.lent),
                 len(workers), LENT_THREAD_NICE)

    def before_step(self) -> bool:
        """Size the coming step's threads; True when it runs on the lent CPUs too."""
        threads = self.wanted_threads()
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads > len(self.own)


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _start_team() -> None:
    """One parallel op large enough for torch to split over every thread, which starts OpenMP's workers."""
    x = torch.ones(1 << 20)
    torch.add(x, x, out=x)

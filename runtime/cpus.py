"""CPU sets: which cores a process runs on, and how many compute threads it starts there.

A CPU set is written as Linux writes it (``taskset -c``, ``/proc/<pid>/status``): ``"0-3,6"``, ``"1"``.

    parse_cpu_list("0-3,6")            -> frozenset({0, 1, 2, 3, 6}); ValueError for anything else
    format_cpu_list({0, 1, 2, 6})      -> "0-2,6"
    checked_cpu_set(field, text)       the set, or a ValueError naming the config field when it is malformed or not
                                       a subset of the CPUs this process may run on (``os.sched_getaffinity``)
    apply_cpu_set(text, num_threads)   at process start: pin every thread of the process to the set and size
                                       torch's thread pools to it (or to ``num_threads`` when given); logs both
    thread_env(threads)                the environment that sizes OpenMP / MKL before torch is imported (for a child)

Without a set, threads default to one per core of the machine, so pods sharing a machine oversubscribe its cores:
each runs as many compute threads as there are cores, and they preempt each other mid-GEMM. A pod pinned to its set
with one thread per CPU of the set runs alone on its cores. The native kernels (engine/cpu_kernels.py) take their
thread count from ``torch.get_num_threads()`` and their OpenMP is torch's libgomp, so they follow the same setting.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}. Raises ValueError for an empty, malformed or descending list."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (expected e.g. '0-3,6')")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{text!r} is not a CPU list: range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 6} -> ``"0-2,6"``."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset also narrows)."""
    return frozenset(os.sched_getaffinity(0))


def checked_cpu_set(field_name: str, text: str) -> frozenset[int]:
    """``text`` as a CPU set, or a ValueError naming ``field_name``; ``""`` is the empty set (leave as is)."""
    if not text.strip():
        return frozenset()
    try:
        cpus = parse_cpu_list(text)
    except ValueError as err:
        raise ValueError(f"{field_name}: {err}") from None
    allowed = allowed_cpus()
    if not cpus <= allowed:
        raise ValueError(f"{field_name}: CPU {format_cpu_list(cpus - allowed)} of {text!r} is not one this process "
                         f"may run on ({format_cpu_list(allowed)})")
    return cpus


@dataclass(frozen=True)
class AppliedCpus:
    cpus: frozenset[int]  # the process's affinity after apply_cpu_set
    threads: int  # torch.get_num_threads() after apply_cpu_set (0: torch not used)


def apply_cpu_set(text: str, num_threads: int = 0, *, field_name: str = "cpus", torch_threads: bool = True
                  ) -> AppliedCpus:
    """Pin this process to the CPU set ``text`` (``""``: leave the affinity as it is) and give torch one compute
    thread per CPU of the set, or ``num_threads`` when that is > 0. Call it before any torch work: a thread
    reads torch's thread count at its first parallel op and keeps it (``torch_threads=False``: a process that
    computes nothing with torch, the router)."""
    cpus = checked_cpu_set(field_name, text)
    if cpus:
        _pin_every_thread(cpus)
    threads = num_threads or len(cpus)
    if torch_threads:
        import torch  # here, not at the top: the router pins itself without importing torch

        if threads:
            torch.set_num_threads(threads)
            try:
                torch.set_num_interop_threads(threads)
            except RuntimeError:  # allowed once, before any inter-op work; the intra-op threads are what count
                pass
        threads = torch.get_num_threads()
    applied = AppliedCpus(allowed_cpus(), threads if torch_threads else 0)
    log.info("CPUs %s%s, %s", format_cpu_list(applied.cpus), "" if cpus else " (not pinned)",
             f"{applied.threads} torch threads" if torch_threads else "no torch threads")
    return applied


def _pin_every_thread(cpus: frozenset[int]) -> None:
    """``sched_setaffinity(0)`` pins only the calling thread; threads started before (torch's import starts one,
    gRPC its pollers) keep their mask. So pin each thread the process has now; threads started later inherit the
    mask of the thread that starts them."""
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no /proc: this thread, and those it starts
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def thread_env(threads: int) -> dict[str, str]:
    """Environment for a child that will import torch: OpenMP and MKL size their pools from it at load, before the
    child's own ``apply_cpu_set`` runs."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}

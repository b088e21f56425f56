"""CPU sets: which cores a process runs on, and how many compute threads it starts there.

A CPU set is written as Linux writes it (``taskset -c``, ``/proc/<pid>/status``): ``"0-3,6"``, ``"1"``.

    parse_cpu_list("0-3,6")            -> frozenset({0, 1, 2, 3, 6}); ValueError for anything else
    format_cpu_list({0, 1, 2, 6})      -> "0-2,6"
    checked_cpu_set(field, text)       the set, or a ValueError naming the config field when it is malformed or not
                                       a subset of the CPUs this process may run on (``os.sched_getaffinity``)
    pin_cpu_set(text)                  at process start: pin every thread of the process to the set (the router;
                                       a pod's ``splitserve.runtime.torch_threads.apply_cpu_set`` also sizes
                                       torch's pools)
    thread_env(threads)                the environment that sizes OpenMP / MKL before torch is imported (for a child)

Without a set, threads default to one per core of the machine, so pods sharing a machine oversubscribe its cores: each
runs as many compute threads as there are cores, and they preempt each other mid-GEMM. A pod pinned to its set with one
thread per CPU of the set runs alone on its cores. The native kernels (engine/kernels/cpu_kernels.py) take their thread
count from ``torch.get_num_threads()`` and their OpenMP is torch's libgomp, so they follow the same setting.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

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


def pin_cpu_set(text: str, field_name: str = "cpus") -> frozenset[int]:
    """Pin every thread of this process to the CPU set ``text`` (``""``: leave the affinity as it is); returns the
    set (empty: not pinned). Without torch: the router pins itself with it, and ``splitserve.runtime.torch_threads``'s
    ``apply_cpu_set`` pins a pod with it before sizing torch's thread pools to the set."""
    cpus = checked_cpu_set(field_name, text)
    if cpus:
        _pin_every_thread(cpus)
    return cpus


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
    child's own ``apply_cpu_set`` (runtime/torch_threads.py) runs."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}

"""A pod's CPU set with torch sized to it: ``apply_cpu_set(text, num_threads)`` pins every thread of the process to the
set (``splitserve.runtime.cpus.pin_cpu_set``) and gives torch one compute thread per CPU of it, or ``num_threads``.

Apart from ``splitserve.runtime.cpus`` because it imports torch: the router pins itself with ``pin_cpu_set`` and never
loads torch (an import contract in pyproject.toml says so).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitserve.runtime.cpus import allowed_cpus, format_cpu_list, pin_cpu_set

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppliedCpus:
    cpus: frozenset[int]  # the process's affinity after apply_cpu_set
    threads: int  # torch.get_num_threads() after apply_cpu_set


def apply_cpu_set(text: str, num_threads: int = 0, *, field_name: str = "cpus") -> AppliedCpus:
    """Pin this process to the CPU set ``text`` (``""``: leave the affinity as it is) and give torch one compute
    thread per CPU of the set, or ``num_threads`` when that is > 0. Call it before any torch work: a thread
    reads torch's thread count at its first parallel op and keeps it."""
    cpus = pin_cpu_set(text, field_name)
    threads = num_threads or len(cpus)
    if threads:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # allowed once, before any inter-op work; the intra-op threads are what count
            pass
    applied = AppliedCpus(allowed_cpus(), torch.get_num_threads())
    log.info("CPUs %s%s, %d torch threads", format_cpu_list(applied.cpus), "" if cpus else " (not pinned)",
             applied.threads)
    return applied

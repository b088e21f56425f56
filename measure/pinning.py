"""``one_pinned_thread``: a measurement on one CPU and one torch thread, as the benchmarks' single-thread figures are
taken (the last CPU this process may use, so that the first stays with whatever else runs), restored after."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_pinned_thread() -> Iterator[int]:
    """This process pinned to its last allowed CPU with one torch thread; yields that CPU."""
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, allowed[-1:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield allowed[-1]
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)

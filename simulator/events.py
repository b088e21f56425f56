"""The virtual clock: a heap of (time, order, callback) run in time order, ties in the order they were scheduled."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0  # seconds of virtual time
        self._heap: list = []
        self._order = itertools.count()

    def at(self, when: float, callback: Callable, *args) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), callback, args))

    def after(self, delay: float, callback: Callable, *args) -> None:
        self.at(self.now + delay, callback, *args)

    def run(self, until: float = float("inf")) -> None:
        """Run every event due up to ``until`` (virtual seconds)."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            self.now, _, callback, args = heapq.heappop(heap)
            callback(*args)

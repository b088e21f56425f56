"""Core lending: a prefill pod computes on a decode pod's CPU while that pod is idle or can spare it.

On one machine the phase split gives each prompt one pod's cores, while a ~600 ms TTFT on two cores needs both
cores' compute on the prompt; meanwhile the decode pod's core idles between requests, and its requests often run
ahead of their TPOT targets. With lending on (``splitserve up --lend-decode-cpus``):

- each decode pod publishes, after every step and every command, how many requests it holds and until when they
  can spare its CPU (``DecodeYield``, into ``DecodeActivity``, a 24-byte file in the run directory): a request can
  spare it while its average TPOT on this pod stays within ``YIELD_SHARE`` x its target (its own, else the pod's
  ``--tpot-target-s``);
- the prefill pod, before each engine step (``CoreLender``), while its steps kept it busy less than half of the
  last 5 s, runs the step on its own CPUs *and* the lent ones (one torch thread per CPU) when every owner is idle,
  or when each busy owner can spare its CPU for ``BORROW_MARGIN`` x the longest recent lent step: then it *borrows*
  it (writes until when into the owner's file) and hands it back as soon as the step ends; otherwise the step runs
  on its own CPUs alone;
- a borrowed decode pod pauses its engine loop, 2 ms at a time (commands, the borrowing prefill's KV writes among
  them, still apply in between), until the borrow ends, never past what its requests spare, never while a request
  waits for its first step there.

A step that overruns its borrow, or that began while the owner was idle and meets a request arriving there,
shares the CPU with the decode pod at equal priority until it ends: the decode steps run ~2x slower meanwhile,
and the prefill step no faster than on its own CPUs. (At the lowest priority the lent thread starved: OpenMP splits
a parallel op evenly over the team, so the whole step waited on it; TTFT p90 rose 50% over the plain split.)

The threads: the pod's process stays pinned to its own CPUs (gRPC, asyncio, logging never touch a lent CPU). The
engine thread widens its own affinity, starts torch's OpenMP team at full size, narrows itself back to its own CPUs
and pins the workers to the lent CPUs (with one own CPU; else they float over both sets). Each step then only sets
torch's thread count (``torch.set_num_threads`` on the engine thread, which the native kernels read too).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from splitserve.runtime.cpus import format_cpu_list

log = logging.getLogger(__name__)

# The activity file: held requests (u32, the decode pod's), then two CLOCK_MONOTONIC times in seconds: until when
# the decode pod's requests can spare its CPU (f64, the decode pod's), and until when a prefill pod borrows it (f64,
# the prefill pod's). Each word has one writer; time.monotonic() is CLOCK_MONOTONIC, one clock for every process.
_LAYOUT = struct.Struct("<I4xdd")
_HELD, _LENDABLE, _BORROWED = 0, 8, 16
YIELD_SHARE = 0.8  # a decode pod spares its CPU only while each request's TPOT stays within 0.8 x its target
BORROW_MARGIN = 1.5  # a prefill pod borrows a busy CPU for 1.5 x its longest recent lent step
MAX_BORROW_S = 0.5  # and never for longer at a time
FIRST_STEP_GUESS_S = 0.2  # the lent step's length before one was measured
PAUSE_POLL_S = 0.002  # how often a pausing decode pod looks whether the borrow ended
# A prefill pod lends only while its own steps kept it busy less than this share of the last LOAD_WINDOW_S: under
# load a lent step too often meets requests arriving at the decode pod, and shared at equal priority it runs no
# faster than on the pod's own CPU while it slows the decodes (measured: TTFT p50 1.1 s against the plain split's
# 0.64 s at 2 req/s, with lending on only 10 of ~50 steps).
LEND_BELOW_BUSY = 0.5
LOAD_WINDOW_S = 5.0


class DecodeActivity:
    """A decode pod's activity file (layout above): written by the pod, read (and borrowed through) by the prefill
    pods it lends its CPUs to. A missing or unreadable file reads as busy and never lendable: a prefill pod never
    takes a CPU whose owner it cannot hear from."""

    def __init__(self, path: str | Path, writer: bool = False):
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        self._last: tuple[int, float] | None = None
        if writer:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as f:
                f.write(_LAYOUT.pack(0, 0.0, 0.0))
            self._open()

    def _open(self) -> bool:
        try:
            with open(self.path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), _LAYOUT.size)
        except (OSError, ValueError):
            return False
        return True

    def _mapped(self) -> mmap.mmap | None:
        if self._map is None:
            self._open()
        return self._map

    # ---- the decode pod's words -----------------------------------------------------------------------------
    def publish(self, held: int, lendable_until: float = 0.0) -> None:
        """The pod holds ``held`` requests, which can spare its CPU until ``lendable_until`` (monotonic seconds)."""
        if (held, lendable_until) != self._last:
            struct.pack_into("<I", self._map, _HELD, held)
            struct.pack_into("<d", self._map, _LENDABLE, lendable_until)
            self._last = (held, lendable_until)

    def held(self) -> int | None:
        """The owner's last published count; None while the file cannot be read."""
        mapped = self._mapped()
        return None if mapped is None else struct.unpack_from("<I", mapped, _HELD)[0]

    def lendable_until(self) -> float:
        mapped = self._mapped()
        return 0.0 if mapped is None else struct.unpack_from("<d", mapped, _LENDABLE)[0]

    # ---- the prefill pod's word -----------------------------------------------------------------------------
    def borrow(self, until: float) -> None:
        struct.pack_into("<d", self._mapped(), _BORROWED, until)

    def borrowed_until(self) -> float:
        mapped = self._mapped()
        return 0.0 if mapped is None else struct.unpack_from("<d", mapped, _BORROWED)[0]


class CoreLender:
    """The prefill pod's side: sizes each engine step's torch threads, ``own`` CPUs always, plus ``lent`` while every
    owner is idle, or while each busy owner's requests can spare its CPU for the step (then it borrows it: the
    owner pauses until the step ends)."""

    def __init__(self, own: frozenset[int], lent: frozenset[int], owners: Sequence[DecodeActivity],
                 clock=time.monotonic):
        if not own or not lent or own & lent:
            raise ValueError(f"lending needs own CPUs and disjoint lent CPUs, got own {format_cpu_list(own)}, "
                             f"lent {format_cpu_list(lent)}")
        if not owners:
            raise ValueError("lending needs the activity files of the pods that own the lent CPUs")
        self.own, self.lent, self.owners = own, lent, list(owners)
        self.clock = clock
        self.threads = len(own)
        self._step_started: float | None = None  # while a step runs
        self._borrow: float | None = None  # the running step's: None on the own CPUs, 0 on idle owners', > 0 borrowed
        self._recent_lent_steps: deque[float] = deque(maxlen=16)  # the last lent steps' lengths, seconds
        self._steps: deque[tuple[float, float]] = deque()  # (end, length) of the steps in the last LOAD_WINDOW_S
        self.workers: list[int] = []  # the thread ids of the OpenMP workers that reach the lent CPUs

    @property
    def step_estimate_s(self) -> float:
        return max(self._recent_lent_steps, default=FIRST_STEP_GUESS_S)

    def busy_share(self, now: float) -> float:
        """The share of the last LOAD_WINDOW_S this pod spent in engine steps."""
        while self._steps and self._steps[0][0] <= now - LOAD_WINDOW_S:
            self._steps.popleft()
        return sum(min(length, end - (now - LOAD_WINDOW_S)) for end, length in self._steps) / LOAD_WINDOW_S

    def _borrow_for(self, now: float) -> float | None:
        """How long to borrow the busy owners' CPUs for the coming step (0: every owner is idle); None: not."""
        if self.busy_share(now) >= LEND_BELOW_BUSY:
            return None
        held = [owner.held() for owner in self.owners]
        if all(h == 0 for h in held):
            return 0.0
        wanted = min(BORROW_MARGIN * self.step_estimate_s, MAX_BORROW_S)
        if any(h is None or (h and owner.lendable_until() - now < wanted) for h, owner in zip(held, self.owners)):
            return None
        return wanted

    def wanted_threads(self) -> int:
        """The coming step's thread count, as ``before_step`` would set it (without borrowing anything)."""
        return self._threads(self._borrow_for(self.clock()))

    def _threads(self, borrow: float | None) -> int:
        return len(self.own) + len(self.lent) if borrow is not None else len(self.own)

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
        # With one own CPU every worker is a lent CPU's: pinned there, a worker woken by the engine thread never
        # waits behind it on the own CPU (it would, until the kernel moved it). With more own CPUs the
        # workers float over both sets: which of them serve the own CPUs is OpenMP's to say.
        worker_cpus = self.lent if len(self.own) == 1 else wide
        for tid in workers:
            try:
                os.sched_setaffinity(tid, worker_cpus)
            except OSError as error:  # the thread ended meanwhile: nothing to place
                log.debug("could not place thread %d: %r", tid, error)
        torch.set_num_threads(self.threads)
        self.workers = sorted(workers)
        log.info("core lending: steps run on CPUs %s, and on %s too while the decode pods there are idle or can "
                 "spare them (%d lent thread(s))", format_cpu_list(self.own), format_cpu_list(self.lent),
                 len(workers))

    def before_step(self) -> bool:
        """Size the coming step's threads, borrowing busy owners' CPUs when they can spare them; True when the
        step runs on the lent CPUs too (the step always runs)."""
        now = self.clock()
        borrow = self._borrow_for(now)
        if borrow:
            for owner in self.owners:
                owner.borrow(now + borrow)
        threads = self._threads(borrow)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        self._step_started, self._borrow = now, borrow
        return borrow is not None

    def after_step(self) -> None:
        """The step ended: hand borrowed CPUs back at once, and learn how long a lent step takes."""
        if self._step_started is None:
            return
        if self._borrow:
            for owner in self.owners:
                owner.borrow(0.0)
        now = self.clock()
        length = now - self._step_started
        self._steps.append((now, length))
        if self._borrow is not None:
            self._recent_lent_steps.append(length)
        self._step_started = self._borrow = None


class DecodeYield:
    """The decode pod's side: after each step it publishes how many requests it holds and until when they can spare
    its CPU; before each step it pauses while a prefill pod borrows the CPU, never past that time.

    A request can spare the CPU while its average TPOT on this pod stays within ``share`` x its target: counting
    from the step it first ran here (``t0``), its next token must come by ``t0 + share x target x (k + 1)`` after k
    tokens here, so the pause may last that less now and one step. A request without a target (no --tpot-target-s,
    no target of its own) spares nothing, and nor does the pod while a request waits for its first step here."""

    def __init__(self, activity: DecodeActivity, default_target_s: float, share: float = YIELD_SHARE,
                 clock=time.monotonic, sleep=time.sleep):
        self.activity = activity
        self.default_target_s = default_target_s
        self.share = share
        self.clock, self.sleep = clock, sleep
        self.lendable_until = 0.0
        self._since: dict[str, tuple[float, int]] = {}  # request id -> (t0, its output tokens at t0)
        self._step_started: float | None = None
        self._last_step_s = 0.0
        self.paused_s = 0.0  # in all (the pod's metrics read it)

    def before_step(self, num_waiting: int = 0) -> bool:
        """False while a prefill pod borrows the CPU (never past ``lendable_until``, never with a request waiting
        for its first step here), after a pause of at most ``PAUSE_POLL_S``: the engine loop applies its commands
        (admissions, KV writes: the borrowing prefill's own push among them) and asks again."""
        now = self.clock()
        end = min(self.activity.borrowed_until(), self.lendable_until)
        if not num_waiting and now < end:
            self.sleep(min(PAUSE_POLL_S, end - now))
            self.paused_s += self.clock() - now
            return False
        self._step_started = now
        return True

    def observe(self, running: Sequence, num_waiting: int, stepped: bool) -> None:
        """After a step (``stepped``) or a command (an admission, an abort): publish what the pod holds now."""
        now = self.clock()
        if stepped and self._step_started is not None:
            self._last_step_s = now - self._step_started
            self._step_started = None
        self._since = {seq.request_id: self._since.get(seq.request_id, (now, seq.num_output_tokens))
                       for seq in running}
        spare = self._spare_s(running, now) if running and not num_waiting else 0.0
        self.lendable_until = now + spare if spare > 0 else 0.0
        self.activity.publish(len(running) + num_waiting, self.lendable_until)

    def _spare_s(self, running: Sequence, now: float) -> float:
        spare = []
        for seq in running:
            target = seq.tpot_target_s or self.default_target_s
            if not target:
                return 0.0
            t0, tokens_at_t0 = self._since[seq.request_id]
            tokens_here = seq.num_output_tokens - tokens_at_t0
            spare.append(self.share * target * (tokens_here + 1) - (now - t0) - self._last_step_s)
        return max(0.0, min(spare))


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _start_team() -> None:
    """One parallel op large enough for torch to split over every thread, which starts OpenMP's workers."""
    x = torch.ones(1 << 20)
    torch.add(x, x, out=x)

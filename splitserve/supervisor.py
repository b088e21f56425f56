"""Supervision of ``splitserve up``'s child processes: start them, restart any that exits, stop them in stages.

    Supervisor(specs).start()    one thread forks every child, in order, then watches them
      a child exits              whatever its code or signal (SIGKILL, a crash, a clean exit after a SIGTERM
                                 drain): logged with its exit and uptime, started again with the same command
                                 (same ports and flags) after a backoff of 1 s doubling up to 30 s; a child
                                 that had run for 30 s or more before exiting starts again after 1 s. From the
                                 third quick exit in a row the event is an ERROR carrying the tail of its log
                                 (crash loop); the supervisor keeps retrying and the other children keep serving
    supervisor.stop(stages)      no more restarts; each stage in turn gets SIGTERM, and SIGKILL for whoever
                                 outlives the stage's grace period (the largest of its children's)

Children die with their parent: each child asks the kernel for SIGTERM when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, Linux), so a ``kill -9`` of the launcher leaves no child holding a port. The kernel
sends it when the *thread* that forked the child ends, not the process; so the one supervisor thread forks every
child, restarts included, and lives until they are all stopped. Children start in their own session
(``start_new_session``): a Ctrl-C in the terminal reaches the launcher only, which then stops them in order.

Each child's stdout and stderr go to its log file, appended across restarts under a line that marks each start.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 30.0  # a child up this long before it exited was not crash-looping: its backoff starts over
CRASH_LOOP_EXITS = 3  # quick exits in a row reported as a crash loop, with the log's tail
POLL_S = 0.2
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class ChildSpec:
    """How to run one child: its command, extra environment, log file, and the grace it gets to stop."""

    name: str
    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    stop_grace_s: float = 10.0


@dataclass(frozen=True)
class Exit:
    """One exit of a child, as the supervisor saw it."""

    name: str
    pid: int
    returncode: int  # negative: killed by that signal
    uptime_s: float
    log_tail: str

    def describe(self) -> str:
        how = (f"was killed by {signal.Signals(-self.returncode).name}" if self.returncode < 0
               else f"exited with code {self.returncode}")
        return f"{self.name} (pid {self.pid}) {how} after {self.uptime_s:.1f} s"


class Child:
    """A supervised child: the spec, the running process (None while it waits to restart) and its history."""

    def __init__(self, spec: ChildSpec):
        self.spec = spec
        self.name = spec.name
        self.popen: subprocess.Popen | None = None
        self.started_at = 0.0
        self.starts = 0
        self.quick_exits = 0  # exits in a row within STABLE_AFTER_S of starting
        self.restart_at: float | None = None  # when a child that exited starts again
        self._log_offset = 0  # where this run's output begins in the log

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None and self.popen.poll() is None else None

    def start(self) -> None:
        self.starts += 1
        with open(self.spec.log, "ab") as out:
            out.write(f"==== {datetime.now().isoformat(timespec='milliseconds')} splitserve up: start "
                      f"{self.starts} of {self.name}: {' '.join(self.spec.command)}\n".encode())
            out.flush()
            self._log_offset = out.tell()
            self.popen = subprocess.Popen(_dying_with_parent(self.spec.command), stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, **self.spec.env}, start_new_session=True)
        self.started_at = time.monotonic()
        self.restart_at = None

    def reap(self) -> Exit | None:
        """The exit of the running process, if it just ended (then ``popen`` is None)."""
        if self.popen is None or self.popen.poll() is None:
            return None
        ended = Exit(self.name, self.popen.pid, self.popen.returncode, time.monotonic() - self.started_at,
                     self.log_tail())
        self.popen = None
        return ended

    def log_tail(self) -> str:
        with open(self.spec.log, "rb") as f:
            f.seek(self._log_offset)
            lines = f.read().decode(errors="replace").splitlines()
        return "\n".join(lines[-LOG_TAIL_LINES:])


class Supervisor:
    """Owns the children (see the module docstring). ``exits`` lists every exit seen, oldest first."""

    def __init__(self, specs: Sequence[ChildSpec]):
        self.children = {spec.name: Child(spec) for spec in specs}
        self.exits: list[Exit] = []
        self._started = threading.Event()
        self._stop_stages: list[list[str]] | None = None
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitserve-supervisor", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> None:
        """Fork every child (on the supervisor thread) and return once they are all started."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def stop(self, stages: Sequence[Sequence[str]]) -> None:
        """Stop restarting, then stop the children stage by stage (names; unknown names are skipped, children in
        no stage go last). Returns when every child has exited."""
        if not self._thread.is_alive():
            return
        listed = {name for stage in stages for name in stage}
        rest = [name for name in self.children if name not in listed]
        known = [[name for name in stage if name in self.children] for stage in stages]
        self._stop_stages = [stage for stage in known if stage] + ([rest] if rest else [])
        self._wake.set()
        self._thread.join()

    @property
    def restarts(self) -> dict[str, int]:
        return {name: child.restarts for name, child in self.children.items()}

    # ---- the supervisor thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for child in self.children.values():
                child.start()
                log.info("started %s (pid %d)", child.name, child.popen.pid)
        except Exception as err:  # e.g. a command not found: stop what started, report to start()
            self._error = err
            self._stop_stages = [list(self.children)]
        self._started.set()
        while self._stop_stages is None:
            try:
                self._watch_once()
            except Exception:  # this thread must outlive the children: its end would SIGTERM them
                log.exception("supervising the children failed; going on")
            self._wake.wait(POLL_S)
        self._stop_all(self._stop_stages)

    def _watch_once(self) -> None:
        now = time.monotonic()
        for child in self.children.values():
            ended = child.reap()
            if ended is not None:
                self.exits.append(ended)
                self._schedule_restart(child, ended, now)
            elif child.popen is None and child.restart_at is not None and now >= child.restart_at:
                child.start()
                log.info("restarted %s (pid %d, restart %d)", child.name, child.popen.pid, child.restarts)

    def _schedule_restart(self, child: Child, ended: Exit, now: float) -> None:
        child.quick_exits = child.quick_exits + 1 if ended.uptime_s < STABLE_AFTER_S else 1
        delay = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (child.quick_exits - 1))
        child.restart_at = now + delay
        if child.quick_exits >= CRASH_LOOP_EXITS:
            log.error("%s; crash loop: %d quick exits in a row, starting it again in %.1f s; last lines of %s:\n%s",
                      ended.describe(), child.quick_exits, delay, child.spec.log, ended.log_tail)
        else:
            log.warning("%s; starting it again in %.1f s", ended.describe(), delay)

    def _stop_all(self, stages: list[list[str]]) -> None:
        for stage in stages:
            running = [self.children[name] for name in stage if self.children[name].pid is not None]
            if not running:
                continue
            for child in running:
                child.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + max(child.spec.stop_grace_s for child in running)
            for child in running:
                try:
                    child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0f s of SIGTERM; killing it", child.name,
                                child.spec.stop_grace_s)
                    child.popen.kill()
                    child.popen.wait()
            log.info("stopped %s", ", ".join(child.name for child in running))


# ---- children die with their parent --------------------------------------------------------------------------------

# Run in the child before its command: ask for SIGTERM when the parent dies (PR_SET_PDEATHSIG = 1, <linux/prctl.h>);
# if the parent already died since the fork, the signal would never come, so exit. Not a ``preexec_fn``: with one,
# Python forks the whole process and runs its fork handlers (gRPC's among them, in a launcher that also makes gRPC
# calls: the soak, the tests), which crashed some children before their command ran; without one, the child is
# vforked and execs at once.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _dying_with_parent(command: list[str]) -> list[str]:
    """``command``, started so that it gets SIGTERM when the forking thread (the supervisor) dies (Linux)."""
    if sys.platform != "linux":
        return command
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]

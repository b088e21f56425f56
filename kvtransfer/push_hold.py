"""A test hook that holds a KV push at a named point until the test lets it go: a fault test kills a pod at a known
moment of a push, never by racing the machine's speed (a fast CPU finishes a push before a kill "mid-push" lands).

With ``SPLITSERVE_TEST_HOLD_PUSH`` naming a directory in a prefill pod's environment, a push that reaches point ``P``
while the file ``<directory>/P`` exists (the test armed it) writes ``<directory>/P.held`` (its request id) and waits,
on the event loop, until ``<directory>/P`` is gone (the test let it go). The points, on a push's path:

- ``MID_PUSH``, in ``KVSender``: the first layer's chunks are written and no later one: the decode pod has reserved
  the prompt's blocks and is receiving;
- ``BEFORE_ANSWER``, in the prefill pod's ``Prefill``: the push is acknowledged (the decode pod holds the KV under its
  lease) and the prefill pod has not answered the router: a pod killed here pushed KV that no Decode call will claim.

The variable is read once, at import (a pod's start); unset, as in production, a point costs one comparison.
``PushHolds`` is the test's side: it arms a point, waits until a push is held there, and lets it go.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

HOLD_PUSH_ENV = "SPLITSERVE_TEST_HOLD_PUSH"
MID_PUSH = "mid-push"
BEFORE_ANSWER = "before-answer"
POLL_S = 0.01
_DIRECTORY = os.environ.get(HOLD_PUSH_ENV, "")  # the pod process's, read at its start


async def hold(point: str, request_id: str) -> None:
    """The pod's side: wait at ``point`` while the test has it armed (module docstring); at once otherwise."""
    if not _DIRECTORY:
        return
    armed = Path(_DIRECTORY, point)
    if not armed.exists():
        return
    Path(_DIRECTORY, f"{point}.held").write_text(request_id)
    while armed.exists():
        await asyncio.sleep(POLL_S)


class PushHolds:
    """The test's side, over ``directory`` (which the pods' ``SPLITSERVE_TEST_HOLD_PUSH`` names)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        """The environment a pod process needs for its pushes to be held here."""
        return {HOLD_PUSH_ENV: str(self.directory)}

    def arm(self, point: str) -> None:
        """The next push to reach ``point`` stops there (and every later one, until ``release``)."""
        Path(self.directory, f"{point}.held").unlink(missing_ok=True)
        Path(self.directory, point).touch()

    def wait_held(self, point: str, timeout_s: float) -> str:
        """The request id of the push held at ``point``, once one is; AssertionError after ``timeout_s``."""
        held, deadline = Path(self.directory, f"{point}.held"), time.monotonic() + timeout_s
        while not held.exists() or not held.read_text():
            assert time.monotonic() < deadline, f"no push reached {point!r} within {timeout_s:g} s"
            time.sleep(POLL_S)
        return held.read_text()

    def release(self, point: str) -> None:
        """Lets the held push (if its pod still lives) go on, and disarms ``point``."""
        Path(self.directory, point).unlink(missing_ok=True)

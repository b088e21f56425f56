"""Runs one ``LLMEngine`` on its own thread and lets asyncio servers talk to it.

A gRPC handler calls ``generate(...)``, which queues the request for the engine thread and returns an async
iterator of ``TokenEvent``s. The engine thread loops: apply queued commands (add, abort, arbitrary calls such as
admitting a transferred KV cache), run one ``step()``, and post each sequence's new tokens back to the event loop
of the caller. Only the engine thread touches the scheduler, the block manager and the model, so none of them
needs a lock.

A step that raises fails the requests of that step with an error and leaves the pod serving the others.
``alive(stall_s)`` says whether the thread still runs and came round its loop within ``stall_s`` seconds (an idle
loop comes round every half second): the pod's health follows it, so a dead or stuck engine fails liveness.

An ``observer(engine, stats)`` set at construction is called on the engine thread after every step (with its
``StepStats``) and after every command (with None), before the command's caller hears back: the pod builds its
load reports and engine metrics there, so they never wait for the engine, never touch it from another thread,
and a caller that saw its command done (an admission, a KV reservation) finds it in the next load report.
``on_start()`` runs once on the engine thread before its loop and ``before_step()`` before every step, which it may
put off by returning False (the loop then applies commands and asks again): a pod that borrows CPUs sizes each
step's threads there, and one that lends its CPU pauses there (runtime/core_lending.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from splitserve.engine.llm_engine import EngineStepError, LLMEngine, StepStats
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import PromptLogprob, Sequence

logger = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """New tokens of one request since the last event; ``finished`` on the last event."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    seq: Sequence | None = None
    # The prompt's logprobs (Sequence.prompt_logprobs), when asked for, on the first event after the prompt was
    # computed here; None on every other event (and for a sequence prefilled elsewhere).
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    seq: Sequence
    num_sent: int = 0
    prompt_logprobs_sent: bool = False


EngineObserver = Callable[[LLMEngine, "StepStats | None"], None]


class EngineLoop:
    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None,
                 on_start: Callable[[], None] | None = None, before_step: Callable[[], bool] | None = None):
        self.engine = engine
        self._observer = observer
        self._on_start = on_start  # called once on the engine thread, before anything else runs there
        # Called on the engine thread before every step (e.g. to size its threads); False: not yet (the loop
        # applies the commands that came meanwhile and asks again).
        self._before_step = before_step
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._last_round = time.monotonic()  # when the engine thread last came round its loop

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    def is_running(self) -> bool:
        return self._thread.is_alive()

    def alive(self, stall_s: float) -> bool:
        """The thread runs and its current round (commands, then one step) has lasted at most ``stall_s``."""
        return self.is_running() and time.monotonic() - self._last_round <= stall_s

    # ---- called from any thread ------------------------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], object]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps; the future holds its result or exception.

        The command runs even if the future was cancelled meanwhile (an asyncio caller of ``run`` that was
        cancelled cancels it): commands free blocks and admit requests, and skipping one would leak them.
        """
        future: Future = Future()

        def command() -> None:
            wanted = future.set_running_or_notify_cancel()  # from here on nobody can cancel the future
            try:
                outcome = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._observe(None)
                if wanted:
                    future.set_exception(exc)
                else:
                    logger.warning("engine command failed after its caller stopped waiting: %r", exc)
                return
            self._observe(None)
            if wanted:
                future.set_result(outcome)

        self._commands.put(command)
        self._wake.set()
        return future

    async def run(self, fn: Callable[[LLMEngine], object]):
        """``call`` for asyncio callers."""
        return await asyncio.wrap_future(self.call(fn))

    def abort(self, request_id: str) -> Future:
        """Abort a request wherever it is; the future holds whether the engine knew it."""
        return self.call(lambda engine: self._abort(request_id))

    # ---- asyncio API -----------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       add: Callable[[LLMEngine], Sequence] | None = None) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens. ``add`` overrides how the sequence enters the engine (e.g. admitting a
        sequence whose KV arrived from a prefill pod); by default it is ``engine.add_request``. Raises the
        ValueError of an invalid request before any event. Closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        add = add or (lambda engine: engine.add_request(request_id, prompt_token_ids, params))
        admitted = False  # written and read on the engine thread only

        def admit(engine: LLMEngine) -> Sequence:
            nonlocal admitted
            if request_id in self._subscribers:
                raise ValueError(f"request_id {request_id!r} is already running on this pod")
            seq = add(engine)
            # A sequence admitted with tokens already (a decode pod's first token came from the prefill pod)
            # streams only what it generates here.
            self._subscribers[request_id] = _Subscriber(loop, events, seq, num_sent=seq.num_output_tokens)
            admitted = True
            if seq.is_finished:  # e.g. the first token was EOS: nothing will run, say so now
                self._publish(seq)
            return seq

        finished = False
        try:
            await self.run(admit)
            while True:
                event: TokenEvent = await events.get()
                finished = event.finished
                yield event
                if finished:
                    return
        finally:
            if not finished:
                # Also when cancelled while the admission was queued: the check runs after it, on the engine
                # thread, so an admitted request is aborted and a refused one (maybe a duplicate id) is left alone.
                self.call(lambda engine: self._abort(request_id) if admitted else False)

    # ---- engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while not self._stopping:
            self._last_round = time.monotonic()
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            previous = self.engine.last_step
            if self._before_step is not None and not self._before_step():
                continue  # not now: apply the commands that came meanwhile, then ask again
            try:
                updated = self.engine.step()
            except EngineStepError as exc:  # one bad step must not take the pod down
                logger.exception("engine step failed; failing the requests it held")
                self._fail(exc.sequences, str(exc.__cause__))
                self._observe(None)
                continue
            for seq in updated:
                self._publish(seq)
            if self.engine.last_step is not previous:  # a step ran (a chunked prefill may update no sequence)
                self._observe(self.engine.last_step)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _observe(self, stats: StepStats | None) -> None:
        if self._observer is None:
            return
        try:
            self._observer(self.engine, stats)
        except Exception:  # a report that failed must not stop the engine
            logger.exception("the engine observer failed")

    def _publish(self, seq: Sequence) -> None:
        sub = self._subscribers.get(seq.request_id)
        if sub is None:
            return
        new = seq.output_token_ids[sub.num_sent:]
        logprobs = seq.output_logprobs[sub.num_sent:] if seq.output_logprobs else []
        sub.num_sent = len(seq.output_token_ids)
        prompt_logprobs = None
        if not sub.prompt_logprobs_sent and seq.sampling_params.prompt_logprobs is not None \
                and not seq.needs_prompt_logprobs:
            prompt_logprobs, sub.prompt_logprobs_sent = list(seq.prompt_logprobs), True
        event = TokenEvent(new, logprobs, seq.is_finished,
                           seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason,
                           seq.num_cached_tokens, seq=seq, prompt_logprobs=prompt_logprobs)
        if seq.is_finished:
            del self._subscribers[seq.request_id]
        sub.loop.call_soon_threadsafe(sub.events.put_nowait, event)

    def _abort(self, request_id: str) -> bool:
        seq = self.engine.abort_request(request_id)
        sub = self._subscribers.pop(request_id, None)
        if sub is not None and seq is not None:
            sub.loop.call_soon_threadsafe(sub.events.put_nowait, TokenEvent(
                [], finished=True, finish_reason="abort", num_cached_tokens=seq.num_cached_tokens, seq=seq))
        return seq is not None

    def _fail(self, sequences: list[Sequence], message: str) -> None:
        for seq in sequences:
            sub = self._subscribers.pop(seq.request_id, None)
            if sub is not None:
                sub.loop.call_soon_threadsafe(sub.events.put_nowait, TokenEvent(
                    [], finished=True, finish_reason="error", error=message, seq=seq))

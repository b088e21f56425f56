"""What a request gives its client, as ``Router.generate`` yields it: ``OutputDelta``s, then one ``Completion``;
and ``RunOutput``, which makes them from what the request's pods sent.

The API edges (``grpc_api.py``, ``openai/``) and ``choices.py`` read ``OutputDelta`` and ``Completion``. The
request's run (``request_run.py``) hands its ``RunOutput`` each pod message in order:

1. a prefill pod's answer (``prefilled``) is the request's report: cached tokens, queue / prefill / transfer seconds;
   a split prefill (``split_at``) adds the decode pod's summary of the rest to it at the end;
2. each ``DecodeChunk`` (``take_chunk``): its tokens through the request's ``IncrementalDetokenizer`` into an
   ``OutputDelta``, up to and including a token that completes a stop string (``stopped_by``: the run then stops
   reading and cancels D's stream); the first token's moment is the TTFT, each later chunk an inter-token gap;
3. the end (``complete_from_pod``, D's ``DecodeComplete``, or ``complete``, when the run ends it): exactly one
   ``Completion`` (finish reason, usage, where the time went), whose numbers go to the router's metrics (latencies,
   tokens, goodput against the request's or the router's ``slo_ttft_s``/``slo_tpot_s``).

A request drawn for a shadow check (``shadow.py``) asked its pods for every token's logprob: they are kept in
``shadow_logprobs``, and the client gets them only if it asked (``client_logprobs``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

from splitserve.engine.sequence import FinishReason, PromptLogprob
from splitserve.engine.text.detokenizer import IncrementalDetokenizer
from splitserve.protos.convert import finish_reason_from_proto, prompt_logprobs_from_proto, token_logprob_to_dict
from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.route_plan import SLOTargets
from splitserve.runtime.errors import StatusError
from splitserve.runtime.metrics import RouterMetrics
from splitserve.v1 import decode_pb2, prefill_pb2

log = logging.getLogger(__name__)


@dataclass
class OutputDelta:
    """New output since the previous delta. ``text`` may lag ``token_ids`` (a character or a possible stop
    string still incomplete); the concatenated deltas give the full text."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None  # one {token_id: logprob} per token (protos/convert.py)
    # The prompt's logprobs (one per prompt token from the second on), in the first delta, when asked for.
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass
class Completion:
    """The request ended; the last item of ``generate``."""

    finish_reason: FinishReason
    stop_reason: int | str | None  # the stop token id or stop string that ended it, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict[str, float]  # seconds: queue, prefill, kv_transfer, ttft, e2e
    error: StatusError | None = None  # what went wrong, when finish_reason is "error"


class RunOutput:
    """One request's output so far: its tokens and text, their times, the pods' reports, and how it ended."""

    def __init__(self, request: RouterRequest, detokenizer: IncrementalDetokenizer, config: RouterConfig,
                 metrics: RouterMetrics, shadow_checked: bool = False, client_logprobs: bool = True):
        self.request = request
        self.detokenizer = detokenizer
        self.config = config
        self.metrics = metrics
        self.output_token_ids: list[int] = []  # every token the client has been sent
        self.prompt_logprobs_sent = False  # a pod that prefills it again (migration) sends them again: not the client
        self.first_token_at: float | None = None  # time.monotonic()
        self.last_token_at: float | None = None
        self.cached_tokens = 0
        # What the pod that prefilled reported, in seconds: queue, prefill and (disaggregated) kv_transfer. Missing
        # when that report never came (a stop string ended a request prefilled on D before D's summary).
        self.pod_timings: dict[str, float] = {}
        self.split_prefix_tokens = 0  # a split prefill: a prefill pod prefilled this many leading prompt tokens
        # Drawn for a shadow check: the logprob of every token the client has been sent. None: not drawn.
        self.shadow_logprobs: list[float] | None = [] if shadow_checked else None
        self.client_logprobs = client_logprobs
        self.finish_reason: FinishReason | None = None  # set once its Completion is made

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def stopped_by(self) -> str | None:
        """The stop string the text completed, if one did: the request ends there."""
        return self.detokenizer.stopped_by

    # -- the pods' reports ----------------------------------------------------------------------------------------

    def prefilled(self, first: prefill_pb2.PrefillResponse) -> None:
        """A prefill pod's answer is the request's report: cached tokens, queue/prefill/transfer seconds."""
        self.cached_tokens = first.num_cached_tokens
        self.pod_timings.update(queue=first.queue_seconds, prefill=first.prefill_seconds,
                                kv_transfer=first.kv_transfer.exposed_transfer_seconds)

    def split_at(self, prefix_tokens: int) -> None:
        """A split prefill started on D: D's summary adds to P's report of the first ``prefix_tokens``."""
        self.split_prefix_tokens = prefix_tokens

    # -- tokens to text -------------------------------------------------------------------------------------------

    def take_chunk(self, chunk: decode_pb2.DecodeChunk) -> OutputDelta:
        """The chunk's tokens as text, up to and including the token that completes a stop string."""
        token_ids, text = [], []
        for token_id in chunk.token_ids:
            token_ids.append(token_id)
            text.append(self.detokenizer.add(token_id))
            if self.detokenizer.stopped_by is not None:
                break  # D's tokens past the stop string are not the client's
        entries = chunk.logprobs.tokens[:len(token_ids)]
        if self.shadow_logprobs is not None:
            self.shadow_logprobs += [entry.logprob for entry in entries]
        logprobs = None
        if self.request.params.logprobs is not None and self.client_logprobs:
            logprobs = [token_logprob_to_dict(entry) for entry in entries]
        self._count_tokens(token_ids)
        prompt_logprobs = None
        if chunk.HasField("prompt_logprobs") and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = prompt_logprobs_from_proto(chunk.prompt_logprobs), True
        return OutputDelta(token_ids, "".join(text), logprobs, prompt_logprobs)

    def finish_text(self) -> str:
        """Text held back for a stop string that never came."""
        return self.detokenizer.finish()

    def _count_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.time_to_first_token.observe(now - self.request.arrival_time)
            self.metrics.prompt_tokens.inc(len(self.request.prompt_token_ids))
        else:
            # One observation per chunk: a chunk is one decode step's output on D.
            self.metrics.inter_token_latency.observe(now - self.last_token_at)
        self.last_token_at = now
        self.output_token_ids.extend(token_ids)
        self.metrics.generation_tokens.inc(len(token_ids))

    # -- the end --------------------------------------------------------------------------------------------------

    def complete_from_pod(self, complete: decode_pb2.DecodeComplete, pod_address: str) -> Completion:
        """The ``Completion`` D's summary ends the request with."""
        if not self.pod_timings:  # no prefill pod reported: D prefilled, and its summary is the report
            self.cached_tokens = complete.usage.cached_tokens
            self.pod_timings.update(queue=complete.queue_seconds, prefill=complete.prefill_seconds)
        elif self.split_prefix_tokens:  # P reported the prefix; D's summary adds the rest (its prefix hit is P's KV)
            self.cached_tokens += max(0, complete.usage.cached_tokens - self.split_prefix_tokens)
            self.pod_timings["queue"] += complete.queue_seconds
            self.pod_timings["prefill"] += complete.prefill_seconds
        stop_reason = complete.stop_token_id if complete.HasField("stop_token_id") else None
        finish_reason = finish_reason_from_proto(complete.finish_reason)
        error = None
        if finish_reason is FinishReason.ERROR:
            error = StatusError(grpc.StatusCode.INTERNAL, f"pod {pod_address} ended the request with an error")
            log.error("request %s: %s", self.request.request_id, error.message)
        return self.complete(finish_reason, stop_reason, error)

    def complete(self, finish_reason: FinishReason, stop_reason: int | str | None,
                 error: StatusError | None = None) -> Completion:
        """The request's ``Completion``, observed in the metrics; made once, as the last output."""
        e2e = time.monotonic() - self.request.arrival_time
        ttft = self.first_token_at - self.request.arrival_time if self.first_token_at is not None else 0.0
        self.finish_reason = finish_reason
        self._observe_completion(finish_reason, e2e, ttft)
        return Completion(
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=self.num_output_tokens,
            cached_tokens=self.cached_tokens,
            timings={"queue": 0.0, "prefill": 0.0, "kv_transfer": 0.0, **self.pod_timings, "ttft": ttft, "e2e": e2e},
            error=error,
        )

    def _observe_completion(self, finish_reason: FinishReason, e2e: float, ttft: float) -> None:
        metrics = self.metrics
        metrics.finished(finish_reason)
        metrics.e2e_request_latency.observe(e2e)
        reported = {"queue": metrics.request_queue_time, "prefill": metrics.request_prefill_time,
                    "kv_transfer": metrics.kv_transfer_time}
        for name, seconds in self.pod_timings.items():
            reported[name].observe(seconds)
        tpot = (e2e - ttft) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0
        if self.num_output_tokens > 1:
            metrics.time_per_output_token.observe(tpot)
        answered = finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and self.first_token_at is not None
        targets = SLOTargets.of(self.request, self.config)
        if answered and ttft <= targets.ttft_s and tpot <= targets.tpot_s:
            metrics.requests_within_slo.inc()

"""The ``Decode`` gRPC service, hosted beside ``KVTransfer`` on a decode or mixed pod.

A request's path (for a request whose KV was pushed here, the claim, run and release steps of the hand-off that
``kvtransfer/handoff.py`` narrates and owns: this service calls ``KVHandoff.claim`` and ``KVHandoff.release_claim``,
and runs the claim's ``Admission`` or ``PrefixHandover`` on the engine thread):

    PushKV (kvtransfer/receiver.py)   the prompt's KV arrives and waits in the KVHandoff under a lease
    Decode(request)
      with first_token_id             claim the lease (NOT_FOUND: never pushed or expired; FAILED_PRECONDITION:
                                      still arriving), then admit the sequence with its first token through
                                      EngineLoop.generate(add=Admission.admit): it joins the running batch.
                                      The n samples of one prompt claim the one KV pushed for them
                                      (kv_request_id): each forks a sequence sharing its full blocks, with a copy
                                      of the last partly filled one (LLMEngine.fork_prefilled).
                                      No KV here (never pushed, expired, or dropped as bad): per
                                      kv_load_failure_policy, NOT_FOUND ("fail") or the prompt and the first
                                      token prefill here ("recompute"), as a migrated request's do
                                      (prompt logprobs are the prefill pod's: a pod that prefills a request it was
                                      not the first to prefill still sends its own, which the router ignores)
      without first_token_id          conditional disaggregation / the mixed role: the prompt prefills here;
                                      with resume_token_ids (a request migrated from a decode pod that went away)
                                      the prompt and those tokens prefill here and generation goes on after them;
                                      with kv_prefix_tokens (a split prefill) the KV a prefill pod pushed for the
                                      prompt's first tokens is claimed and handed to the prefix cache just before
                                      the request is added, which finds it there: only the rest prefills here
                                      (KV no longer here, its lease expired, is computed again)
      stream                          DecodeChunk per engine event with the tokens new to the router (from the
                                      second when the prefill pod sampled the first; the first chunk of a prompt
                                      prefilled here carries its prompt logprobs, when asked: alone, with no token,
                                      for a request that generates nothing), then DecodeComplete with the
                                      finish reason, stop token id, usage and this pod's queue/prefill seconds
      the end, however it comes       KVHandoff.release_claim; a cancelled or failed request is aborted in the
                                      engine, or its unadmitted lease released: every block goes back either way
    Abort(request_id)                 releases a lease, stops a push in progress, or aborts a running request
(The pod's load, leased blocks counted as used, is served by ``PodStatus``, runtime/pod_status.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from splitserve.decode_service.config import DecodeConfig
from splitserve.engine.engine_loop import TokenEvent
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.parallel.workers import rank_lost
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.kvtransfer.handoff import Admission, KVHandoff
from splitserve.kvtransfer.receiver import KVTransferServicer
from splitserve.kvtransfer.shm import ShmArenaViews
from splitserve.protos.convert import finish_reason_to_proto, prompt_logprobs_to_proto, token_logprob_from_dict
from splitserve.runtime.config import parse_config
from splitserve.runtime.errors import StatusError
from splitserve.runtime.metrics import PodMetrics
from splitserve.runtime.pod_server import Pod, PodService, checked_params, run_pod
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass
class _TokenClock:
    """When one Decode call's tokens came out, for the latency histograms (time.monotonic seconds, the engine's
    clock)."""

    metrics: PodMetrics
    arrived_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0  # tokens sampled on this pod

    @classmethod
    def start(cls, metrics: PodMetrics, prefilled: bool) -> "_TokenClock":
        now = time.monotonic()
        # A prefilled request brings its first token: from here, the next one is an inter-token gap.
        return cls(metrics, now, now if prefilled else None, now if prefilled else None)

    def on_tokens(self, count: int) -> None:
        now = time.monotonic()
        if self.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - self.arrived_at)
            self.first_token_at = now
        else:
            for _ in range(count):  # tokens that came out together shared the gap
                self.metrics.inter_token_latency.observe((now - self.last_token_at) / count)
        self.last_token_at = now
        self.num_generated += count

    def on_finish(self, reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrived_at)
        self.metrics.request_prompt_tokens.observe(num_prompt_tokens)  # every request ends on a decode pod
        self.metrics.request_generation_tokens.observe(num_output_tokens)
        if num_output_tokens > 1 and self.first_token_at is not None:
            tpot = (self.last_token_at - self.first_token_at) / (num_output_tokens - 1)
            self.metrics.time_per_output_token.observe(tpot)
        self.metrics.generation_tokens.inc(self.num_generated)
        self.metrics.finished(reason)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    service_name = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name

    def __init__(self, pod: Pod, handoff: KVHandoff, load_failure_policy: str = "fail"):
        self._pod = pod
        self.handoff = handoff
        self.load_failure_policy = load_failure_policy

    def add_to_server(self, server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(self, server)

    async def Decode(self, request: decode_pb2.DecodeRequest, context) -> None:
        params = await self._checked_params(request, context)
        if not request.HasField("first_token_id"):
            if self._pod.queue_full():
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the decode pod's queue is full")
            if request.kv_prefix_tokens:
                await self._stream_after_prefix(request, params, context)
            else:
                await self._stream(request, params, None, context)
            return
        try:
            admission = self.handoff.claim(request, params)
        except StatusError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                await context.abort(err.code, err.message)  # not a failed load: a bad request, or too early
            await self._load_failed(request, params, err, context)
            return
        if admission.first_claim:  # one load per transfer, however many samples claim it
            self._pod.metrics.kv_loaded("loaded")
        try:
            await self._stream(request, params, admission, context)
        finally:
            await self.handoff.release_claim(admission)  # from here the engine owns admitted blocks

    async def _stream_after_prefix(self, request: decode_pb2.DecodeRequest, params: SamplingParams, context) -> None:
        """A split prefill: the prompt's first ``kv_prefix_tokens`` tokens' KV was pushed here; it goes to the prefix
        cache just before the request is added, and the rest of the prompt prefills here."""
        try:
            handover = self.handoff.claim(request, params)
        except StatusError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                await context.abort(err.code, err.message)
            self._pod.metrics.kv_loaded("recomputed")  # gone (its lease expired): this pod computes it
            await self._stream(request, params, None, context)
            return
        self._pod.metrics.kv_loaded("loaded")
        try:
            await self._stream(request, params, None, context, before_add=handover.hand_over)
        finally:
            await self.handoff.release_claim(handover)

    async def _load_failed(self, request: decode_pb2.DecodeRequest, params: SamplingParams, err: StatusError,
                           context) -> None:
        """No KV for a prefilled request: fail it, or prefill its prompt and first token here."""
        if self.load_failure_policy != "recompute":
            self._pod.metrics.kv_loaded("failed")
            await context.abort(err.code, err.message)
        self._pod.metrics.kv_loaded("recomputed")
        recompute = decode_pb2.DecodeRequest()
        recompute.CopyFrom(request)
        recompute.ClearField("first_token_id")
        recompute.ClearField("first_token_logprob")
        recompute.resume_token_ids[:] = [request.first_token_id]
        await self._stream(recompute, params, None, context)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        if await self.handoff.abort(request.request_id):
            return common_pb2.AbortResponse(found=True)
        found = await asyncio.wrap_future(self._pod.engine_loop.abort(request.request_id))
        return common_pb2.AbortResponse(found=found)

    # ---- one request -----------------------------------------------------------------------------------------

    async def _checked_params(self, request: decode_pb2.DecodeRequest, context) -> SamplingParams:
        """Every pod's checks (``checked_params``), then a decode pod's: the first token in the vocabulary, and one way
        in (a first token, a migration's resumed tokens, or a split prefill's pushed prefix)."""
        params = await checked_params(request, context)
        vocab_size = self._pod.engine.model_config.vocab_size
        if request.HasField("first_token_id") and not 0 <= request.first_token_id < vocab_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"first_token_id must be in [0, {vocab_size}), got {request.first_token_id}")
        if request.HasField("first_token_id") and request.resume_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "resume_token_ids: a migrated request prefills here; it cannot have a first_token_id")
        if request.kv_prefix_tokens and (request.HasField("first_token_id") or request.resume_token_ids
                                         or not 0 < request.kv_prefix_tokens < len(request.prompt_token_ids)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kv_prefix_tokens must be in (0, {len(request.prompt_token_ids)}) (the prompt's "
                                f"length), without first_token_id or resume_token_ids; got {request.kv_prefix_tokens}")
        return params

    async def _stream(self, request: decode_pb2.DecodeRequest, params: SamplingParams,
                      admission: Admission | None, context,
                      before_add: Callable[[LLMEngine], None] | None = None) -> None:
        """Run the request in the engine and write its tokens; closing the stream early aborts it there.
        ``before_add`` runs on the engine thread just before a request that prefills here is added."""
        # A migrated request's first token here is not its first: the clock counts it as an inter-token gap.
        clock = _TokenClock.start(self._pod.metrics, prefilled=admission is not None or bool(request.resume_token_ids))
        prompt, resumed = list(request.prompt_token_ids), list(request.resume_token_ids)

        def add_here(engine: LLMEngine) -> Sequence:
            if before_add is not None:
                before_add(engine)
            seq = engine.add_request(request.request_id, prompt, params, resumed, priority=request.priority)
            seq.tpot_target_s = request.tpot_target_seconds  # 0 when unset: the pod's default
            return seq

        add = admission.admit if admission is not None else add_here
        events = self._pod.engine_loop.generate(request.request_id, prompt, params, add=add)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    await self._send(event, params, admission is not None, clock, context)
        except ValueError as err:  # the engine refused the request
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except StatusError as err:  # no room for a sample's copy of the prompt's last block
            await context.abort(err.code, err.message)

    async def _send(self, event: TokenEvent, params: SamplingParams, prefilled: bool, clock: _TokenClock,
                    context) -> None:
        if event.token_ids or event.prompt_logprobs is not None:  # a scored prompt's: its logprobs, no token
            if event.token_ids:
                clock.on_tokens(len(event.token_ids))
            chunk = decode_pb2.DecodeChunk(token_ids=event.token_ids)
            if params.logprobs is not None:
                chunk.logprobs.tokens.extend(token_logprob_from_dict(token_id, logprobs, params.logprobs)
                                             for token_id, logprobs in zip(event.token_ids, event.logprobs))
            if event.prompt_logprobs is not None:
                chunk.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(event.prompt_logprobs))
            await context.write(decode_pb2.DecodeResponse(chunk=chunk))
        if not event.finished:
            return
        clock.on_finish(event.finish_reason, event.seq.num_prompt_tokens, event.seq.num_output_tokens)
        if event.error is not None:  # UNAVAILABLE where a dead tensor-parallel rank failed the pod (it is ending)
            lost = rank_lost(self._pod.engine.runner.model)
            await context.abort(grpc.StatusCode.UNAVAILABLE if lost else grpc.StatusCode.INTERNAL,
                                f"decode failed: {event.error}")
        if not prefilled:
            self._observe_prefill(event.seq)
        complete = _complete(event, params, prefilled, clock.arrived_at)
        await context.write(decode_pb2.DecodeResponse(complete=complete))

    def _observe_prefill(self, seq: Sequence) -> None:
        if seq.first_token_time is None:
            return  # aborted before its first token
        metrics = self._pod.metrics
        metrics.request_queue_time.observe(seq.first_scheduled_time - seq.arrival_time)
        metrics.request_prefill_time.observe(seq.first_token_time - seq.first_scheduled_time)
        metrics.prompt_tokens.inc(seq.num_prompt_tokens)


def _complete(event: TokenEvent, params: SamplingParams, prefilled: bool,
              arrived_at: float) -> decode_pb2.DecodeComplete:
    seq = event.seq
    complete = decode_pb2.DecodeComplete(
        finish_reason=finish_reason_to_proto(event.finish_reason),
        usage=common_pb2.Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
                               cached_tokens=0 if prefilled else event.num_cached_tokens),
    )
    if event.stop_reason in params.stop_token_ids:  # EOS leaves it unset, as vLLM's stop_reason does
        complete.stop_token_id = event.stop_reason
    if seq.first_scheduled_time is not None:
        # A prefilled request is "scheduled" when admitted; one prefilled here queued since add_request.
        complete.queue_seconds = seq.first_scheduled_time - (arrived_at if prefilled else seq.arrival_time)
        if not prefilled and seq.first_token_time is not None:
            complete.prefill_seconds = seq.first_token_time - seq.first_scheduled_time
    return complete


async def build_decode_services(pod: Pod, config: DecodeConfig) -> list[PodService]:
    if config.tpot_slack_chunking:  # before the engine loop starts: the engine is this thread's alone
        await asyncio.to_thread(pod.engine.warm_up_step_times)
        logger.info("step-time model after warm-up: %s", pod.engine.step_times.model)
    handoff = KVHandoff(pod.engine_loop, config.kv_lease_s,
                        on_expired=lambda request_id: pod.metrics.kv_leases_expired.inc())
    await handoff.start()
    pod.on_stop(handoff.stop)
    shm = ShmArenaViews(config.kv_shm_dir)
    pod.on_stop(lambda: asyncio.to_thread(shm.close))
    receiver = KVTransferServicer(pod.engine_loop, handoff, pod.metrics, config.accepted_kv_codecs,
                                  config.kv_load_failure_policy, shm)
    return [DecodeServicer(pod, handoff, config.kv_load_failure_policy), receiver]


def main(argv: list[str]) -> None:
    config = parse_config(DecodeConfig, argv, prog="python -m splitserve.decode_service")
    run_pod(config, config.role, lambda pod: build_decode_services(pod, config))

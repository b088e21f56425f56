"""The ``Prefill`` gRPC service: prefill one prompt, push its KV to a decode pod, return the first token.

A request's path:

    Prefill(request)     check the request (INVALID_ARGUMENT naming the field), the queue (RESOURCE_EXHAUSTED)
      KVTransferClient.open(decode_address, codec)   handshake once per (decode pod, codec): FAILED_PRECONDITION
                                                     or UNAVAILABLE from the decode pod come back as they are
      two tasks, side by side:
        prefill          EngineLoop.generate with max_tokens=1; the request enters the engine with its sender
                         registered in the KV export hook, so each step's layers stream out as they finish.
                         Concurrent Prefill calls join the same engine steps under the token budget.
        push             KVSender.push(): header, chunks as layers arrive, trailer, the decode pod's ack
      both done          -> PrefillResponse(first token, logprobs, prompt logprobs, cached tokens, queue/prefill
                            seconds, stats)
      either fails       -> the other is cancelled: an aborted engine request frees its blocks, a cancelled push
                            makes the decode pod release its reservation; the failure's status is the answer
    n > 1 samples        one prefill samples every sample's first token (sample i seeded seed + i), and the KV goes
                         once, for n claims: each sample's Decode call forks its own sequence off it
    scoring              a request that generates nothing (max_tokens 0, no decode_address): the prompt is
                         prefilled for its prompt logprobs, nothing is sampled, no KV goes anywhere
    Abort(request_id)    cancels the call's work the same way; the call ends CANCELLED
(The pod's load is served by ``PodStatus``, runtime/pod_status.py, on every pod.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math

import grpc

from splitserve.engine.engine_loop import TokenEvent
from splitserve.engine.parallel.workers import rank_lost
from splitserve.engine.sampling.params import SamplingParams
from splitserve.kvtransfer import push_hold
from splitserve.kvtransfer.handshake import KVLayout
from splitserve.kvtransfer.link_codec import LinkCodecChooser, QualityTable
from splitserve.kvtransfer.sender import KVSender, KVTransferClient
from splitserve.kvtransfer.shm_arena import ShmLinks
from splitserve.prefill_service.config import PrefillConfig
from splitserve.prefill_service.kv_export import PrefillKVExport
from splitserve.protos.convert import prompt_logprobs_to_proto, token_logprob_from_dict
from splitserve.runtime.config import parse_config
from splitserve.runtime.errors import StatusError
from splitserve.runtime.pod_server import Pod, PodService, checked_params, run_pod
from splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    service_name = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name

    def __init__(self, pod: Pod, config: PrefillConfig, kv_client: KVTransferClient, export: PrefillKVExport):
        self._pod = pod
        self._config = config
        self.kv_client = kv_client
        self._export = export
        self._in_flight: dict[str, asyncio.Task] = {}  # request id -> its prefill-and-push work

    def add_to_server(self, server: grpc.aio.Server) -> None:
        prefill_pb2_grpc.add_PrefillServicer_to_server(self, server)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        params = await _checked_params(request, context)
        if request.request_id in self._in_flight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id!r} is already here")
        if self._pod.queue_full():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the prefill queue is full")
        # The push may not outlive the call, nor wait forever on a stalled decode pod.
        remaining_s = context.time_remaining()
        timeout_s = min(self._config.kv_transfer_timeout_s, remaining_s if remaining_s is not None else math.inf)
        work = asyncio.ensure_future(self._prefill_and_push(request, params, timeout_s))
        self._in_flight[request.request_id] = work
        try:
            event, stats = await work
        except StatusError as err:
            self._pod.metrics.transfer_failed(err.code.name)
            await context.abort(err.code, err.message)
        except ValueError as err:  # the engine refused the prompt
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the client went away; cancelling ``work`` already cleaned up
            await context.abort(grpc.StatusCode.CANCELLED, f"request {request.request_id!r} was aborted")
        finally:
            self._in_flight.pop(request.request_id, None)
        if _failed(event):
            # A step that met a dead tensor-parallel rank failed the pod, which is ending: the router tries others.
            code = grpc.StatusCode.UNAVAILABLE if rank_lost(self._pod.engine.runner.model) else grpc.StatusCode.INTERNAL
            await context.abort(code, f"prefill failed: {event.error or 'aborted by the engine'}")
        if stats is not None:  # the push is acknowledged: the decode pod holds the KV under its lease
            await push_hold.hold(push_hold.BEFORE_ANSWER, request.request_id)
        return self._respond(request, params, event, stats)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        work = self._in_flight.get(request.request_id)
        if work is not None:
            work.cancel()
        return common_pb2.AbortResponse(found=work is not None)

    # ---- one request -----------------------------------------------------------------------------------------

    async def _prefill_and_push(self, request: prefill_pb2.PrefillRequest, params: SamplingParams,
                                timeout_s: float) -> tuple[TokenEvent, prefill_pb2.KVTransferStats | None]:
        if not request.decode_address:  # scoring: nothing is generated, so no decode pod needs the KV
            return await self._prefill(request, params, None), None
        sender = await self.kv_client.open(request.decode_address, request.kv_codec,
                                            request.request_id, list(request.prompt_token_ids),
                                            request.kv_lease_seconds, timeout_s, num_claims=params.n)
        push = asyncio.create_task(sender.push(), name=f"push-{request.request_id}")
        prefill = asyncio.create_task(self._prefill(request, params, sender), name=f"prefill-{request.request_id}")
        try:
            pending = {push, prefill}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if push in done:
                    push.result()  # raises the decode pod's refusal, which explains more than anything after it
                if prefill in done and _failed(prefill.result()):
                    return prefill.result(), None  # the push would wait forever for layers that never come
            return prefill.result(), push.result()
        finally:
            for task in (push, prefill):
                task.cancel()
            await asyncio.gather(push, prefill, return_exceptions=True)
            # On the engine thread, behind the admission that registered it (queued even if we were cancelled).
            self._pod.engine_loop.call(lambda engine: self._export.unregister(request.request_id))

    async def _prefill(self, request: prefill_pb2.PrefillRequest, params: SamplingParams,
                       sender: KVSender | None) -> TokenEvent:
        """Run the prompt through the engine with its sender (if any) registered; the final event (first token)."""
        request_id, prompt = request.request_id, list(request.prompt_token_ids)

        def add(engine):
            seq = engine.add_request(request_id, prompt, params, priority=request.priority)
            if sender is not None:
                self._export.register(seq, sender)  # same engine command: no step can run in between
            return seq

        async with contextlib.aclosing(self._pod.engine_loop.generate(request_id, prompt, params, add=add)) as events:
            async for event in events:
                if event.finished:
                    break
        if sender is not None:
            sender.prefill_finished()
        return event

    def _respond(self, request: prefill_pb2.PrefillRequest, params: SamplingParams, event: TokenEvent,
                 stats: prefill_pb2.KVTransferStats) -> prefill_pb2.PrefillResponse:
        seq = event.seq
        queue_s = seq.first_scheduled_time - seq.arrival_time
        prefill_s = seq.first_token_time - seq.first_scheduled_time
        metrics = self._pod.metrics
        metrics.request_queue_time.observe(queue_s)
        metrics.request_prefill_time.observe(prefill_s)
        metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        response = prefill_pb2.PrefillResponse(num_cached_tokens=event.num_cached_tokens, queue_seconds=queue_s,
                                               prefill_seconds=prefill_s)
        if stats is not None:
            metrics.kv_transfer_time.observe(stats.exposed_transfer_seconds)
            metrics.transfer_bytes(stats.codec).inc(stats.bytes_sent)
            metrics.transfer_raw_bytes(stats.codec).inc(stats.raw_bytes)
            metrics.transfer_done(stats.transport)
            response.kv_transfer.CopyFrom(stats)
        if event.token_ids:
            response.first_token_id = event.token_ids[0]
        if event.token_ids and params.logprobs is not None:
            response.first_token_logprob.CopyFrom(
                token_logprob_from_dict(event.token_ids[0], event.logprobs[0], params.logprobs))
        if params.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(seq.prompt_logprobs))
        for token_id, logprobs in seq.sample_first_tokens:  # samples 1..n-1 of an n > 1 request
            response.more_first_token_ids.append(token_id)
            if params.logprobs is not None:
                response.more_first_token_logprobs.append(token_logprob_from_dict(token_id, logprobs, params.logprobs))
        return response


def _failed(event: TokenEvent) -> bool:
    return event.error is not None or event.finish_reason == "abort"


async def _checked_params(request: prefill_pb2.PrefillRequest, context) -> SamplingParams:
    """The request's sampling params for the prefill step (max_tokens=1, or 0 when scoring), after every pod's checks
    (``checked_params``); INVALID_ARGUMENT naming the field."""
    params = await checked_params(request, context)
    scoring = params.max_tokens == 0
    if scoring == bool(request.decode_address):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address must be set, except for a request "
                            "that generates nothing (sampling_params.max_tokens 0), which must leave it empty")
    # One token here; min_tokens still holds EOS back for it if the request asked for any.
    return dataclasses.replace(params, max_tokens=0 if scoring else 1, min_tokens=min(params.min_tokens, 1))


async def build_prefill_services(pod: Pod, config: PrefillConfig) -> list[PodService]:
    # Before serving, and before the engine loop starts (the engine is this thread's alone): the router's hybrid
    # placement predicts this pod's prefills from its step-time model, which one real prompt alone fits to nonsense
    # (a 374-token prompt predicted at 11.7 s after a 16-token one: the fit put all of it on the attention term).
    await asyncio.to_thread(pod.engine.warm_up_step_times, 1)  # one token: a prefill pod samples the first, no more
    logger.info("step-time model after warm-up: %s", pod.engine.step_times.model)
    export = PrefillKVExport(pod.engine)
    pod.engine.kv_export = export
    layout = KVLayout.of_engine(pod.engine)
    table = (QualityTable.load(config.kv_quality_table) if config.kv_quality_table
             else QualityTable.shipped(layout.model_name))
    kv_client = KVTransferClient(layout, config.max_chunk_bytes, config.overlap_transfer,
                                 corrupt_chunk_rate=config.inject_corrupt_chunks,
                                 link_codecs=LinkCodecChooser(layout, table, config.kv_min_agreement),
                                 shm_links=ShmLinks(config.kv_transport == "auto", config.kv_shm_arena_bytes))
    pod.on_stop(kv_client.close)
    return [PrefillServicer(pod, config, kv_client, export)]


def main(argv: list[str]) -> None:
    config = parse_config(PrefillConfig, argv, prog="python -m splitserve.prefill_service")
    run_pod(config, "prefill", lambda pod: build_prefill_services(pod, config))

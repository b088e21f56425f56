"""A pod's load: measured on the engine thread after every step and admission, served without waiting on the engine.

    engine thread   EngineLoop's observer -> LoadTracker.observe(engine, stats): the step's metrics (tokens per
                    step, preemptions, prefix-cache lookups), recent prefill throughput and decode step time, and
                    a new PodLoad snapshot, handed to the event loop
    event loop      LoadTracker.load is the latest snapshot; the gauges follow it; watchers wake up
    PodStatus       GetLoad: the latest snapshot, at once; WatchLoad: the latest at once, then each new one (at most
                    one per min_interval_seconds), and the last one again every HEARTBEAT_S while nothing changes

So a pod deep in a long prefill step still answers at once with what it last knew, and the router sees every
admission and every step within milliseconds. Liveness is the health service's: a silent load stream means a busy
pod, never a dead one.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from splitserve.engine.kernels.cpu_features import matrix_flags
from splitserve.engine.llm_engine import LLMEngine, StepStats
from splitserve.engine.scheduler import Scheduler
from splitserve.protos.convert import step_time_to_proto
from splitserve.runtime.metrics import PodMetrics
from splitserve.v1 import common_pb2, pod_status_pb2, pod_status_pb2_grpc

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # a watcher hears at least this often, so it can tell a quiet pod from a broken stream
DEFAULT_MIN_INTERVAL_S = 0.02
SMALLEST_MIN_INTERVAL_S = 0.005
# Weight of the newest step in the recent prefill throughput and decode step time (exponential averages).
RECENT_WEIGHT = 0.3


class LoadTracker:
    """The pod's latest ``PodLoad``: written by the engine thread (``observe``), read on the event loop."""

    def __init__(self, metrics: PodMetrics):
        self.metrics = metrics
        self.load = common_pb2.PodLoad()
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop that serves; set by attach()
        self._changed = asyncio.Event()
        # Engine thread only:
        self._version = 0
        self._prefill_tokens_per_second = 0.0
        self._decode_step_seconds = 0.0
        self._prefix_counts_seen = (0, 0)
        self._draining = False  # set from the event loop; read by the next snapshot

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Snapshots go to ``loop`` from now on (the pod calls this as it starts serving)."""
        self._loop = loop

    # ---- engine thread ---------------------------------------------------------------------------------------

    def observe(self, engine: LLMEngine, stats: StepStats | None) -> None:
        if stats is not None:
            self._record_step(stats)
        self._count_prefix_lookups(engine)
        if self._loop is not None:
            self._version += 1
            self._loop.call_soon_threadsafe(self._publish, self._snapshot(engine))

    def _record_step(self, stats: StepStats) -> None:
        self.metrics.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
        if stats.num_preempted:
            self.metrics.num_preemptions.inc(stats.num_preempted)
        self.metrics.spec_decoded(stats.spec_decode)
        if stats.seconds <= 0:
            return
        if stats.num_prefill_tokens:
            rate = stats.num_prefill_tokens / stats.seconds
            self._prefill_tokens_per_second = _recent(self._prefill_tokens_per_second, rate)
        elif stats.num_decode_tokens:
            self._decode_step_seconds = _recent(self._decode_step_seconds, stats.seconds)

    def _count_prefix_lookups(self, engine: LLMEngine) -> None:
        # The block manager counts since start; Prometheus counters take increments.
        blocks = engine.block_manager
        seen_queries, seen_hits = self._prefix_counts_seen
        if blocks.prefix_queries > seen_queries:
            self.metrics.prefix_cache_queries.inc(blocks.prefix_queries - seen_queries)
        if blocks.prefix_hits > seen_hits:
            self.metrics.prefix_cache_hits.inc(blocks.prefix_hits - seen_hits)
        self._prefix_counts_seen = (max(seen_queries, blocks.prefix_queries), max(seen_hits, blocks.prefix_hits))

    def _snapshot(self, engine: LLMEngine) -> common_pb2.PodLoad:
        return common_pb2.PodLoad(
            **scheduler_load(engine.scheduler, time.monotonic()), draining=self._draining, version=self._version,
            prefill_tokens_per_second=self._prefill_tokens_per_second,
            decode_step_seconds=self._decode_step_seconds, step_time=step_time_to_proto(engine.step_times.model),
            quantization=engine.config.weights_format, tensor_parallel_size=engine.config.tensor_parallel_size,
            pipeline_parallel_size=engine.config.pipeline_parallel_size, prefill_compute_dtype=engine.prefill_compute,
            cpu_features=matrix_flags())

    # ---- event loop ------------------------------------------------------------------------------------------

    def _publish(self, load: common_pb2.PodLoad) -> None:
        if load.version <= self.load.version:
            return  # an older snapshot overtaken by a newer one
        self.load = load
        self.metrics.num_requests_running.set(load.num_running)
        self.metrics.num_requests_waiting.set(load.num_waiting)
        if load.total_kv_blocks:
            self.metrics.kv_cache_usage.set(1.0 - load.free_kv_blocks / load.total_kv_blocks)
        self._changed.set()
        self._changed = asyncio.Event()

    def start_draining(self) -> None:
        """From now on every snapshot says the pod is draining; watchers hear it at once."""
        self._draining = True
        load = common_pb2.PodLoad()
        load.CopyFrom(self.load)
        load.draining, load.version = True, self.load.version + 1
        self._version = max(self._version, load.version)  # the engine's next snapshot comes after this one
        self._publish(load)

    async def wait_for_change(self, timeout_s: float) -> None:
        """Returns when a new snapshot is published, or after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


def scheduler_load(scheduler: Scheduler, now: float) -> dict:
    """The load fields a pod's scheduler and block pool say at ``now`` (the simulator's pods publish them too)."""
    blocks = scheduler.block_manager
    # Tokens still to compute before each request samples again: all of a waiting one's (preempted or
    # migrated ones included), the rest of a running one's prefill (0 once it decodes).
    queued = sum(seq.num_tokens - seq.num_computed_tokens for seq in scheduler.waiting)
    queued += sum(max(0, seq.num_tokens - 1 - seq.num_computed_tokens) for seq in scheduler.running)
    decoding = [seq for seq in scheduler.running if seq.num_computed_tokens == seq.num_tokens - 1]
    allowance = (scheduler.prefill_budget.allowance_s(decoding, now, bool(scheduler.awaiting_kv))
                 if scheduler.prefill_budget is not None else None)
    return dict(num_waiting=scheduler.num_waiting, num_running=scheduler.num_running,
                free_kv_blocks=blocks.num_free_blocks, total_kv_blocks=blocks.num_blocks, block_size=blocks.block_size,
                kv_window=blocks.window or 0,
                queued_prefill_tokens=queued, running_context_tokens=sum(seq.num_tokens for seq in decoding),
                tpot_allowance_seconds=allowance)


def _recent(average: float, value: float) -> float:
    return value if average == 0.0 else (1 - RECENT_WEIGHT) * average + RECENT_WEIGHT * value


class PodStatusServicer(pod_status_pb2_grpc.PodStatusServicer):
    service_name = pod_status_pb2.DESCRIPTOR.services_by_name["PodStatus"].full_name

    def __init__(self, tracker: LoadTracker):
        self._tracker = tracker

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pod_status_pb2_grpc.add_PodStatusServicer_to_server(self, server)

    async def GetLoad(self, request: pod_status_pb2.LoadRequest, context) -> common_pb2.PodLoad:
        return self._tracker.load

    async def WatchLoad(self, request: pod_status_pb2.WatchLoadRequest, context):
        interval = max(request.min_interval_seconds or DEFAULT_MIN_INTERVAL_S, SMALLEST_MIN_INTERVAL_S)
        while True:
            sent = self._tracker.load
            yield sent
            await asyncio.sleep(interval)
            if self._tracker.load.version == sent.version:
                await self._tracker.wait_for_change(HEARTBEAT_S)

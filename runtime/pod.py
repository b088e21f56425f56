"""One serving process, a "pod": the engine, its thread, the gRPC server, metrics and the registry heartbeat.

Prefill, decode and mixed pods all start here; only their gRPC services differ:

    python -m prefill_service | decode_service  ->  parse_config(ServiceConfig)  ->  run_pod(config, role, build)
      Pod(config, role)        builds the LLMEngine (loads the model) and its EngineLoop
      build(pod)               the role's services (and their cleanups, ``pod.on_stop``)
      pod.start(services)      engine thread; grpc.aio server with the KV path's message limits, the services,
                               health (SERVING: the engine is loaded by now) and reflection; Prometheus /metrics on
                               metrics_port; a task refreshing the load snapshot, gauges and prefix-cache counters;
                               with registry=redis, a RedisHeartbeat publishing the load under advertise_address
      SIGTERM / SIGINT         pod.stop(): health NOT_SERVING, heartbeat deregistered, in-flight calls drained for
                               shutdown_grace_s, cleanups run, engine thread stopped

``PodConfig`` holds the fields every pod shares; each service's config dataclass extends it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from protos.splitserve.v1 import common_pb2
from runtime import transport
from runtime.config import described, member
from runtime.logs import configure_logging
from runtime.metrics import PodMetrics
from runtime.registry import RedisHeartbeat, RegistryKind
from runtime.roles import Role

logger = logging.getLogger(__name__)


@dataclass
class PodConfig:
    """Settings every pod shares: where it listens, which model, the engine's cache and batching, the registry."""

    host: str = field(default="0.0.0.0", metadata=described("Address the gRPC server listens on."))
    port: int = field(default=50060, metadata=described("gRPC port of all the pod's services (0: any free port)."))
    advertise_address: str = field(default="", metadata=described(
        "host:port other pods and the router reach this pod at (empty: this host's name and the port)."))
    metrics_port: int = field(default=9400, metadata=described("Port of the Prometheus /metrics endpoint (0: any free)."))
    model: str = field(default=DEFAULT_MODEL, metadata=described(
        f"{DEFAULT_MODEL}, tiny-random, a HF checkpoint directory or a .gguf file."))
    device: str = field(default="cpu", metadata=described("Torch device: cpu, cuda, cuda:1."))
    dtype: str = field(default="float32", metadata=described("Compute dtype: float32, bfloat16, float16."))
    seed: int = field(default=0, metadata=described("Seeds random-weight models and unseeded sampling."))
    num_threads: int = field(default=0, metadata=described(
        "Torch compute threads (0: torch's default, one per core); pods sharing a machine split its cores."))
    cpu_kernels: bool = field(default=True, metadata=described(
        "Native CPU kernels for float32 on CPU (built at first use with g++); false: PyTorch ops only."))
    # The engine's cache and scheduler settings, with the engine's own defaults (engine/config.py).
    block_size: int = field(default=CacheConfig.block_size, metadata=described("Tokens per KV block."))
    kv_cache_memory_bytes: int = field(default=CacheConfig.kv_cache_memory_bytes, metadata=described(
        "Memory for the KV block pool."))
    num_blocks: int = field(default=CacheConfig.num_blocks, metadata=described(
        "Blocks in the KV pool (> 0 overrides the memory budget)."))
    cache_dtype: str = field(default=CacheConfig.cache_dtype, metadata=described(
        "dtype of the KV cache: float16, bfloat16 (half float32's bytes per token) or float32; attention computes "
        "in float32."))
    enable_prefix_caching: bool = field(default=CacheConfig.enable_prefix_caching, metadata=described(
        "Reuse the KV of shared prompt prefixes."))
    max_num_batched_tokens: int = field(default=SchedulerConfig.max_num_batched_tokens, metadata=described(
        "Token budget of one engine step (with chunked prefill: how much prefill rides along with the decodes)."))
    max_num_seqs: int = field(default=SchedulerConfig.max_num_seqs, metadata=described("Requests running at once."))
    long_prefill_token_threshold: int = field(default=SchedulerConfig.long_prefill_token_threshold,
                                              metadata=described(
        "Prompts longer than this prefill in chunks of this many tokens."))
    max_waiting_requests: int = field(default=1024, metadata=described(
        "Requests queued in the engine beyond which new ones get RESOURCE_EXHAUSTED (0: no limit)."))
    registry: RegistryKind = field(default=RegistryKind.STATIC, metadata=described(
        "How the router finds this pod: 'static' (its flags) or 'redis' (a heartbeat here)."))
    redis_url: str = field(default="redis://localhost:6379/0", metadata=described("Redis registry: server URL."))
    heartbeat_ttl_s: float = field(default=10.0, metadata=described("Redis registry: expiry of this pod's key."))
    load_refresh_interval_s: float = field(default=1.0, metadata=described(
        "Seconds between refreshes of the load snapshot, the gauges and the heartbeat's load."))
    shutdown_grace_s: float = field(default=10.0, metadata=described("On SIGTERM, time in-flight calls get to finish."))

    def __post_init__(self) -> None:
        self.registry = member(RegistryKind, "registry", self.registry)
        for name in ("port", "metrics_port", "max_waiting_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("heartbeat_ttl_s", "load_refresh_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self.engine_config()  # the engine's own checks, so that a bad value fails at start, naming its field

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, device=self.device, dtype=self.dtype, seed=self.seed, cpu_kernels=self.cpu_kernels,
            cache=CacheConfig(self.block_size, self.kv_cache_memory_bytes, self.num_blocks,
                              self.enable_prefix_caching, self.cache_dtype),
            scheduler=SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                                      self.long_prefill_token_threshold),
        )


class PodService(Protocol):
    """A gRPC servicer a pod hosts."""

    service_name: str  # full name ("splitserve.v1.Prefill"), for health and reflection

    def add_to_server(self, server: grpc.aio.Server) -> None: ...


class Pod:
    """One serving process's engine and servers (see the module docstring for the order of things)."""

    def __init__(self, config: PodConfig, role: Role):
        self.config = config
        self.role = Role(role)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.engine = LLMEngine(config.engine_config())
        self.engine_loop = EngineLoop(self.engine)
        self.metrics = PodMetrics(self.role, self.engine.model_config.name)
        self.load = common_pb2.PodLoad()  # the last snapshot, refreshed every load_refresh_interval_s
        self.cached_block_hashes: list[int] = []  # of the same snapshot, oldest first
        self.port = 0  # bound gRPC port, once started
        self.metrics_port = 0
        self._cleanups: list[Callable[[], Awaitable[None]]] = []
        self._prefix_counts_seen = (0, 0)
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._metrics_http = None
        self._refresher: asyncio.Task | None = None
        self._heartbeat = None

    @property
    def address(self) -> str:
        return self.config.advertise_address or f"{socket.gethostname()}:{self.port}"

    def on_stop(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        """Run ``cleanup`` at shutdown, after the server stopped taking calls (last registered, first run)."""
        self._cleanups.append(cleanup)

    def queue_full(self) -> bool:
        """The engine's waiting queue reached max_waiting_requests: new requests get RESOURCE_EXHAUSTED."""
        limit = self.config.max_waiting_requests
        return limit > 0 and self.engine.scheduler.num_waiting >= limit

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self, services: list[PodService]) -> None:
        self.engine_loop.start()
        self._server = transport.new_server()
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [service.service_name for service in services]
        for service in services:
            service.add_to_server(self._server)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server)
        self.port = transport.bind(self._server, self.config.host, self.config.port)
        await self._server.start()
        for name in ["", *names]:  # "" is the whole server
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        http_server, _ = start_http_server(self.config.metrics_port, self.config.host, self.metrics.registry)
        self._metrics_http, self.metrics_port = http_server, http_server.server_port
        await self.refresh_load()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="pod-load-refresh")
        if self.config.registry is RegistryKind.REDIS:
            await self._start_heartbeat()
        logger.info("%s pod serving %s on %s:%d (metrics on :%d)", self.role, ", ".join(names), self.config.host,
                    self.port, self.metrics_port)

    async def stop(self) -> None:
        await self._health.enter_graceful_shutdown()
        if self._heartbeat is not None:
            await self._heartbeat.stop()
        await self._server.stop(self.config.shutdown_grace_s)
        for cleanup in reversed(self._cleanups):
            await cleanup()
        self._refresher.cancel()
        await asyncio.gather(self._refresher, return_exceptions=True)
        await asyncio.to_thread(self.engine_loop.stop)
        self._metrics_http.shutdown()
        self._metrics_http.server_close()
        logger.info("%s pod stopped", self.role)

    async def _start_heartbeat(self) -> None:
        self._heartbeat = RedisHeartbeat(self.config.redis_url, self.role, self.address, self.config.heartbeat_ttl_s,
                                         self._published_load)
        await self._heartbeat.start()

    def _published_load(self) -> dict:
        """What the heartbeat publishes: the PodLoad fields and the prefix cache's block hashes."""
        fields = {f.name: getattr(self.load, f.name) for f in self.load.DESCRIPTOR.fields}
        return {**fields, "block_hashes": self.cached_block_hashes}

    # ---- load and gauges -------------------------------------------------------------------------------------

    async def refresh_load(self) -> common_pb2.PodLoad:
        """A fresh PodLoad, read on the engine thread between steps; also updates the gauges and counters."""
        load, self.cached_block_hashes, prefix_queries, prefix_hits = await self.engine_loop.run(_engine_snapshot)
        self.load = load
        self.metrics.num_requests_running.set(load.num_running)
        self.metrics.num_requests_waiting.set(load.num_waiting)
        self.metrics.kv_cache_usage.set(1.0 - load.free_kv_blocks / load.total_kv_blocks)
        # The block manager counts since start; Prometheus counters take increments.
        seen_queries, seen_hits = self._prefix_counts_seen
        self.metrics.prefix_cache_queries.inc(max(0, prefix_queries - seen_queries))
        self.metrics.prefix_cache_hits.inc(max(0, prefix_hits - seen_hits))
        self._prefix_counts_seen = (max(seen_queries, prefix_queries), max(seen_hits, prefix_hits))
        return load

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_refresh_interval_s)
            try:
                await self.refresh_load()
            except Exception:  # a missed refresh leaves stale gauges, not a dead pod
                logger.exception("refreshing the pod's load failed")


def _engine_snapshot(engine: LLMEngine) -> tuple[common_pb2.PodLoad, list[int], int, int]:
    """Engine thread: the PodLoad, the prefix cache's block hashes and its (queried, hit) token counts."""
    scheduler, blocks = engine.scheduler, engine.block_manager
    queued = sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                 for seq in (*scheduler.waiting, *scheduler.running))
    load = common_pb2.PodLoad(num_waiting=scheduler.num_waiting, num_running=scheduler.num_running,
                              free_kv_blocks=blocks.num_free_blocks, total_kv_blocks=blocks.num_blocks,
                              block_size=blocks.block_size, queued_prefill_tokens=queued)
    return load, engine.cached_block_hashes(), blocks.prefix_queries, blocks.prefix_hits


# ---- process entry ----------------------------------------------------------------------------------------------

def run_pod(config: PodConfig, role: Role, build: Callable[[Pod], Awaitable[list[PodService]]]) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    configure_logging()
    asyncio.run(_serve(config, role, build))


async def _serve(config: PodConfig, role: Role, build: Callable[[Pod], Awaitable[list[PodService]]]) -> None:
    pod = Pod(config, role)
    await pod.start(await build(pod))
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    logger.info("%s pod shutting down", role)
    await pod.stop()

"""One serving process, a "pod": the engine, its thread, the gRPC server, metrics and the registry heartbeat.

Prefill, decode and mixed pods all start here; only their gRPC services differ:

    python -m splitserve.prefill_service | decode_service
      -> parse_config(ServiceConfig) -> run_pod(config, role, build)
      Pod(config, role)        builds the LLMEngine (loads the model) and its EngineLoop, whose observer is the
                               pod's LoadTracker (runtime/pod_status.py): a load snapshot after every step
      build(pod)               the role's services (and their cleanups, ``pod.on_stop``)
      pod.start(services)      engine thread; gRPC server (runtime/transport.py) with the services, PodStatus (the
                               load, pushed as it changes), health (SERVING: the engine is loaded by now) and
                               reflection (with probe_port, health alone in plain text there: kubelet's gRPC
                               probe under TLS); Prometheus /metrics on metrics_port; with registry=redis, a
                               RedisHeartbeat publishing the load and the prefix cache's block hashes under
                               advertise_address
      engine watchdog          health NOT_SERVING (so liveness restarts the pod, readiness and the router stop
                               sending to it) while the engine thread is dead or one round of it has lasted
                               longer than engine_stall_s; SERVING again if a stall ends
      SIGTERM / SIGINT         pod.stop(), the drain: load reports say draining and health NOT_SERVING (the router
                               stops sending new requests at once), the heartbeat deregisters (best effort: Redis may
                               be gone), running calls get shutdown_grace_s to finish, cleanups run, engine stops

``PodConfig`` holds the fields every pod shares; each service's config dataclass extends it. ``checked_params`` is
the check every pod's request handler starts with (``PrefillRequest``, ``DecodeRequest``): the checks each adds are
its own.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from splitserve.engine.config import (
    COMPUTE_DTYPES,
    DEFAULT_MODEL,
    MOE_DISPATCHES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.kernels.cpu_features import matrix_features
from splitserve.engine.llm_engine import LLMEngine, StepStats
from splitserve.engine.model.moe import tokens_routed
from splitserve.engine.parallel.workers import end_process_on_rank_loss
from splitserve.engine.sampling.params import SamplingParams
from splitserve.protos.convert import sampling_params_from_proto
from splitserve.runtime import transport
from splitserve.runtime.config import described, member
from splitserve.runtime.core_lending import CoreLender, DecodeActivity, DecodeYield
from splitserve.runtime.cpus import checked_cpu_set
from splitserve.runtime.discovery import DEFAULT_REDIS_URL, HEARTBEAT_TTL_S, RedisHeartbeat, RegistryKind
from splitserve.runtime.logs import configure_logging
from splitserve.runtime.metrics import PodMetrics
from splitserve.runtime.pod_status import LoadTracker, PodStatusServicer
from splitserve.runtime.roles import Role
from splitserve.runtime.torch_threads import apply_cpu_set
from splitserve.v1 import common_pb2

logger = logging.getLogger(__name__)


@dataclass
class PodConfig:
    """Settings every pod shares: where it listens, which model, the engine's cache and batching, the registry."""

    host: str = field(default="0.0.0.0", metadata=described("Address the gRPC server listens on."))
    port: int = field(default=50060, metadata=described("gRPC port of all the pod's services (0: any free port)."))
    advertise_address: str = field(default="", metadata=described(
        "host:port other pods and the router reach this pod at (empty: this host's name and the port)."))
    metrics_port: int = field(default=9400, metadata=described(
        "Port of the Prometheus /metrics endpoint (0: any free)."))
    model: str = field(default=EngineConfig.model, metadata=described(
        f"{DEFAULT_MODEL}, tiny-random, a HF checkpoint directory or a .gguf file."))
    device: str = field(default=EngineConfig.device, metadata=described("Torch device: cpu, cuda, cuda:1."))
    dtype: str = field(default=EngineConfig.dtype, metadata=described(f"Compute dtype: {', '.join(COMPUTE_DTYPES)}."))
    seed: int = field(default=EngineConfig.seed, metadata=described(
        "Seeds random-weight models and unseeded sampling."))
    cpus: str = field(default="", metadata=described(
        "CPU set this pod runs on, e.g. '0-3,6' (empty: wherever the OS puts it); its torch and native-kernel "
        "threads default to one per CPU of the set."))
    num_threads: int = field(default=0, metadata=described(
        "Torch compute threads (0: one per CPU of --cpus, else torch's default, one per core)."))
    lend_cpus: str = field(default="", metadata=described(
        "Core lending (runtime/core_lending.py): CPUs outside --cpus that engine steps also run on (one more torch "
        "thread per CPU) while the pods of --lender-activity-files are idle or can spare them, and this pod was "
        "busy less than half of the last 5 s."))
    lender_activity_files: str = field(default="", metadata=described(
        "Comma-separated activity files of the pods that own --lend-cpus (each written by its --activity-file)."))
    activity_file: str = field(default="", metadata=described(
        "Core lending: publish in this file, after every step, how many requests this pod holds and until when they "
        "can spare its CPU (within their TPOT targets), and pause while a prefill pod borrows it."))
    cpu_kernels: bool = field(default=EngineConfig.cpu_kernels, metadata=described(
        "Native CPU kernels for float32 on CPU (built by `splitserve build-kernels`, which set-up runs; built at "
        "first use when missing); false: PyTorch ops only."))
    quantization: str = field(default=EngineConfig.quantization, metadata=described(
        f"Format the weights are kept in, one of {', '.join(QUANTIZATIONS)}: none widens them to float (the "
        "reference), gguf keeps a GGUF file's own quantized blocks, int8/int4 quantize a float checkpoint at load, "
        "auto is gguf for a GGUF file where the native kernels run (the same answers as none, bit for bit) and none "
        "elsewhere. Prefill and decode pods may differ (docs/quantization.md)."))
    int8_activations: bool = field(default=EngineConfig.int8_activations, metadata=described(
        "Products over quantized weights (--quantization other than none) quantize their inputs to int8 per block "
        "of 32 and sum integer dot products, as llama.cpp does: faster decode, answers no longer bit-equal to the "
        "float32 path's (docs/quantization.md)."))
    prefill_compute_dtype: str = field(default=EngineConfig.prefill_compute_dtype, metadata=described(
        "What prompt tokens' products compute in: auto (bfloat16 where the CPU multiplies bf16 natively, avx512_bf16 "
        "or amx_bf16, else float32), bfloat16 (from a bf16 copy of the weights, float32 accumulation, norms, "
        "attention and logits: not float32's bits) or float32 (the bit-exact reference); docs/PERFORMANCE.md."))
    tensor_parallel_size: int = field(default=EngineConfig.tensor_parallel_size, metadata=described(
        "Ranks the model is split over (engine/parallel/), each on its share of --cpus; one's exit ends the pod."))
    pipeline_parallel_size: int = field(default=EngineConfig.pipeline_parallel_size, metadata=described(
        "Ranks the layers are split over (engine/parallel/pipeline.py; not with TP > 1), as tensor_parallel_size."))
    moe_dispatch: str = field(default=EngineConfig.moe_dispatch, metadata=described(
        f"How a mixture of experts' tokens meet their experts over the TP ranks, one of {', '.join(MOE_DISPATCHES)}: "
        "all_reduce, each rank computes its experts' rows of every token and the all-reduce sums them (the faster on "
        "one host), all_to_all, the tokens are sent to their experts' ranks (docs/models.md)."))
    # The engine's cache and scheduler settings, with the engine's own defaults (engine/config.py).
    block_size: int = field(default=CacheConfig.block_size, metadata=described("Tokens per KV block."))
    kv_cache_memory_bytes: int = field(default=CacheConfig.kv_cache_memory_bytes, metadata=described(
        "Memory for the KV block pool."))
    num_blocks: int = field(default=CacheConfig.num_blocks, metadata=described(
        "Blocks in the KV pool (> 0 overrides the memory budget)."))
    cache_dtype: str = field(default=CacheConfig.cache_dtype, metadata=described(
        "What the KV pool stores: float16, bfloat16 (half float32's bytes per token), float32, or int8 (a scale per "
        "16 channels of a token and head: 1.78x float16's tokens; pods that both hold int8 push their rows as they "
        "lie); attention computes in float32 (docs/kv_cache.md)."))
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
    redis_url: str = field(default=DEFAULT_REDIS_URL, metadata=described("Redis registry: server URL."))
    heartbeat_ttl_s: float = field(default=HEARTBEAT_TTL_S, metadata=described(
        "Redis registry: expiry of this pod's key."))
    load_refresh_interval_s: float = field(default=1.0, metadata=described(
        "Redis registry: seconds between refreshes of the prefix-cache block hashes the heartbeat publishes."))
    shutdown_grace_s: float = field(default=10.0, metadata=described("On SIGTERM, time in-flight calls get to finish."))
    probe_port: int = field(default=0, metadata=described(
        "A plain-text port serving only grpc.health.v1 (kubelet's native gRPC probe, which speaks no TLS); 0: none."))
    engine_stall_s: float = field(default=60.0, metadata=described(
        "Health turns NOT_SERVING (liveness fails) when the engine thread died or one engine step (with the "
        "commands before it) has run longer than this."))
    # TLS on every gRPC link the pod serves or opens (runtime/transport.py); all empty: plaintext.
    tls_cert_file: str = field(default="", metadata=described(
        "PEM certificate of this pod: its gRPC server's identity and its client identity on the channels it opens."))
    tls_key_file: str = field(default="", metadata=described("PEM private key of tls_cert_file."))
    tls_ca_file: str = field(default="", metadata=described(
        "PEM CA certificates that peers' certificates must chain to (empty: the system's roots)."))
    tls_require_client_cert: bool = field(default=False, metadata=described(
        "Mutual TLS: the gRPC server refuses clients without a certificate signed by tls_ca_file."))
    tls_server_name: str = field(default="", metadata=described(
        "The name the certificates of the pods this pod dials (decode pods, for KV) must list, when they are "
        "dialled by IP (in Kubernetes: the pods' headless Service's DNS name); empty: the address's host."))

    def __post_init__(self) -> None:
        self.registry = member(RegistryKind, "registry", self.registry)
        own = checked_cpu_set("cpus", self.cpus)
        if self.lend_cpus and not (own and self.lender_activity_files):
            raise ValueError("lend_cpus needs cpus (the pod's own) and lender_activity_files")
        if own & checked_cpu_set("lend_cpus", self.lend_cpus):
            raise ValueError(f"lend_cpus {self.lend_cpus!r} overlaps cpus {self.cpus!r}")
        for name in ("port", "metrics_port", "probe_port", "max_waiting_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("heartbeat_ttl_s", "load_refresh_interval_s", "engine_stall_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        transport.TLSConfig.of(self).check()
        self.engine_config()  # the engine's own checks, so that a bad value fails at start, naming its field

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, device=self.device, dtype=self.dtype, seed=self.seed, cpu_kernels=self.cpu_kernels,
            quantization=self.quantization, int8_activations=self.int8_activations,
            prefill_compute_dtype=self.prefill_compute_dtype, tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size, moe_dispatch=self.moe_dispatch,
            cache=CacheConfig(self.block_size, self.kv_cache_memory_bytes, self.num_blocks,
                              self.enable_prefix_caching, self.cache_dtype),
            scheduler=SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                                      self.long_prefill_token_threshold),
        )


class PodService(Protocol):
    """A gRPC servicer a pod hosts."""

    service_name: str  # full name ("splitserve.v1.Prefill"), for health and reflection

    def add_to_server(self, server: grpc.aio.Server) -> None: ...


async def checked_params(request, context: grpc.aio.ServicerContext) -> SamplingParams:
    """A request to a pod (a ``PrefillRequest`` or ``DecodeRequest``), checked as every pod checks it: it names its
    request and its sampling parameters are valid; the call ends with INVALID_ARGUMENT naming the field if not."""
    if not request.request_id:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must be set")
    try:
        return sampling_params_from_proto(request.sampling_params)
    except ValueError as err:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling_params.{err}")


class Pod:
    """One serving process's engine and servers (see the module docstring for the order of things)."""

    def __init__(self, config: PodConfig, role: Role):
        self.config = config
        self.role = Role(role)
        lent = checked_cpu_set("lend_cpus", config.lend_cpus)  # checked before pinning narrows what is allowed
        applied = apply_cpu_set(config.cpus, config.num_threads)  # before the engine's first torch op
        self.engine = LLMEngine(config.engine_config())
        end_process_on_rank_loss(self.engine.runner.model)  # a tensor- or pipeline-parallel engine restarts whole
        self.metrics = PodMetrics(self.role, self.engine.model_config.name)
        # The engine logged its compute path (native kernels, or PyTorch and why) as it loaded.
        self.metrics.set_engine_info(self.engine.compute_path.path, config.device, config.cache_dtype,
                                     self.engine.config.weights_format, self.engine.prefill_compute,
                                     self.engine.runner.model.prefill_isa, matrix_features(), self.engine.weight_bytes)
        if self.engine.model_config.moe_layers:
            model = self.engine.runner.model
            self.metrics.count_expert_tokens(lambda: tokens_routed(model.layers))
        self.load_tracker = LoadTracker(self.metrics)
        self.lender = self._core_lender(applied.cpus, lent)
        self.yielder = DecodeYield(DecodeActivity(config.activity_file, writer=True),
                                   self.engine.config.scheduler.default_tpot_target_s) if config.activity_file else None
        self.engine_loop = EngineLoop(self.engine, observer=self._observe,
                                      on_start=self.lender and self.lender.start_on_engine_thread,
                                      before_step=self._before_step if self.lender or self.yielder else None)
        self.cached_block_hashes: list[int] = []  # the prefix cache's, oldest first (Redis heartbeat)
        self.port = 0  # bound gRPC port, once started
        self.metrics_port = 0
        self._cleanups: list[Callable[[], Awaitable[None]]] = []
        self._server: grpc.aio.Server | None = None
        self._probe_server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._metrics_http = None
        self._refresher: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._served_names: list[str] = []  # health service names: "" (the whole server) and each service
        self._heartbeat: RedisHeartbeat | None = None

    def _core_lender(self, own: frozenset[int], lent: frozenset[int]) -> CoreLender | None:
        if not lent:
            return None
        owners = [DecodeActivity(path) for path in self.config.lender_activity_files.split(",") if path]
        return CoreLender(own, lent, owners)

    def _observe(self, engine: LLMEngine, stats: StepStats | None) -> None:
        self.load_tracker.observe(engine, stats)
        if self.yielder is not None:
            self.yielder.observe(engine.scheduler.running, engine.scheduler.num_waiting, stepped=stats is not None)
        if self.lender is not None:  # after a step (or a failed one): hand a borrowed CPU back at once
            self.lender.after_step()

    def _before_step(self) -> bool:
        """Core lending (runtime/core_lending.py), on the engine thread before each step; False: not yet."""
        if self.lender is not None and self.lender.before_step():
            self.metrics.lent_cpu_steps.inc()
        if self.yielder is None:
            return True
        paused = self.yielder.paused_s
        go = self.yielder.before_step(self.engine.scheduler.num_waiting)
        self.metrics.lent_cpu_seconds.inc(self.yielder.paused_s - paused)
        return go

    @property
    def address(self) -> str:
        return self.config.advertise_address or f"{socket.gethostname()}:{self.port}"

    @property
    def load(self) -> common_pb2.PodLoad:
        """The latest load snapshot (after the engine's last step or admission)."""
        return self.load_tracker.load

    def on_stop(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        """Run ``cleanup`` at shutdown, after the server stopped taking calls (last registered, first run)."""
        self._cleanups.append(cleanup)

    def queue_full(self) -> bool:
        """The engine's waiting queue reached max_waiting_requests: new requests get RESOURCE_EXHAUSTED."""
        limit = self.config.max_waiting_requests
        return limit > 0 and self.engine.scheduler.num_waiting >= limit

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self, services: list[PodService]) -> None:
        self.load_tracker.attach(asyncio.get_running_loop())
        self.load_tracker.observe(self.engine, None)  # the first snapshot, before the engine thread runs
        self.engine_loop.start()
        services = [*services, PodStatusServicer(self.load_tracker)]
        self._server = transport.new_server()
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [service.service_name for service in services]
        for service in services:
            service.add_to_server(self._server)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server)
        tls = transport.TLSConfig.of(self.config)
        self.port = transport.bind(self._server, self.config.host, self.config.port, tls)
        await self._server.start()
        if self.config.probe_port:
            self._probe_server, _ = await transport.start_probe_server(self._health, self.config.host,
                                                                       self.config.probe_port)
        self._served_names = ["", *names]  # "" is the whole server
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watchdog = asyncio.create_task(self._watch_engine(), name="pod-engine-watchdog")
        http_server, _ = start_http_server(self.config.metrics_port, self.config.host, self.metrics.registry)
        self._metrics_http, self.metrics_port = http_server, http_server.server_port
        if self.config.registry is RegistryKind.REDIS:
            await self.refresh_block_hashes()
            self._refresher = asyncio.create_task(self._refresh_forever(), name="pod-block-hashes")
            self._heartbeat = RedisHeartbeat(self.config.redis_url, self.role, self.address,
                                             self.config.heartbeat_ttl_s, self._published_load)
            await self._heartbeat.start()
        logger.info("%s pod serving %s on %s:%d (metrics on :%d)", self.role, ", ".join(names), self.config.host,
                    self.port, self.metrics_port)

    async def stop(self) -> None:
        """The drain: no new requests from here; running ones get ``shutdown_grace_s`` to finish."""
        self.load_tracker.start_draining()
        self._watchdog.cancel()
        await asyncio.gather(self._watchdog, return_exceptions=True)
        await self._health.enter_graceful_shutdown()
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        if self._heartbeat is not None:
            await self._deregister()
        await self._server.stop(self.config.shutdown_grace_s)
        if self._probe_server is not None:
            await self._probe_server.stop(None)
        for cleanup in reversed(self._cleanups):
            await cleanup()
        await asyncio.to_thread(self.engine_loop.stop)
        self._metrics_http.shutdown()
        self._metrics_http.server_close()
        logger.info("%s pod stopped", self.role)

    async def _set_health(self, status: int) -> None:
        for name in self._served_names:
            await self._health.set(name, status)

    async def _watch_engine(self) -> None:
        """Health follows the engine thread (see the module docstring)."""
        stall_s = self.config.engine_stall_s
        serving = True
        while True:
            await asyncio.sleep(min(1.0, stall_s / 4))
            alive = self.engine_loop.alive(stall_s)
            if alive == serving:
                continue
            serving = alive
            if alive:
                logger.warning("the engine thread came round again: serving")
            else:
                logger.error("the engine thread is %s: health NOT_SERVING, so that liveness restarts the pod",
                             "stuck" if self.engine_loop.is_running() else "dead")
            await self._set_health(health_pb2.HealthCheckResponse.SERVING if alive
                                   else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _deregister(self) -> None:
        """Best effort: with Redis gone the key expires on its own, and the drain must not wait for it."""
        try:
            await asyncio.wait_for(self._heartbeat.stop(), timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - Redis down, slow, or refusing: nothing to do but say so
            logger.warning("could not deregister from Redis (%r); the key expires within %.0f s", exc,
                           self.config.heartbeat_ttl_s)

    def _published_load(self) -> dict:
        """What the heartbeat publishes: the PodLoad fields and the prefix cache's block hashes."""
        load = self.load
        fields = {f.name: getattr(load, f.name) for f in load.DESCRIPTOR.fields if f.name in _HEARTBEAT_LOAD_FIELDS}
        return {**fields, "block_hashes": self.cached_block_hashes}

    async def refresh_block_hashes(self) -> None:
        self.cached_block_hashes = await self.engine_loop.run(lambda engine: engine.cached_block_hashes())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_refresh_interval_s)
            try:
                await self.refresh_block_hashes()
            except Exception:  # a missed refresh leaves the published hashes stale, not the pod dead
                logger.exception("refreshing the prefix cache's block hashes failed")


# The load fields a Redis record carries (the registry reads them until the pod's own load stream answers).
_HEARTBEAT_LOAD_FIELDS = ("num_waiting", "num_running", "free_kv_blocks", "total_kv_blocks", "block_size",
                          "queued_prefill_tokens", "quantization", "prefill_compute_dtype")


# ---- process entry ----------------------------------------------------------------------------------------------

def run_pod(config: PodConfig, role: Role, build: Callable[[Pod], Awaitable[list[PodService]]]) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    configure_logging()
    transport.configure_process_tls(transport.TLSConfig.of(config))  # the KV channels to decode pods, too
    asyncio.run(_serve(config, role, build))


async def _serve(config: PodConfig, role: Role, build: Callable[[Pod], Awaitable[list[PodService]]]) -> None:
    pod = Pod(config, role)
    await pod.start(await build(pod))
    # What exists now (torch, the model, the services) lives as long as the process: out of every collection from
    # here, the serving loop's and the interpreter's at exit (which otherwise walks it for seconds after a SIGTERM).
    gc.freeze()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    logger.info("%s pod shutting down", role)
    await pod.stop()

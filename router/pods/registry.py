"""Which pods exist, whether they serve, how loaded they are, and which prompt blocks they hold.

Membership, liveness and load are three separate things:

- membership: ``StaticRegistry`` (addresses from flags) or ``RedisRegistry`` (pods register themselves: each pod's
  ``RedisHeartbeat``, ``runtime/discovery.py``, keeps a record alive under a key with a TTL; the router rescans
  every second; an expired key is a pod gone; with Redis unreachable, the last membership stays and the pods keep
  being watched directly; after a Redis restart, keys not yet written again by the pods' heartbeats are not pods
  gone, for one TTL);
- liveness: a ``PodMonitor`` (``router/pods/monitor.py``) per member watches the pod's ``grpc.health.v1`` status
  as a stream. SERVING: routable. NOT_SERVING (the pod is draining) or a broken stream (the process died, the
  connection broke, keepalive pings went unanswered): not routable, at once. A busy pod's stream just stays
  quiet, so busy is never mistaken for dead. A request's call that fails as if the pod were gone (UNAVAILABLE)
  makes it *suspect* (``PodRegistry.suspect``): not routable until it begins to serve again (a restart) or, if its
  health stream never broke, for ``SUSPECT_S``: the next request does not find the same dead pod before the
  stream says so;
- load: the same monitor watches ``PodStatus.WatchLoad``, a snapshot the pod pushes after each engine step. Load
  is a hint: stale or missing, it is used as it is, never a reason to drop a pod. ``PodInfo`` adds what the
  router knows itself, exactly and at once: its own requests in flight on the pod.

The router asks for the routable pods of each role (``prefill_pods()``, ``decode_pods()``, both in a
``snapshot()``) every time it places a request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from splitserve.engine.config import CacheConfig
from splitserve.engine.step_time import StepTimeModel
from splitserve.protos.convert import step_time_from_proto
from splitserve.runtime.discovery import KEY_PREFIX, PodRecord
from splitserve.runtime.roles import Role
from splitserve.v1 import common_pb2

log = logging.getLogger(__name__)

FIRST_REPORT_WAIT_S = 3.0  # how long start() waits for the pods' first health answers
# How long a pod a call found gone stays out of placement unless it restarts: its health stream breaks within
# about a second of a death on the same network (the channel reconnects every second), so a pod still serving
# after this was not dead, just refused one call.
SUSPECT_S = 2.0


@dataclass
class PodLoad:
    """A pod's queues and KV cache, as it last reported them (``common.proto`` PodLoad)."""

    num_waiting: int = 0
    num_running: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    queued_prefill_tokens: int = 0
    block_size: int = CacheConfig.block_size  # until the pod's first report says its own
    draining: bool = False
    version: int = 0
    prefill_tokens_per_second: float = 0.0
    decode_step_seconds: float = 0.0
    running_context_tokens: int = 0
    # The measured step-time model and TPOT allowance (hybrid placement): from the load stream only, not Redis.
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    tpot_allowance_seconds: float | None = None
    quantization: str = ""  # the pod's weight format; "" until its first report says
    # What its prompt tokens' products compute in (float32, bfloat16: its prefill_compute_dtype resolved on its CPU)
    # and the CPU features that chose it; "" and () until its first report says (Redis records carry the format only).
    prefill_compute_dtype: str = ""
    cpu_features: tuple[str, ...] = ()
    tensor_parallel_size: int = 0  # the ranks its model is split over; 0 until its first report says
    pipeline_parallel_size: int = 0  # the stages its layers are split over; 0 until its first report says
    kv_window: int = 0  # every layer's sliding window, the widest (0: none): what a request holds there is bounded

    @classmethod
    def from_proto(cls, message: common_pb2.PodLoad) -> "PodLoad":
        plain = {f.name: getattr(message, f.name) for f in dataclasses.fields(cls) if f.name in _PLAIN_FIELDS}
        allowance = message.tpot_allowance_seconds if message.HasField("tpot_allowance_seconds") else None
        return cls(**plain, step_time=step_time_from_proto(message.step_time), tpot_allowance_seconds=allowance,
                   cpu_features=tuple(message.cpu_features))

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "PodLoad":
        """From a Redis record's load; unknown names are ignored, values take the field's type."""
        types = {f.name: type(f.default) for f in dataclasses.fields(cls) if f.name in _PLAIN_FIELDS}
        return cls(**{name: types[name](value) for name, value in fields.items() if name in types})


_PLAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(PodLoad)) - {"step_time", "tpot_allowance_seconds",
                                                                          "cpu_features"}


@dataclass
class PodInfo:
    """One pod as the router sees it: what the pod reports, and the router's own requests on it."""

    address: str  # host:port of all the pod's gRPC services
    role: Role
    load: PodLoad = field(default_factory=PodLoad)
    block_hashes: set[int] = field(default_factory=set)  # chained hashes of blocks in its prefix cache
    serving: bool = False  # its health service says SERVING (the monitor keeps this)
    serving_since: float = 0.0  # time.monotonic() when it last began to serve (0: from the start)
    suspect_since: float | None = None  # time.monotonic() when a call to it failed as if it were gone (suspect())
    load_at: float = 0.0  # time.monotonic() of its last load report
    # The router's own bookkeeping (router.py), exact and immediate where the pod's reports lag:
    active_requests: int = 0  # this router's calls in flight here: prefills on P, Decode streams on D
    queued_prompt_tokens: int = 0  # prompt tokens sent here for prefill that have not produced a first token yet
    blocks_since_report: int = 0  # KV blocks this router's requests took here since the pod's last report

    def __post_init__(self) -> None:
        self.role = Role(self.role)
        if self.role is Role.ROUTER:
            raise ValueError("a router is not a pod")

    @property
    def can_decode(self) -> bool:
        return self.role.can_decode

    @property
    def healthy(self) -> bool:
        """Routable: serving, not draining, and not suspect (``suspect``)."""
        return self.serving and not self.load.draining and not self.suspect

    @property
    def suspect(self) -> bool:
        """A call to it failed as if it were gone, ``SUSPECT_S`` ago at most, and it has not begun to serve since
        (a restart): its health stream has not told yet whether it is."""
        since = self.suspect_since
        return since is not None and self.serving_since <= since and time.monotonic() - since < SUSPECT_S

    @property
    def busy(self) -> int:
        """Requests on the pod: the larger of its report and this router's own count (other routers' requests
        show in the report; this router's newest ones, not yet)."""
        return max(self.active_requests, self.load.num_running + self.load.num_waiting)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens waiting to be prefilled on the pod, by the same rule."""
        return max(self.queued_prompt_tokens, self.load.queued_prefill_tokens)

    @property
    def prefill_wait_s(self) -> float | None:
        """Seconds the pod would take to get through the prompt tokens queued on it, at its recent prefill rate;
        None before it has measured one."""
        rate = self.load.prefill_tokens_per_second
        return self.queued_tokens / rate if rate > 0 else None

    @property
    def free_kv_blocks(self) -> int:
        return self.load.free_kv_blocks - self.blocks_since_report

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks ``num_tokens`` take on the pod: under a sliding window (``kv_window``) at most its window's and
        two more (the blocks it reaches into and the one it fills; a prompt prefilled there in chunks takes a
        chunk's more while it prefills, which its reports then show)."""
        load = self.load
        if load.kv_window:
            num_tokens = min(num_tokens, load.kv_window + 2 * load.block_size)
        return math.ceil(num_tokens / load.block_size)

    def take_report(self, load: PodLoad) -> None:
        self.load, self.load_at, self.blocks_since_report = load, time.monotonic(), 0


@dataclass(frozen=True)
class PodSnapshot:
    """The routable pods of each kind at one moment, as placement decides over them (``router/placement.py``)."""

    prefill: list[PodInfo]
    decode: list[PodInfo]  # decode and mixed pods


class PodRegistry:
    """Membership; subclasses say who the members are. Each member gets a monitor from ``monitor_factory`` (the
    router passes one that watches the pod over gRPC); ``on_change(pod)`` hears every health or load change and
    ``on_leave(pod)`` every departure."""

    def __init__(self, monitor_factory: Callable[[PodInfo], Any] | None = None,
                 on_change: Callable[[PodInfo], None] | None = None,
                 on_leave: Callable[[PodInfo], None] | None = None):
        self.pods: dict[str, PodInfo] = {}
        self._monitor_factory = monitor_factory
        self._monitors: dict[str, Any] = {}
        self._on_change = on_change or (lambda pod: None)
        self._on_leave = on_leave or (lambda pod: None)
        self._waiters: list[asyncio.Future] = []  # wait_until's, woken at every change

    def on_change(self, pod: PodInfo) -> None:
        """A pod's health or load changed (its monitor says so)."""
        self._on_change(pod)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def suspect(self, address: str | None) -> None:
        """A call to the pod at ``address`` failed as if it were gone: out of placement until it serves again (its
        monitor sees a restart) or ``SUSPECT_S`` passes; waiters hear both."""
        pod = self.pods.get(address) if address else None
        if pod is None:
            return
        if not pod.suspect:
            log.warning("pod %s (%s) failed a call as if gone: not routing to it for up to %g s", address, pod.role,
                        SUSPECT_S)
        pod.suspect_since = time.monotonic()
        self.on_change(pod)
        asyncio.get_running_loop().call_later(SUSPECT_S, self._suspicion_over, pod)

    def _suspicion_over(self, pod: PodInfo) -> None:
        if self.pods.get(pod.address) is pod:  # still a member
            self.on_change(pod)

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Until ``condition()`` holds, checked at every pod change, for at most ``timeout_s``; whether it holds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not condition():
            left = deadline - loop.time()
            if left <= 0:
                return False
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                return condition()
        return True

    def prefill_pods(self) -> list[PodInfo]:
        return [pod for pod in self.pods.values() if pod.healthy and pod.role is Role.PREFILL]

    def decode_pods(self) -> list[PodInfo]:
        """Pods that can run a decode: decode pods and mixed pods."""
        return [pod for pod in self.pods.values() if pod.healthy and pod.can_decode]

    def snapshot(self) -> PodSnapshot:
        return PodSnapshot(self.prefill_pods(), self.decode_pods())

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        for address in list(self.pods):
            await self._leave(address)

    async def _join(self, pod: PodInfo) -> None:
        self.pods[pod.address] = pod
        if self._monitor_factory is None:  # membership alone (tests of placement): a member serves
            pod.serving = True
            return
        monitor = self._monitor_factory(pod)
        self._monitors[pod.address] = monitor
        await monitor.start()

    async def _leave(self, address: str) -> None:
        pod = self.pods.pop(address)
        monitor = self._monitors.pop(address, None)
        if monitor is not None:
            await monitor.stop()
        self._on_leave(pod)

    async def wait_for_first_reports(self, timeout_s: float = FIRST_REPORT_WAIT_S) -> None:
        """Until every monitor has its pod's first health answer (or failure), so the first request sees the
        pods that serve; a pod that is not up yet does not hold the router's start longer than ``timeout_s``."""
        waits = [monitor.first_report.wait() for monitor in self._monitors.values()]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=timeout_s)


class StaticRegistry(PodRegistry):
    """Pods from the command line, each watched from the router's start."""

    def __init__(self, prefill: list[str], decode: list[str], mixed: list[str], **kwargs: Any):
        super().__init__(**kwargs)
        self._members: list[PodInfo] = []
        seen: set[str] = set()
        for role, addresses in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.MIXED, mixed)):
            for address in addresses:
                if address in seen:
                    raise ValueError(f"pod {address} is listed twice")
                seen.add(address)
                self._members.append(PodInfo(address, role))  # not serving until its health says so

    async def start(self) -> None:
        for pod in self._members:
            await self._join(pod)
        await self.wait_for_first_reports()


class RedisRegistry(PodRegistry):
    """Pods that registered themselves in Redis; rescanned every ``scan_interval_s``."""

    def __init__(self, redis_url: str, ttl_s: float, scan_interval_s: float = 1.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.ttl_s = ttl_s
        self._redis = redis_asyncio.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._redis_reachable = True  # to log when that changes, not once a second
        self._redis_run_id: str | None = None  # the Redis server's run_id at the last scan: a new one is a restart
        self._refill_until = 0.0  # until then, after a restart, keys missing are not yet written again, not gone
        self._scan_interval_s = scan_interval_s
        self._scanner: asyncio.Task | None = None

    async def start(self) -> None:
        await self.scan()  # the first request sees the pods registered now
        await self.wait_for_first_reports()
        self._scanner = asyncio.create_task(self._scan_forever(), name="redis-registry-scan")

    async def stop(self) -> None:
        if self._scanner is not None:
            self._scanner.cancel()
            await asyncio.gather(self._scanner, return_exceptions=True)
        await super().stop()
        await self._redis.aclose()

    async def _scan_forever(self) -> None:
        while True:
            await asyncio.sleep(self._scan_interval_s)
            try:
                await self.scan()
            except Exception:  # one failed round must not end the scanning
                log.exception("scanning the pod registry failed")

    async def scan(self) -> None:
        """Make the membership the keys that exist now: new keys join, expired keys (dead pods) leave."""
        try:
            run_id = (await self._redis.info("server"))["run_id"]
            keys = [key async for key in self._redis.scan_iter(match=f"{KEY_PREFIX}:*", count=1000)]
            records = await self._redis.mget(keys) if keys else []
        except (RedisError, OSError) as exc:
            # Keep the last membership: the pods are probably fine, and their monitors still watch them.
            if self._redis_reachable:
                log.warning("cannot read the pod registry from Redis: %r; keeping the %d pods it last listed",
                            exc, len(self.pods))
            self._redis_reachable = False
            return
        if not self._redis_reachable:
            log.info("reading the pod registry from Redis again")
        self._redis_reachable = True
        self._note_restart(run_id)
        listed = {record.address: record for record in map(_parse_record, records) if record is not None}
        for address in set(self.pods) - set(listed):
            if time.monotonic() < self._refill_until:
                continue
            log.warning("pod %s left the registry (heartbeat expired or deregistered)", address)
            await self._leave(address)
        for address, record in listed.items():
            pod = self.pods.get(address)
            if pod is not None and pod.role is not record.role:  # the address now runs another role
                await self._leave(address)
                pod = None
            if pod is None:
                log.info("pod %s (%s) registered", address, record.role)
                pod = PodInfo(address, record.role, PodLoad.from_dict(record.load))
                await self._join(pod)
            pod.block_hashes = set(record.block_hashes)

    def _note_restart(self, run_id: str) -> None:
        """A Redis server that restarted lost every key: the pods write theirs again with their next heartbeat
        (within ttl_s / 3), so until ttl_s has passed a missing key is not a pod gone. Meanwhile a pod that did
        die is not routed to all the same: its monitor saw its health stream break."""
        if self._redis_run_id is not None and run_id != self._redis_run_id:
            self._refill_until = time.monotonic() + self.ttl_s
            log.warning("Redis restarted (its keys are gone): keeping the %d pods listed for up to %.0f s while "
                        "their heartbeats register them again", len(self.pods), self.ttl_s)
        self._redis_run_id = run_id


def _parse_record(record: bytes | None) -> PodRecord | None:
    """None for an expired key (gone between SCAN and MGET) or a record this router cannot read."""
    if record is None:
        return None
    try:
        parsed = PodRecord.from_json(record)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring an unreadable pod record %r: %r", record[:200], exc)
        return None
    if parsed.role is Role.ROUTER:
        log.warning("ignoring a pod record with role router: %r", record[:200])
        return None
    return parsed

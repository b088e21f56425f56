"""Which pods exist, in which role, how loaded they are, and which prompt blocks they hold.

The router asks a registry for the healthy pods of each role every time it places a request
(``prefill_pods()``, ``decode_pods()``); the registry keeps that view fresh in the background:

- ``StaticRegistry``: a fixed list of addresses (flags). It polls each pod's ``GetLoad`` every
  ``load_poll_interval_s``; a pod that refuses or fails a poll is skipped until it answers again, and one that
  only answers late (busy: its event loop waits behind the engine on a loaded machine) is skipped after
  ``MAX_LATE_POLLS`` late polls in a row, so one slow answer does not reroute its requests.
- ``RedisRegistry``: pods register themselves (``runtime/registry.py``: each pod's ``RedisHeartbeat`` keeps a
  ``PodRecord`` alive under a key with a TTL); the router reads all such keys every second. A pod that dies stops
  refreshing its key, Redis expires it, and the pod leaves the router's view within ``ttl_s`` plus a second. The
  record also carries the pod's recent prefix-cache block hashes, which the prefix-aware policy matches prompts
  against.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from protos.splitserve.v1 import common_pb2
from runtime.registry import KEY_PREFIX, PodRecord
from runtime.roles import Role

log = logging.getLogger(__name__)

MAX_LATE_POLLS = 3  # GetLoad polls in a row that may time out before a static pod is skipped


@dataclass
class PodLoad:
    """A pod's queues and KV cache, as its ``GetLoad`` reports them (see ``common.proto`` PodLoad)."""

    num_waiting: int = 0
    num_running: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    queued_prefill_tokens: int = 0
    block_size: int = 16

    @classmethod
    def from_proto(cls, message: common_pb2.PodLoad) -> "PodLoad":
        return cls(**{f.name: getattr(message, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "PodLoad":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: int(value) for name, value in fields.items() if name in known})


@dataclass
class PodInfo:
    """One pod as the router sees it."""

    address: str  # host:port of all the pod's gRPC services
    role: Role
    load: PodLoad = field(default_factory=PodLoad)
    block_hashes: set[int] = field(default_factory=set)  # chained hashes of blocks in its prefix cache
    last_seen: float = 0.0  # time.monotonic() of the last load report
    healthy: bool = True
    late_polls: int = 0  # consecutive GetLoad polls that timed out (StaticRegistry)

    def __post_init__(self) -> None:
        self.role = Role(self.role)
        if self.role is Role.ROUTER:
            raise ValueError("a router is not a pod")

    @property
    def can_decode(self) -> bool:
        return self.role.can_decode


class PodRegistry:
    """What the router needs from a registry. Subclasses fill ``self.pods`` (address -> PodInfo)."""

    def __init__(self) -> None:
        self.pods: dict[str, PodInfo] = {}

    def prefill_pods(self) -> list[PodInfo]:
        return [pod for pod in self.pods.values() if pod.healthy and pod.role is Role.PREFILL]

    def decode_pods(self) -> list[PodInfo]:
        """Pods that can run a decode: decode pods and mixed pods."""
        return [pod for pod in self.pods.values() if pod.healthy and pod.can_decode]

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError


class _PeriodicTask:
    """Runs ``refresh`` once at start (so the first request sees pods), then every ``interval_s``."""

    def __init__(self, refresh: Callable[[], Any], interval_s: float, name: str):
        self._refresh, self._interval_s, self._name = refresh, interval_s, name
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._refresh()
        self._task = asyncio.create_task(self._loop(), name=self._name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self._refresh()


class StaticRegistry(PodRegistry):
    """Pods from the command line; their load from polling ``GetLoad``.

    ``get_load(pod)`` returns the pod's ``PodLoad`` proto or raises; the router passes its pod clients' method.
    """

    def __init__(self, prefill: list[str], decode: list[str], mixed: list[str],
                 get_load: Callable[[PodInfo], Any], poll_interval_s: float = 0.5):
        super().__init__()
        for role, addresses in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.MIXED, mixed)):
            for address in addresses:
                if address in self.pods:
                    raise ValueError(f"pod {address} is listed twice")
                # Unknown until its first poll answers: a pod that never answers never gets a request.
                self.pods[address] = PodInfo(address, role, healthy=False)
        self._get_load = get_load
        # A poll that takes longer than the interval is a failed poll: the next one is due.
        self._poll_timeout_s = max(poll_interval_s, 0.2)
        self._poller = _PeriodicTask(self.poll_all, poll_interval_s, "static-registry-poll")

    async def start(self) -> None:
        await self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(pod) for pod in self.pods.values()))

    async def _poll(self, pod: PodInfo) -> None:
        try:
            message = await asyncio.wait_for(self._get_load(pod), self._poll_timeout_s)
        except Exception as exc:
            pod.late_polls = pod.late_polls + 1 if _is_timeout(exc) else MAX_LATE_POLLS
            if pod.healthy and pod.late_polls >= MAX_LATE_POLLS:
                log.warning("pod %s (%s) stopped answering GetLoad: %r; skipping it", pod.address, pod.role, exc)
                pod.healthy = False
            return
        if not pod.healthy:
            log.info("pod %s (%s) is serving", pod.address, pod.role)
        pod.load, pod.last_seen, pod.healthy, pod.late_polls = PodLoad.from_proto(message), time.monotonic(), True, 0


def _is_timeout(exc: BaseException) -> bool:
    """A poll that ran out of time (the pod may just be busy), as opposed to one the pod refused or failed."""
    return isinstance(exc, asyncio.TimeoutError) or (
        isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED)


def _parse_record(record: bytes | None) -> PodInfo | None:
    """None for an expired key (gone between SCAN and MGET) or a record this router cannot read."""
    if record is None:
        return None
    try:
        fields = PodRecord.from_json(record)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring an unreadable pod record %r: %r", record[:200], exc)
        return None
    if fields.role is Role.ROUTER:
        log.warning("ignoring a pod record with role router: %r", record[:200])
        return None
    return PodInfo(fields.address, fields.role, PodLoad.from_dict(fields.load), set(fields.block_hashes),
                   last_seen=time.monotonic())


class RedisRegistry(PodRegistry):
    """Pods that registered themselves in Redis; rescanned every ``scan_interval_s``."""

    def __init__(self, redis_url: str, ttl_s: float = 10.0, scan_interval_s: float = 1.0):
        super().__init__()
        self.ttl_s = ttl_s
        self._redis = redis_asyncio.from_url(redis_url)
        self._redis_reachable = True  # to log when that changes, not once a second
        self._scanner = _PeriodicTask(self.scan, scan_interval_s, "redis-registry-scan")

    async def start(self) -> None:
        await self._scanner.start()

    async def stop(self) -> None:
        await self._scanner.stop()
        await self._redis.aclose()

    async def scan(self) -> None:
        """Replace the view with the keys that exist now: expired keys (dead pods) drop out."""
        try:
            keys = [key async for key in self._redis.scan_iter(match=f"{KEY_PREFIX}:*", count=1000)]
            records = await self._redis.mget(keys) if keys else []
        except RedisError as exc:
            # Keep the last view: the pods are probably fine, and a pod that is not fails its calls.
            if self._redis_reachable:
                log.warning("cannot read the pod registry from Redis: %r; keeping the last view", exc)
            self._redis_reachable = False
            return
        if not self._redis_reachable:
            log.info("reading the pod registry from Redis again")
        self._redis_reachable = True
        pods = [pod for pod in map(_parse_record, records) if pod is not None]
        self._log_changes({pod.address for pod in pods})
        self.pods = {pod.address: pod for pod in pods}

    def _log_changes(self, addresses: set[str]) -> None:
        for address in addresses - set(self.pods):
            log.info("pod %s registered", address)
        for address in set(self.pods) - addresses:
            log.warning("pod %s left the registry (heartbeat expired or deregistered)", address)

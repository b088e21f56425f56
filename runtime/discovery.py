"""The pod registry's shared half: how the router finds pods (``RegistryKind``), and, for the Redis registry, the
record a pod publishes and the heartbeat that keeps it alive. The router's reading side is ``router/pods/registry.py``.

A pod with ``--registry redis`` runs a ``RedisHeartbeat``: it writes its ``PodRecord`` as JSON under
``splitserve:pods:{role}:{address}`` with an expiry of ``ttl_s``, refreshed every ``ttl_s / 3``. A pod that dies
stops refreshing its key and Redis expires it; one that stops cleanly deletes it. The key format and the JSON have
this one owner. The first beat is retried, backing off, for up to ``FIRST_BEAT_DEADLINE_S``: pods and Redis start
together (a rollout, a node's restart, DNS or a NetworkPolicy not ready yet), and a pod that gave up at once would
crash-loop with every other pod of the release.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import redis.asyncio as redis_asyncio

from splitserve.runtime.roles import POD_ROLES, Role

log = logging.getLogger(__name__)

KEY_PREFIX = "splitserve:pods"
# Where the pods' heartbeats and the router's registry meet by default (the pods' and the router's redis_url).
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# Seconds a pod's key lives without a beat: the pods' heartbeat_ttl_s and the router's pod_ttl_s (how long it keeps
# the pods it knew after Redis restarted empty) default to it, so that both sides count the same time.
HEARTBEAT_TTL_S = 10.0
# A heartbeat publishes at most this many block hashes, the pod's most recent: enough to route the prompts
# that are hot now, small enough that the router reads every pod's key every second.
MAX_PUBLISHED_BLOCK_HASHES = 8192
# How long a pod tries its first beat before it gives up (and exits, for its restart policy to decide), and the
# backoff between tries: Redis starting beside the pods answers within seconds, a wrong URL never.
FIRST_BEAT_DEADLINE_S = 120.0
FIRST_BEAT_BACKOFF_S = (0.25, 5.0)  # first wait, longest wait (doubling)


class RegistryKind(enum.StrEnum):
    STATIC = "static"  # the router is given the pod addresses (flags)
    REDIS = "redis"  # pods register themselves with a heartbeat; the router watches Redis


def pod_key(role: str, address: str) -> str:
    return f"{KEY_PREFIX}:{role}:{address}"


@dataclass
class PodRecord:
    """What a pod publishes: where it is, its role, its load (PodLoad's fields) and its prefix cache's hashes."""

    address: str
    role: Role
    load: dict[str, int | float | str] = field(default_factory=dict)  # numbers, and the weight format's name
    block_hashes: list[int] = field(default_factory=list)  # most recent last
    published_at: float = 0.0  # time.time() of the beat

    def to_json(self) -> str:
        return json.dumps({"address": self.address, "role": str(self.role), "load": self.load,
                           "block_hashes": self.block_hashes[-MAX_PUBLISHED_BLOCK_HASHES:],
                           "published_at": self.published_at})

    @classmethod
    def from_json(cls, text: str | bytes) -> "PodRecord":
        """Raises ValueError (or KeyError, TypeError) for a record that is not one."""
        fields = json.loads(text)
        return cls(address=fields["address"], role=Role(fields["role"]),
                   load={name: _load_value(name, value) for name, value in fields["load"].items()},
                   block_hashes=[int(h) for h in fields.get("block_hashes", [])],
                   published_at=float(fields.get("published_at", 0.0)))


def _load_value(name: str, value: Any) -> int | float | str:
    """A load field as published: a number (flags count as 0/1, rates stay floats) or a name (the weight format)."""
    if not isinstance(value, (int, float, str)):
        raise ValueError(f"load field {name!r}: {value!r} is not a number or a name")
    return int(value) if isinstance(value, bool) else value


class RedisHeartbeat:
    """Pod side of the Redis registry: keeps this pod's key alive with its current load.

    ``load_fn()`` returns PodLoad's fields as a dict, plus ``block_hashes`` (most recent last) when the pod
    has a prefix cache to advertise. ``stop()`` deletes the key, so a pod that shuts down cleanly leaves at
    once; ``stop(deregister=False)`` leaves it to expire, which is what a crashed pod does.
    """

    def __init__(self, redis_url: str, role: str, address: str, ttl_s: float, load_fn: Callable[[], dict[str, Any]]):
        if role not in POD_ROLES:
            raise ValueError(f"role must be one of {', '.join(POD_ROLES)}, got {role!r}")
        self.key = pod_key(role, address)
        self._role, self._address, self._ttl_s, self._load_fn = Role(role), address, ttl_s, load_fn
        self._redis = redis_asyncio.from_url(redis_url)
        self._task: asyncio.Task | None = None

    async def start(self, deadline_s: float = FIRST_BEAT_DEADLINE_S) -> None:
        """Registered before this returns (the pod is routable as soon as it serves): the first beat is retried
        with backoff until ``deadline_s``, then the last error is raised naming the key."""
        give_up_at = time.monotonic() + deadline_s
        wait_s, longest_s = FIRST_BEAT_BACKOFF_S
        while True:
            try:
                await self.beat()
                break
            except redis_asyncio.AuthenticationError:
                raise  # a wrong password does not get right by waiting
            except (OSError, redis_asyncio.ConnectionError, redis_asyncio.TimeoutError) as err:  # refused,
                # unresolvable, timed out, still loading its data
                if time.monotonic() + wait_s > give_up_at:
                    raise ConnectionError(f"the first heartbeat of {self.key} failed for {deadline_s:.0f} s: "
                                          f"{err}") from err
                log.warning("first heartbeat of %s failed (%s); retrying in %.2f s", self.key, err, wait_s)
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, longest_s)
        self._task = asyncio.create_task(self._loop(), name=f"heartbeat-{self._address}")

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if deregister:
            await self._redis.delete(self.key)
        await self._redis.aclose()

    async def beat(self) -> None:
        load = dict(self._load_fn())
        hashes = list(load.pop("block_hashes", []))
        record = PodRecord(self._address, self._role, load, hashes, time.time())
        # px: millisecond expiry, so sub-second TTLs (tests) work too.
        await self._redis.set(self.key, record.to_json(), px=int(self._ttl_s * 1000))

    async def _loop(self) -> None:
        # Three beats per TTL: one lost or late beat does not make a live pod disappear.
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self.beat()
            except Exception:  # a missed beat must not end the heartbeat: the pod would silently expire
                log.exception("heartbeat of %s failed; retrying in %.1f s", self.key, self._ttl_s / 3)

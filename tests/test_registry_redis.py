"""The Redis registry against a real redis-server on a free loopback port: pods register with a heartbeat, the
router's registry sees them with their load, and a pod whose heartbeat stops disappears after its TTL."""

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time

import pytest
import redis
import redis.asyncio

from splitserve.engine.block_manager import chained_block_hashes
from splitserve.router.pods.registry import PodLoad, RedisRegistry
from splitserve.router.config import RouterConfig
from splitserve.runtime.discovery import DEFAULT_REDIS_URL, MAX_PUBLISHED_BLOCK_HASHES, RedisHeartbeat, pod_key
from splitserve.runtime.pod_server import PodConfig

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
TTL_S = 1.0
SCAN_INTERVAL_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(directory, password: str = ""):
    """A redis-server on a free loopback port (asking for ``password`` when set); yields its port."""
    port = free_port()
    server = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(directory), *(["--requirepass", password] if password else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=password or None)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        else:
            raise RuntimeError("redis-server did not start")
        yield port
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as port:
        yield f"redis://127.0.0.1:{port}/0"


@pytest.mark.e2e
def test_a_redis_with_a_password_takes_the_url_the_chart_composes(tmp_path):
    """The chart's bundled Redis runs with --requirepass, and pods and router get redis://:<password>@host/0."""
    async def scenario(port: int):
        url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
        heartbeat = RedisHeartbeat(url, "decode", "10.0.0.5:50061", TTL_S, decode_pod_load)
        registry = RedisRegistry(url, ttl_s=TTL_S, scan_interval_s=SCAN_INTERVAL_S)
        await heartbeat.start()
        await registry.start()
        try:
            assert [p.address for p in registry.decode_pods()] == ["10.0.0.5:50061"]
        finally:
            await registry.stop()
            await heartbeat.stop()
        stranger = RedisHeartbeat(f"redis://127.0.0.1:{port}/0", "decode", "10.9.9.9:1", TTL_S, decode_pod_load)
        with pytest.raises(redis.exceptions.AuthenticationError):  # no password: no registering as a decode pod
            await stranger.start()

    with redis_server(tmp_path, PASSWORD) as port:
        asyncio.run(scenario(port))


PASSWORD = "Zq7bK2mR9xW4tY8pL3nV6cH1"  # letters and digits, like the chart's randAlphaNum 32


def decode_pod_load() -> dict:
    return {"num_waiting": 1, "num_running": 3, "free_kv_blocks": 700, "total_kv_blocks": 1024,
            "queued_prefill_tokens": 0, "block_size": 16,
            "block_hashes": chained_block_hashes(list(range(64)), 16)}


async def wait_for(condition, timeout_s: float) -> float:
    """Seconds until ``condition()`` held."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not true after {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.e2e
def test_heartbeat_registers_a_pod_and_it_expires_after_its_ttl_when_the_heartbeat_stops(redis_url):
    async def scenario():
        registry = RedisRegistry(redis_url, ttl_s=TTL_S, scan_interval_s=SCAN_INTERVAL_S)
        decode = RedisHeartbeat(redis_url, "decode", "10.0.0.5:50061", TTL_S, decode_pod_load)
        prefill = RedisHeartbeat(redis_url, "prefill", "10.0.0.6:50062", TTL_S, lambda: {"queued_prefill_tokens": 900})
        await decode.start()
        await prefill.start()
        await registry.start()
        try:
            pod = registry.pods["10.0.0.5:50061"]
            assert (pod.role, pod.healthy) == ("decode", True)
            assert pod.load == PodLoad(num_waiting=1, num_running=3, free_kv_blocks=700, total_kv_blocks=1024,
                                       queued_prefill_tokens=0, block_size=16)
            assert pod.block_hashes == set(chained_block_hashes(list(range(64)), 16))
            assert [p.address for p in registry.decode_pods()] == ["10.0.0.5:50061"]
            assert [(p.address, p.load.queued_prefill_tokens) for p in registry.prefill_pods()] == \
                [("10.0.0.6:50062", 900)]

            # Alive for several TTLs while the heartbeat runs.
            await asyncio.sleep(2.5 * TTL_S)
            assert set(registry.pods) == {"10.0.0.5:50061", "10.0.0.6:50062"}

            await decode.stop(deregister=False)  # a killed pod: no goodbye, its key just stops being refreshed
            gone_after = await wait_for(lambda: "10.0.0.5:50061" not in registry.pods, timeout_s=3 * TTL_S)
            assert gone_after <= TTL_S + 2 * SCAN_INTERVAL_S + 0.3
            assert set(registry.pods) == {"10.0.0.6:50062"}

            await prefill.stop()  # a clean shutdown deregisters at once
            await wait_for(lambda: not registry.pods, timeout_s=5 * SCAN_INTERVAL_S)
        finally:
            await registry.stop()
    asyncio.run(scenario())


@pytest.mark.e2e
def test_heartbeat_record_caps_block_hashes_and_uses_the_key_format(redis_url):
    async def scenario():
        hashes = list(range(MAX_PUBLISHED_BLOCK_HASHES + 10))
        heartbeat = RedisHeartbeat(redis_url, "mixed", "pod-a:1", 5.0, lambda: {"block_hashes": hashes})
        await heartbeat.start()
        registry = RedisRegistry(redis_url, ttl_s=5.0)
        await registry.start()
        try:
            assert heartbeat.key == pod_key("mixed", "pod-a:1") == "splitserve:pods:mixed:pod-a:1"
            pod = registry.pods["pod-a:1"]
            assert pod.block_hashes == set(hashes[10:])  # the most recent ones
            assert pod.can_decode and registry.decode_pods() == [pod]
        finally:
            await registry.stop()
            await heartbeat.stop()
    asyncio.run(scenario())


@pytest.mark.e2e
def test_unreadable_records_are_skipped(redis_url):
    async def scenario():
        client = redis.asyncio.from_url(redis_url)
        await client.set(pod_key("decode", "bad:1"), b"not json")
        registry = RedisRegistry(redis_url, ttl_s=5.0)
        await registry.start()
        try:
            assert registry.pods == {}
        finally:
            await registry.stop()
            await client.aclose()
    asyncio.run(scenario())


def test_heartbeat_rejects_an_unknown_role():
    with pytest.raises(ValueError, match="role must be one of prefill, decode, mixed, got 'router'"):
        RedisHeartbeat("redis://127.0.0.1:1/0", "router", "x:1", 1.0, dict)


@pytest.mark.e2e
def test_a_heartbeat_carries_the_weight_format_and_rates_through_redis(redis_url):
    """The load a pod publishes holds a name (its weight format) and rates beside its counts: the router reads each
    with its own type (a record that cast every field to int was skipped as unreadable, so no pod was routed to)."""
    load = {"num_running": 2, "draining": False, "prefill_tokens_per_second": 812.5, "quantization": "gguf"}

    async def scenario():
        registry = RedisRegistry(redis_url, ttl_s=TTL_S, scan_interval_s=SCAN_INTERVAL_S)
        beat = RedisHeartbeat(redis_url, "decode", "10.0.0.7:50063", TTL_S, lambda: dict(load))
        await beat.start()
        await registry.start()
        try:
            await wait_for(lambda: "10.0.0.7:50063" in registry.pods, timeout_s=5 * SCAN_INTERVAL_S)
            pod = registry.pods["10.0.0.7:50063"]
            assert (pod.load.quantization, pod.load.prefill_tokens_per_second, pod.load.num_running) == \
                ("gguf", 812.5, 2)
        finally:
            await beat.stop()
            await registry.stop()
    asyncio.run(scenario())


def test_the_pods_and_the_router_meet_at_one_default_redis_url():
    assert PodConfig().redis_url == RouterConfig(decode_pods=["d:1"]).redis_url == DEFAULT_REDIS_URL
    assert DEFAULT_REDIS_URL == "redis://localhost:6379/0"


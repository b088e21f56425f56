"""The first Redis heartbeat is retried: pods and Redis start together (a rollout, a node's restart), and a pod whose
first beat failed used to exit at once, so every pod of a release crash-looped until Redis happened to be first. A
real redis-server, started late on a free loopback port, and a heartbeat that waits for it; a wrong address gives up
at its deadline with an error naming the key."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import pytest
import redis

from splitserve.runtime.discovery import RedisHeartbeat

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_first_heartbeat_waits_for_a_redis_that_starts_late(tmp_path):
    port = _free_port()
    heartbeat = RedisHeartbeat(f"redis://127.0.0.1:{port}/0", "decode", "10.0.0.5:50062", 5.0, lambda: {})
    server = None

    async def scenario() -> float:
        nonlocal server
        started = time.monotonic()
        registering = asyncio.create_task(heartbeat.start(deadline_s=30))
        try:
            await asyncio.sleep(1.5)  # a few refused tries
            assert not registering.done()
            server = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(tmp_path)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await asyncio.wait_for(registering, timeout=20)
            waited_s = time.monotonic() - started
            assert redis.Redis(port=port).exists(heartbeat.key)
            return waited_s
        finally:
            registering.cancel()
            await heartbeat.stop(deregister=False)

    try:
        assert 1.5 <= asyncio.run(scenario()) < 15
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)


def test_a_redis_that_never_answers_fails_at_the_deadline_naming_the_key():
    heartbeat = RedisHeartbeat(f"redis://127.0.0.1:{_free_port()}/0", "prefill", "10.0.0.6:50061", 5.0, lambda: {})

    async def scenario() -> None:
        try:
            await heartbeat.start(deadline_s=1.0)
        finally:
            await heartbeat.stop(deregister=False)

    started = time.monotonic()
    with pytest.raises(ConnectionError, match="first heartbeat of splitserve:pods:prefill:10.0.0.6:50061 failed"):
        asyncio.run(scenario())
    assert time.monotonic() - started < 5

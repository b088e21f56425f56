"""What a pod needs from the runtime to start on a cluster (issue 36), on real servers:

- the probe port (``probe_port``): grpc.health.v1 alone, in plain text, beside a server on mutual TLS, so that
  kubelet's native gRPC probe (which speaks no TLS) asks the same health the TLS port serves, on any architecture
  (the chart's probes use it: test_chart_flags.py; the rendered pods answer it: test_rendered_release.py);
- the first Redis heartbeat, retried: pods and Redis start together (a rollout, a node's restart), and a pod whose
  first beat failed used to exit at once, so every pod of a release crash-looped until Redis happened to be first. A
  real redis-server, started late on a free loopback port, and a heartbeat that waits for it; a dead address gives
  up at its deadline with an error naming the key.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from rendered_release import write_tls_secret

from splitserve.decode_service.config import DecodeConfig
from splitserve.router.config import RouterConfig
from splitserve.runtime import transport
from splitserve.runtime.discovery import RedisHeartbeat

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def _check(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=3)).status


def test_the_probe_port_answers_health_in_plain_text_beside_a_mutual_tls_server(tmp_path):
    secret = write_tls_secret(tmp_path / "tls", ["localhost", "127.0.0.1"])
    tls = transport.TLSConfig(str(secret / "tls.crt"), str(secret / "tls.key"), str(secret / "ca.crt"),
                              require_client_cert=True)

    async def scenario() -> None:
        servicer = health.aio.HealthServicer()
        server = transport.new_server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        tls_port = transport.bind(server, "127.0.0.1", 0, tls)
        await server.start()
        probe, probe_port = await transport.start_probe_server(servicer, "127.0.0.1", 0)
        try:
            await servicer.set("", SERVING)
            assert await _check(probe_port) == SERVING
            await servicer.set("", NOT_SERVING)  # one servicer: the probe sees what the TLS port would say
            assert await _check(probe_port) == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as plain_on_tls:
                await _check(tls_port)  # kubelet's probe on the API port under TLS: what failed before
            assert plain_on_tls.value.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(f"127.0.0.1:{probe_port}") as channel:
                other = channel.unary_unary("/splitserve.v1.Generation/Generate")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await other(b"", timeout=3)  # health alone: no API in plain text
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await probe.stop(None)
            await server.stop(None)

    asyncio.run(scenario())


@pytest.mark.parametrize("config", [DecodeConfig, RouterConfig])
def test_a_negative_probe_port_is_refused(config):
    with pytest.raises(ValueError, match="probe_port must be >= 0"):
        config(probe_port=-1, **({"decode_pods": ["h:1"]} if config is RouterConfig else {}))


# ---- the first heartbeat ---------------------------------------------------------------------------------------

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
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

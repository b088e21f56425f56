"""The probe port (``probe_port``): grpc.health.v1 alone, in plain text, beside a server on mutual TLS, so that
kubelet's native gRPC probe (which speaks no TLS) asks the same health the TLS port serves, on any architecture.
The chart's probes use it (tests/deploy/test_chart.py); the rendered pods answer it (test_rendered_release.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tls_secret import write_tls_secret

from splitserve.decode_service.config import DecodeConfig
from splitserve.router.config import RouterConfig
from splitserve.runtime import transport

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

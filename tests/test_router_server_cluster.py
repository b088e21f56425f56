"""The router process as Kubernetes runs it (``RouterServer`` over the fake pods of ``test_router_flow``, real gRPC
and HTTP on loopback): Prometheus scrapes a plain ``/metrics`` port while both APIs require client certificates,
and SIGTERM's drain takes both APIs down together within ``shutdown_grace_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
import urllib.request

import grpc
import httpx
import pytest
from served_router import free_port
from test_router_flow import LONG_PROMPT, SCRIPT, running_cluster
from test_security import LOOPBACK_NAMES, _make_ca, _make_leaf

from splitserve.router.server import RouterServer
from splitserve.runtime import transport
from splitserve.runtime.transport import TLSConfig
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


def _generate_request() -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text=LONG_PROMPT, sampling_params=common_pb2.SamplingParams(max_tokens=64))


def _get(url: str, context=None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as reply:
            return reply.status, reply.read().decode()
    except OSError as error:  # refused: a URLError, or the connection closed in the handshake
        return getattr(error, "code", 0), str(error)


def test_metrics_on_their_own_plain_port_while_both_apis_require_client_certificates(tmp_path):
    ca = _make_ca(tmp_path / "ca", "test CA")
    router_id = _make_leaf(tmp_path / "router", "router", ca, LOOPBACK_NAMES)
    tls = TLSConfig(router_id.cert, router_id.key, str(tmp_path / "ca.crt"), require_client_cert=True)

    async def scenario():
        async with running_cluster() as env:
            config = dataclasses.replace(env.router.config, http_port=free_port(), metrics_port=free_port(),
                                         tls_cert_file=tls.cert_file, tls_key_file=tls.key_file,
                                         tls_ca_file=tls.ca_file, tls_require_client_cert=True)
            server = RouterServer(config, env.router)
            await server.start()
            try:
                status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{server.metrics_port}/metrics")
                assert status == 200 and 'splitserve_router_pod_healthy{' in body, body[:300]
                assert 'pod_address="' in body and ' pod="' not in body  # pod is the scraped pod's, in Kubernetes
                no_client_cert = ssl.create_default_context(cafile=tls.ca_file)
                status, _ = await asyncio.to_thread(_get, f"https://127.0.0.1:{config.http_port}/metrics",
                                                    no_client_cert)
                assert status == 0  # the HTTPS API's handshake refuses a scraper without a certificate
            finally:
                await server.stop(grace_s=0)
            with pytest.raises(OSError):  # the metrics port closed with the router
                await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{server.metrics_port}/metrics",
                                        timeout=2)
    asyncio.run(scenario())


def test_the_drain_stops_both_apis_at_once_and_lets_running_streams_finish():
    """While an HTTP stream drains, a new gRPC call is already refused (the old order drained HTTP first and kept
    taking gRPC calls meanwhile), and the running stream ends with all its tokens."""
    async def scenario():
        async with running_cluster() as env:
            env.decode[0].token_delay_s = 0.1
            config = dataclasses.replace(env.router.config, http_port=free_port(), shutdown_grace_s=20)
            server = RouterServer(config, env.router)
            await server.start()
            grpc_address = f"127.0.0.1:{server.grpc_port}"
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": "tiny-random", "prompt": LONG_PROMPT, "max_tokens": 64, "stream": True}
                async with client.stream("POST", f"http://127.0.0.1:{config.http_port}/v1/completions",
                                         json=body) as reply:
                    lines = reply.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    stopping = asyncio.create_task(server.stop())
                    await asyncio.sleep(0.3)
                    async with transport.open_channel(grpc_address) as channel:
                        with pytest.raises(grpc.aio.AioRpcError) as refused:
                            await generate_pb2_grpc.GenerationStub(channel).Generate(_generate_request(),
                                                                                     timeout=5).read()
                        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                    rest = [line async for line in lines if line]
                    assert rest[-1] == "data: [DONE]"
                    assert len(rest) >= len(SCRIPT) - 2  # every token streamed (some may share a chunk)
            await stopping
    asyncio.run(scenario())


def test_the_drain_ends_within_shutdown_grace_s_even_for_a_long_http_stream():
    async def scenario():
        async with running_cluster() as env:
            env.decode[0].token_delay_s = 2.0  # the whole script would take tens of seconds
            config = dataclasses.replace(env.router.config, http_port=free_port(), shutdown_grace_s=1.0)
            server = RouterServer(config, env.router)
            await server.start()
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "tiny-random", "prompt": LONG_PROMPT, "max_tokens": 64, "stream": True}
                async with client.stream("POST", f"http://127.0.0.1:{config.http_port}/v1/completions",
                                         json=body) as reply:
                    await anext(reply.aiter_lines())
                    started = time.monotonic()
                    await server.stop()
                    assert time.monotonic() - started < 1.0 + 2.0  # the grace, plus shutting down
    asyncio.run(scenario())

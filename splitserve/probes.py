"""How the launcher sees from outside that a process of its cluster serves: a gRPC health check (``serving``) and
the router's own list of the pods it routes to (``pods_routed_to``, its ``GET /pods``, over HTTPS with the
cluster's TLS when it has one)."""

from __future__ import annotations

import json
import ssl
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.runtime.transport import PLAINTEXT, TLSConfig, open_blocking_channel
from splitserve.up_config import UpConfig


def serving(address: str, tls: TLSConfig = PLAINTEXT) -> bool:
    """Whether the gRPC server at ``address`` answers SERVING to a health check now."""
    try:
        with open_blocking_channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def pods_routed_to(url: str, config: UpConfig) -> set[str]:
    """Addresses of the pods the router at ``url`` (its ``GET /pods``) would route to now."""
    headers = {"Authorization": f"Bearer {config.api_keys[0]}"} if config.api_keys else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2.0,
                                    context=_https_context(config.tls)) as reply:
            return {pod["address"] for pod in json.load(reply)["pods"] if pod["healthy"]}
    except OSError:  # not listening yet, or refused
        return set()


def _https_context(tls: TLSConfig) -> ssl.SSLContext | None:
    """How this process's HTTPS requests verify the router (and, for mutual TLS, present its certificate)."""
    if not tls.enabled:
        return None
    context = ssl.create_default_context(cafile=tls.ca_file or None)
    if tls.cert_file:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context

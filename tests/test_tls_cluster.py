"""TLS as a Kubernetes cluster needs it, on loopback: certificates whose subjectAltNames are DNS names only (never
127.0.0.1), servers dialled by IP and checked against a Service's name (``tls_server_name``), and a certificate
renewed the way a cert-manager Secret volume renews it (its ``..data`` symlink swapped) while a stream runs: the
stream goes on, and the next connection sees the new certificate without a restart.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import ssl
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_security import Identity, _check, _health_server, _make_ca, _make_leaf

from splitserve.router.config import RouterConfig
from splitserve.router.server import CERTIFICATE_CHECK_S, RouterServer
from splitserve.runtime import transport
from splitserve.runtime.transport import TLSConfig

SERVICE = "demo-splitserve-pods.llm.svc"  # the chart's headless Service, as the pods' certificate lists it
NAMES = (x509.DNSName(SERVICE), x509.DNSName(f"{SERVICE}.cluster.local"))


@pytest.fixture()
def cas(tmp_path):
    """Two CAs: the one that signs now and the one a renewal moves to."""
    return _make_ca(tmp_path / "ca-old", "old CA"), _make_ca(tmp_path / "ca-new", "new CA")


class SecretVolume:
    """A directory laid out as the kubelet mounts a Secret: ``tls.crt -> ..data/tls.crt`` and ``..data`` a symlink
    to a timestamped directory, swapped in one rename when the Secret changes."""

    def __init__(self, root: Path):
        self.root, self.generation = root, 0
        root.mkdir()
        for name in ("tls.crt", "tls.key", "ca.crt"):
            (root / name).symlink_to(Path("..data") / name)

    def publish(self, identity: Identity, ca_pems: list[bytes]) -> None:
        self.generation += 1
        version = self.root / f"..v{self.generation}"
        version.mkdir()
        (version / "tls.crt").write_bytes(Path(identity.cert).read_bytes())
        (version / "tls.key").write_bytes(Path(identity.key).read_bytes())
        (version / "ca.crt").write_bytes(b"".join(ca_pems))
        link = self.root / "..data_tmp"
        link.symlink_to(version.name)
        os.replace(link, self.root / "..data")

    def tls(self, mutual: bool = True) -> TLSConfig:
        return TLSConfig(str(self.root / "tls.crt"), str(self.root / "tls.key"), str(self.root / "ca.crt"),
                         require_client_cert=mutual, server_name=SERVICE)


def _pem(ca_file: Path) -> bytes:
    return ca_file.read_bytes()


def test_a_pod_dialled_by_ip_is_checked_against_the_service_name(tmp_path, cas):
    """The certificate lists names only: dialling 127.0.0.1 verifies with the target name set to the Service's
    name, and fails without it or with another name."""
    old_ca, _ = cas
    server_id = _make_leaf(tmp_path / "pod", "pod", old_ca, NAMES)
    client_id = _make_leaf(tmp_path / "router", "router", old_ca, NAMES)
    ca = str(tmp_path / "ca-old.crt")

    async def scenario():
        server, port, _ = await _health_server(TLSConfig(server_id.cert, server_id.key, ca, require_client_cert=True))
        address = f"127.0.0.1:{port}"
        try:
            named = TLSConfig(client_id.cert, client_id.key, ca, server_name=SERVICE)
            assert await _check(address, named) == grpc.StatusCode.OK
            unnamed = TLSConfig(client_id.cert, client_id.key, ca)
            assert await _check(address, unnamed) == grpc.StatusCode.UNAVAILABLE  # 127.0.0.1 is not listed
            other = TLSConfig(client_id.cert, client_id.key, ca, server_name="other.llm.svc")
            assert await _check(address, other) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)
    asyncio.run(scenario())


def test_a_certificate_renewed_while_a_stream_runs(tmp_path, cas):
    """A renewal onto a new CA (the CA bundle carrying both during the change): the running stream keeps going,
    new connections get the new certificate, and a client that trusts only the old CA is refused afterwards."""
    old_ca, new_ca = cas
    old_pem, new_pem = _pem(tmp_path / "ca-old.crt"), _pem(tmp_path / "ca-new.crt")
    volume = SecretVolume(tmp_path / "secret")
    volume.publish(_make_leaf(tmp_path / "pod-1", "pod", old_ca, NAMES), [old_pem])
    old_client = _make_leaf(tmp_path / "client-old", "router", old_ca, NAMES)
    new_client = _make_leaf(tmp_path / "client-new", "router", new_ca, NAMES)

    def client(identity: Identity, ca_file: str) -> TLSConfig:
        return TLSConfig(identity.cert, identity.key, ca_file, server_name=SERVICE)

    trusts_old = client(old_client, str(tmp_path / "ca-old.crt"))
    trusts_new = client(new_client, str(tmp_path / "ca-new.crt"))

    async def scenario():
        server, port, servicer = await _health_server(volume.tls())
        address = f"127.0.0.1:{port}"
        try:
            assert await _check(address, trusts_new) == grpc.StatusCode.UNAVAILABLE  # before: the old certificate
            async with transport.open_channel(address, trusts_old) as channel:
                stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
                first = await stream.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                volume.publish(_make_leaf(tmp_path / "pod-2", "pod", new_ca, NAMES), [old_pem, new_pem])
                assert await _check(address, trusts_new) == grpc.StatusCode.OK  # a new connection: renewed
                await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                second = await stream.read()  # the stream opened before the renewal still runs
                assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
                stream.cancel()
            assert await _check(address, trusts_old) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)
    asyncio.run(scenario())


def test_a_half_written_certificate_is_skipped_until_its_key_arrives(tmp_path, cas):
    """Files replaced one by one (not a Secret volume): a new certificate beside the old key is not loaded, the
    server keeps its current pair, and loads the new one once the key matches."""
    old_ca, new_ca = cas
    first = _make_leaf(tmp_path / "first", "pod", old_ca, NAMES)
    second = _make_leaf(tmp_path / "second", "pod", new_ca, NAMES)
    live = Identity(str(tmp_path / "live.crt"), str(tmp_path / "live.key"))
    os.replace(_copy(first.cert, tmp_path / "staging.crt"), live.cert)
    os.replace(_copy(first.key, tmp_path / "staging.key"), live.key)
    ca = tmp_path / "bundle.crt"
    ca.write_bytes(_pem(tmp_path / "ca-old.crt") + _pem(tmp_path / "ca-new.crt"))

    async def scenario():
        server, port, _ = await _health_server(TLSConfig(live.cert, live.key, str(ca), server_name=SERVICE))
        address = f"127.0.0.1:{port}"
        trusts_old = TLSConfig(ca_file=str(tmp_path / "ca-old.crt"), server_name=SERVICE)
        trusts_new = TLSConfig(ca_file=str(tmp_path / "ca-new.crt"), server_name=SERVICE)
        try:
            os.replace(_copy(second.cert, tmp_path / "staging.crt"), live.cert)  # the key still the old one
            assert await _check(address, trusts_old) == grpc.StatusCode.OK
            os.replace(_copy(second.key, tmp_path / "staging.key"), live.key)
            assert await _check(address, trusts_new) == grpc.StatusCode.OK
            assert await _check(address, trusts_old) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)
    asyncio.run(scenario())


def _copy(source: str, staging: Path) -> Path:
    staging.write_bytes(Path(source).read_bytes())
    return staging


def test_a_server_name_without_tls_is_refused():
    with pytest.raises(ValueError, match="^tls_server_name: names the peers' certificates, so it needs TLS"):
        TLSConfig(server_name=SERVICE).check()


def _served_certificate_issuer(port: int, ca_file: str) -> str:
    """The issuer's common name of the certificate a new HTTPS connection to the router is handed."""
    context = ssl.create_default_context(cafile=ca_file)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=SERVICE) as conn:
            cert = x509.load_der_x509_certificate(conn.getpeercert(binary_form=True))
    return cert.issuer.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value


def test_the_routers_https_certificate_is_renewed_without_a_restart(tmp_path, cas, free_ports):
    """uvicorn reads its certificate once: the router loads the renewed files into its TLS context, so the next
    HTTPS connection is handed the new certificate while the router keeps running."""
    old_ca, new_ca = cas
    old_pem, new_pem = _pem(tmp_path / "ca-old.crt"), _pem(tmp_path / "ca-new.crt")
    volume = SecretVolume(tmp_path / "secret")
    volume.publish(_make_leaf(tmp_path / "router-1", "router", old_ca, NAMES), [old_pem])
    both = tmp_path / "both.crt"
    both.write_bytes(old_pem + new_pem)
    tls = volume.tls(mutual=False)
    config = RouterConfig(model="tiny-random", decode_pods=["127.0.0.1:1"], host="127.0.0.1", grpc_port=0,
                          http_port=free_ports(1), tls_cert_file=tls.cert_file, tls_key_file=tls.key_file,
                          tls_ca_file=tls.ca_file)

    async def scenario():
        server = RouterServer(config)
        await server.start()
        try:
            issuer = functools.partial(_served_certificate_issuer, config.http_port, str(both))
            assert await asyncio.to_thread(issuer) == "old CA"
            volume.publish(_make_leaf(tmp_path / "router-2", "router", new_ca, NAMES), [old_pem, new_pem])
            deadline = time.monotonic() + 10 * CERTIFICATE_CHECK_S
            while await asyncio.to_thread(issuer) != "new CA":
                assert time.monotonic() < deadline, "the router still serves the old certificate"
                await asyncio.sleep(0.2)
        finally:
            await server.stop(grace_s=0)
    asyncio.run(scenario())

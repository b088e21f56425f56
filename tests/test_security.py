"""TLS, mutual TLS, API keys and CORS, against real servers: gRPC over loopback, the router's HTTP API on uvicorn,
the real ``openai`` client, ``grpcurl``, and a whole ``splitserve up`` cluster with every link on mutual TLS.

Certificates are made here with the ``cryptography`` package: a CA, one certificate per identity signed by it
(subjectAltName 127.0.0.1 and localhost, usable as server and as client), and a second, unrelated CA whose
certificates nobody should accept.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from served_router import RouterInThread
from test_router_flow import LONG_PROMPT, MODEL, SCRIPT

from splitserve.launcher import Cluster
from splitserve.router.config import RouterConfig
from splitserve.runtime import transport
from splitserve.runtime.pod_server import PodConfig
from splitserve.runtime.transport import TLSConfig
from splitserve.up_config import UpConfig
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
KEY = "sk-test-0123456789"


# ---------------------------------------------------------------------------------------------------- PKI


@dataclass
class Identity:
    cert: str
    key: str


@dataclass
class PKI:
    ca: str  # the CA every test identity is signed by
    server: Identity  # a process's identity (server and client)
    client: Identity  # a client's identity
    rogue_ca: str  # a CA that signed nothing anyone trusts
    rogue: Identity  # signed by the rogue CA


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> Identity:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return Identity(str(path.with_suffix(".crt")), str(path.with_suffix(".key")))


def _make_ca(path: Path, common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    _write(path, key, cert)
    return key, cert


LOOPBACK_NAMES = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))


def _make_leaf(path: Path, common_name: str, ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate],
               names=LOOPBACK_NAMES) -> Identity:
    """A certificate signed by ``ca`` listing ``names`` (subjectAltName), for servers and clients."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _write(path, key, cert)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    directory = tmp_path_factory.mktemp("pki")
    ca = _make_ca(directory / "ca", "splitserve test CA")
    rogue_ca = _make_ca(directory / "rogue-ca", "someone else's CA")
    return PKI(str(directory / "ca.crt"), _make_leaf(directory / "server", "splitserve", ca),
               _make_leaf(directory / "client", "a client", ca), str(directory / "rogue-ca.crt"),
               _make_leaf(directory / "rogue", "an impostor", rogue_ca))


def server_tls(pki: PKI, mutual: bool = False) -> TLSConfig:
    return TLSConfig(pki.server.cert, pki.server.key, pki.ca, require_client_cert=mutual)


def client_tls(pki: PKI, identity: Identity | None = None, ca: str | None = None) -> TLSConfig:
    return TLSConfig(identity.cert if identity else "", identity.key if identity else "", ca or pki.ca)


def run(coroutine):
    return asyncio.run(coroutine)


# ------------------------------------------------------------------------------- transport: TLS and mTLS


async def _health_server(tls: TLSConfig) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A gRPC server with only the health service, SERVING: (server, port, its health servicer)."""
    server = transport.new_server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = transport.bind(server, "127.0.0.1", 0, tls)
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, servicer


async def _check(address: str, tls: TLSConfig) -> grpc.StatusCode:
    async with transport.open_channel(address, tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            return error.code()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_tls_server_and_channel_talk_and_plaintext_or_unknown_ca_do_not(pki, host):
    async def scenario():
        server, port, _ = await _health_server(server_tls(pki))
        try:
            address = f"{host}:{port}"
            assert await _check(address, client_tls(pki)) == grpc.StatusCode.OK
            assert await _check(address, transport.PLAINTEXT) == grpc.StatusCode.UNAVAILABLE
            assert await _check(address, client_tls(pki, ca=pki.rogue_ca)) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)
    run(scenario())


def test_mutual_tls_refuses_clients_without_a_certificate_from_its_ca(pki):
    async def scenario():
        server, port, _ = await _health_server(server_tls(pki, mutual=True))
        try:
            address = f"127.0.0.1:{port}"
            assert await _check(address, client_tls(pki, pki.client)) == grpc.StatusCode.OK
            assert await _check(address, client_tls(pki)) == grpc.StatusCode.UNAVAILABLE  # no certificate
            assert await _check(address, client_tls(pki, pki.rogue)) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)
    run(scenario())


def test_a_process_uses_its_tls_for_channels_it_opens_without_being_told(pki):
    """The prefill pod's KV channels take the pod process's TLS (``configure_process_tls``)."""
    async def scenario():
        server, port, _ = await _health_server(server_tls(pki, mutual=True))
        try:
            transport.configure_process_tls(server_tls(pki))
            assert await _check(f"127.0.0.1:{port}", None) == grpc.StatusCode.OK
        finally:
            transport.configure_process_tls(transport.PLAINTEXT)
            await server.stop(None)
    run(scenario())


def test_a_missing_certificate_file_stops_the_server_at_start_naming_it(pki, tmp_path):
    missing = TLSConfig(str(tmp_path / "missing.crt"), pki.server.key, pki.ca)

    async def scenario():
        with pytest.raises(RuntimeError, match=f"^TLS: cannot read {tmp_path / 'missing.crt'}: No such file"):
            transport.bind(transport.new_server(), "127.0.0.1", 0, missing)
        with pytest.raises(RuntimeError, match="^TLS: cannot read"):
            transport.open_channel("127.0.0.1:1", missing)
    run(scenario())


@pytest.mark.parametrize("fields, message", [
    ({"tls_cert_file": "x.crt"}, "tls_cert_file and tls_key_file: set both or neither"),
    ({"tls_ca_file": "__PKI_CA__"}, "tls_cert_file: a server on TLS needs its certificate"),
    ({"tls_require_client_cert": True}, "tls_require_client_cert: needs tls_ca_file"),
])
def test_tls_settings_are_checked_at_start_naming_the_field(pki, fields, message):
    fields = {name: pki.ca if value == "__PKI_CA__" else value for name, value in fields.items()}
    for config_class, required in ((PodConfig, {}), (RouterConfig, {"decode_pods": ["127.0.0.1:1"]})):
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
            config_class(**required, **fields)


# ------------------------------------------------------------------------------------------ the router


def _openai(base: str, api_key: str = "unused", **client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, **client)


def _grpc_generate(address: str, metadata=None, tls: TLSConfig = transport.PLAINTEXT) -> list:
    with transport.open_blocking_channel(address, tls) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.GenerateRequest(text=LONG_PROMPT, sampling_params=common_pb2.SamplingParams(
            max_tokens=4))
        return list(stub.Generate(request, metadata=metadata, timeout=30))


def test_api_keys_guard_the_http_api_but_not_health_or_metrics():
    with RouterInThread(api_keys=["sk-other", KEY]) as router:
        with pytest.raises(openai.AuthenticationError) as refused:
            _openai(router.http, "sk-wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert refused.value.status_code == 401
        assert refused.value.body == {"message": "the API key is not valid", "type": "authentication_error",
                                      "param": None, "code": "unauthenticated"}
        completion = _openai(router.http, KEY).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
        assert completion.usage.completion_tokens == 4
        missing = httpx.get(f"{router.http}/v1/models")
        assert (missing.status_code, missing.headers["www-authenticate"]) == (401, "Bearer")
        assert missing.json()["error"]["message"] == "an API key is required: send 'Authorization: Bearer <key>'"
        basic = httpx.get(f"{router.http}/pods", headers={"Authorization": f"Basic {KEY}"})
        assert basic.json()["error"]["message"] == "the authorization must be 'Bearer <key>'"
        for path in ("/pods", "/version", "/v1/models"):
            assert httpx.get(f"{router.http}{path}").status_code == 401, path
            assert httpx.get(f"{router.http}{path}", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert httpx.get(f"{router.http}/health").status_code == 200
        assert httpx.get(f"{router.http}/metrics").status_code == 200


def test_health_and_metrics_can_be_guarded_too():
    with RouterInThread(api_keys=[KEY], auth_exempt_paths=[]) as router:
        for path in ("/health", "/metrics"):
            assert httpx.get(f"{router.http}{path}").status_code == 401
            assert httpx.get(f"{router.http}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_api_keys_guard_the_grpc_generation_api_but_not_health():
    with RouterInThread(api_keys=[KEY]) as router:
        for metadata, problem in ((None, "an API key is required"), ([("authorization", "Bearer nope")],
                                                                      "the API key is not valid")):
            with pytest.raises(grpc.RpcError) as refused:
                _grpc_generate(router.grpc, metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert refused.value.details().startswith(problem)
        with grpc.insecure_channel(router.grpc) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                generate_pb2_grpc.GenerationStub(channel).Abort(common_pb2.AbortRequest(request_id="x"), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        responses = _grpc_generate(router.grpc, [("authorization", f"Bearer {KEY}")])
        assert [t for r in responses[:-1] for t in r.chunk.token_ids] == SCRIPT[:4]
        # grpcurl, as a user would call it: reflection stays open, the key goes in a header.
        listed = subprocess.run([GRPCURL, "-plaintext", router.grpc, "list"], capture_output=True, text=True,
                                timeout=30)
        assert "splitserve.v1.Generation" in listed.stdout, listed.stderr
        body = json.dumps({"text": LONG_PROMPT, "sampling_params": {"max_tokens": 3}})
        without = subprocess.run([GRPCURL, "-plaintext", "-d", body, router.grpc, "splitserve.v1.Generation/Generate"],
                                 capture_output=True, text=True, timeout=30)
        assert "Unauthenticated" in without.stderr
        with_key = subprocess.run([GRPCURL, "-plaintext", "-H", f"authorization: Bearer {KEY}", "-d", body,
                                   router.grpc, "splitserve.v1.Generation/Generate"],
                                  capture_output=True, text=True, timeout=30)
        assert with_key.returncode == 0 and '"complete"' in with_key.stdout, with_key.stderr


def test_cors_answers_preflights_from_allowed_origins_only():
    with RouterInThread(cors_allowed_origins=["https://app.example"], api_keys=[KEY]) as router:
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type,x-request-id"}
        allowed = httpx.options(f"{router.http}/v1/chat/completions", headers=preflight)
        assert allowed.status_code == 200  # no key needed for a preflight: browsers send none
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        other = httpx.options(f"{router.http}/v1/chat/completions", headers={**preflight, "Origin": "https://evil"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        call = httpx.get(f"{router.http}/v1/models", headers={"Origin": "https://app.example",
                                                              "Authorization": f"Bearer {KEY}",
                                                              "X-Request-Id": "cors-1"})
        assert call.headers["access-control-allow-origin"] == "https://app.example"
        assert call.headers["access-control-expose-headers"] == "X-Request-Id"
        refused = httpx.get(f"{router.http}/v1/models", headers={"Origin": "https://app.example"})
        assert refused.status_code == 401  # a browser can read why
        assert refused.headers["access-control-allow-origin"] == "https://app.example"
    with RouterInThread() as router:  # no origins configured: no CORS headers at all
        plain = httpx.get(f"{router.http}/v1/models", headers={"Origin": "https://app.example"})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def _https_client(pki: PKI, identity: Identity | None) -> httpx.Client:
    context = ssl.create_default_context(cafile=pki.ca)
    if identity is not None:
        context.load_cert_chain(identity.cert, identity.key)
    return httpx.Client(verify=context, timeout=30)


def test_router_serves_https_and_grpc_over_mutual_tls(pki):
    router_tls = {"tls_cert_file": pki.server.cert, "tls_key_file": pki.server.key, "tls_ca_file": pki.ca,
                  "tls_require_client_cert": True}
    # The fake pods speak plaintext, so the router cannot reach them: its client-facing side is what is tested.
    with RouterInThread(**router_tls) as router:
        assert router.http.startswith("https://")
        with _https_client(pki, pki.client) as http:
            models = _openai(router.http, http_client=http).models.list()
            assert [m.id for m in models] == [MODEL]
        with _https_client(pki, None) as http, pytest.raises(openai.APIConnectionError):
            _openai(router.http, http_client=http).models.list()  # no client certificate
        with pytest.raises(httpx.TransportError):  # TLS 1.3: refused right after the handshake
            httpx.get(f"{router.http}/v1/models", verify=False)  # no client certificate either
        with pytest.raises(httpx.HTTPError):
            httpx.get(router.http.replace("https", "http") + "/health")  # plaintext HTTP
        assert asyncio.run(_check(router.grpc, client_tls(pki, pki.client))) == grpc.StatusCode.OK
        assert asyncio.run(_check(router.grpc, client_tls(pki))) == grpc.StatusCode.UNAVAILABLE
        tls_flags = ["-cacert", pki.ca, "-cert", pki.client.cert, "-key", pki.client.key]
        listed = subprocess.run([GRPCURL, *tls_flags, router.grpc, "list"], capture_output=True, text=True,
                                timeout=30)
        assert "splitserve.v1.Generation" in listed.stdout, listed.stderr
        plaintext = subprocess.run([GRPCURL, "-plaintext", router.grpc, "list"], capture_output=True, text=True,
                                   timeout=30)
        assert plaintext.returncode != 0


# ------------------------------------------------------------------------ every link of a real cluster


@pytest.mark.e2e
def test_a_cluster_on_mutual_tls_serves_over_every_link_and_refuses_plaintext(pki, tmp_path):
    """``splitserve up`` with TLS: client -> router (gRPC and HTTPS), router -> pods, prefill -> decode (the KV
    push of a long prompt), each on mutual TLS with certificates from files; ``splitserve generate`` and the
    ``openai`` client as a user runs them; a plaintext client or one without a certificate is refused by every
    process."""
    config = UpConfig.on_ports(model="tiny-random", prefill=1, decode=1, prometheus=False, kv_codec="int8",
                               scheduling="disaggregated", conditional_prefill_threshold=8,
                               kv_cache_memory_bytes=32 << 20, run_dir=str(tmp_path),
                               tls_cert_file=pki.server.cert, tls_key_file=pki.server.key, tls_ca_file=pki.ca,
                               tls_require_client_cert=True, api_keys=[KEY])
    cluster = Cluster(config)
    try:
        cluster.start()
        cluster.wait_ready(log=lambda *_: None)  # its health checks and GET /pods ran over mutual TLS, with the key
        prompt = "Tell me a story about a fox, please. " * 3  # long: prefilled on the prefill pod
        generated = subprocess.run(
            [sys.executable, "-m", "splitserve", "generate", "--raw", "--max-tokens", "6", "--router",
             f"127.0.0.1:{config.grpc_port}", "--tls-ca-file", pki.ca, "--tls-cert-file", pki.client.cert,
             "--tls-key-file", pki.client.key, prompt], capture_output=True, text=True, timeout=120,
            env={**os.environ, "SPLITSERVE_API_KEY": KEY})
        assert generated.returncode == 0, generated.stderr
        assert "6 output tokens" in generated.stderr
        with _https_client(pki, pki.client) as http:
            chat = _openai(cluster.http_url, KEY, http_client=http).chat.completions.create(
                model="tiny-random", messages=[{"role": "user", "content": prompt}], max_tokens=5, temperature=0)
            assert chat.usage.completion_tokens == 5
        prefill_pod = next(p for p in cluster.pods if p.role == "prefill")
        with urllib.request.urlopen(f"http://127.0.0.1:{prefill_pod.metrics_port}/metrics", timeout=10) as reply:
            pushed = [s.value for family in text_string_to_metric_families(reply.read().decode())
                      for s in family.samples if s.name == "splitserve_kv_transfer_bytes_total"]
        assert sum(pushed) > 0  # both prompts' KV went from the prefill pod to the decode pod, over mutual TLS
        for process in [f"127.0.0.1:{config.grpc_port}", *(cluster.address(p) for p in cluster.pods)]:
            assert asyncio.run(_check(process, client_tls(pki, pki.client))) == grpc.StatusCode.OK, process
            assert asyncio.run(_check(process, transport.PLAINTEXT)) == grpc.StatusCode.UNAVAILABLE, process
            assert asyncio.run(_check(process, client_tls(pki))) == grpc.StatusCode.UNAVAILABLE, process
    finally:
        cluster.stop()

"""Run what the chart renders, not only its YAML: a router, a prefill pod, a decode pod and Redis from one rendered
release (tests/deploy/rendered_release.py runs each container as its manifest says, in a bubblewrap sandbox with the
manifest's user, read-only root and volumes, its probes as rendered) answer a completion through the rendered
Service ports: once with the chart's defaults (the pods run the image's baseline kernels from its read-only folder,
writing nothing; KV over gRPC), once with mutual TLS, network policies, Redis auth, kernels compiled for this CPU at
start (kernels.target native: into the read-only root's one writable place for them, the chart's sized kernel cache)
and same-host KV through the node's shared directory (kvTransfer.sharedMemory: a hostPath both pods mount, here a
directory of the test's host, where the prefill pod's KV goes, not over gRPC).

The model is the tiny random one (the chart's model.name: built in code, nothing to load) and the KV pools are
small; every other value is the chart's default or the case's. With SPLITSERVE_TEST_IMAGE_ROOT set to a built
image's root filesystem (``buildah mount``), the pods run the image instead of this checkout (deploy/README.md).
"""

from __future__ import annotations

import os
import re
import ssl
import time

import httpx
import pytest
from rendered_release import RenderedRelease, write_tls_secret
from test_chart import NAMESPACE, RELEASE, chart, objects  # noqa: F401 - chart: the fixture

# about 35 s for both cases (the TLS one compiles kernels); bubblewrap comes from scripts/bootstrap.sh
pytestmark = pytest.mark.e2e

# Every prompt through the prefill pod (disaggregated, no length threshold): the test reads the transport its push
# took, which a prompt that hybrid placement lent to its decode pod would not have made.
SMALL = {"model": {"name": "tiny-random"},
         "prefill": {"config": {"kvCacheMemoryBytes": 16 << 20}},
         "decode": {"config": {"kvCacheMemoryBytes": 32 << 20}},
         "router": {"config": {"scheduling": "disaggregated", "conditionalPrefillThreshold": 0}}}
REDIS_SECRET = {"splitserve-redis": {"redis-password": "Zq7bK2mR9xW4tY8pL3nV6cH1"}}
TLS = {"tls": {"enabled": True, "secretName": "splitserve-tls", "requireClientCert": True},
       "networkPolicy": {"enabled": True}, "redis": {"auth": {"enabled": True}}, "kernels": {"target": "native"}}
ROUTER = f"{RELEASE}-splitserve-router"


def _tls_secret(tmp_path) -> dict[str, str]:
    """The Secret cert-manager would issue from the chart's Certificate: the pods' Service name, the router's names
    and (clients here dial addresses, not names) every pod address the harness gives out."""
    names = [f"{RELEASE}-splitserve-pods.{NAMESPACE}.svc", ROUTER, f"{ROUTER}.{NAMESPACE}.svc",
             *(f"127.77.0.{n}" for n in range(2, 10))]
    directory = write_tls_secret(tmp_path / "issued", names)
    return {key: (directory / key).read_text() for key in ("tls.crt", "tls.key", "ca.crt")}


@pytest.mark.parametrize("case", ["defaults", "tls"])
def test_a_rendered_release_answers_a_completion_through_its_service(chart, case, tmp_path):
    values = {**SMALL, **(TLS if case == "tls" else {})}
    secrets = dict(REDIS_SECRET)
    if case == "tls":
        secrets["splitserve-tls"] = _tls_secret(tmp_path)
        node_shm = tmp_path / "node-shm"  # the node's directory: mode 1777, as /dev/shm
        node_shm.mkdir(mode=0o1777)
        node_shm.chmod(0o1777)
        values["kvTransfer"] = {"sharedMemory": {"enabled": True, "hostPath": str(node_shm)}}
    rendered = objects(chart, values)
    assert any(o["kind"] == "NetworkPolicy" for o in rendered)
    release = RenderedRelease(rendered, secrets, tmp_path / "pods",
                              image_root=os.environ.get("SPLITSERVE_TEST_IMAGE_ROOT", ""))
    release.start()
    try:
        release.wait_ready(timeout_s=240)
        host, port = release.address(ROUTER, "http")
        client = httpx.Client(timeout=60)
        if case == "tls":  # HTTPS, and the router asks for a client certificate (mutual TLS)
            issued = tmp_path / "issued"
            context = ssl.create_default_context(cafile=str(issued / "ca.crt"))
            context.load_cert_chain(issued / "tls.crt", issued / "tls.key")
            client = httpx.Client(timeout=60, verify=context)
            with pytest.raises(httpx.HTTPError):  # no client certificate: refused
                httpx.get(f"https://{host}:{port}/health", verify=str(issued / "ca.crt"), timeout=10)
        scheme = "https" if case == "tls" else "http"
        deadline = time.monotonic() + 30  # ready pods are registered through Redis within a scan
        while {pod["role"] for pod in client.get(f"{scheme}://{host}:{port}/pods").json()["pods"]} < {"prefill",
                                                                                                       "decode"}:
            assert time.monotonic() < deadline, "the pods never appeared in the router's registry"
            time.sleep(0.2)
        answer = client.post(f"{scheme}://{host}:{port}/v1/completions",
                             json={"model": "tiny-random", "prompt": "a prompt for the prefill pod",
                                   "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
        # native: this CPU's build, compiled into the kernel cache; baseline: the image's, read where it lies
        kernels = r"/tmp/.cache/splitserve/cpu_kernels-[0-9a-f]+\.so" if case == "tls" else \
            r"/opt/splitserve/kernels/cpu_kernels-x86-64-v[34](-vnni)?-[0-9a-f]+\.so"
        for pod in ("prefill", "decode"):
            log = (tmp_path / "pods" / f"{RELEASE}-splitserve-{pod}" / pod / "log").read_text()
            assert re.search(rf"compute path: native CPU kernels \(\w+, {kernels}\)", log), log
            cache = tmp_path / "pods" / f"{RELEASE}-splitserve-{pod}" / pod / "volumes" / "kernel-cache"
            assert any(cache.glob("*.so")) == (case == "tls"), list(cache.iterdir())  # baseline: nothing written
        host, port = release.address(f"{RELEASE}-splitserve-prefill", "metrics")
        pushes = {transport: float(count) for transport, count in re.findall(
            r'^splitserve_kv_transfers_total\{[^}]*transport="(\w+)"[^}]*\} (\S+)$',
            httpx.get(f"http://{host}:{port}/metrics", timeout=10).text, re.MULTILINE)}
        assert sum(pushes.values()) >= 1 and pushes.get("shm" if case == "tls" else "grpc") == sum(pushes.values())
    except BaseException:
        print(release.logs())
        raise
    finally:
        release.stop()

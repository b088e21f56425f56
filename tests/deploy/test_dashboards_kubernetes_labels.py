"""The dashboards against a Prometheus that labels targets as Kubernetes does: every scraped series gets the
scraped pod's ``pod`` and ``namespace`` (relabelled from ``__meta_kubernetes_*``, as the Prometheus Operator's
ServiceMonitors and the common ``kubernetes-pods`` job do), which overwrite a series' own labels of those names.

A ``splitserve up`` cluster (tiny random model: a router, a prefill pod and two decode pods) is scraped that way
by a real Prometheus; then every panel's queries run, and no panel may draw two series under one legend (series
folded together by a label the scrape overwrote), and the router's per-pod panels show one series per pod, named
by the pods' addresses.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from splitserve.deploy.grafana.dashboards import DASHBOARDS, OUT_DIR
from splitserve.deploy.grafana.snapshot import grafana_expr, legend
from splitserve.deploy.grafana.snapshot import query as _query
from splitserve.launcher import Cluster
from splitserve.up_config import UpConfig
from tests.deploy.test_dashboards_e2e import _wait_scraped_since

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus")]

NAMESPACE = "llm"
PER_POD_PANELS = ["Running per pod", "Waiting per pod", "KV cache usage per pod", "Queued prefill tokens per pod"]


def kubernetes_style_config(targets: dict[str, str]) -> str:
    """One job; each target (address -> Kubernetes pod name) relabelled as the Operator does."""
    static = [{"targets": [address], "labels": {"__meta_kubernetes_pod_name": pod,
                                                "__meta_kubernetes_namespace": NAMESPACE}}
              for address, pod in targets.items()]
    relabel = [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
               {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
    return json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                       "scrape_configs": [{"job_name": "serviceMonitor/llm/splitserve/0", "static_configs": static,
                                           "relabel_configs": relabel}]})


def _complete(http: str, prompt: str) -> None:
    body = json.dumps({"model": "tiny-random", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{http}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200


@pytest.fixture(scope="module")
def scraped(tmp_path_factory, free_ports):
    """(Prometheus URL, the pods' addresses) once a few requests went through and were scraped. Prometheus starts
    first, on the planned ports, while the pods load."""
    run_dir = tmp_path_factory.mktemp("k8s-labels")
    cluster = Cluster(UpConfig.on_ports(run_dir=str(run_dir), model="tiny-random", prefill=1, decode=2,
                                        prometheus=False, scheduling="disaggregated",
                                        conditional_prefill_threshold=4))
    port = free_ports(1)
    c = cluster.config
    targets = {f"{c.host}:{c.http_port}": "demo-splitserve-router-5d8c7b9f4-x2x7q"}
    targets.update({f"{c.host}:{pod.metrics_port}": f"demo-splitserve-{pod.role}-6f9d8c-{pod.name[-1]}abcd"
                    for pod in cluster.pods})
    config = run_dir / "prometheus.yml"
    config.write_text(kubernetes_style_config(targets))
    prometheus = subprocess.Popen(["prometheus", f"--config.file={config}", f"--web.listen-address={c.host}:{port}",
                                   f"--storage.tsdb.path={run_dir / 'tsdb'}"], stdout=subprocess.DEVNULL,
                                  stderr=(run_dir / "prometheus.log").open("w"))
    url = f"http://{c.host}:{port}"
    try:
        cluster.start()
        cluster.wait_ready(log=lambda *_: None)
        http = f"http://{c.host}:{c.http_port}"
        for i in range(8):
            _complete(http, "The fox jumps over the lazy dog and runs far away" if i % 2 else "Hi")
        deadline = time.monotonic() + 60
        while not _query_ok(url, "splitserve_router_pod_healthy") and time.monotonic() < deadline:
            time.sleep(0.2)
        _wait_scraped_since(url, time.time())  # scrapes of every target after the last request
        yield url, {cluster.address(pod) for pod in cluster.pods}
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        cluster.stop()


def _query_ok(url: str, expr: str) -> bool:
    try:
        return bool(_query(url, expr))
    except OSError:  # Prometheus still starting
        return False


def test_the_scrape_labels_every_series_with_its_kubernetes_pod(scraped):
    prometheus, _ = scraped
    series = _query(prometheus, "splitserve_router_pod_healthy")
    assert series and all(s["metric"]["pod"] == "demo-splitserve-router-5d8c7b9f4-x2x7q" for s in series)
    assert all(s["metric"]["namespace"] == NAMESPACE for s in series)


def _panels():
    for name in DASHBOARDS:
        for panel in json.loads((OUT_DIR / f"splitserve-{name}.json").read_text())["panels"]:
            if panel["type"] != "row":
                yield name, panel


@pytest.mark.parametrize("dashboard, title", [(d, p["title"]) for d, p in _panels()],
                         ids=[f"{d}:{p['title']}" for d, p in _panels()])
def test_no_panel_folds_series_under_one_legend(scraped, dashboard, title):
    prometheus, _ = scraped
    panel = next(p for d, p in _panels() if (d, p["title"]) == (dashboard, title))
    for target in panel["targets"]:
        result = _query(prometheus, grafana_expr(target["expr"], "1m", {"$namespace": ".*"}))
        legends = [legend(target["legendFormat"], s["metric"]) for s in result]
        assert len(legends) == len(set(legends)), (target["expr"], legends)
        assert not any(re.search(r"\{\{\w+\}\}", text) for text in legends), legends  # a label that is gone


@pytest.mark.parametrize("title", ["CPU per pod", "Memory per pod", "Prompt length", "Output length",
                                   "Finish reasons"])
def test_the_new_overview_panels_show_every_process(scraped, title):
    """CPU and memory: one line per process; lengths and finish reasons: from the pods that ended requests."""
    prometheus, addresses = scraped
    board = json.loads((OUT_DIR / "splitserve-overview.json").read_text())
    (target,) = next(p for p in board["panels"] if p.get("title") == title)["targets"][:1]
    result = _query(prometheus, grafana_expr(target["expr"], "1m", {"$role": ".*"}))
    if title in ("CPU per pod", "Memory per pod"):
        assert len(result) == len(addresses) + 1, result  # the pods and the router
    else:
        assert {s["metric"]["role"] for s in result} >= {"decode"}, result


@pytest.mark.parametrize("title", PER_POD_PANELS)
def test_the_routers_per_pod_panels_show_each_pod_by_its_address(scraped, title):
    prometheus, addresses = scraped
    board = json.loads((OUT_DIR / "splitserve-router.json").read_text())
    (target,) = next(p for p in board["panels"] if p.get("title") == title)["targets"]
    result = _query(prometheus, grafana_expr(target["expr"], "1m", {"$namespace": ".*"}))
    assert {s["metric"].get("pod_address") for s in result} == addresses, result

"""The planner against a Kubernetes API: the real ``kubernetes`` client talking HTTP to ``kmock``'s emulator, which
keeps the Deployments in memory. The planner must only read the two Deployments it was given and patch their scale
subresource (what the chart's Role allows), scale nothing in dry-run, and survive API errors; against servers that
never answer, every Kubernetes and Prometheus call times out; bad answers from Prometheus are logged and skipped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kmock
import pytest
from kubernetes import client
from prometheus_client import generate_latest

from splitserve.deploy.planner.capacity import Planner, Replicas, Signals
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.deploy.planner.controller import PlannerLoop
from splitserve.deploy.planner.metrics import PlannerMetrics
from splitserve.deploy.planner.scaler import DeploymentScaler
from splitserve.deploy.planner.signals import PrometheusSignals

DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
NAMESPACE = "llm"
NAMES = {"prefill": "demo-splitserve-prefill", "decode": "demo-splitserve-decode"}

# A recorded busy minute: 4 requests/s of 600-token prompts and 120-token answers on one prefill and one decode pod.
BUSY = Signals(requests_per_s=4.0, prompt_tokens_per_s=2400.0, output_tokens_per_s=480.0,
               prefill_tokens_per_s=400.0, decode_prefill_tokens_per_s=0.0, prefill_busy=1.0, prefill_queue_p99_s=9.5,
               decode_pods=1.0, decode_running=24.0, decode_waiting=3.0, decode_step_s=0.045, kv_usage_max=0.4,
               ttft_p99_s=11.0, tpot_p99_s=0.06)


class RecordedSignals:
    def __init__(self, signals: Signals):
        self.signals = signals

    def read(self) -> Signals:
        return self.signals


def deployment(name: str, replicas: int, ready: int | None = None) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "pod", "image": "splitserve"}]}}},
            "status": {"replicas": replicas, "readyReplicas": replicas if ready is None else ready}}


@pytest.fixture
def cluster(kmock):
    for pool, name in NAMES.items():
        kmock.objects[DEPLOYMENTS, NAMESPACE, name] = deployment(name, 1)
    kmock.objects[DEPLOYMENTS, NAMESPACE, "someone-else"] = deployment("someone-else", 3)
    return kmock


def scaler_for(emulator, names=NAMES, timeout_s: float = 10.0) -> DeploymentScaler:
    api = client.ApiClient(client.Configuration(host=str(emulator.url).rstrip("/")))
    return DeploymentScaler(api, NAMESPACE, dict(names), timeout_s)


def replicas_in(emulator, name: str) -> int:
    return emulator.objects[DEPLOYMENTS, NAMESPACE, name].raw["spec"]["replicas"]


def loop_for(emulator, signals: Signals, **overrides) -> tuple[PlannerLoop, PlannerMetrics]:
    config = PlannerConfig(prefill_deployment=NAMES["prefill"], decode_deployment=NAMES["decode"],
                           namespace=NAMESPACE, scale_up_cooldown_s=0, **overrides)
    metrics = PlannerMetrics("smollm2-135m", config.dry_run)
    return PlannerLoop(config, RecordedSignals(signals), scaler_for(emulator), metrics), metrics


def requests_made(emulator) -> list[tuple[str, str]]:
    return [(str(r.method).split(".")[-1], r.url.path) for r in list(emulator)]


@pytest.mark.asyncio
async def test_scaler_reads_the_deployments_and_sets_replicas_through_the_scale_subresource(cluster):
    scaler = scaler_for(cluster)
    assert await asyncio.to_thread(scaler.replicas) == {"prefill": Replicas(1, 1), "decode": Replicas(1, 1)}
    await asyncio.to_thread(scaler.scale, "decode", 4)
    assert replicas_in(cluster, NAMES["decode"]) == 4
    assert (await asyncio.to_thread(scaler.replicas))["decode"].desired == 4
    base = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
    assert requests_made(cluster) == [  # exactly the chart Role's verbs: get deployments, patch deployments/scale
        ("GET", f"{base}/{NAMES['prefill']}"), ("GET", f"{base}/{NAMES['decode']}"),
        ("PATCH", f"{base}/{NAMES['decode']}/scale"),
        ("GET", f"{base}/{NAMES['prefill']}"), ("GET", f"{base}/{NAMES['decode']}")]


@pytest.mark.asyncio
async def test_pods_not_ready_hold_the_pool(kmock):
    kmock.objects[DEPLOYMENTS, NAMESPACE, NAMES["prefill"]] = deployment(NAMES["prefill"], 3, ready=1)
    kmock.objects[DEPLOYMENTS, NAMESPACE, NAMES["decode"]] = deployment(NAMES["decode"], 1)
    loop, _ = loop_for(kmock, BUSY)
    by_pool = {d.pool: d for d in await asyncio.to_thread(loop.tick)}
    assert (by_pool["prefill"].desired, by_pool["prefill"].reason) == (3, "starting")  # 2 pods still loading
    assert by_pool["decode"].desired > 1
    assert replicas_in(kmock, NAMES["prefill"]) == 3


@pytest.mark.asyncio
async def test_a_tick_under_load_grows_both_pools_and_exports_the_decision(cluster):
    loop, metrics = loop_for(cluster, BUSY)
    decisions = await asyncio.to_thread(loop.tick)
    by_pool = {d.pool: d for d in decisions}
    assert by_pool["prefill"].desired > 1 and by_pool["decode"].desired > 1
    for pool, name in NAMES.items():
        assert replicas_in(cluster, name) == by_pool[pool].desired
    assert replicas_in(cluster, "someone-else") == 3
    assert all(any(path.rstrip("/").endswith(f"/{n}") or path.endswith(f"/{n}/scale") for n in NAMES.values())
               for _, path in requests_made(cluster))
    exposition = generate_latest(metrics.registry).decode()
    desired = by_pool["prefill"].desired
    assert (f'splitserve_planner_desired_replicas{{model_name="smollm2-135m",pool="prefill",role="planner"}} '
            f'{desired:.1f}') in exposition


@pytest.mark.asyncio
async def test_dry_run_decides_but_patches_nothing(cluster):
    loop, metrics = loop_for(cluster, BUSY, dry_run=True)
    decisions = await asyncio.to_thread(loop.tick)
    assert all(d.desired > d.current for d in decisions)
    assert [method for method, _ in requests_made(cluster)] == ["GET", "GET"]
    assert all(replicas_in(cluster, name) == 1 for name in NAMES.values())
    assert 'splitserve_planner_dry_run{model_name="smollm2-135m",role="planner"} 1.0' in \
        generate_latest(metrics.registry).decode()


@pytest.mark.asyncio
async def test_a_missing_deployment_is_counted_and_changes_nothing(cluster):
    config = PlannerConfig(prefill_deployment="gone", decode_deployment=NAMES["decode"], scale_up_cooldown_s=0)
    metrics = PlannerMetrics("", dry_run=False)
    loop = PlannerLoop(config, RecordedSignals(BUSY),
                       scaler_for(cluster, {"prefill": "gone", "decode": NAMES["decode"]}), metrics)
    assert await asyncio.to_thread(loop.tick) == []
    assert replicas_in(cluster, NAMES["decode"]) == 1
    assert 'splitserve_planner_errors_total{model_name="all",role="planner",stage="read_replicas"} 1.0' in \
        generate_latest(metrics.registry).decode()


# ---- timeouts and bad answers --------------------------------------------------------------------------------

class SilentServer:
    """Accepts connections and never answers: a hung API server or Prometheus."""

    def __init__(self):
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def close(self):
        self.socket.close()


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def test_a_kubernetes_api_that_never_answers_times_out(silent):
    api = client.ApiClient(client.Configuration(host=silent.url))
    scaler = DeploymentScaler(api, NAMESPACE, dict(NAMES), timeout_s=0.5)
    for call in (scaler.replicas, lambda: scaler.scale("decode", 2)):
        started = time.monotonic()
        with pytest.raises(Exception, match="(?i)timed? ?out"):
            call()
        assert time.monotonic() - started < 3


def test_a_prometheus_that_never_answers_times_out_and_the_tick_changes_nothing(silent, kmock):
    for name in NAMES.values():
        kmock.objects[DEPLOYMENTS, NAMESPACE, name] = deployment(name, 1)
    config = PlannerConfig(prometheus_url=silent.url, request_timeout_s=0.5, scale_up_cooldown_s=0)
    metrics = PlannerMetrics("", dry_run=False)
    loop = PlannerLoop(config, PrometheusSignals(config), scaler_for(kmock), metrics)
    started = time.monotonic()
    assert loop.tick() == []
    assert time.monotonic() - started < 3
    assert 'stage="read_metrics"} 1.0' in generate_latest(metrics.registry).decode()


class AnsweringPrometheus:
    """/api/v1/query answering from a table: promql (a substring) -> the response body."""

    def __init__(self, answers: dict[str, bytes], default: bytes):
        table = answers

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                body = next((b for key, b in table.items() if key in self.path), default)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _vector(*values: str) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {}, "value": [0, v]} for v in values]}}).encode()


def test_bad_answers_from_prometheus_are_logged_and_skipped(caplog):
    """Not JSON, two series, a value that is no number, a negative rate: each such signal reads NaN (not known)
    and is logged; the others still count, and the planner decides on what it has."""
    answers = {"splitserve_generation_tokens_total": b"<html>proxy error</html>",
               "splitserve_kv_cache_usage_perc": _vector("0.5", "0.7"),
               "splitserve_num_requests_waiting": _vector("many"),
               "splitserve_inter_token_latency_seconds": _vector("-3")}
    prometheus = AnsweringPrometheus({k: v for k, v in answers.items()}, default=_vector("2"))
    try:
        config = PlannerConfig(prometheus_url=prometheus.url)
        with caplog.at_level(logging.WARNING, logger="splitserve.deploy.planner.signals"):
            signals = PrometheusSignals(config).read()
    finally:
        prometheus.close()
    assert math.isnan(signals.output_tokens_per_s) and math.isnan(signals.decode_waiting)
    assert math.isnan(signals.decode_pods) and math.isnan(signals.kv_usage_max) and math.isnan(signals.decode_step_s)
    assert signals.requests_per_s == 2.0 and signals.prompt_tokens_per_s == 2.0
    skipped = {r.getMessage().split(":")[0] for r in caplog.records}
    assert {"skipping the signal output_tokens_per_s", "skipping the signal decode_waiting",
            "skipping the signal kv_usage_max", "skipping the signal decode_step_s"} <= skipped
    decisions = Planner(config, started_at=-1e6).plan(signals, {p: Replicas(1, 1) for p in ("prefill", "decode")},
                                                       0.0)
    assert all(d.desired >= 1 for d in decisions)

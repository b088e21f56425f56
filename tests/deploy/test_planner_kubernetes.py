"""The planner against a Kubernetes API: the real ``kubernetes`` client talking HTTP to ``kmock``'s emulator, which
keeps the Deployments in memory. The planner must read and patch only the scale subresource of the two
Deployments it was given (what the chart's Role allows), scale nothing in dry-run, and survive API errors.
"""

from __future__ import annotations

import asyncio

import kmock
import pytest
from kubernetes import client
from prometheus_client import generate_latest

from deploy.planner.capacity import Signals
from deploy.planner.config import PlannerConfig
from deploy.planner.controller import PlannerLoop
from deploy.planner.metrics import PlannerMetrics
from deploy.planner.scaler import DeploymentScaler

DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
NAMESPACE = "llm"
NAMES = {"prefill": "demo-splitserve-prefill", "decode": "demo-splitserve-decode"}

# A recorded busy minute: 4 requests/s of 600-token prompts and 120-token answers on one prefill and one decode pod.
BUSY = Signals(requests_per_s=4.0, prompt_tokens_per_s=2400.0, output_tokens_per_s=480.0, disaggregated_fraction=1.0,
               prefill_tokens_per_s=400.0, prefill_busy=1.0, prefill_queue_p99_s=9.5, decode_pods=1.0,
               decode_running=24.0, decode_waiting=3.0, decode_step_s=0.045, kv_usage_max=0.4, ttft_p99_s=11.0,
               tpot_p99_s=0.06)


class RecordedSignals:
    def __init__(self, signals: Signals):
        self.signals = signals

    def read(self) -> Signals:
        return self.signals


def deployment(name: str, replicas: int) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": replicas}, "status": {"replicas": replicas}}


@pytest.fixture
def cluster(kmock):
    for pool, name in NAMES.items():
        kmock.objects[DEPLOYMENTS, NAMESPACE, name] = deployment(name, 1)
    kmock.objects[DEPLOYMENTS, NAMESPACE, "someone-else"] = deployment("someone-else", 3)
    return kmock


def scaler_for(emulator, names=NAMES) -> DeploymentScaler:
    api = client.ApiClient(client.Configuration(host=str(emulator.url).rstrip("/")))
    return DeploymentScaler(api, NAMESPACE, dict(names))


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
async def test_scaler_reads_and_sets_replicas_through_the_scale_subresource(cluster):
    scaler = scaler_for(cluster)
    assert await asyncio.to_thread(scaler.replicas) == {"prefill": 1, "decode": 1}
    await asyncio.to_thread(scaler.scale, "decode", 4)
    assert replicas_in(cluster, NAMES["decode"]) == 4
    assert await asyncio.to_thread(scaler.replicas) == {"prefill": 1, "decode": 4}
    base = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
    assert requests_made(cluster) == [
        ("GET", f"{base}/{NAMES['prefill']}/scale"), ("GET", f"{base}/{NAMES['decode']}/scale"),
        ("PATCH", f"{base}/{NAMES['decode']}/scale"),
        ("GET", f"{base}/{NAMES['prefill']}/scale"), ("GET", f"{base}/{NAMES['decode']}/scale")]


@pytest.mark.asyncio
async def test_a_tick_under_load_grows_both_pools_and_exports_the_decision(cluster):
    loop, metrics = loop_for(cluster, BUSY)
    decisions = await asyncio.to_thread(loop.tick)
    by_pool = {d.pool: d for d in decisions}
    assert by_pool["prefill"].desired > 1 and by_pool["decode"].desired > 1
    for pool, name in NAMES.items():
        assert replicas_in(cluster, name) == by_pool[pool].desired
    assert replicas_in(cluster, "someone-else") == 3
    assert all(path.endswith("/scale") and any(f"/{n}/" in path for n in NAMES.values())
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

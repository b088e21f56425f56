"""The chart's planner parts against a Kubernetes API server: kmock's emulator, which keeps objects in memory and
answers the real ``kubernetes`` client and Helm itself.

- **RBAC**: the planner's API calls, as the server records them, each allowed by the Role the chart renders for it,
  evaluated as RBAC does (API group, resource with its subresource, resource name, verb): a call the Role lacks would
  be a 403 on a cluster, which no unit test of the planner alone would show.
- **Replicas kept**: turning the planner on for a running release must not reset its pools to 1. The chart reads the
  live counts with ``lookup``, which returns nothing under ``helm template`` (and so nothing in test_chart.py's
  renders); here Helm's own cluster-aware render (what ``helm upgrade`` runs, through helm-python-sdk's
  ``Config.render``) asks the emulated server, so the real ``lookup`` reads Deployments the test placed there. What
  this cannot show is the three-way merge of a real upgrade, which needs a server that stores releases.
"""

from __future__ import annotations

import asyncio
import re

import helm_python as helm
import kmock as kmock_lib
import pytest
import yaml
from test_chart import (  # noqa: F401 - chart: the fixture
    CHART,
    NAMESPACE,
    RELEASE,
    case_values,
    chart,
    containers_by_component,
    objects,
    parsed_config,
    with_required,
)
from test_planner_kubernetes import (  # noqa: F401 - cluster: a fixture
    BUSY,
    DEPLOYMENTS,
    NAMES,
    cluster,
    deployment,
    loop_for,
    requests_made,
)

VERBS = {"GET": "get", "PATCH": "patch", "PUT": "update", "POST": "create", "DELETE": "delete"}
PATH = re.compile(r"/apis/(?P<group>[^/]+)/[^/]+/namespaces/(?P<namespace>[^/]+)/(?P<resource>[^/]+)"
                  r"(/(?P<name>[^/]+))?(/(?P<subresource>[^/]+))?")


def allowed(role: dict, method: str, path: str) -> bool:
    call = PATH.fullmatch(path)
    assert call, path
    if call["namespace"] != role["metadata"].get("namespace", NAMESPACE):
        return False
    resource = call["resource"] + (f"/{call['subresource']}" if call["subresource"] else "")
    return any(call["group"] in rule["apiGroups"] and resource in rule["resources"]
               and VERBS[method] in rule["verbs"]
               and (not rule.get("resourceNames") or call["name"] in rule["resourceNames"])
               for rule in role["rules"])


@pytest.fixture
def role(chart) -> dict:
    (rendered,) = [o for o in objects(chart, case_values("planner")) if o["kind"] == "Role"]
    return rendered


@pytest.mark.asyncio
async def test_every_call_of_a_planner_tick_is_allowed_by_the_rendered_role(cluster, role):
    loop, _ = loop_for(cluster, BUSY)
    decisions = await asyncio.to_thread(loop.tick)
    assert any(d.desired > 1 for d in decisions)  # it scaled: reads and patches both recorded
    calls = requests_made(cluster)
    assert {method for method, _ in calls} == {"GET", "PATCH"}
    refused = [(method, path) for method, path in calls if not allowed(role, method, path)]
    assert refused == []


def test_the_rbac_evaluation_refuses_what_the_role_does_not_grant(role):
    base = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
    assert allowed(role, "PATCH", f"{base}/{NAMES['decode']}/scale")
    assert not allowed(role, "PATCH", f"{base}/{NAMES['decode']}")  # the Deployment itself, not its scale
    assert not allowed(role, "PATCH", f"{base}/someone-else/scale")  # another release's Deployment
    assert not allowed(role, "GET", f"/apis/apps/v1/namespaces/other/deployments/{NAMES['decode']}")
    assert not allowed(role, "DELETE", f"{base}/{NAMES['prefill']}")


@pytest.mark.parametrize("prefill_ranks, decode_ranks", [(2, 1), (1, 4)])
def test_the_planner_receives_each_pools_tensor_parallel_size(chart, prefill_ranks, decode_ranks):
    """It counts each pod's ranks against its rank budgets: the sizes are the pools' own values, not a copy."""
    values = with_required({"planner": {"enabled": True, "config": {"maxPrefillRanks": 8, "maxDecodeRanks": 8}},
                            "prefill": {"tensorParallelSize": prefill_ranks},
                            "decode": {"tensorParallelSize": decode_ranks}})
    planner = parsed_config(containers_by_component(objects(chart, values))["planner"])
    assert (planner.prefill_tensor_parallel_size, planner.decode_tensor_parallel_size) == (prefill_ranks, decode_ranks)
    assert (planner.max_pods("prefill"), planner.max_pods("decode")) == (8 // prefill_ranks, min(8, 8 // decode_ranks))


def test_the_planner_counts_a_pipeline_parallel_pods_stages_as_its_ranks(chart):
    """A pod of two pipeline stages is two processes on their own cores, as a pod of two tensor ranks is."""
    values = with_required({"planner": {"enabled": True, "config": {"maxPrefillRanks": 8, "maxDecodeRanks": 8}},
                            "prefill": {"pipelineParallelSize": 2}})
    planner = parsed_config(containers_by_component(objects(chart, values))["planner"])
    assert (planner.prefill_pipeline_parallel_size, planner.decode_pipeline_parallel_size) == (2, 1)
    assert (planner.ranks("prefill"), planner.max_pods("prefill"), planner.max_pods("decode")) == (2, 4, 8)


def test_planner_role_allows_only_reading_and_scaling_the_two_deployments(chart):
    objs = objects(chart, case_values("planner"))
    role = next(o for o in objs if o["kind"] == "Role")
    names = [f"{RELEASE}-splitserve-prefill", f"{RELEASE}-splitserve-decode"]
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": names,
         "verbs": ["patch"]},  # what deploy/planner/scaler.py calls, nothing more
        {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": names, "verbs": ["get"]}]
    deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    for name in names:  # the planner owns the counts: offline (no lookup) the field is left out
        assert "replicas" not in deployments[name]["spec"]
    assert deployments[f"{RELEASE}-splitserve-router"]["spec"]["replicas"] == 1


# ---- replicas kept through lookup -------------------------------------------------------------------------------

def live_render(emulator, values: dict) -> dict[str, int | None]:
    """Helm's cluster-aware render of an upgrade against the emulator: component -> its Deployment's ``replicas``
    (None: left out)."""
    with helm.Chart.load(str(CHART)) as loaded, helm.Config(namespace=NAMESPACE,
                                                              kube_apiserver=str(emulator.url).rstrip("/")) as config:
        rendered = config.render(loaded, with_required(values), name=RELEASE, namespace=NAMESPACE, is_upgrade=True)
    return {obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj["spec"].get("replicas")
            for path, text in rendered.items() if not path.endswith("NOTES.txt")
            for obj in yaml.safe_load_all(text) if obj and obj["kind"] == "Deployment"}


@pytest.fixture
def running_release(kmock):
    """A release running before the upgrade: 2 prefill pods, 3 decode pods, 4 router pods (values say 1 each)."""
    kmock.resources[DEPLOYMENTS] = kmock_lib.ResourceInfo(kind="Deployment", namespaced=True, verbs={"get", "list"})
    for component, count in {"prefill": 2, "decode": 3, "router": 4}.items():
        name = f"{RELEASE}-splitserve-{component}"
        kmock.objects[DEPLOYMENTS, NAMESPACE, name] = deployment(name, count)
    return kmock


@pytest.mark.asyncio
async def test_turning_the_planner_on_keeps_the_live_counts_of_its_pools(running_release):
    replicas = await asyncio.to_thread(live_render, running_release, {"planner": {"enabled": True}})
    assert replicas == {"prefill": 2, "decode": 3, "router": 1, "redis": 1, "planner": 1}
    looked_up = {path for method, path in requests_made(running_release) if "/namespaces/" in path}
    assert looked_up == {f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{NAMES[pool]}" for pool in NAMES}


@pytest.mark.asyncio
async def test_an_hpa_keeps_the_live_count_and_the_chart_owns_it_otherwise(running_release):
    """The router's HPA owns its count (the live 4 is kept); without the planner the chart sets its values' 1 on the
    pools, whatever runs."""
    replicas = await asyncio.to_thread(live_render, running_release, {"router": {"autoscaling": {"enabled": True}}})
    assert replicas == {"prefill": 1, "decode": 1, "router": 4, "redis": 1}


@pytest.mark.asyncio
async def test_a_first_install_with_the_planner_leaves_the_count_to_kubernetes(kmock):
    """Nothing runs yet: lookup finds no Deployment, and the field is left out (Kubernetes starts one pod)."""
    kmock.resources[DEPLOYMENTS] = kmock_lib.ResourceInfo(kind="Deployment", namespaced=True, verbs={"get", "list"})
    replicas = await asyncio.to_thread(live_render, kmock, {"planner": {"enabled": True}})
    assert (replicas["prefill"], replicas["decode"]) == (None, None)

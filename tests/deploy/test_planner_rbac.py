"""The planner's API calls, as a Kubernetes API server records them (kmock's emulator, the real ``kubernetes``
client), each allowed by the Role the chart renders for it, evaluated as RBAC does (API group, resource with its
subresource, resource name, verb): a call the Role lacks would be a 403 on a cluster, which no unit test of the
planner alone would show."""

from __future__ import annotations

import asyncio
import re

import pytest
from test_chart import NAMESPACE, case_values, chart, objects  # noqa: F401 - chart: the fixture
from test_planner_kubernetes import BUSY, NAMES, cluster, loop_for, requests_made  # noqa: F401 - cluster: a fixture

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

"""What a cluster's API server and admission controllers would check on the rendered manifests, beyond
test_chart.py's strict validation at one Kubernetes version:

- every built-in kind, strictly, against the schemas of the oldest and newest Kubernetes the chart supports and
  one between (kubernetes-validate's 1.27, 1.32 and 1.37);
- the CRD kinds (ServiceMonitor, PrometheusRule, cert-manager's Certificate) against their published schemas (the
  cloudcoil models, generated from the Prometheus Operator's and cert-manager's CRDs): a field the schema lacks
  (which the API server's structural pruning would drop without a word) fails here, like a value off its pattern;
- policy as code, as Kyverno or Gatekeeper would enforce it (plain checks over the objects, each shown to catch its
  violation): the restricted Pod Security Standard, no metrics port on a Service reachable from outside the cluster,
  threads equal to the CPU limit, no surge for pods holding an accelerator. Two values break the restricted level
  knowingly, each with one hostPath volume (the privileged level then: baseline refuses hostPath too): a model on
  the node (model.source hostPath) and same-host KV (kvTransfer.sharedMemory); nothing else may.
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from cloudcoil.models.cert_manager import v1 as cert_manager
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator
from test_chart import CASES, case_values, chart, objects  # noqa: F401 - chart: the fixture

KUBE_VERSIONS = ["1.27.0", "1.32.0", "1.37.0"]  # the chart's kubeVersion floor, a middle one, the newest schemas
CRD_MODELS = {"ServiceMonitor": prometheus_operator.ServiceMonitor, "PodMonitor": prometheus_operator.PodMonitor,
              "PrometheusRule": prometheus_operator.PrometheusRule, "Certificate": cert_manager.Certificate}
# every optional part at once: everything-values with TLS and the planner (which then sizes prefill and decode)
EVERYTHING = copy.deepcopy(case_values("everything")) | {"tls": case_values("tls")["tls"],
                                                          "planner": case_values("planner")["planner"]}
for _pool in ("prefill", "decode"):
    EVERYTHING[_pool]["autoscaling"]["enabled"] = False


# Same-host KV (issue 37): the serving pods share a node directory, a hostPath volume.
SHARED_MEMORY = {"mixed": {"enabled": True}, "kvTransfer": {"sharedMemory": {"enabled": True}}}
# The cases that need a namespace at the privileged Pod Security level (restricted and baseline both refuse a hostPath
# volume), each by the one volume its values ask for, in the pods that mount it; every other case is restricted.
HOST_PATH_CASES = {"external-redis": ("model", ("router", "prefill", "decode")),  # model.source hostPath
                   "shared-memory": ("kv-shm", ("prefill", "decode", "mixed"))}  # kvTransfer.sharedMemory


@pytest.fixture(scope="module")
def rendered(chart):
    cases = {case: objects(chart, case_values(case)) for case in CASES}
    cases["everything+tls+planner"] = objects(chart, EVERYTHING)
    cases["shared-memory"] = objects(chart, SHARED_MEMORY)
    return cases


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_built_in_kinds_pass_strict_validation_on_every_supported_kubernetes(rendered, version):
    for case, objs in rendered.items():
        for obj in objs:
            if obj["kind"] not in CRD_MODELS:
                kubernetes_validate.validate(obj, version, strict=True)


# ---- CRD kinds -------------------------------------------------------------------------------------------------

def _unknown_fields(given, kept, path: str = "") -> list[str]:
    """Keys of ``given`` that the model's dump (``kept``) lost: fields the CRD's schema does not have."""
    if isinstance(given, dict):
        return [found for key, value in given.items()
                for found in ([f"{path}{key}"] if key not in kept
                              else _unknown_fields(value, kept[key], f"{path}{key}."))]
    if isinstance(given, list):
        return [found for i, (a, b) in enumerate(zip(given, kept)) for found in _unknown_fields(a, b, f"{path}{i}.")]
    return []


def crd_problems(obj: dict) -> list[str]:
    model = CRD_MODELS[obj["kind"]]
    try:
        parsed = model.model_validate(obj)
    except ValueError as err:  # pydantic's ValidationError: a wrong type, a pattern, a missing required field
        return [str(err)]
    return [f"unknown field {name}" for name in
            _unknown_fields(obj, parsed.model_dump(by_alias=True, exclude_unset=True, mode="json"))]


def test_crd_kinds_match_their_published_schemas(rendered):
    checked = set()
    for case, objs in rendered.items():
        for obj in objs:
            if obj["kind"] in CRD_MODELS:
                assert crd_problems(obj) == [], (case, obj["kind"], obj["metadata"]["name"])
                checked.add(obj["kind"])
    assert checked == {"ServiceMonitor", "PrometheusRule", "Certificate"}


def test_the_crd_check_catches_a_misspelt_field_and_a_bad_duration(rendered):
    monitor = next(o for o in rendered["everything"] if o["kind"] == "ServiceMonitor")
    typo = copy.deepcopy(monitor)
    typo["spec"]["endpoints"][0]["intervall"] = "15s"
    assert crd_problems(typo) == ["unknown field spec.endpoints.0.intervall"]
    bad = copy.deepcopy(monitor)
    bad["spec"]["endpoints"][0]["interval"] = "15 seconds"
    assert "pattern" in crd_problems(bad)[0]


# ---- policies ----------------------------------------------------------------------------------------------------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _pod_specs(objs: list[dict]):
    for obj in objs:
        if obj["kind"] == "Deployment":
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


def restricted_pod_security(objs: list[dict]) -> list[str]:
    """The restricted Pod Security Standard (Kubernetes 1.27+), as the PodSecurity admission plugin checks it."""
    found = []
    for name, pod in _pod_specs(objs):
        pod_context = pod.get("securityContext", {})
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(flag):
                found.append(f"{name}: {flag}")
        for volume in pod.get("volumes", []):
            kinds = set(volume) - {"name"}
            if not kinds <= RESTRICTED_VOLUMES:
                found.append(f"{name}: {'/'.join(sorted(kinds))} volume {volume['name']}")
        for container in pod["containers"] + pod.get("initContainers", []):
            context = {**pod_context, **container.get("securityContext", {})}
            where = f"{name}/{container['name']}"
            if context.get("privileged") or context.get("allowPrivilegeEscalation") is not False:
                found.append(f"{where}: privilege escalation allowed")
            if not context.get("runAsNonRoot") or context.get("runAsUser") == 0:
                found.append(f"{where}: may run as root")
            if context.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
                found.append(f"{where}: no seccomp profile")
            capabilities = container.get("securityContext", {}).get("capabilities", {})
            if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
                found.append(f"{where}: capabilities not dropped")
            if any(port.get("hostPort") for port in container.get("ports", [])):
                found.append(f"{where}: hostPort")
    return found


def metrics_not_exposed(objs: list[dict]) -> list[str]:
    """No Service reachable from outside the cluster (LoadBalancer, NodePort) carries a metrics port: /metrics is
    plain HTTP without an API key."""
    return [f"{o['metadata']['name']}: {port['name']} on a {o['spec']['type']}" for o in objs if o["kind"] == "Service"
            and o["spec"].get("type") in ("LoadBalancer", "NodePort")
            for port in o["spec"]["ports"] if "metrics" in port["name"] or port.get("targetPort") == "metrics"]


def _cores(quantity) -> int:
    text = str(quantity)
    return max(1, int(text[:-1]) // 1000 if text.endswith("m") else int(float(text)))


SERVING_MODULES = ("splitserve.prefill_service", "splitserve.decode_service")  # what runs torch


def threads_match_the_cpu_limit(objs: list[dict]) -> list[str]:
    """A serving container with a CPU limit runs --num-threads equal to its whole cores (torch otherwise starts a
    thread per core of the node, throttled by the quota)."""
    found = []
    for name, pod in _pod_specs(objs):
        container = pod["containers"][0]
        limit = container.get("resources", {}).get("limits", {}).get("cpu")
        if limit is None or container.get("command", [""])[-1] not in SERVING_MODULES:
            continue
        args = container["args"]
        threads = int(args[args.index("--num-threads") + 1]) if "--num-threads" in args else None
        if threads != _cores(limit):
            found.append(f"{name}: {threads} threads under a CPU limit of {limit}")
    return found


def no_surge_for_accelerators(objs: list[dict]) -> list[str]:
    found = []
    for obj in objs:
        if obj["kind"] != "Deployment":
            continue
        limits = obj["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        if any("gpu" in resource for resource in limits):
            strategy = obj["spec"].get("strategy", {})
            if strategy.get("type") != "Recreate" and str(strategy.get("rollingUpdate", {}).get("maxSurge")) != "0":
                found.append(f"{obj['metadata']['name']}: a rollout would surge past the GPU pool")
    return found


POLICIES = [restricted_pod_security, metrics_not_exposed, threads_match_the_cpu_limit, no_surge_for_accelerators]


def test_every_rendered_case_passes_the_policies(rendered):
    for case, objs in rendered.items():
        violations = [v for policy in POLICIES for v in policy(objs)]
        volume, components = HOST_PATH_CASES.get(case, ("", ()))
        assert sorted(violations) == sorted(f"{n}: hostPath volume {volume}" for n, _ in _pod_specs(objs)
                                            if n.rsplit("-", 1)[-1] in components), case


def test_each_policy_catches_its_violation(rendered):
    """What each policy refuses, made by hand from a passing release (and what the previous chart did itself)."""
    objs = copy.deepcopy(rendered["everything"])
    deployments = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in objs if o["kind"] == "Deployment"}
    decode = deployments["decode"]["spec"]
    decode["template"]["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    assert restricted_pod_security(objs) == [f"{deployments['decode']['metadata']['name']}/decode: "
                                             "privilege escalation allowed"]
    api = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"].endswith("-router"))
    api["spec"]["ports"].append({"name": "metrics", "port": 9400, "targetPort": "metrics"})  # the previous chart's
    assert metrics_not_exposed(objs) == [f"{api['metadata']['name']}: metrics on a LoadBalancer"]
    args = decode["template"]["spec"]["containers"][0]["args"]
    args[args.index("--num-threads") + 1] = "8"  # the previous chart's hard-coded 2, under a limit of 4, alike
    assert threads_match_the_cpu_limit(objs) == [f"{deployments['decode']['metadata']['name']}: 8 threads under a "
                                                 "CPU limit of 2"]
    gpu = copy.deepcopy(rendered["gpu"])
    for obj in gpu:
        obj.get("spec", {}).pop("strategy", None)  # the previous chart's: Kubernetes' default surge
    assert no_surge_for_accelerators(gpu) == ["demo-splitserve-decode: a rollout would surge past the GPU pool"]

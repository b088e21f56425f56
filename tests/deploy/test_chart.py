"""The Helm chart, rendered by Helm itself (helm-python-sdk, Helm's Go SDK without a cluster) for each values file in
``deploy/helm/splitserve/ci`` plus the defaults: it lints clean, every manifest passes ``kubernetes-validate
--strict`` (the Prometheus Operator's kinds, which it has no schema for, are checked by promtool and by shape), the
committed schema is the generated one and refuses bad values at install, and each optional template renders nothing
when it is off. The rendering helpers here serve the other chart tests; how values reach each process' flags is
tests/deploy/test_chart_flags.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from splitserve.deploy.chart_schema import COMPONENTS, SCHEMA_PATH
from splitserve.deploy.chart_schema import render as render_schema
from splitserve.runtime.config import parse_config

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "splitserve"
VALUES_FILES = {path.stem.removesuffix("-values"): path for path in sorted((CHART / "ci").glob("*-values.yaml"))}
CASES = ["defaults", *VALUES_FILES]
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "demo", "llm"
POD_IP = "10.1.2.3"
COMMANDS = {"splitserve.router.server": "router", "splitserve.prefill_service": "prefill",
            "splitserve.decode_service": "decode", "splitserve.deploy.planner": "planner",
            "splitserve.simulator.planner_check": "planner"}


# What an install must say (the chart has no default for them): where the image is, the Redis password's Secret.
REQUIRED = {"image": {"repository": "registry.example.com/splitserve"},
            "redis": {"auth": {"existingSecret": "splitserve-redis"}},
            "planner": {"config": {"prometheusUrl": "http://prometheus-operated.monitoring.svc:9090"}}}


def with_required(values: dict, required: dict = REQUIRED) -> dict:
    """``values`` over the REQUIRED ones (a key set in ``values`` wins, at any depth)."""
    merged = dict(required)
    for key, value in values.items():
        merged[key] = with_required(value, merged[key]) if isinstance(value, dict) and isinstance(
            merged.get(key), dict) else value
    return merged


def case_values(case: str) -> dict:
    return REQUIRED if case == "defaults" else yaml.safe_load(VALUES_FILES[case].read_text())


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def render(chart, values: dict) -> dict[str, list[dict]]:
    """Template file -> the objects it renders (NOTES.txt left out)."""
    rendered = chart.render(with_required(values), name=RELEASE, namespace=NAMESPACE)
    return {path.removeprefix("splitserve/templates/"): [doc for doc in yaml.safe_load_all(text) if doc]
            for path, text in rendered.items() if not path.endswith("NOTES.txt")}


def objects(chart, values: dict) -> list[dict]:
    return [obj for docs in render(chart, values).values() for obj in docs]


def containers_by_component(objs: list[dict]) -> dict[str, dict]:
    """Component -> its Deployment's splitserve container (router, prefill, decode, mixed, planner)."""
    found = {}
    for obj in objs:
        if obj["kind"] == "Deployment":
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            if component in COMPONENTS:
                found[component] = obj
    return found


def expanded_args(container: dict) -> list[str]:
    """The container's args as the kubelet passes them: $(POD_IP) expanded."""
    return [arg.replace("$(POD_IP)", POD_IP) for arg in container["args"]]


def literal_env(container: dict) -> dict[str, str]:
    """SPLITSERVE_* variables, a Secret's value standing in as the placeholder 'from-secret'."""
    env = {}
    for var in container.get("env") or []:
        if var["name"].startswith("SPLITSERVE_"):
            env[var["name"]] = var.get("value", "redis://from-secret:6379/0" if "REDIS" in var["name"] else "k1,k2")
    return env


def parsed_config(deployment: dict):
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
    assert COMMANDS[container["command"][-1]] in (component, "decode")  # mixed pods run decode_service
    return parse_config(COMPONENTS[component], expanded_args(container), env=literal_env(container))


# ---- lint, Kubernetes schemas ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean(case):
    report = helm.lint(str(CHART), case_values(case), strict=True, namespace=NAMESPACE, kube_version=KUBE_VERSION)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # info ("icon is recommended") is fine
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_passes_strict_kubernetes_validation(chart, case, tmp_path):
    checked = set()
    for obj in objects(chart, case_values(case)):
        if obj["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
            check_prometheus_operator_object(obj, tmp_path)
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        checked.add(obj["kind"])
    assert {"Deployment", "Service"} <= checked


def check_prometheus_operator_object(obj: dict, tmp_path: Path) -> None:
    """kubernetes-validate has no CRD schemas: PrometheusRule specs go through promtool, ServiceMonitors by shape."""
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    if obj["kind"] == "PrometheusRule":
        rules = tmp_path / "rules.yaml"
        rules.write_text(yaml.safe_dump(obj["spec"]))
        subprocess.run(["promtool", "check", "rules", str(rules)], check=True, capture_output=True)
    elif obj["kind"] == "Certificate":  # cert-manager's: tests/deploy/test_chart_cluster.py checks its fields
        assert obj["spec"]["secretName"] and obj["spec"]["dnsNames"] and obj["spec"]["issuerRef"]["name"]
    else:
        assert obj["kind"] == "ServiceMonitor"
        assert obj["spec"]["selector"]["matchLabels"] and obj["spec"]["endpoints"]
        for endpoint in obj["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "tlsConfig"}
            assert re.fullmatch(r"[0-9]+(ms|s|m|h)", endpoint["interval"])


# ---- the schema, the dashboards ---------------------------------------------------------------------------------

def test_the_committed_schema_is_generated_from_the_dataclasses():
    assert SCHEMA_PATH.read_text() == render_schema(), "run: python -m splitserve.deploy.chart_schema"


def test_dashboards_ship_as_labelled_configmaps(chart):
    maps = [o for o in objects(chart, {}) if o["kind"] == "ConfigMap"]
    assert sorted(next(iter(m["data"])) for m in maps) == sorted(
        p.name for p in (CHART.parent.parent / "grafana" / "dashboards").glob("*.json"))
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        dashboard = json.loads(next(iter(config_map["data"].values())))
        assert dashboard["uid"].startswith("splitserve-")


# ---- the schema refuses bad values ---------------------------------------------------------------------------

BAD_VALUES = {
    "negative replicas": {"decode": {"replicas": -1}},
    "unknown codec": {"router": {"config": {"kvCodec": "gzip"}}},
    "unknown codec in a list": {"decode": {"config": {"acceptedKvCodecs": ["int8", "lz4"]}}},
    "unknown weight format": {"decode": {"config": {"quantization": "q4_k_m"}}},
    "unknown policy": {"router": {"config": {"policy": "random"}}},
    "port out of range": {"router": {"service": {"grpcPort": 70000}}},
    "metrics port zero": {"prefill": {"ports": {"metrics": 0}}},
    "a key that reaches no flag": {"decode": {"config": {"maxBatchSize": 8}}},
    "a flag the chart owns": {"prefill": {"config": {"advertiseAddress": "1.2.3.4:1"}}},
    "wrong type": {"decode": {"config": {"maxNumSeqs": "many"}}},
    "fractional integer": {"decode": {"config": {"maxNumSeqs": 1.5}}},
    "unknown model source": {"model": {"source": "s3"}},
    "two Redis replicas": {"redis": {"replicas": 2}},
    "planner and HPA on one pool": {"planner": {"enabled": True}, "decode": {"autoscaling": {"enabled": True}}},
    "utilization over 1": {"planner": {"config": {"targetUtilization": 1.5}}},
    "unknown top-level key": {"routr": {"replicas": 1}},
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_the_schema_rejects_bad_values(chart, name):
    with pytest.raises(helm.HelmValuesError):
        chart.render(BAD_VALUES[name], name=RELEASE, namespace=NAMESPACE)


def test_the_schema_accepts_every_ci_values_file(chart):
    for case in VALUES_FILES:
        chart.validate_schema(case_values(case))


# ---- optional templates ----------------------------------------------------------------------------------------

OPTIONAL = {  # template -> values that turn it on (the defaults leave it off)
    "deployment-mixed.yaml": {"mixed": {"enabled": True}},
    "service-mixed.yaml": {"mixed": {"enabled": True}},
    **{f"pdb-{c}.yaml": {c: {"replicas": 2, **({"enabled": True} if c == "mixed" else {})}}  # 1 pod: no budget
       for c in ("router", "prefill", "decode", "mixed")},
    **{f"hpa-{c}.yaml": {c: {"autoscaling": {"enabled": True}, **({"enabled": True} if c == "mixed" else {})}}
       for c in ("router", "prefill", "decode", "mixed")},
    **{f"servicemonitor-{c}.yaml": {c: {"serviceMonitor": {"enabled": True},
                                        **({"enabled": True} if c in ("mixed", "planner") else {})}}
       for c in ("router", "prefill", "decode", "mixed", "planner")},
    **{f"{kind}-planner.yaml": {"planner": {"enabled": True}}
       for kind in ("deployment", "service", "serviceaccount", "role", "rolebinding")},
    "prometheusrule.yaml": {"prometheusRule": {"enabled": True}},
    "certificate.yaml": {"tls": {"enabled": True, "secretName": "s", "certManager": {
        "enabled": True, "issuerRef": {"name": "ca"}}}},
    "networkpolicy-mixed.yaml": {"mixed": {"enabled": True}},
    "networkpolicy-planner.yaml": {"planner": {"enabled": True}},
    "secret-redis.yaml": {"redis": {"auth": {"existingSecret": "", "password": "from-my-values"}}},
}
OFF_BY_VALUE = {  # template -> values that turn off something the defaults turn on
    "deployment-redis.yaml": {"redis": {"enabled": False, "externalUrl": "redis://r:6379/0"}},
    "service-redis.yaml": {"redis": {"enabled": False, "externalUrl": "redis://r:6379/0"}},
    "configmap-dashboards.yaml": {"grafanaDashboards": {"enabled": False}},
    "deployment-prefill.yaml": {"prefill": {"enabled": False}},
    "service-prefill.yaml": {"prefill": {"enabled": False}},
    "deployment-decode.yaml": {"decode": {"enabled": False}, "mixed": {"enabled": True}},
    **{f"networkpolicy-{c}.yaml": {"networkPolicy": {"enabled": False}} for c in ("router", "prefill", "decode",
                                                                                     "redis")},
}


@pytest.mark.parametrize("template", list(OPTIONAL))
def test_an_optional_template_renders_nothing_when_off_and_something_when_on(chart, template):
    assert render(chart, {})[template] == []
    assert render(chart, OPTIONAL[template])[template]


@pytest.mark.parametrize("template", list(OFF_BY_VALUE))
def test_a_default_template_renders_nothing_when_turned_off(chart, template):
    assert render(chart, {})[template]
    assert render(chart, OFF_BY_VALUE[template])[template] == []


def test_every_template_is_covered_by_the_on_off_tests():
    always = {"deployment-router.yaml", "service-router.yaml", "service-router-metrics.yaml", "service-pods.yaml",
              "NOTES.txt"}
    templates = {p.name for p in (CHART / "templates").iterdir() if not p.name.startswith("_")}
    # decode's Service shares its definition with prefill's, which OFF_BY_VALUE covers
    uncovered = templates - set(OPTIONAL) - set(OFF_BY_VALUE) - always - {"service-decode.yaml"}
    assert not uncovered, uncovered

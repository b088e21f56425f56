"""The Helm chart, rendered by Helm itself (helm-python-sdk, Helm's Go SDK without a cluster) for each values file in
``deploy/helm/splitserve/ci`` plus the defaults: it lints clean, every manifest passes ``kubernetes-validate
--strict`` (the Prometheus Operator's kinds, which it has no schema for, are checked by promtool and by shape), every
value of a component's ``config`` block reaches a flag of the component's dataclass and the rendered command line
parses into a working config, the schema refuses bad values at install, and each optional template renders
nothing when it is off.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from splitserve.deploy.chart_schema import COMPONENTS, SCHEMA_PATH, camel, config_fields
from splitserve.deploy.chart_schema import render as render_schema
from splitserve.runtime.config import parse_config

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "splitserve"
VALUES_FILES = {path.stem.removesuffix("-values"): path for path in sorted((CHART / "ci").glob("*-values.yaml"))}
CASES = ["defaults", *VALUES_FILES]
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "demo", "llm"
POD_IP = "10.1.2.3"
COMMANDS = {"splitserve.router.server": "router", "splitserve.prefill_service": "prefill", "splitserve.decode_service": "decode",
            "splitserve.deploy.planner": "planner", "splitserve.simulator.planner_check": "planner"}


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


def field_names(component: str) -> set[str]:
    return {f.name for f in dataclasses.fields(COMPONENTS[component])}


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


# ---- values -> flags ----------------------------------------------------------------------------------------------

def test_the_committed_schema_is_generated_from_the_dataclasses():
    assert SCHEMA_PATH.read_text() == render_schema(), "run: python -m splitserve.deploy.chart_schema"


def test_every_config_value_in_values_yaml_is_a_field_of_its_dataclass():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for component in COMPONENTS:
        allowed = {camel(f.name) for f in config_fields(component)}
        unknown = set(values[component]["config"]) - allowed
        assert not unknown, f"{component}.config: {sorted(unknown)} reach no flag of {COMPONENTS[component].__name__}"


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_every_config_key_reaches_its_flag(chart, component):
    """Each field a config block may set, set to a value of the right type that is not its default, arrives in
    the process' config through the rendered command line."""
    hints = {f.name: f.type for f in dataclasses.fields(COMPONENTS[component])}
    schema = json.loads(SCHEMA_PATH.read_text())["properties"][component]["properties"]["config"]["properties"]
    chosen = {name: EXISTING_FILES.get(name) or _other_value(spec) for name, spec in schema.items()}
    values = {component: {"config": chosen}, "planner": {"enabled": component == "planner",
                                                           "config": {} if component != "planner" else chosen}}
    if component == "mixed":
        values["mixed"]["enabled"] = True
    if component == "planner":
        values = {"planner": {"enabled": True, "config": chosen}}
    deployment = containers_by_component(objects(chart, values))[component]
    config = parsed_config(deployment)
    for key, value in chosen.items():
        name = re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), key)
        assert name in hints, key
        assert getattr(config, name) == value, f"{component}.config.{key}"


@pytest.mark.parametrize("simulate_check, module", [(False, "splitserve.deploy.planner"), (True, "splitserve.simulator.planner_check")])
def test_the_planner_checked_in_simulation_runs_from_the_simulator(chart, simulate_check, module):
    """The simulated check lives in the simulator (a layer above the planner): the chart runs that entry point."""
    values = {"planner": {"enabled": True, "config": {"simulateCheck": simulate_check}}}
    container = containers_by_component(objects(chart, values))["planner"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", module]


# Keys naming a file the process reads at start: another value must be a file that exists.
EXISTING_FILES = {"kvQualityTable": str(Path(__file__).parents[2] / "kvtransfer" / "quality" / "smollm2-135m.json"),
                  "kvShmDir": str(Path(__file__).parent)}  # a directory that exists


def _other_value(spec: dict):
    """A valid value for a config key that differs from its default (so that its arrival is visible)."""
    default = spec["default"]
    if spec["type"] == "boolean":
        return not default
    if "enum" in spec:
        return next(v for v in spec["enum"] if v != default and v != "")
    if spec["type"] == "array":
        items = spec["items"].get("enum", ["a", "b"])
        return items[:1] if default != items[:1] else items[:2]
    if spec["type"] == "integer":
        return default + 1 if "maximum" not in spec or default + 1 <= spec["maximum"] else default - 1
    if spec["type"] == "number":
        upper = spec.get("maximum", spec.get("exclusiveMaximum"))
        return default * 0.9 if upper is not None and default * 1.5 >= upper else default * 1.5 + 0.25
    return (default + "-x") if default else "x"


@pytest.mark.parametrize("case", CASES)
def test_rendered_command_lines_parse_into_working_configs(chart, case):
    """No required flag without a value: each process' rendered args (and env) build its config, with the
    registry in Redis, the pods advertising their pod IP, and termination grace covering the drain."""
    values = case_values(case)
    deployments = containers_by_component(objects(chart, values))
    expected = {"router", *(c for c in ("prefill", "decode", "mixed", "planner")
                            if (values.get(c, {}).get("enabled", c in ("prefill", "decode"))))}
    assert set(deployments) == expected
    for component, deployment in deployments.items():
        config = parsed_config(deployment)
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        for var in container.get("env") or []:
            if var["name"].startswith("SPLITSERVE_"):
                assert var["name"].removeprefix("SPLITSERVE_").lower() in field_names(component), var["name"]
        if component == "planner":
            assert (config.prefill_deployment, config.decode_deployment, config.namespace) == (
                f"{RELEASE}-splitserve-prefill", f"{RELEASE}-splitserve-decode", NAMESPACE)
            continue
        assert config.registry == "redis"
        redis = values.get("redis", {})
        if redis.get("enabled", True):
            # the kubelet puts the password from the Secret in place of $(REDIS_PASSWORD)
            assert config.redis_url == f"redis://:$(REDIS_PASSWORD)@{RELEASE}-splitserve-redis:6379/0"
        else:
            assert config.redis_url == "redis://from-secret:6379/0"
        if component != "router":
            assert config.advertise_address == f"{POD_IP}:{config.port}"
            if component != "prefill":
                assert config.role == component
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports == {"grpc": config.port, "metrics": config.metrics_port, "probe": config.probe_port}
            assert pod["terminationGracePeriodSeconds"] > config.shutdown_grace_s
        model = values.get("model", {})
        if model.get("source", "image") == "image":
            assert config.model == "smollm2-135m"
        else:
            assert config.model == f"/models/{model['path']}"
            mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
            assert mount["mountPath"] == "/models" and mount["readOnly"]


def test_each_component_gets_its_own_weight_format(chart):
    """Prefill on float weights, decode on the GGUF file's blocks, mixed on int8: each Deployment's command line
    gives its pods their own --quantization (and the defaults give every pod none)."""
    values = {"prefill": {"config": {"quantization": "none"}}, "decode": {"config": {"quantization": "gguf"}},
              "mixed": {"enabled": True, "config": {"quantization": "int8"}}}
    formats = {component: parsed_config(deployment).engine_config().quantization
               for component, deployment in containers_by_component(objects(chart, values)).items()
               if component != "router"}
    assert formats == {"prefill": "none", "decode": "gguf", "mixed": "int8"}
    defaults = containers_by_component(objects(chart, {"mixed": {"enabled": True}}))
    assert {parsed_config(defaults[c]).quantization for c in ("prefill", "decode", "mixed")} == {"auto"}


@pytest.mark.parametrize("case", ["defaults", "tls"])
def test_probes_are_native_grpc_on_the_plain_probe_port_with_tls_or_without(chart, case):
    """kubelet's gRPC probe speaks no TLS: every process serves health alone in plain text on --probe-port, and
    every gRPC probe asks there (the old chart ran grpcurl, an x86-64 binary, through a Python wrapper under TLS)."""
    deployments = containers_by_component(objects(chart, case_values(case)))
    for component in ("router", "prefill", "decode"):
        container = deployments[component]["spec"]["template"]["spec"]["containers"][0]
        probe_port = parsed_config(deployments[component]).probe_port
        assert {"name": "probe", "containerPort": probe_port} in container["ports"] and probe_port == 8081
        probes = ("readinessProbe",) if component == "router" else ("startupProbe", "readinessProbe", "livenessProbe")
        for probe in probes:
            assert container[probe]["grpc"] == {"port": probe_port}, (component, probe)
            assert "exec" not in container[probe]
    router = deployments["router"]["spec"]["template"]["spec"]["containers"][0]
    assert "tcpSocket" in router["livenessProbe"] and "tcpSocket" in router["startupProbe"]  # see the template


TLS_DIR = "/etc/splitserve/tls"


@pytest.mark.parametrize("case", ["defaults", "tls"])
def test_tls_reaches_every_process_from_the_secret(chart, case):
    """With ``tls.enabled``, every process (router and pods) gets the certificate, key and CA files of the Secret,
    mounted read-only, and mutual TLS as asked; the router's metrics are scraped over HTTPS. Off: none of it."""
    values = case_values(case)
    on = values.get("tls", {}).get("enabled", False)
    objs = objects(chart, values)
    for component, deployment in containers_by_component(objs).items():
        config = parsed_config(deployment)
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        if not on:
            assert (config.tls_cert_file, config.tls_key_file, config.tls_ca_file) == ("", "", ""), component
            assert "tls" not in volumes and "tls" not in mounts, component
            continue
        assert (config.tls_cert_file, config.tls_key_file, config.tls_ca_file, config.tls_require_client_cert) == (
            f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt", values["tls"]["requireClientCert"]), \
            component
        assert volumes["tls"]["secret"] == {"secretName": values["tls"]["secretName"]}, component
        assert mounts["tls"] == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}, component
    # With TLS or without, the router's /metrics is plain HTTP on its own port, so scrapers need no client
    # certificate under mutual TLS.
    router = containers_by_component(objs)["router"]["spec"]["template"]
    assert router["metadata"]["annotations"].get("prometheus.io/scheme") is None
    [monitor] = [o for o in objs if o["kind"] == "ServiceMonitor" and
                 o["metadata"]["labels"]["app.kubernetes.io/component"] == "router"] or [None]
    if monitor is not None:
        assert monitor["spec"]["endpoints"][0].get("scheme") in (None, "http")


@pytest.mark.parametrize("case", ["defaults", "everything"])
def test_api_keys_reach_only_the_router_and_only_from_the_secret(chart, case):
    """``router.apiKeysSecret`` puts the keys in the router's environment from the Secret (never on its command
    line, which ``ps`` and the pod spec show); the pods get none."""
    values = case_values(case)
    secret = values.get("router", {}).get("apiKeysSecret")
    for component, deployment in containers_by_component(objects(chart, values)).items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = {var["name"]: var for var in container.get("env") or []}
        assert not any(arg.startswith("--api-keys") for arg in container["args"]), component
        if component == "router" and secret:
            assert env["SPLITSERVE_API_KEYS"] == {"name": "SPLITSERVE_API_KEYS", "valueFrom": {
                "secretKeyRef": {"name": secret["name"], "key": secret["key"]}}}
            assert parsed_config(deployment).api_keys == ["k1", "k2"]  # the Secret's value, as the router reads it
        else:
            assert "SPLITSERVE_API_KEYS" not in env, component


def test_planner_role_allows_only_reading_and_scaling_the_two_deployments(chart):
    objs = objects(chart, case_values("planner"))
    role = next(o for o in objs if o["kind"] == "Role")
    names = [f"{RELEASE}-splitserve-prefill", f"{RELEASE}-splitserve-decode"]
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": names,
         "verbs": ["patch"]},  # what deploy/planner/scaler.py calls, nothing more
        {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": names, "verbs": ["get"]}]
    deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    for name in names:  # the planner owns the counts: an upgrade must not reset them
        assert "replicas" not in deployments[name]["spec"]
    assert deployments[f"{RELEASE}-splitserve-router"]["spec"]["replicas"] == 1


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

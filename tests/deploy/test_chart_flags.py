"""Values to processes: every value of a component's ``config`` block reaches a flag of the component's dataclass,
the rendered command lines (and environment) parse into working configs, each pod gets its own weight format, probes,
TLS files and API keys reach the processes that need them, and one service level (issue 35) reaches every rendered
place: ``serviceLevel``'s TTFT and TPOT targets reach the router's goodput and placement flags, the hybrid decode
pods' TPOT-slack chunking, the planner's sizing targets and the PrometheusRule's alerts; the chart's defaults are
``runtime/service_level.py``'s and ``RouterConfig``'s, so ``splitserve up``, ``splitserve router`` and ``helm
install`` agree."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from helm_python.errors import HelmError
from test_chart import (  # noqa: F401 - chart: the fixture
    CASES,
    CHART,
    NAMESPACE,
    POD_IP,
    RELEASE,
    case_values,
    chart,
    containers_by_component,
    objects,
    parsed_config,
    render,
)

from splitserve.deploy.chart_schema import COMPONENTS, SCHEMA_PATH, camel, config_fields
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.router.config import RouterConfig, Scheduling
from splitserve.runtime.service_level import DEFAULT_TPOT_S, DEFAULT_TTFT_S
from splitserve.up_config import UpConfig


# SPLITSERVE_ variables that are not a config field's: the kernels' build reads them (engine/kernels/build.py)
NOT_CONFIG = {"SPLITSERVE_KERNEL_TARGET"}


def field_names(component: str) -> set[str]:
    return {f.name for f in dataclasses.fields(COMPONENTS[component])}


# ---- every config key, every command line ---------------------------------------------------------------------

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
    chosen = {name: EXISTING_FILES.get(name) or BOUND_BY_OTHERS.get(name) or _other_value(spec)
              for name, spec in schema.items()}
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


@pytest.mark.parametrize("simulate_check, module", [(False, "splitserve.deploy.planner"),
                                                    (True, "splitserve.simulator.planner_check")])
def test_the_planner_checked_in_simulation_runs_from_the_simulator(chart, simulate_check, module):
    """The simulated check lives in the simulator (a layer above the planner): the chart runs that entry point."""
    values = {"planner": {"enabled": True, "config": {"simulateCheck": simulate_check}}}
    container = containers_by_component(objects(chart, values))["planner"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", module]


# Keys naming a file the process reads at start: another value must be a file that exists.
EXISTING_FILES = {"kvQualityTable": str(Path(__file__).parents[2] / "kvtransfer" / "quality" / "smollm2-135m.json")}

# Keys checked against others' values: a rank budget must hold the pool's minimum (minPrefillReplicas + 1 pods).
BOUND_BY_OTHERS = {"maxPrefillRanks": 8, "maxDecodeRanks": 8}


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
            if var["name"].startswith("SPLITSERVE_") and var["name"] not in NOT_CONFIG:
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


# ---- one service level ----------------------------------------------------------------------------------------

ALL_ON = {"planner": {"enabled": True}, "prometheusRule": {"enabled": True}}


def rendered_targets(chart, values: dict) -> dict[str, float]:
    """Every place the chart puts a TTFT or TPOT target, read back from the rendered manifests."""
    rendered = render(chart, values)
    deployments = containers_by_component([obj for docs in rendered.values() for obj in docs])
    router, decode, planner = (parsed_config(deployments[name]) for name in ("router", "decode", "planner"))
    alerts = {rule["alert"]: rule["expr"] for group in rendered["prometheusrule.yaml"][0]["spec"]["groups"]
              for rule in group["rules"] if "alert" in rule}
    return {"router ttft": router.slo_ttft_s, "router tpot": router.slo_tpot_s,
            "decode tpot": decode.tpot_target_s,
            "planner ttft": planner.ttft_target_s, "planner tpot": planner.tpot_target_s,
            "ttft alert": float(alerts["SplitserveTTFTP99OverTarget"].rsplit(">", 1)[1]),
            "tpot alert": float(alerts["SplitserveTPOTP99OverTarget"].rsplit(">", 1)[1])}


def test_the_charts_defaults_are_the_one_service_level_and_scheduling():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["serviceLevel"] == {"ttftSeconds": DEFAULT_TTFT_S,
                                      "tpotSeconds": DEFAULT_TPOT_S}
    assert values["router"]["config"]["scheduling"] == RouterConfig.scheduling == UpConfig.scheduling == "hybrid"
    assert (RouterConfig.slo_ttft_s, RouterConfig.slo_tpot_s) == (UpConfig.slo_ttft_s, UpConfig.slo_tpot_s) == (
        PlannerConfig.ttft_target_s, PlannerConfig.tpot_target_s) == (DEFAULT_TTFT_S,
                                                                    DEFAULT_TPOT_S)


def test_one_value_changes_each_target_everywhere_it_is_used(chart):
    assert set(rendered_targets(chart, ALL_ON).values()) == {DEFAULT_TTFT_S, DEFAULT_TPOT_S}
    targets = rendered_targets(chart, {**ALL_ON, "serviceLevel": {"ttftSeconds": 0.35, "tpotSeconds": 0.042}})
    assert targets == {"router ttft": 0.35, "router tpot": 0.042, "decode tpot": 0.042, "planner ttft": 0.35,
                       "planner tpot": 0.042, "ttft alert": 0.35, "tpot alert": 0.042}


@pytest.mark.parametrize("scheduling, chunks", [("hybrid", True), ("disaggregated", False), ("colocated", False)])
def test_hybrid_decode_pods_chunk_lent_prompts(chart, scheduling, chunks):
    """The router lends prompts to decode pods only when it schedules hybrid; only then do they need to chunk them."""
    values = {"router": {"config": {"scheduling": scheduling}}, "mixed": {"enabled": True}}
    deployments = containers_by_component([obj for docs in render(chart, values).values() for obj in docs])
    assert parsed_config(deployments["router"]).scheduling is Scheduling(scheduling)
    decode = parsed_config(deployments["decode"])
    assert (decode.tpot_slack_chunking, decode.tpot_target_s) == (
        (True, DEFAULT_TPOT_S) if chunks else (False, 0.0))
    assert not parsed_config(deployments["mixed"]).tpot_slack_chunking  # a mixed pod lends nothing


def test_the_schema_refuses_a_target_set_twice_or_not_positive(chart):
    for values in ({"router": {"config": {"sloTtftS": 2}}}, {"planner": {"config": {"ttftTargetS": 2}}},
                   {"serviceLevel": {"ttftSeconds": 0}}, {"prometheusRule": {"ttftP99TargetSeconds": 2}}):
        with pytest.raises(HelmError):
            render(chart, values)

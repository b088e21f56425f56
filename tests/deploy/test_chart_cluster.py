"""What a real cluster needs of the chart, checked field by field on the manifests Helm renders: TLS that verifies
between pods dialled by IP (one Service name every certificate lists, a cert-manager Certificate for it), metrics
scraped on plain ports under mutual TLS, NetworkPolicies that allow exactly the links splitserve uses (evaluated as
a CNI would), the bundled Redis behind a password from a Secret, and one drain setting for the router.
"""

from __future__ import annotations

import base64
import itertools
import json
import re

import helm_python as helm
import kubernetes_validate
import pytest
from test_chart import (  # noqa: F401 - chart:
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    SCHEMA_PATH,
    case_values,
    chart,
    containers_by_component,  # the fixture
    objects,
    parsed_config,
    with_required,
)

SERVER_NAME = f"{RELEASE}-splitserve-pods.{NAMESPACE}.svc"
SERVING = ("prefill", "decode", "mixed")


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"].removeprefix(f"{RELEASE}-splitserve-"): o for o in objs if o["kind"] == kind}


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(deployment: dict) -> list[dict]:
    return container(deployment).get("env") or []


# ---- TLS -----------------------------------------------------------------------------------------------------

def test_every_process_checks_pods_against_the_pods_service_name(chart):
    objs = objects(chart, {**case_values("tls"), "mixed": {"enabled": True}})
    deployments = containers_by_component(objs)
    for component in ("router", *SERVING):
        config = parsed_config(deployments[component])
        assert config.tls_server_name == SERVER_NAME, component
        assert config.tls_require_client_cert and config.tls_ca_file == "/etc/splitserve/tls/ca.crt"
    service = by_kind(objs, "Service")["pods"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    selector = service["spec"]["selector"]
    for component, deployment in deployments.items():  # the Service names the serving pods, and only them
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert (selector.items() <= labels.items()) == (component in SERVING), component


def test_the_cert_manager_certificate_lists_every_name_the_release_dials(chart):
    certificate = next(o for o in objects(chart, case_values("tls")) if o["kind"] == "Certificate")
    spec = certificate["spec"]
    assert spec["secretName"] == "splitserve-tls"
    router = f"{RELEASE}-splitserve-router"
    assert spec["dnsNames"] == [SERVER_NAME, router, f"{router}.{NAMESPACE}", f"{router}.{NAMESPACE}.svc",
                                "llm.example.com"]
    assert {"server auth", "client auth"} <= set(spec["usages"])  # one identity: server and client (mutual TLS)
    assert spec["issuerRef"] == {"name": "splitserve-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert spec["privateKey"]["rotationPolicy"] == "Always"


def test_a_chosen_server_name_replaces_the_services(chart):
    values = {"tls": {"enabled": True, "secretName": "s", "serverName": "pods.example.internal"}}
    for deployment in containers_by_component(objects(chart, values)).values():
        if container(deployment)["command"][-1] != "splitserve.deploy.planner":
            assert parsed_config(deployment).tls_server_name == "pods.example.internal"


def test_the_certificate_needs_an_issuer(chart):
    with pytest.raises(helm.HelmError, match="tls.certManager.issuerRef.name is required"):
        chart.render(with_required({"tls": {"enabled": True, "secretName": "s", "certManager": {"enabled": True}}}),
                     name=RELEASE, namespace=NAMESPACE)


# ---- metrics under mutual TLS ----------------------------------------------------------------------------------

def test_the_router_serves_metrics_on_a_plain_port_that_its_service_monitor_scrapes(chart):
    objs = objects(chart, {**case_values("tls"), "router": {"serviceMonitor": {"enabled": True}}})
    router = containers_by_component(objs)["router"]
    assert parsed_config(router).metrics_port == 9400
    assert {"name": "metrics", "containerPort": 9400} in container(router)["ports"]
    annotations = router["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9400" and "prometheus.io/scheme" not in annotations
    services = by_kind(objs, "Service")
    assert "metrics" not in {p["name"] for p in services["router"]["spec"]["ports"]}  # the API Service: APIs only
    metrics_service = services["router-metrics"]
    assert metrics_service["spec"]["type"] == "ClusterIP"
    assert [(p["name"], p["port"]) for p in metrics_service["spec"]["ports"]] == [("metrics", 9400)]
    monitor = by_kind(objs, "ServiceMonitor")["router"]
    selector = monitor["spec"]["selector"]["matchLabels"]  # the metrics Service, not the API Service
    assert selector.items() <= metrics_service["metadata"]["labels"].items()
    assert not selector.items() <= services["router"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and "scheme" not in endpoint and "tlsConfig" not in endpoint


# ---- network policies ------------------------------------------------------------------------------------------

def _matches(peer: dict, labels: dict[str, str]) -> bool:
    """A NetworkPolicy peer against a pod of this namespace (namespaceSelector {} selects every namespace)."""
    if "ipBlock" in peer:
        return False
    pod_selector = peer.get("podSelector")
    if pod_selector is None:
        return peer.get("namespaceSelector") == {}  # any pod of any namespace; a labelled one is elsewhere
    return pod_selector.get("matchLabels", {}).items() <= labels.items()


def _rule_allows(rules: list[dict], direction: str, peer_labels: dict, port: int) -> bool:
    for rule in rules:
        peers = rule.get(direction)
        if peers and not any(_matches(p, peer_labels) for p in peers):
            continue
        ports = rule.get("ports")
        if not ports or any(p["port"] == port for p in ports):
            return True
    return False


def allowed_links(objs: list[dict]) -> set[tuple[str, str, int]]:
    """(from, to, port) pairs between the release's components that both ends' policies allow."""
    policies = {name: p["spec"] for name, p in by_kind(objs, "NetworkPolicy").items()}
    pods = {}
    for name, deployment in by_kind(objs, "Deployment").items():
        spec = deployment["spec"]["template"]
        pods[name] = (spec["metadata"]["labels"], {p["containerPort"] for c in spec["spec"]["containers"]
                                                   for p in c.get("ports", [])})
    links = set()
    for (source, (source_labels, _)), (target, (target_labels, ports)) in itertools.product(pods.items(), repeat=2):
        for port in ports:
            if source == target:
                continue
            egress = _rule_allows(policies[source]["egress"], "to", target_labels, port)
            ingress = _rule_allows(policies[target]["ingress"], "from", source_labels, port)
            if egress and ingress:
                links.add((source, target, port))
    return links


def test_network_policies_allow_exactly_the_links_splitserve_uses(chart):
    objs = objects(chart, {"mixed": {"enabled": True}, "planner": {"enabled": True}})
    assert set(by_kind(objs, "NetworkPolicy")) == {"router", "prefill", "decode", "mixed", "redis", "planner"}
    for name, policy in by_kind(objs, "NetworkPolicy").items():
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == name
    metrics = {9400}  # scrapers (metricsFrom: pods of any namespace) reach these; the table below has the rest
    links = {link for link in allowed_links(objs) if link[2] not in metrics}
    assert links == {
        ("router", "prefill", 50061), ("router", "decode", 50062), ("router", "mixed", 50062),
        ("prefill", "decode", 50062), ("prefill", "mixed", 50062),
        *((client, "redis", 6379) for client in ("router", "prefill", "decode", "mixed")),
    }
    # what the old chart allowed and this one refuses: a pod outside the release calling a decode pod
    stranger = {"app.kubernetes.io/name": "curl"}
    decode = by_kind(objs, "NetworkPolicy")["decode"]["spec"]
    assert not _rule_allows(decode["ingress"], "from", stranger, 50062)
    assert not _rule_allows(by_kind(objs, "NetworkPolicy")["redis"]["spec"]["ingress"], "from", stranger, 6379)
    assert _rule_allows(decode["ingress"], "from", stranger, 9400)  # metricsFrom: any namespace's pods


def test_every_component_reaches_dns_and_the_planner_only_its_apis(chart):
    objs = objects(chart, {"planner": {"enabled": True}})
    for name, policy in by_kind(objs, "NetworkPolicy").items():
        egress = policy["spec"]["egress"]
        if name == "redis":
            assert egress == []
            continue
        dns = [r for r in egress if any(p["port"] == 53 for p in r["ports"])]
        assert dns and {p["protocol"] for p in dns[0]["ports"]} == {"UDP", "TCP"}, name
    planner = by_kind(objs, "NetworkPolicy")["planner"]["spec"]
    apis = [rule for rule in planner["egress"] if "to" not in rule]  # any address: the API server, Prometheus
    assert [[p["port"] for p in rule["ports"]] for rule in apis] == [[443, 6443, 9090]]
    assert [rule["ports"] for rule in planner["ingress"]] == [[{"port": 9400, "protocol": "TCP"}]]


def test_clients_and_scrapers_can_be_narrowed_and_an_external_redis_reached(chart):
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    clients = [{"podSelector": {"matchLabels": {"role": "gateway"}}}]
    objs = objects(chart, {"networkPolicy": {"clientsFrom": clients, "metricsFrom": prometheus,
                                             "externalRedisPorts": [6380]},
                           "redis": {"enabled": False, "externalUrl": "rediss://cache.example:6380/0"}})
    router = by_kind(objs, "NetworkPolicy")["router"]["spec"]
    assert router["ingress"][0]["from"] == clients and router["ingress"][1]["from"] == prometheus
    assert {"ports": [{"port": 6380, "protocol": "TCP"}]} in router["egress"]
    assert parsed_config(containers_by_component(objs)["router"]).redis_url == "rediss://cache.example:6380/0"


def test_network_policies_can_be_turned_off(chart):
    assert not by_kind(objects(chart, {"networkPolicy": {"enabled": False}}), "NetworkPolicy")


# ---- Redis with a password -------------------------------------------------------------------------------------

def test_the_bundled_redis_asks_for_a_password_from_a_secret(chart):
    objs = objects(chart, {"redis": {"auth": {"existingSecret": "", "password": "s3cret"}}})
    secret = by_kind(objs, "Secret")["redis"]
    assert secret["data"] == {"redis-password": base64.b64encode(b"s3cret").decode()}
    redis = container(by_kind(objs, "Deployment")["redis"])
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    password_ref = {"secretKeyRef": {"name": f"{RELEASE}-splitserve-redis", "key": "redis-password"}}
    assert {"name": "REDIS_PASSWORD", "valueFrom": password_ref} in redis["env"]
    for component, deployment in containers_by_component(objs).items():
        if component == "planner":
            continue
        env = [var["name"] for var in env_of(deployment)]
        # $(REDIS_PASSWORD) expands only from a variable defined before it
        assert env.index("REDIS_PASSWORD") < env.index("SPLITSERVE_REDIS_URL"), component
        assert "--redis-url" not in container(deployment)["args"]  # a URL with a password is not a flag
        assert parsed_config(deployment).redis_url.startswith("redis://:$(REDIS_PASSWORD)@")


def test_an_existing_password_secret_is_used_as_it_is(chart):
    objs = objects(chart, {"redis": {"auth": {"existingSecret": "ops-redis", "secretKey": "pw"}}})
    assert "redis" not in by_kind(objs, "Secret")
    router = containers_by_component(objs)["router"]
    assert {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "ops-redis", "key": "pw"}}} in \
        env_of(router)


@pytest.mark.parametrize("url, accepted", [("rediss://r:6380/0", True), ("redis://r:6379/0", True),
                                           ("http://r:6379", False)])
def test_an_external_redis_url_is_redis_or_rediss(chart, url, accepted):
    values = {"redis": {"enabled": False, "externalUrl": url}}
    if accepted:
        chart.validate_schema(values)
    else:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(values)


# ---- draining ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grace", [None, 50])
def test_the_routers_grace_period_is_derived_from_its_one_drain_setting(chart, grace):
    values = {"router": {"config": {"shutdownGraceS": grace}}} if grace else {}
    router = containers_by_component(objects(chart, values))["router"]
    config = parsed_config(router)
    assert config.shutdown_grace_s == (grace or 30)
    pre_stop, margin = 5, 5
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == pre_stop + (grace or 30) + margin


# ---- what operators expect of a chart ------------------------------------------------------------------------

ESCAPE_HATCHES = {
    "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
    "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "tolerations": [{"key": "llm", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                         "labelSelector": {"matchLabels": {"team": "llm"}}}}]}},
    "nodeSelector": {"pool": "llm"},
    "topologySpreadConstraints": [{"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"a": "b"}}}],
    "priorityClassName": "llm-serving",
    "podAnnotations": {"example.com/owner": "llm"},
    "podLabels": {"team": "llm"},
}
COMPONENTS_WITH_HATCHES = ("router", "prefill", "decode", "mixed", "planner")


@pytest.mark.parametrize("component", COMPONENTS_WITH_HATCHES)
def test_every_escape_hatch_reaches_the_pod(chart, component, tmp_path):
    values = {component: {**ESCAPE_HATCHES, **({"enabled": True} if component in ("mixed", "planner") else {})}}
    objs = objects(chart, values)
    for obj in objs:  # and the result is a valid manifest
        if not obj["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    deployment = by_kind(objs, "Deployment")[component]
    pod = deployment["spec"]["template"]
    spec, c = pod["spec"], pod["spec"]["containers"][0]
    assert ESCAPE_HATCHES["extraEnv"][0] in c["env"]
    assert ESCAPE_HATCHES["extraVolumes"][0] in spec["volumes"]
    assert ESCAPE_HATCHES["extraVolumeMounts"][0] in c["volumeMounts"]
    for key in ("tolerations", "affinity", "nodeSelector", "topologySpreadConstraints", "priorityClassName"):
        assert spec[key] == ESCAPE_HATCHES[key], key
    assert pod["metadata"]["annotations"]["example.com/owner"] == "llm"
    assert pod["metadata"]["labels"]["team"] == "llm"


@pytest.mark.parametrize("component", COMPONENTS_WITH_HATCHES + ("redis",))
def test_pods_spread_over_nodes_by_default(chart, component):
    values = {component: {"enabled": True}} if component in ("mixed", "planner") else {}
    spec = by_kind(objects(chart, values), "Deployment")[component]["spec"]
    (spread,) = spec["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_a_cuda_pod_gets_a_memory_backed_dev_shm_and_the_image_by_digest(chart):
    objs = objects(chart, case_values("gpu"))
    decode = by_kind(objs, "Deployment")["decode"]["spec"]["template"]["spec"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in decode["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in decode["containers"][0]["volumeMounts"]
    digest = case_values("gpu")["image"]["digest"]
    for name, deployment in by_kind(objs, "Deployment").items():
        if name != "redis":
            assert container(deployment)["image"] == f"registry.example.com/splitserve@{digest}"
    prefill = by_kind(objs, "Deployment")["prefill"]["spec"]["template"]["spec"]
    assert all(v["name"] != "shm" for v in prefill["volumes"])  # off unless asked for


@pytest.mark.parametrize("values, budgets", [
    ({}, set()),  # one pod each: a budget would block every drain
    ({"router": {"replicas": 2}, "decode": {"replicas": 3}}, {"router", "decode"}),
    ({"prefill": {"autoscaling": {"enabled": True, "minReplicas": 2}}}, {"prefill"}),
    ({"planner": {"enabled": True, "config": {"minDecodeReplicas": 2}}}, {"decode"}),
])
def test_disruption_budgets_protect_roles_of_two_pods_or_more(chart, values, budgets):
    pdbs = by_kind(objects(chart, values), "PodDisruptionBudget")
    assert set(pdbs) == budgets
    for name, pdb in pdbs.items():
        assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": {
            "app.kubernetes.io/name": "splitserve", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": name}}}


def test_notes_warn_about_single_pod_roles(chart):
    rendered = chart.render(with_required({"router": {"replicas": 2}}), name=RELEASE, namespace=NAMESPACE)
    notes = rendered["splitserve/templates/NOTES.txt"]
    warned = set(re.findall(r"WARNING: (\w+) runs a single pod", notes))
    assert warned == {"prefill", "decode"}


def test_every_key_of_the_schema_has_a_description():
    schema = json.loads(SCHEMA_PATH.read_text())
    missing = []

    def walk(node: dict, path: str) -> None:
        for name, prop in node.get("properties", {}).items():
            if not prop.get("description"):
                missing.append(f"{path}{name}")
            walk(prop, f"{path}{name}.")
    walk(schema, "")
    assert not missing, missing

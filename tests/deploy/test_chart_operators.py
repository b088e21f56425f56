"""What a cluster operator expects of the chart's defaults and escape hatches (issue 36), each checked on what Helm
renders: an image that must be named, rollouts that do not wait for a free GPU, the pod-spec fields GPU clusters
need (with the schema still refusing typos), DNS egress that works with NodeLocal DNSCache and on OpenShift, a Redis
password that a GitOps renderer does not change at every sync, threads sized from the CPU limit, a planner that is
told where Prometheus is, GPU values checked against each other, the kernels' target and the node's shared-memory
directory for same-host KV (issue 37) only where asked.
"""

from __future__ import annotations

import helm_python as helm
import pytest
from test_chart import (  # noqa: F401 - chart: the fixture
    NAMESPACE,
    RELEASE,
    case_values,
    chart,
    containers_by_component,
    objects,
    parsed_config,
    with_required,
)

SERVING = ("prefill", "decode", "mixed")
COMPONENTS = ("router", *SERVING, "planner")
EVERYTHING_ON = {"mixed": {"enabled": True}, "planner": {"enabled": True}}


def render_error(chart, values: dict) -> str:
    with pytest.raises(helm.HelmError) as raised:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return str(raised.value)


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


# ---- the image -------------------------------------------------------------------------------------------------

def test_an_install_must_name_the_image_repository(chart):
    """No public image exists: the old default (repository splitserve) pulled docker.io/library/splitserve:0.1.0."""
    values = with_required({})
    del values["image"]
    assert "image.repository is required" in render_error(chart, values)
    deployments = containers_by_component(objects(chart, {}))
    assert {pod_spec(d)["containers"][0]["image"] for d in deployments.values()} == {
        "registry.example.com/splitserve:0.1.0"}


# ---- rollouts and pod-spec fields ------------------------------------------------------------------------------

def test_accelerator_pods_roll_without_surge_and_a_chosen_strategy_wins(chart):
    """A surge pod needs a free GPU, which a full pool never has: the rollout would hang until its deadline."""
    deployments = containers_by_component(objects(chart, case_values("gpu")))
    assert deployments["decode"]["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert "strategy" not in deployments["prefill"]["spec"]  # CPU pods: Kubernetes' default (25% surge)
    assert deployments["decode"]["spec"]["progressDeadlineSeconds"] == 600
    chosen = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "50%", "maxUnavailable": 0}}
    deployments = containers_by_component(objects(chart, {"prefill": {"strategy": chosen}}))
    assert deployments["prefill"]["spec"]["strategy"] == chosen


def test_pod_spec_fields_reach_every_component(chart):
    sidecar = {"name": "log-shipper", "image": "registry.example.com/vector:0.40"}
    fields = {"runtimeClassName": "nvidia", "schedulerName": "volcano", "extraContainers": [sidecar],
              "progressDeadlineSeconds": 1200, "automountServiceAccountToken": True}
    values = {component: dict(fields) for component in COMPONENTS}
    values["mixed"]["enabled"] = values["planner"]["enabled"] = True
    for component, deployment in containers_by_component(objects(chart, values)).items():
        spec = pod_spec(deployment)
        assert (spec["runtimeClassName"], spec["schedulerName"]) == ("nvidia", "volcano"), component
        assert spec["automountServiceAccountToken"] is True, component
        assert spec["containers"][1:] == [sidecar], component
        assert deployment["spec"]["progressDeadlineSeconds"] == 1200, component


def test_only_the_planner_mounts_a_service_account_token(chart):
    for component, deployment in containers_by_component(objects(chart, EVERYTHING_ON)).items():
        assert pod_spec(deployment)["automountServiceAccountToken"] is (component == "planner"), component


@pytest.mark.parametrize("typo", [{"decode": {"runtimeClass": "nvidia"}},
                                  {"decode": {"strategy": {"rollingupdate": {"maxSurge": 0}}}},
                                  {"decode": {"strategy": {"type": "BlueGreen"}}},
                                  {"router": {"progressDeadlineSeconds": 0}}])
def test_the_schema_still_refuses_typos_in_those_fields(chart, typo):
    with pytest.raises(helm.HelmValuesError):
        chart.render(with_required(typo), name=RELEASE, namespace=NAMESPACE)


# ---- DNS egress -------------------------------------------------------------------------------------------------

def _dns_rules(policy: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(where, ports) of each rule allowing UDP: a namespace's name or an ipBlock's CIDR."""
    found = []
    for rule in policy["spec"]["egress"]:
        udp = tuple(p["port"] for p in rule.get("ports", []) if p["protocol"] == "UDP")
        if not udp:
            continue
        for peer in rule["to"]:
            where = peer["ipBlock"]["cidr"] if "ipBlock" in peer else \
                peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            found.append((where, udp))
            assert {p["protocol"] for p in rule["ports"]} == {"UDP", "TCP"}
    return found


def test_dns_egress_reaches_kube_dns_nodelocal_dnscache_and_openshift_dns(chart):
    policies = [o for o in objects(chart, EVERYTHING_ON) if o["kind"] == "NetworkPolicy"]
    for policy in policies:
        if policy["metadata"]["name"].endswith("-redis"):
            continue  # Redis calls nothing, not even DNS
        assert _dns_rules(policy) == [("kube-system", (53,)), ("169.254.20.10/32", (53,)),
                                      ("openshift-dns", (5353,))], policy["metadata"]["name"]


def test_the_dns_destinations_are_a_list_the_operator_replaces(chart):
    dns = [{"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dns"}}}], "ports": [1053]}]
    for policy in (o for o in objects(chart, {"networkPolicy": {"dns": dns}}) if o["kind"] == "NetworkPolicy"):
        if not policy["metadata"]["name"].endswith("-redis"):
            assert _dns_rules(policy) == [("dns", (1053,))]


# ---- the Redis password -----------------------------------------------------------------------------------------

def test_the_redis_password_is_the_same_at_every_render(chart):
    """Argo CD and Flux render with `helm template`, where lookup sees no cluster: a generated password changed at
    every sync and restarted Redis with it."""
    for values in ({}, {"redis": {"auth": {"existingSecret": "", "password": "from-sealed-values"}}}):
        first, second = (chart.render(with_required(values), name=RELEASE, namespace=NAMESPACE) for _ in range(2))
        assert first == second


def test_redis_auth_without_a_secret_or_a_password_is_a_clear_error(chart):
    values = with_required({})
    del values["redis"]
    assert "redis.auth.existingSecret" in render_error(chart, values)
    external = {"redis": {"enabled": False, "externalUrl": "redis://r:6379/0"}}  # no bundled Redis: no password
    assert objects(chart, external)


# ---- threads ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("resources, threads", [
    ({"limits": {"cpu": "2"}}, 2),
    ({"limits": {"cpu": 6}}, 6),
    ({"limits": {"cpu": "1500m"}}, 1),  # whole cores: a second thread would be throttled half the time
    ({"limits": {"cpu": "250m"}}, 1),
    ({"limits": {"cpu": None}, "requests": {"cpu": "3"}}, 3),  # no limit (null drops the default's): the request
])
def test_threads_follow_the_cpu_limit(chart, resources, threads):
    values = {"decode": {"resources": resources}, "mixed": {"enabled": True, "resources": resources}}
    deployments = containers_by_component(objects(chart, values))
    for component in ("decode", "mixed"):
        assert parsed_config(deployments[component]).num_threads == threads, component
    assert parsed_config(deployments["prefill"]).num_threads == 2  # the default limits.cpu "2"


def test_threads_over_the_cpu_limit_are_refused_and_none_without_cpu_resources(chart):
    message = render_error(chart, with_required({"prefill": {"config": {"numThreads": 8}}}))
    assert "prefill.config.numThreads 8 exceeds the CPU limit" in message
    chosen = containers_by_component(objects(chart, {"prefill": {"config": {"numThreads": 1}}}))
    assert parsed_config(chosen["prefill"]).num_threads == 1
    no_cpu = {"decode": {"resources": {"limits": {"cpu": None}, "requests": {"cpu": None}}}}
    unbounded = containers_by_component(objects(chart, no_cpu))
    assert "--num-threads" not in pod_spec(unbounded["decode"])["containers"][0]["args"]


# ---- the planner ------------------------------------------------------------------------------------------------

def test_the_planner_must_be_told_where_prometheus_is(chart):
    """The old default, http://prometheus-operated:9090, resolved only when Prometheus ran in the release's
    namespace; an empty URL now fails the render, naming the value."""
    values = with_required({"planner": {"enabled": True, "config": {"prometheusUrl": ""}}})
    assert "planner.config.prometheusUrl is required" in render_error(chart, values)
    planner = containers_by_component(objects(chart, {"planner": {"enabled": True}}))["planner"]
    assert parsed_config(planner).prometheus_url == "http://prometheus-operated.monitoring.svc:9090"


# ---- GPUs ------------------------------------------------------------------------------------------------------

def test_a_cuda_device_and_a_gpu_limit_go_together(chart):
    no_gpu = with_required({"decode": {"config": {"device": "cuda"}}})
    assert "decode.config.device is cuda but decode.resources.limits has no nvidia.com/gpu" in \
        render_error(chart, no_gpu)
    idle = with_required({"prefill": {"resources": {"limits": {"cpu": "2", "nvidia.com/gpu": 1}}}})
    assert "prefill.resources.limits asks for nvidia.com/gpu but prefill.config.device is cpu" in \
        render_error(chart, idle)
    assert objects(chart, case_values("gpu"))  # both together: fine


# ---- scratch space on a read-only root -------------------------------------------------------------------------

def test_writable_places_are_sized_volumes_and_serving_pods_cache_their_kernels(chart):
    """A pod compiles the native kernels for its node's CPU into ~/.cache/splitserve (HOME=/tmp): on a volume of its
    own with a size limit, not in an unbounded /tmp."""
    values = {"mixed": {"enabled": True}, "scratch": {"kernelCacheSizeLimit": "128Mi"}}
    for component, deployment in containers_by_component(objects(chart, values)).items():
        spec = pod_spec(deployment)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        if component == "planner":
            continue
        assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "1Gi"} and mounts["tmp"] == "/tmp", component
        if component in SERVING:
            assert volumes["kernel-cache"]["emptyDir"] == {"sizeLimit": "128Mi"}, component
            assert mounts["kernel-cache"] == "/tmp/.cache/splitserve", component
        else:
            assert "kernel-cache" not in volumes  # the router runs no kernels


def test_serving_pods_get_the_kernel_target_asked_for(chart):
    """baseline (the image's prebuilt libraries, the default) or native (compiled for the node's CPU at start):
    engine/kernels/build.py reads SPLITSERVE_KERNEL_TARGET; the router and the planner run no kernels."""
    for target in ("baseline", "native"):
        values = {**EVERYTHING_ON, "kernels": {"target": target}} if target == "native" else EVERYTHING_ON
        for component, deployment in containers_by_component(objects(chart, values)).items():
            env = {v["name"]: v.get("value") for v in pod_spec(deployment)["containers"][0].get("env", [])}
            assert env.get("SPLITSERVE_KERNEL_TARGET") == (target if component in SERVING else None), component
    assert "/kernels/target" in render_error(chart, with_required({"kernels": {"target": "znver4"}}))


# ---- same-host KV through the node's shared memory (issue 37) ------------------------------------------------

KV_SHM = "/run/splitserve/kv-shm"


def kv_shm_dirs(chart, values: dict) -> dict[str, tuple[str | None, str | None, dict | None]]:
    """Serving component -> (its --kv-shm-dir, where it mounts kv-shm, the kv-shm volume)."""
    found = {}
    for component, deployment in containers_by_component(objects(chart, values)).items():
        if component in SERVING:
            spec = pod_spec(deployment)
            args = spec["containers"][0]["args"]
            flag = args[args.index("--kv-shm-dir") + 1] if "--kv-shm-dir" in args else None
            mount = next((m["mountPath"] for m in spec["containers"][0]["volumeMounts"] if m["name"] == "kv-shm"), None)
            volume = next((v for v in spec["volumes"] if v["name"] == "kv-shm"), None)
            found[component] = (flag, mount, volume)
    return found


def test_shared_memory_kv_mounts_the_node_directory_at_one_path_only_when_enabled(chart):
    """Off (the default): no node directory, and decode pods offer none (a container's own /dev/shm is no other
    pod's: KV over gRPC). On: every serving pod mounts the node's directory at one path, the decode and mixed pods
    offer it to the prefill pods of their node, and the prefill pods find it there (same path, same device:inode)."""
    assert kv_shm_dirs(chart, EVERYTHING_ON) == {"prefill": (None, None, None), "decode": ("", None, None),
                                                 "mixed": ("", None, None)}
    values = {**EVERYTHING_ON, "kvTransfer": {"sharedMemory": {"enabled": True}}}
    volume = {"name": "kv-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}}
    assert kv_shm_dirs(chart, values) == {"prefill": (None, KV_SHM, volume), "decode": (KV_SHM, KV_SHM, volume),
                                          "mixed": (KV_SHM, KV_SHM, volume)}
    elsewhere = {**EVERYTHING_ON, "kvTransfer": {"sharedMemory": {"enabled": True, "hostPath": "/mnt/kv"}}}
    assert {v[2]["hostPath"]["path"] for v in kv_shm_dirs(chart, elsewhere).values()} == {"/mnt/kv"}


@pytest.mark.parametrize("values, key", [({"decode": {"config": {"kvShmDir": "/dev/shm"}}}, "kvShmDir"),
                                         ({"kvTransfer": {"sharedMemory": {"hostPath": "dev/shm"}}}, "hostPath")])
def test_the_shared_directory_is_the_charts_to_set(chart, values, key):
    """A decode pod's directory follows kvTransfer.sharedMemory (config may not name it), a node path is absolute."""
    assert key in render_error(chart, with_required(values))

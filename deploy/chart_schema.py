"""The Helm chart's ``values.schema.json``, generated: ``python -m splitserve.deploy.chart_schema`` rewrites it, and a
test checks that the committed file is current.

Two kinds of values (see ``values.yaml``):

- infrastructure (replicas, resources, scheduling, ports, probes, image, model source, TLS secret, Redis): they
  become Kubernetes fields, and the chart derives from them the flags it owns (``CHART_OWNED``: where a process
  listens and advertises itself, which model file, which registry, the TLS files);
- ``<component>.config``: every other field of the component's config dataclass, camelCase
  (``max_num_seqs`` -> ``maxNumSeqs``), passed as its flag (``--max-num-seqs``) by ``splitserve.configArgs`` in
  ``_helpers.tpl``. Their schema (type, range, allowed names, description, default) is read off the dataclass here,
  so a field added to a service appears in the chart by running this module.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import typing
from pathlib import Path

import yaml

from splitserve.decode_service.config import DecodeConfig
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.engine.config import CACHE_DTYPES, COMPUTE_DTYPES, MOE_DISPATCHES, QUANTIZATIONS, SPECULATIVE_METHODS
from splitserve.engine.kernels.build import KERNEL_TARGETS
from splitserve.engine.kernels.cpu_features import PREFILL_COMPUTE_DTYPES
from splitserve.kvtransfer.codecs import available_codecs
from splitserve.kvtransfer.receiver import KV_LOAD_FAILURE_POLICIES
from splitserve.prefill_service.config import KV_TRANSPORTS, PrefillConfig
from splitserve.router.config import RouterConfig
from splitserve.runtime.kv_codecs import AUTO

CHART = Path(__file__).parent / "helm" / "splitserve"
SCHEMA_PATH = CHART / "values.schema.json"

# component values block -> the dataclass its `config` block maps to
COMPONENTS = {"router": RouterConfig, "prefill": PrefillConfig, "decode": DecodeConfig, "mixed": DecodeConfig,
              "planner": PlannerConfig}

# Fields the chart sets itself from infrastructure values; a `config` block may not name them. `cpus` is left to
# Kubernetes: the kubelet places a container on CPUs (its CPU manager, from the resources), so host CPU ids do not
# belong in values; nor does core lending (`lend_cpus` and its activity files: pods of one machine sharing host CPUs and
# a directory, which `splitserve up` arranges and Kubernetes pods do not); `tensor_parallel_size` and
# `pipeline_parallel_size` are the pod's `tensorParallelSize` and `pipelineParallelSize`, which also scale its
# resources. The TTFT and TPOT targets come from `serviceLevel`, one value for the router, the decode pods' TPOT-slack
# chunking (hybrid scheduling) and the planner. A decode pod's `kv_shm_dir` is the node directory of
# `kvTransfer.sharedMemory` or none (a container's own /dev/shm is no other pod's).
_TLS_OWNED = {"tls_cert_file", "tls_key_file", "tls_ca_file", "tls_require_client_cert", "tls_server_name"}
_POD_OWNED = {"host", "port", "metrics_port", "probe_port", "advertise_address", "model", "registry", "redis_url",
              "role", "cpus", "lend_cpus", "lender_activity_files", "activity_file", "tensor_parallel_size",
              "pipeline_parallel_size", *_TLS_OWNED}
CHART_OWNED = {
    "router": {"host", "grpc_port", "http_port", "metrics_port", "probe_port", "model", "registry", "redis_url",
               "prefill_pods", "decode_pods", "mixed_pods", "api_keys", "cpus", "slo_ttft_s", "slo_tpot_s",
               *_TLS_OWNED},
    "prefill": _POD_OWNED,
    "decode": _POD_OWNED | {"tpot_slack_chunking", "tpot_target_s", "kv_shm_dir"},
    "mixed": _POD_OWNED | {"kv_shm_dir"},
    "planner": {"host", "metrics_port", "namespace", "prefill_deployment", "decode_deployment", "kubeconfig",
                "ttft_target_s", "tpot_target_s", "prefill_tensor_parallel_size", "decode_tensor_parallel_size",
                "prefill_pipeline_parallel_size", "decode_pipeline_parallel_size"},
}

_CODECS = list(available_codecs())
CHOICES = {  # field -> allowed values of plain-string fields (enum fields list their members)
    "kv_codec": [*_CODECS, AUTO],
    "accepted_kv_codecs": _CODECS,
    "kv_load_failure_policy": list(KV_LOAD_FAILURE_POLICIES),
    "cache_dtype": list(CACHE_DTYPES),
    "dtype": list(COMPUTE_DTYPES),
    "speculative_method": list(SPECULATIVE_METHODS),
    "quantization": list(QUANTIZATIONS),
    "moe_dispatch": list(MOE_DISPATCHES),
    "kv_transport": list(KV_TRANSPORTS),
    "prefill_compute_dtype": list(PREFILL_COMPUTE_DTYPES),
}
RANGES = {  # field -> JSON-schema bounds beyond the defaults (numbers >= 0; durations "*_s" > 0)
    "seed": {"minimum": 0},
    "conditional_cached_fraction": {"minimum": 0},
    "target_utilization": {"exclusiveMinimum": 0, "maximum": 1},
    "kv_usage_high": {"exclusiveMinimum": 0, "maximum": 1},
    "simulate_min_attainment": {"exclusiveMinimum": 0, "maximum": 1},
    "simulate_requests": {"minimum": 1},
    "hysteresis": {"minimum": 0, "exclusiveMaximum": 1},
    "scale_up_cooldown_s": {"minimum": 0},
    "scale_down_cooldown_s": {"minimum": 0},
    "block_size": {"enum": [2 ** k for k in range(11)]},  # a power of two
    "max_queue_time_s": {"minimum": 0},  # 0: never refuse for queue time
    "inject_corrupt_chunks": {"minimum": 0, "maximum": 1},  # a probability
    "kv_min_agreement": {"minimum": 0, "maximum": 1},  # a share of tokens
    "max_num_batched_tokens": {"minimum": 1},
    "max_num_seqs": {"minimum": 1},
    "max_chunk_bytes": {"minimum": 1},
    "max_model_len": {"minimum": 1},
    "num_speculative_tokens": {"minimum": 1, "maximum": 16},
    "prompt_lookup_max": {"minimum": 1},
    "prompt_lookup_min": {"minimum": 1},
    # the router's request limits (router/config.py)
    "max_request_bytes": {"minimum": 1},
    "max_prompt_bytes": {"minimum": 1},
    "max_stop_string_bytes": {"minimum": 1},
    "max_logprobs": {"minimum": 0, "maximum": 20},
    "tokenizer_threads": {"minimum": 1},
}


def camel(field_name: str) -> str:
    head, *rest = field_name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def config_fields(component: str) -> list[dataclasses.Field]:
    """The fields a component's `config` block may set."""
    return [f for f in dataclasses.fields(COMPONENTS[component]) if f.name not in CHART_OWNED[component]]


def _field_schema(f: dataclasses.Field, hint) -> dict:
    base = typing.get_origin(hint) or hint
    item = None
    if base is list:
        (item,) = typing.get_args(hint)
    enum_type = base if isinstance(base, type) and issubclass(base, enum.Enum) else None
    kind = "string" if enum_type else {bool: "boolean", int: "integer", float: "number", str: "string",
                                       list: "array"}[base]
    schema: dict = {"type": kind, "description": f.metadata.get("help", "")}
    choices = [member.value for member in enum_type] if enum_type else CHOICES.get(f.name)
    if kind == "array":
        schema["items"] = {"type": "string", **({"enum": choices} if choices else {})}
    elif choices:
        schema["enum"] = choices + ([""] if f.default == "" else [])
    if kind in ("integer", "number"):
        schema.update(RANGES.get(f.name, {"exclusiveMinimum": 0} if f.name.endswith("_s") else {"minimum": 0}))
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    schema["default"] = default.value if isinstance(default, enum.Enum) else default
    return schema


def config_schema(component: str) -> dict:
    hints = typing.get_type_hints(COMPONENTS[component])
    return {"type": "object", "additionalProperties": False,
            "description": f"Flags of {COMPONENTS[component].__name__} (camelCase field names).",
            "properties": {camel(f.name): _field_schema(f, hints[f.name]) for f in config_fields(component)}}


# ---- infrastructure values ---------------------------------------------------------------------------------

def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    schema = {"type": "object", "additionalProperties": False, "properties": properties, **extra}
    if required:
        schema["required"] = required
    return schema


_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_PORTS = {"type": "array", "items": _PORT}
_PEERS = {"type": "array", "items": {"type": "object"}}  # NetworkPolicy peers (podSelector, namespaceSelector, ...)
_DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(ns|us|ms|s|m|h))+$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_BOOL, _STR = {"type": "boolean"}, {"type": "string"}
_QUANTITY = {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"}  # a Kubernetes size
_COUNT = {"type": "integer", "minimum": 0}
_LIST, _MAP = {"type": "array", "items": {"type": "object"}}, {"type": "object"}
_SCHEDULING = {"resources": _MAP, "nodeSelector": _STRING_MAP, "tolerations": _LIST, "affinity": _MAP,
               "podAnnotations": _STRING_MAP, "podLabels": _STRING_MAP, "topologySpreadConstraints": _LIST,
               "priorityClassName": _STR}
_EXTRAS = {"extraEnv": _LIST, "extraVolumes": _LIST, "extraVolumeMounts": _LIST, "extraContainers": _LIST}
_INT_OR_PERCENT = {"type": ["integer", "string"], "pattern": "^[0-9]+%$", "minimum": 0}
# Pod-spec and rollout fields (Kubernetes' own names); a misspelt key is still refused (additionalProperties).
_POD_SPEC = {"runtimeClassName": _STR, "schedulerName": _STR, "automountServiceAccountToken": _BOOL,
             "progressDeadlineSeconds": {"type": "integer", "minimum": 1},
             "strategy": {"type": "object", "additionalProperties": False, "properties": {
                 "type": {"enum": ["RollingUpdate", "Recreate"]},
                 "rollingUpdate": _obj({"maxSurge": _INT_OR_PERCENT, "maxUnavailable": _INT_OR_PERCENT})}}}
_SERVICE_MONITOR = _obj({"enabled": _BOOL, "interval": _STR, "scrapeTimeout": _STR, "labels": _STRING_MAP})
_PDB = _obj({"enabled": _BOOL, "minAvailable": {"type": ["integer", "string"]}})
_HPA = _obj({"enabled": _BOOL, "minReplicas": {"type": "integer", "minimum": 1}, "maxReplicas": {
    "type": "integer", "minimum": 1}, "targetCPUUtilizationPercentage": {"type": "integer", "minimum": 1,
                                                                          "maximum": 100}})
_PROBE = _obj({"periodSeconds": {"type": "integer", "minimum": 1}, "failureThreshold": {"type": "integer",
                                                                                        "minimum": 1},
               "timeoutSeconds": {"type": "integer", "minimum": 1}})
_PROBES = _obj({"startup": _PROBE, "readiness": _PROBE, "liveness": _PROBE})


def _component(name: str, extra: dict, replicas: dict = _COUNT) -> dict:
    properties = {"replicas": replicas, **_SCHEDULING, **_EXTRAS, **_POD_SPEC, "terminationGraceExtraSeconds": _COUNT,
                  **extra,
                  "config": config_schema(name)}
    return _obj(properties)


def _pod_component(name: str) -> dict:
    return _component(name, {
        "enabled": _BOOL, "ports": _obj({"grpc": _PORT, "metrics": _PORT, "probe": _PORT}), "probes": _PROBES,
        "shm": _obj({"enabled": _BOOL, "sizeLimit": _STR}), "tensorParallelSize": {"type": "integer", "minimum": 1},
        "pipelineParallelSize": {"type": "integer", "minimum": 1},
        "podDisruptionBudget": _PDB, "autoscaling": _HPA, "serviceMonitor": _SERVICE_MONITOR})


def values_schema() -> dict:
    image = _obj({"repository": _STR, "tag": _STR, "digest": {"type": "string", "pattern": "^(sha256:[0-9a-f]{64})?$"},
                  "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}})
    return {
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "splitserve Helm chart values (generated by python -m splitserve.deploy.chart_schema)",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "nameOverride": _STR, "fullnameOverride": _STR, "image": image,
            "imagePullSecrets": {"type": "array"}, "podSecurityContext": {"type": "object"},
            "securityContext": {"type": "object"},
            "model": _obj({
                "source": {"enum": ["image", "pvc", "hostPath"]}, "name": _STR, "path": _STR,
                "mountPath": {"type": "string", "pattern": "^/"},
                "pvc": _obj({"claimName": _STR, "subPath": _STR}),
                "hostPath": _obj({"path": _STR, "type": {"enum": ["", "Directory", "File"]}})}),
            "tls": _obj({"enabled": _BOOL, "secretName": _STR, "requireClientCert": _BOOL, "serverName": _STR,
                         "certManager": _obj({
                             "enabled": _BOOL, "issuerRef": _obj({"name": _STR, "kind": _STR, "group": _STR}),
                             "duration": _DURATION, "renewBefore": _DURATION,
                             "dnsNames": {"type": "array", "items": _STR}})}),
            "networkPolicy": _obj({
                "enabled": _BOOL, "clientsFrom": _PEERS, "metricsFrom": _PEERS,
                "dns": {"type": "array", "items": _obj({"to": _PEERS, "ports": _PORTS}, required=["to", "ports"])},
                "externalRedisPorts": _PORTS,
                "plannerEgressPorts": _PORTS}),
            "redis": _redis(image),
            "router": _component("router", {
                "service": _obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "grpcPort": _PORT,
                                 "httpPort": _PORT, "annotations": _STRING_MAP}),
                "apiKeysSecret": _obj({"name": _STR, "key": _STR}), "preStopSleepSeconds": _COUNT,
                "metricsPort": _PORT, "probePort": _PORT,
                "probes": _PROBES, "podDisruptionBudget": _PDB, "autoscaling": _HPA,
                "serviceMonitor": _SERVICE_MONITOR}),
            "prefill": _pod_component("prefill"),
            "decode": _pod_component("decode"),
            "mixed": _pod_component("mixed"),
            "planner": _component("planner", {"enabled": _BOOL, "metricsPort": _PORT,
                                               "serviceMonitor": _SERVICE_MONITOR},
                                  replicas={"type": "integer", "minimum": 0, "maximum": 1}),
            "metrics": _obj({"scrapeAnnotations": _BOOL}),
            "scratch": _obj({"tmpSizeLimit": _QUANTITY, "kernelCacheSizeLimit": _QUANTITY}),
            "kernels": _obj({"target": {"enum": list(KERNEL_TARGETS)}}),
            "kvTransfer": _obj({"sharedMemory": _obj({"enabled": _BOOL,
                                                      "hostPath": {"type": "string", "pattern": "^/"}})}),
            "grafanaDashboards": _obj({"enabled": _BOOL, "labels": _STRING_MAP, "annotations": _STRING_MAP}),
            "serviceLevel": _obj({"ttftSeconds": {"type": "number", "exclusiveMinimum": 0},
                                  "tpotSeconds": {"type": "number", "exclusiveMinimum": 0}}),
            "prometheusRule": _obj({
                "enabled": _BOOL, "labels": _STRING_MAP,
                "kvCacheUsageThreshold": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "for": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}),
        },
        # the planner and an HPA must not both scale a pool
        "allOf": [{"if": {"properties": {"planner": {"properties": {"enabled": {"const": True}}}}},
                   "then": {"properties": {pool: {"properties": {"autoscaling": {"properties": {
                       "enabled": {"const": False}}}}} for pool in ("prefill", "decode")}}}],
    }


def _redis(image: dict) -> dict:
    properties = {"enabled": _BOOL, "replicas": {"type": "integer", "minimum": 0, "maximum": 1}, **_SCHEDULING,
                  "terminationGraceExtraSeconds": _COUNT,
                  "image": image, "port": _PORT,
                  "auth": _obj({"enabled": _BOOL, "existingSecret": _STR, "password": _STR, "secretKey": _STR}),
                  "externalUrl": {"type": "string", "pattern": "^(rediss?://.*)?$"},
                  "externalUrlSecret": _obj({"name": _STR, "key": _STR})}
    return _obj(properties)


# ---- descriptions: every infrastructure key says what it is (config keys take their dataclass field's help) --

# What each key means (a key's name, or "parent.name" where the name alone is ambiguous): data, kept beside this file.
DESCRIPTIONS: dict[str, str] = yaml.safe_load((Path(__file__).parent / "chart_descriptions.yaml").read_text())


def _describe(schema: dict, parent: str = "") -> None:
    """Fill each property's description from DESCRIPTIONS ("parent.name" first); ``enabled`` says what it turns on."""
    for name, prop in schema.get("properties", {}).items():
        if name == "config":
            continue
        text = DESCRIPTIONS.get(f"{parent}.{name}") or DESCRIPTIONS.get(name)
        if name == "enabled":
            text = f"Turn on: {DESCRIPTIONS.get(parent, parent)}"
        schema["properties"][name] = prop = {"description": text, **prop} if text else dict(prop)
        _describe(prop, name)


def render() -> str:
    schema = values_schema()
    _describe(schema)
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str]) -> None:
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])

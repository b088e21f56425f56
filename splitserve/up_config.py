"""What ``splitserve up`` starts (``UpConfig``: pods per role, scheduling, CPUs, ports, registry, TLS; each field a
flag of ``splitserve up``, the pods' and the router's own fields passed on to them), checked before anything starts,
and the free ports a test's or a benchmark's cluster takes (``UpConfig.on_ports``, ``free_port_run``).
``splitserve/launcher.py`` runs it."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from splitserve.decode_service.config import DecodeConfig
from splitserve.engine.config import QUANTIZATIONS
from splitserve.engine.weights.model_files import check_architecture
from splitserve.prefill_service.config import PrefillConfig
from splitserve.router.config import PolicyName, RouterConfig, Scheduling
from splitserve.runtime.config import described, member, passed_to, passed_values
from splitserve.runtime.cpus import checked_cpu_set
from splitserve.runtime.discovery import RegistryKind
from splitserve.runtime.kv_codecs import check_kv_codec
from splitserve.runtime.pod_server import PodConfig
from splitserve.runtime.roles import POD_ROLES, Role
from splitserve.runtime.transport import TLSConfig

# Each pod role's config: the fields `up` checks for it and passes on as its flags.
POD_CONFIGS = {Role.PREFILL: PrefillConfig, Role.DECODE: DecodeConfig, Role.MIXED: DecodeConfig}


@dataclass
class UpConfig:
    """Run a router, prefill pods and decode pods on this machine, each as its own process."""

    model: str = passed_to(PodConfig, RouterConfig, name="model", help="Model every pod serves.")
    prefill: int = field(default=1, metadata=described("Number of prefill pods."))
    decode: int = field(default=1, metadata=described("Number of decode pods."))
    mixed: int = field(default=0, metadata=described("Number of mixed pods (both phases in one process)."))
    host: str = field(default="127.0.0.1", metadata=described("Address every process listens on."))
    grpc_port: int = field(default=RouterConfig.grpc_port, metadata=described(
        "Router gRPC port (Generation API)."))
    http_port: int = field(default=RouterConfig.http_port, metadata=described(
        "Router HTTP port (OpenAI API, /health, /metrics)."))
    base_pod_port: int = field(default=PodConfig.port, metadata=described(
        "Pods take consecutive gRPC ports from here."))
    base_metrics_port: int = field(default=PodConfig.metrics_port, metadata=described(
        "Pods take consecutive /metrics ports from here."))
    # The router's settings: defaults and help from RouterConfig, passed as its flags
    # (splitserve.runtime.config.passed_to).
    kv_codec: str = passed_to(RouterConfig, name="kv_codec", help=(
        "KV codec between prefill and decode pods (the router's: it names one in every prefill request)."))
    policy: PolicyName = passed_to(RouterConfig, name="policy")
    scheduling: Scheduling = field(default=RouterConfig.scheduling, metadata=described(
        "'hybrid' (each prompt on a prefill pod, lent to its decode pod in TPOT-bounded chunks, or split across both, "
        "by predicted latency), 'disaggregated' (the pure split) or 'colocated' (the prefill and decode pods become "
        "mixed pods)."))
    slo_ttft_s: float = passed_to(RouterConfig, name="slo_ttft_s")
    slo_tpot_s: float = passed_to(RouterConfig, name="slo_tpot_s")
    conditional_prefill_threshold: int = passed_to(RouterConfig, name="conditional_prefill_threshold")
    conditional_prefill_queue_s: float = passed_to(RouterConfig, name="conditional_prefill_queue_s")
    registry: RegistryKind = field(default=RegistryKind.STATIC, metadata=described(
        "'static' (the router gets the pod list) or 'redis' (a local redis-server; pods heartbeat into it)."))
    redis_port: int = field(default=6379, metadata=described("Port of the local redis-server (--registry redis)."))
    heartbeat_ttl_s: float = passed_to(PodConfig, name="heartbeat_ttl_s", help=(
        "Redis registry: expiry of each pod's key (the pods heartbeat three times per TTL)."))
    pod_ttl_s: float = passed_to(RouterConfig, name="pod_ttl_s")
    decode_pod_wait_s: float = passed_to(RouterConfig, name="decode_pod_wait_s")
    shadow_check_fraction: float = passed_to(RouterConfig, name="shadow_check_fraction")
    prometheus: bool = field(default=True, metadata=described("Start Prometheus scraping every process, if installed."))
    prometheus_port: int = field(default=9090, metadata=described("Prometheus web port."))
    # What each pod's engine gets (PodConfig's defaults and help, passed as its flags): the colocated baseline is
    # mixed pods with chunked prefill at a token budget, so these reach every pod.
    kv_cache_memory_bytes: int = passed_to(PodConfig, name="kv_cache_memory_bytes")
    cache_dtype: str = passed_to(PodConfig, name="cache_dtype")
    max_num_batched_tokens: int = passed_to(PodConfig, name="max_num_batched_tokens")
    max_num_seqs: int = passed_to(PodConfig, name="max_num_seqs")
    long_prefill_token_threshold: int = passed_to(PodConfig, name="long_prefill_token_threshold")
    shutdown_grace_s: float = passed_to(PodConfig, name="shutdown_grace_s", help=(
        "On stop, time each pod's in-flight calls get to finish (the launcher waits this + 10 s, then kills)."))
    # The weights' format per role (each becomes that role's pods' --quantization): the phase split lets prefill and
    # decode pods differ (docs/quantization.md).
    prefill_quantization: str = passed_to(PrefillConfig, name="quantization", scope=Role.PREFILL, help=(
        "Weight format of the prefill pods: auto (gguf for a GGUF file where the native kernels run, else none), "
        "none (float), gguf (the GGUF file's own blocks), int8, int4."))
    decode_quantization: str = passed_to(DecodeConfig, name="quantization", scope=Role.DECODE, help=(
        "Weight format of the decode pods (may differ from the prefill pods': the KV layout is what must match)."))
    mixed_quantization: str = passed_to(DecodeConfig, name="quantization", scope=Role.MIXED, help=(
        "Weight format of the mixed pods."))
    # Tensor parallelism per role (each becomes that role's pods' --tensor-parallel-size): the phases may differ, KV
    # moves between any degrees; a pod of N ranks takes N CPUs' worth of the plan (splitserve/cpu_plan.py).
    prefill_tensor_parallel_size: int = passed_to(PrefillConfig, name="tensor_parallel_size", scope=Role.PREFILL,
                                                  help="Ranks each prefill pod's model is split over.")
    decode_tensor_parallel_size: int = passed_to(DecodeConfig, name="tensor_parallel_size", scope=Role.DECODE,
                                                 help="Ranks each decode pod's model is split over.")
    mixed_tensor_parallel_size: int = passed_to(DecodeConfig, name="tensor_parallel_size", scope=Role.MIXED,
                                                help="Ranks each mixed pod's model is split over.")
    # Pipeline parallelism per role (--pipeline-parallel-size; engine/parallel/pipeline.py): layers split over
    # ranks, not together with tensor parallelism; a pod of N stages takes N CPUs' worth of the plan as well.
    prefill_pipeline_parallel_size: int = passed_to(PrefillConfig, name="pipeline_parallel_size", scope=Role.PREFILL,
                                                    help="Ranks each prefill pod's layers are split over.")
    decode_pipeline_parallel_size: int = passed_to(DecodeConfig, name="pipeline_parallel_size", scope=Role.DECODE,
                                                   help="Ranks each decode pod's layers are split over.")
    mixed_pipeline_parallel_size: int = passed_to(DecodeConfig, name="pipeline_parallel_size", scope=Role.MIXED,
                                                  help="Ranks each mixed pod's layers are split over.")
    int8_activations: bool = passed_to(PodConfig, name="int8_activations", help=(
        "Every pod's products over quantized weights take int8 activations (faster decode, not float32's bits; "
        "pods on --*-quantization none are unaffected)."))
    prefill_compute_dtype: str = passed_to(PodConfig, name="prefill_compute_dtype")
    # Speculative decoding on the decode and mixed pods (DecodeConfig's defaults and help, passed as its flags).
    speculative_method: str = passed_to(DecodeConfig, name="speculative_method")
    num_speculative_tokens: int = passed_to(DecodeConfig, name="num_speculative_tokens")
    prompt_lookup_max: int = passed_to(DecodeConfig, name="prompt_lookup_max")
    prompt_lookup_min: int = passed_to(DecodeConfig, name="prompt_lookup_min")
    speculative_model: str = passed_to(DecodeConfig, name="speculative_model")
    inject_corrupt_chunks: float = passed_to(PrefillConfig, name="inject_corrupt_chunks", help=(
        "Fault injection (reliability tests, bench soak): the share of KV chunks the prefill pods send corrupted."))
    # CPU sets (Linux CPU lists, e.g. '0-3,6'); empty: the launcher's plan (splitserve/cpu_plan.py).
    prefill_cpus: str = field(default="", metadata=described(
        "CPUs of the prefill pods (split among them when there are enough, else shared)."))
    decode_cpus: str = field(default="", metadata=described("CPUs of the decode pods (split or shared likewise)."))
    mixed_cpus: str = field(default="", metadata=described("CPUs of the mixed pods (split or shared likewise)."))
    router_cpus: str = field(default="", metadata=described("CPUs of the router (empty: any CPU)."))
    lend_decode_cpus: bool = field(default=False, metadata=described(
        "Core lending (runtime/core_lending.py): prefill pods' steps also run on the decode pods' CPUs while every "
        "decode pod is idle, or pauses within its requests' TPOT targets (--slo-tpot-s, or a request's own); needs "
        "pinned, disjoint prefill and decode CPUs."))
    pin_cpus: bool = field(default=True, metadata=described(
        "Pin each process to its planned CPUs (--no-pin-cpus: same thread counts, the OS places the threads)."))
    run_dir: str = field(default="", metadata=described("Where logs and generated configs go (empty: a new temp dir)."))
    ready_timeout_s: float = field(default=300.0, metadata=described("How long to wait for the pods to load."))
    # Security, passed to every process (docs/security.md): TLS on every gRPC link and HTTPS on the router.
    tls_cert_file: str = passed_to(PodConfig, RouterConfig, name="tls_cert_file", help=(
        "PEM certificate every process uses as server and client identity (must list the --host address)."))
    tls_key_file: str = passed_to(PodConfig, RouterConfig, name="tls_key_file")
    tls_ca_file: str = passed_to(PodConfig, RouterConfig, name="tls_ca_file", help=(
        "PEM CA certificates peers' certificates chain to."))
    tls_require_client_cert: bool = passed_to(PodConfig, RouterConfig, name="tls_require_client_cert", help=(
        "Mutual TLS: every server refuses clients without a certificate signed by tls_ca_file."))
    api_keys: list[str] = field(default_factory=list, repr=False, metadata=described(
        "API keys of the router's APIs (handed to the router in its environment, not on its command line)."))

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.mixed) < 0 or self.decode + self.mixed == 0:
            raise ValueError("need at least one decode or mixed pod, and no negative counts")
        self.policy = member(PolicyName, "policy", self.policy)
        self.scheduling = member(Scheduling, "scheduling", self.scheduling)
        self.registry = member(RegistryKind, "registry", self.registry)
        check_kv_codec("kv_codec", self.kv_codec)  # the router's, checked here before any process starts
        check_architecture(self.model)  # an unserved model type is one line here, not every pod's failed start
        for name in ("prefill_cpus", "decode_cpus", "mixed_cpus", "router_cpus"):
            checked_cpu_set(name, getattr(self, name))
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        for role in POD_ROLES:
            name = f"{role}_quantization"
            if getattr(self, name) not in QUANTIZATIONS:
                raise ValueError(f"{name} must be one of {', '.join(QUANTIZATIONS)}, got {getattr(self, name)!r}")
        # Each role's pod checks and its engine's (scheduler, speculation), so that a bad value fails here,
        # naming its field, not in every pod.
        for role, pod_config in POD_CONFIGS.items():
            pod_config(**passed_values(self, pod_config, scope=role)).engine_config()
        self.tls.check()

    def cpu_sets(self) -> dict[Role, frozenset[int]]:
        """The sets the operator named, by role (empty where the plan decides)."""
        return {role: checked_cpu_set(f"{role}_cpus", getattr(self, f"{role}_cpus")) for role in (*POD_ROLES,
                                                                                                  Role.ROUTER)}

    def ranks(self, role: Role) -> int:
        """The processes each pod of ``role`` runs: its tensor- or pipeline-parallel ranks (never both above 1)."""
        return getattr(self, f"{role}_tensor_parallel_size") * getattr(self, f"{role}_pipeline_parallel_size")

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig.of(self)

    @classmethod
    def on_ports(cls, base: int | None = None, **fields) -> "UpConfig":
        """A config whose every port is one consecutive run from ``base`` (None: a run free now), for clusters
        started beside others (tests, benchmarks): router gRPC and HTTP, Prometheus, redis-server, then each pod's
        gRPC port and each pod's /metrics port."""
        pods = sum(fields.get(role, getattr(cls, role)) for role in POD_ROLES)
        if base is None:
            base = free_port_run(4 + 2 * pods, fields.get("host", cls.host))
        return cls(grpc_port=base, http_port=base + 1, prometheus_port=base + 2, redis_port=base + 3,
                   base_pod_port=base + 4, base_metrics_port=base + 4 + pods, **fields)


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports on ``host`` that are free now, away from the defaults a developer's
    own cluster uses (6379, 8000, 9090, 9400+, 50051, 50060+)."""
    for base in range(20000 + time.time_ns() // 1000 % 20000, 49000, count + 7):
        if all(_port_free(host, port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no run of {count} free ports on {host}")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False

"""``RouterConfig``: everything the router process is told, filled by ``splitserve.runtime.config.parse_config`` from
flags (``--grpc-port``) and ``SPLITSERVE_*`` environment variables (``SPLITSERVE_GRPC_PORT``).

Checked in ``__post_init__``, so a bad value stops the process at start, naming the field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from splitserve.engine.config import DEFAULT_MODEL, KV_LEASE_S
from splitserve.engine.sampling.params import MAX_LOGPROBS
from splitserve.runtime.config import described, member
from splitserve.runtime.cpus import checked_cpu_set
from splitserve.runtime.discovery import DEFAULT_REDIS_URL, HEARTBEAT_TTL_S, RegistryKind
from splitserve.runtime.kv_codecs import check_kv_codec
from splitserve.runtime.service_level import DEFAULT_TPOT_S, DEFAULT_TTFT_S
from splitserve.runtime.transport import TLSConfig

# Long enough for a typical stream to finish; Kubernetes' default termination grace period is 30 s.
SHUTDOWN_GRACE_S = 30.0


class PolicyName(enum.StrEnum):
    """The routing policies (``policies.py`` holds one class for each)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    POWER_OF_TWO = "power_of_two"
    PREFIX_AWARE = "prefix_aware"


class Scheduling(enum.StrEnum):
    """How prompts and decodes share the pods (docs/architecture.md, "Hybrid scheduling")."""

    HYBRID = "hybrid"  # per request, from predicted latency: prefill pod, or lent to the decode pod in chunks
    DISAGGREGATED = "disaggregated"  # prefill pods prefill, but for the conditional_* rules
    COLOCATED = "colocated"  # mixed pods run both phases (splitserve up starts mixed pods instead of P and D)


@dataclass
class RouterConfig:
    """The splitserve router: client-facing gRPC and HTTP APIs in front of prefill and decode pods."""

    host: str = field(default="0.0.0.0", metadata=described("Address both APIs listen on."))
    grpc_port: int = field(default=50051, metadata=described("Port of the gRPC Generation API (0: any free port)."))
    http_port: int = field(default=8000, metadata=described("Port of the OpenAI-compatible HTTP API (0: no HTTP API)."))
    metrics_port: int = field(default=0, metadata=described(
        "Port of a plain-HTTP Prometheus /metrics, without TLS or API keys, for a scraper that cannot present a "
        "client certificate (0: none; /metrics is on the HTTP API either way)."))
    probe_port: int = field(default=0, metadata=described(
        "A plain-text port serving only grpc.health.v1 (kubelet's native gRPC probe, which speaks no TLS); 0: none."))
    shutdown_grace_s: float = field(default=SHUTDOWN_GRACE_S, metadata=described(
        "On SIGTERM, time in-flight requests (HTTP and gRPC, drained together) get to finish."))
    model: str = field(default=DEFAULT_MODEL, metadata=described("Served model; the router loads only its tokenizer."))
    max_model_len: int = field(default=8192, metadata=described(
        "Context length in tokens (prompt + output); must match the pods' model (SmolLM2-135M: 8192)."))
    prefill_pods: list[str] = field(default_factory=list, metadata=described(
        "Static registry: prefill pods, host:port."))
    decode_pods: list[str] = field(default_factory=list, metadata=described("Static registry: decode pods, host:port."))
    mixed_pods: list[str] = field(default_factory=list, metadata=described(
        "Static registry: mixed pods (both phases in one process), host:port."))
    registry: RegistryKind = field(default=RegistryKind.STATIC, metadata=described(
        "Where pods are found: 'static' (the *_pods lists) or 'redis' (pods register themselves)."))
    redis_url: str = field(default=DEFAULT_REDIS_URL, metadata=described("Redis registry: server URL."))
    pod_ttl_s: float = field(default=HEARTBEAT_TTL_S, metadata=described(
        "Redis registry: the pods' key TTL; after the Redis server restarted empty, the router keeps the pods it "
        "knew this long while their heartbeats write their keys again."))
    policy: PolicyName = field(default=PolicyName.LEAST_LOADED, metadata=described("Routing policy."))
    kv_codec: str = field(default="none", metadata=described(
        "KV codec prefill pods compress each request's KV with: none, bf16, fp8, int8, int4, kivi8, kivi4, kivi2, "
        "each optionally +zstd, or auto (each prefill pod picks per decode pod from the link's measured throughput, "
        "among the codecs its kv_min_agreement allows)."))
    conditional_prefill_threshold: int = field(default=32, metadata=described(
        "Prompts shorter than this many tokens prefill on their decode pod (0: never for length)."))
    conditional_cached_fraction: float = field(default=0.8, metadata=described(
        "Prompts with at least this fraction already cached on the decode pod prefill there (> 1: never)."))
    conditional_prefill_queue_s: float = field(default=0.0, metadata=described(
        "Load-aware conditional disaggregation: a prompt that would wait at least this many seconds behind every "
        "prefill pod's queue prefills on its decode pod instead, if that pod has no prompt queued (0: never)."))
    request_timeout_s: float = field(default=300.0, metadata=described(
        "Deadline of one request, arrival to last token."))
    max_retries: int = field(default=2, metadata=described(
        "Retries on other pods of a request that failed before its first token."))
    max_migrations: int = field(default=2, metadata=described(
        "Times a request whose decode pod went away mid-stream moves to another decode pod (0: it fails instead)."))
    decode_pod_wait_s: float = field(default=30.0, metadata=described(
        "How long a request waits for a decode pod when none serves (one restarting, a rollout), or, mid-stream, "
        "for one to move to when no other is left (its own pod back from a restart counts), before it fails with "
        "UNAVAILABLE (HTTP 503); within the request's deadline. 0: it fails at once."))
    max_pending_requests: int = field(default=512, metadata=described(
        "Requests waiting for their first token beyond which new ones get 429 / RESOURCE_EXHAUSTED (0: no limit)."))
    max_queue_time_s: float = field(default=30.0, metadata=described(
        "Refuse (429 / RESOURCE_EXHAUSTED, with Retry-After) a request whose prompt would wait longer than this "
        "before its prefill starts, by the least loaded pod's queued prompt tokens and measured prefill rate "
        "(0: never)."))
    scheduling: Scheduling = field(default=Scheduling.HYBRID, metadata=described(
        "'hybrid': each prompt prefills where its first token is predicted to come first, on a prefill pod, lent "
        "to its decode pod in TPOT-bounded chunks, or split across both (the decode pods need --tpot-slack-chunking; "
        "splitserve up and the chart set it); 'disaggregated' or 'colocated': by the conditional_* rules."))
    slo_ttft_s: float = field(default=DEFAULT_TTFT_S, metadata=described(
        "TTFT target: of splitserve_requests_within_slo_total (goodput), and of hybrid placement's predictions "
        "(a request may name its own: docs/api.md)."))
    slo_tpot_s: float = field(default=DEFAULT_TPOT_S, metadata=described(
        "TPOT target: of splitserve_requests_within_slo_total (goodput), and the one hybrid decode pods keep while "
        "they prefill lent prompts (a request may name its own: docs/api.md)."))
    shadow_check_fraction: float = field(default=0.0, metadata=described(
        "Share (0 to 1) of finished greedy or seeded requests served a second time, after their answer went out, "
        "through another path (prefilled on the decode pod if a prefill pod prefilled them, else through a prefill "
        "pod) and compared, tokens and logprobs: splitserve_router_shadow_checks_total{outcome}, the first differing "
        "position in splitserve_router_shadow_divergence_position. 0: off."))
    kv_lease_s: float = field(default=KV_LEASE_S, metadata=described(
        "How long a decode pod keeps pushed KV waiting for the router's Decode call."))
    cpus: str = field(default="", metadata=described(
        "CPU set the router runs on, e.g. '0-1' (empty: wherever the OS puts it)."))

    # ---- the API edge: request limits, authentication, CORS, TLS (docs/security.md, docs/api.md) -----------------
    max_request_bytes: int = field(default=4 << 20, metadata=described(
        "Largest HTTP request body and gRPC request message, in bytes (413 / RESOURCE_EXHAUSTED beyond)."))
    max_prompt_bytes: int = field(default=1 << 20, metadata=described(
        "Largest prompt in UTF-8 bytes (a chat: its rendered prompt), checked before tokenizing."))
    max_prompt_tokens: int = field(default=0, metadata=described(
        "Largest prompt in tokens (0: max_model_len - 1)."))
    max_tokens_limit: int = field(default=0, metadata=described(
        "Largest max_tokens a request may ask for; also caps a request that leaves it unset (0: max_model_len)."))
    max_stop_strings: int = field(default=16, metadata=described("Most stop strings per request."))
    max_stop_string_bytes: int = field(default=256, metadata=described("Longest stop string, in UTF-8 bytes."))
    max_stop_token_ids: int = field(default=64, metadata=described("Most stop token ids per request."))
    max_logprobs: int = field(default=MAX_LOGPROBS, metadata=described(
        f"Most top logprobs per token a request may ask for (at most {MAX_LOGPROBS})."))
    tokenizer_threads: int = field(default=2, metadata=described(
        "Threads that tokenize prompts, off the event loop (a long prompt never stalls other requests)."))
    api_keys: list[str] = field(default_factory=list, repr=False, metadata=described(
        "API keys clients must present (HTTP 'Authorization: Bearer KEY', gRPC metadata 'authorization: Bearer "
        "KEY'); empty: no authentication. Prefer the environment variable to the flag (ps shows flags)."))
    auth_exempt_paths: list[str] = field(default_factory=lambda: ["/health", "/metrics"], metadata=described(
        "HTTP paths served without an API key, with or without their leading '/' (empty: every path needs one). "
        "gRPC health and reflection are always open."))
    cors_allowed_origins: list[str] = field(default_factory=list, metadata=described(
        "Origins browsers may call the HTTP API from ('*': any); empty: no CORS headers."))
    tls_cert_file: str = field(default="", metadata=described(
        "PEM certificate of the router: its gRPC and HTTPS server identity and its client identity towards pods."))
    tls_key_file: str = field(default="", metadata=described("PEM private key of tls_cert_file."))
    tls_ca_file: str = field(default="", metadata=described(
        "PEM CA certificates that pods' (and, with tls_require_client_cert, clients') certificates must chain to."))
    tls_require_client_cert: bool = field(default=False, metadata=described(
        "Mutual TLS: the gRPC and HTTPS servers refuse clients without a certificate signed by tls_ca_file."))
    tls_server_name: str = field(default="", metadata=described(
        "The name pods' certificates must list, when they are dialled by IP (in Kubernetes: the pods' headless "
        "Service's DNS name); empty: the address's host."))

    def __post_init__(self) -> None:
        self.policy = member(PolicyName, "policy", self.policy)
        self.scheduling = member(Scheduling, "scheduling", self.scheduling)
        self.registry = member(RegistryKind, "registry", self.registry)
        check_kv_codec("kv_codec", self.kv_codec)
        checked_cpu_set("cpus", self.cpus)
        for name in ("grpc_port", "http_port", "metrics_port", "probe_port", "shutdown_grace_s",
                     "conditional_prefill_threshold",
                     "max_retries", "max_migrations", "decode_pod_wait_s",
                     "max_pending_requests", "max_queue_time_s", "conditional_prefill_queue_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_model_len", "pod_ttl_s", "request_timeout_s", "kv_lease_s", "slo_ttft_s", "slo_tpot_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.shadow_check_fraction <= 1:
            raise ValueError(f"shadow_check_fraction must be in [0, 1], got {self.shadow_check_fraction}")
        if self.conditional_cached_fraction < 0:
            raise ValueError(f"conditional_cached_fraction must be >= 0, got {self.conditional_cached_fraction}")
        self._check_edge()
        if self.registry is RegistryKind.STATIC and not (self.prefill_pods or self.decode_pods or self.mixed_pods):
            raise ValueError("the static registry needs pods: set decode_pods or mixed_pods (and prefill_pods)")

    def _check_edge(self) -> None:
        for name in ("max_request_bytes", "max_prompt_bytes", "max_stop_string_bytes", "tokenizer_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens_limit", "max_stop_strings", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_prompt_tokens >= self.max_model_len:
            raise ValueError(f"max_prompt_tokens must be < max_model_len ({self.max_model_len}), "
                             f"got {self.max_prompt_tokens}")
        if self.max_tokens_limit > self.max_model_len:
            raise ValueError(f"max_tokens_limit must be <= max_model_len ({self.max_model_len}), "
                             f"got {self.max_tokens_limit}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        for key in self.api_keys:  # never echo a key: the message goes to logs
            if not key or not key.isprintable() or " " in key or not key.isascii():
                raise ValueError("api_keys: every key must be non-empty printable ASCII without spaces")
        TLSConfig.of(self).check()

    @property
    def prompt_token_limit(self) -> int:
        """Most tokens a prompt may have (``max_prompt_tokens``, or all of the context but one)."""
        return self.max_prompt_tokens or self.max_model_len - 1

    @property
    def output_token_limit(self) -> int:
        """Most tokens a request may ask for (``max_tokens_limit``, or the whole context)."""
        return self.max_tokens_limit or self.max_model_len

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig.of(self)

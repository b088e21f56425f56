"""The Prometheus metrics every splitserve process exposes, each defined once.

- ``ServingMetrics``: the request-level series every process keeps (router, prefill, decode, mixed);
- ``PodMetrics``: plus the engine's (preemptions, tokens per step, the kernel path, a mixture of experts' tokens per
  expert) and the KV transfer's;
- ``RouterMetrics``: plus the router's (routing decisions, retries, rejections, its view of each pod, goodput).

Every registry also carries the process' CPU time, memory and open files (prometheus_client's process collector,
with ``role`` and ``model_name`` added), so that a dashboard shows CPU and memory per pod with the same filters.

Names follow vLLM's with the prefix ``splitserve_`` and vLLM's histogram buckets (TTFT's with four more between 1
and 5 s), so that vLLM dashboards translate directly. Every series carries ``role`` (router, prefill, decode,
mixed) and ``model_name``.
TTFT splits into queue + prefill + KV transfer (``request_queue_time``, ``request_prefill_time``,
``kv_transfer_time``), so a dashboard can say where the time went. The dashboards and alerts built on these
names live in ``deploy/``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.engine.sequence import FinishReason
from splitserve.engine.speculative.proposer import SpecDecodeCounts

# vLLM's TTFT buckets plus 1.5, 2.0, 3.0 and 4.0 s: a CPU pod's first tokens land between 1 and 5 s, where vLLM's
# 1.0/2.5/5.0 s put a median 13% off (docs/PERFORMANCE.md). A superset, so every vLLM `le` still exists.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# KV transfers are short (milliseconds on loopback), so they get TTFT's fine low end.
KV_TRANSFER_BUCKETS = TTFT_BUCKETS
SHADOW_POSITION_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # output token index
SHADOW_LOGPROB_DELTA_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.5, 1.0)  # nats (router/shadow.py)
# Tokens in one engine step (vLLM's vllm:iteration_tokens_total).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Prompt and output lengths of a request (vLLM's 1-2-5 buckets, up to a long context).
REQUEST_TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

LABELS = ("role", "model_name")


class ServingMetrics:
    """All series of one process, bound to its role and model. Each process owns a registry (tests start
    several roles in one process)."""

    def __init__(self, role: str, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.role, self.model_name = role, model_name
        hist = self._histogram
        self.time_to_first_token = hist("time_to_first_token_seconds",
                                        "Time from request arrival to its first output token.", TTFT_BUCKETS)
        self.inter_token_latency = hist("inter_token_latency_seconds",
                                        "Time between consecutive output tokens.", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = hist("request_time_per_output_token_seconds",
                                          "Per request: (e2e - ttft) / (output tokens - 1).", TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = hist("e2e_request_latency_seconds",
                                        "Time from request arrival to its last token.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = hist("request_queue_time_seconds",
                                       "Time a request waited before its prefill was first scheduled.",
                                       REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = hist("request_prefill_time_seconds",
                                         "Time from a request's first scheduling to its first token.",
                                         REQUEST_LATENCY_BUCKETS)
        self.kv_transfer_time = hist("kv_transfer_time_seconds",
                                     "Exposed KV-cache transfer time: from the end of prefill compute to the "
                                     "decode pod's acknowledgement.", KV_TRANSFER_BUCKETS)
        self.kv_transfer_bytes = Counter("splitserve_kv_transfer_bytes_total",
                                         "KV-cache bytes sent (prefill) or received (decode), on the wire.",
                                         LABELS + ("codec",), registry=self.registry)
        self.prompt_tokens = self._counter("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = self._counter("generation_tokens_total", "Output tokens generated.")
        self.prefix_cache_queries = self._counter("prefix_cache_queries_total",
                                                  "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = self._counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.request_success = Counter("splitserve_request_success_total", "Finished requests by finish reason.",
                                       LABELS + ("finished_reason",), registry=self.registry)
        for reason in FinishReason:  # exported at 0 from the start: a rate() sees the first finish as an increase
            self.request_success.labels(role, model_name, reason)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt length of each finished request, in "
                                          "tokens.", REQUEST_TOKENS_BUCKETS)
        self.request_generation_tokens = hist("request_generation_tokens", "Output length of each finished "
                                              "request, in tokens.", REQUEST_TOKENS_BUCKETS)
        self.num_requests_running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.registry.register(_LabelledProcessCollector(role, model_name))

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        metric = Histogram(f"splitserve_{name}", doc, LABELS, buckets=buckets, registry=self.registry)
        return metric.labels(self.role, self.model_name)

    def _counter(self, name: str, doc: str):
        return Counter(f"splitserve_{name}", doc, LABELS, registry=self.registry).labels(self.role, self.model_name)

    def _gauge(self, name: str, doc: str):
        return Gauge(f"splitserve_{name}", doc, LABELS, registry=self.registry).labels(self.role, self.model_name)

    def transfer_bytes(self, codec: str):
        return self.kv_transfer_bytes.labels(self.role, self.model_name, codec)

    def finished(self, reason: str) -> None:
        self.request_success.labels(self.role, self.model_name, reason).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition format and its content type, for a ``/metrics`` handler."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ExpertTokensCollector(Collector):
    """The engine's per-expert routing counts as a counter family, read when scraped: a layer-by-expert table
    (Qwen3-30B-A3B: 48 x 128) is cheaper to read once per scrape than to increment per step."""

    def __init__(self, role: str, model_name: str, tokens_routed: Callable[[], dict[int, list[int]]]):
        self.labels, self.tokens_routed = (role, model_name), tokens_routed

    def collect(self):
        family = CounterMetricFamily("splitserve_moe_expert_tokens", "Tokens routed to each expert of each "
                                     "mixture-of-experts layer (a token counts once for each of its top-k experts); "
                                     "the spread across a layer's experts is its load imbalance.",
                                     labels=(*LABELS, "layer", "expert"))
        for layer, counts in self.tokens_routed().items():
            for expert, count in enumerate(counts):
                family.add_metric((*self.labels, str(layer), str(expert)), count)
        yield family


class _LabelledProcessCollector(Collector):
    """The process collector's series (process_cpu_seconds_total, process_resident_memory_bytes, ...) with the
    process' ``role`` and ``model_name``."""

    def __init__(self, role: str, model_name: str):
        self.labels = {"role": role, "model_name": model_name}

    def collect(self):
        for family in PROCESS_COLLECTOR.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labelled.add_sample(sample.name, {**sample.labels, **self.labels}, sample.value)
            yield labelled


class PodMetrics(ServingMetrics):
    """A pod's series: the request-level ones, plus its engine's and its KV transfers'."""

    def __init__(self, role: str, model_name: str, registry: CollectorRegistry | None = None):
        super().__init__(role, model_name, registry)
        self.num_preemptions = self._counter("num_preemptions_total",
                                             "Requests preempted (KV freed, recomputed later) for lack of KV blocks.")
        self.lent_cpu_steps = self._counter("engine_lent_cpu_steps_total",
                                            "Engine steps that also ran on CPUs decode pods lent (prefill pods; "
                                            "core lending, runtime/core_lending.py).")
        self.lent_cpu_seconds = self._counter("engine_lent_cpu_seconds_total",
                                              "Time this decode pod paused so that a prefill pod's step could use "
                                              "its CPU (core lending).")
        self.iteration_tokens = self._histogram("iteration_tokens_total", "Tokens (prefill and decode) per engine "
                                                "step.", ITERATION_TOKENS_BUCKETS)
        self.kv_transfer_raw_bytes = Counter("splitserve_kv_transfer_raw_bytes_total",
                                             "KV-cache bytes sent, in the cache's dtype before compression "
                                             "(prefill); raw / splitserve_kv_transfer_bytes_total is the "
                                             "compression ratio.", LABELS + ("codec",), registry=self.registry)
        self.kv_transfers = Counter("splitserve_kv_transfers_total",
                                    "KV pushes acknowledged, by the way their bytes went: shm (a shared-memory arena, "
                                    "the decode pod on this host, kvtransfer/shm.py) or grpc (prefill pods).",
                                    LABELS + ("transport",), registry=self.registry)
        self.kv_transfer_failures = Counter("splitserve_kv_transfer_failures_total",
                                            "KV pushes that failed, by gRPC status code (prefill pods).",
                                            LABELS + ("code",), registry=self.registry)
        self.kv_loads = Counter("splitserve_kv_load_total",
                                "Pushed prompt KV a decode pod took in, by outcome: loaded (admitted from the push), "
                                "recomputed (the KV failed to load; the prompt prefilled here, kv_load_failure_policy "
                                "recompute, or always for a split prefill's prefix), failed (the KV failed to load and "
                                "the request failed: policy fail).",
                                LABELS + ("outcome",), registry=self.registry)
        self.kv_leases_expired = self._counter("kv_leases_expired_total", (
            "Pushed KV a decode pod released at its lease's expiry: no Decode call claimed it and the router never "
            "dropped it (a leak the lease caught)."))
        # Speculative decoding, as vLLM's spec_decode series (acceptance rate: accepted / draft tokens).
        self.spec_decode_num_drafts = self._counter("spec_decode_num_drafts_total",
                                                    "Draft proposals verified (a request's drafts in one step).")
        self.spec_decode_num_draft_tokens = self._counter("spec_decode_num_draft_tokens_total",
                                                          "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = self._counter("spec_decode_num_accepted_tokens_total",
                                                             "Draft tokens accepted.")
        self.spec_decode_accepted_per_position = Counter(
            "splitserve_spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by their position in the proposal (0: the first).", LABELS + ("position",),
            registry=self.registry)
        self.engine_info = Gauge("splitserve_engine_info", "The engine's compute path: kernels (native or pytorch), "
                                 "device, KV cache dtype, the weights' format (quantization), what prefill's products "
                                 "compute in (prefill_compute) and on (prefill_isa: amx, avx512_bf16, fma for "
                                 "bfloat16; avx512, avx2, pytorch for float32), and the CPU features that chose them; "
                                 "always 1.", LABELS + ("kernels", "device", "cache_dtype", "quantization",
                                                        "prefill_compute", "prefill_isa", "cpu_features"),
                                 registry=self.registry)
        self.weight_memory = Gauge("splitserve_weight_memory_bytes", "Memory the weights take, by form: model (the "
                                   "parameters decode computes from; a bf16 prefill pod keeps only their embeddings "
                                   "and norms) and bf16_prefill (the bf16 copies prefill computes from where it "
                                   "resolved to bfloat16; 0 elsewhere).",
                                   LABELS + ("form",), registry=self.registry)

    def count_expert_tokens(self, tokens_routed: Callable[[], dict[int, list[int]]]) -> None:
        """Export ``splitserve_moe_expert_tokens_total{layer, expert}``: the tokens routed to each expert of each
        mixture-of-experts layer, as ``tokens_routed()`` (engine/model/moe.py) counts them, read at each scrape."""
        self.registry.register(_ExpertTokensCollector(self.role, self.model_name, tokens_routed))

    def transfer_raw_bytes(self, codec: str):
        return self.kv_transfer_raw_bytes.labels(self.role, self.model_name, codec)

    def transfer_done(self, transport: str) -> None:
        self.kv_transfers.labels(self.role, self.model_name, transport).inc()

    def transfer_failed(self, code: str) -> None:
        self.kv_transfer_failures.labels(self.role, self.model_name, code).inc()

    def kv_loaded(self, outcome: str) -> None:
        self.kv_loads.labels(self.role, self.model_name, outcome).inc()

    def spec_decoded(self, counts: SpecDecodeCounts) -> None:
        if not counts.num_drafts:
            return
        self.spec_decode_num_drafts.inc(counts.num_drafts)
        self.spec_decode_num_draft_tokens.inc(counts.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(counts.num_accepted_tokens)
        for position, accepted in enumerate(counts.accepted_per_position):
            if accepted:
                self.spec_decode_accepted_per_position.labels(self.role, self.model_name, str(position)).inc(accepted)

    def set_engine_info(self, kernels: str, device: str, cache_dtype: str, quantization: str, prefill_compute: str,
                        prefill_isa: str, cpu_features: str, weight_bytes: dict[str, int]) -> None:
        """The engine's labels, and its weights' memory by form (``LLMEngine.weight_bytes``)."""
        self.engine_info.labels(self.role, self.model_name, kernels, device, cache_dtype, quantization,
                                prefill_compute, prefill_isa, cpu_features).set(1)
        for form, nbytes in weight_bytes.items():
            self.weight_memory.labels(self.role, self.model_name, form).set(nbytes)


# The router's per-pod series name the pod by ``pod_address`` (host:port, as it registered), not ``pod``: the
# Prometheus Operator (and any Kubernetes scrape config) sets ``pod`` on every series to the scraped pod's name,
# which would rename the router's to ``exported_pod`` and fold every pod's series into the router's.
POD_LABELS = LABELS + ("pod_address", "pod_role")


class RouterMetrics(ServingMetrics):
    """The router's series: the request-level ones as its clients see them, plus routing and its view of the pods."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        super().__init__("router", model_name, registry)
        counter = self._labelled_counter
        self.routing_decisions = counter("router_routing_decisions_total", "Requests placed, by how: "
                                         "'disaggregated' (prefill pod + decode pod), 'prefill_on_decode' or 'split' "
                                         "(a prefix on the prefill pod, the rest on the decode pod).",
                                         ("decision",))
        self.pod_requests = counter("router_pod_requests_total", "Requests sent to each pod.", POD_LABELS[2:])
        self.retries = counter("router_retries_total", "Requests retried on other pods before their first token, "
                               "by the gRPC code of the failure.", ("code",))
        self.rejected = counter("router_rejected_requests_total", "Requests refused before any output, by gRPC "
                                "code (RESOURCE_EXHAUSTED: shed under load; UNAVAILABLE: no pod; ...).", ("code",))
        self.decode_pod_waits = counter("router_decode_pod_waits_total", "Requests that waited for a decode pod "
                                        "(none serving, or none left to migrate to: decode_pod_wait_s), by outcome: "
                                        "found, or none (it failed).", ("outcome",))
        self.migrations = self._counter("router_migrations_total",
                                        "Requests moved to another decode pod after theirs failed mid-stream.")
        self.requests_within_slo = self._counter("requests_within_slo_total", "Finished requests that met both the "
                                                 "TTFT and the TPOT target (--slo-ttft-s, --slo-tpot-s): goodput.")
        self.shadow_checks = counter("router_shadow_checks_total", "Greedy or seeded answers served again through "
                                     "another path and compared (--shadow-check-fraction), by outcome: match, "
                                     "diverged (other tokens, or logprobs beyond router/shadow.py's tolerance), "
                                     "failed (the second run did not finish).", ("outcome",))
        self.shadow_divergence_position = self._histogram(
            "router_shadow_divergence_position", "Output position of the first token (or logprob) a shadow check found "
            "different.", SHADOW_POSITION_BUCKETS)
        self.shadow_logprob_delta = self._histogram(
            "router_shadow_logprob_delta", "Largest difference of a token's logprob (nats) between a shadow check's "
            "two runs, over the tokens both gave alike.", SHADOW_LOGPROB_DELTA_BUCKETS)
        gauge = self._pod_gauge
        self.pod_healthy = gauge("router_pod_healthy", "1 while the router routes to the pod (its health serves).")
        self.pod_running = gauge("router_pod_running_requests", "Requests running on the pod, as it last reported.")
        self.pod_waiting = gauge("router_pod_waiting_requests", "Requests waiting on the pod, as it last reported.")
        self.pod_kv_cache_usage = gauge("router_pod_kv_cache_usage_perc",
                                        "Fraction of the pod's KV blocks in use, as it last reported (0 to 1).")
        self.pod_queued_prefill_tokens = gauge("router_pod_queued_prefill_tokens",
                                               "Prompt tokens waiting to be prefilled on the pod, as it last reported.")

    def _labelled_counter(self, name: str, doc: str, labels: tuple[str, ...]) -> Counter:
        return Counter(f"splitserve_{name}", doc, LABELS + labels, registry=self.registry)

    def _pod_gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"splitserve_{name}", doc, POD_LABELS, registry=self.registry)

    def count(self, counter: Counter, *labels: str) -> None:
        counter.labels(self.role, self.model_name, *labels).inc()

    def forget_pod(self, address: str, role: str) -> None:
        """Drop the series of a pod that left the registry."""
        for gauge in (self.pod_healthy, self.pod_running, self.pod_waiting, self.pod_kv_cache_usage,
                      self.pod_queued_prefill_tokens):
            try:
                gauge.remove(self.role, self.model_name, address, role)
            except KeyError:
                pass

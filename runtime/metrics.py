"""The Prometheus metrics every splitserve process exposes: one definition, shared by router, prefill, decode
and mixed pods.

Names follow vLLM's with the prefix ``splitserve_`` and vLLM's histogram buckets, so that vLLM dashboards
translate directly. Every series carries ``role`` (router, prefill, decode, mixed) and ``model_name``.
TTFT splits into queue + prefill + KV transfer (``request_queue_time``, ``request_prefill_time``,
``kv_transfer_time``), so a dashboard can say where the time went.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# KV transfers are short (milliseconds on loopback), so they get TTFT's fine low end.
KV_TRANSFER_BUCKETS = TTFT_BUCKETS

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
        self.num_requests_running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")

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

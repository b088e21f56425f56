"""What one run of ``splitserve bench serve`` is: its config (``ServeBenchConfig``, the library's way in) and what it
measured (``ServeRun``). ``driver.py`` makes runs; ``plots.py`` draws them; ``bench/compare/`` gives every
topology the same config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from splitserve.measure.serve_metrics import SLO, RequestRecord
from splitserve.measure.workload import WorkloadConfig
from splitserve.runtime.config import described


@dataclass
class ServeBenchConfig:
    """One run of ``bench serve`` (the library's way in; the command line fills it from flags)."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    backend: str = field(default="http", metadata=described(
        "http: OpenAI /v1/completions, streamed (SSE); grpc: Generation/Generate, token_ids."))
    base_url: str = field(default="http://127.0.0.1:8000", metadata=described(
        "The router's HTTP API; also where /v1/models and /metrics are read."))
    grpc_address: str = field(default="127.0.0.1:50051", metadata=described(
        "The router's gRPC API (--backend grpc)."))
    model: str | None = field(default=None, metadata=described(
        "Model name to send (default: what /v1/models reports)."))
    tokenizer: str | None = field(default=None, metadata=described(
        "The tokenizer's model name or path (default: the model's)."))
    max_concurrency: int | None = field(default=None, metadata=described("At most this many requests in flight."))
    prompt_format: str = field(default="ids", metadata=described(
        "ids: token-id prompts of exact length; text: decoded text fitted to the length."))
    shared_prefix: int = field(default=0, metadata=described("Tokens every prompt starts with (prefix caching)."))
    temperature: float = field(default=0.0, metadata=described("Sampling temperature of every request."))
    slo: SLO = field(default_factory=SLO)
    request_timeout_s: float = field(default=600.0, metadata=described("Seconds before a request fails."))
    time_limit_s: float | None = field(default=None, metadata=described(
        "Seconds after which the run stops; requests still out are reported unfinished."))
    warmup: int = field(default=1, metadata=described("Requests sent (and not counted) before the run."))
    router_metrics: bool = field(default=True, metadata=described(
        "Scrape the router's /metrics before and after the run."))
    progress: bool = field(default=True, metadata=described("A progress bar on stderr."))

    def __post_init__(self) -> None:
        if self.backend not in ("http", "grpc"):
            raise ValueError(f"backend must be http or grpc, got {self.backend!r}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt_format must be ids or text, got {self.prompt_format!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.shared_prefix < 0 or self.warmup < 0:
            raise ValueError("shared_prefix and warmup must be >= 0")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")

    def endpoint(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1/completions" if self.backend == "http" else \
            f"grpc://{self.grpc_address} splitserve.v1.Generation/Generate"


@dataclass
class ServeRun:
    """What one run measured: every request's record, the figures, and the router's medians beside the client's."""

    config: ServeBenchConfig
    model: str
    records: list[RequestRecord]
    summary: dict
    router: dict | None  # None: /metrics not scraped
    max_in_flight: int

    def to_json(self, detailed: bool = False) -> dict:
        out = {"config": _config_json(self.config), "workload": self.config.workload.describe(), "model": self.model,
               "endpoint": self.config.endpoint(), "summary": self.summary, "router": self.router,
               "max_in_flight": self.max_in_flight}
        if detailed:
            out["requests"] = [dataclasses.asdict(r) | {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}
                               for r in self.records]
        return out


def _config_json(config: ServeBenchConfig) -> dict:
    out = dataclasses.asdict(config)
    out["workload"]["request_rate"] = _finite_or_none(config.workload.request_rate)
    return out


def _finite_or_none(value: float) -> float | None:
    return None if math.isinf(value) else value

"""What one run of ``splitserve bench serve`` is: its config (``ServeBenchConfig``, the library's way in) and what it
measured (``ServeRun``). ``serve.py`` makes runs; ``serve_plots.py`` draws them; ``compare.py`` gives every
topology the same config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from bench.serve_metrics import SLO, RequestRecord
from bench.workload import WorkloadConfig


@dataclass
class ServeBenchConfig:
    """One run of ``bench serve`` (the library's way in; the command line fills it from flags)."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    backend: str = "http"  # http | grpc
    base_url: str = "http://127.0.0.1:8000"  # the router's HTTP API: /v1/completions, /v1/models, /metrics
    grpc_address: str = "127.0.0.1:50051"  # the router's gRPC API (backend grpc)
    model: str | None = None  # None: the one the router serves (GET /v1/models)
    tokenizer: str | None = None  # None: the model's (a name engine.model_files knows, a directory, a .gguf)
    max_concurrency: int | None = None
    prompt_format: str = "ids"  # ids (exact lengths) | text
    shared_prefix: int = 0
    temperature: float = 0.0
    slo: SLO = field(default_factory=SLO)
    request_timeout_s: float = 600.0
    time_limit_s: float | None = None
    warmup: int = 1
    router_metrics: bool = True
    progress: bool = True

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

"""What ``splitserve bench serve`` sends and when: a list of ``RequestSpec`` (send time, prompt and output length).

Lengths come from one of:
  random              fixed ``input_len`` / ``output_len``, optionally spread uniformly by ``range_ratio`` (vLLM's
                      random dataset);
  azure-conv          synthetic lengths shaped like the Azure LLM inference trace 2023 (Patel et al., Splitwise,
  azure-code          ISCA 2024): quantile fits to the published median / p90 / p99 of prompt and output tokens
                      (``LengthDistribution``);
  a CSV path          a trace in the Azure format (``TIMESTAMP,ContextTokens,GeneratedTokens``, plain or gzipped),
                      replayed: the Azure traces themselves ship with the package (``AZURE_CONV``, ``AZURE_CODE``,
                      measure/traces/README.md has their source and licence).

Send times come from an arrival process at ``request_rate`` requests/s: Poisson (exponential gaps), or gamma gaps
with shape ``burstiness`` (mean gap 1/rate, coefficient of variation 1/sqrt(burstiness): below 1 burstier than
Poisson, above 1 smoother), as vLLM's ``--burstiness``; an infinite rate sends everything at once. A trace keeps
its own timestamps, multiplied by ``time_scale`` (10: ten times slower), unless a request rate is given.
``max_prompt_tokens`` / ``max_output_tokens`` cap every length (small machines replay big traces scaled down).

Everything is drawn from generators seeded by ``seed``: the same config gives the same workload, and the same
lengths and unit-rate gaps at every rate of a sweep (the gaps are divided by the rate).
"""

from __future__ import annotations

import csv
import gzip
import math
import random
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from statistics import NormalDist

from splitserve.runtime.config import described

SYNTHETIC = ("random", "azure-conv", "azure-code")
# The Azure traces themselves, package data (CC BY 4.0: measure/traces/README.md).
AZURE_CONV = Path(__file__).with_name("traces") / "AzureLLMInferenceTrace_conv.csv.gz"
AZURE_CODE = AZURE_CONV.with_name("AzureLLMInferenceTrace_code.csv.gz")


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float  # send time, seconds after the run starts
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class WorkloadConfig:
    """What to send and when (the module docstring); its fields are ``bench serve``'s workload flags."""

    workload: str = field(default="random", metadata=described(
        f"{', '.join(SYNTHETIC)}, or a CSV trace in the Azure format (TIMESTAMP,ContextTokens,GeneratedTokens) to "
        "replay."))
    num_prompts: int = field(default=100, metadata=described("Requests in the run (a trace: its first N rows)."))
    request_rate: float = field(default=math.inf, metadata=described(
        "Requests/s (inf: all at once; a trace keeps its own timestamps unless set)."))
    burstiness: float = field(default=1.0, metadata=described(
        "Gamma shape of the gaps: 1 Poisson, < 1 burstier, > 1 smoother (CV 1/sqrt(b))."))
    input_len: int = field(default=128, metadata=described("random: prompt tokens."))
    output_len: int = field(default=32, metadata=described("random: output tokens."))
    range_ratio: float = field(default=0.0, metadata=described(
        "random: lengths uniform in [len*(1-r), len*(1+r)]."))
    time_scale: float = field(default=1.0, metadata=described(
        "trace: multiply its inter-arrival times (10: ten times slower)."))
    max_prompt_tokens: int | None = field(default=None, metadata=described("Cap every prompt length."))
    max_output_tokens: int | None = field(default=None, metadata=described("Cap every output length."))
    seed: int = field(default=0, metadata=described("Seeds the lengths and the arrival times."))

    def __post_init__(self) -> None:
        if self.workload not in SYNTHETIC and not Path(self.workload).is_file():
            raise ValueError(f"workload must be one of {', '.join(SYNTHETIC)} or a trace CSV file, "
                             f"got {self.workload!r}")
        if self.num_prompts <= 0:
            raise ValueError(f"num_prompts must be > 0, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        for name in ("input_len", "output_len", "max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def is_trace(self) -> bool:
        return self.workload not in SYNTHETIC

    def describe(self) -> str:
        return f"{self.describe_requests()}; {self.describe_arrivals()}; seed {self.seed}"

    def describe_requests(self) -> str:
        if self.workload == "random":
            spread = f" +-{self.range_ratio:.0%}" if self.range_ratio else ""
            lengths = f"random (prompt {self.input_len}{spread}, output {self.output_len}{spread} tokens)"
        elif self.is_trace:
            lengths = f"trace {Path(self.workload).name}"
        else:
            lengths = f"{self.workload} (synthetic lengths fitted to the Azure 2023 trace's quantiles)"
        caps = [f"{name} <= {cap}" for name, cap in (("prompt", self.max_prompt_tokens),
                                                       ("output", self.max_output_tokens)) if cap]
        return f"{lengths}{', ' + ', '.join(caps) if caps else ''}; {self.num_prompts} requests"

    def describe_arrivals(self) -> str:
        if self.is_trace and math.isinf(self.request_rate):
            return f"trace timestamps x {self.time_scale:g}"
        if math.isinf(self.request_rate):
            return "all at once"
        if self.burstiness == 1:
            return f"Poisson {self.request_rate:g} req/s"
        return f"gamma {self.request_rate:g} req/s, burstiness {self.burstiness:g}"


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    """The requests of ``config``, in send order."""
    rng = random.Random(f"{config.seed}-lengths")
    if config.is_trace:
        rows = read_trace(config.workload)[:config.num_prompts]
        lengths = [(r.prompt_tokens, r.output_tokens) for r in rows]
        trace_times = [(r.timestamp_s - rows[0].timestamp_s) * config.time_scale for r in rows]
    elif config.workload == "random":
        lengths = [(_spread(rng, config.input_len, config.range_ratio), _spread(rng, config.output_len,
                                                                                 config.range_ratio))
                   for _ in range(config.num_prompts)]
        trace_times = None
    else:
        prompt_dist, output_dist = AZURE_LENGTHS[config.workload]
        lengths = [(prompt_dist.sample(rng), output_dist.sample(rng)) for _ in range(config.num_prompts)]
        trace_times = None
    if trace_times is not None and math.isinf(config.request_rate):
        times = trace_times
    else:
        times = arrival_times(len(lengths), config.request_rate, config.burstiness, config.seed)
    cap = lambda n, limit: max(1, min(n, limit)) if limit else max(1, n)  # noqa: E731
    return [RequestSpec(i, t, cap(p, config.max_prompt_tokens), cap(o, config.max_output_tokens))
            for i, (t, (p, o)) in enumerate(zip(times, lengths))]


def _spread(rng: random.Random, length: int, ratio: float) -> int:
    if not ratio:
        return length
    return rng.randint(max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio)))


# ------------------------------------------------------------------------------------------- arrivals


def arrival_times(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of ``count`` requests: the first at 0, then gamma-distributed gaps of mean ``1 / rate`` and shape
    ``burstiness`` (1: exponential, a Poisson process). An infinite rate sends all at 0."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"{seed}-arrivals")
    # Unit-rate gaps (mean 1) scaled by 1 / rate: every rate of a sweep gets the same shape of schedule.
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / burstiness) / rate
    return times


# ------------------------------------------------------------------------------------ length distributions


_Z = NormalDist()


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths with a given median, p90 and p99: log-length is piecewise linear in the normal score, so the
    distribution is lognormal around the median (the median-p90 slope, mirrored below the median) and takes the
    p90-p99 slope beyond p90; the three quantiles come out exactly. A single lognormal fitted to median and p90
    overshoots these traces' p99 (conversation prompts: 6,100 instead of 4,142)."""

    median: float
    p90: float
    p99: float
    minimum: int = 1
    maximum: int | None = None

    def quantile(self, u: float) -> int:
        z = _Z.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
        z90, z99 = _Z.inv_cdf(0.9), _Z.inv_cdf(0.99)
        log_m, log_90, log_99 = math.log(self.median), math.log(self.p90), math.log(self.p99)
        if z <= z90:
            log_x = log_m + z * (log_90 - log_m) / z90
        else:
            log_x = log_90 + (z - z90) * (log_99 - log_90) / (z99 - z90)
        value = max(self.minimum, round(math.exp(log_x)))
        return min(value, self.maximum) if self.maximum else value

    def sample(self, rng: random.Random) -> int:
        return self.quantile(rng.random())


# The README of the Azure LLM inference trace 2023 (measure/traces/README.md): prompt and
# output tokens, median / p90 / p99; bounded by the largest values such traces hold (8k-context models; the
# conversation trace's outputs stop at 1,000).
AZURE_LENGTHS = {
    "azure-conv": (LengthDistribution(1020, 2734, 4142, minimum=2, maximum=14050),
                   LengthDistribution(129, 424, 601, minimum=1, maximum=1000)),
    "azure-code": (LengthDistribution(1469, 5186, 7436, minimum=3, maximum=7437),
                   LengthDistribution(13, 55, 249, minimum=1, maximum=1899)),
}


# ---------------------------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class TraceRow:
    timestamp_s: float
    prompt_tokens: int
    output_tokens: int


def read_trace(path: str | Path) -> list[TraceRow]:
    """An Azure-format trace (a ``.gz`` file: gzipped): a header ``TIMESTAMP,ContextTokens,GeneratedTokens``, then
    one row per request with an ISO date-time (``2023-11-16 18:17:03.9799600``) or a number of seconds. Rows are
    returned in time order."""
    rows = []
    with (gzip.open if Path(path).suffix == ".gz" else open)(path, "rt", newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: not an Azure LLM inference trace (no column {', '.join(sorted(missing))})")
        for line, row in enumerate(reader, start=2):
            try:
                rows.append(TraceRow(_seconds(row["TIMESTAMP"]), int(row["ContextTokens"]),
                                     int(row["GeneratedTokens"])))
            except (TypeError, ValueError) as error:
                raise ValueError(f"{path}, line {line}: {error}") from None
    if not rows:
        raise ValueError(f"{path}: the trace has no rows")
    return sorted(rows, key=lambda r: r.timestamp_s)


def _seconds(stamp: str) -> float:
    try:
        return float(stamp)
    except ValueError:
        # As UTC: only differences matter, and a local clock's DST change would bend them.
        return datetime.fromisoformat(stamp.strip()).replace(tzinfo=timezone.utc).timestamp()

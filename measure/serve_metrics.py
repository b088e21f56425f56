"""The arithmetic of ``splitserve bench serve``: from per-request timings to the figures it reports.

Definitions, as vLLM's ``benchmark_serving.py`` / ``vllm bench serve`` make them, all measured at the client:

  TTFT  arrival of the first chunk that carries output - the moment the request was sent
  TPOT  (E2E - TTFT) / (output tokens - 1), per request, for requests with more than one output token
  ITL   the gaps between successive output-bearing chunks of a request (after the first), all requests pooled
  E2E   arrival of the stream's last byte - the moment the request was sent

Goodput is the number of successful requests that meet every target given (TTFT, TPOT, E2E) divided by the
benchmark's duration; SLO attainment is that count over all requests of the workload (failed, unfinished and
never-sent requests miss their targets). Percentiles interpolate linearly between order statistics (numpy's
default).

The router's view of the same run comes from its Prometheus histograms: ``/metrics`` text scraped before and
after the run, the bucket counts subtracted, and quantiles estimated as PromQL's ``histogram_quantile`` does
(linear interpolation inside the bucket that holds the rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PERCENTILES = (50, 90, 99)


# ------------------------------------------------------------------------------------------ one request


@dataclass
class RequestRecord:
    """One request of a run, as the client saw it. Times are seconds since the run started."""

    index: int
    prompt_len: int  # tokens asked for
    output_len: int  # tokens asked for (max_tokens, with ignore_eos)
    scheduled_s: float  # when the workload wanted it sent
    status: str = "not_sent"  # not_sent | sent | ok | failed | unfinished
    sent_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of each output-bearing chunk
    end_s: float | None = None  # arrival of the stream's last byte
    prompt_tokens: int | None = None  # as the server counted them (usage)
    output_tokens: int | None = None
    error: str | None = None  # the kind: http_429, grpc_UNAVAILABLE, stream_error_internal, timeout, ReadError...
    error_message: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def e2e(self) -> float | None:
        return self.end_s - self.sent_s if self.end_s is not None else None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than two tokens (no decode to time)."""
        if self.status != "ok" or not self.output_tokens or self.output_tokens < 2 or not self.chunk_s:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def length_mismatch(self) -> bool:
        """A successful request that did not produce the output length it was forced to."""
        return self.status == "ok" and self.output_tokens != self.output_len


# ------------------------------------------------------------------------------------------ statistics


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``, interpolating linearly between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float] | None:
    """Count, mean and the reported percentiles of ``values`` (None when there are none)."""
    if not values:
        return None
    stats = {"count": len(values), "mean": sum(values) / len(values)}
    stats.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return stats


SLO_ATTAINMENT = 0.9  # DistServe's goodput: the share of requests that must meet every target


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; a target left None is not checked."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, items: list[str]) -> "SLO":
        """vLLM's spelling: ``["ttft:500", "tpot:100", "e2el:8000"]``, milliseconds."""
        names = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}
        targets = {}
        for item in items:
            name, colon, value = item.partition(":")
            if not colon or name not in names:
                raise ValueError(f"goodput target {item!r}: expected NAME:MS with NAME one of {', '.join(names)}")
            milliseconds = float(value)
            if milliseconds <= 0:
                raise ValueError(f"goodput target {item!r}: milliseconds must be > 0")
            targets[names[name]] = milliseconds / 1e3
        return cls(**targets)

    def __bool__(self) -> bool:
        return any(t is not None for t in (self.ttft, self.tpot, self.e2e))

    def describe(self) -> str:
        parts = [f"{name}<={t * 1e3:g}ms" for name, t in (("ttft", self.ttft), ("tpot", self.tpot), ("e2el", self.e2e))
                 if t is not None]
        return ", ".join(parts) or "none"

    def met_by(self, record: RequestRecord) -> bool:
        """Whether a request succeeded within every target. A one-token request has no TPOT, so it cannot miss
        a TPOT target (as vLLM counts it)."""
        if record.status != "ok":
            return False
        tpot = record.tpot
        return ((self.ttft is None or record.ttft <= self.ttft)
                and (self.tpot is None or tpot is None or tpot <= self.tpot)
                and (self.e2e is None or record.e2e <= self.e2e))

    def attained_by(self, records: list[RequestRecord]) -> float:
        """The share of ``records`` that met every target (failed and unfinished ones miss); 0 when there are none."""
        return sum(self.met_by(r) for r in records) / len(records) if records else 0.0


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict:
    """The run's figures: counts by outcome and failure kind, throughputs, goodput, latency distributions."""
    ok = [r for r in records if r.status == "ok"]
    failures: dict[str, int] = {}
    for r in records:
        if r.status == "failed":
            failures[r.error] = failures.get(r.error, 0) + 1
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    good = sum(slo.met_by(r) for r in ok) if slo else None
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "requests": len(records),
        "successful": len(ok),
        "failed": sum(failures.values()),
        "failures": dict(sorted(failures.items())),
        "unfinished": sum(r.status == "unfinished" for r in records),
        "not_sent": sum(r.status == "not_sent" for r in records),
        "length_mismatches": sum(r.length_mismatch for r in records),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(prompt_tokens + output_tokens),
        "slo": {"ttft_s": slo.ttft, "tpot_s": slo.tpot, "e2e_s": slo.e2e},
        "good_requests": good,
        "goodput": per_s(good) if good is not None else None,
        "slo_attainment": good / len(records) if good is not None and records else None,
        "ttft": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl": distribution([gap for r in ok for gap in r.itl]),
        "e2e": distribution([r.e2e for r in ok]),
    }


# ------------------------------------------------------------------------------- the router's histograms


@dataclass
class Histogram:
    """One Prometheus histogram series: cumulative counts per upper bound ``le`` (the last is +Inf)."""

    buckets: list[tuple[float, float]]  # (le, cumulative count), ascending le
    count: float
    sum: float

    def minus(self, earlier: "Histogram") -> "Histogram":
        """The observations made since ``earlier`` (a scrape of the same series before)."""
        if [le for le, _ in earlier.buckets] != [le for le, _ in self.buckets]:
            raise ValueError("the two scrapes have different buckets")
        return Histogram([(le, c - c0) for (le, c), (_, c0) in zip(self.buckets, earlier.buckets)],
                         self.count - earlier.count, self.sum - earlier.sum)

    @classmethod
    def of(cls, values: list[float], bounds: list[float]) -> "Histogram":
        """``values`` observed into buckets with upper bounds ``bounds`` (+Inf appended when missing)."""
        bounds = sorted(bounds) + ([] if bounds and math.isinf(max(bounds)) else [math.inf])
        return cls([(le, sum(v <= le for v in values)) for le in bounds], len(values), sum(values))


def parse_histograms(text: str, names: list[str], labels: dict[str, str]) -> dict[str, Histogram]:
    """The histograms ``names`` (without the ``_bucket`` suffix) from Prometheus exposition ``text``, summed over
    the series whose labels include ``labels``. A name with no matching series is left out."""
    found: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in names or family.type != "histogram":
            continue
        buckets: dict[float, float] = {}
        count = total = 0.0
        matched = False
        for sample in family.samples:
            if not labels.items() <= sample.labels.items():
                continue
            matched = True
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
        if matched:
            found[family.name] = Histogram(sorted(buckets.items()), count, total)
    return found


def parse_counter(text: str, name: str, labels: dict[str, str]) -> float | None:
    """The sum of the samples ``name`` (as exposed: ``..._total``) whose labels include ``labels``; None when the
    exposition has none."""
    values = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == name and labels.items() <= sample.labels.items()]
    return sum(values) if values else None


def histogram_quantile(q: float, histogram: Histogram) -> float | None:
    """PromQL's ``histogram_quantile(q, ...)`` for one series: None without observations. The rank ``q * count``
    is found in the first bucket whose cumulative count reaches it, and placed linearly between that bucket's
    lower and upper bounds (the lowest bucket starts at 0); a rank in the +Inf bucket gives the highest finite
    bound."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    buckets = histogram.buckets
    if not buckets or not math.isinf(buckets[-1][0]) or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    index = next(i for i, (_, cumulative) in enumerate(buckets) if cumulative >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0] if len(buckets) > 1 else None
    upper, cumulative = buckets[index]
    lower, below = (0.0, 0.0) if index == 0 else buckets[index - 1]
    if index == 0 and upper <= 0:
        return upper
    in_bucket = cumulative - below
    return lower if in_bucket == 0 else lower + (upper - lower) * (rank - below) / in_bucket

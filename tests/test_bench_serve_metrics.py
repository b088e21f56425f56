"""The arithmetic of ``bench serve`` on hand-made timings: percentiles, TTFT / TPOT (first token excluded) / ITL /
E2E, goodput and SLO attainment, failures by kind, the sweep's pass/fail bracket, and the router side: Prometheus
histograms parsed from real exposition text, subtracted between scrapes, and their quantiles estimated as PromQL's
``histogram_quantile`` does (checked against values computed by hand).
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import Histogram as PromHistogram

from splitserve.bench.serve.driver import _bracket, compare_with_router
from splitserve.measure.serve_metrics import (
    SLO,
    Histogram,
    RequestRecord,
    histogram_quantile,
    parse_counter,
    parse_histograms,
    percentile,
    summarize,
)


def record(index=0, sent=0.0, chunks=(), end=None, output_tokens=None, status="ok", output_len=None, prompt_len=10,
           error=None) -> RequestRecord:
    return RequestRecord(index, prompt_len, output_len if output_len is not None else (output_tokens or 1), sent,
                         status=status, sent_s=sent, chunk_s=list(chunks), end_s=end, prompt_tokens=prompt_len,
                         output_tokens=output_tokens, error=error)


# ------------------------------------------------------------------------------------------ percentiles


def test_percentile_interpolates_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_matches_numpys_default_on_random_values():
    rng = random.Random(3)
    values = [rng.expovariate(1.0) for _ in range(1001)]
    for q in (1, 25, 50, 90, 99, 99.9):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


# ------------------------------------------------------------------------------------------ one request


def test_ttft_tpot_itl_e2e_of_one_request():
    # Sent at 1.0; chunks at 1.5 (the first token), 1.6, 1.8, 2.1; last byte at 2.2; five output tokens.
    r = record(sent=1.0, chunks=[1.5, 1.6, 1.8, 2.1], end=2.2, output_tokens=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.2)
    # TPOT excludes the first token: the 0.7 s after it over the 4 tokens that followed.
    assert r.tpot == pytest.approx(0.7 / 4)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_needs_two_tokens_and_success():
    assert record(sent=0.0, chunks=[0.3], end=0.4, output_tokens=1).tpot is None
    failed = record(sent=0.0, chunks=[0.3, 0.5], end=0.6, output_tokens=2, status="failed", error="timeout")
    assert failed.tpot is None and failed.ttft == pytest.approx(0.3)
    assert record(sent=0.0, chunks=[], end=0.1, output_tokens=0, status="failed").ttft is None


def test_length_mismatch_is_a_successful_request_with_the_wrong_output_length():
    assert record(sent=0, chunks=[1], end=2, output_tokens=7, output_len=8).length_mismatch
    assert not record(sent=0, chunks=[1], end=2, output_tokens=8, output_len=8).length_mismatch
    assert not record(sent=0, chunks=[1], end=2, output_tokens=3, output_len=8, status="failed").length_mismatch


# ------------------------------------------------------------------------------------------ goodput


def test_slo_parse_speaks_vllms_names_in_milliseconds():
    slo = SLO.parse(["ttft:500", "tpot:100", "e2el:8000"])
    assert (slo.ttft, slo.tpot, slo.e2e) == (0.5, 0.1, 8.0)
    assert slo.describe() == "ttft<=500ms, tpot<=100ms, e2el<=8000ms"
    assert not SLO.parse([]) and SLO.parse(["tpot:50"])
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_slo_counts_a_request_good_only_when_it_succeeded_within_every_target():
    slo = SLO(ttft=0.5, tpot=0.1)
    fast = record(sent=0.0, chunks=[0.4, 0.5], end=0.8, output_tokens=5)  # TPOT 0.1: on the target counts
    slow_first = record(sent=0.0, chunks=[0.6, 0.7], end=0.9, output_tokens=5)
    slow_decode = record(sent=0.0, chunks=[0.1, 0.5], end=1.0, output_tokens=5)  # TPOT 0.225
    one_token = record(sent=0.0, chunks=[0.2], end=0.2, output_tokens=1)  # no TPOT: cannot miss it
    failed = record(sent=0.0, chunks=[0.1], end=0.2, output_tokens=1, status="failed", error="http_503")
    assert [slo.met_by(r) for r in (fast, slow_first, slow_decode, one_token, failed)] == [
        True, False, False, True, False]
    assert SLO(e2e=0.85).met_by(fast) and not SLO(e2e=0.85).met_by(slow_first)


def test_summarize_counts_outcomes_throughputs_goodput_and_distributions():
    records = [
        record(0, sent=0.0, chunks=[0.2, 0.3, 0.4], end=0.5, output_tokens=4, prompt_len=100),  # TPOT 0.1: good
        record(1, sent=1.0, chunks=[1.9, 2.0], end=2.1, output_tokens=3, prompt_len=50),  # TTFT 0.9: misses
        record(2, sent=2.0, chunks=[2.1, 2.6], end=3.0, output_tokens=3, prompt_len=20),  # TPOT 0.45: misses
        record(3, sent=3.0, chunks=[3.1], end=3.1, output_tokens=1, prompt_len=30, output_len=2),  # good, mismatch
        record(4, sent=4.0, end=4.0, status="failed", error="http_429_resource_exhausted"),
        record(5, sent=4.5, end=5.0, status="failed", error="http_429_resource_exhausted"),
        record(6, sent=5.0, end=9.0, status="failed", error="timeout"),
        record(7, sent=6.0, chunks=[6.5], status="unfinished"),
        record(8, status="not_sent"),
    ]
    s = summarize(records, duration_s=10.0, slo=SLO(ttft=0.5, tpot=0.2))
    assert (s["requests"], s["successful"], s["failed"], s["unfinished"], s["not_sent"]) == (9, 4, 3, 1, 1)
    assert s["failures"] == {"http_429_resource_exhausted": 2, "timeout": 1}
    assert s["length_mismatches"] == 1
    assert (s["prompt_tokens"], s["output_tokens"]) == (200, 11)
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(1.1)
    assert s["total_token_throughput"] == pytest.approx(21.1)
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(0.2)  # good requests over the duration
    assert s["slo_attainment"] == pytest.approx(2 / 9)  # over every request of the workload
    assert s["ttft"]["count"] == 4 and s["ttft"]["p50"] == pytest.approx(0.15)
    assert s["ttft"]["mean"] == pytest.approx((0.2 + 0.9 + 0.1 + 0.1) / 4)
    assert s["tpot"]["count"] == 3  # the one-token request has none; the others: 0.1, 0.1, 0.45
    assert s["tpot"]["p50"] == pytest.approx(0.1)
    assert s["tpot"]["p99"] == pytest.approx(0.1 + (0.45 - 0.1) * 0.98)
    assert s["itl"]["count"] == 2 + 1 + 1  # gaps of the successful requests, pooled
    assert s["itl"]["mean"] == pytest.approx((0.1 + 0.1 + 0.1 + 0.5) / 4)
    assert s["e2e"]["p50"] == pytest.approx((0.5 + 1.0) / 2)


def test_summarize_without_targets_reports_no_goodput():
    s = summarize([record(sent=0.0, chunks=[0.1], end=0.2, output_tokens=1)], 1.0, SLO())
    assert s["goodput"] is None and s["slo_attainment"] is None and s["tpot"] is None


def test_sweep_bracket_is_the_last_passing_rate_before_the_first_miss():
    def runs(attainments: dict[float, float]):
        return {rate: SimpleNamespace(summary={"slo_attainment": a}) for rate, a in attainments.items()}

    assert _bracket(runs({1: 1.0, 2: 0.95, 4: 0.7, 8: 0.2}), 0.9) == (2, 4)
    # A noisy pass above the first miss does not count: the knee is where attainment first drops.
    assert _bracket(runs({1: 1.0, 2: 0.8, 4: 0.92}), 0.9) == (1, 2)
    assert _bracket(runs({1: 0.5}), 0.9) == (None, 1)
    assert _bracket(runs({1: 0.9, 2: 0.95}), 0.9) == (2, None)


# ----------------------------------------------------------------------------------- router histograms


def hand_histogram() -> Histogram:
    # Buckets (0, 0.1], (0.1, 0.5], (0.5, 1], (1, +Inf] holding 2, 4, 3 and 1 observations.
    return Histogram([(0.1, 2), (0.5, 6), (1.0, 9), (math.inf, 10)], count=10, sum=5.0)


def test_histogram_quantile_interpolates_inside_the_bucket_holding_the_rank():
    h = hand_histogram()
    assert histogram_quantile(0.5, h) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)  # rank 5 in (0.1, 0.5]: 0.4
    assert histogram_quantile(0.1, h) == pytest.approx(0.1 * 1 / 2)  # the lowest bucket starts at 0
    assert histogram_quantile(0.9, h) == pytest.approx(1.0)  # rank 9: the top of (0.5, 1]
    assert histogram_quantile(0.95, h) == 1.0  # rank 9.5 in +Inf: the highest finite bound
    assert histogram_quantile(0.5, Histogram([(0.1, 0), (math.inf, 0)], 0, 0.0)) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, h)


def test_histogram_of_values_counts_cumulatively():
    h = Histogram.of([0.05, 0.1, 0.3, 0.7, 2.0], [0.1, 0.5, 1.0])
    assert h.buckets == [(0.1, 2), (0.5, 3), (1.0, 4), (math.inf, 5)]
    assert (h.count, h.sum) == (5, pytest.approx(3.15))


def test_parse_and_subtract_scrapes_keeps_only_the_run_and_the_role_asked_for():
    registry = CollectorRegistry()
    metric = PromHistogram("splitserve_time_to_first_token_seconds", "TTFT", ["role", "model_name"],
                           buckets=(0.01, 0.1, 1.0), registry=registry)
    router, pod = metric.labels("router", "m"), metric.labels("decode", "m")
    for v in (0.005, 0.5, 3.0):  # before the run
        router.observe(v)
    pod.observe(0.05)
    name = "splitserve_time_to_first_token_seconds"
    before = parse_histograms(generate_latest(registry).decode(), [name, "absent_seconds"], {"role": "router"})
    assert list(before) == [name]
    run_values = [0.02, 0.05, 0.06, 0.2, 0.09]
    for v in run_values:
        router.observe(v)
        pod.observe(v * 10)
    after = parse_histograms(generate_latest(registry).decode(), [name], {"role": "router"})
    run = after[name].minus(before[name])
    expected = Histogram.of(run_values, [0.01, 0.1, 1.0])
    assert run.buckets == expected.buckets and run.count == 5 and run.sum == pytest.approx(sum(run_values))
    # Rank 2.5 of 5 in (0.01, 0.1], which holds 4 of them: 0.01 + 0.09 * 2.5 / 4.
    assert histogram_quantile(0.5, run) == pytest.approx(0.01 + 0.09 * 2.5 / 4)


def test_compare_with_router_sets_the_client_median_beside_the_routers_estimate():
    records = [record(i, sent=0.0, chunks=[ttft, ttft + 0.05], end=ttft + 0.05, output_tokens=2)
               for i, ttft in enumerate([0.030, 0.035, 0.045, 0.070])]
    registry = CollectorRegistry()
    ttft = PromHistogram("splitserve_time_to_first_token_seconds", "TTFT", ["role", "model_name"],
                         buckets=(0.02, 0.04, 0.06, 0.08), registry=registry).labels("router", "m")
    within_slo = Counter("splitserve_requests_within_slo", "good", ["role", "model_name"],
                         registry=registry).labels("router", "m")
    ttft.observe(0.5)  # an earlier request
    within_slo.inc()
    before = generate_latest(registry).decode()
    for seconds in (0.031, 0.036, 0.044, 0.071):
        ttft.observe(seconds)
    within_slo.inc(3)
    router = compare_with_router(records, before, generate_latest(registry).decode())
    row = router["medians"]["ttft"]
    assert row["client_p50"] == pytest.approx(0.040)
    assert row["router_count"] == 4 and row["client_count"] == 4
    # Ranks 2 of 4: (0.02, 0.04] holds 2 (client: 0.030, 0.035; router: 0.031, 0.036), so both estimate 0.04.
    assert row["router_p50"] == pytest.approx(0.04) and row["client_p50_in_router_buckets"] == pytest.approx(0.04)
    assert row["router_over_client"] == pytest.approx(1.0)
    assert list(router["medians"]) == ["ttft"]  # the router exported no other histogram
    assert router["requests_within_slo"] == 3  # this run's, not the earlier one


def test_parse_counter_sums_the_matching_series_or_says_there_is_none():
    text = ('# TYPE splitserve_requests_within_slo_total counter\n'
            'splitserve_requests_within_slo_total{role="router",model_name="m"} 5.0\n'
            'splitserve_requests_within_slo_total{role="decode",model_name="m"} 7.0\n')
    assert parse_counter(text, "splitserve_requests_within_slo_total", {"role": "router"}) == 5.0
    assert parse_counter(text, "splitserve_requests_within_slo_total", {}) == 12.0
    assert parse_counter(text, "splitserve_requests_within_slo_total", {"role": "prefill"}) is None

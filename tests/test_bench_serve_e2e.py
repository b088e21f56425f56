"""``bench serve`` against a real ``splitserve up`` cluster (router, one prefill and one decode pod, each its own
process) serving the tiny random model: over HTTP and over gRPC, at a low rate for a few seconds. Every request must
succeed with exactly the prompt and output token counts asked for, and the client's counts must match the router's
own histograms over the run; a time limit leaves requests unfinished (or never sent), and refused requests are
counted by kind.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from splitserve.bench.serve import command as serve
from splitserve.bench.serve.driver import run_serve_benchmark, run_sweep
from splitserve.bench.serve.run import ServeBenchConfig
from splitserve.measure.serve_metrics import SLO
from splitserve.measure.workload import WorkloadConfig

pytestmark = pytest.mark.e2e

THRESHOLD = 32  # prompts of 24..72 tokens: some prefill on the decode pod, the others on the prefill pod
# The router's own TTFT and TPOT targets: the goodput the client asks for (--goodput ttft:5000 tpot:1000), which no
# tiny request misses, so that the router's count of requests within them is every request of a run.
SLO_TTFT_S, SLO_TPOT_S = 5.0, 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    cluster = start_cluster(tmp_path_factory.mktemp("bench-serve"), model="tiny-random", prefill=1, decode=1,
                            scheduling="disaggregated", conditional_prefill_threshold=THRESHOLD,
                            kv_cache_memory_bytes=64 << 20, prometheus=False, slo_ttft_s=SLO_TTFT_S,
                            slo_tpot_s=SLO_TPOT_S)
    yield cluster
    cluster.stop()


def base_url(cluster) -> str:
    return f"http://{cluster.config.host}:{cluster.config.http_port}"


def config(cluster, backend: str = "http", slo: SLO = SLO(), **workload) -> ServeBenchConfig:
    fields = dict(num_prompts=12, request_rate=4.0, input_len=48, output_len=12, range_ratio=0.5) | workload
    return ServeBenchConfig(workload=WorkloadConfig(**fields), backend=backend, base_url=base_url(cluster),
                            grpc_address=f"{cluster.config.host}:{cluster.config.grpc_port}", slo=slo,
                            progress=False)


def assert_exact_lengths(requests: list[dict]) -> None:
    for r in requests:
        assert r["status"] == "ok", r
        assert (r["prompt_tokens"], r["output_tokens"]) == (r["prompt_len"], r["output_len"]), r


def test_http_run_from_the_command_line(cluster, tmp_path, capsys):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    serve.main(["--base-url", base_url(cluster), "--request-rate", "4", "--num-prompts", "12", "--input-len", "48",
                "--output-len", "12", "--range-ratio", "0.5", "--goodput", "ttft:5000", "tpot:1000", "--no-progress",
                "--json", str(out), "--save-detailed", "--plot", str(png)])
    results = json.loads(out.read_text())
    s = results["summary"]
    assert (s["successful"], s["failed"], s["unfinished"], s["length_mismatches"]) == (12, 0, 0, 0)
    requests = results["requests"]
    assert_exact_lengths(requests)
    assert {r["prompt_len"] for r in requests} & set(range(THRESHOLD)) and max(r["prompt_len"] for r in requests) \
        >= THRESHOLD  # both the decode-pod and the prefill-pod paths ran
    assert s["output_tokens"] == sum(r["output_len"] for r in requests)
    assert s["good_requests"] == 12 and s["slo_attainment"] == 1.0  # targets no tiny request misses
    # The router saw exactly this run's requests in its histograms (the warm-up came before the first scrape).
    router = results["router"]["medians"]
    assert router["ttft"]["router_count"] == router["ttft"]["client_count"] == 12
    assert router["tpot"]["router_count"] == 12 and router["ttft"]["router_p50"] > 0
    assert results["router"]["requests_within_slo"] == 12  # this run's, by the router's own targets (the client's)
    printed = capsys.readouterr().out
    assert "medians, client vs the router's histograms" in printed
    assert "TTFT" in printed.split("medians, client vs the router's histograms")[1]
    assert png.stat().st_size > 0


def test_grpc_run_as_a_library_sees_every_decode_chunk_the_router_counts(cluster):
    run = run_serve_benchmark(config(cluster, "grpc"), log=lambda *_: None)
    s = run.summary
    assert (s["successful"], s["failed"], s["length_mismatches"]) == (12, 0, 0)
    assert_exact_lengths([r.__dict__ for r in run.records])
    # A gRPC chunk is one decode step's tokens, and the router observes an ITL per chunk: the counts are equal.
    router = run.router["medians"]
    assert router["itl"]["router_count"] == router["itl"]["client_count"] == s["itl"]["count"] > 0
    assert router["tpot"]["router_count"] == s["tpot"]["count"] == 12
    for figure in ("ttft", "tpot"):
        assert router[figure]["router_p50"] > 0 and router[figure]["client_p50"] > 0


def test_time_limit_reports_requests_unfinished_or_never_sent(cluster):
    # Three long requests at once, two slots: two are cut off mid-stream, the third never gets a slot.
    limited = dataclasses.replace(config(cluster, "grpc", num_prompts=3, request_rate=float("inf"), input_len=40,
                                         output_len=1900, range_ratio=0.0), max_concurrency=2, time_limit_s=0.3)
    s = run_serve_benchmark(limited, log=lambda *_: None).summary
    assert (s["successful"], s["failed"], s["unfinished"], s["not_sent"]) == (0, 0, 2, 1)
    assert s["duration_s"] == pytest.approx(0.3, abs=0.2)


@pytest.mark.parametrize("backend, kind", [("http", "http_400_invalid_argument"), ("grpc", "grpc_INVALID_ARGUMENT")])
def test_refused_requests_are_counted_by_kind(cluster, backend, kind):
    # Prompts longer than the tiny model's context (2048 tokens) are refused before any output.
    s = run_serve_benchmark(config(cluster, backend, num_prompts=3, input_len=3000, range_ratio=0.0),
                            log=lambda *_: None).summary
    assert (s["successful"], s["failed"], s["failures"]) == (0, 3, {kind: 3})


def test_sweep_runs_the_same_workload_at_each_rate(cluster, tmp_path):
    from splitserve.bench.serve.plots import plot_sweep

    sweep = run_sweep(config(cluster, num_prompts=6, slo=SLO(ttft=5.0, tpot=1.0)), [2.0, 8.0], log=lambda *_: None)
    assert sweep["rates"] == [2.0, 8.0] and sweep["max_rate_meeting_slo"] == 8.0
    assert sweep["first_rate_missing_slo"] is None
    low, high = sweep["runs"]
    assert [(r.prompt_len, r.output_len) for r in low.records] == [(r.prompt_len, r.output_len) for r in high.records]
    assert high.records[-1].scheduled_s == pytest.approx(low.records[-1].scheduled_s / 4)
    plot_sweep(sweep, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_a_sweep_told_to_stop_at_the_first_miss_runs_no_rate_above_it(cluster):
    impossible = SLO(ttft=1e-6, tpot=1.0)  # no first token comes within a microsecond
    sweep = run_sweep(config(cluster, num_prompts=3, slo=impossible), [2.0, 4.0, 8.0], log=lambda *_: None,
                      stop_at_miss=True)
    assert sweep["rates"] == [2.0] and len(sweep["runs"]) == 1
    assert (sweep["max_rate_meeting_slo"], sweep["first_rate_missing_slo"]) == (None, 2.0)

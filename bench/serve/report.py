"""What ``splitserve bench serve`` prints: a run's figures (``report``), the router's view beside the client's
(``report_router``), and a sweep's table (``report_sweep``; ``run_sweep`` prints its rows as they come)."""

from __future__ import annotations

from splitserve.bench.serve.run import ServeRun

AGREEMENT = 0.10  # client and router medians of TTFT and TPOT should agree within 10%


def report(run: ServeRun, log=print) -> None:
    s, config = run.summary, run.config
    rule = "=" * 78
    log(f"\n{rule}\n{'splitserve bench serve':^78}\n{rule}")
    rows = [
        ("Endpoint", config.endpoint()),
        ("Model", run.model),
        ("Workload", config.workload.describe()),
        ("Max concurrency", f"{config.max_concurrency or 'unlimited'} (reached {run.max_in_flight})"),
        ("Successful requests", s["successful"]),
        ("Failed requests", f"{s['failed']}" + (f"  {_kinds(s['failures'])}" if s["failures"] else "")),
    ]
    if s["unfinished"] or s["not_sent"]:
        rows.append(("Unfinished at time limit", f"{s['unfinished']} (never sent: {s['not_sent']})"))
    rows += [
        ("Output length mismatches", s["length_mismatches"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total prompt tokens", s["prompt_tokens"]),
        ("Total output tokens", s["output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}"),
    ]
    if s["goodput"] is not None:
        rows += [("Goodput targets", config.slo.describe()),
                 ("Goodput (req/s)", f"{s['goodput']:.2f}  ({s['good_requests']} of {s['requests']} requests, "
                                     f"SLO attainment {s['slo_attainment']:.1%})")]
    if s["send_lag"]:
        rows.append(("Send lag p50 / p99 (ms)", f"{s['send_lag']['p50'] * 1e3:.1f} / {s['send_lag']['p99'] * 1e3:.1f}"))
    for name, value in rows:
        log(f"{name + ':':<40}{value}")
    log(f"{'-' * 78}\n{'(ms)':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'count':>10}")
    for figure, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        d = s[figure]
        if d is None:
            log(f"{title:<8}{'-':>10}")
            continue
        percentiles = "".join(f"{d[k] * 1e3:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        log(f"{title:<8}{percentiles}{d['count']:>10}")
    if run.router is not None:
        report_router(run.router, log, s["good_requests"])
    if s["length_mismatches"]:
        log(f"WARNING: {s['length_mismatches']} successful requests did not produce the output length asked for")
    log(rule)


def report_router(router: dict, log=print, client_good: int | None = None) -> None:
    """The medians of ``compare_with_router`` side by side, and the router's own count of requests within its SLO."""
    log(f"{'-' * 78}\nmedians, client vs the router's histograms over this run (/metrics, role=router):")
    log(f"{'(ms)':<6}{'client':>9}{'router':>9}{'router/':>9}  {'client in':>10}{'router/':>9}  {'count':>15}")
    log(f"{'':<6}{'p50':>9}{'p50':>9}{'client':>9}  {'buckets':>10}{'that':>9}  {'client / router':>15}")
    fmt = lambda v, scale=1e3, spec=".1f": f"{v * scale:{spec}}" if v is not None else "-"  # noqa: E731
    coarse = []
    for figure, row in router["medians"].items():
        client, bucketed, ratio = row["client_p50"], row["client_p50_in_router_buckets"], row["router_over_client"]
        same_buckets = row["router_p50"] / bucketed if row["router_p50"] is not None and bucketed else None
        verdict = ""
        if figure in ("ttft", "tpot") and ratio is not None:
            verdict = "agree (within 10%)" if abs(ratio - 1) <= AGREEMENT else "DIFFER by more than 10%"
            if client and bucketed is not None and abs(bucketed / client - 1) > AGREEMENT:
                coarse.append(figure.upper())
        log(f"{figure.upper():<6}{fmt(client):>9}{fmt(row['router_p50']):>9}{fmt(ratio, 1, '.3f'):>9}  "
            f"{fmt(bucketed):>10}{fmt(same_buckets, 1, '.3f'):>9}  "
            f"{row['client_count']:>7} / {row['router_count']:<6.0f} {verdict}")
    log("(client in buckets: the client's own values put in the router's buckets and estimated as histogram_quantile "
        "does; router/that compares like with like. ITL: the router counts a gap per decode chunk, an HTTP client "
        "per chunk with text)")
    if coarse:
        log(f"NOTE: the router's buckets alone move the client's {' and '.join(coarse)} median by more than 10% here: "
            "at these latencies the histograms cannot show agreement within 10%")
    if router["requests_within_slo"] is not None:
        client = f"; the client counted {client_good} within --goodput" if client_good is not None else ""
        log(f"the router counted {router['requests_within_slo']:.0f} requests within its own targets "
            f"(splitserve_requests_within_slo_total, its --slo-ttft-s and --slo-tpot-s){client}")


def report_sweep(sweep: dict, log=print) -> None:
    log(f"\n{'=' * 78}\nsweep: SLO {sweep['slo']}, attainment target {sweep['attainment_target']:.0%}")
    log(SWEEP_HEADER)
    for run in sweep["runs"]:
        log(sweep_row_text(run.config.workload.request_rate, run.summary))
    best = sweep["max_rate_meeting_slo"]
    if best is None:
        log(f"no rate met the targets for {sweep['attainment_target']:.0%} of requests (the lowest tried: "
            f"{sweep['rates'][0]:g} req/s)")
    else:
        miss = sweep["first_rate_missing_slo"]
        log(f"highest rate meeting the targets for >= {sweep['attainment_target']:.0%} of requests: {best:g} req/s"
            + (f" (the next tried, {miss:g} req/s, did not)" if miss is not None else " (the highest tried)"))


SWEEP_HEADER = (f"{'rate':>8}{'req/s':>8}{'failed':>8}{'SLO met':>9}{'goodput':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
                 f"{'TPOT p50':>10}{'TPOT p99':>10}")


def sweep_row_text(rate: float, s: dict) -> str:
    ms = lambda d, k: f"{d[k] * 1e3:.0f}" if d else "-"  # noqa: E731
    return (f"{rate:>8g}{s['request_throughput']:>8.2f}{s['failed'] + s['unfinished']:>8}"
            f"{s['slo_attainment']:>9.1%}{s['goodput']:>9.2f}{ms(s['ttft'], 'p50'):>10}{ms(s['ttft'], 'p99'):>10}"
            f"{ms(s['tpot'], 'p50'):>10}{ms(s['tpot'], 'p99'):>10}")


def _kinds(failures: dict[str, int]) -> str:
    return ", ".join(f"{kind}: {count}" for kind, count in failures.items())

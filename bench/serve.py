"""``splitserve bench serve``: drive a running router with a seeded workload and measure it as a client sees it.

    splitserve bench serve --base-url http://127.0.0.1:8000 --request-rate 2 --num-prompts 200 \\
        --input-len 256 --output-len 64 --goodput ttft:1000 tpot:150 --json run.json --plot run.png

A run, top to bottom (``run_serve_benchmark(config)``, also the library entry point):
  1. the model's name from the router's ``GET /v1/models``, its tokenizer loaded here (``splitserve.engine.text.tokenizer_files``);
  2. the workload (``workload.py``): send times and exact prompt / output lengths, from the seed;
  3. every prompt (``prompts.py``) and request body (``serve_client.py``) built before the clock starts;
  4. warm-up requests (not counted), then the router's ``/metrics`` scraped;
  5. the requests sent on schedule from one asyncio loop, at most ``max_concurrency`` in flight; each request
     timed at the client (``RequestRecord``); a progress bar on stderr (done / total, failures, live p50 TTFT and
     TPOT); at ``time_limit_s`` the requests still out are cancelled and reported unfinished;
  6. ``/metrics`` scraped again: the router's TTFT / TPOT / ITL / E2E histograms over exactly this run (the
     difference of the two scrapes), their medians estimated as ``histogram_quantile`` does, printed beside the
     client's (``serve_metrics.py``);
  7. the figures: successful and failed requests (by kind), throughputs, goodput and SLO attainment against the
     ``--goodput`` targets, mean / p50 / p90 / p99 of TTFT, TPOT, ITL and E2E.

``--sweep 0.5,1,2,4`` runs the same seeded workload at each rate (``--sweep-refine K`` then bisects K times between
the last rate that met the targets and the first that did not) and reports the highest rate at which at least
``--slo-attainment`` (90%) of the requests met every target, before the first rate that missed: DistServe's goodput
of the deployment measured.

The load generator is light (one process, one asyncio loop, no tokenization while sending), but on a small machine
it still shares the cores with the servers: pin it away from them, e.g. ``taskset -c 1 python -m splitserve bench
serve ...`` with the pods on the other cores, and check the reported send lag (how late requests left against
their schedule).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field

import httpx

from splitserve.bench import FiguresOutput, save_results
from splitserve.bench.prompts import PromptFactory
from splitserve.bench.serve_client import GrpcGenerate, HttpCompletions
from splitserve.bench.serve_metrics import (
    SLO,
    SLO_ATTAINMENT,
    Histogram,
    RequestRecord,
    distribution,
    histogram_quantile,
    parse_counter,
    parse_histograms,
    percentile,
    summarize,
)
from splitserve.bench.serve_plots import plot_run, plot_sweep
from splitserve.bench.serve_run import ServeBenchConfig, ServeRun
from splitserve.bench.workload import RequestSpec, WorkloadConfig, build_workload
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.runtime.config import described, parse_config, passed_to, passed_values

# The router's request histograms (runtime/metrics.py, role="router"), by the client figure they match.
ROUTER_HISTOGRAMS = {
    "ttft": "splitserve_time_to_first_token_seconds",
    "tpot": "splitserve_request_time_per_output_token_seconds",
    "itl": "splitserve_inter_token_latency_seconds",
    "e2e": "splitserve_e2e_request_latency_seconds",
}
ROUTER_WITHIN_SLO = "splitserve_requests_within_slo_total"  # the router's own goodput count
AGREEMENT = 0.10  # client and router medians of TTFT and TPOT should agree within 10%
WARMUP_SPEC = dict(prompt_len=16, output_len=4)


# ------------------------------------------------------------------------------------------------- a run


def run_serve_benchmark(config: ServeBenchConfig, log=print, prep: Preparation | None = None) -> ServeRun:
    """One run against a router that is up; see the module docstring for its steps. ``prep``: the one of earlier
    runs against the same router, so that this run's prompts are new to its prefix caches."""
    return asyncio.run(_run(config, prep or Preparation.make(config), log))


@dataclass
class Preparation:
    """What does not change between the runs of a sweep: the model, its tokenizer's prompts (each run its own, of the
    same lengths: ``runs`` counts the runs started)."""

    model: str
    prompts: PromptFactory
    runs: int = 0

    @classmethod
    def make(cls, config: ServeBenchConfig) -> "Preparation":
        model = config.model or served_model(config.base_url)
        prompts = PromptFactory(load_tokenizer(config.tokenizer or model), config.workload.seed, config.shared_prefix)
        return cls(model, prompts)

    def prompt(self, config: ServeBenchConfig, spec: RequestSpec) -> list[int] | str:
        if config.prompt_format == "text":
            return self.prompts.text(spec, self.runs)
        return self.prompts.token_ids(spec, self.runs)


def served_model(base_url: str) -> str:
    """The model the router at ``base_url`` serves (its ``GET /v1/models``)."""
    try:
        reply = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=10.0)
        reply.raise_for_status()
        return reply.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise RuntimeError(f"cannot ask {base_url}/v1/models which model the router serves ({error}); "
                           "pass --model and --base-url") from error


async def _run(config: ServeBenchConfig, prep: Preparation, log) -> ServeRun:
    specs = build_workload(config.workload)
    client = _client(config, prep.model)
    prep.runs += 1
    try:
        payloads = [client.prepare(spec, prep.prompt(config, spec)) for spec in specs]
        log(f"benchmarking {config.endpoint()} ({prep.model}): {config.workload.describe()}")
        await _warm_up(config, prep, client)
        before = scrape_router(config.base_url) if config.router_metrics else None
        records = [RequestRecord(s.index, s.prompt_len, s.output_len, s.arrival_s) for s in specs]
        progress = _Progress(len(records), config.progress)
        try:
            duration, max_in_flight = await _drive(specs, payloads, records, client, config, progress.done)
        finally:
            progress.close()
        router = None
        if before is not None:
            router = compare_with_router(records, before, scrape_router(config.base_url))
    finally:
        await client.close()
    summary = summarize(records, duration, config.slo)
    summary["send_lag"] = distribution([r.sent_s - r.scheduled_s for r in records if r.sent_s is not None])
    return ServeRun(config, prep.model, records, summary, router, max_in_flight)


def _client(config: ServeBenchConfig, model: str) -> HttpCompletions | GrpcGenerate:
    if config.backend == "http":
        return HttpCompletions(config.base_url, model, config.temperature, config.request_timeout_s)
    return GrpcGenerate(config.grpc_address, model, config.temperature, config.request_timeout_s)


async def _warm_up(config: ServeBenchConfig, prep: Preparation, client) -> None:
    """Requests that open the connections and touch every code path once; a failure stops the benchmark here,
    since every request of the run would fail the same way."""
    start = time.perf_counter()
    for i in range(config.warmup):
        spec = RequestSpec(-1 - i, 0.0, **WARMUP_SPEC)  # negative indices: prompts no request of the run has
        record = RequestRecord(spec.index, spec.prompt_len, spec.output_len, 0.0)
        await client.send(record, client.prepare(spec, prep.prompt(config, spec)), lambda: time.perf_counter() - start)
        if record.status != "ok":
            raise RuntimeError(f"the warm-up request to {config.endpoint()} failed: {record.error} "
                               f"{record.error_message}")


async def _drive(specs: list[RequestSpec], payloads: list, records: list[RequestRecord], client,
                 config: ServeBenchConfig, on_done) -> tuple[float, int]:
    """Send every request at its time (and when a concurrency slot is free); returns the run's duration (the first
    send to the last byte, or the time limit) and the most requests that were in flight at once."""
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    in_flight = max_in_flight = 0
    tasks: list[asyncio.Task] = []

    async def one(i: int) -> None:
        nonlocal in_flight, max_in_flight
        if slots is not None:
            await slots.acquire()
        in_flight += 1
        max_in_flight = max(max_in_flight, in_flight)
        try:
            await client.send(records[i], payloads[i], clock)
        finally:
            in_flight -= 1
            if slots is not None:
                slots.release()
        on_done(records[i])

    async def dispatch() -> None:
        try:
            for i, spec in enumerate(specs):
                delay = spec.arrival_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        finally:  # the time limit cancelled us: cancel the requests still out, and let them record it
            pending = [task for task in tasks if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    try:
        await asyncio.wait_for(dispatch(), config.time_limit_s)
    except TimeoutError:
        pass
    return clock(), max_in_flight


class _Progress:
    """One line on stderr: requests done / total, failures, and the live p50 TTFT and TPOT."""

    def __init__(self, total: int, enabled: bool):
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.failed = 0
        self._next_postfix = 0.0
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="req", dynamic_ncols=True, mininterval=0.5)

    def done(self, record: RequestRecord) -> None:
        if record.status == "ok":
            if record.ttft is not None:
                self.ttfts.append(record.ttft)
            if record.tpot is not None:
                self.tpots.append(record.tpot)
        else:
            self.failed += 1
        if self.bar is None:
            return
        now = time.monotonic()
        if now >= self._next_postfix:  # medians of everything so far, at most twice a second
            self._next_postfix = now + 0.5
            self.bar.set_postfix_str(f"failed {self.failed}, p50 TTFT {_ms(self.ttfts)}, p50 TPOT {_ms(self.tpots)}",
                                     refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _ms(values: list[float]) -> str:
    return f"{percentile(values, 50) * 1e3:.0f} ms" if values else "-"


# ------------------------------------------------------------------------------------- the router's view


def scrape_router(base_url: str) -> str:
    """The router's ``/metrics`` exposition text."""
    reply = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=10.0)
    reply.raise_for_status()
    return reply.text


def compare_with_router(records: list[RequestRecord], before: str, after: str) -> dict:
    """The router's view of the run, from two scrapes of its ``/metrics`` (role="router") around it.

    ``medians``, per figure: the client's median, the client's values put in the router's buckets and estimated the
    same way (what bucketing alone does to a median), and the router's median over this run's observations.
    ``requests_within_slo``: the requests the router counted within its own targets (its ``--slo-ttft-s`` and
    ``--slo-tpot-s``), None when it does not export the counter."""
    labels = {"role": "router"}
    histograms = [parse_histograms(text, list(ROUTER_HISTOGRAMS.values()), labels) for text in (before, after)]
    ok = [r for r in records if r.status == "ok"]
    client_values = {"ttft": [r.ttft for r in ok if r.ttft is not None],
                     "tpot": [r.tpot for r in ok if r.tpot is not None],
                     "itl": [gap for r in ok for gap in r.itl],
                     "e2e": [r.e2e for r in ok]}
    medians = {}
    for figure, name in ROUTER_HISTOGRAMS.items():
        if name not in histograms[1]:
            continue
        run = histograms[1][name].minus(histograms[0][name]) if name in histograms[0] else histograms[1][name]
        values = client_values[figure]
        client = percentile(values, 50) if values else None
        bucketed = histogram_quantile(0.5, Histogram.of(values, [le for le, _ in run.buckets])) if values else None
        router = histogram_quantile(0.5, run)
        medians[figure] = {"client_p50": client, "client_p50_in_router_buckets": bucketed, "router_p50": router,
                           "router_count": run.count, "client_count": len(values),
                           "router_over_client": router / client if router is not None and client else None}
    within = [parse_counter(text, ROUTER_WITHIN_SLO, labels) for text in (before, after)]
    return {"medians": medians,
            "requests_within_slo": within[1] - (within[0] or 0.0) if within[1] is not None else None}


# ------------------------------------------------------------------------------------------------ sweeps


def run_sweep(config: ServeBenchConfig, rates: list[float], attainment: float = SLO_ATTAINMENT, refine: int = 0,
              log=print, stop_at_miss: bool = False, prep: Preparation | None = None) -> dict:
    """The same seeded workload at each rate (then ``refine`` bisections between the last rate that met the
    targets and the first that did not); the highest rate meeting ``attainment`` before the first that did not.
    ``stop_at_miss``: skip the rates above the first that missed (they cannot change the result; saves the time of
    runs past capacity)."""
    if not config.slo:
        raise ValueError("a sweep needs latency targets (--goodput ttft:MS tpot:MS)")
    prep = prep or Preparation.make(config)
    runs: dict[float, ServeRun] = {}

    def measure(rate: float) -> bool:
        run = asyncio.run(_run(dataclasses.replace(config, workload=dataclasses.replace(
            config.workload, request_rate=rate)), prep, log))
        runs[rate] = run
        log(_sweep_row_text(rate, run.summary))
        return run.summary["slo_attainment"] >= attainment

    log(_SWEEP_HEADER)
    for rate in sorted(rates):
        if not measure(rate) and stop_at_miss:
            break
    for _ in range(refine):
        passing, failing = _bracket(runs, attainment)
        if passing is None or failing is None:
            break
        measure(round((passing + failing) / 2, 4))
    best, first_miss = _bracket(runs, attainment)
    return {"rates": sorted(runs), "slo": config.slo.describe(), "attainment_target": attainment,
            "max_rate_meeting_slo": best, "first_rate_missing_slo": first_miss,
            "runs": [runs[rate] for rate in sorted(runs)]}


def _bracket(runs: dict[float, ServeRun], attainment: float) -> tuple[float | None, float | None]:
    """(the highest rate meeting the target below the first that misses it, that first miss)."""
    best = None
    for rate in sorted(runs):
        if runs[rate].summary["slo_attainment"] < attainment:
            return best, rate
        best = rate
    return best, None


# ----------------------------------------------------------------------------------------------- report


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
        log(f"{title:<8}" + "".join(f"{d[k] * 1e3:>10.1f}" for k in ("mean", "p50", "p90", "p99")) + f"{d['count']:>10}")
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
    log(_SWEEP_HEADER)
    for run in sweep["runs"]:
        log(_sweep_row_text(run.config.workload.request_rate, run.summary))
    best = sweep["max_rate_meeting_slo"]
    if best is None:
        log(f"no rate met the targets for {sweep['attainment_target']:.0%} of requests (the lowest tried: "
            f"{sweep['rates'][0]:g} req/s)")
    else:
        miss = sweep["first_rate_missing_slo"]
        log(f"highest rate meeting the targets for >= {sweep['attainment_target']:.0%} of requests: {best:g} req/s"
            + (f" (the next tried, {miss:g} req/s, did not)" if miss is not None else " (the highest tried)"))


_SWEEP_HEADER = (f"{'rate':>8}{'req/s':>8}{'failed':>8}{'SLO met':>9}{'goodput':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
                 f"{'TPOT p50':>10}{'TPOT p99':>10}")


def _sweep_row_text(rate: float, s: dict) -> str:
    ms = lambda d, k: f"{d[k] * 1e3:.0f}" if d else "-"  # noqa: E731
    return (f"{rate:>8g}{s['request_throughput']:>8.2f}{s['failed'] + s['unfinished']:>8}"
            f"{s['slo_attainment']:>9.1%}{s['goodput']:>9.2f}{ms(s['ttft'], 'p50'):>10}{ms(s['ttft'], 'p99'):>10}"
            f"{ms(s['tpot'], 'p50'):>10}{ms(s['tpot'], 'p99'):>10}")


def _kinds(failures: dict[str, int]) -> str:
    return ", ".join(f"{kind}: {count}" for kind, count in failures.items())


# ---------------------------------------------------------------------------------------------- command line


EXAMPLES = """examples:
  splitserve bench serve --request-rate 2 --num-prompts 100 --input-len 256 --output-len 64 \\
      --goodput ttft:1000 tpot:150 --json run.json --plot run.png
  splitserve bench serve --backend grpc --grpc-address 127.0.0.1:50051 --max-concurrency 8
  splitserve bench serve --workload ../shared/workloads/AzureLLMInferenceTrace_conv.csv \\
      --time-scale 20 --max-prompt-tokens 1024 --max-output-tokens 64 --num-prompts 200
  splitserve bench serve --workload azure-code --sweep 0.25,0.5,1,2 --sweep-refine 2 \\
      --goodput ttft:2000 tpot:200 --max-prompt-tokens 2048 --plot sweep.png
pin the generator away from the servers on a small machine: taskset -c 1 python -m splitserve ..."""


@dataclass
class ServeCommand(FiguresOutput):
    """Drive a running router (HTTP or gRPC) with a seeded workload; report throughput, goodput and TTFT / TPOT /
    ITL / E2E percentiles measured at the client, beside the router's own histograms.

    The command line of ``bench serve``: the run's fields and the workload's come with their defaults and help
    from ``ServeBenchConfig`` and ``WorkloadConfig`` (``splitserve.runtime.config.passed_to``); the rest say what to do with
    the runs."""

    backend: str = passed_to(ServeBenchConfig, name="backend")
    base_url: str = passed_to(ServeBenchConfig, name="base_url")
    grpc_address: str = passed_to(ServeBenchConfig, name="grpc_address")
    model: str | None = passed_to(ServeBenchConfig, name="model")
    tokenizer: str | None = passed_to(ServeBenchConfig, name="tokenizer")
    router_metrics: bool = passed_to(ServeBenchConfig, name="router_metrics")
    workload: str = passed_to(WorkloadConfig, name="workload")
    num_prompts: int = passed_to(WorkloadConfig, name="num_prompts")
    request_rate: float = passed_to(WorkloadConfig, name="request_rate")
    burstiness: float = passed_to(WorkloadConfig, name="burstiness")
    max_concurrency: int | None = passed_to(ServeBenchConfig, name="max_concurrency")
    input_len: int = passed_to(WorkloadConfig, name="input_len")
    output_len: int = passed_to(WorkloadConfig, name="output_len")
    range_ratio: float = passed_to(WorkloadConfig, name="range_ratio")
    time_scale: float = passed_to(WorkloadConfig, name="time_scale")
    max_prompt_tokens: int | None = passed_to(WorkloadConfig, name="max_prompt_tokens")
    max_output_tokens: int | None = passed_to(WorkloadConfig, name="max_output_tokens")
    shared_prefix: int = passed_to(ServeBenchConfig, name="shared_prefix")
    prompt_format: str = passed_to(ServeBenchConfig, name="prompt_format")
    temperature: float = passed_to(ServeBenchConfig, name="temperature")
    seed: int = passed_to(WorkloadConfig, name="seed")
    goodput: list[str] = field(default_factory=list, metadata=described(
        "Targets a request must all meet to count as good, NAME:MS: ttft:MS tpot:MS e2el:MS."))
    sweep: list[float] = field(default_factory=list, metadata=described(
        "Request rates to run in turn (needs --goodput); empty: one run at --request-rate."))
    sweep_refine: int = field(default=0, metadata=described(
        "After the sweep, K bisections between the last rate meeting the targets and the next."))
    slo_attainment: float = field(default=SLO_ATTAINMENT, metadata=described(
        "Share of requests that must meet the targets for a rate to pass a sweep."))
    request_timeout_s: float = passed_to(ServeBenchConfig, name="request_timeout_s")
    time_limit_s: float | None = passed_to(ServeBenchConfig, name="time_limit_s")
    warmup: int = passed_to(ServeBenchConfig, name="warmup")
    progress: bool = passed_to(ServeBenchConfig, name="progress")
    save_detailed: bool = field(default=False, metadata=described("Include every request's timings in the JSON."))

    def __post_init__(self) -> None:
        if any(not rate > 0 for rate in self.sweep):
            raise ValueError(f"sweep rates must be > 0, got {self.sweep}")
        self.bench_config()  # every field's own checks, naming it, before anything runs

    def bench_config(self) -> ServeBenchConfig:
        return ServeBenchConfig(workload=WorkloadConfig(**passed_values(self, WorkloadConfig)),
                                slo=SLO.parse(self.goodput), **passed_values(self, ServeBenchConfig))


def main(argv: list[str] | None = None) -> dict:
    command = parse_config(ServeCommand, argv, prog="splitserve bench serve", epilog=EXAMPLES)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    config = command.bench_config()
    try:
        if command.sweep:
            sweep = run_sweep(config, command.sweep, command.slo_attainment, command.sweep_refine)
        else:
            run = run_serve_benchmark(config)
    except (RuntimeError, ValueError) as error:  # the router is not there, or refuses even the warm-up
        sys.exit(f"splitserve bench serve: {error}")
    if command.sweep:
        report_sweep(sweep)
        results = {**sweep, "runs": [run.to_json(command.save_detailed) for run in sweep["runs"]]}
        draw = lambda _, path: plot_sweep(sweep, path)  # noqa: E731
    else:
        report(run)
        results = run.to_json(command.save_detailed)
        draw = lambda _, path: plot_run(run, path)  # noqa: E731
    save_results(results, command.json, command.plot, draw)
    return results

"""``splitserve bench serve``'s run: drive a running router with a seeded workload, measured as a client sees it.

    splitserve bench serve --base-url http://127.0.0.1:8000 --request-rate 2 --num-prompts 200 \\
        --input-len 256 --output-len 64 --goodput ttft:1000 tpot:150 --json run.json --plot run.png

A run, top to bottom (``run_serve_benchmark(config)``, also the library entry point):
  1. the model's name from the router's ``GET /v1/models``, its tokenizer loaded here
     (``splitserve.engine.text.tokenizer_files``);
  2. the workload (``splitserve.measure.workload``): send times and exact prompt / output lengths, from the seed;
  3. every prompt (``prompts.py``) and request body (``client.py``) built before the clock starts;
  4. warm-up requests (not counted), then the router's ``/metrics`` scraped;
  5. the requests sent on schedule from one asyncio loop, at most ``max_concurrency`` in flight; each request
     timed at the client (``RequestRecord``); a progress bar on stderr (done / total, failures, live p50 TTFT and
     TPOT); at ``time_limit_s`` the requests still out are cancelled and reported unfinished;
  6. ``/metrics`` scraped again: the router's TTFT / TPOT / ITL / E2E histograms over exactly this run (the
     difference of the two scrapes), their medians estimated as ``histogram_quantile`` does, printed beside the
     client's (``splitserve.measure.serve_metrics``);
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
import sys
import time
from dataclasses import dataclass

import httpx

from splitserve.bench.serve.client import GrpcGenerate, HttpCompletions
from splitserve.bench.serve.prompts import PromptFactory
from splitserve.bench.serve.report import SWEEP_HEADER, sweep_row_text
from splitserve.bench.serve.run import ServeBenchConfig, ServeRun
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.measure.serve_metrics import (
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
from splitserve.measure.workload import RequestSpec, build_workload

# The router's request histograms (runtime/metrics.py, role="router"), by the client figure they match.
ROUTER_HISTOGRAMS = {
    "ttft": "splitserve_time_to_first_token_seconds",
    "tpot": "splitserve_request_time_per_output_token_seconds",
    "itl": "splitserve_inter_token_latency_seconds",
    "e2e": "splitserve_e2e_request_latency_seconds",
}
ROUTER_WITHIN_SLO = "splitserve_requests_within_slo_total"  # the router's own goodput count
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
        log(sweep_row_text(rate, run.summary))
        return run.summary["slo_attainment"] >= attainment

    log(SWEEP_HEADER)
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

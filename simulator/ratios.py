"""``splitserve simulate ratios``: the best P:D ratio, and the colocated alternative, per trace, cluster size and SLO
regime, by goodput per pod (the plot Splitwise and DistServe draw).

    splitserve simulate ratios [--pods 8,32,128] [--traces conv,code] [--json ratios.json] [--plot ratios.png] \
        [--scheduling disaggregated|hybrid]

For each trace and cluster size, every layout (``--prefill-shares`` of the pods prefilling, the rest decoding; and
all of them mixed) is swept up a ladder of per-pod rates (``--per-pod-rates``), each run simulated once and judged
against every SLO regime (``--regimes``) from the same requests; a layout's goodput under a regime is bench
compare's: the highest rate at which >= 90% of requests meet both targets, before the first miss. The ladder stops
once every regime has missed. Lengths are the trace's first rows (``--requests-per-pod`` per pod: the same rows at
every rate of a cluster size; prompts capped at ``--max-prompt-tokens``), arrivals Poisson at each rate, the same
seed everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.measure.figures import headless_pyplot, save_figure, save_results
from splitserve.measure.serve_metrics import SLO, SLO_ATTAINMENT
from splitserve.measure.workload import AZURE_CODE, AZURE_CONV
from splitserve.router.config import Scheduling
from splitserve.runtime.config import described, member, parse_config
from splitserve.simulator.cluster import DEFAULT_SCHEDULING, SimCluster
from splitserve.simulator.run import DEFAULT_PROFILE, SimulateConfig, simulate_records

TRACES = {"conv": str(AZURE_CONV), "code": str(AZURE_CODE)}
# name: (TTFT, TPOT) targets in ms, for SmolLM2-135M on one core of this machine (a 1,000-token prompt prefills in
# about 1.2 s, a decode step at batch 1 takes about 30 ms).
REGIMES = {"tight-ttft": ("ttft:2500", "tpot:150"), "balanced": ("ttft:5000", "tpot:100"),
           "tight-tpot": ("ttft:10000", "tpot:60")}


@dataclass
class RatiosConfig:
    """Goodput per pod of every P:D split and of colocation, per trace, cluster size and SLO regime."""

    pods: list[int] = field(default_factory=lambda: [8, 32, 128], metadata=described("Cluster sizes."))
    traces: list[str] = field(default_factory=lambda: list(TRACES), metadata=described(
        f"Traces ({', '.join(TRACES)})."))
    regimes: list[str] = field(default_factory=lambda: list(REGIMES), metadata=described(
        f"SLO regimes ({', '.join(f'{k}: {v[0]} {v[1]}' for k, v in REGIMES.items())})."))
    prefill_shares: list[float] = field(default_factory=lambda: [0.25, 0.375, 0.5, 0.625, 0.75, 0.875],
                                        metadata=described("Shares of the pods that prefill (the rest decode)."))
    per_pod_rates: list[float] = field(default_factory=lambda: [0.02, 0.04, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2, 0.25,
                                                                0.3, 0.36, 0.43],
                                       metadata=described("Request rates per pod to sweep."))
    requests_per_pod: int = field(default=10, metadata=described(
        "Requests per run per pod (at least 150): the same trace rows at every rate of a cluster size."))
    max_prompt_tokens: int = field(default=2048, metadata=described(
        "Cap every prompt (2,048: the longest prompt the shipped profile measured; the context is 8,192)."))
    max_output_tokens: int = field(default=1000, metadata=described("Cap every output."))
    profile: str = field(default=str(DEFAULT_PROFILE), metadata=described("Profile of every pod."))
    prefill_profile: str = field(default="", metadata=described(
        "Profile of the P:D layouts' prefill pods, e.g. measured at another tensor parallel size than the decode "
        "pods' (empty: --profile). Pods then differ in CPUs: each layout's CPUs and goodput per CPU are reported."))
    scheduling: Scheduling = field(default=DEFAULT_SCHEDULING, metadata=described(
        "Of the P:D layouts, as splitserve up's: 'disaggregated' (every prompt on a prefill pod) or 'hybrid' (each "
        "prompt prefilled remotely or lent to its decode pod, one sweep per regime, the router told its targets); "
        "the colocated layout is always there."))
    seed: int = field(default=0, metadata=described("Seeds the lengths and arrivals."))
    json: str = field(default="", metadata=described("Also write the figures to this JSON file."))
    plot: str = field(default="", metadata=described("Also draw goodput per pod against the prefill share here."))

    def __post_init__(self) -> None:
        self.scheduling = member(Scheduling, "scheduling", self.scheduling)
        if self.scheduling is Scheduling.COLOCATED:
            raise ValueError("--scheduling colocated: the colocated layout is always there; pick the P:D layouts' "
                             "scheduling (disaggregated or hybrid)")
        unknown = [t for t in self.traces if t not in TRACES] + [r for r in self.regimes if r not in REGIMES]
        if unknown:
            raise ValueError(f"unknown traces or regimes: {', '.join(unknown)}")


def layouts(pods: int, shares: list[float], prefill_profile: str = "") -> list[tuple[str, list[str]]]:
    """(name, pools) of every distinct P:D split of ``pods`` at ``shares`` (its prefill pods at ``prefill_profile``
    where given), then all of them mixed."""
    splits = sorted({min(pods - 1, max(1, round(pods * share))) for share in shares})
    own = f":{prefill_profile}" if prefill_profile else ""
    return [(f"{p}:{pods - p}", [f"prefill:{p}{own}", f"decode:{pods - p}"]) for p in splits] + [
        ("colocated", [f"mixed:{pods}"])]


def sweep_layout(config: RatiosConfig, trace: str, pods: int, pools: list[str], log=print) -> dict[str, float]:
    """Goodput (req/s) of one layout under every regime (hybrid: one sweep per regime, its router told the
    regime's targets)."""
    slos = {name: SLO.parse(list(REGIMES[name])) for name in config.regimes}

    def simulation_at(rate: float, router_slo: SLO | None = None) -> SimulateConfig:
        scheduling = Scheduling.DISAGGREGATED if pools[0].startswith("mixed") else config.scheduling
        targets = {"slo_ttft_s": router_slo.ttft, "slo_tpot_s": router_slo.tpot} if router_slo else {}
        return SimulateConfig(pools=pools, profile=config.profile, workload=TRACES[trace],
                              num_prompts=max(150, config.requests_per_pod * pods),
                              max_prompt_tokens=config.max_prompt_tokens, max_output_tokens=config.max_output_tokens,
                              seed=config.seed, rates=[rate], conditional_prefill_threshold=0,
                              scheduling=scheduling, **targets)

    rates = [per_pod * pods for per_pod in config.per_pod_rates]
    if config.scheduling is Scheduling.HYBRID and not pools[0].startswith("mixed"):
        return {name: goodput_sweep(lambda rate: simulation_at(rate, slo), rates, {name: slo})[name][0]
                for name, slo in slos.items()}
    return {name: rate for name, (rate, _) in goodput_sweep(simulation_at, rates, slos).items()}


def goodput_sweep(simulation_at: Callable[[float], SimulateConfig], rates: list[float],
                  slos: dict[str, SLO]) -> dict[str, tuple[float, SimCluster | None]]:
    """Per regime of ``slos``: bench compare's goodput over ``rates`` (the highest at which >= 90% of requests meet
    the targets, before the first miss; 0 if none) and the simulated cluster of that run (None if none). The rates
    go up until every regime has missed."""
    result: dict[str, tuple[float, SimCluster | None]] = {name: (0.0, None) for name in slos}
    missed: set[str] = set()
    for rate in sorted(rates):
        simulation = simulation_at(rate)
        cluster = simulation.cluster()
        records = simulate_records(simulation, rate, cluster=cluster)
        for name, slo in slos.items():
            if name in missed:
                continue
            if slo.attained_by(records) >= SLO_ATTAINMENT:
                result[name] = (rate, cluster)
            else:
                missed.add(name)
        if missed == set(slos):
            break
    return result


def run(config: RatiosConfig, log=print) -> dict:
    results = {}
    for trace in config.traces:
        for pods in config.pods:
            started = time.perf_counter()
            rows, cpus = {}, {}
            for name, pools in layouts(pods, config.prefill_shares, config.prefill_profile):
                rows[name] = sweep_layout(config, trace, pods, pools, log)
                cpus[name] = SimulateConfig(pools=pools, profile=config.profile).cluster_spec().cpus
            results[f"{trace}/{pods}"] = rows
            results[f"{trace}/{pods}/cpus"] = cpus  # each pod its profile's CPUs (ranks x threads)
            log(f"{trace}, {pods} pods ({time.perf_counter() - started:.0f} s of simulation); CPUs: "
                + "  ".join(f"{layout} {n}" for layout, n in cpus.items()))
            for regime in config.regimes:
                best = max(rows, key=lambda layout: rows[layout][regime])
                cells = "  ".join(f"{layout} {rows[layout][regime] / pods:.3f}" for layout in rows)
                log(f"  {regime:<11} best {best:<10} goodput/pod: {cells}")
                if len(set(cpus.values())) > 1:  # pods of different sizes: per pod no longer compares them
                    cells = "  ".join(f"{layout} {rows[layout][regime] / cpus[layout]:.3f}" for layout in rows)
                    log(f"  {'':<11} {'':<15} goodput/CPU: {cells}")
    return results


def plot(results: dict, config: RatiosConfig, path: str) -> None:
    plt = headless_pyplot()
    fig, axes = plt.subplots(len(config.traces), len(config.regimes), figsize=(5 * len(config.regimes),
                                                                              4 * len(config.traces)), squeeze=False)
    for row, trace in enumerate(config.traces):
        for col, regime in enumerate(config.regimes):
            ax = axes[row][col]
            for pods in config.pods:
                layout_rows = results[f"{trace}/{pods}"]
                splits = [(int(name.split(":")[0]) / pods, g[regime] / pods) for name, g in layout_rows.items()
                          if name != "colocated"]
                line, = ax.plot(*zip(*splits), "o-", label=f"{pods} pods, P:D")
                ax.axhline(layout_rows["colocated"][regime] / pods, color=line.get_color(), linestyle="--",
                           label=f"{pods} pods, colocated")
            targets = " ".join(REGIMES[regime])
            ax.set(xlabel="share of pods prefilling", ylabel="goodput per pod (req/s)",
                   title=f"{trace} trace, {regime} ({targets})")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Simulated goodput per pod by P:D split (SmolLM2-135M, 1 core per pod, profile measured on a loaded "
                 "2-core machine): a projection")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(RatiosConfig, argv, prog="splitserve simulate ratios")
    results = run(config)
    save_results(results, config.json, config.plot, lambda r, path: plot(r, config, path))
    return results

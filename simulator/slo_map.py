"""``splitserve simulate slo-map``: simulated goodput of the three schedulings (``splitserve up --scheduling``) under
``bench compare --slo-map``'s SLO regimes, at one or more cluster sizes.

    splitserve simulate slo-map [--pods 2,8,32,128] [--prefill-share 0.5] [--json slo-map.json]

As ``bench/compare/slo_map.py`` maps a real run, in simulation:
  1. the single-request TTFT ``T0`` and TPOT ``P0``: the workload's first ``--calibration-requests`` requests, each
     alone on one mixed pod at the colocated budget (the map's baseline), medians;
  2. the regimes from them: ``splitserve.measure.slo_regimes.REGIMES`` (tight TTFT ``2 T0`` / ``5 P0``, balanced
     ``4 T0`` / ``2.5 P0``, tight TPOT ``12 T0`` / ``1.5 P0``);
  3. per cluster size N: ``colocated`` (N mixed pods, chunked prefill at ``--colocated-budget`` tokens, the map's
     best colocated setting), ``disaggregated`` (``round(N * --prefill-share)`` prefill pods, the rest decode, every
     prompt on a prefill pod) and ``hybrid`` (the same pods, its router and decode pods told the regime's targets:
     one sweep per regime), each swept up ``--per-pod-rates`` x N with the same seeded requests;
  4. a scheduling's goodput under a regime is bench compare's: the highest rate at which >= 90% of the requests meet
     both targets, every lower rate meeting them too. One seed, no intervals: a simulated figure, not a
     measurement.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from splitserve.measure.figures import save_results
from splitserve.measure.phase_profile import PhaseProfile
from splitserve.measure.serve_metrics import SLO
from splitserve.measure.slo_regimes import BASELINE_BUDGET, CALIBRATION_REQUESTS, REGIMES
from splitserve.measure.workload import AZURE_CONV, build_workload
from splitserve.router.config import Scheduling
from splitserve.runtime.config import described, parse_config
from splitserve.simulator.cluster import SimCluster
from splitserve.simulator.ratios import goodput_sweep
from splitserve.simulator.run import DEFAULT_PROFILE, SimulateConfig

SCHEDULINGS = (Scheduling.COLOCATED, Scheduling.DISAGGREGATED, Scheduling.HYBRID)
PER_POD_RATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0, 1.2, 1.5)


@dataclass
class SLOMapConfig:
    """Goodput of colocated, disaggregated and hybrid scheduling per SLO regime of bench compare --slo-map."""

    pods: list[int] = field(default_factory=lambda: [2], metadata=described(
        "Cluster sizes (2: bench compare's 1:1 split, and two mixed pods)."))
    prefill_share: float = field(default=0.5, metadata=described(
        "Share of the pods that prefill in the disaggregated and hybrid layouts (the rest decode)."))
    per_pod_rates: list[float] = field(default_factory=lambda: list(PER_POD_RATES), metadata=described(
        "Request rates per pod to sweep."))
    requests_per_pod: int = field(default=30, metadata=described(
        "Requests per run per pod (at least 60, the issue's per-rate floor): the same rows at every rate."))
    workload: str = field(default=str(AZURE_CONV), metadata=described(
        "An Azure-format CSV trace, or azure-conv, azure-code (synthetic)."))
    max_prompt_tokens: int = field(default=512, metadata=described("Cap every prompt (bench compare's)."))
    max_output_tokens: int = field(default=64, metadata=described("Cap every output (bench compare's)."))
    colocated_budget: int = field(default=BASELINE_BUDGET, metadata=described(
        "Chunked-prefill token budget (and chunk cap) of the colocated pods (the map's baseline)."))
    calibration_requests: int = field(default=CALIBRATION_REQUESTS, metadata=described(
        "Requests, one at a time, whose median TTFT and TPOT the regimes are multiples of."))
    profile: str = field(default=str(DEFAULT_PROFILE), metadata=described("Profile of every pod."))
    seed: int = field(default=0, metadata=described("Seeds the lengths and arrivals."))
    json: str = field(default="", metadata=described("Also write the figures to this JSON file."))

    def __post_init__(self) -> None:
        if not 0 < self.prefill_share < 1 or min(self.pods) < 2:
            raise ValueError("--prefill-share must be in (0, 1) and every --pods at least 2")

    def simulation(self, pods: int, scheduling: Scheduling, rate: float, slo: SLO | None = None,
                   num_prompts: int = 0) -> SimulateConfig:
        """The simulated cluster of ``pods`` under ``scheduling`` at ``rate`` (hybrid: its router told ``slo``)."""
        prefill = min(pods - 1, max(1, round(pods * self.prefill_share)))
        pools = [f"prefill:{prefill}", f"decode:{pods - prefill}"] if pods > 1 else ["mixed:1"]
        budget = ({"max_num_batched_tokens": self.colocated_budget,
                   "long_prefill_token_threshold": self.colocated_budget}
                  if scheduling is Scheduling.COLOCATED else {})
        targets = {"slo_ttft_s": slo.ttft, "slo_tpot_s": slo.tpot} if slo is not None else {}
        return SimulateConfig(pools=pools, profile=self.profile, workload=self.workload,
                              num_prompts=num_prompts or max(60, self.requests_per_pod * pods),
                              max_prompt_tokens=self.max_prompt_tokens, max_output_tokens=self.max_output_tokens,
                              seed=self.seed, rates=[rate], conditional_prefill_threshold=0, scheduling=scheduling,
                              **budget, **targets)


def single_request_latencies(config: SLOMapConfig) -> tuple[float, float]:
    """``T0`` and ``P0``: the median TTFT and TPOT of the first requests, each alone on one colocated pod."""
    base = config.simulation(1, Scheduling.COLOCATED, 1.0, num_prompts=config.calibration_requests)
    ttfts, tpots = [], []
    for spec in build_workload(base.workload_at(1.0)):
        [record] = base.cluster().run([dataclasses.replace(spec, arrival_s=0.0)])
        ttfts.append(record.ttft)
        if record.tpot is not None:
            tpots.append(record.tpot)
    return statistics.median(ttfts), statistics.median(tpots)


def sweep(config: SLOMapConfig, pods: int, scheduling: Scheduling, slos: dict[str, SLO],
          router_slo: SLO | None = None) -> dict[str, dict]:
    """Per regime of ``slos``: the goodput (req/s) of one scheduling on ``pods``, from one sweep of rates, and the
    share of requests prefilled on their decode pod at that rate (hybrid: lent)."""
    rates = [per_pod * pods for per_pod in config.per_pod_rates]
    swept = goodput_sweep(lambda rate: config.simulation(pods, scheduling, rate, router_slo), rates, slos)
    return {name: {"goodput": rate, "on_decode": _on_decode(cluster)} for name, (rate, cluster) in swept.items()}


def _on_decode(cluster: SimCluster | None) -> float:
    decisions = cluster.decisions if cluster is not None else {}
    return decisions.get("prefill_on_decode", 0) / max(1, sum(decisions.values()))


def run(config: SLOMapConfig, log=print) -> dict:
    ttft0, tpot0 = single_request_latencies(config)
    slos = {regime.name: regime.slo(ttft0, tpot0) for regime in REGIMES}
    log(f"single request: TTFT {ttft0 * 1e3:.0f} ms, TPOT {tpot0 * 1e3:.1f} ms; regimes: "
        + "; ".join(f"{name} {slo.describe()}" for name, slo in slos.items()))
    pod_cpus = PhaseProfile.load(config.profile).pod_cpus  # one profile: every layout of N pods holds N x this
    results = {"ttft0_s": ttft0, "tpot0_s": tpot0, "regimes": {n: s.describe() for n, s in slos.items()},
               "goodput": {}, "cpus": {str(pods): pods * pod_cpus for pods in config.pods}}
    for pods in config.pods:
        rows = {str(s): sweep(config, pods, s, slos) for s in SCHEDULINGS if s is not Scheduling.HYBRID}
        rows[str(Scheduling.HYBRID)] = {name: sweep(config, pods, Scheduling.HYBRID, {name: slo}, slo)[name]
                                        for name, slo in slos.items()}
        results["goodput"][str(pods)] = rows
        for name in slos:
            cells = "  ".join(f"{s} {rows[str(s)][name]['goodput']:.2f}" for s in SCHEDULINGS)
            log(f"{pods:>4} pods ({pods * pod_cpus} CPUs) {name:<11} goodput req/s: {cells} (hybrid lent "
                f"{rows[str(Scheduling.HYBRID)][name]['on_decode']:.0%} of prompts at its goodput)")
    return results


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(SLOMapConfig, argv, prog="splitserve simulate slo-map")
    results = run(config)
    save_results(results, config.json, None)
    return results

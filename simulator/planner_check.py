"""The planner with its decisions checked in simulation before they apply:
``python -m splitserve.simulator.planner_check`` (the chart runs it in place of ``python -m splitserve.deploy.planner``
when ``planner.config.simulateCheck`` is true).

Every tick, after ``Planner.plan`` has decided, ``SimulatedCheck`` replays the load the planner just measured on two
simulated clusters, the pools as they are and as decided:

    workload   ``simulate_requests`` requests, Poisson at the measured request rate, lengths shaped like the
               conversation trace (``azure-conv``) and scaled to the measured mean prompt and output lengths
               (the router's token rates over its request rate);
    cluster    that many prefill and decode pods, each as fast as its pool's profile says (``prefill_profile``,
               ``decode_profile``: measured at the pods' tensor parallel size; else ``simulate_profile``; ``bench
               phases --profile-out`` on the pods' machine), the engine's scheduler and the router's policy on a
               virtual clock (``simulator/``);
    verdict    the share of the requests meeting both of the planner's targets (TTFT and TPOT): the predicted
               attainment, exported as ``splitserve_planner_predicted_attainment{plan="current"|"decided"}``.

A decision that shrinks a pool is held (reason ``simulated``) when the decided pools are predicted to attain less
than ``simulate_min_attainment`` and less than the pools as they are: the capacity model's headroom is a rule of
thumb, the simulation plays the queueing out. Growing is never held (more pods do not make a request later). In
dry-run the check runs as ever, so the exported decisions say what it would hold. No traffic (no request rate or
no token rates in the window): no prediction, nothing held.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys

from splitserve.deploy.planner.capacity import PoolDecision, Signals
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.deploy.planner.controller import main as planner_main
from splitserve.measure.serve_metrics import SLO
from splitserve.measure.workload import RequestSpec, WorkloadConfig, build_workload
from splitserve.simulator.run import DEFAULT_PROFILE, SimulateConfig

logger = logging.getLogger(__name__)

MIN_RUN_S = 600.0  # a simulated run lasts at least this much virtual time past its last arrival


class SimulatedCheck:
    """``check(signals, decisions) -> decisions``: each decision as planned, or held where the simulation says the
    decided pools would miss (module docstring). ``last`` keeps the latest predictions ({"current", "decided"})."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.slo = SLO(ttft=config.ttft_target_s, tpot=config.tpot_target_s)
        # each pool's pods at its own profile (measured at its pods' size), else the one profile of both
        self.profiles = {pool: getattr(config, f"{pool}_profile") or config.simulate_profile or str(DEFAULT_PROFILE)
                         for pool in ("prefill", "decode")}
        self.last: dict[str, float] = {}

    def __call__(self, signals: Signals, decisions: list[PoolDecision]) -> list[PoolDecision]:
        self.last = {}  # nothing predicted until this tick's simulations are done
        current = {d.pool: d.current for d in decisions}
        decided = {d.pool: d.desired for d in decisions}
        specs = self.workload(signals)
        if specs is None:
            return decisions
        now = self.attainment(current, specs)
        self.last = {"current": now, "decided": now if decided == current else self.attainment(decided, specs)}
        shrinks = [d for d in decisions if d.desired < d.current]
        predicted = self.last["decided"]
        if not shrinks or predicted >= self.config.simulate_min_attainment or predicted >= now:
            return decisions
        logger.info("simulated: the decided pools %s would attain %.0f%% of the targets against %.0f%% as they are "
                    "%s (floor %.0f%%): shrinking is held", decided, 100 * predicted, 100 * now, current,
                    100 * self.config.simulate_min_attainment)
        return [dataclasses.replace(d, desired=d.current, reason="simulated") if d in shrinks else d
                for d in decisions]

    def workload(self, signals: Signals) -> list[RequestSpec] | None:
        """The measured load as requests (module docstring); None when the window saw none."""
        rate, prompt, output = signals.requests_per_s, signals.prompt_tokens_per_s, signals.output_tokens_per_s
        if not all(math.isfinite(x) and x > 0 for x in (rate, prompt, output)):
            return None
        shaped = build_workload(WorkloadConfig(workload="azure-conv", num_prompts=self.config.simulate_requests,
                                               request_rate=rate, seed=0))
        prompt_scale = prompt / rate / (sum(s.prompt_len for s in shaped) / len(shaped))
        output_scale = output / rate / (sum(s.output_len for s in shaped) / len(shaped))
        return [RequestSpec(s.index, s.arrival_s, max(1, round(s.prompt_len * prompt_scale)),
                            max(1, round(s.output_len * output_scale))) for s in shaped]

    def attainment(self, pods: dict[str, int], specs: list[RequestSpec]) -> float:
        """The share of ``specs`` meeting both targets on ``pods`` prefill and decode pods, simulated."""
        if not pods.get("decode"):
            return 0.0
        simulated = SimulateConfig(pools=[f"{pool}:{n}:{self.profiles[pool]}" for pool, n in pods.items()],
                                   profile=self.profiles["decode"],
                                   rates=[1.0], max_prompt_tokens=0, max_output_tokens=0)
        records = simulated.cluster().run(specs, until=specs[-1].arrival_s + MIN_RUN_S)
        return self.slo.attained_by(records)


def main(argv: list[str] | None = None) -> None:
    planner_main(sys.argv[1:] if argv is None else argv, check_factory=SimulatedCheck)


if __name__ == "__main__":
    main()

"""The planner's loop: read the signals and the current replica counts, decide, check the decision (when a check is
given: ``simulator/planner_check.py`` simulates it), scale (unless dry-run), export.

A failed step (Prometheus unreachable or slow, the API server refusing or slow: every call has a timeout) is
counted and logged, and changes nothing: the planner never scales on data it does not have, and never stops.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from prometheus_client import start_http_server

from splitserve.deploy.planner.capacity import POOLS, Planner, PoolDecision, Signals
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.deploy.planner.metrics import PlannerMetrics
from splitserve.deploy.planner.scaler import DeploymentScaler, api_client, own_namespace
from splitserve.deploy.planner.signals import PrometheusSignals
from splitserve.runtime.config import parse_config

logger = logging.getLogger(__name__)


class Check(Protocol):
    """A second opinion on the decisions before they apply: the same decisions, or some of them held."""

    last: dict[str, float]  # its latest predicted attainment per plan ("current", "decided"); empty: none

    def __call__(self, signals: Signals, decisions: list[PoolDecision]) -> list[PoolDecision]: ...


class PlannerLoop:
    """One planner process: ``tick()`` makes one decision for both pools."""

    def __init__(self, config: PlannerConfig, signals: PrometheusSignals, scaler: DeploymentScaler,
                 metrics: PlannerMetrics, clock=time.monotonic, check: Check | None = None):
        self.config, self.signals, self.scaler, self.metrics, self.clock = config, signals, scaler, metrics, clock
        self.planner = Planner(config, started_at=clock())
        self.check = check

    def tick(self) -> list[PoolDecision]:
        try:
            signals = self.signals.read()
        except OSError:
            logger.exception("reading Prometheus failed; nothing changes")
            self.metrics.failed("read_metrics")
            return []
        try:
            current = self.scaler.replicas()
        except Exception:  # the kubernetes client raises ApiException, urllib3 errors, ...
            logger.exception("reading the Deployments' scale failed; nothing changes")
            self.metrics.failed("read_replicas")
            return []
        try:
            decisions = self.planner.plan(signals, current, self.clock())
        except Exception:  # a bug on data nobody foresaw must not stop the planner: say so, keep going
            logger.exception("deciding failed on %s; nothing changes", signals)
            self.metrics.failed("plan")
            return []
        if self.check is not None:
            try:
                decisions = self.check(signals, decisions)
            except Exception:  # the check is advice: a failure of it must not stop a decision
                logger.exception("checking the decisions failed; they apply unchecked")
                self.metrics.failed("check")
            self.metrics.predicted(self.check.last)
        for decision in decisions:
            self._apply(decision)
        return decisions

    def _apply(self, decision: PoolDecision) -> None:
        logger.info("%s: %d -> %d (%s; needs %.2f pods: demand %.3g, capacity %.3g per pod)%s", decision.pool,
                    decision.current, decision.desired, decision.reason, decision.needed, decision.demand,
                    decision.capacity, " [dry run]" if self.config.dry_run else "")
        if decision.desired != decision.current and not self.config.dry_run:
            try:
                self.scaler.scale(decision.pool, decision.desired)
            except Exception:
                logger.exception("scaling %s failed", decision.pool)
                self.metrics.failed("scale")
                return
        self.metrics.record(decision)

    def run_forever(self) -> None:
        while True:
            started = self.clock()
            self.tick()
            time.sleep(max(0.0, self.config.interval_s - (self.clock() - started)))


def main(argv: list[str], check_factory: Callable[[PlannerConfig], Check] | None = None) -> None:
    """``python -m splitserve.deploy.planner``; ``check_factory`` builds the decisions' check (``python -m
    splitserve.simulator.planner_check`` passes the simulator's: this package sits below the simulator and cannot
    load it)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_config(PlannerConfig, argv, prog="python -m splitserve.deploy.planner")
    if config.simulate_check and check_factory is None:
        raise SystemExit("--simulate-check needs the simulator: run python -m splitserve.simulator.planner_check (the "
                         "chart does when planner.config.simulateCheck is true)")
    deployments = {"prefill": config.prefill_deployment, "decode": config.decode_deployment}
    missing = [pool for pool in POOLS if not deployments[pool]]
    if missing:
        raise SystemExit(f"name the Deployments to scale: --{missing[0]}-deployment")
    scaler = DeploymentScaler(api_client(config.kubeconfig), config.namespace or own_namespace(), deployments,
                              config.request_timeout_s)
    metrics = PlannerMetrics(config.model_name, config.dry_run)
    start_http_server(config.metrics_port, config.host, metrics.registry)
    logger.info("planner: %s in %s every %.0f s%s", ", ".join(deployments.values()), scaler.namespace,
                config.interval_s, " (dry run)" if config.dry_run else "")
    check = check_factory(config) if config.simulate_check and check_factory is not None else None
    PlannerLoop(config, PrometheusSignals(config), scaler, metrics, check=check).run_forever()

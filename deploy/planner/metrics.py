"""The planner's own Prometheus series: what it measured, what it decided and why, per pool.

Labelled ``role="planner"`` and ``model_name`` like every splitserve series, plus ``pool`` (prefill, decode).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.deploy.planner.capacity import PoolDecision

LABELS = ("role", "model_name", "pool")


class PlannerMetrics:
    def __init__(self, model_name: str, dry_run: bool, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name or "all"

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"splitserve_planner_{name}", doc, LABELS, registry=self.registry)

        self.current = gauge("current_replicas", "Replicas the pool's Deployment had at the decision.")
        self.desired = gauge("desired_replicas", "Replicas the planner decided on (set unless dry-run).")
        self.needed = gauge("needed_replicas", "Pods the capacity model says the load needs, before bounds, "
                                               "hysteresis and cooldowns.")
        self.demand = gauge("demand", "Prefill: prompt tokens/s for prefill pods; decode: requests decoding at once.")
        self.capacity = gauge("capacity_per_pod", "Prefill: prompt tokens/s of one busy pod; decode: requests one "
                                                  "pod runs within the TPOT target.")
        self.decisions = Counter("splitserve_planner_decisions_total", "Decisions by outcome (up, down, hold, "
                                 "cooldown, bounds, slo, starting, settling, no-data, simulated).",
                                 LABELS + ("reason",), registry=self.registry)
        self.errors = Counter("splitserve_planner_errors_total",
                              "Failed steps (read_metrics, read_replicas, plan, check, scale).",
                              ("role", "model_name", "stage"), registry=self.registry)
        self.attainment = Gauge("splitserve_planner_predicted_attainment",
                                "Share of requests within both targets in the simulated check (--simulate-check), "
                                "for the pools as they are and as decided.", ("role", "model_name", "plan"),
                                registry=self.registry)
        Gauge("splitserve_planner_dry_run", "1 when the planner decides but scales nothing.", ("role", "model_name"),
              registry=self.registry).labels("planner", self.model_name).set(1 if dry_run else 0)

    def record(self, decision: PoolDecision) -> None:
        labels = ("planner", self.model_name, decision.pool)
        self.current.labels(*labels).set(decision.current)
        self.desired.labels(*labels).set(decision.desired)
        for gauge, value in ((self.needed, decision.needed), (self.demand, decision.demand),
                             (self.capacity, decision.capacity)):
            if math.isfinite(value):
                gauge.labels(*labels).set(value)
        self.decisions.labels(*labels, decision.reason).inc()

    def predicted(self, attainment: dict[str, float]) -> None:
        """The simulated check's latest predictions ({"current": .., "decided": ..}; empty: none, NaN exported)."""
        for plan in ("current", "decided"):
            self.attainment.labels("planner", self.model_name, plan).set(attainment.get(plan, math.nan))

    def failed(self, stage: str) -> None:
        self.errors.labels("planner", self.model_name, stage).inc()

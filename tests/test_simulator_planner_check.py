"""The planner's decisions checked in simulation (``simulator/planner_check.py``): the prediction follows the pods
(fewer decode pods under a decode-bound load attain less), a shrink the simulation says would miss is held, growing
never is, and the loop exports what it predicted and scales nothing it held."""

from __future__ import annotations

import dataclasses
import math

import pytest
from prometheus_client import generate_latest

from splitserve.deploy.planner.capacity import PoolDecision, Replicas, Signals
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.deploy.planner.controller import PlannerLoop
from splitserve.deploy.planner.controller import main as planner_main
from splitserve.deploy.planner.metrics import PlannerMetrics
from splitserve.simulator.planner_check import SimulatedCheck
from splitserve.simulator.run import FORMAT_PROFILES

NAN = math.nan


def measured(rate: float, prompt: int, output: int, **known) -> Signals:
    """The planner's window at ``rate`` requests/s of ``prompt``-token prompts and ``output``-token answers."""
    fields = dict(prefill_tokens_per_s=NAN, decode_prefill_tokens_per_s=NAN, prefill_busy=NAN,
                  prefill_queue_p99_s=NAN, decode_pods=NAN, decode_running=NAN, decode_waiting=NAN,
                  decode_step_s=NAN, kv_usage_max=NAN, ttft_p99_s=NAN, tpot_p99_s=NAN)
    fields.update(known)
    return Signals(requests_per_s=rate, prompt_tokens_per_s=rate * prompt, output_tokens_per_s=rate * output,
                   **fields)


CONFIG = PlannerConfig(ttft_target_s=2.0, tpot_target_s=0.06, simulate_requests=200, simulate_check=True)


def test_the_workload_has_the_measured_rate_and_mean_lengths():
    specs = SimulatedCheck(CONFIG).workload(measured(3.0, 100, 200))
    assert len(specs) == 200
    assert sum(s.prompt_len for s in specs) / 200 == pytest.approx(100, rel=0.02)
    assert sum(s.output_len for s in specs) / 200 == pytest.approx(200, rel=0.02)
    assert 200 / specs[-1].arrival_s == pytest.approx(3.0, rel=0.25)  # Poisson: the mean gap, roughly
    assert len({s.prompt_len for s in specs}) > 20  # the trace's spread, not one length
    assert SimulatedCheck(CONFIG).workload(measured(NAN, 100, 200)) is None  # no traffic: nothing to predict


@pytest.mark.parametrize("prefill_format", sorted(FORMAT_PROFILES))
def test_fewer_decode_pods_under_a_decode_bound_load_are_predicted_to_attain_less(prefill_format):
    """On either shipped profile of a default pod (the check's default is the one this CPU resolves to)."""
    check = SimulatedCheck(dataclasses.replace(CONFIG, simulate_profile=str(FORMAT_PROFILES[prefill_format])))
    specs = check.workload(measured(3.0, 100, 400))
    one, two, four = (check.attainment({"prefill": 1, "decode": n}, specs) for n in (1, 2, 4))
    assert one < two < four
    assert four >= 0.9 and one < 0.5


class Table(SimulatedCheck):
    """The check's rule on attainments given by hand (the decode pods -> attainment)."""

    def __init__(self, config: PlannerConfig, by_decode_pods: dict[int, float]):
        super().__init__(config)
        self.by_decode_pods = by_decode_pods

    def attainment(self, pods, specs):
        return self.by_decode_pods[pods["decode"]]


def decisions(decode_from: int, decode_to: int) -> list[PoolDecision]:
    return [PoolDecision("prefill", 1, 1, 0.5, 100.0, 400.0, "hold"),
            PoolDecision("decode", decode_from, decode_to, float(decode_to), 10.0, 8.0,
                         "down" if decode_to < decode_from else "up")]


@pytest.mark.parametrize("table, start, end, held", [
    ({3: 0.97, 2: 0.70}, 3, 2, True),  # the shrink would miss the floor: held
    ({3: 0.97, 2: 0.93}, 3, 2, False),  # it would still attain the floor: applied
    ({3: 0.50, 2: 0.60}, 3, 2, False),  # below the floor either way, but not worse: applied
    ({2: 0.30, 3: 0.60}, 2, 3, False),  # growing is never held
])
def test_a_shrink_is_held_only_when_predicted_to_miss_the_floor_and_do_worse(table, start, end, held):
    check = Table(CONFIG, table)
    out = {d.pool: d for d in check(measured(3.0, 100, 200), decisions(start, end))}
    assert out["decode"].desired == (start if held else end)
    assert out["decode"].reason == ("simulated" if held else decisions(start, end)[1].reason)
    assert out["prefill"] == decisions(start, end)[0]
    assert check.last == {"current": table[start], "decided": table[end]}


class Scaler:
    def __init__(self, counts: dict[str, int]):
        self.counts, self.calls = dict(counts), []

    def replicas(self) -> dict[str, Replicas]:
        return {pool: Replicas(n, n) for pool, n in self.counts.items()}

    def scale(self, pool: str, replicas: int) -> None:
        self.calls.append((pool, replicas))
        self.counts[pool] = replicas


class Recorded:
    def __init__(self, signals: Signals):
        self.signals = signals

    def read(self) -> Signals:
        return self.signals


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_loop_holds_a_shrink_the_simulation_rejects_and_exports_the_prediction(dry_run):
    """An idle-looking window (few running, a low measured rate on the capacity model) makes the planner shrink the
    decode pool; the simulation of the same window on fewer pods misses, so the shrink is held, in dry-run too."""
    config = PlannerConfig(ttft_target_s=2.0, tpot_target_s=0.06, simulate_check=True, dry_run=dry_run,
                           scale_down_cooldown_s=0, min_decode_replicas=1)
    signals = measured(0.2, 100, 200, decode_pods=3.0, decode_running=0.5, decode_waiting=0.0, decode_step_s=0.03,
                       kv_usage_max=0.05, prefill_tokens_per_s=20.0, decode_prefill_tokens_per_s=0.0,
                       prefill_busy=0.05, prefill_queue_p99_s=0.0, ttft_p99_s=0.2, tpot_p99_s=0.03)
    metrics = PlannerMetrics("smollm2-135m", dry_run)
    scaler = Scaler({"prefill": 1, "decode": 3})
    check = Table(config, {3: 0.95, 2: 0.40, 1: 0.10})
    loop = PlannerLoop(config, Recorded(signals), scaler, metrics, clock=lambda: 1e6, check=check)
    (decode,) = [d for d in loop.tick() if d.pool == "decode"]
    assert (decode.current, decode.desired, decode.reason) == (3, 3, "simulated")
    assert scaler.calls == []
    text = generate_latest(metrics.registry).decode()
    assert 'splitserve_planner_predicted_attainment{model_name="smollm2-135m",plan="decided",role="planner"} 0.4' \
        in text
    assert 'plan="current",role="planner"} 0.95' in text
    assert 'reason="simulated",role="planner"} 1.0' in text

    check.by_decode_pods[2] = 0.93  # now the simulation agrees: the shrink applies (unless dry-run)
    (decode,) = [d for d in loop.tick() if d.pool == "decode"]
    assert decode.desired < 3
    assert scaler.calls == ([] if dry_run else [("decode", decode.desired)])


def test_a_failing_check_leaves_the_decisions_as_planned_and_is_counted():
    class Broken(SimulatedCheck):
        def attainment(self, pods, specs):
            raise RuntimeError("profile unreadable")

    config = PlannerConfig(simulate_check=True, scale_up_cooldown_s=0)
    signals = measured(4.0, 600, 120, decode_pods=1.0, decode_running=24.0, decode_waiting=3.0, decode_step_s=0.045,
                       kv_usage_max=0.4, prefill_tokens_per_s=400.0, decode_prefill_tokens_per_s=0.0,
                       prefill_busy=1.0, prefill_queue_p99_s=9.5, ttft_p99_s=11.0, tpot_p99_s=0.06)
    metrics, scaler = PlannerMetrics("m", False), Scaler({"prefill": 1, "decode": 1})
    loop = PlannerLoop(config, Recorded(signals), scaler, metrics, clock=lambda: 1e6, check=Broken(config))
    assert any(d.desired > d.current for d in loop.tick())  # the busy window grows a pool, unchecked
    assert scaler.calls
    assert 'splitserve_planner_errors_total{model_name="m",role="planner",stage="check"} 1.0' in \
        generate_latest(metrics.registry).decode()


def test_the_planner_alone_refuses_the_check_it_cannot_load():
    with pytest.raises(SystemExit, match="splitserve.simulator.planner_check"):
        planner_main(["--simulate-check", "--prefill-deployment", "p", "--decode-deployment", "d"])

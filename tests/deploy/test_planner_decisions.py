"""The planner's pure decisions (``deploy/planner/capacity.py``) on metric traces.

The traces come from ``SimulatedCluster``: a cluster whose true capacities the planner does not know (a prefill
pod prefills 400 prompt tokens/s; a decode step takes 20 ms + 1 ms per running request), which turns the load and
the ready pods into what Prometheus would report, optionally as a real cluster does it: new pods ready only
``startup_s`` after the planner asked for them, and the metrics ``lag_s`` behind (they describe the load and the
ready pods of that long ago). The planner's decisions are fed back each tick (closed loop, one tick every 30 s of
simulated time), so each scenario checks where the pools settle and how they get there: steady, ramp (without
overshoot, with start-up delay and lag), spike, prefill-heavy, decode-heavy, a TTFT target no pool can meet; plus
the rules one at a time (bounds, readiness, hysteresis, cooldowns, SLO misses, missing data).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from splitserve.deploy.planner.capacity import (
    DecodeCapacity,
    Planner,
    PoolSizer,
    PrefillCapacity,
    Replicas,
    Signals,
    mdl1_max_utilization,
)
from splitserve.deploy.planner.config import PlannerConfig

TICK_S = 30.0
PREFILL_TOKENS_PER_S = 400.0  # the simulated pods' truth, unknown to the planner
STEP_BASE_S, STEP_PER_SEQ_S = 0.020, 0.001
KV_SEQS_PER_POD = 200


def config(**overrides) -> PlannerConfig:
    base = dict(ttft_target_s=2.0, tpot_target_s=0.05, max_prefill_replicas=20, max_decode_replicas=20,
                scale_up_cooldown_s=60, scale_down_cooldown_s=300, prefill_tokens_per_s_per_pod=200.0,
                decode_step_base_s=0.05, decode_step_per_seq_s=0.002)
    return PlannerConfig(**{**base, **overrides})


class SimulatedCluster:
    """Load (requests/s, prompt and output lengths) and ready pods -> the Signals Prometheus would show."""

    def __init__(self, prefill: int = 1, decode: int = 1, startup_s: float = 0.0, lag_s: float = 0.0):
        self.replicas = {"prefill": prefill, "decode": decode}  # what the Deployments ask for
        self.startup_s, self.lag_s = startup_s, lag_s
        self.pods: dict[str, list[float]] = {pool: [-math.inf] * n for pool, n in self.replicas.items()}  # ready at
        self.ready_history: list[tuple[float, dict[str, int]]] = []

    def scale(self, pool: str, desired: int, now: float) -> None:
        started = self.pods[pool]
        if desired > len(started):
            started.extend([now + self.startup_s] * (desired - len(started)))
        else:
            del started[desired:]  # the newest go first
        self.replicas[pool] = desired

    def ready(self, now: float) -> dict[str, int]:
        return {pool: sum(1 for at in started if at <= now) for pool, started in self.pods.items()}

    def observed(self, now: float, load) -> Signals:
        """What Prometheus shows at ``now``: the load and the ready pods of ``lag_s`` ago."""
        self.ready_history.append((now, self.ready(now)))
        then = now - self.lag_s
        ready_then = next((r for t, r in reversed(self.ready_history) if t <= then), self.ready_history[0][1])
        return self.signals(*load(then), pods=ready_then)

    def signals(self, rate: float, prompt_len: float, output_len: float, pods: dict[str, int] | None = None) -> Signals:
        pods = pods or self.replicas
        pods_p, pods_d = max(pods["prefill"], 0), max(pods["decode"], 1)
        prompt_tps, output_tps = rate * prompt_len, rate * output_len
        rho = prompt_tps / (pods_p * PREFILL_TOKENS_PER_S) if pods_p else math.inf
        service_s = prompt_len / PREFILL_TOKENS_PER_S
        queue_p99 = 3 * service_s * rho / (2 * (1 - rho)) if rho < 1 else 30.0
        per_pod_rate = output_tps / pods_d  # tokens/s each decode pod must produce
        if STEP_PER_SEQ_S * per_pod_rate < 1:
            batch = STEP_BASE_S * per_pod_rate / (1 - STEP_PER_SEQ_S * per_pod_rate)  # B = x * step(B)
            waiting = 0.0
        else:
            batch, waiting = 64.0, 10.0 * pods_d
        step = STEP_BASE_S + STEP_PER_SEQ_S * batch
        return Signals(
            requests_per_s=rate, prompt_tokens_per_s=prompt_tps, output_tokens_per_s=output_tps,
            prefill_tokens_per_s=min(prompt_tps, pods_p * PREFILL_TOKENS_PER_S), decode_prefill_tokens_per_s=0.0,
            prefill_busy=min(pods_p, rho * pods_p), prefill_queue_p99_s=queue_p99, decode_pods=pods_d,
            decode_running=batch * pods_d, decode_waiting=waiting, decode_step_s=step,
            kv_usage_max=min(1.0, batch / KV_SEQS_PER_POD), ttft_p99_s=service_s + queue_p99,
            tpot_p99_s=1.2 * step)


def run(planner: Planner, cluster: SimulatedCluster, load, ticks: int, start: float = 0.0):
    """Closed loop: ``load(t)`` -> (rate, prompt_len, output_len). Returns the replica counts after each tick."""
    history = []
    for i in range(ticks):
        now = start + (i + 1) * TICK_S
        for decision in planner.plan(cluster.observed(now, load), replicas_of(cluster, now), now):
            cluster.scale(decision.pool, decision.desired, now)
        history.append(dict(cluster.replicas))
    return history


def replicas_of(cluster: SimulatedCluster, now: float) -> dict[str, Replicas]:
    ready = cluster.ready(now)
    return {pool: Replicas(desired, ready[pool]) for pool, desired in cluster.replicas.items()}


def all_ready(**counts: int) -> dict[str, Replicas]:
    return {pool: Replicas(n, n) for pool, n in counts.items()}


def changes(history, pool: str) -> int:
    return sum(1 for a, b in zip(history, history[1:]) if a[pool] != b[pool])


def band(busy_pods: float, utilization: float, c: PlannerConfig) -> range:
    """Where a settled pool may sit: enough pods at the target utilization, at most as many as the lower
    (hysteresis) utilization asks for."""
    low = busy_pods / utilization
    high = busy_pods / (utilization * (c.target_utilization - c.hysteresis) / c.target_utilization)
    return range(math.ceil(low), math.ceil(high) + 1)


def prefill_band(rate: float, prompt_len: float, c: PlannerConfig) -> range:
    """The right answer: prompt tokens/s over a pod's true rate, at the M/D/1 bound for the TTFT target."""
    service, target = prompt_len / PREFILL_TOKENS_PER_S, c.ttft_target_s
    utilization = min(c.target_utilization, (target - service) / (target + service))
    return band(rate * prompt_len / PREFILL_TOKENS_PER_S, utilization, c)


def decode_band(rate: float, output_len: float, c: PlannerConfig) -> range:
    """The right answer: requests decoding at once at the TPOT target over the true batch that meets it."""
    batch = math.floor((c.tpot_target_s - STEP_BASE_S) / STEP_PER_SEQ_S)
    return band(rate * output_len * c.tpot_target_s / batch, c.target_utilization, c)


def test_steady_load_settles_and_stays():
    c = config()
    cluster = SimulatedCluster()
    history = run(Planner(c, started_at=0.0), cluster, lambda t: (2.0, 500, 200), ticks=60)
    settled = history[-1]
    # prefill: 1000 prompt tokens/s at 400 per pod; a 500-token prompt takes 1.25 s, so the M/D/1 bound for a
    # 2 s TTFT p99 is (2 - 1.25) / (2 + 1.25), lower than target_utilization
    assert settled["prefill"] in prefill_band(2.0, 500, c)
    assert settled["decode"] in decode_band(2.0, 200, c)
    assert all(h == settled for h in history[-30:])  # half an hour without a change: no flapping
    assert changes(history, "prefill") + changes(history, "decode") <= 6


def test_ramp_only_grows_and_ends_sized():
    c = config()
    cluster = SimulatedCluster()
    history = run(Planner(c, started_at=0.0), cluster, lambda t: (0.5 + 4.5 * min(1.0, t / 1800), 400, 150),
                  ticks=80)
    for pool in ("prefill", "decode"):
        counts = [h[pool] for h in history]
        assert counts == sorted(counts), f"{pool} shrank during a ramp: {counts}"
    assert history[-1]["prefill"] in prefill_band(5.0, 400, c)
    assert history[-1]["decode"] in decode_band(5.0, 150, c)


def test_spike_scales_up_quickly_and_down_slowly():
    c = config()
    cluster = SimulatedCluster()
    spike = (900.0, 1080.0)  # three minutes at 4x
    load = lambda t: (8.0 if spike[0] <= t < spike[1] else 2.0, 500, 200)  # noqa: E731
    planner = Planner(c, started_at=0.0)
    history = run(planner, cluster, load, ticks=120)
    before = history[int(spike[0] / TICK_S) - 2]
    during = history[int(spike[1] / TICK_S) - 1]
    assert during["prefill"] > before["prefill"] and during["decode"] > before["decode"]
    # the pool grew within the spike's first two ticks (the up-cooldown is 60 s)
    first = int(spike[0] / TICK_S)
    assert history[first + 1]["prefill"] > before["prefill"]
    # shrinking: one pod at a time, at least scale_down_cooldown_s apart, back to the steady size
    after = [h["prefill"] for h in history[int(spike[1] / TICK_S):]]
    steps = [a - b for a, b in zip(after, after[1:]) if a != b]
    assert steps and all(step == 1 for step in steps)
    assert after[-1] in prefill_band(2.0, 500, c) and before["prefill"] in prefill_band(2.0, 500, c)
    down_ticks = [i for i, (a, b) in enumerate(zip(after, after[1:])) if b < a]
    assert all(b - a >= c.scale_down_cooldown_s / TICK_S for a, b in zip(down_ticks, down_ticks[1:]))


def test_prefill_heavy_load_gets_more_prefill_than_decode_pods():
    cluster = SimulatedCluster()
    history = run(Planner(config(), started_at=0.0), cluster, lambda t: (3.0, 2000, 20), ticks=40)
    assert history[-1]["prefill"] >= 3 * history[-1]["decode"]


def test_decode_heavy_load_gets_more_decode_than_prefill_pods():
    cluster = SimulatedCluster()
    history = run(Planner(config(), started_at=0.0), cluster, lambda t: (6.0, 50, 800), ticks=40)
    assert history[-1]["decode"] >= 3 * history[-1]["prefill"]


def test_the_planner_learns_capacities_it_was_not_told():
    c = config()
    planner = Planner(c, started_at=0.0)
    varying = lambda t: (1.0 + (t // 300) % 3, 500, 200)  # noqa: E731 - 1, 2, 3 requests/s, 5 minutes each
    run(planner, SimulatedCluster(prefill=2, decode=2), varying, ticks=40)
    assert planner.prefill_capacity.tokens_per_s == pytest.approx(PREFILL_TOKENS_PER_S, rel=0.01)
    base, slope = planner.decode_capacity.step_line()
    assert base + slope * 10 == pytest.approx(STEP_BASE_S + STEP_PER_SEQ_S * 10, rel=0.05)


# ---- the rules one at a time ----------------------------------------------------------------------------------

def test_bounds_are_enforced_at_once_even_in_cooldown():
    sizer = PoolSizer("decode", low=2, high=5, up_cooldown_s=60, down_cooldown_s=300, max_down_step=1,
                      started_at=100.0)
    assert sizer.decide(current=0, need_up=0.0, need_down=0.0, slo_miss=False, now=101.0) == (2, "bounds")
    assert sizer.decide(current=9, need_up=9.0, need_down=9.0, slo_miss=False, now=102.0) == (5, "bounds")
    assert sizer.decide(current=5, need_up=12.0, need_down=12.0, slo_miss=False, now=1000.0) == (5, "bounds")


def test_hysteresis_holds_between_the_two_utilizations():
    c = config(scale_down_cooldown_s=0, scale_up_cooldown_s=0, prefill_tokens_per_s_per_pod=PREFILL_TOKENS_PER_S)
    planner = Planner(c, started_at=0.0)
    cluster = SimulatedCluster(prefill=3, decode=3)
    # 500 prompt tokens/s: 2 pods would do at 0.7 (560), not at the hysteresis' 0.55 (440), so 3 stay 3
    for t in range(1, 30):
        prefill = next(d for d in planner.plan(cluster.signals(5.0, 100, 50), all_ready(**cluster.replicas),
                                               t * TICK_S) if d.pool == "prefill")
        assert (prefill.desired, prefill.reason, math.ceil(prefill.needed)) == (3, "hold", 2)


def test_cooldown_holds_a_second_scale_up():
    sizer = PoolSizer("prefill", low=1, high=10, up_cooldown_s=60, down_cooldown_s=300, max_down_step=1,
                      started_at=-1000.0)
    assert sizer.decide(2, need_up=4.0, need_down=4.0, slo_miss=False, now=0.0) == (4, "up")
    assert sizer.decide(4, need_up=6.0, need_down=6.0, slo_miss=False, now=30.0) == (4, "cooldown")
    assert sizer.decide(4, need_up=6.0, need_down=6.0, slo_miss=False, now=61.0) == (6, "up")
    assert sizer.decide(6, need_up=1.0, need_down=1.0, slo_miss=False, now=200.0) == (6, "cooldown")
    assert sizer.decide(6, need_up=1.0, need_down=1.0, slo_miss=False, now=362.0) == (5, "down")


def test_an_slo_miss_adds_a_pod_and_blocks_shrinking():
    sizer = PoolSizer("decode", low=1, high=10, up_cooldown_s=0, down_cooldown_s=0, max_down_step=1,
                      started_at=-1000.0)
    assert sizer.decide(3, need_up=1.0, need_down=1.0, slo_miss=True, now=0.0) == (4, "slo")
    assert sizer.decide(4, need_up=1.0, need_down=1.0, slo_miss=False, now=1.0) == (3, "down")


def test_tpot_p99_over_target_grows_decode_even_when_the_model_says_enough():
    c = config(scale_up_cooldown_s=0)
    planner = Planner(c, started_at=0.0)
    signals = SimulatedCluster(prefill=1, decode=4).signals(0.2, 100, 100)
    decisions = {d.pool: d for d in planner.plan(replace(signals, tpot_p99_s=0.2), all_ready(prefill=1, decode=4),
                                                 1.0)}
    assert decisions["decode"].needed < 4 and (decisions["decode"].desired, decisions["decode"].reason) == (5, "slo")


def test_no_router_series_changes_nothing():
    signals = replace(SimulatedCluster().signals(1.0, 100, 100), requests_per_s=math.nan)
    decisions = Planner(config(), started_at=-1e6).plan(signals, all_ready(prefill=7, decode=3), 0.0)
    assert [(d.desired, d.reason) for d in decisions] == [(7, "no-data"), (3, "no-data")]


def test_no_traffic_shrinks_to_the_minimum_one_pod_at_a_time():
    c = config(min_prefill_replicas=1, min_decode_replicas=2, scale_down_cooldown_s=0)
    cluster = SimulatedCluster(prefill=4, decode=5)
    history = run(Planner(c, started_at=0.0), cluster, lambda t: (0.0, 100, 100), ticks=10)
    assert [h["decode"] for h in history[:4]] == [4, 3, 2, 2]
    assert history[-1] == {"prefill": 1, "decode": 2}


def test_mdl1_utilization_meets_the_target_exactly():
    service, target = 0.5, 2.0
    rho = mdl1_max_utilization(service, target)
    assert service + 4 * rho * service / (2 * (1 - rho)) == pytest.approx(target)
    assert mdl1_max_utilization(3.0, 2.0) == 0.1  # a prompt alone exceeds the target: the floor


def test_decode_line_fit_needs_spread_and_anchors_the_prior_until_then():
    capacity = DecodeCapacity(prior_base_s=0.05, prior_slope_s=0.002)
    assert capacity.step_line() == (0.05, 0.002)
    base_signals = SimulatedCluster().signals(1.0, 100, 100)
    capacity.observe(replace(base_signals, decode_pods=1, decode_running=10, decode_step_s=0.05))
    assert capacity.step_line() == pytest.approx((0.03, 0.002))  # prior slope through the measurement
    for batch in (5, 15, 25):
        capacity.observe(replace(base_signals, decode_pods=1, decode_running=batch, decode_step_s=0.01 + 0.003 * batch))
    assert capacity.step_line() != pytest.approx((0.01, 0.003))  # the first point (10, 0.05) is off the line
    capacity.samples.popleft()
    assert capacity.step_line() == pytest.approx((0.01, 0.003))
    assert capacity.batch_within(0.1, max_batch=64) == 30
    assert capacity.batch_within(0.1, max_batch=16) == 16


def test_prefill_capacity_ignores_idle_windows():
    capacity = PrefillCapacity(prior_tokens_per_s=200.0)
    idle = replace(SimulatedCluster().signals(0.0, 100, 100), prefill_busy=0.01, prefill_tokens_per_s=50.0)
    capacity.observe(idle)
    assert (capacity.tokens_per_s, capacity.measured) == (200.0, False)


# ---- a cluster that takes time: pods start slowly, metrics lag ------------------------------------------------

STARTUP_S, LAG_S = 90.0, 60.0  # a pod loads its model for a minute and a half; rates and p99s trail by a minute


@pytest.mark.parametrize("ramp_s", [300.0, 1800.0])
def test_a_ramp_with_slow_starts_and_lagging_metrics_never_overshoots(ramp_s):
    """At most one pod above where the pool settles: pods that are starting count as capacity, and lagging
    signals (the p99 of the smaller pool) never add pods for a need already met. The decode profile is the
    truth here (how the line is learnt is another test's), so that what is measured is the timing alone."""
    c = config(decode_step_base_s=STEP_BASE_S, decode_step_per_seq_s=STEP_PER_SEQ_S)
    cluster = SimulatedCluster(startup_s=STARTUP_S, lag_s=LAG_S)
    ramp = lambda t: (0.5 + 5.5 * min(1.0, max(t, 0) / ramp_s), 400, 150)  # noqa: E731 - up, then flat
    history = run(Planner(c, started_at=0.0), cluster, ramp, ticks=140)
    settled = history[-1]
    assert all(h == settled for h in history[-30:]), "not settled after the ramp"
    for pool in ("prefill", "decode"):
        counts = [h[pool] for h in history]
        assert max(counts) <= settled[pool] + 1, f"{pool} overshot: {counts}"
        assert counts[:60] == sorted(counts[:60]), f"{pool} shrank during the ramp: {counts}"
    assert settled["prefill"] in prefill_band(6.0, 400, c) and settled["decode"] in decode_band(6.0, 150, c)


def test_an_unserviceable_ttft_target_does_not_climb_to_the_maximum():
    """A 1200-token prompt prefills in 3 s on a pod: a 2 s TTFT target is out of reach whatever the pool, so the
    pool is sized for its load, not grown pod after pod on a p99 no pod count can fix."""
    c = config(max_prefill_replicas=20)
    cluster = SimulatedCluster(startup_s=STARTUP_S, lag_s=LAG_S)
    planner = Planner(c, started_at=0.0)
    history = run(planner, cluster, lambda t: (1.0, 1200, 50), ticks=80)
    counts = [h["prefill"] for h in history]
    busy = 1.0 * 1200 / PREFILL_TOKENS_PER_S  # 3 pods' worth of prefill
    assert max(counts) <= math.ceil(busy / c.target_utilization) + 1, counts
    assert planner.unserviceable


def test_a_pool_with_pods_starting_holds_and_grows_again_only_on_fresh_metrics():
    sizer = PoolSizer("prefill", low=1, high=10, up_cooldown_s=0, down_cooldown_s=300, max_down_step=1,
                      started_at=-1000.0, settle_s=120.0)
    assert sizer.decide(2, need_up=4.0, need_down=4.0, slo_miss=False, now=0.0, ready=2) == (4, "up")
    # two pods starting: the need (still measured on the old pool) asks for more, the planner waits
    assert sizer.decide(4, need_up=6.0, need_down=6.0, slo_miss=True, now=30.0, ready=2) == (4, "starting")
    assert sizer.decide(4, need_up=6.0, need_down=6.0, slo_miss=True, now=90.0, ready=4) == (4, "settling")
    assert sizer.decide(4, need_up=6.0, need_down=6.0, slo_miss=True, now=180.0, ready=4) == (4, "settling")
    assert sizer.decide(4, need_up=6.0, need_down=6.0, slo_miss=False, now=210.0, ready=4) == (6, "up")


def test_prefill_demand_is_the_share_of_prompt_tokens_prefilled_on_prefill_pods():
    """A few long prompts go to prefill pods, many short ones prefill on decode pods: by requests the share
    would be small, by tokens it is most of the work."""
    c = config(scale_up_cooldown_s=0, prefill_tokens_per_s_per_pod=PREFILL_TOKENS_PER_S)
    signals = replace(SimulatedCluster(prefill=1, decode=1).signals(10.0, 180, 50),
                      prefill_tokens_per_s=1500.0, decode_prefill_tokens_per_s=300.0)
    prefill = Planner(c, started_at=-1e6).plan(signals, all_ready(prefill=1, decode=1), 0.0)[0]
    assert prefill.demand == pytest.approx(1800.0 * 1500 / 1800)

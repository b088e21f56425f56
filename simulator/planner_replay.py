"""``splitserve simulate planner``: the planner's own decisions (``splitserve.deploy.planner.capacity.Planner``)
replayed on a day-shaped rate curve, against static provisioning at the peak: SLO attainment and pod-hours.

    splitserve simulate planner [--peak-rate 2] [--day-s 3600] [--startup-s 60] [--lag-s 30] [--json F --plot F]

The day: a Poisson process whose rate follows ``trough + (peak - trough) * (1 - cos(2 pi t / day)) / 2`` (night,
noon peak, night), the conversation trace's lengths. Every ``interval_s`` the planner reads ``Signals`` computed
from the simulation as its Prometheus queries compute them, over ``window_s`` ending ``lag_s`` ago (scrape and
rule-evaluation delay), and decides both pools; a pod it adds serves ``startup_s`` later (image pull, model load:
it counts in pod-hours from the decision), a pod it removes stops taking requests at once and leaves when its
requests are done. The static baseline runs the same day on the most pods of each pool the planner ever asked for.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field

from splitserve.deploy.planner.capacity import Planner, Replicas, Signals
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.measure.phase_profile import PhaseProfile
from splitserve.measure.figures import headless_pyplot, save_figure, save_results
from splitserve.measure.serve_metrics import SLO, RequestRecord, percentile
from splitserve.measure.workload import AZURE_CONV, RequestSpec, WorkloadConfig, build_workload
from splitserve.runtime.config import described, parse_config
from splitserve.runtime.roles import Role
from splitserve.simulator.cluster import PodPool, SimCluster
from splitserve.simulator.planner_check import SimulatedCheck
from splitserve.simulator.run import DEFAULT_PROFILE, SimulateConfig
from splitserve.simulator.sim_pod import SimPod

POOL_ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE}


@dataclass
class PlannerReplayConfig:
    """The planner on a simulated day, against static provisioning at the peak."""

    peak_rate: float = field(default=2.0, metadata=described("Requests/s at the day's peak."))
    trough_rate: float = field(default=0.25, metadata=described("Requests/s at night."))
    day_s: float = field(default=3600.0, metadata=described("Length of the simulated day (seconds; compressed)."))
    startup_s: float = field(default=60.0, metadata=described("A new pod's start-up delay before it serves."))
    lag_s: float = field(default=30.0, metadata=described("Age of the newest metrics the planner sees."))
    interval_s: float = field(default=30.0, metadata=described("Seconds between the planner's decisions."))
    window_s: int = field(default=120, metadata=described("The planner's metrics window (seconds)."))
    ttft_ms: float = field(default=5000.0, metadata=described("TTFT target (the planner's and the attainment's)."))
    tpot_ms: float = field(default=100.0, metadata=described("TPOT target."))
    max_replicas: int = field(default=64, metadata=described("Most pods per pool."))
    max_prompt_tokens: int = field(default=4096, metadata=described("Cap every prompt."))
    max_output_tokens: int = field(default=1000, metadata=described("Cap every output."))
    profile: str = field(default=str(DEFAULT_PROFILE), metadata=described("Profile of every pod."))
    seed: int = field(default=0, metadata=described("Seeds arrivals and lengths."))
    simulate_check: bool = field(default=False, metadata=described(
        "The planner checks each decision in simulation first, as with python -m splitserve.simulator.planner_check."))
    json: str = field(default="", metadata=described("Also write the figures to this JSON file."))
    plot: str = field(default="", metadata=described("Also draw rate, pods and attainment over the day here."))

    def rate_at(self, t: float) -> float:
        return self.trough_rate + (self.peak_rate - self.trough_rate) * (1 - math.cos(2 * math.pi * t / self.day_s)) / 2


def day_workload(config: PlannerReplayConfig) -> list[RequestSpec]:
    """Arrivals of the day (a Poisson process thinned to the curve), lengths from the conversation trace in order."""
    rng = random.Random(f"{config.seed}-day")
    times, t = [], 0.0
    while True:
        t += rng.expovariate(config.peak_rate)
        if t >= config.day_s:
            break
        if rng.random() < config.rate_at(t) / config.peak_rate:
            times.append(t)
    lengths = build_workload(WorkloadConfig(workload=str(AZURE_CONV), num_prompts=len(times), request_rate=1.0,
                                            max_prompt_tokens=config.max_prompt_tokens,
                                            max_output_tokens=config.max_output_tokens, seed=config.seed))
    return [RequestSpec(i, at, spec.prompt_len, spec.output_len) for i, (at, spec) in enumerate(zip(times, lengths))]


class ReplayedDay:
    """A cluster whose pools a planner resizes (``planner`` None: fixed), with its pod-seconds counted."""

    def __init__(self, config: PlannerReplayConfig, pods: dict[str, int], planner: Planner | None,
                 check: SimulatedCheck | None = None):
        self.config, self.planner, self.check = config, planner, check
        sim = SimulateConfig(pools=[f"{pool}:{n}" for pool, n in pods.items()], profile=config.profile,
                             max_prompt_tokens=config.max_prompt_tokens, max_output_tokens=config.max_output_tokens,
                             rates=[1.0])
        self.cluster: SimCluster = sim.cluster()
        self.profile = self.cluster.spec.pools[0].profile
        self.desired = dict(pods)
        self.starting = {pool: 0 for pool in pods}
        self.pod_seconds = 0.0
        self.counted_at = 0.0
        self.timeline: list[dict] = []
        self.records: list[RequestRecord] = []
        self._busy_seen: dict[str, float] = {}

    def run(self, specs: list[RequestSpec]) -> list[RequestRecord]:
        if self.planner is not None:
            self.cluster.loop.at(self.config.interval_s, self._decide)
        self.records = self.cluster.run(specs, until=self.config.day_s + 600.0)
        self._count_pods()
        return self.records

    def _count_pods(self) -> None:
        now = self.cluster.loop.now
        alive = len(self.cluster.pods) + sum(self.starting.values())
        self.pod_seconds += alive * (now - self.counted_at)
        self.counted_at = now

    def _decide(self) -> None:
        loop, config = self.cluster.loop, self.config
        self._count_pods()
        self._reap()
        signals = self.signals(loop.now - config.lag_s)
        current = {pool: Replicas(self.desired[pool], self._serving(pool)) for pool in POOL_ROLES}
        decisions = self.planner.plan(signals, current, loop.now)
        for decision in self.check(signals, decisions) if self.check else decisions:
            self._apply(decision.pool, decision.desired)
        self.timeline.append({"t": loop.now, "rate": config.rate_at(loop.now),
                              **{pool: self._serving(pool) for pool in POOL_ROLES}})
        if loop.now < config.day_s:
            loop.after(config.interval_s, self._decide)

    def _serving(self, pool: str) -> int:
        return sum(1 for pod in self.cluster.pods if pod.role is POOL_ROLES[pool] and pod.info.serving)

    def _apply(self, pool: str, desired: int) -> None:
        change = desired - self.desired[pool]
        self.desired[pool] = desired
        if change > 0:
            self.starting[pool] += change
            for _ in range(change):
                self.cluster.loop.after(self.config.startup_s, self._started, pool)
        for _ in range(-change):
            candidates = [p for p in self.cluster.pods if p.role is POOL_ROLES[pool] and p.info.serving]
            if len(candidates) > 1:
                self.cluster.drain(min(candidates, key=lambda p: p.info.busy))

    def _started(self, pool: str) -> None:
        self._count_pods()
        self.starting[pool] -= 1
        self.cluster.add_pod(PodPool(POOL_ROLES[pool], 1, self.profile))

    def _reap(self) -> None:
        """Drained pods with nothing left leave (their pod-seconds stop)."""
        for pod in [p for p in self.cluster.pods if not p.info.serving and not p.scheduler.has_unfinished()
                    and not p.stepping and not p.info.active_requests]:
            self.cluster.remove(pod)

    # ---- what Prometheus would say --------------------------------------------------------------------------

    def signals(self, end: float) -> Signals:
        """Each series as its metric is observed: TTFT and prompt tokens at the first token (the router's
        histogram and counter; the prefill pods' queue time at the same moment), TPOT and successes at the end."""
        start, seconds = end - self.config.window_s, self.config.window_s
        records = self.cluster.records
        finished = [r for r in records if r.status == "ok" and start <= r.end_s < end]
        first = [r for r in records if r.chunk_s and start <= r.chunk_s[0] < end]
        prompt = sum(r.prompt_len for r in first) / seconds
        decode = [p for p in self.cluster.pods if p.role is Role.DECODE]
        prefill = [p for p in self.cluster.pods if p.role is Role.PREFILL]
        ttfts = [r.chunk_s[0] - r.sent_s for r in first]
        tpots = [r.tpot for r in finished if r.tpot is not None]
        waits = [r.chunk_s[0] - r.sent_s - self.profile.prefill_s(r.prompt_len, r.prompt_len ** 2) for r in first]
        return Signals(
            requests_per_s=len(finished) / seconds, prompt_tokens_per_s=prompt,
            output_tokens_per_s=sum(r.output_tokens or 0 for r in finished) / seconds,
            prefill_tokens_per_s=prompt, decode_prefill_tokens_per_s=0.0,
            prefill_busy=self._busy_share(prefill),
            prefill_queue_p99_s=percentile(waits, 99) if waits else math.nan,
            decode_pods=float(len(decode)), decode_running=float(sum(p.scheduler.num_running for p in decode)),
            decode_waiting=float(sum(p.scheduler.num_waiting for p in decode)),
            decode_step_s=sum(tpots) / len(tpots) if tpots else math.nan,
            kv_usage_max=max((p.block_manager.usage for p in decode), default=0.0),
            ttft_p99_s=percentile(ttfts, 99) if ttfts else math.nan,
            tpot_p99_s=percentile(tpots, 99) if tpots else math.nan)

    def _busy_share(self, pods: list[SimPod]) -> float:
        """Prefill pods busy at once over the last interval (the rate of their busy seconds)."""
        busy = 0.0
        for pod in pods:
            busy += pod.busy_s - self._busy_seen.get(pod.name, pod.busy_s)
            self._busy_seen[pod.name] = pod.busy_s
        return busy / self.config.interval_s


def run(config: PlannerReplayConfig, log=print) -> dict:
    specs = day_workload(config)
    slo = SLO(ttft=config.ttft_ms / 1e3, tpot=config.tpot_ms / 1e3)
    profile = PhaseProfile.load(config.profile)
    ranks = profile.tensor_parallel_size
    planner_config = PlannerConfig(  # its capacity priors: the profile's (PlannerConfig.with_profile_priors)
        ttft_target_s=slo.ttft, tpot_target_s=slo.tpot, interval_s=config.interval_s, window_s=config.window_s,
        max_prefill_replicas=config.max_replicas, max_decode_replicas=config.max_replicas,
        prefill_tensor_parallel_size=ranks, decode_tensor_parallel_size=ranks, prefill_profile=config.profile,
        decode_profile=config.profile)
    started = time.perf_counter()
    check = SimulatedCheck(dataclasses.replace(planner_config, simulate_profile=config.profile)) \
        if config.simulate_check else None
    planned = ReplayedDay(config, {"prefill": 1, "decode": 1}, Planner(planner_config, started_at=0.0), check)
    planned.run(specs)
    peak = {pool: max(row[pool] for row in planned.timeline) for pool in POOL_ROLES}
    static = ReplayedDay(config, peak, None)
    static.run(specs)
    out = {"requests": len(specs), "slo": slo.describe(), "peak_pods": peak, "timeline": planned.timeline,
           "simulate_check": config.simulate_check}
    for name, day in (("planner", planned), ("static-at-peak", static)):
        out[name] = {"attainment": slo.attained_by(day.records), "pod_hours": day.pod_seconds / 3600,
                     "cpu_hours": day.pod_seconds / 3600 * profile.pod_cpus}  # a pod: the profile's CPUs
        log(f"{name:<15} SLO attainment {out[name]['attainment']:.1%}, pod-hours {out[name]['pod_hours']:.1f} "
            f"(CPU-hours {out[name]['cpu_hours']:.1f}: {profile.pod_cpus} CPUs a pod, TP {ranks})")
    log(f"{len(specs)} requests over a {config.day_s:g} s day; static pools: {peak}; "
        f"{time.perf_counter() - started:.0f} s of simulation")
    return out


def plot(out: dict, path: str) -> None:
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    t = [row["t"] / 60 for row in out["timeline"]]
    ax.plot(t, [row["prefill"] for row in out["timeline"]], label="prefill pods serving (planner)")
    ax.plot(t, [row["decode"] for row in out["timeline"]], label="decode pods serving (planner)")
    for pool, n in out["peak_pods"].items():
        ax.axhline(n, linestyle=":", color="gray")
    rate_ax = ax.twinx()
    rate_ax.plot(t, [row["rate"] for row in out["timeline"]], "k--", label="request rate")
    rate_ax.set(ylabel="requests/s")
    ax.set(xlabel="minutes into the (compressed) day", ylabel="pods",
           title=f"planner{' checked in simulation' if out.get('simulate_check') else ''}: "
                 f"{out['planner']['attainment']:.0%} SLO met, {out['planner']['pod_hours']:.1f} pod-h; "
                 f"static at peak: {out['static-at-peak']['attainment']:.0%}, "
                 f"{out['static-at-peak']['pod_hours']:.1f} pod-h (simulated)")
    ax.legend(loc="upper left", fontsize=8)
    rate_ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(PlannerReplayConfig, argv, prog="splitserve simulate planner")
    out = run(config)
    save_results(out, config.json, config.plot, plot)
    return out

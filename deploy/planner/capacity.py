"""The planner's decisions, without I/O: how many prefill and how many decode pods the measured load needs.

Each pool is sized for its own bottleneck, as in Splitwise (Patel et al., ISCA 2024) and DistServe (OSDI 2024):

prefill  demand: prompt tokens/s that go to prefill pods: the router's prompt tokens x the share of prompt tokens
         prefilled on prefill pods (the rest prefill on decode pods: short or cached prompts).
         capacity: prompt tokens/s one busy pod processes, measured (tokens processed / mean prefills in progress)
         and smoothed; the profile's figure until there is a measurement. A pod is loaded only as far as an M/D/1
         queue (DistServe's prefill model) keeps the TTFT p99 under the target: with service time D (a mean
         prompt on an idle pod), mean wait W = rho D / (2(1 - rho)), and the planning assumption that the p99
         wait is about 4 W, D + 4W <= T gives utilization <= (T - D) / (T + D); never above target_utilization.
         A target no pool can meet (the mean prompt's prefill alone exceeds it) is reported, and sized at
         target_utilization: more pods do not shorten one prompt's prefill.
decode   demand: requests decoding at once if every one ran at the TPOT target (output tokens/s x TPOT target, by
         Little's law), or the requests running and waiting now, whichever is larger.
         capacity: the batch one pod runs within the TPOT target. The step time grows with the batch,
         TPOT(B) = base + slope * B; the line is fitted on measured (batch, step time) pairs once they spread, and
         until then the profile's slope is anchored to the latest measurement. The batch is also capped by the
         pods' max_num_seqs and by what their KV caches hold.

Capacities are per pod, of the pods' size: a pool's profile (``prefill_profile``, ``decode_profile``) must have been
measured at its pods' tensor parallel size. ``PoolSizer`` turns a pool's need (in pods, fractional) into a replica
count: bounds first (``max_*_replicas``, and a rank budget ``max_*_ranks`` over each pod's ranks), then hysteresis (it
grows as soon as the need exceeds the pool, but shrinks only when the smaller pool would still run under
target_utilization - hysteresis, in proportion when the queueing model planned lower), then cooldowns since the
pool's last change. It is readiness-aware: while a pool has pods not ready (a previous decision starting) it holds
("starting"), and after they are ready it grows again only once the metrics window covers the new pool
("settling"), so that lagging rates and percentiles never add pods twice for one need. A measured SLO miss (TTFT
p99 with the prefill queue the larger part of it; TPOT p99; KV cache nearly full) adds a pod and blocks shrinking,
which covers whatever the model got wrong.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from splitserve.deploy.planner.config import PlannerConfig

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Signals:
    """The cluster over the planner's window: rates per second, percentiles in seconds; NaN where no series."""

    requests_per_s: float  # finished at the router
    prompt_tokens_per_s: float  # at the router
    output_tokens_per_s: float  # at the router
    prefill_tokens_per_s: float  # prompt tokens processed by prefill pods
    decode_prefill_tokens_per_s: float  # prompt tokens prefilled on decode pods (short or cached prompts)
    prefill_busy: float  # prefills in progress at once, summed over prefill pods (rate of the prefill time's sum)
    prefill_queue_p99_s: float
    decode_pods: float  # decode pods reporting
    decode_running: float  # summed over decode pods, averaged over the window
    decode_waiting: float
    decode_step_s: float  # mean inter-token latency on decode pods: one engine step
    kv_usage_max: float  # of the fullest decode pod, 0..1
    ttft_p99_s: float
    tpot_p99_s: float


@dataclass(frozen=True)
class PoolDecision:
    """What the planner decided for one pool, and why (exported as metrics, logged)."""

    pool: str
    current: int
    desired: int
    needed: float  # pods the model says the load needs, before bounds, hysteresis and cooldowns
    demand: float  # prefill: prompt tokens/s; decode: requests decoding at once
    capacity: float  # per pod, same unit as demand
    reason: str  # up | down | hold | cooldown | bounds | slo | starting | settling | no-data | simulated (the check)


@dataclass(frozen=True)
class Replicas:
    """A pool's Deployment: the replicas it asks for and those ready (the rest are starting: pending capacity)."""

    desired: int
    ready: int


def _finite(x: float) -> bool:
    return x is not None and math.isfinite(x)


class PrefillCapacity:
    """Prompt tokens/s one busy prefill pod processes: the profile's figure, then a moving average of measurements.

    A measurement divides the tokens prefilled by the prefills in progress (Little's law over the prefill time);
    prompts batched into one step each count as busy, so batching makes it an underestimate: the safe side."""

    def __init__(self, prior_tokens_per_s: float, smoothing: float = 0.3, min_busy: float = 0.05):
        self.tokens_per_s = prior_tokens_per_s
        self.smoothing, self.min_busy = smoothing, min_busy
        self.measured = False

    def observe(self, signals: Signals) -> None:
        busy, tokens = signals.prefill_busy, signals.prefill_tokens_per_s
        if _finite(busy) and _finite(tokens) and busy >= self.min_busy and tokens > 0:
            sample = tokens / busy
            self.tokens_per_s = sample if not self.measured else (
                self.smoothing * sample + (1 - self.smoothing) * self.tokens_per_s)
            self.measured = True


P99_WAIT_OVER_MEAN = 4.0  # planning assumption: an M/D/1 queue's p99 wait over its mean wait, at moderate load


def mdl1_max_utilization(service_s: float, target_s: float, floor: float = 0.1) -> float:
    """Highest utilization at which an M/D/1 queue keeps D + P99_WAIT_OVER_MEAN * rho*D / (2(1 - rho)) <= target.

    When one request alone takes longer than the target no pool meets it; ``floor`` then keeps queues short."""
    if service_s <= 0:
        return 1.0
    if service_s >= target_s:
        return floor
    slack = target_s - service_s
    return max(floor, 2 * slack / (2 * slack + P99_WAIT_OVER_MEAN * service_s))


class DecodeCapacity:
    """The decode step time as a line in the batch size, TPOT(B) = base + slope * B, from measurements."""

    def __init__(self, prior_base_s: float, prior_slope_s: float, max_samples: int = 30, min_spread: float = 2.0):
        self.prior = (prior_base_s, prior_slope_s)
        self.samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (batch per pod, step seconds)
        self.min_spread = min_spread

    def observe(self, signals: Signals) -> None:
        pods, running, step = signals.decode_pods, signals.decode_running, signals.decode_step_s
        if _finite(pods) and pods > 0 and _finite(running) and _finite(step) and step > 0 and running / pods >= 1:
            self.samples.append((running / pods, step))

    def step_line(self) -> tuple[float, float]:
        """(base seconds, seconds per running request)."""
        base, slope = self.prior
        if len(self.samples) >= 3:
            batches = [b for b, _ in self.samples]
            if max(batches) - min(batches) >= self.min_spread:
                fitted = _least_squares(self.samples)
                if fitted is not None and fitted[0] >= 0 and fitted[1] > 0:
                    return fitted
        if self.samples:  # the profile's slope through the latest measurement
            batch, step = self.samples[-1]
            return max(0.0, step - slope * batch), slope
        return base, slope

    def batch_within(self, tpot_target_s: float, max_batch: int) -> float:
        """Requests one pod can run at once while a step stays within ``tpot_target_s`` (at least 1)."""
        base, slope = self.step_line()
        return float(min(max_batch, max(1.0, math.floor((tpot_target_s - base) / slope))))


def _least_squares(points) -> tuple[float, float] | None:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return mean_y - slope * mean_x, slope


class PoolSizer:
    """One pool's replica count from its need: bounds, readiness, hysteresis, cooldowns since the pool's last change.

    ``settle_s``: after a change, once every pod is ready, how long the metrics take to describe the new pool (the
    planner's window): no growth before, so that the old pool's lagging signals never ask for pods twice."""

    def __init__(self, pool: str, low: int, high: int, up_cooldown_s: float, down_cooldown_s: float,
                 max_down_step: int, started_at: float, settle_s: float = 0.0):
        self.pool, self.low, self.high = pool, low, high
        self.up_cooldown_s, self.down_cooldown_s, self.max_down_step = up_cooldown_s, down_cooldown_s, max_down_step
        self.last_change = started_at  # a (re)started planner waits a cooldown before it acts on the model
        self.settle_s = settle_s
        self.ready_since: float | None = -math.inf  # when the pool last became wholly ready (None: starting)

    def decide(self, current: int, need_up: float, need_down: float, slo_miss: bool, now: float,
               ready: int | None = None) -> tuple[int, str]:
        """``need_up``: pods at target utilization; ``need_down``: pods at the lower (hysteresis) utilization;
        ``ready``: the pool's ready pods (None: all of them)."""
        if current < self.low or current > self.high:  # out of bounds: fixed at once, whatever the cooldown
            return self._changed(min(self.high, max(self.low, current)), now), "bounds"
        if ready is not None and ready < current:  # a previous decision still starting: its pods are capacity
            self.ready_since = None
            return current, "starting"
        if self.ready_since is None:
            self.ready_since = now
        grow_to = max(math.ceil(need_up - 1e-9), current + 1 if slo_miss else 0)
        shrink_to = max(math.ceil(need_down - 1e-9), current - self.max_down_step)
        if grow_to > current:
            target, reason, cooldown = min(self.high, grow_to), ("slo" if slo_miss else "up"), self.up_cooldown_s
        elif shrink_to < current and not slo_miss:
            target, reason, cooldown = max(self.low, shrink_to), "down", self.down_cooldown_s
        else:
            return current, "hold"
        if target == current:
            return current, "bounds"
        if target > current and now - self.ready_since < self.settle_s:
            return current, "settling"
        if now - self.last_change < cooldown:
            return current, "cooldown"
        return self._changed(target, now), reason

    def _changed(self, target: int, now: float) -> int:
        self.last_change = now
        self.ready_since = None  # the new pods must be ready, then measured
        return target


class Planner:
    """Both pools' decisions from one reading of the signals (stateful: capacities learnt, last changes)."""

    def __init__(self, config: PlannerConfig, started_at: float):
        config = config.with_profile_priors()
        self.config = config
        self.prefill_capacity = PrefillCapacity(config.prefill_tokens_per_s_per_pod)
        self.decode_capacity = DecodeCapacity(config.decode_step_base_s, config.decode_step_per_seq_s)
        c = config
        self.sizers = {
            pool: PoolSizer(pool, getattr(c, f"min_{pool}_replicas"), c.max_pods(pool),
                            c.scale_up_cooldown_s, c.scale_down_cooldown_s, c.max_scale_down_step, started_at,
                            settle_s=c.window_s)
            for pool in POOLS}
        self.unserviceable = False  # the mean prompt's prefill alone exceeds the TTFT target

    def plan(self, signals: Signals, current: dict[str, Replicas], now: float) -> list[PoolDecision]:
        if not _finite(signals.requests_per_s):  # no router series: nothing is known, nothing changes
            return [PoolDecision(pool, current[pool].desired, current[pool].desired, math.nan, math.nan, math.nan,
                                 "no-data") for pool in POOLS]
        self.prefill_capacity.observe(signals)
        self.decode_capacity.observe(signals)
        return [self._prefill(signals, current["prefill"], now), self._decode(signals, current["decode"], now)]

    def _prefill(self, s: Signals, current: Replicas, now: float) -> PoolDecision:
        c = self.config
        demand = _or_zero(s.prompt_tokens_per_s) * _prefill_token_share(s)  # prompt tokens/s for prefill pods
        per_pod = self.prefill_capacity.tokens_per_s
        mean_prompt = _or_zero(s.prompt_tokens_per_s) / s.requests_per_s if s.requests_per_s > 0 else 0.0
        service_s = mean_prompt / per_pod
        self._note_serviceable(service_s < c.ttft_target_s, service_s)
        utilization = c.target_utilization
        if not self.unserviceable:
            utilization = min(utilization, mdl1_max_utilization(service_s, c.ttft_target_s))
        busy_pods = demand / per_pod
        slo_miss = (not self.unserviceable and _finite(s.ttft_p99_s) and s.ttft_p99_s > c.ttft_target_s
                    and _finite(s.prefill_queue_p99_s) and s.prefill_queue_p99_s >= 0.5 * s.ttft_p99_s)
        return self._decide("prefill", current, busy_pods, utilization, slo_miss, demand, per_pod, now)

    def _note_serviceable(self, serviceable: bool, service_s: float) -> None:
        if serviceable == (not self.unserviceable):
            return
        self.unserviceable = not serviceable
        if self.unserviceable:
            logger.warning("the TTFT target %.2f s is out of reach: a mean prompt alone prefills in %.2f s; the "
                           "prefill pool is sized for its load only (more pods would not shorten a prefill)",
                           self.config.ttft_target_s, service_s)
        else:
            logger.info("the TTFT target is within reach again")

    def _decode(self, s: Signals, current: Replicas, now: float) -> PoolDecision:
        c = self.config
        demand = max(_or_zero(s.output_tokens_per_s) * c.tpot_target_s,
                     _or_zero(s.decode_running) + _or_zero(s.decode_waiting))  # requests decoding at once
        per_pod = self.decode_capacity.batch_within(c.tpot_target_s, c.decode_max_batch)
        if _finite(s.kv_usage_max) and s.kv_usage_max > 0.05 and _finite(s.decode_pods) and s.decode_pods > 0:
            running_per_pod = _or_zero(s.decode_running) / s.decode_pods
            if running_per_pod >= 1:  # what the fullest pod's KV cache would hold at this mix of lengths
                per_pod = min(per_pod, max(1.0, running_per_pod / s.kv_usage_max))
        slo_miss = ((_finite(s.tpot_p99_s) and s.tpot_p99_s > c.tpot_target_s)
                    or (_finite(s.kv_usage_max) and s.kv_usage_max > c.kv_usage_high))
        return self._decide("decode", current, demand / per_pod, c.target_utilization, slo_miss, demand, per_pod,
                            now)

    def _decide(self, pool: str, current: Replicas, busy_pods: float, utilization: float, slo_miss: bool,
                demand: float, per_pod: float, now: float) -> PoolDecision:
        c = self.config
        need_up = busy_pods / utilization
        # the hysteresis band, proportional when the queueing model lowered the utilization
        need_down = busy_pods / (utilization * (c.target_utilization - c.hysteresis) / c.target_utilization)
        desired, reason = self.sizers[pool].decide(current.desired, need_up, need_down, slo_miss, now, current.ready)
        return PoolDecision(pool, current.desired, desired, need_up, demand, per_pod, reason)


def _prefill_token_share(s: Signals) -> float:
    """The share of prompt tokens prefilled on prefill pods (1 until both pools report)."""
    on_prefill, on_decode = s.prefill_tokens_per_s, s.decode_prefill_tokens_per_s
    if not (_finite(on_prefill) and _finite(on_decode)) or on_prefill + on_decode <= 0:
        return 1.0
    return on_prefill / (on_prefill + on_decode)


def _or_zero(x: float) -> float:
    return x if _finite(x) else 0.0

"""``PlannerConfig``: the planner's settings, filled by ``parse_config`` from flags (``--max-decode-replicas``) and
``SPLITSERVE_*`` environment variables, like every other splitserve process; the Helm chart maps
``planner.config`` to these flags. Checked in ``__post_init__``, so a bad value stops the planner at start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from splitserve.measure.phase_profile import PhaseProfile

from splitserve.runtime.config import described
from splitserve.runtime.service_level import DEFAULT_TPOT_S, DEFAULT_TTFT_S

DECODE_PRIOR_CONTEXT = 500  # tokens: the context a profile's decode step line is read at for the prior


@dataclass
class PlannerConfig:
    """The splitserve planner: sets the prefill and decode Deployments' replica counts from Prometheus metrics."""

    prometheus_url: str = field(default="http://prometheus:9090", metadata=described(
        "Prometheus server the planner queries (its HTTP API)."))
    namespace: str = field(default="", metadata=described(
        "Namespace of the Deployments (empty: the planner's own, from its service account)."))
    prefill_deployment: str = field(default="", metadata=described("Name of the prefill Deployment it scales."))
    decode_deployment: str = field(default="", metadata=described("Name of the decode Deployment it scales."))
    kubeconfig: str = field(default="", metadata=described(
        "Kubeconfig file (empty: the in-cluster service account, else ~/.kube/config)."))
    model_name: str = field(default="", metadata=described(
        "Only series with this model_name label count (empty: all models)."))
    promql_selector: str = field(default="", metadata=described(
        "Extra label matchers added to every query, e.g. namespace=\"llm\" (empty: none)."))
    interval_s: float = field(default=30.0, metadata=described("Seconds between decisions."))
    window_s: int = field(default=120, metadata=described(
        "Rates and percentiles are taken over this many seconds; after a change, a pool grows again only once "
        "its new pods have been ready this long (the metrics then describe the new pool)."))
    request_timeout_s: float = field(default=10.0, metadata=described(
        "Timeout of every Prometheus query and Kubernetes API call (seconds)."))
    dry_run: bool = field(default=False, metadata=described(
        "Decide and export the decisions as metrics, but scale nothing."))
    min_prefill_replicas: int = field(default=1, metadata=described("Fewest prefill pods."))
    max_prefill_replicas: int = field(default=8, metadata=described("Most prefill pods."))
    min_decode_replicas: int = field(default=1, metadata=described("Fewest decode pods."))
    max_decode_replicas: int = field(default=8, metadata=described("Most decode pods."))
    prefill_tensor_parallel_size: int = field(default=1, metadata=described(
        "Ranks of each prefill pod (the chart's prefill.tensorParallelSize): a prefill pod counts this many against "
        "max_prefill_ranks, and prefill_profile must have been measured at it."))
    decode_tensor_parallel_size: int = field(default=1, metadata=described(
        "Ranks of each decode pod (the chart's decode.tensorParallelSize), as prefill_tensor_parallel_size."))
    prefill_pipeline_parallel_size: int = field(default=1, metadata=described(
        "Pipeline stages of each prefill pod (the chart's prefill.pipelineParallelSize): a pod's ranks are its tensor "
        "parallel size times this (the chart refuses both above 1)."))
    decode_pipeline_parallel_size: int = field(default=1, metadata=described(
        "Pipeline stages of each decode pod (the chart's decode.pipelineParallelSize), as "
        "prefill_pipeline_parallel_size."))
    max_prefill_ranks: int = field(default=0, metadata=described(
        "Most ranks the prefill pool holds, its pods together (a rank: one process on its own cores, the chart's "
        "per-rank resources): at most max_prefill_ranks // prefill_tensor_parallel_size pods (0: "
        "max_prefill_replicas alone bounds the pool)."))
    max_decode_ranks: int = field(default=0, metadata=described(
        "Most ranks the decode pool holds, as max_prefill_ranks."))
    prefill_profile: str = field(default="", metadata=described(
        "Profile of one prefill pod (bench phases --tensor-parallel-size N --profile-out, N its ranks): its prefill "
        "speed is the prior in place of prefill_tokens_per_s_per_pod, and the simulated check's prefill pods run "
        "at it (empty: the flag's figure)."))
    decode_profile: str = field(default="", metadata=described(
        "Profile of one decode pod, as prefill_profile: its decode step line is the prior in place of "
        "decode_step_base_s and decode_step_per_seq_s."))
    ttft_target_s: float = field(default=DEFAULT_TTFT_S, metadata=described(
        "TTFT target: prefill pods are loaded only as far as the queueing model keeps mean TTFT under it; a p99 "
        "over it adds a prefill pod."))
    tpot_target_s: float = field(default=DEFAULT_TPOT_S, metadata=described(
        "TPOT target: decode pods batch only as many requests as keep a step under it; a p99 over it adds a "
        "decode pod."))
    target_utilization: float = field(default=0.7, metadata=described(
        "Fraction of a pod's measured capacity the planner plans to use (headroom for bursts)."))
    hysteresis: float = field(default=0.15, metadata=described(
        "A pool shrinks only when the smaller pool would run under target_utilization minus this."))
    scale_up_cooldown_s: float = field(default=60.0, metadata=described(
        "After a change to a pool, seconds before it grows again."))
    scale_down_cooldown_s: float = field(default=300.0, metadata=described(
        "After a change to a pool, seconds before it shrinks."))
    max_scale_down_step: int = field(default=1, metadata=described("Most pods one decision removes from a pool."))
    prefill_tokens_per_s_per_pod: float = field(default=200.0, metadata=described(
        "Prefill throughput of one busy pod (prompt tokens/s) assumed until measured."))
    decode_step_base_s: float = field(default=0.05, metadata=described(
        "Decode step time at batch 0 (s) assumed until measured: TPOT(batch) = base + per_seq * batch."))
    decode_step_per_seq_s: float = field(default=0.002, metadata=described(
        "Added decode step time per running request (s), the slope of TPOT(batch)."))
    decode_max_batch: int = field(default=64, metadata=described(
        "Most requests one decode pod runs at once (the pods' max_num_seqs)."))
    kv_usage_high: float = field(default=0.9, metadata=described(
        "KV-cache usage of the fullest decode pod above which a decode pod is added."))
    simulate_check: bool = field(default=False, metadata=described(
        "Check every decision in simulation before it applies (run as python -m splitserve.simulator.planner_check, "
        "which the chart does when this is true): a shrink predicted to attain less than simulate_min_attainment, "
        "and less than the pools as they are, is held (docs: deploy/README.md)."))
    simulate_profile: str = field(default="", metadata=described(
        "Profile of a pod for the check (bench phases --profile-out on the pods' machine; empty: the shipped "
        "profile of a default pod, its prefill in the format auto resolves to on the planner's CPU: "
        "simulator/profiles/smollm2-135m-gguf-bf16-1thread.json or -f32prefill-1thread.json)."))
    simulate_requests: int = field(default=200, metadata=described(
        "Requests each check simulates, at the measured rate and mean lengths."))
    simulate_min_attainment: float = field(default=0.9, metadata=described(
        "Share of requests within both targets a shrunk pool must be predicted to keep."))
    host: str = field(default="0.0.0.0", metadata=described("Address of the planner's /metrics endpoint."))
    metrics_port: int = field(default=9400, metadata=described("Port of the planner's /metrics endpoint (0: any)."))

    def __post_init__(self) -> None:
        for pool in ("prefill", "decode"):
            low, high = getattr(self, f"min_{pool}_replicas"), getattr(self, f"max_{pool}_replicas")
            if not 0 <= low <= high:
                raise ValueError(f"need 0 <= min_{pool}_replicas <= max_{pool}_replicas, got {low} and {high}")
            budget = getattr(self, f"max_{pool}_ranks")
            sizes = [getattr(self, f"{pool}_{kind}_parallel_size") for kind in ("tensor", "pipeline")]
            if min(sizes) < 1 or budget < 0:
                raise ValueError(f"need {pool}_tensor_parallel_size and {pool}_pipeline_parallel_size >= 1 and "
                                 f"max_{pool}_ranks >= 0, got {sizes[0]}, {sizes[1]} and {budget}")
            ranks = self.ranks(pool)
            if self.max_pods(pool) < low:
                raise ValueError(f"max_{pool}_ranks {budget} holds {self.max_pods(pool)} pods of {ranks} ranks, "
                                 f"fewer than min_{pool}_replicas {low}")
        for name in ("interval_s", "window_s", "request_timeout_s", "ttft_target_s", "tpot_target_s",
                     "prefill_tokens_per_s_per_pod", "decode_step_base_s", "decode_step_per_seq_s", "decode_max_batch",
                     "max_scale_down_step", "simulate_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.hysteresis < self.target_utilization:
            raise ValueError(f"hysteresis must be in [0, target_utilization), got {self.hysteresis}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "metrics_port"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.simulate_min_attainment <= 1:
            raise ValueError(f"simulate_min_attainment must be in (0, 1], got {self.simulate_min_attainment}")
        if not 0 < self.kv_usage_high <= 1:
            raise ValueError(f"kv_usage_high must be in (0, 1], got {self.kv_usage_high}")

    def ranks(self, pool: str) -> int:
        """The processes, each on its own cores, of one of ``pool``'s pods: tensor ranks times pipeline stages."""
        return getattr(self, f"{pool}_tensor_parallel_size") * getattr(self, f"{pool}_pipeline_parallel_size")

    def max_pods(self, pool: str) -> int:
        """The most pods ``pool`` may reach: its replica bound, and its rank budget over its pods' ranks."""
        replicas, budget = getattr(self, f"max_{pool}_replicas"), getattr(self, f"max_{pool}_ranks")
        return min(replicas, budget // self.ranks(pool)) if budget else replicas

    def pool_profile(self, pool: str) -> PhaseProfile | None:
        """``pool``'s profile, refused unless measured at its pods' tensor parallel size (None: none given)."""
        path = getattr(self, f"{pool}_profile")
        if not path:
            return None
        if getattr(self, f"{pool}_pipeline_parallel_size") > 1:
            raise ValueError(f"{pool}_profile {path}: no profile describes a pipeline-parallel pod yet (bench phases "
                             f"measures tensor parallel sizes only): leave {pool}_profile empty")
        profile, ranks = PhaseProfile.load(path), getattr(self, f"{pool}_tensor_parallel_size")
        if profile.tensor_parallel_size != ranks:
            raise ValueError(f"{pool}_profile {path} was measured at tensor parallel size "
                             f"{profile.tensor_parallel_size}, the {pool} pods run {ranks} ranks: measure it at "
                             f"theirs (bench phases --tensor-parallel-size {ranks} --profile-out)")
        return profile

    def with_profile_priors(self) -> "PlannerConfig":
        """These settings with the capacity priors read off the pools' profiles, where given: a prefill pod's prompt
        tokens/s (its per-token step time; the quadratic and fixed terms make long and short prompts slower), a
        decode pod's step line at a 500-token context (DECODE_PRIOR_CONTEXT)."""
        changes = {}
        if prefill := self.pool_profile("prefill"):
            changes["prefill_tokens_per_s_per_pod"] = 1.0 / prefill.prefill.b
        if decode := self.pool_profile("decode"):
            changes["decode_step_base_s"] = decode.decode.a + decode.step_overhead_s
            changes["decode_step_per_seq_s"] = max(1e-6, decode.decode.c + decode.decode.b * DECODE_PRIOR_CONTEXT)
        return dataclasses.replace(self, **changes) if changes else self

"""``splitserve simulate``: a cluster of pods of given roles, counts and speeds, loaded with ``bench serve``'s seeded
workloads over a sweep of rates, in virtual time; the report is ``bench compare``'s (goodput, TTFT and TPOT per rate).

    splitserve simulate validate --measured compare.json [--calibrate]   (simulator/validate.py)
    splitserve simulate ratios [--pods 8,32,128]                         (simulator/ratios.py)
    splitserve simulate planner [--peak-rate 2 --day-s 3600]             (simulator/planner_replay.py)
    splitserve simulate slo-map [--pods 2,8,32,128]                      (simulator/slo_map.py)
    splitserve simulate [--pools prefill:1,decode:1] [--profile simulator/profiles/....json] [--rates 0.2,0.3] \\
        [--workload PATH|azure-conv|azure-code] [--num-prompts 20] [--goodput ttft:4000 tpot:100] [--json F] \\
        [--scheduling hybrid|disaggregated|colocated]

A pool is ``ROLE:COUNT`` or ``ROLE:COUNT:PROFILE`` (its own profile file: pods of different speeds in one cluster);
``--rates inf`` replays a trace at its own timestamps (``--time-scale``). ``--scheduling`` is ``splitserve up``'s:
``hybrid`` places each prompt by ``HybridPlacement`` and lets the decode pods prefill lent prompts in TPOT-bounded
chunks, both aiming at ``--slo-ttft-s`` / ``--slo-tpot-s`` (by default the ``--goodput`` targets, as ``bench
compare --slo-map`` tells each hybrid its regime's);
``colocated`` makes every prefill and decode pool a pool of mixed pods. The wall time of each run is printed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.engine.config import SchedulerConfig
from splitserve.engine.kernels.cpu_features import prefill_compute_dtype as resolve_prefill_dtype
from splitserve.measure.figures import save_results
from splitserve.measure.phase_profile import PhaseProfile
from splitserve.measure.serve_metrics import SLO, SLO_ATTAINMENT, RequestRecord, summarize
from splitserve.measure.workload import AZURE_CONV, WorkloadConfig, build_workload
from splitserve.router.config import RouterConfig, Scheduling
from splitserve.router.policies import HybridPlacement, LocalPrefill, SLOTargets, make_policy
from splitserve.runtime.config import described, member, parse_config, passed_to
from splitserve.runtime.pod_server import PodConfig
from splitserve.runtime.roles import POD_ROLES, Role
from splitserve.simulator.cluster import DEFAULT_SCHEDULING, ClusterSpec, PodPool, SimCluster

PROFILES = Path(__file__).resolve().parent / "profiles"
# What ``splitserve simulate`` runs by the pods' prefill compute format (PhaseProfile.prefill_compute): SmolLM2-135M
# with the GGUF file's blocks on one pinned thread of this project's AMD EPYC (avx512_bf16, no AMX), the two measured
# back to back (their notes say how): bf16 prefill 1.4-1.7x float32's at 64-2048 tokens, decode the same.
FORMAT_PROFILES = {"float32": PROFILES / "smollm2-135m-gguf-f32prefill-1thread.json",
                   "bfloat16": PROFILES / "smollm2-135m-gguf-bf16-1thread.json"}


def format_profile(prefill_compute_dtype: str) -> Path:
    """The shipped profile of pods started with ``--prefill-compute-dtype prefill_compute_dtype``, resolved on this
    CPU as the pods resolve it (``auto``: bfloat16 where it multiplies bf16 natively, float32 elsewhere)."""
    return FORMAT_PROFILES[resolve_prefill_dtype(prefill_compute_dtype)]


# The studies' profile (ratios, slo-map, planner, validate, the planner's check) where they name none: a default pod's
# (the GGUF file's blocks, prefill in the format ``auto`` resolves to on this CPU), as ``splitserve simulate``'s.
# Their figures in docs/simulator.md say which profile each was simulated on (the older ones: float32's,
# smollm2-135m-1thread.json).
DEFAULT_PROFILE = format_profile("auto")


@dataclass
class SimulateConfig:
    """A simulated cluster (the engine's scheduler and the router's policy on a virtual clock, step times from a
    measured profile) swept over request rates with bench compare's workload; goodput and TTFT/TPOT per rate."""

    pools: list[str] = field(default_factory=lambda: ["prefill:1", "decode:1"], metadata=described(
        "Pod pools ROLE:COUNT[:PROFILE] (roles prefill, decode, mixed; a pool's own profile file)."))
    profile: str = field(default="", metadata=described(
        "Profile file of the pools that name none (bench phases --profile-out; empty: the shipped profile of "
        "--prefill-compute-dtype)."))
    prefill_compute_dtype: str = passed_to(PodConfig, name="prefill_compute_dtype", help=(
        "The pods' prefill compute format, resolved on this CPU as a pod resolves it: picks the shipped profile "
        "(float32 or bfloat16 prefill) where --profile names none."))
    cpus: int = field(default=0, metadata=described(
        "CPU budget the pools must fit: a pod occupies its profile's CPUs (the ranks it was measured at, "
        "--tensor-parallel-size, sharing the CPUs it ran on); a layout over it is refused (0: no budget)."))
    speed: float = field(default=1.0, metadata=described(
        "Scale every profile's compute this many times faster (a what-if projection, not a measurement)."))
    router_s: float = field(default=-1.0, metadata=described(
        "Router overhead per request before its first token, seconds (-1: the default profile's fitted value)."))
    workload: str = field(default=str(AZURE_CONV), metadata=described(
        "An Azure-format CSV trace, or random, azure-conv, azure-code (as bench compare)."))
    num_prompts: int = field(default=20, metadata=described("Requests per rate (a trace: its first N rows)."))
    max_prompt_tokens: int = field(default=512, metadata=described("Cap every prompt length (0: no cap)."))
    max_output_tokens: int = field(default=64, metadata=described("Cap every output length (0: no cap)."))
    time_scale: float = field(default=1.0, metadata=described("--rates inf on a trace: multiply its gaps."))
    seed: int = field(default=0, metadata=described("Seeds the lengths and the arrival times."))
    rates: list[float] = field(default_factory=lambda: [0.2, 0.3, 0.4, 0.5, 0.7], metadata=described(
        "Request rates to sweep (inf: a trace's own timestamps)."))
    goodput: list[str] = field(default_factory=lambda: ["ttft:4000", "tpot:100"], metadata=described(
        "Targets every good request meets, NAME:MS."))
    slo_attainment: float = field(default=SLO_ATTAINMENT, metadata=described(
        "Share of requests that must meet the targets for a rate to count."))
    stop_at_miss: bool = field(default=True, metadata=described("Skip the rates above the first that misses."))
    policy: str = passed_to(RouterConfig, name="policy")
    scheduling: Scheduling = field(default=DEFAULT_SCHEDULING, metadata=described(
        "As splitserve up's: 'hybrid' (each prompt on a prefill pod or lent to its decode pod in TPOT-bounded "
        "chunks, by predicted latency, aiming at --slo-ttft-s / --slo-tpot-s), 'disaggregated' (the pure split) or "
        "'colocated' (the prefill and decode pools become mixed pods)."))
    slo_ttft_s: float = field(default=0.0, metadata=described(
        "The router's TTFT target (hybrid placement's), seconds (0: the --goodput TTFT target)."))
    slo_tpot_s: float = field(default=0.0, metadata=described(
        "The router's TPOT target, which hybrid decode pods keep while they prefill lent prompts, seconds (0: the "
        "--goodput TPOT target)."))
    conditional_prefill_threshold: int = field(default=0, metadata=described(
        "Prompts shorter than this prefill on the decode pod (0: every prompt on a prefill pod, as bench compare's "
        "disaggregated topology)."))
    conditional_prefill_queue_s: float = passed_to(RouterConfig, name="conditional_prefill_queue_s")
    codec_ratio: float = field(default=1.0, metadata=described(
        "Wire bytes over raw bytes of the KV codec (none: 1; int8+zstd about 0.22: docs/PERFORMANCE.md)."))
    link_gbps: float = field(default=0.0, metadata=described(
        "Prefill-to-decode link, GB/s (0: the profile's)."))
    max_num_batched_tokens: int = passed_to(PodConfig, name="max_num_batched_tokens")
    max_num_seqs: int = passed_to(PodConfig, name="max_num_seqs")
    long_prefill_token_threshold: int = passed_to(PodConfig, name="long_prefill_token_threshold")
    kv_cache_memory_bytes: int = passed_to(PodConfig, name="kv_cache_memory_bytes")
    block_size: int = passed_to(PodConfig, name="block_size")
    span_s: float = field(default=2.0, metadata=described(
        "Longest span of steady decode steps simulated at once (0: every step on its own; docs/simulator.md)."))
    json: str = field(default="", metadata=described("Also write the figures to this JSON file."))

    def __post_init__(self) -> None:
        self.scheduling = member(Scheduling, "scheduling", self.scheduling)
        self.profile = self.profile or str(format_profile(self.prefill_compute_dtype))
        self.cluster_spec()
        self.slo()
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"rates must be > 0, got {self.rates}")

    def slo(self) -> SLO:
        return SLO.parse(self.goodput)

    def cluster_spec(self) -> ClusterSpec:
        """The pools with their profiles, and the pods' shared settings."""
        default = self._profile(self.profile)
        pools = []
        for item in self.pools:
            role, _, rest = item.partition(":")
            count, _, path = rest.partition(":")
            if role not in POD_ROLES or not count.isdigit():
                raise ValueError(f"pool {item!r}: expected ROLE:COUNT[:PROFILE], ROLE one of "
                                 f"{', '.join(POD_ROLES)}")
            if int(count):
                role = Role.MIXED if self.scheduling is Scheduling.COLOCATED else Role(role)
                pools.append(PodPool(role, int(count), self._profile(path) if path else default))
        if not any(pool.role.can_decode for pool in pools):
            raise ValueError(f"pools {self.pools}: no decode or mixed pod")
        if self.cpus and sum(pool.cpus for pool in pools) > self.cpus:
            raise ValueError(f"pools {', '.join(pool.describe() for pool in pools)} CPUs: "
                             f"{sum(pool.cpus for pool in pools)} in all, over the --cpus budget {self.cpus}")
        per_block = default.kv_bytes_per_token * self.block_size
        return ClusterSpec(tuple(pools), SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                                                         self.long_prefill_token_threshold),
                           num_blocks=self.kv_cache_memory_bytes // per_block, block_size=self.block_size,
                           codec_ratio=self.codec_ratio, span_s=self.span_s,
                           router_s=default.router_s if self.router_s < 0 else self.router_s,
                           scheduling=self.scheduling, targets=self.targets())

    def targets(self) -> SLOTargets:
        """The router's SLO targets: its own flags, else the --goodput ones, else the router's defaults."""
        slo, defaults = self.slo(), {f.name: f.default for f in dataclasses.fields(RouterConfig)}
        return SLOTargets(self.slo_ttft_s or slo.ttft or defaults["slo_ttft_s"],
                          self.slo_tpot_s or slo.tpot or defaults["slo_tpot_s"])

    def _profile(self, path: str) -> PhaseProfile:
        profile = PhaseProfile.load(path)
        changes = {"link_gbps": self.link_gbps} if self.link_gbps else {}
        return profile.scaled(self.speed, **changes) if self.speed != 1 or changes else profile

    def workload_at(self, rate: float) -> WorkloadConfig:
        return WorkloadConfig(workload=self.workload, num_prompts=self.num_prompts, request_rate=rate,
                              max_prompt_tokens=self.max_prompt_tokens or None,
                              max_output_tokens=self.max_output_tokens or None, time_scale=self.time_scale,
                              seed=self.seed)

    def cluster(self, spec: ClusterSpec | None = None) -> SimCluster:
        local = LocalPrefill(threshold=self.conditional_prefill_threshold,
                             queue_s=self.conditional_prefill_queue_s)
        hybrid = HybridPlacement() if self.scheduling is Scheduling.HYBRID else None
        return SimCluster(spec or self.cluster_spec(), make_policy(self.policy, local, seed=self.seed, hybrid=hybrid))


def simulate_records(config: SimulateConfig, rate: float, spec: ClusterSpec | None = None,
                     cluster: SimCluster | None = None) -> list[RequestRecord]:
    """One run at ``rate``: bench serve's records of the simulated requests."""
    specs = build_workload(config.workload_at(rate))
    cluster = cluster or config.cluster(spec)
    return cluster.run(specs, until=run_limit_s(config, rate, specs))


def run_limit_s(config: SimulateConfig, rate: float, specs: list) -> float:
    """As bench compare stops each run: the longest schedule's end plus a minute."""
    return specs[-1].arrival_s + 60.0 if math.isinf(rate) else config.num_prompts / min(config.rates) + 60.0


def simulate_rate(config: SimulateConfig, rate: float, spec: ClusterSpec | None = None) -> dict:
    """One run at ``rate``: the ``bench serve`` summary of the simulated requests, with the run's wall time."""
    started, cpu = time.perf_counter(), time.process_time()
    cluster = config.cluster(spec)
    records = simulate_records(config, rate, cluster=cluster)
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(ends, default=0.0)
    summary = summarize(records, duration, config.slo())
    summary["wall_s"] = time.perf_counter() - started
    summary["cpu_s"] = time.process_time() - cpu  # the wall time on a loaded machine is mostly waiting for a core
    summary["pods"] = len(cluster.pods)
    summary["pod_busy"] = sum(pod.busy_s for pod in cluster.pods) / max(duration, 1e-9) / len(cluster.pods)
    return summary


def sweep(config: SimulateConfig, spec: ClusterSpec | None = None, log=print) -> dict:
    """Every rate in order (stopping at the first miss when asked); goodput as bench compare defines it."""
    runs, best, first_miss = {}, None, None
    for rate in sorted(config.rates):
        summary = simulate_rate(config, rate, spec)
        runs[rate] = summary
        log(rate_row(rate, summary))
        if summary["slo_attainment"] < config.slo_attainment:
            first_miss = rate
            if config.stop_at_miss:
                break
        elif first_miss is None:
            best = rate
    return {"max_rate_meeting_slo": best, "first_rate_missing_slo": first_miss, "runs": runs}


HEADER = (f"{'rate':>6}{'SLO met':>9}{'goodput':>9}{'TTFT p50/p90/p99 ms':>22}{'TPOT p50/p90/p99 ms':>22}"
          f"{'failed':>7}{'busy':>6}{'wall s':>8}{'cpu s':>7}")


def rate_row(rate: float, s: dict) -> str:
    def triple(d):
        return "/".join(f"{d[k] * 1e3:.0f}" for k in ("p50", "p90", "p99")) if d else "-"

    return (f"{rate:>6g}{s['slo_attainment']:>9.0%}{s['goodput']:>9.2f}{triple(s['ttft']):>22}"
            f"{triple(s['tpot']):>22}{s['failed'] + s['unfinished']:>7}{s['pod_busy']:>6.0%}{s['wall_s']:>8.2f}"
            f"{s['cpu_s']:>7.2f}")


EXAMPLES = """examples:
  splitserve simulate --pools prefill:1,decode:1                    # bench compare's disagg-1:1, predicted
  splitserve simulate --pools mixed:2 --max-num-batched-tokens 256 --long-prefill-token-threshold 256
  splitserve simulate --pools prefill:40,decode:88 --rates inf --num-prompts 19366 --max-prompt-tokens 0 \\
      --max-output-tokens 0                                         # an hour of the conversation trace, 128 pods
the profile (bench phases --profile-out) says how fast a pod is; see docs/simulator.md"""


# ``splitserve simulate NAME ...``: the studies built on the simulator, each a module of this package.
STUDIES = {"validate": "splitserve.simulator.validate", "ratios": "splitserve.simulator.ratios",
           "planner": "splitserve.simulator.planner_replay", "slo-map": "splitserve.simulator.slo_map"}


def main(argv: list[str] | None = None) -> dict:
    if argv and argv[0] in STUDIES:
        import importlib

        return importlib.import_module(STUDIES[argv[0]]).main(argv[1:])
    config = parse_config(SimulateConfig, argv, prog="splitserve simulate", epilog=EXAMPLES)
    spec = config.cluster_spec()
    print(f"splitserve simulate: {', '.join(config.pools)} ({sum(p.count for p in spec.pools)} pods, "
          f"{config.scheduling}); "
          f"{config.workload_at(config.rates[0]).describe_requests()}; targets {config.slo().describe()}")
    print(f"CPUs: {', '.join(pool.describe() for pool in spec.pools)}; {spec.cpus} in all"
          + (f" of the {config.cpus} budget" if config.cpus else ""))
    print(HEADER)
    result = sweep(config, spec)
    if all(math.isinf(rate) for rate in config.rates):  # a trace at its own timestamps: no rate to report
        print(f"at the trace's own timestamps: {'met' if result['max_rate_meeting_slo'] else 'missed'} "
              f">= {config.slo_attainment:.0%} of requests within the targets")
    else:
        print(f"goodput: {result['max_rate_meeting_slo'] or 0:g} req/s (the highest rate with >= "
              f"{config.slo_attainment:.0%} of requests meeting the targets, before the first miss)")
    out = {"pools": config.pools, "scheduling": str(config.scheduling), "slo": config.slo().describe(),
           "goodput": result["max_rate_meeting_slo"] or 0.0,
           "profile": config.profile,
           "cpus": {"pools": [pool.describe() for pool in spec.pools], "total": spec.cpus,
                    "budget": config.cpus},
           "runs": {str(rate): summary for rate, summary in result["runs"].items()}}
    save_results(out, config.json, None)
    return out

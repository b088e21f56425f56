"""What ``splitserve bench compare`` measures (``command.py`` runs it): the topologies (``plan_topologies``), one
run's settings (``CompareConfig``), and what each topology measured (``TopologyResult``), with the baseline they are
held to (``best_colocated``, ``goodput_ratios``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from splitserve.bench.serve.run import ServeBenchConfig
from splitserve.engine.config import DEFAULT_MODEL, CacheConfig
from splitserve.measure.serve_metrics import SLO, SLO_ATTAINMENT
from splitserve.runtime.config import described, passed_to, passed_values
from splitserve.runtime.cpus import allowed_cpus, format_cpu_list
from splitserve.up_config import UpConfig

KINDS = ("disaggregated", "colocated", "conditional", "hybrid")
TAIL_RATIO = 1.5  # a steady decode: p99 TPOT at most 1.5x its median (issue 10's target)
STARTUP_S = 30.0  # estimate: a cluster of smollm2-135m pods loads, serves, and stops (2 CPUs)
DRAIN_S = 10.0  # estimate: after the last send, the requests still out finish
BUDGETS = (64, 128, 256)  # colocated chunked-prefill token budgets: small chunks (steady decode) to large ones
CONDITIONAL_THRESHOLD = 256  # prompts shorter than this prefill on the decode pod (about a third of the trace's)
# Load-aware: a prompt this far behind the prefill queue prefills on the decode pod (1.0: worse).
CONDITIONAL_QUEUE_S = 2.0


@dataclass(frozen=True)
class Topology:
    """One way to serve on the CPUs: its name, kind, and the ``UpConfig`` fields that make it so."""

    name: str
    kind: str  # disaggregated | colocated | conditional
    fields: dict = field(hash=False)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.fields.items())


def plan_topologies(cpus: list[int], budgets: list[int], conditional_threshold: int,
                    conditional_queue_s: float = 0.0, slo: SLO | None = None) -> list[Topology]:
    """Every topology worth measuring on ``cpus`` (sorted CPU ids), in the order they run. The hybrid's router is
    told the run's targets (``slo``), as an operator tells it the service level: its lending keeps that TPOT."""
    n, every = len(cpus), format_cpu_list(frozenset(cpus))
    plans = []
    for p in range(1, n):  # every P:D split
        plans.append(Topology(f"disagg-{p}:{n - p}", "disaggregated", _pd_fields(cpus, p, threshold=0)))
    layouts = [(n, 1)] + ([(1, n)] if n > 1 else [])  # one mixed pod per CPU; one on all of them
    for pods, per_pod in layouts:
        for budget in budgets:
            plans.append(Topology(f"colocated-{pods}x{per_pod}cpu-b{budget}", "colocated", dict(
                prefill=0, decode=0, mixed=pods, mixed_cpus=every, max_num_batched_tokens=budget,
                long_prefill_token_threshold=budget)))
    if n > 1:
        p = n // 2
        plans.append(Topology(f"conditional-{p}:{n - p}-t{conditional_threshold}", "conditional",
                              _pd_fields(cpus, p, threshold=conditional_threshold)))
        if conditional_queue_s:
            plans.append(Topology(f"conditional-{p}:{n - p}-q{conditional_queue_s:g}", "conditional",
                                  _pd_fields(cpus, p, threshold=0, queue_s=conditional_queue_s)))
        targets = {name: value for name, value in (("slo_ttft_s", slo and slo.ttft), ("slo_tpot_s", slo and slo.tpot))
                   if value}
        plans.append(Topology(f"hybrid-{p}:{n - p}", "hybrid",
                              dict(_pd_fields(cpus, p, threshold=0), scheduling="hybrid", **targets)))
    return plans


def interleaved(plan: list[Topology], repeat: int) -> list[Topology]:
    """``plan`` run ``repeat`` times in turn (A B A B: a drift of the machine falls on every topology alike), each
    run a fresh cluster named ``NAME#K``; ``plan`` itself when once."""
    if repeat <= 1:
        return plan
    return [replace(t, name=f"{t.name}#{k + 1}") for k in range(repeat) for t in plan]


def base_name(topology: Topology) -> str:
    """The topology a repeated run is of (``interleaved``)."""
    return topology.name.partition("#")[0]


def _pd_fields(cpus: list[int], prefill_cpus: int, threshold: int, queue_s: float = 0.0) -> dict:
    """A prefill and a decode pod on ``cpus`` split at ``prefill_cpus``, placed by the conditional rules (the pure
    split, whatever ``splitserve up``'s default scheduling)."""
    return dict(prefill=1, decode=1, mixed=0, prefill_cpus=format_cpu_list(frozenset(cpus[:prefill_cpus])),
                decode_cpus=format_cpu_list(frozenset(cpus[prefill_cpus:])), conditional_prefill_threshold=threshold,
                conditional_prefill_queue_s=queue_s, scheduling="disaggregated")


def select_topologies(plan: list[Topology], wanted: list[str]) -> list[Topology]:
    """The topologies of ``plan`` named in ``wanted`` by kind or by name (all of them when empty)."""
    unknown = [w for w in wanted if w not in KINDS and w not in {t.name for t in plan}]
    if unknown:
        raise ValueError(f"unknown topologies {', '.join(unknown)}: pick kinds ({', '.join(KINDS)}) or names "
                         f"({', '.join(t.name for t in plan)})")
    return [t for t in plan if not wanted or t.kind in wanted or t.name in wanted]


# ------------------------------------------------------------------------------------------------ results


@dataclass
class TopologyResult:
    """What one topology measured, or why it could not be measured (``error``)."""

    topology: Topology
    error: str | None = None
    sweep: dict | None = None  # serve.run_sweep's result
    reference: dict | None = None  # the bench serve summary at the reference rate

    @property
    def goodput(self) -> float | None:
        """DistServe's goodput: the highest rate meeting the targets; 0 if even the lowest missed; None: failed."""
        if self.error is not None or self.sweep is None:
            return None
        return self.sweep["max_rate_meeting_slo"] or 0.0

    def to_json(self) -> dict:
        sweep = None
        if self.sweep is not None:
            sweep = {**{k: v for k, v in self.sweep.items() if k != "runs"},
                     "runs": [_rate_row(run.config.workload.request_rate, run.summary) | {"router": run.router}
                              for run in self.sweep["runs"]]}
        return {"name": self.topology.name, "kind": self.topology.kind, "settings": self.topology.fields,
                "error": self.error, "goodput": self.goodput, "sweep": sweep,
                "reference": reference_figures(self.reference) if self.reference else None}


def _rate_row(rate: float, s: dict) -> dict:
    return {"rate": rate, "slo_attainment": s["slo_attainment"], "goodput": s["goodput"], "failed": s["failed"],
            "unfinished": s["unfinished"], "ttft_p99": _pick(s["ttft"], "p99"), "tpot_p50": _pick(s["tpot"], "p50"),
            "tpot_p99": _pick(s["tpot"], "p99"),
            # Every percentile, for the simulator's validation (simulator/validate.py) to hold its predictions to.
            "ttft": {k: _pick(s["ttft"], k) for k in ("p50", "p90", "p99")},
            "tpot": {k: _pick(s["tpot"], k) for k in ("p50", "p90", "p99")}}


def reference_figures(s: dict) -> dict:
    """The reference-rate figures of one bench serve summary ``s``."""
    tpot50, tpot99 = _pick(s["tpot"], "p50"), _pick(s["tpot"], "p99")
    return {"slo_attainment": s["slo_attainment"], "goodput": s["goodput"],
            "ttft": {k: _pick(s["ttft"], k) for k in ("p50", "p90", "p99")},
            "tpot": {k: _pick(s["tpot"], k) for k in ("p50", "p90", "p99")},
            "tpot_p99_over_p50": tpot99 / tpot50 if tpot50 and tpot99 is not None else None,
            "steady_tpot": tpot99 <= TAIL_RATIO * tpot50 if tpot50 and tpot99 is not None else None,
            "errors": {**s["failures"], **({"unfinished": s["unfinished"]} if s["unfinished"] else {}),
                       **({"not_sent": s["not_sent"]} if s["not_sent"] else {})}}


def _pick(distribution: dict | None, key: str) -> float | None:
    return distribution[key] if distribution else None


def best_colocated(results: list[TopologyResult]) -> TopologyResult | None:
    """The baseline: the colocated setting with the highest goodput (ties: the higher reference-rate goodput)."""
    measured = [r for r in results if r.topology.kind == "colocated" and r.goodput is not None]
    return max(measured, key=lambda r: (r.goodput, (r.reference or {}).get("goodput") or 0.0), default=None)


def goodput_ratios(results: list[TopologyResult]) -> dict[str, float | None]:
    """Every measured topology's goodput over the best colocated one's (None where either is missing or 0)."""
    base = best_colocated(results)
    base_goodput = base.goodput if base is not None else None
    return {r.topology.name: r.goodput / base_goodput if r.goodput is not None and base_goodput else None
            for r in results}


# ------------------------------------------------------------------------------------------------ a run


@dataclass
class CompareConfig:
    """One ``bench compare`` run (the library's way in; the command line fills it from flags)."""

    serve: ServeBenchConfig  # the workload and targets every topology gets; its URLs are each cluster's
    rates: list[float]
    reference_rate: float
    model: str = field(default=DEFAULT_MODEL, metadata=described("Model every pod serves."))
    topologies: list[str] = field(default_factory=list)  # kinds or names; empty: all
    budgets: list[int] = field(default_factory=lambda: list(BUDGETS))
    conditional_threshold: int = field(default=CONDITIONAL_THRESHOLD, metadata=described(
        "conditional: prompts shorter than this prefill on the decode pod."))
    conditional_queue_s: float = field(default=CONDITIONAL_QUEUE_S, metadata=described(
        "Load-aware conditional: a prompt that would wait this many seconds behind the prefill pod's queue "
        "prefills on the decode pod if it has none queued (0: no such topology)."))
    attainment: float = SLO_ATTAINMENT
    refine: int = field(default=0, metadata=described(
        "K bisections between the last rate meeting the targets and the first missing them."))
    cpus: frozenset[int] = field(default_factory=allowed_cpus)
    client_cpus: frozenset[int] = frozenset()  # empty: the load generator floats
    kv_cache_memory_bytes: int = field(default=CacheConfig.kv_cache_memory_bytes, metadata=described(
        "KV block pool of each pod."))
    ready_timeout_s: float = field(default=300.0, metadata=described("How long each cluster's pods may take to load."))
    repeat: int = field(default=1, metadata=described(
        "Measure every topology this many times, interleaved (A B A B), each on a fresh cluster: the spread."))
    # The weights' format of each role's pods in every topology (docs/quantization.md): e.g. decode pods on the GGUF
    # file's blocks beside float prefill pods.
    prefill_quantization: str = passed_to(UpConfig, name="prefill_quantization")
    decode_quantization: str = passed_to(UpConfig, name="decode_quantization")
    mixed_quantization: str = passed_to(UpConfig, name="mixed_quantization")

    def __post_init__(self) -> None:
        if not self.rates or min(self.rates) <= 0 or self.reference_rate <= 0:
            raise ValueError("rates and the reference rate must be > 0")
        if not self.serve.slo:
            raise ValueError("bench compare needs latency targets (--goodput ttft:MS tpot:MS)")
        if not self.budgets or min(self.budgets) <= 0:
            raise ValueError("budgets must be > 0")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        if not self.client_cpus <= allowed_cpus():
            raise ValueError(f"client CPUs {format_cpu_list(self.client_cpus)} are not all allowed here")
        UpConfig(**passed_values(self, UpConfig))  # its checks of what every topology's UpConfig gets, at once

    def plan(self) -> list[Topology]:
        return interleaved(select_topologies(plan_topologies(
            sorted(self.cpus), self.budgets, self.conditional_threshold, self.conditional_queue_s, self.serve.slo),
            self.topologies), self.repeat)

    def estimate_s(self) -> float:
        """A topology's time, at most: start-up, then each rate's sends and drain (fewer when a rate misses)."""
        rates = sorted(self.rates) + [sorted(self.rates)[len(self.rates) // 2]] * self.refine  # bisections: ~mid
        if self.reference_rate not in self.rates:
            rates.append(self.reference_rate)
        return STARTUP_S + sum(self.serve.workload.num_prompts / rate + DRAIN_S for rate in rates)

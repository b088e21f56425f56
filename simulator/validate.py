"""``splitserve simulate validate``: the simulator's predictions against a real ``bench compare`` run, on its own
workload (the same trace rows, seed, caps and rates), topology by topology.

    splitserve simulate validate --measured compare.json [--calibrate] [--profile-out calibrated.json]
    splitserve simulate validate --measured map.json --regime balanced ...     (a bench compare --slo-map run)

1. Each topology of the run (its JSON's ``settings``) becomes the same cluster in simulation: ``disagg-P:D`` one
   prefill and one decode pod, ``colocated-NxMcpu-bB`` N mixed pods at budget B, ``conditional-*`` with its
   threshold or queue rule, a ``hybrid-*`` (``--slo-map``) with its scheduling and its router's SLO targets; a pod
   on M CPUs needs a profile of M threads (``--profile`` is one of
   ``--profile-threads``; other topologies are reported as not simulated).
2. ``--calibrate``: what a bench does not see is fitted on one point of the run, the lowest rate of
   ``--calibrate-on``: a factor on every step time (``--calibrate-as factor``: the pods' share of a loaded machine)
   or a time added to every step (``overhead``: the pod loop's own time per step, and a multi-threaded pod's
   threads waiting on a core the router or the load generator holds, which a bench of the engine alone does not
   see and which does not grow with the step's work), so that the
   predicted TPOT median meets the measured one, then ``router_s`` so that the TTFT median does (llm-d's BLIS fits
   its overheads from a real run too). Every other point of the run is a prediction. ``--profile-out`` saves the
   calibrated profile.
3. The table: per topology and rate, measured against predicted SLO attainment, TTFT and TPOT p50 and p90 with the
   error of each; per topology, goodput and how many rate steps apart the two are.

A ``--slo-map`` run (``measured_from_map``) is read as the plain run it contains, scored on one of its regimes
(``--regime``): each topology's settings, and per rate the recorded requests' attainment of that regime's targets
and their latency percentiles. Topologies that are not splitserve's (vLLM) are not simulated.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.measure.phase_profile import PhaseProfile
from splitserve.measure.slo_regimes import COMPARE_NUM_PROMPTS
from splitserve.measure.workload import AZURE_CONV
from splitserve.runtime.config import described, parse_config
from splitserve.simulator.run import DEFAULT_PROFILE, SimulateConfig, simulate_rate

FIGURES = (("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50"), ("tpot", "p90"))
LATENCY_TARGET = 0.15  # the target: predicted latencies within 15% of measured below capacity


@dataclass
class ValidateConfig:
    """Replay a bench compare run (its JSON) in simulation and compare predicted against measured figures."""

    measured: str = field(default="", metadata=described("bench compare's --json output (required)."))
    profile: str = field(default=str(DEFAULT_PROFILE), metadata=described("Profile of the pods."))
    profile_threads: int = field(default=1, metadata=described("Threads of that profile (pods on as many CPUs)."))
    calibrate: bool = field(default=False, metadata=described(
        "Fit the step and router overheads on one point of the run first."))
    calibrate_on: str = field(default="disagg-1:1", metadata=described(
        "The topology whose lowest rate the overheads are fitted on."))
    calibrate_as: str = field(default="factor", metadata=described(
        "What TPOT is fitted with: 'factor' (every step time scaled) or 'overhead' (a time added to every step)."))
    profile_out: str = field(default="", metadata=described("Write the calibrated profile here."))
    workload: str = field(default=str(AZURE_CONV), metadata=described("bench compare's --workload."))
    num_prompts: int = field(default=COMPARE_NUM_PROMPTS, metadata=described("bench compare's --num-prompts."))
    max_prompt_tokens: int = field(default=512, metadata=described("bench compare's --max-prompt-tokens."))
    max_output_tokens: int = field(default=64, metadata=described("bench compare's --max-output-tokens."))
    seed: int = field(default=0, metadata=described("bench compare's --seed."))
    regime: str = field(default="balanced", metadata=described(
        "A --slo-map run: the regime whose targets score it (tight-ttft, balanced, tight-tpot)."))
    map_index: int = field(default=0, metadata=described("A --slo-map run: which of its workloads (0: the first)."))
    json: str = field(default="", metadata=described("Also write the comparison to this JSON file."))

    def __post_init__(self) -> None:
        if self.calibrate_as not in ("factor", "overhead"):
            raise ValueError(f"calibrate_as must be factor or overhead, got {self.calibrate_as!r}")
        if not self.measured or not Path(self.measured).is_file():
            raise ValueError(f"--measured must name bench compare's JSON output, got {self.measured!r}")


def measured_from_map(result: dict, regime: str) -> dict:
    """One workload's ``bench compare --slo-map`` result as a plain bench compare run scored on ``regime``."""
    if regime not in result["regimes"]:
        raise ValueError(f"the map has no regime {regime!r}; it has {', '.join(result['regimes'])}")
    targets, attained = result["regimes"][regime], result["attainment_target"]
    topologies = []
    for name, settings in result["settings"].items():
        requests = result["requests"].get(name)
        if not requests or settings["kind"] == "vllm":
            continue
        runs = [{"rate": float(rate), "ttft": result["latency"][name][rate]["ttft"],
                 "tpot": result["latency"][name][rate]["tpot"],
                 "slo_attainment": sum(status == "ok" and ttft <= targets["ttft_s"]
                                       and (tpot is None or tpot <= targets["tpot_s"])
                                       for status, ttft, tpot in records) / len(records)}
                for rate, records in sorted(requests.items(), key=lambda item: float(item[0]))]
        topologies.append({"name": name, "settings": settings, "sweep": {"runs": runs},
                           "goodput": targets["topologies"][name]["goodput"]})
    return {"topologies": topologies, "rates": result["rates"], "attainment_target": attained,
            "slo": f"ttft<={targets['ttft_s'] * 1e3:.0f}ms, tpot<={targets['tpot_s'] * 1e3:.1f}ms"}


def simulate_config(config: ValidateConfig, topology: dict, rates: list[float], measured: dict,
                    profile: str) -> SimulateConfig | None:
    """The simulation of one measured topology, or None when no profile has its pods' thread count."""
    s = topology["settings"]
    if s.get("mixed"):
        threads = len(_cpus(s["mixed_cpus"])) // s["mixed"]
        pools = [f"mixed:{s['mixed']}"]
    else:
        threads = min(len(_cpus(s["prefill_cpus"])), len(_cpus(s["decode_cpus"])))
        pools = [f"prefill:{s['prefill']}", f"decode:{s['decode']}"]
    if threads != config.profile_threads:
        return None
    scheduler = {name: s[name] for name in ("max_num_batched_tokens", "long_prefill_token_threshold") if name in s}
    # The topology's scheduling (bench compare --slo-map's hybrids carry their router's targets), as splitserve up's.
    scheduling = {name: s[name] for name in ("scheduling", "slo_ttft_s", "slo_tpot_s") if name in s}
    return SimulateConfig(pools=pools, profile=profile, workload=config.workload, num_prompts=config.num_prompts,
                          max_prompt_tokens=config.max_prompt_tokens, max_output_tokens=config.max_output_tokens,
                          seed=config.seed, rates=rates, goodput=_goodput_flags(measured["slo"]),
                          slo_attainment=measured["attainment_target"], stop_at_miss=False,
                          conditional_prefill_threshold=s.get("conditional_prefill_threshold", 0),
                          conditional_prefill_queue_s=s.get("conditional_prefill_queue_s", 0.0), **scheduler,
                          **scheduling)


def _cpus(text: str) -> list[int]:
    from splitserve.runtime.cpus import parse_cpu_list

    return sorted(parse_cpu_list(text))


def _goodput_flags(slo: str) -> list[str]:
    """bench compare's "ttft<=4000ms, tpot<=100ms" back into its flags."""
    return [part.strip().replace("<=", ":").removesuffix("ms") for part in slo.split(",")]


# ------------------------------------------------------------------------------------------- calibration


def calibrate(config: ValidateConfig, measured: dict, log=print) -> PhaseProfile:
    """The profile with ``step_overhead_s`` and ``router_s`` fitted on the lowest rate of ``calibrate_on``."""
    topology = next((t for t in measured["topologies"] if t["name"] == config.calibrate_on and t["sweep"]), None)
    if topology is None:
        raise ValueError(f"the run has no measured topology {config.calibrate_on!r}")
    run = topology["sweep"]["runs"][0]
    target_tpot, target_ttft = run["tpot"]["p50"], run["ttft"]["p50"]
    base = dataclasses.replace(PhaseProfile.load(config.profile), step_overhead_s=0.0, router_s=0.0)

    def predicted(profile: PhaseProfile) -> dict:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "profile.json"
            profile.save(path)
            return simulate_rate(simulate_config(config, topology, [run["rate"]], measured, str(path)), run["rate"])

    if config.calibrate_as == "overhead":
        # TPOT grows one for one with a time added to every step: a few corrections converge.
        overhead = 0.0
        for _ in range(3):
            tpot = predicted(dataclasses.replace(base, step_overhead_s=overhead))["tpot"]["p50"]
            overhead = max(0.0, overhead + target_tpot - tpot)
        profile, fitted = dataclasses.replace(base, step_overhead_s=overhead), f"{overhead * 1e3:.1f} ms per step"
    else:
        # TPOT is close to linear in the step times: a secant step on the factor, then corrections.
        slowdown = 1.0
        for _ in range(3):
            low = predicted(base.scaled(1 / slowdown))["tpot"]["p50"]
            high = predicted(base.scaled(1 / (slowdown * 1.1)))["tpot"]["p50"]
            slowdown = max(0.1, slowdown + (target_tpot - low) * slowdown * 0.1 / (high - low))
        profile, fitted = base.scaled(1 / slowdown), f"step times x {slowdown:.2f}"
    router_s = max(0.0, target_ttft - predicted(profile)["ttft"]["p50"])
    profile = dataclasses.replace(profile, router_s=router_s, note=f"{base.note}; {fitted} and router overhead "
                                  f"fitted by simulate validate on {config.calibrate_on} at {run['rate']:g} req/s of "
                                  f"{Path(config.measured).name}")
    log(f"calibrated on {config.calibrate_on} at {run['rate']:g} req/s: {fitted}, router {router_s * 1e3:.0f} ms "
        f"(measured TTFT p50 {target_ttft * 1e3:.0f} ms, TPOT p50 {target_tpot * 1e3:.1f} ms)")
    return profile


# ------------------------------------------------------------------------------------------- comparison


def compare(config: ValidateConfig, measured: dict, profile_path: str, log=print) -> list[dict]:
    """Per topology: its rates, measured and predicted, and the goodput of each."""
    rows = []
    for topology in measured["topologies"]:
        if not topology["sweep"]:
            continue
        runs = topology["sweep"]["runs"]
        rates = [run["rate"] for run in runs]
        all_rates = measured["rates"]
        sim = simulate_config(config, topology, all_rates, measured, profile_path)
        if sim is None:
            log(f"{topology['name']}: not simulated (its pods' thread count has no profile here)")
            continue
        predicted = {rate: simulate_rate(sim, rate) for rate in all_rates}
        predicted_goodput = _goodput(all_rates, {r: p["slo_attainment"] for r, p in predicted.items()},
                                     measured["attainment_target"])
        per_rate = []
        for run in runs:
            p = predicted[run["rate"]]
            per_rate.append({"rate": run["rate"], "measured": _figures(run), "predicted": _figures(p),
                             "below_capacity": run["slo_attainment"] >= measured["attainment_target"]})
        steps = _rate_steps(all_rates, topology["goodput"], predicted_goodput)
        rows.append({"topology": topology["name"], "measured_goodput": topology["goodput"],
                     "predicted_goodput": predicted_goodput, "goodput_rate_steps_apart": steps,
                     "measured_rates": rates, "rates": per_rate})
    return rows


def _figures(summary: dict) -> dict:
    return {"slo_attainment": summary["slo_attainment"],
            **{f"{name}_{q}": (summary[name] or {}).get(q) for name, q in FIGURES}}


def _goodput(rates: list[float], attainment: dict[float, float], target: float) -> float:
    best = 0.0
    for rate in sorted(rates):
        if attainment[rate] < target:
            break
        best = rate
    return best


def _rate_steps(rates: list[float], measured: float, predicted: float) -> int:
    """How many swept rates apart two goodputs are (0 counts as the step below the lowest rate)."""
    ladder = [0.0] + sorted(rates)
    return abs(ladder.index(measured) - ladder.index(predicted))


def error(predicted: float | None, measured: float | None) -> float | None:
    return (predicted - measured) / measured if predicted is not None and measured else None


def report(rows: list[dict], log=print) -> None:
    """The comparison as a markdown table (docs/PERFORMANCE.md keeps one)."""
    log("| topology | rate | SLO met meas / pred | TTFT p50 ms meas / pred (err) | TTFT p90 | TPOT p50 | TPOT p90 |")
    log("|---|---|---|---|---|---|---|")
    errors = []
    for row in rows:
        for r in row["rates"]:
            m, p = r["measured"], r["predicted"]
            cells = []
            for name, q in FIGURES:
                key = f"{name}_{q}"
                e = error(p[key], m[key])
                if r["below_capacity"] and e is not None:
                    errors.append(abs(e))
                cells.append(f"{_ms(m[key])} / {_ms(p[key])} ({e:+.0%})" if e is not None else "-")
            mark = "" if r["below_capacity"] else " (past capacity)"
            log(f"| {row['topology']} | {r['rate']:g}{mark} | {m['slo_attainment']:.0%} / "
                f"{p['slo_attainment']:.0%} | " + " | ".join(cells) + " |")
    log("\n| topology | goodput measured | goodput predicted | rate steps apart |\n|---|---|---|---|")
    for row in rows:
        log(f"| {row['topology']} | {row['measured_goodput']:g} | {row['predicted_goodput']:g} | "
            f"{row['goodput_rate_steps_apart']} |")
    if errors:
        within = sum(e <= LATENCY_TARGET for e in errors)
        log(f"\nbelow capacity: {within} of {len(errors)} latency figures within {LATENCY_TARGET:.0%}; "
            f"median |error| {sorted(errors)[len(errors) // 2]:.0%}, largest {max(errors):.0%}")


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.0f}" if seconds is not None else "-"


def main(argv: list[str] | None = None) -> list[dict]:
    config = parse_config(ValidateConfig, argv, prog="splitserve simulate validate")
    measured = json.loads(Path(config.measured).read_text())
    if "slo_map" in measured:
        measured = measured_from_map(measured["slo_map"][config.map_index], config.regime)
    profile_path = config.profile
    if config.calibrate:
        profile = calibrate(config, measured)
        profile_path = config.profile_out or str(Path(config.json or "validate").with_suffix(".profile.json"))
        profile.save(profile_path)
        print(f"calibrated profile written to {profile_path}")
    rows = compare(config, measured, profile_path)
    report(rows)
    if config.json:
        Path(config.json).write_text(json.dumps(rows, indent=2))
    return rows

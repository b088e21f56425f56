"""``bench compare``: which topologies a CPU count gives, how the baseline and the ratios are chosen from hand-made
results, that a topology which cannot start is reported while the others are measured; and one end-to-end run of
two real clusters (tiny random model) on two CPUs."""

from __future__ import annotations

import json
import os

import pytest

from splitserve.bench.compare import command as compare
from splitserve.bench.compare import plan as compare_plan
from splitserve.bench.compare.command import measure_topology, repeat_spread
from splitserve.bench.compare.plan import (
    CompareConfig,
    Topology,
    TopologyResult,
    base_name,
    best_colocated,
    goodput_ratios,
    plan_topologies,
    reference_figures,
    select_topologies,
)
from splitserve.bench.serve.run import ServeBenchConfig
from splitserve.measure.serve_metrics import SLO
from splitserve.measure.workload import WorkloadConfig
from splitserve.runtime.config import parse_config


def test_two_cpus_give_one_split_both_colocated_layouts_per_budget_and_conditional():
    plan = plan_topologies([0, 1], [64, 256, 512], conditional_threshold=128, conditional_queue_s=1.5)
    assert [t.name for t in plan] == [
        "disagg-1:1",
        "colocated-2x1cpu-b64", "colocated-2x1cpu-b256", "colocated-2x1cpu-b512",
        "colocated-1x2cpu-b64", "colocated-1x2cpu-b256", "colocated-1x2cpu-b512",
        "conditional-1:1-t128", "conditional-1:1-q1.5", "hybrid-1:1"]
    disagg, conditional, load_aware = plan[0].fields, plan[-3].fields, plan[-2].fields
    assert (disagg["prefill_cpus"], disagg["decode_cpus"], disagg["conditional_prefill_threshold"]) == ("0", "1", 0)
    assert disagg["conditional_prefill_queue_s"] == 0
    assert (conditional["prefill_cpus"], conditional["decode_cpus"]) == ("0", "1")
    assert (conditional["conditional_prefill_threshold"], conditional["conditional_prefill_queue_s"]) == (128, 0)
    assert (load_aware["conditional_prefill_threshold"], load_aware["conditional_prefill_queue_s"]) == (0, 1.5)
    per_cpu, one_pod = plan[2].fields, plan[5].fields
    assert (per_cpu["mixed"], per_cpu["mixed_cpus"], per_cpu["prefill"], per_cpu["decode"]) == (2, "0-1", 0, 0)
    assert (per_cpu["max_num_batched_tokens"], per_cpu["long_prefill_token_threshold"]) == (256, 256)
    assert (one_pod["mixed"], one_pod["mixed_cpus"]) == (1, "0-1")


def test_four_cpus_give_every_split_and_the_even_one_for_conditional():
    plan = plan_topologies([2, 3, 4, 5], [128], conditional_threshold=256)
    splits = [(t.name, t.fields["prefill_cpus"], t.fields["decode_cpus"]) for t in plan if t.kind != "colocated"]
    assert splits == [("disagg-1:3", "2", "3-5"), ("disagg-2:2", "2-3", "4-5"), ("disagg-3:1", "2-4", "5"),
                      ("conditional-2:2-t256", "2-3", "4-5"), ("hybrid-2:2", "2-3", "4-5")]
    assert [t.name for t in plan if t.kind == "colocated"] == ["colocated-4x1cpu-b128", "colocated-1x4cpu-b128"]


def test_the_hybrid_is_told_the_runs_targets_and_repeats_run_interleaved():
    """The hybrid's router gets the targets the run scores (an operator's service level: its lending keeps that
    TPOT); the pure split schedules disaggregated whatever ``up``'s default. ``--repeat 2``: A B A B, named apart."""
    plan = plan_topologies([0, 1], [128], 256, slo=SLO(tpot=0.025))
    hybrid, split = plan[-1].fields, plan[0].fields
    assert (hybrid["scheduling"], hybrid["slo_tpot_s"], "slo_ttft_s" in hybrid) == ("hybrid", 0.025, False)
    assert split["scheduling"] == "disaggregated" and "slo_tpot_s" not in split
    both = config(topologies=["disaggregated", "hybrid"], repeat=2).plan()
    assert [t.name for t in both] == ["disagg-1:1#1", "hybrid-1:1#1", "disagg-1:1#2", "hybrid-1:1#2"]
    assert [base_name(t) for t in both] == ["disagg-1:1", "hybrid-1:1"] * 2
    with pytest.raises(ValueError, match="repeat"):
        config(repeat=0)


def test_repeated_runs_print_their_spread_side_by_side():
    runs = [TopologyResult(Topology(f"{name}#{k}", kind, {}), sweep={"max_rate_meeting_slo": 1.0, "runs": []},
                           reference=summary(met, 1.0, 0.010, p99))
            for k, (name, kind, met, p99) in enumerate([("disagg-1:1", "disaggregated", 1.0, 0.0135),
                                                        ("hybrid-1:1", "hybrid", 0.95, 0.0297),
                                                        ("disagg-1:1", "disaggregated", 0.983, 0.0143),
                                                        ("hybrid-1:1", "hybrid", 1.0, 0.0151)])]
    lines = repeat_spread(runs)
    assert lines[1].split() == ["disagg-1:1", "SLO", "met", "100.0%,", "98.3%", "[98.3%-100.0%];", "TPOT", "p99",
                                "13.5,", "14.3", "ms"]
    assert "95.0%, 100.0% [95.0%-100.0%]" in lines[2] and lines[2].lstrip().startswith("hybrid-1:1")
    assert repeat_spread(runs[:2]) == []  # each once: no spread to show


def test_one_cpu_leaves_only_one_colocated_pod():
    assert [t.name for t in plan_topologies([0], [128, 256], 256)] == ["colocated-1x1cpu-b128",
                                                                       "colocated-1x1cpu-b256"]


def test_topologies_are_picked_by_kind_or_name_and_unknown_ones_refused():
    plan = plan_topologies([0, 1], [128, 256], 256)
    assert [t.name for t in select_topologies(plan, ["disaggregated", "colocated-1x2cpu-b256"])] == [
        "disagg-1:1", "colocated-1x2cpu-b256"]
    assert select_topologies(plan, []) == plan
    with pytest.raises(ValueError, match="disagg-3:1"):
        select_topologies(plan, ["disagg-3:1"])


def summary(attainment: float, goodput: float, tpot_p50: float, tpot_p99: float, failures=None, unfinished=0):
    dist = lambda p50, p99: {"p50": p50, "p90": (p50 + p99) / 2, "p99": p99}  # noqa: E731
    return {"slo_attainment": attainment, "goodput": goodput, "ttft": dist(0.5, 1.5), "tpot": dist(tpot_p50, tpot_p99),
            "failures": failures or {}, "unfinished": unfinished, "not_sent": 0,
            "failed": sum((failures or {}).values())}


def result(name: str, kind: str, goodput: float | None, ref_goodput: float = 0.1, error: str | None = None):
    sweep = None if error else {"max_rate_meeting_slo": goodput, "runs": []}
    return TopologyResult(Topology(name, kind, {}), error=error, sweep=sweep,
                          reference=None if error else summary(0.95, ref_goodput, 0.05, 0.06))


def test_the_best_colocated_setting_is_the_baseline_of_every_ratio():
    results = [result("disagg-1:1", "disaggregated", 0.6), result("colocated-2x1cpu-b128", "colocated", 0.3),
               result("colocated-2x1cpu-b256", "colocated", 0.4, ref_goodput=0.20),
               result("colocated-1x2cpu-b256", "colocated", 0.4, ref_goodput=0.25),  # the tie-break: reference
               result("conditional-1:1-t256", "conditional", None),  # no rate met the targets: goodput 0
               result("broken", "colocated", None, error="RuntimeError: decode-0 exited")]
    assert best_colocated(results).topology.name == "colocated-1x2cpu-b256"
    assert results[4].goodput == 0.0 and results[5].goodput is None
    ratios = goodput_ratios(results)
    assert ratios["disagg-1:1"] == pytest.approx(1.5)
    assert ratios["colocated-2x1cpu-b128"] == pytest.approx(0.75)
    assert ratios["conditional-1:1-t256"] == 0.0 and ratios["broken"] is None


def test_no_ratios_without_a_colocated_goodput():
    results = [result("disagg-1:1", "disaggregated", 0.6), result("colocated-2x1cpu-b128", "colocated", None)]
    assert goodput_ratios(results) == {"disagg-1:1": None, "colocated-2x1cpu-b128": None}
    assert best_colocated([result("disagg-1:1", "disaggregated", 0.6)]) is None


def test_reference_figures_flag_a_tpot_tail_over_one_and_a_half_times_the_median():
    steady = reference_figures(summary(0.9, 0.2, 0.100, 0.150, unfinished=2))
    assert steady["steady_tpot"] is True and steady["tpot_p99_over_p50"] == pytest.approx(1.5)
    assert steady["errors"] == {"unfinished": 2}
    spiky = reference_figures(summary(0.9, 0.2, 0.100, 0.151, failures={"http_503": 3}))
    assert spiky["steady_tpot"] is False and spiky["errors"] == {"http_503": 3}


def config(**fields) -> CompareConfig:
    serve = ServeBenchConfig(workload=WorkloadConfig(workload="random", num_prompts=10, input_len=48, output_len=12),
                             slo=SLO(ttft=5.0, tpot=1.0), progress=False)
    return CompareConfig(**({"serve": serve, "rates": [1.0, 2.0], "reference_rate": 1.0, "model": "tiny-random",
                             "kv_cache_memory_bytes": 64 << 20} | fields))


def test_the_estimate_counts_start_up_and_every_rate_and_a_reference_rate_off_the_sweep():
    swept = config(rates=[1.0, 2.0], reference_rate=1.0)
    assert swept.estimate_s() == (compare_plan.STARTUP_S + (10 / 1 + compare_plan.DRAIN_S)
                                  + (10 / 2 + compare_plan.DRAIN_S))
    extra = config(rates=[1.0, 2.0], reference_rate=0.5)
    assert extra.estimate_s() == swept.estimate_s() + 10 / 0.5 + compare_plan.DRAIN_S


def test_a_topology_that_cannot_be_set_up_is_reported_and_the_run_goes_on(monkeypatch, capsys):
    impossible = Topology("disagg-impossible", "disaggregated", dict(
        prefill=1, decode=1, mixed=0, prefill_cpus="0", decode_cpus=str(max(os.sched_getaffinity(0)) + 1),
        conditional_prefill_threshold=0))
    fine = Topology("colocated-fake", "colocated", {})
    monkeypatch.setattr(CompareConfig, "plan", lambda self: [impossible, fine])
    measured = []
    real = measure_topology

    def measure(topology, config, log=print):
        if topology is fine:  # no cluster: only the loop's going on is under test here
            measured.append(topology)
            return TopologyResult(fine, sweep={"max_rate_meeting_slo": 2.0, "runs": []},
                                  reference=summary(1.0, 2.0, 0.01, 0.012))
        return real(topology, config, log)

    monkeypatch.setattr(compare, "measure_topology", measure)
    cfg = config()
    results = compare.run_compare(cfg, log=print)
    assert results[0].error.startswith("bad settings: decode_cpus") and results[0].goodput is None
    assert measured == [fine] and results[1].goodput == 2.0
    compare.report(results, cfg)
    printed = capsys.readouterr().out
    assert "FAILED (not measured): disagg-impossible" in printed
    assert "disagg-impossible / best colocated" not in printed
    out = compare.results_json(results, cfg)
    assert out["topologies"][0]["error"].startswith("bad settings") and out["best_colocated"] == "colocated-fake"
    json.dumps(out)


@pytest.mark.e2e
def test_a_pod_that_fails_to_start_fails_its_topology_with_its_log():
    broken = Topology("colocated-broken", "colocated", dict(prefill=0, decode=0, mixed=1, mixed_cpus="",
                                                            max_num_batched_tokens=64,
                                                            long_prefill_token_threshold=64))
    lines = []
    result = measure_topology(broken, config(model="no-such-model", ready_timeout_s=60), log=lines.append)
    assert result.goodput is None and result.error.startswith("RuntimeError")
    assert any(line.startswith("FAILED") for line in lines)


@pytest.mark.e2e
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1")
def test_two_topologies_end_to_end_from_the_command_line(tmp_path, capsys, monkeypatch):
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    preparations = []  # one per cluster, shared by its sweep and its reference run: every run's prompts are new
    make = compare.Preparation.make
    monkeypatch.setattr(compare.Preparation, "make", classmethod(
        lambda cls, config: preparations.append(make(config)) or preparations[-1]))
    results = compare.main([
        "--model", "tiny-random", "--cpus", "0,1", "--topologies", "disagg-1:1,colocated-2x1cpu-b64",
        "--budgets", "64", "--workload", "random", "--max-prompt-tokens", "48", "--max-output-tokens", "8",
        "--num-prompts", "6", "--rates", "4,8", "--reference-rate", "6", "--goodput", "ttft:5000", "tpot:1000",
        "--kv-cache-memory-bytes", str(64 << 20), "--no-progress", "--json", str(out), "--plot", str(png)])
    assert [prep.runs for prep in preparations] == [3, 3]  # rates 4 and 8, then the reference rate on its own
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    by_name = {t["name"]: t for t in results["topologies"]}
    assert list(by_name) == ["disagg-1:1", "colocated-2x1cpu-b64"]
    for topology in by_name.values():
        assert topology["error"] is None
        assert [run["rate"] for run in topology["sweep"]["runs"]] == [4.0, 8.0]
        assert all(run["failed"] == run["unfinished"] == 0 for run in topology["sweep"]["runs"])
        assert topology["goodput"] == 8.0  # targets no tiny request misses
        ref = topology["reference"]
        assert ref["errors"] == {} and ref["slo_attainment"] == 1.0 and ref["tpot"]["p50"] > 0
    assert results["best_colocated"] == "colocated-2x1cpu-b64"
    assert results["goodput_over_best_colocated"] == {"disagg-1:1": 1.0, "colocated-2x1cpu-b64": 1.0}
    printed = capsys.readouterr().out
    assert "[1/2 disagg-1:1 |" in printed and "[2/2 colocated-2x1cpu-b64 |" in printed
    assert "disagg-1:1 / best colocated: 1.00x" in printed
    assert png.stat().st_size > 0


def test_pinning_the_load_generator_restores_the_mask_for_the_next_cluster():
    before = os.sched_getaffinity(0)
    one = frozenset([min(before)])
    with compare.pinned(one):
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == before
    with compare.pinned(frozenset()):
        assert os.sched_getaffinity(0) == before


def command(*flags: str) -> compare.CompareCommand:
    """The command line as ``splitserve bench compare`` parses it (on the random workload: no trace needed)."""
    return parse_config(compare.CompareCommand, ["--workload", "random", *flags], env={})


def test_quick_and_full_defaults_differ_only_where_asked():
    full, quick = command(), command("--quick")
    assert full.rates == [0.2, 0.3, 0.4, 0.5, 0.7] and full.reference_rate in full.rates
    assert quick.reference_rate in quick.rates and len(quick.rates) < len(full.rates)
    assert command("--quick", "--rates", "1,2").rates == [1.0, 2.0]
    assert (quick.budgets, quick.topologies) == ([256], ["disaggregated", "colocated"])


def test_topologies_can_run_quantized_decode_pods_and_a_bad_format_is_refused_at_once():
    config = command("--decode-quantization", "int4").compare_config()
    for topology in config.plan():
        up = compare.up_config(topology, config)
        assert (up.prefill_quantization, up.decode_quantization, up.mixed_quantization) == ("auto", "int4", "auto")
        assert {name: getattr(up, name) for name in topology.fields} == topology.fields, topology.name
    with pytest.raises(SystemExit):
        command("--mixed-quantization", "q4_k")


def test_the_command_line_hands_on_the_library_defaults_and_refuses_bad_values_at_once():
    config = command().compare_config()
    library = CompareConfig(serve=config.serve, rates=[1.0], reference_rate=1.0)
    assert (config.model, config.kv_cache_memory_bytes, config.conditional_threshold, config.conditional_queue_s) == (
        library.model, library.kv_cache_memory_bytes, library.conditional_threshold, library.conditional_queue_s)
    assert config.serve.slo.describe() == "ttft<=4000ms, tpot<=100ms" and config.attainment == 0.9
    for bad in (["--topologies", "no-such"], ["--rates", "0"], ["--goodput", "ttft"], ["--budgets", "0"]):
        with pytest.raises(SystemExit):
            command(*bad)

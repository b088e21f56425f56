"""The simulator (``simulator/``) on hand-made profiles whose answers are computable by hand, its reuse of the engine's
real scheduler, the profile fit on synthetic points, and ``splitserve simulate`` end to end on a small trace."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from splitserve.engine.config import SchedulerConfig
from splitserve.engine.scheduler import Scheduler
from splitserve.measure.phase_profile import PhaseProfile, StepFit, fit_step
from splitserve.measure.workload import RequestSpec
from splitserve.router.policies import LocalPrefill, make_policy
from splitserve.runtime.roles import Role
from splitserve.simulator.cluster import DEFAULT_SCHEDULING, ClusterSpec, PodPool, SimCluster
from splitserve.simulator.ratios import RatiosConfig
from splitserve.simulator.run import DEFAULT_PROFILE, SimulateConfig, simulate_rate

PREFILL_A, PREFILL_B, DECODE_A = 0.1, 0.001, 0.02


def hand_profile(**changes) -> PhaseProfile:
    """Prefill step 0.1 s + 1 ms per token; decode step 20 ms whatever the batch; the KV push fully hidden."""
    fields = dict(model="hand", threads=1, prefill=StepFit(PREFILL_A, PREFILL_B, 0.0),
                  decode=StepFit(DECODE_A, 0.0, 0.0), kv_bytes_per_token=100, transfer_overlap=1.0)
    return PhaseProfile(**(fields | changes))


def cluster(pools: dict[Role, int], profile: PhaseProfile | None = None, router_s: float = 0.0, span_s: float = 0.0,
            **scheduler) -> SimCluster:
    profile = profile or hand_profile()
    spec = ClusterSpec(tuple(PodPool(role, count, profile) for role, count in pools.items()),
                       SchedulerConfig(**scheduler), num_blocks=1000, router_s=router_s, span_s=span_s)
    return SimCluster(spec, make_policy("least_loaded", LocalPrefill(threshold=0)))


def request(index: int, prompt: int, output: int, at: float = 0.0) -> RequestSpec:
    return RequestSpec(index, at, prompt, output)


def test_one_request_disaggregated_is_exact():
    [record] = cluster({Role.PREFILL: 1, Role.DECODE: 1}, router_s=0.05).run([request(0, 100, 5)])
    # Router 50 ms, one prefill step of 100 tokens (0.1 + 0.1 s); then 4 decode steps of 20 ms on D.
    assert record.status == "ok" and record.output_tokens == 5
    assert record.ttft == pytest.approx(0.05 + PREFILL_A + 100 * PREFILL_B)
    assert record.tpot == pytest.approx(DECODE_A)
    assert record.chunk_s == pytest.approx([0.25 + k * DECODE_A for k in range(5)])


def test_one_request_on_a_mixed_pod_prefills_and_decodes_there():
    [record] = cluster({Role.MIXED: 1}).run([request(0, 300, 3)])
    assert record.ttft == pytest.approx(PREFILL_A + 300 * PREFILL_B)
    assert record.tpot == pytest.approx(DECODE_A)


def test_a_queue_of_identical_prompts_prefills_one_after_another():
    # A budget of one prompt per step: the k-th prompt's first token comes after k + 1 prefill steps.
    records = cluster({Role.PREFILL: 1, Role.DECODE: 1}, max_num_batched_tokens=200,
                      long_prefill_token_threshold=200).run([request(i, 200, 1) for i in range(5)])
    step = PREFILL_A + 200 * PREFILL_B
    assert [r.ttft for r in records] == pytest.approx([(k + 1) * step for k in range(5)])
    assert all(r.tpot is None and r.status == "ok" for r in records)


def test_the_transfer_time_is_the_exposed_share_of_the_push():
    profile = hand_profile(transfer_overlap=0.5, link_gbps=1e-6)  # 1 KB/s: 100 tokens of 100 B take 10 s
    [record] = cluster({Role.PREFILL: 1, Role.DECODE: 1}, profile).run([request(0, 100, 2)])
    assert record.ttft == pytest.approx(PREFILL_A + 100 * PREFILL_B + 0.5 * 10.0)


def test_chunked_prefill_follows_the_engines_scheduler():
    # 300 tokens with a 128-token chunk cap: three steps (128, 128, 44 tokens), each paying the constant.
    [record] = cluster({Role.MIXED: 1}, long_prefill_token_threshold=128).run([request(0, 300, 2)])
    assert record.ttft == pytest.approx(3 * PREFILL_A + 300 * PREFILL_B)


def test_the_simulation_runs_the_real_scheduler(monkeypatch):
    # The engine's scheduler serves its waiting queue oldest first; made to serve the newest first, the simulation
    # follows: of three prompts sent together, the first starts at once, then the third, then the second.
    specs = [request(i, 200, 1) for i in range(3)]
    step = PREFILL_A + 200 * PREFILL_B

    def ttfts():
        return [r.ttft for r in cluster({Role.MIXED: 1}, max_num_batched_tokens=200,
                                        long_prefill_token_threshold=200).run(specs)]

    assert ttfts() == pytest.approx([step, 2 * step, 3 * step])
    add = Scheduler.add

    def newest_first(self, seq):
        add(self, seq)
        self.waiting.rotate(1)

    monkeypatch.setattr(Scheduler, "add", newest_first)
    assert ttfts() == pytest.approx([step, 3 * step, 2 * step])


def test_a_full_kv_pool_preempts_and_every_request_still_finishes():
    spec = ClusterSpec((PodPool(Role.MIXED, 1, hand_profile()),), SchedulerConfig(), num_blocks=12, block_size=16)
    sim = SimCluster(spec, make_policy("least_loaded", LocalPrefill(threshold=0)))
    records = sim.run([request(i, 60, 40) for i in range(3)])  # 3 x 100 tokens > 12 blocks of 16
    assert [(r.status, r.output_tokens) for r in records] == [("ok", 40)] * 3
    pod = sim.pods[0]
    assert pod.num_preemptions > 0
    assert pod.block_manager.num_free_blocks == 12  # everything free again


@pytest.mark.parametrize("pools", [{Role.MIXED: 1}, {Role.PREFILL: 1, Role.DECODE: 1}])
def test_spans_of_decode_steps_give_the_times_of_single_steps(pools):
    # Requests arriving while others decode interrupt the spans; a decode step's time grows with context and batch.
    profile = hand_profile(decode=StepFit(DECODE_A, 1e-5, 3e-3))
    specs = [request(i, 50 + 37 * i, 20 + 13 * i, at=0.15 * i) for i in range(8)]

    def times(span_s):
        sim = cluster(pools, profile, span_s=span_s, max_num_batched_tokens=256, long_prefill_token_threshold=128)
        return [(r.status, r.chunk_s) for r in sim.run(specs)], sum(p.num_steps for p in sim.pods), sim

    single, steps, _ = times(0.0)
    spanned, spanned_steps, sim = times(0.3)
    assert [status for status, _ in single] == ["ok"] * 8
    assert [(status, pytest.approx(chunks, abs=1e-9)) for status, chunks in spanned] == single
    assert spanned_steps == steps
    assert all(pod.block_manager.num_free_blocks == 1000 for pod in sim.pods)


def test_fit_step_recovers_known_coefficients_and_keeps_them_non_negative():
    points = [(x1, x2, 0.05 + 0.002 * x1 + 3e-6 * x2) for x1 in (10, 100, 400) for x2 in (0, 5000, 90000)]
    fit = fit_step(points)
    assert (fit.a, fit.b, fit.c) == pytest.approx((0.05, 0.002, 3e-6), rel=1e-6)
    # Seconds falling with x2 cannot be a cost: that term is dropped, not fitted negative.
    falling = [(x1, x2, 0.1 + 0.001 * x1 - 1e-6 * x2) for x1 in (10, 100) for x2 in (0, 1000)]
    assert min(fit_step(falling).a, fit_step(falling).b, fit_step(falling).c) >= 0


def test_splitserve_simulate_on_a_small_trace(tmp_path, capsys):
    from splitserve.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{i * 0.5},{100 + 50 * i},{5 + i}\n" for i in range(8)))
    profile = tmp_path / "profile.json"
    hand_profile().save(profile)
    out = tmp_path / "sim.json"
    main(["simulate", "--pools", "prefill:1,decode:1", "--profile", str(profile), "--workload", str(trace),
          "--num-prompts", "8", "--rates", "1,100", "--router-s", "0", "--goodput", "ttft:1000", "tpot:100",
          "--kv-cache-memory-bytes", "1600000", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "goodput: 1 req/s" in printed and "wall s" in printed
    result = json.loads(out.read_text())
    assert result["goodput"] == 1.0
    assert result["runs"]["1.0"]["successful"] == 8
    assert result["runs"]["1.0"]["slo_attainment"] == 1.0
    assert result["runs"]["100.0"]["slo_attainment"] < 0.9


def test_the_planner_replay_grows_the_pools_a_day_needs(tmp_path):
    from splitserve.simulator.planner_replay import PlannerReplayConfig, day_workload, run

    profile = tmp_path / "profile.json"
    hand_profile(decode=StepFit(DECODE_A, 0.0, 1e-3), kv_bytes_per_token=50_000).save(profile)  # 1,342 blocks
    config = PlannerReplayConfig(peak_rate=3.0, trough_rate=0.2, day_s=300, startup_s=10, lag_s=5, interval_s=10,
                                 window_s=20, max_replicas=6, max_prompt_tokens=512, max_output_tokens=8,
                                 profile=str(profile))
    specs = day_workload(config)
    halves = [sum(1 for s in specs if lo <= s.arrival_s < lo + 75) for lo in (0, 112.5)]
    assert halves[1] > 2 * halves[0]  # the curve: night, then noon
    out = run(config, log=lambda line: None)
    # One prefill pod prefills 1 / (0.1 s + 1 ms x ~400 tokens) = 2 prompts/s: noon's 3 req/s needs more.
    assert out["peak_pods"]["prefill"] > 1
    assert out["timeline"][0]["prefill"] == 1
    assert out["planner"]["pod_hours"] < out["static-at-peak"]["pod_hours"]


def test_validation_maps_bench_compare_topologies_and_counts_rate_steps():
    from splitserve.simulator.validate import ValidateConfig, _goodput_flags, _rate_steps, simulate_config

    assert _goodput_flags("ttft<=4000ms, tpot<=100ms") == ["ttft:4000", "tpot:100"]
    assert _rate_steps([0.1, 0.2, 0.3], 0.1, 0.3) == 2 and _rate_steps([0.1, 0.2], 0.0, 0.1) == 1
    config = ValidateConfig.__new__(ValidateConfig)  # the mapping reads only these fields
    config.profile_threads, config.workload, config.num_prompts, config.seed = 1, "random", 5, 0
    config.max_prompt_tokens, config.max_output_tokens = 512, 64
    measured = {"slo": "ttft<=4000ms, tpot<=100ms", "attainment_target": 0.9}
    colocated = {"settings": dict(prefill=0, decode=0, mixed=2, mixed_cpus="0-1", max_num_batched_tokens=256,
                                  long_prefill_token_threshold=256)}
    sim = simulate_config(config, colocated, [0.1], measured, str(DEFAULT_PROFILE))
    assert sim.pools == ["mixed:2"] and sim.max_num_batched_tokens == 256 and sim.long_prefill_token_threshold == 256
    one_pod_on_both = {"settings": dict(colocated["settings"], mixed=1)}
    assert simulate_config(config, one_pod_on_both, [0.1], measured, str(DEFAULT_PROFILE)) is None  # 2 threads
    split = {"settings": dict(prefill=1, decode=1, mixed=0, prefill_cpus="0", decode_cpus="1",
                              conditional_prefill_threshold=0, conditional_prefill_queue_s=2.0)}
    sim = simulate_config(config, split, [0.1], measured, str(DEFAULT_PROFILE))
    assert sim.pools == ["prefill:1", "decode:1"] and sim.conditional_prefill_queue_s == 2.0


def test_a_slo_map_run_is_validated_as_the_plain_run_it_holds_scored_on_one_regime(tmp_path):
    """The map's recorded requests, scored on the regime asked for, become each topology's per-rate attainment; its
    settings say what to simulate (the hybrid with its router's targets); vLLM is left out."""
    import json

    from splitserve.bench.compare.slo_map import MapConfig, TopologyRuns, score, topologies
    from splitserve.bench.serve.run import ServeBenchConfig
    from splitserve.measure.serve_metrics import RequestRecord
    from splitserve.simulator.validate import ValidateConfig, compare, measured_from_map

    def records(ttft: float, tpot: float, count: int = 10, slow: int = 0) -> list[RequestRecord]:
        out = []
        for i in range(count):
            scale = 10 if i < slow else 1
            chunks = [ttft * scale + k * tpot * scale for k in range(8)]
            out.append(RequestRecord(i, 100, 8, 0.0, status="ok", sent_s=0.0, chunk_s=chunks, end_s=chunks[-1],
                                     output_tokens=8))
        return out

    config = MapConfig(serve=ServeBenchConfig(), rates=[0.2, 0.4], cpus=frozenset({0, 1}), model="tiny-random",
                       kv_cache_memory_bytes=1 << 20, ready_timeout_s=10.0, reference_rate=0.2,
                       hybrid_regimes=("balanced",), vllm_python="/opt/vllm/bin/python")
    plan = topologies(config, ttft0=0.5, tpot0=0.04)  # balanced: TTFT 2 s, TPOT 100 ms
    runs = [TopologyRuns(t, {0.2: records(0.5, 0.04), 0.4: records(0.5, 0.04, slow=5)}) for t in plan]
    result = json.loads(json.dumps(score(runs, config, 0.5, 0.04)))  # as the JSON file holds it
    measured = measured_from_map(result, "balanced")
    names = [t["name"] for t in measured["topologies"]]
    assert "vllm-cpu" not in names and "hybrid-balanced" in names and "disagg-1:1" in names
    hybrid = next(t for t in measured["topologies"] if t["name"] == "hybrid-balanced")
    assert hybrid["settings"]["scheduling"] == "hybrid" and hybrid["settings"]["slo_tpot_s"] == 0.1
    assert [(r["rate"], r["slo_attainment"]) for r in hybrid["sweep"]["runs"]] == [(0.2, 1.0), (0.4, 0.5)]
    assert hybrid["goodput"] == 0.2 and measured["slo"] == "ttft<=2000ms, tpot<=100.0ms"
    with pytest.raises(ValueError, match="no regime"):
        measured_from_map(result, "relaxed")

    validate = ValidateConfig.__new__(ValidateConfig)  # the replay reads only these fields
    validate.profile_threads, validate.workload, validate.num_prompts, validate.seed = 1, "random", 4, 0
    validate.max_prompt_tokens, validate.max_output_tokens = 64, 8
    rows = compare(validate, measured, str(DEFAULT_PROFILE), log=lambda _: None)
    assert {row["topology"] for row in rows} == {"disagg-1:1", "hybrid-balanced"}  # the 2-thread pod has no profile
    assert all(len(row["rates"]) == 2 for row in rows)


@pytest.mark.parametrize("calibrate_as", ["factor", "overhead"])
def test_calibration_meets_the_measured_tpot_it_was_fitted_on(calibrate_as):
    """A run measured 4 ms per token slower than the profile predicts: either fit brings the prediction to it; the
    overhead fit finds the 4 ms as a time per step and leaves the step forms alone."""
    from splitserve.simulator.validate import ValidateConfig, calibrate, simulate_config

    config = ValidateConfig.__new__(ValidateConfig)  # the calibration reads only these fields
    config.profile, config.profile_threads, config.calibrate_on = str(DEFAULT_PROFILE), 1, "disagg-1:1"
    config.workload, config.num_prompts, config.seed, config.measured = "random", 6, 0, "run.json"
    config.max_prompt_tokens, config.max_output_tokens, config.calibrate_as = 64, 16, calibrate_as
    split = {"name": "disagg-1:1", "settings": dict(prefill=1, decode=1, mixed=0, prefill_cpus="0", decode_cpus="1",
                                                     conditional_prefill_threshold=0)}
    measured = {"slo": "ttft<=4000ms, tpot<=100ms", "attainment_target": 0.9, "topologies": [split]}
    base = simulate_rate(simulate_config(config, split, [0.2], measured, str(DEFAULT_PROFILE)), 0.2)
    target = base["tpot"]["p50"] + 0.004
    split["sweep"] = {"runs": [{"rate": 0.2, "tpot": {"p50": target}, "ttft": {"p50": base["ttft"]["p50"] + 0.1}}]}
    profile = calibrate(config, measured, log=lambda _: None)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "calibrated.json")
        profile.save(path)
        after = simulate_rate(simulate_config(config, split, [0.2], measured, path), 0.2)
    assert after["tpot"]["p50"] == pytest.approx(target, rel=0.03)
    if calibrate_as == "overhead":
        assert profile.step_overhead_s == pytest.approx(0.004, abs=0.0005)
        assert profile.decode == PhaseProfile.load(DEFAULT_PROFILE).decode


def test_the_simulator_and_its_studies_share_one_scheduling_default():
    """The pure split, which the recorded fixtures were made with, defined once (``DEFAULT_SCHEDULING``)."""
    assert DEFAULT_SCHEDULING == "disaggregated"
    defaults = [ClusterSpec.__dataclass_fields__["scheduling"].default,
                SimulateConfig.__dataclass_fields__["scheduling"].default,
                RatiosConfig.__dataclass_fields__["scheduling"].default]
    assert all(default is DEFAULT_SCHEDULING for default in defaults), defaults


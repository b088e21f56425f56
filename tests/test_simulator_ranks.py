"""The simulator counts a pod's size: a pod occupies its profile's CPUs (the ranks it was measured at and the CPUs
they shared), pools of prefill TP 2 and decode TP 1 pods count each at its own, and a CPU budget refuses a layout
over it; the P:D ratio study reports each layout's CPUs and, when pods differ, goodput per CPU."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.measure.phase_profile import PhaseProfile
from splitserve.simulator import ratios
from splitserve.simulator.run import DEFAULT_PROFILE, SimulateConfig
from splitserve.simulator.run import main as simulate_main

ONE_RANK = PhaseProfile.load(DEFAULT_PROFILE)  # a shipped profile: one rank on one thread


@pytest.fixture
def tp2(tmp_path) -> str:
    """A pod of two ranks that shared two CPUs (the speed is the one-rank profile's: only the size counts here)."""
    path = tmp_path / "tp2.json"
    dataclasses.replace(ONE_RANK, tensor_parallel_size=2, cpus=2).save(path)
    return str(path)


def test_each_pool_counts_its_pods_at_their_profiles_size(tp2):
    spec = SimulateConfig(pools=[f"prefill:3:{tp2}", "decode:2"], profile=str(DEFAULT_PROFILE)).cluster_spec()
    assert ONE_RANK.pod_cpus == 1
    assert [pool.cpus for pool in spec.pools] == [6, 2] and spec.cpus == 8
    assert [pool.describe() for pool in spec.pools] == ["prefill:3 x 2 CPUs (TP 2) = 6", "decode:2 x 1 CPU (TP 1) = 2"]


def test_a_layout_over_the_cpu_budget_is_refused(tp2):
    pools = [f"prefill:3:{tp2}", "decode:2"]
    assert SimulateConfig(pools=pools, profile=str(DEFAULT_PROFILE), cpus=8).cluster_spec().cpus == 8
    with pytest.raises(ValueError, match="8 in all, over the --cpus budget 7"):
        SimulateConfig(pools=pools, profile=str(DEFAULT_PROFILE), cpus=7)


def test_a_profile_without_a_cpu_count_occupies_its_threads_on_each_rank():
    assert dataclasses.replace(ONE_RANK, tensor_parallel_size=2, threads=2, cpus=0).pod_cpus == 4
    assert dataclasses.replace(ONE_RANK, tensor_parallel_size=4, cpus=2).pod_cpus == 4  # one each, at least


def test_simulate_prints_and_records_each_pools_cpus(tp2, capsys):
    out = simulate_main(["--pools", f"prefill:1:{tp2},decode:1", "--profile", str(DEFAULT_PROFILE),
                         "--rates", "0.2", "--num-prompts", "3", "--cpus", "4"])
    assert "CPUs: prefill:1 x 2 CPUs (TP 2) = 2, decode:1 x 1 CPU (TP 1) = 1; 3 in all of the 4 budget" in (
        capsys.readouterr().out)
    assert out["cpus"]["total"] == 3 and out["cpus"]["budget"] == 4


def test_the_ratio_study_reports_cpus_per_layout_and_goodput_per_cpu(tp2):
    logged = []
    config = ratios.RatiosConfig(pods=[3], traces=["conv"], regimes=["balanced"], prefill_shares=[0.34],
                                 per_pod_rates=[0.02], requests_per_pod=1, max_output_tokens=16,
                                 profile=str(DEFAULT_PROFILE), prefill_profile=tp2)
    results = ratios.run(config, log=logged.append)
    assert results["conv/3/cpus"] == {"1:2": 1 * 2 + 2, "colocated": 3}
    assert any("goodput/CPU" in line for line in logged)


def test_the_planners_check_runs_each_pool_at_its_own_profile(tp2):
    from splitserve.deploy.planner.config import PlannerConfig
    from splitserve.simulator.planner_check import SimulatedCheck

    check = SimulatedCheck(PlannerConfig(prefill_tensor_parallel_size=2, prefill_profile=tp2,
                                         simulate_profile=str(DEFAULT_PROFILE)))
    assert check.profiles == {"prefill": tp2, "decode": str(DEFAULT_PROFILE)}

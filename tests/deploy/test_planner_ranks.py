"""The planner counts a pod's size: a pool of tensor-parallel pods reaches at most its rank budget over each pod's
ranks, and a pool's capacity prior comes from its profile only where that profile was measured at the pods' size."""

from __future__ import annotations

import dataclasses

import pytest
from test_planner_decisions import SimulatedCluster, config, run

from splitserve.deploy.planner.capacity import Planner
from splitserve.measure.phase_profile import PhaseProfile
from splitserve.simulator.run import DEFAULT_PROFILE

HEAVY = (20.0, 400, 50)  # requests/s, prompt and output tokens: far more prefill than ten pods serve


@pytest.mark.parametrize("ranks, reached", [(1, 10), (2, 5), (3, 3)])
def test_a_pool_of_tensor_parallel_pods_stops_at_its_rank_budget_over_their_ranks(ranks, reached):
    c = config(max_prefill_replicas=20, max_prefill_ranks=10, prefill_tensor_parallel_size=ranks,
               scale_up_cooldown_s=0)
    planner = Planner(c, started_at=-1e6)
    history = run(planner, SimulatedCluster(), lambda t: HEAVY, ticks=30)
    assert max(h["prefill"] for h in history) == reached
    assert history[-1]["prefill"] == reached  # held there: the need is beyond it
    assert c.max_pods("prefill") == reached and c.max_pods("decode") == 20  # no decode rank budget: replicas


def test_pipeline_stages_count_as_ranks_and_no_profile_describes_them(tmp_path):
    c = config(max_prefill_replicas=20, max_prefill_ranks=10, prefill_pipeline_parallel_size=2)
    assert (c.ranks("prefill"), c.max_pods("prefill")) == (2, 5)
    with pytest.raises(ValueError, match="no profile describes a pipeline-parallel pod"):
        Planner(config(prefill_pipeline_parallel_size=2, prefill_profile=_profile_at(tmp_path, 1)), started_at=0.0)


def test_a_rank_budget_too_small_for_the_pool_minimum_is_refused():
    with pytest.raises(ValueError, match="max_decode_ranks 3 holds 1 pods of 2 ranks"):
        config(min_decode_replicas=2, max_decode_ranks=3, decode_tensor_parallel_size=2)


def _profile_at(tmp_path, ranks: int) -> str:
    profile = dataclasses.replace(PhaseProfile.load(DEFAULT_PROFILE), tensor_parallel_size=ranks, cpus=ranks)
    path = tmp_path / f"tp{ranks}.json"
    profile.save(path)
    return str(path)


def test_the_capacity_prior_is_the_profile_measured_at_the_pods_size(tmp_path):
    tp2 = _profile_at(tmp_path, 2)
    profile = PhaseProfile.load(tp2)
    planner = Planner(config(prefill_tensor_parallel_size=2, prefill_profile=tp2,
                             decode_tensor_parallel_size=2, decode_profile=tp2), started_at=0.0)
    assert planner.prefill_capacity.tokens_per_s == pytest.approx(1.0 / profile.prefill.b)
    assert planner.decode_capacity.prior == pytest.approx(
        (profile.decode.a + profile.step_overhead_s, profile.decode.c + profile.decode.b * 500))


def test_a_profile_measured_at_another_pod_size_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="measured at tensor parallel size 1, the prefill pods run 2 ranks"):
        Planner(config(prefill_tensor_parallel_size=2, prefill_profile=_profile_at(tmp_path, 1)), started_at=0.0)

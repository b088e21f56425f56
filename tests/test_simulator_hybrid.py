"""Hybrid scheduling in the simulator (issue 20 in issue 24's simulator): decode pods prefill lent prompts in chunks
the engine's ``TPOTSlackBudget`` sizes on the virtual clock, the router's ``HybridPlacement`` picks lent or remote
from the simulated pods' load reports, and the other schedulings give exactly the records they gave before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.engine.config import SchedulerConfig
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_time import MAX_GAP_TARGETS, attention_positions
from splitserve.measure.phase_profile import PhaseProfile, StepFit
from splitserve.measure.workload import RequestSpec
from splitserve.router.config import Scheduling
from splitserve.router.policies import HybridPlacement, LocalPrefill, SLOTargets, make_policy
from splitserve.runtime.roles import Role
from splitserve.simulator.cluster import ClusterSpec, PodPool, SimCluster
from splitserve.simulator.run import PROFILES, SimulateConfig, simulate_records
from splitserve.simulator.sim_pod import profile_step_time

TPOT_TARGET = 0.1
BEFORE_HYBRID = Path(__file__).parent / "data" / "simulator-records-before-hybrid.json"
RECORDED_PROFILE = PROFILES / "smollm2-135m-1thread.json"  # the float32 profile those records were simulated on


def lendable_profile(**changes) -> PhaseProfile:
    """A prefill step 20 ms + 1 ms per prompt token, a decode step 20 ms + 2 ms per sequence: a decode pod can lend
    tens of tokens per step within a 100 ms TPOT."""
    fields = dict(model="hand", threads=1, prefill=StepFit(0.02, 0.001, 0.0), decode=StepFit(0.02, 0.0, 0.002),
                  kv_bytes_per_token=100, transfer_overlap=1.0)
    return PhaseProfile(**(fields | changes))


def hybrid_cluster(pools: dict[Role, int], profile: PhaseProfile, span_s: float = 0.0,
                   ttft_target: float = 2.0) -> SimCluster:
    spec = ClusterSpec(tuple(PodPool(role, count, profile) for role, count in pools.items()), SchedulerConfig(),
                       num_blocks=2000, span_s=span_s, scheduling=Scheduling.HYBRID,
                       targets=SLOTargets(ttft_s=ttft_target, tpot_s=TPOT_TARGET))
    return SimCluster(spec, make_policy("least_loaded", LocalPrefill(threshold=0), hybrid=HybridPlacement()))


def recorded_plans(sim: SimCluster) -> list:
    """The route plans the cluster's policy returns, in order."""
    plans, choose = [], sim.policy.choose_pair
    sim.policy.choose_pair = lambda *args: plans.append(choose(*args)) or plans[-1]
    return plans


def test_a_lent_prompts_chunks_keep_the_running_requests_tpot():
    # Three requests decode on the only pod (no prefill pod: every prompt is lent to it); a 2,000-token prompt
    # arrives meanwhile and prefills there in chunks (its whole prompt in one step would take 2 s).
    sim = hybrid_cluster({Role.DECODE: 1}, lendable_profile(), span_s=0.5)
    plans = recorded_plans(sim)
    decoding = [RequestSpec(i, 0.0, 20, 300) for i in range(3)]
    records = sim.run(decoding + [RequestSpec(3, 0.5, 2000, 5)])
    assert [r.status for r in records] == ["ok"] * 4
    assert all(plan.prefill is None for plan in plans)
    long = records[3]
    assert long.chunk_s[0] < min(r.chunk_s[-1] for r in records[:3])  # it prefilled while they decoded
    for r in records[:3]:  # their TPOT (the mean gap) within the target; a gap may spend what faster ones banked
        gaps = [b - a for a, b in zip(r.chunk_s, r.chunk_s[1:])]
        assert sum(gaps) / len(gaps) <= TPOT_TARGET and max(gaps) <= MAX_GAP_TARGETS * TPOT_TARGET


def test_a_split_prefill_runs_its_prefix_on_the_prefill_pod_and_the_rest_on_the_decode_pod():
    """P has a 700-token prompt ahead (0.7 s of the 2.5 s target: P is the bottleneck; it then decodes on D beside the
    split's rest, as the router predicts) and D, by the router's count, 600 tokens of its own to prefill: lending the
    whole prompt misses the target, a split meets it with the least work on P. The prefix's KV reaches D through its
    prefix cache: D computes only the tail."""
    sim = hybrid_cluster({Role.PREFILL: 1, Role.DECODE: 1}, lendable_profile(), ttft_target=2.5)
    plans = recorded_plans(sim)
    prefill, decode = sim.pods
    prefill._prefill_rate = 1000.0
    prefill.publish()
    decode.info.queued_prompt_tokens = 600
    hits_before = decode.block_manager.prefix_hits
    first, split = sim.run([RequestSpec(0, 0.0, 700, 40), RequestSpec(1, 0.05, 1000, 3)], until=100.0)
    assert [plan.decision for plan in plans] == ["disaggregated", "split"]
    k = plans[1].prefix_tokens
    assert 0 < k < 1000 and k % 16 == 0
    assert (split.status, split.output_tokens) == ("ok", 3)
    assert decode.block_manager.prefix_hits - hits_before == k
    assert split.ttft <= 2.5 and split.ttft == pytest.approx(plans[1].predicted_ttft_s, rel=0.1)
    assert (decode.info.queued_prompt_tokens, prefill.info.queued_prompt_tokens) == (600, 0)  # the holds ended
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_hybrid_placement_lends_when_the_prefill_pod_is_busy():
    sim = hybrid_cluster({Role.PREFILL: 1, Role.DECODE: 1}, lendable_profile())
    plans = recorded_plans(sim)
    prefill, decode = sim.pods
    # P holds 16,000 prompt tokens, at a measured 1,000 tokens/s: 16 s of queue.
    for i in range(8):
        prefill.scheduler.add(Sequence(f"q{i}", [7] * 2000, SamplingParams(max_tokens=1, ignore_eos=True)))
    prefill._prefill_rate = 1000.0
    prefill.publish()
    [record] = sim.run([RequestSpec(0, 0.0, 500, 3)], until=100.0)
    assert record.status == "ok"
    [plan] = plans
    assert plan.prefill is None and plan.decode.address == decode.name
    assert record.ttft < 2.0  # chunked on D, not behind P's queue


def test_hybrid_placement_prefills_remotely_on_an_idle_prefill_pod_and_learns_the_transfer():
    profile = lendable_profile(transfer_overlap=0.5, link_gbps=1e-5)  # 500 tokens of 100 B: 5 s, 2.5 s exposed
    sim = hybrid_cluster({Role.PREFILL: 1, Role.DECODE: 1}, profile)
    plans = recorded_plans(sim)
    prefill, decode = sim.pods
    # Lent, 500 tokens take 10 chunks of 60 tokens (80 ms each); remote, one 0.52 s step: remote, while the router
    # has measured no transfer yet.
    [record] = sim.run([RequestSpec(0, 0.0, 500, 3)])
    assert record.status == "ok"
    assert plans[0].prefill.address == prefill.name and plans[0].decode.address == decode.name
    assert sim.policy.hybrid.transfer_s_per_token == pytest.approx(profile.transfer_s(500) / 500)
    # Now the router knows the 2.5 s exposed transfer: the next prompt of 500 goes to D, lent.
    sim.run([RequestSpec(1, sim.loop.now + 1.0, 500, 3)])
    assert plans[1].prefill is None


def test_the_decode_pods_step_time_is_the_profiles_where_it_sizes_chunks():
    profile = lendable_profile()
    model = profile_step_time(profile)
    assert model.known
    # 4 decodes at 2 ms each beside a chunk of n at 20 ms + 1 ms each (the prefill form): n = 52 in 80 ms.
    assert model.largest_chunk(4, 4000, 0.0805) == 52
    assert model.prefill_seconds(500) == pytest.approx(0.52)
    # Decodes alone, and a chunk alone (its start read off its attention positions), by the profile's forms, here
    # with the prefill form's attention term: 1 us per n * (s + n).
    model = profile_step_time(lendable_profile(prefill=StepFit(0.02, 0.001, 1e-6), decode=StepFit(0.02, 1e-5, 0.002)))
    assert model.predict(3, 0, 900) == pytest.approx(0.02 + 900 * 1e-5 + 3 * 0.002)
    assert model.predict(0, 100, attention_positions(400, 100)) == pytest.approx(0.02 + 0.1 + 100 * 500 * 1e-6)


def records(pools: list[str], **flags) -> list:
    """Two runs' records (status, token times) of a small simulation; ``BEFORE_HYBRID`` holds this function's
    output on the tree before hybrid scheduling existed (commit 919970a, without ``flags``)."""
    out = []
    for rate in (0.3, 0.6):
        config = SimulateConfig(pools=pools, workload="azure-conv", num_prompts=24, max_prompt_tokens=1024,
                                max_output_tokens=24, rates=[rate], seed=3, profile=str(RECORDED_PROFILE), **flags)
        out.append([[r.status, r.chunk_s] for r in simulate_records(config, rate)])
    return out


def test_disaggregated_and_colocated_give_exactly_the_records_of_before():
    before = json.loads(BEFORE_HYBRID.read_text())
    assert records(["prefill:1", "decode:2"], scheduling="disaggregated") == before["prefill:1,decode:2"]
    assert records(["prefill:1", "decode:1"], scheduling="colocated") == before["mixed:2"]
    assert records(["prefill:1", "decode:2"], scheduling="hybrid") != before["prefill:1,decode:2"]


def test_slo_map_derives_the_regimes_from_single_requests_and_maps_every_scheduling(tmp_path):
    from splitserve.simulator.slo_map import SLOMapConfig, run

    trace = tmp_path / "trace.csv"
    prompts = [100, 300, 200, 500, 150, 260]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{i},{p},8\n"
                                                                           for i, p in enumerate(prompts)))
    profile = tmp_path / "profile.json"
    lendable_profile(kv_bytes_per_token=50_000).save(profile)  # 1,342 blocks in the pods' default pool
    config = SLOMapConfig(pods=[2], per_pod_rates=[0.5, 1.0], requests_per_pod=3, workload=str(trace),
                          profile=str(profile))
    results = run(config, log=lambda line: None)
    # Alone on a mixed pod at the 128-token budget: a chunk of at most 128 tokens per step, 20 ms each + 1 ms per
    # token; then 20 ms + 2 ms per decode step.
    ttfts = sorted(-(-p // 128) * 0.02 + p * 0.001 for p in prompts)
    assert results["ttft0_s"] == pytest.approx((ttfts[2] + ttfts[3]) / 2)
    assert results["tpot0_s"] == pytest.approx(0.022)
    rows = results["goodput"]["2"]
    assert set(rows) == {"colocated", "disaggregated", "hybrid"}
    assert all(set(row) == {"tight-ttft", "balanced", "tight-tpot"} for row in rows.values())
    assert rows["disaggregated"]["balanced"]["on_decode"] == 0.0

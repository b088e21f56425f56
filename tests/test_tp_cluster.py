"""Tensor-parallel pods (issue 38): the CPU plan, the handshake's layout and the chart's resources for a pod of N
ranks; and through ``splitserve up``, prefill and decode pods of different degrees, on real processes over loopback,
give the offline engine's greedy answers token for token, and a rank killed mid-request ends in a retried request or
a clear error while its pod restarts whole and no KV block leaks.

KV between degrees: a tensor-parallel prefill pod pushes each rank's KV heads as chunks of their own (a K and a V
chunk per layer per rank: the count its Prefill answer reports, checked here through the pods), and a decode pod
writes each chunk's heads into the ranks that own them (engine/parallel/sharded_kv_cache.py;
tests/test_tp_kv_streams.py in-process). The tiny random model has 4 layers, 4 query and 2 KV heads: at TP 2 each
rank holds one KV head. Prefill computes in float32 on both sides (the
offline engine's too): the reference path, whatever the default.
"""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import grpc
import pytest

from splitserve.bench.soak import pod_load
from splitserve.cpu_plan import format_plan, plan_cpus
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels.cpu_features import prefill_compute_dtype
from splitserve.engine.parallel.layout import plan_shards
from splitserve.kvtransfer.handshake import KVLayout, check_compatible
from splitserve.launcher import Cluster
from splitserve.measure.serve_metrics import parse_counter
from splitserve.router.policies import FORCE_SPLIT_ENV
from splitserve.runtime.errors import StatusError
from splitserve.runtime.roles import Role
from splitserve.up_config import UpConfig
from splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.deploy.test_chart import chart, containers_by_component, objects, parsed_config  # noqa: F401 (fixture)
from tests.reliability.live_cluster import (
    MODEL,
    ROUTES,
    START_S,
    TINY,
    prompts,
    route_counts,
    router_counter,
    router_json,
    stream,
    wait_back,
    wait_every_block_free,
)

MAX_TOKENS = 24
TINY_LAYERS, TINY_KV_HEADS = 4, 2
SMOLLM2_LAYERS, SMOLLM2_KV_HEADS = 30, 3
PROMPTS = prompts(3, 48, seed=38)  # longer than the router's conditional threshold: each prefills on the prefill pod
SMOLLM2, SMOLLM2_PROMPTS = "smollm2-135m", ["The capital of France is", "def fibonacci(n):", "Write a haiku:"]
LONG_TOKENS = 600  # the stream a rank is killed under: long enough to outlast the kill on a busy machine
# Every prompt on the prefill pod, KV lossless, and a stream whose decode pod restarts waits for it to come back.
TP_CLUSTER = {**TINY, "prefill": 1, "decode": 1, "kv_codec": "none", "prefill_compute_dtype": "float32",
              "conditional_prefill_threshold": 0, "decode_pod_wait_s": START_S}


# ---- the plan and the handshake, without processes --------------------------------------------------------------

def test_a_pod_of_n_ranks_takes_n_cpus_worth_of_the_plan():
    pods = [("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE), ("decode-1", Role.DECODE)]
    plan = plan_cpus(pods, frozenset(range(8)), {}, {"prefill-0": 2, "decode-0": 1, "decode-1": 3})
    # roles weighted by ranks, 2 : 4 over 8 CPUs (2.67 : 5.33, so 3 : 5), decode's 5 split 1 : 3 (1.25 : 3.75)
    assert {n: (sorted(p.cpus), p.threads, p.ranks) for n, p in plan.items() if n != "router"} == {
        "prefill-0": ([0, 1, 2], 3, 2), "decode-0": ([3], 1, 1), "decode-1": ([4, 5, 6, 7], 4, 3)}
    # fewer CPUs than ranks: the pod's ranks share its CPU (one thread each), and the table says so
    small = plan_cpus(pods[:2], frozenset({0, 1}), {}, {"decode-0": 2})
    assert (sorted(small["decode-0"].cpus), small["decode-0"].threads) == ([1], 2)
    assert "2 (2 ranks)" in format_plan(list(small.values()))


def _layout(tp: int, **changes) -> KVLayout:
    model = ModelConfig(64, 64, 128, 2, num_heads=4, num_kv_heads=2)
    ranges = tuple(s.kv_heads for s in plan_shards(model, tp))
    fields = {"tensor_parallel_size": tp, "rank_kv_heads": ranges} | changes
    return KVLayout("tiny-random", 2, 2, 16, 16, "float32", weights_fingerprint="w", **fields)


def test_the_handshake_carries_the_degree_and_maps_any_two():
    for sender_tp in (1, 2, 4):  # 4 ranks: each KV head replicated on two
        sender = _layout(sender_tp)
        assert KVLayout.from_proto(sender.to_proto()) == sender
        for receiver_tp in (1, 2, 4):
            check_compatible(_layout(receiver_tp), sender, sender.compat_hash, "none", ["none"])
    assert _layout(4).rank_kv_heads == ((0, 1), (0, 1), (1, 2), (1, 2))


@pytest.mark.parametrize("ranges, reason", [
    (((0, 1),), "1 ranges for 2 ranks"),
    (((0, 1), (1, 3)), "not within the model's 2 KV heads"),
    (((0, 1), (0, 1)), "do not hold KV heads 0..1 once each"),
    (((1, 2), (0, 1)), "do not hold KV heads 0..1 once each"),
])
def test_a_layout_whose_heads_cannot_be_mapped_is_refused(ranges, reason):
    sender = _layout(2, rank_kv_heads=ranges)
    with pytest.raises(StatusError, match=reason) as refused:
        check_compatible(_layout(1), sender, sender.compat_hash, "none", ["none"])
    assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION and "rank_kv_heads" in str(refused.value)


# The ranks a pod's engine runs on: split by tensor (this module) or by pipeline stage (tests/test_pp_cluster.py);
# a rank's death, lending and the chart's resources take the same path either way (engine/parallel/workers.py).
PARALLEL = ("tensor", "pipeline")


@pytest.mark.parametrize("parallel", PARALLEL)
def test_lending_to_parallel_prefill_pods_is_refused(tmp_path, parallel):
    config = UpConfig(model=MODEL, run_dir=str(tmp_path), lend_decode_cpus=True, prefill_cpus="0", decode_cpus="1",
                      scheduling="disaggregated", **{f"prefill_{parallel}_parallel_size": 2})
    with pytest.raises(ValueError, match=f"prefill_{parallel}_parallel_size > 1 is not built"):
        Cluster(config)


@pytest.mark.parametrize("parallel", PARALLEL)
def test_the_chart_gives_a_pod_its_ranks_and_n_times_one_rank_s_resources(chart, parallel):  # noqa: F811
    rank = {"requests": {"cpu": "1500m", "memory": "1.5Gi"}, "limits": {"cpu": 2, "memory": "3Gi"}}
    value = {"tensor": "tensorParallelSize", "pipeline": "pipelineParallelSize"}[parallel]
    deployments = containers_by_component(objects(chart, {"decode": {value: 2, "resources": rank}}))
    decode = deployments["decode"]["spec"]["template"]["spec"]["containers"][0]
    assert decode["resources"] == {"requests": {"cpu": "3000m", "memory": "3Gi"},
                                   "limits": {"cpu": "4", "memory": "6Gi"}}
    config, other = parsed_config(deployments["decode"]), parsed_config(deployments["prefill"])
    assert (config.tensor_parallel_size * config.pipeline_parallel_size, config.num_threads) == (2, 4)  # every rank's
    assert getattr(config, f"{parallel}_parallel_size") == 2 and getattr(other, f"{parallel}_parallel_size") == 1


# ---- real clusters -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def offline():
    """The offline engine's greedy answers, TP 1, float32 prefill."""
    engine = LLM(model=MODEL, num_blocks=512, prefill_compute_dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    answers = [list(out.token_ids) for out in engine.generate(PROMPTS, params)]
    long = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True))
    return answers, list(long[0].token_ids)


def rank_workers(pod_pid: int) -> list[int]:
    """The pids of the tensor-parallel rank processes (ranks 1..N-1) the pod ``pod_pid`` started."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or one that just exited
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pod_pid and b"splitserve.engine.parallel.rank_worker" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def kv_loaded(cluster, pod) -> float:
    """Pushed prompt KV the decode pod ``pod`` admitted (``splitserve_kv_load_total{outcome="loaded"}``)."""
    with urllib.request.urlopen(f"http://{cluster.config.host}:{pod.metrics_port}/metrics", timeout=5) as reply:
        return parse_counter(reply.read().decode(), "splitserve_kv_load_total", {"outcome": "loaded"}) or 0.0


def check_answers(cluster, prompt_list: list[list[int]], answers: list[list[int]], degrees: tuple[int, int],
                  shape: tuple[int, int] = (TINY_LAYERS, TINY_KV_HEADS)) -> None:
    """Each pod runs its degree's ranks and says so; each prompt prefilled on the prefill pod, its KV loaded on the
    decode pod, gives ``answers``; every block is free after."""
    prefill, decode = cluster.pods
    for pod, size in zip((prefill, decode), degrees):
        assert len(rank_workers(cluster.pid(pod.name))) == size - 1, pod.name
        assert pod_load(cluster.address(pod)).tensor_parallel_size == size, pod.name
        assert cluster.cpu_plan[pod.name].ranks == size
    seen = {pod["address"]: pod["load"]["tensor_parallel_size"] for pod in router_json(cluster, "/pods")["pods"]}
    assert seen == {cluster.address(prefill): degrees[0], cluster.address(decode): degrees[1]}  # the router's view
    got = [stream(cluster, prompt, len(answer), timeout_s=START_S) for prompt, answer in zip(prompt_list, answers)]
    assert [(a.finish, a.error) for a in got] == [("FINISH_REASON_LENGTH", "")] * len(prompt_list)
    assert [a.token_ids for a in got] == answers
    assert kv_loaded(cluster, decode) == len(prompt_list)  # every prompt's KV came from the prefill pod
    # One push straight to the prefill pod: a K and a V chunk per layer for each rank's own KV heads (at TP 1, all).
    pushed = prefill_pb2.PrefillRequest(
        request_id="heads-check", prompt_token_ids=prompt_list[0], decode_address=cluster.address(decode),
        kv_codec="none", kv_lease_seconds=30.0,
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=1))
    with grpc.insecure_channel(cluster.address(prefill)) as channel:
        answer = prefill_pb2_grpc.PrefillStub(channel).Prefill(pushed, timeout=START_S)
    with grpc.insecure_channel(cluster.address(decode)) as channel:  # nobody claims it: dropped, not leased out
        assert decode_pb2_grpc.DecodeStub(channel).Abort(common_pb2.AbortRequest(request_id="heads-check"),
                                                         timeout=30).found
    layers, kv_heads = shape  # the model's
    assert answer.kv_transfer.num_chunks == layers * 2 * min(degrees[0], kv_heads), answer.kv_transfer
    wait_every_block_free(cluster)


@pytest.mark.e2e
@pytest.mark.parametrize("degrees", [(1, 2), (2, 1), (2, 2)])
def test_pods_of_different_degrees_answer_as_the_offline_engine(tmp_path, start_cluster, offline, degrees):
    cluster = start_cluster(tmp_path, **TP_CLUSTER, prefill_tensor_parallel_size=degrees[0],
                            decode_tensor_parallel_size=degrees[1])
    try:
        check_answers(cluster, PROMPTS, offline[0], degrees)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def smollm2_offline():
    """SmolLM2's prompts as token ids, and the offline engine's greedy answers (TP 1, float32 prefill)."""
    llm = LLM(model=SMOLLM2, num_blocks=256, prefill_compute_dtype="float32")
    prompt_ids = [llm.tokenizer.encode(text) for text in SMOLLM2_PROMPTS]
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return prompt_ids, [list(out.token_ids) for out in outputs]


@pytest.mark.model
@pytest.mark.e2e
@pytest.mark.parametrize("degrees", [(1, 2), (2, 1)])
def test_smollm2_pods_of_different_degrees_answer_as_the_offline_engine(tmp_path, start_cluster, smollm2_offline,
                                                                        degrees):
    """The real model: 9 query and 3 KV heads, split unevenly at TP 2 (2 + 1 KV heads)."""
    cluster = start_cluster(tmp_path, **{**TP_CLUSTER, "model": SMOLLM2, "kv_cache_memory_bytes": 64 << 20},
                            prefill_tensor_parallel_size=degrees[0], decode_tensor_parallel_size=degrees[1])
    try:
        check_answers(cluster, *smollm2_offline, degrees, shape=(SMOLLM2_LAYERS, SMOLLM2_KV_HEADS))
    finally:
        cluster.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_rank_killed_mid_request_restarts_its_pod_whole(tmp_path, start_cluster, offline, parallel):
    """SIGKILL of a decode pod's rank 1 while it streams: the pod ends, and the stream moves to the pod's next life
    (the router's migration, which waits for it: ``decode_pod_wait_s``), one migration, with the offline answer
    token for token; its supervisor starts it again with new ranks, it serves, and every block is free on every
    pod."""
    cluster = start_cluster(tmp_path, **TP_CLUSTER, **{f"decode_{parallel}_parallel_size": 2})
    try:
        decode = cluster.pods[1]
        (rank,) = rank_workers(cluster.pid(decode.name))
        answer = stream(cluster, PROMPTS[0], LONG_TOKENS, timeout_s=3 * START_S,
                        after_first_chunk=lambda: os.kill(rank, signal.SIGKILL))
        assert (answer.finish, answer.error, answer.token_ids) == ("FINISH_REASON_LENGTH", "", offline[1]), answer
        assert router_counter(cluster, "splitserve_router_migrations_total") == 1  # moved once, to the next life
        wait_back(cluster, decode.name, restarts=1)
        new_ranks = rank_workers(cluster.pid(decode.name))
        assert len(new_ranks) == 1 and new_ranks != [rank]
        again = stream(cluster, PROMPTS[1], MAX_TOKENS)
        assert again.token_ids == offline[0][1]
        assert cluster.restarts == {**{name: 0 for name in cluster.restarts}, decode.name: 1}
        wait_every_block_free(cluster)
    finally:
        cluster.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_prefill_rank_killed_before_a_request_fails_the_pod_not_the_request(tmp_path, start_cluster, offline,
                                                                               parallel):
    """SIGKILL of a prefill pod's rank 1, then a request at once: whether it meets the dying pod's failed step
    (UNAVAILABLE: the pod's failure, so the router retries, on the decode pod) or the pod already draining or back,
    it gives the offline answer; the prefill pod restarts once with new ranks, and every block is free."""
    cluster = start_cluster(tmp_path, **TP_CLUSTER, **{f"prefill_{parallel}_parallel_size": 2})
    try:
        prefill = cluster.pods[0]
        (rank,) = rank_workers(cluster.pid(prefill.name))
        os.kill(rank, signal.SIGKILL)
        answer = stream(cluster, PROMPTS[2], MAX_TOKENS, timeout_s=START_S)
        assert (answer.finish, answer.error, answer.token_ids) == ("FINISH_REASON_LENGTH", "", offline[0][2])
        wait_back(cluster, prefill.name, restarts=1)
        assert len(rank_workers(cluster.pid(prefill.name))) == 1
        assert stream(cluster, PROMPTS[0], MAX_TOKENS).token_ids == offline[0][0]
        assert cluster.restarts == {**{name: 0 for name in cluster.restarts}, prefill.name: 1}
        wait_every_block_free(cluster)
    finally:
        cluster.stop()


@pytest.mark.e2e
def test_a_tensor_parallel_decode_pod_in_float32_beside_bf16_prefill_pods_never_splits_a_prompt(
        tmp_path, start_cluster, monkeypatch):
    """Under ``auto`` a TP 2 decode pod computes prefill in float32, the prefill pod in this CPU's format (bfloat16
    with avx512_bf16 or AMX). Every prompt asked to split (``FORCE_SPLIT_ENV``) goes whole to one pod instead, and
    answers as the offline engine in that pod's format: float32 where the decode pod prefilled it (lent), the prefill
    pod's where it pushed the KV. Where ``auto`` is float32 on both, the formats agree and the prompts split."""
    resolved = prefill_compute_dtype("auto")
    monkeypatch.setenv(FORCE_SPLIT_ENV, "16")  # the router's
    cluster = start_cluster(tmp_path, **{**TP_CLUSTER, "prefill_compute_dtype": "auto", "scheduling": "hybrid",
                                         "decode_tensor_parallel_size": 2})
    try:
        prefill, decode = cluster.pods
        assert (pod_load(cluster.address(prefill)).prefill_compute_dtype,
                pod_load(cluster.address(decode)).prefill_compute_dtype) == (resolved, "float32")
        offline = {fmt: LLM(model=MODEL, num_blocks=128, prefill_compute_dtype=fmt).generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
            for fmt in {resolved, "float32"}}
        for i, prompt in enumerate(PROMPTS):
            before = route_counts(cluster)
            answer = stream(cluster, prompt, MAX_TOKENS)
            taken = {name: n - before[name] for name, n in route_counts(cluster).items()}
            [route] = [name for name in ROUTES if taken[name]]
            assert route != "split" if resolved != "float32" else route == "split", taken
            fmt = "float32" if route == "prefill_on_decode" else resolved
            assert answer.token_ids == list(offline[fmt][i].token_ids), (route, fmt)
        wait_every_block_free(cluster)
    finally:
        cluster.stop()

"""Pipeline-parallel pods (issue 38's second step): ``--pipeline-parallel-size`` on prefill and decode pods, per role
in ``splitserve up``, in the CPU plan and the chart; through ``splitserve up``, a prefill pod of 2 stages feeding a
decode pod of one process gives the offline engine's greedy answers token for token. A stage killed ends in a
retried request or a clear error while its pod restarts whole and no KV block leaks: the tensor-parallel rank-death
path, which the pipeline's ranks share (engine/parallel/workers.py): tested for both kinds of ranks in
tests/test_tp_cluster.py, as are lending refused to such prefill pods and the chart's resources x ranks.

A pipeline-parallel engine's KV pool is one file of every layer that rank 0 maps as an ordinary cache, so the KV
wire and the handshake are a one-process pod's (tensor_parallel_size 1). It computes prefill in float32, so both
sides and the offline engine pin prefill_compute_dtype float32 (TP_CLUSTER).
"""

from __future__ import annotations

import pytest

from splitserve.bench.soak import pod_load
from splitserve.launcher import Cluster
from splitserve.runtime.roles import Role
from splitserve.up_config import UpConfig
from tests.deploy.test_chart import chart, objects  # noqa: F401 (fixture)
from tests.reliability.live_cluster import MODEL, START_S, stream, wait_every_block_free
from tests.test_tp_cluster import (  # noqa: F401 (fixtures)
    MAX_TOKENS,
    PROMPTS,
    TP_CLUSTER,
    kv_loaded,
    offline,
    rank_workers,
    smollm2_offline,
)

SMOLLM2 = "smollm2-135m"


# ---- configuration, the plan and the chart, without processes ----------------------------------------------------

def test_each_role_s_pods_get_their_stages_in_the_plan(tmp_path):
    config = UpConfig(model=MODEL, run_dir=str(tmp_path), prefill=1, decode=1, prefill_pipeline_parallel_size=2,
                      prefill_cpus="0", decode_cpus="1")
    assert [config.ranks(role) for role in (Role.PREFILL, Role.DECODE, Role.MIXED)] == [2, 1, 1]
    plan = Cluster(config).cpu_plan
    # one CPU for two stages: each stage a thread of its own on it (fewer CPUs than ranks)
    assert (plan["prefill-0"].ranks, plan["prefill-0"].threads, sorted(plan["prefill-0"].cpus)) == (2, 2, [0])
    assert plan["decode-0"].ranks == 1


def test_tensor_and_pipeline_parallel_together_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size and pipeline_parallel_size both above 1 is not built"):
        UpConfig(model=MODEL, run_dir=str(tmp_path), decode_tensor_parallel_size=2, decode_pipeline_parallel_size=2)


def test_the_chart_refuses_tensor_and_pipeline_parallel_on_one_pod(chart):  # noqa: F811
    with pytest.raises(Exception, match="both above 1 is not built"):
        objects(chart, {"decode": {"pipelineParallelSize": 2, "tensorParallelSize": 2}})


# ---- real clusters -------------------------------------------------------------------------------------------------

def stages(cluster, pod) -> int:
    """The processes the pod's engine runs its layers on: rank 0 (the pod) and the workers it started."""
    return 1 + len(rank_workers(cluster.pid(pod.name)))


def check_answers(cluster, prompt_list: list[list[int]], answers: list[list[int]], sizes: tuple[int, int]) -> None:
    """Each pod runs its stages, as the plan says, and reports them and no tensor parallelism (the KV wire is TP 1's);
    each prompt prefilled on the prefill pod, its KV loaded on the decode pod, gives ``answers``; every block is free
    after."""
    prefill, decode = cluster.pods
    for pod, size in zip((prefill, decode), sizes):
        assert stages(cluster, pod) == size == cluster.cpu_plan[pod.name].ranks, pod.name
        load = pod_load(cluster.address(pod))
        assert (load.tensor_parallel_size, load.pipeline_parallel_size) == (1, size), pod.name
    got = [stream(cluster, prompt, len(answer), timeout_s=START_S) for prompt, answer in zip(prompt_list, answers)]
    assert [(a.finish, a.error) for a in got] == [("FINISH_REASON_LENGTH", "")] * len(prompt_list)
    assert [a.token_ids for a in got] == answers
    assert kv_loaded(cluster, decode) == len(prompt_list)  # every prompt's KV came from the prefill pod
    wait_every_block_free(cluster)


@pytest.mark.e2e
@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)])
def test_pipeline_parallel_pods_answer_as_the_offline_engine(tmp_path, start_cluster, offline, sizes):  # noqa: F811
    """Tiny random model, 2 layers: one a stage."""
    cluster = start_cluster(tmp_path, **TP_CLUSTER, prefill_pipeline_parallel_size=sizes[0],
                            decode_pipeline_parallel_size=sizes[1])
    try:
        check_answers(cluster, PROMPTS, offline[0], sizes)
    finally:
        cluster.stop()


@pytest.mark.model
@pytest.mark.e2e
def test_smollm2_prefill_pod_of_two_stages_answers_as_the_offline_engine(tmp_path, start_cluster,
                                                                          smollm2_offline):  # noqa: F811
    """The real model, 30 layers: 15 a stage on the prefill pod, the decode pod one process."""
    cluster = start_cluster(tmp_path, **{**TP_CLUSTER, "model": SMOLLM2, "kv_cache_memory_bytes": 64 << 20},
                            prefill_pipeline_parallel_size=2)
    try:
        check_answers(cluster, *smollm2_offline, (2, 1))
    finally:
        cluster.stop()

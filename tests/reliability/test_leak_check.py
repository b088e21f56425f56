"""The leak check the reliability tests end with (``live_cluster.wait_every_block_free``) fails on a leaked lease.

A decode pod frees pushed KV that no Decode call claimed when its lease expires, so a check that only waits for
every block to come free passes a leak if it waits longer than the lease. The check also reads every pod's
``splitserve_kv_leases_expired_total``: here a leak is injected (a prefill pod pushes a prompt's KV to the decode pod
under a 1 s lease, straight through the pod's API, and nobody claims or drops it) and the check must fail on it,
although every block is free by then. A pod whose /metrics does not answer fails it too (its count unread is
no count of 0)."""

from __future__ import annotations

import socket

import grpc
import live_cluster as live
import pytest

from splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.e2e


def test_a_lease_left_to_expire_fails_the_leak_check_though_its_blocks_came_free(tiny_pd_up):
    cluster = tiny_pd_up
    prefill = next(pod for pod in cluster.pods if pod.role == "prefill")
    decode = next(pod for pod in cluster.pods if pod.role == "decode")
    before = live.leases_expired(cluster)
    live.wait_every_block_free(cluster, since=before)  # nothing leaked yet: the check passes
    with grpc.insecure_channel(cluster.address(prefill)) as channel:
        pushed = prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id="leaked-on-purpose", prompt_token_ids=live.prompts(1, 48, seed=5)[0],
            sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=4),
            decode_address=cluster.address(decode), kv_codec="none", kv_lease_seconds=1.0), timeout=60)
    assert pushed.kv_transfer.bytes_sent > 0  # the KV waits on the decode pod, unclaimed
    with pytest.raises(AssertionError, match="KV leases expired") as failed:
        live.wait_every_block_free(cluster, since=before)
    assert decode.name in str(failed.value)
    # What the check alone saw before it read the counter: every block free (the lease freed them).
    assert all(live.blocks_in_use(cluster.address(pod)) == 0 for pod in cluster.pods)


def test_a_pod_whose_metrics_do_not_answer_fails_the_leak_check(tiny_pd_up, monkeypatch):
    """A count the check cannot read is no count of 0: the decode pod's /metrics moved to a port nothing listens on
    (as a pod that hangs or died between its blocks' check and its counter's read), the check fails naming it."""
    cluster = tiny_pd_up
    decode = next(pod for pod in cluster.pods if pod.role == "decode")
    assert live.leases_expired(cluster, answer_within_s=1)[decode.name][1] >= 0  # it answers now
    with socket.socket() as closed:  # a port free now, and nothing listening on it
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(decode, "metrics_port", closed.getsockname()[1])
    with pytest.raises(AssertionError, match=rf"{decode.name}'s /metrics .* did not answer within 1 s"):
        live.leases_expired(cluster, answer_within_s=1)  # what wait_every_block_free reads last

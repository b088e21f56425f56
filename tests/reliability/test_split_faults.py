"""Faults on the split path, with real pod processes (1 prefill + 2 decode pods, tiny random model, hybrid
scheduling, float32 prefill on the pods and the offline engine alike), each made by the test, never by the machine's
timing: the router's environment names ``SPLITSERVE_TEST_FORCE_SPLIT_TOKENS`` (router/policies.py), so every prompt
longer than ``PREFIX`` tokens prefills its first ``PREFIX`` on the prefill pod, pushed to the decode pod, and the rest
there; and the router picks decode pods in turn (``round_robin``), so the test knows which one a request goes to.

- a full decode pod refuses a split's Decode call (RESOURCE_EXHAUSTED: its queue is full, ``max_waiting_requests``
  1 and one request running, one waiting) after the prefix's KV arrived there and before it claimed it: the router
  drops the prefix there at once and retries on the other decode pod, which prefills the prompt: the client gets the
  offline engine's answer, and no block stays held nor lease expires on the full pod (the prefix is not left to its
  lease: this fails without the drop);
- the prefill pod killed after it pushed a split's prefix (its push held, by the pods' test hook
  ``SPLITSERVE_TEST_HOLD_PUSH``, kvtransfer/push_hold.py, once the decode pod acknowledged it and before the prefill
  pod answered, then SIGKILL): the decode pod holds the prefix under a lease no Decode call will claim; the router
  drops it there before the retry, which the decode pod prefills, with the offline engine's answer; every block is
  free before the prefix's lease could expire (this fails without the drop).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import live_cluster as live
import pytest

from splitserve.kvtransfer.push_hold import BEFORE_ANSWER, PushHolds
from splitserve.router.policies import FORCE_SPLIT_ENV
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

pytestmark = pytest.mark.e2e

PREFIX = 32  # two blocks of the decode pod
PROMPT_LEN = 80
MAX_TOKENS = 8
OCCUPY_TOKENS = 4000  # each request that fills the decode pod: tens of seconds; cancelled by the test


@pytest.fixture(scope="module")
def holds(tmp_path_factory) -> PushHolds:
    return PushHolds(tmp_path_factory.mktemp("push-holds"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster, holds):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FORCE_SPLIT_ENV, str(PREFIX))  # the router's
        for name, value in holds.env().items():  # the prefill pod's: its pushes can be held at a known point
            env.setenv(name, value)
        env.setenv("SPLITSERVE_MAX_WAITING_REQUESTS", "1")  # the pods': one waiting request fills a pod's queue
        running = start_cluster(tmp_path_factory.mktemp("split-faults"), **{
            **live.TINY, "decode": 2, "scheduling": "hybrid", "policy": "round_robin",
            "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 1})
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def every_block_free_afterwards(cluster):
    before = live.leases_expired(cluster)
    yield
    live.wait_every_block_free(cluster, timeout_s=live.KV_LEASE_S / 2, since=before)


def splits(cluster) -> float:
    return live.router_counter(cluster, "splitserve_router_routing_decisions_total", decision="split")


def decode_requests(cluster) -> dict[str, float]:
    """{address: requests the router sent there} of the decode pods."""
    return {cluster.address(pod): live.router_counter(cluster, "splitserve_router_pod_requests_total",
                                                      pod_address=cluster.address(pod))
            for pod in cluster.pods if pod.role == "decode"}


class Occupied:
    """A decode pod's one batch slot and its one queue place taken, by requests sent straight to it (the router
    does not count them) until ``release``."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(self.address)
        stub = decode_pb2_grpc.DecodeStub(self.channel)
        self.calls = [stub.Decode(decode_pb2.DecodeRequest(
            request_id=f"occupy-{i}", prompt_token_ids=live.prompts(1, 16, seed=40 + i)[0],
            sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=OCCUPY_TOKENS, ignore_eos=True)),
            timeout=300) for i in range(2)]
        live.wait_until(lambda: live.pod_load(self.address).num_waiting >= 1, 60, "a request waiting on the decode pod")

    def release(self) -> None:
        for call in self.calls:
            call.cancel()  # the pod aborts them and frees their blocks
        self.channel.close()


def test_a_full_decode_pod_refusing_a_split_holds_no_prefix_and_the_request_is_served_by_the_other(cluster):
    prompts = live.prompts(2, PROMPT_LEN, seed=21)
    expected = live.offline_answers(prompts, MAX_TOKENS)
    before = decode_requests(cluster)
    assert live.stream(cluster, prompts[0], MAX_TOKENS).token_ids == expected[0]  # a split, on one decode pod ...
    [first] = [address for address, n in decode_requests(cluster).items() if n > before[address]]
    [full] = [address for address in before if address != first]  # ... so the next request's goes to the other
    split_before, lent_before = splits(cluster), live.router_counter(
        cluster, "splitserve_router_routing_decisions_total", decision="prefill_on_decode")
    refused_before = live.router_counter(cluster, "splitserve_router_retries_total", code="RESOURCE_EXHAUSTED")
    leases_before, occupied = live.leases_expired(cluster), Occupied(full)
    try:
        sent_at = time.monotonic()
        answer = live.stream(cluster, prompts[1], MAX_TOKENS)
        assert live.pod_load(full).num_waiting >= 1  # still full when the answer came: the other pod served it
    finally:
        occupied.release()
    # Every block free before the refused prefix's lease could expire: dropped at the refusal, not leased out.
    live.free_before_the_lease(cluster, sent_at, since=leases_before)
    assert (answer.finish, answer.token_ids) == ("FINISH_REASON_LENGTH", expected[1]), answer
    assert splits(cluster) == split_before + 1  # refused on the full pod: its prefix had been pushed there
    assert live.router_counter(cluster, "splitserve_router_retries_total", code="RESOURCE_EXHAUSTED") == \
        refused_before + 1
    assert live.router_counter(cluster, "splitserve_router_routing_decisions_total", decision="prefill_on_decode") == \
        lent_before + 1  # the retry: the other decode pod prefilled it (the prefill pod of the failed try left out)


def test_the_prefill_pod_killed_after_pushing_a_splits_prefix_leaves_no_lease_and_the_decode_pod_prefills(
        cluster, holds):
    prefill = next(pod for pod in cluster.pods if pod.role == "prefill")
    prompt = live.prompts(1, PROMPT_LEN, seed=22)[0]
    expected = live.offline_answers([prompt], MAX_TOKENS)[0]
    split_before, restarts = splits(cluster), cluster.restarts[prefill.name]
    lent_before = live.router_counter(cluster, "splitserve_router_routing_decisions_total",
                                      decision="prefill_on_decode")
    retried_before = live.router_counter(cluster, "splitserve_router_retries_total", code="UNAVAILABLE")
    leases_before, before = live.leases_expired(cluster), decode_requests(cluster)
    answers: list = []
    holds.arm(BEFORE_ANSWER)  # the prefix's push acknowledged, the prefill pod stops before it answers the router
    try:
        sent_at = time.monotonic()
        sender = threading.Thread(target=lambda: answers.append(live.stream(cluster, prompt, MAX_TOKENS)))
        sender.start()
        holds.wait_held(BEFORE_ANSWER, 60)
        [split_on] = [address for address, n in decode_requests(cluster).items() if n > before[address]]
        assert live.blocks_in_use(split_on) >= PREFIX // 16  # the prefix's blocks, under their lease
        os.kill(cluster.pid(prefill.name), signal.SIGKILL)
    finally:
        holds.release(BEFORE_ANSWER)
    sender.join(timeout=120)
    [answer] = answers
    assert (answer.finish, answer.token_ids) == ("FINISH_REASON_LENGTH", expected), answer
    # Every block free before the prefix's lease could expire: dropped when the prefill pod failed, not leased out.
    live.free_before_the_lease(cluster, sent_at, since=leases_before)
    assert splits(cluster) == split_before + 1  # the one split, on the killed pod
    assert live.router_counter(cluster, "splitserve_router_retries_total", code="UNAVAILABLE") == retried_before + 1
    assert live.router_counter(cluster, "splitserve_router_routing_decisions_total", decision="prefill_on_decode") == \
        lent_before + 1  # the retry, without the prefill pod that failed it: a decode pod prefilled the prompt
    live.wait_back(cluster, prefill.name, restarts + 1)

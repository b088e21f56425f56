"""A lease that expires is counted (splitserve_kv_leases_expired_total), so a leak check can fail on one instead of
waiting for the blocks to come free, which an expired lease also brings about (issue 35)."""

from splitserve.v1 import common_pb2
from tests.test_pods import GREEDY, metric, prompt_of
from tests.test_pods import pods as real_pods  # noqa: F401  (the fixture: a prefill and a decode pod, in-process)

EXPIRED = "splitserve_kv_leases_expired_total"


def test_an_expired_lease_is_counted_and_a_claimed_or_dropped_one_is_not(real_pods):  # noqa: F811
    pods = real_pods
    before = metric(pods.decode_pod, EXPIRED)
    claimed = prompt_of(40, seed=6100)
    pods.run_decode("claimed", claimed, GREEDY, pods.run_prefill("claimed", claimed, GREEDY, lease_s=0.5))
    pods.run_prefill("dropped", prompt_of(40, seed=6101), GREEDY, lease_s=0.5)
    assert pods.decode.Abort(common_pb2.AbortRequest(request_id="dropped")).found
    pods.run_prefill("left", prompt_of(40, seed=6102), GREEDY, lease_s=0.3)
    pods.wait_all_free("decode", timeout_s=3)
    assert metric(pods.decode_pod, EXPIRED) == before + 1

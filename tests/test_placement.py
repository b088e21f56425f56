"""``Placement`` (router/placement.py) tested as a scheduler is: hand-made pod snapshots in, exact decisions out, no
server, no clock, no pod call. Each decision in the order a request meets it: admission, the route, a retry after a
failure before the first token, a migration after one mid-stream."""

import grpc
import pytest

from splitserve.engine.sampling.params import SamplingParams
from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.placement import Migration, Placement, Retry
from splitserve.router.pods.registry import PodInfo, PodLoad, PodSnapshot
from splitserve.router.policies import LocalPrefill, make_policy
from splitserve.router.route_plan import RoutePlan
from splitserve.runtime.errors import StatusError

BLOCK = 16


def pod(address, role="decode", running=0, queued=0, rate=0.0, free=100):
    """A pod as its last load report shows it: ``queued`` prompt tokens to prefill at ``rate`` tokens/s."""
    load = PodLoad(num_running=running, free_kv_blocks=free, total_kv_blocks=100, block_size=BLOCK,
                   queued_prefill_tokens=queued, prefill_tokens_per_second=rate)
    return PodInfo(address, role, load, serving=True)


def placement(**config) -> Placement:
    settings = {"decode_pods": ["d1:1"], "max_pending_requests": 2, "max_queue_time_s": 30.0, "max_retries": 2,
                "max_migrations": 2, **config}
    return Placement(RouterConfig(**settings), make_policy("least_loaded", LocalPrefill(threshold=8)))


def request(num_tokens=64) -> RouterRequest:
    return RouterRequest("r", [10 + i for i in range(num_tokens)], SamplingParams())


def refusal(decide) -> StatusError:
    with pytest.raises(StatusError) as refused:
        decide()
    return refused.value


# ---- 1: admission ---------------------------------------------------------------------------------------------------

def test_admission_refuses_past_max_pending_with_the_soonest_prefill_pods_wait_as_the_hint():
    pods = PodSnapshot(prefill=[pod("p1", "prefill", queued=300, rate=100.0), pod("p2", "prefill", queued=500,
                                                                                  rate=250.0)],
                       decode=[pod("d1", queued=100, rate=10.0)])
    placement().admit(2, pods)  # this one counted: two waiting is the limit
    refused = refusal(lambda: placement().admit(3, pods))
    assert (refused.code, refused.retry_after_s) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 2.0)  # p2: 500 / 250
    assert refused.message == ("2 requests are already waiting for their first token (the router's "
                               "max_pending_requests is 2); retry later")
    # No prefill pod: the decode pods prefill, and their waits are the hint; none measured yet: a second.
    assert refusal(lambda: placement().admit(3, PodSnapshot([], pods.decode))).retry_after_s == 10.0
    assert refusal(lambda: placement().admit(3, PodSnapshot([], [pod("d1")]))).retry_after_s == 1.0
    placement(max_pending_requests=0).admit(10_000, pods)  # 0: no limit


# ---- 2: the route ---------------------------------------------------------------------------------------------------

def test_a_route_leaves_out_the_pods_that_failed_the_request():
    pods = PodSnapshot(prefill=[pod("p1", "prefill", queued=100), pod("p2", "prefill", queued=20)],
                       decode=[pod("d1", running=1), pod("d2")])
    routes = placement()

    def route(avoid=()):
        plan = routes.route(request(), pods, frozenset(avoid))
        return plan.prefill.address if plan.prefill else None, plan.decode.address, plan.reason

    assert route() == ("p2", "d2", "disaggregated")
    assert route({"p2", "d2"}) == ("p1", "d1", "disaggregated")
    # Every pod failed it: no prefill pod is left (D prefills the prompt), and a decode pod is, the least loaded.
    assert route({"p1", "p2", "d1", "d2"}) == (None, "d2", "no prefill pod: prefill on the decode pod")
    assert routes.route(request(4), pods).prefill is None  # a short prompt prefills on D


def test_a_route_is_refused_when_its_prefill_pod_is_behind_by_more_than_max_queue_time():
    pods = PodSnapshot(prefill=[pod("p1", "prefill", queued=5000, rate=100.0)], decode=[pod("d1")])
    refused = refusal(lambda: placement().route(request(), pods))
    assert (refused.code, refused.retry_after_s) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 20.0)
    assert refused.message == ("the least loaded pod would start this prompt in about 50.0 s (5000 prompt tokens "
                               "queued at 100 tokens/s), past the router's max_queue_time_s (30 s); retry later")
    assert placement(max_queue_time_s=60.0).route(request(), pods).prefill.address == "p1"
    assert refusal(lambda: placement().route(request(), PodSnapshot(pods.prefill, []))).code is (
        grpc.StatusCode.UNAVAILABLE)  # no decode pod serves


# ---- 3: a failure before the first token ----------------------------------------------------------------------------

def test_a_failure_before_the_first_token_is_retried_on_other_pods_with_a_doubling_backoff():
    p, d = pod("p1", "prefill"), pod("d1")
    plan, retries = RoutePlan(p, d, "disaggregated"), placement()
    gone = StatusError(grpc.StatusCode.UNAVAILABLE, "pod d1: gone", peer="d1")
    tried = frozenset({"p1", "d1"})
    assert retries.retry(gone, plan, 1) == Retry(again=True, avoid=tried, backoff_s=0.1, suspect="d1")
    assert retries.retry(gone, plan, 2) == Retry(again=True, avoid=tried, backoff_s=0.2, suspect="d1")
    assert retries.retry(gone, plan, 3) == Retry(again=False, avoid=tried, backoff_s=0.4, suspect="d1")
    # A prefill pod answers UNAVAILABLE for a push its decode pod broke off: it is passed over, not suspect.
    push_broke = StatusError(grpc.StatusCode.UNAVAILABLE, "pod p1: push failed", peer="p1")
    assert retries.retry(push_broke, plan, 1) == Retry(again=True, avoid=tried, backoff_s=0.1, suspect=None)
    full = StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pod d1: full", peer="d1")
    assert retries.retry(full, RoutePlan(None, d, "short"), 1) == Retry(True, frozenset({"d1"}), 0.1, None)
    bad = StatusError(grpc.StatusCode.INVALID_ARGUMENT, "pod d1: bad", peer="d1")
    assert not retries.retry(bad, plan, 1).again
    assert not placement(max_retries=0).retry(gone, plan, 1).again


# ---- 4: a decode pod lost after the first token ---------------------------------------------------------------------

def test_a_broken_stream_migrates_while_max_migrations_allows():
    migrations = placement()
    gone = StatusError(grpc.StatusCode.UNAVAILABLE, "pod d1: gone", peer="d1")
    broke = StatusError(grpc.StatusCode.INTERNAL, "pod d1: stream broke", peer="d1")
    full = StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pod d2: full", peer="d2")
    assert migrations.after_break(gone, "d1", 0) == Migration(again=True, suspect="d1")
    assert migrations.after_break(broke, "d1", 1) == Migration(again=True, suspect=None)
    assert migrations.after_break(gone, "d1", 2) == Migration(again=False, suspect="d1")
    # A full target is no reason to stop a stream, but a migration's target that refused is passed over.
    assert migrations.after_break(full, "d2", 1) == Migration(again=False, suspect=None)
    assert migrations.after_break(full, "d2", 1, target_failed=True) == Migration(again=True, suspect=None)


def test_a_migration_goes_to_a_pod_that_has_not_failed_the_request_unless_it_restarted_since():
    d1, d2, d3 = pod("d1"), pod("d2", running=3), pod("d3", running=1)
    migrations, tokens = placement(), list(range(40))
    assert migrations.migration_target(tokens, {"d1": 10.0}, [d1, d2, d3]).address == "d3"
    assert migrations.migration_target(tokens, {"d1": 10.0, "d3": 11.0}, [d1, d2, d3]).address == "d2"
    assert migrations.migration_target(tokens, {"d1": 10.0}, [d1]) is None
    d1.serving_since = 12.0  # began to serve again since it failed: a new process
    assert migrations.migration_target(tokens, {"d1": 10.0}, [d1]).address == "d1"

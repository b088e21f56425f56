"""Routing policies and conditional disaggregation, on hand-made PodInfo lists (no servers)."""

import random

import grpc
import pytest

from splitserve.engine.block_manager import chained_block_hashes
from splitserve.engine.sampling.params import SamplingParams
from splitserve.router.intake import RouterRequest
from splitserve.router.pods.registry import PodInfo, PodLoad
from splitserve.router.policies import NO_DECODE_POD_RETRY_S, LocalPrefill, has_room, make_policy
from splitserve.router.route_plan import PromptBlocks
from splitserve.runtime.errors import StatusError

BLOCK = 4


def pod(address, role="decode", free=100, running=0, waiting=0, queued=0, hashes=(), block_size=BLOCK):
    load = PodLoad(num_waiting=waiting, num_running=running, free_kv_blocks=free, total_kv_blocks=100,
                   queued_prefill_tokens=queued, block_size=block_size)
    return PodInfo(address, role, load, set(hashes), serving=True)


def request(num_tokens=64, tokens=None):
    token_ids = tokens if tokens is not None else [10 + i % 200 for i in range(num_tokens)]
    return RouterRequest("r", token_ids, SamplingParams())


def policy(name, threshold=32, cached_fraction=0.8, queue_s=0.0, seed=None):
    return make_policy(name, LocalPrefill(threshold, cached_fraction, queue_s), seed=seed)


def test_least_loaded_picks_the_fewest_requests_then_most_free_blocks_and_least_queued_prefill():
    decode = [pod("d1", free=10), pod("d2", free=50, running=3), pod("d3", free=50, running=1),
              pod("d4", free=90, running=1, waiting=1)]
    prefill = [pod("p1", "prefill", queued=100), pod("p2", "prefill", queued=20, waiting=2),
               pod("p3", "prefill", queued=20, waiting=1)]
    plan = policy("least_loaded").choose_pair(request(64), prefill, decode)
    # d1 has no room for 65 tokens (17 blocks of 4); of the rest d3 runs the fewest requests.
    assert (plan.prefill.address, plan.decode.address, plan.reason) == ("p3", "d3", "disaggregated")
    decode[2].load.num_running = 2  # now d3 and d4 both hold two requests: the one with more free blocks wins
    assert policy("least_loaded").choose_pair(request(64), prefill, decode).decode.address == "d4"


def test_the_routers_own_requests_count_before_the_pods_next_report():
    """A burst between two load reports must spread: the router counts what it sent since the last report."""
    a, b = pod("a", free=40), pod("b", free=40)
    least = policy("least_loaded")
    chosen = []
    for _ in range(4):
        target = least.choose_decode(request(30).prompt_token_ids, [a, b])
        target.active_requests += 1
        target.blocks_since_report += 8  # 30 tokens + 1 in blocks of 4
        chosen.append(target.address)
    assert chosen == ["a", "b", "a", "b"]
    assert (a.busy, a.free_kv_blocks) == (2, 24)
    a.take_report(PodLoad(num_running=5, free_kv_blocks=30, total_kv_blocks=100, block_size=BLOCK))
    assert (a.busy, a.free_kv_blocks, a.blocks_since_report) == (5, 30, 0)  # the report now includes them
    # Prefill queues by the same rule: the larger of the report and the router's own count.
    p = pod("p", "prefill", queued=10)
    p.queued_prompt_tokens = 300
    assert p.queued_tokens == 300


def test_a_pod_is_routable_while_serving_and_not_draining():
    d = pod("d")
    assert d.healthy
    d.load.draining = True
    assert not d.healthy
    d.load.draining, d.serving = False, False
    assert not d.healthy


def test_round_robin_takes_turns_in_address_order_per_phase():
    rr = policy("round_robin")
    decode = [pod("d2"), pod("d1"), pod("d3")]
    prefill = [pod("p2", "prefill"), pod("p1", "prefill")]
    plans = [rr.choose_pair(request(64), prefill, decode) for _ in range(4)]
    assert [p.decode.address for p in plans] == ["d1", "d2", "d3", "d1"]
    assert [p.prefill.address for p in plans] == ["p1", "p2", "p1", "p2"]


def test_power_of_two_takes_the_less_loaded_of_two_seeded_draws():
    decode = [pod("d3", free=50), pod("d1", free=20), pod("d2", free=90), pod("d4", free=70)]
    prefill = [pod("p1", "prefill", queued=5), pod("p2", "prefill", queued=500), pod("p3", "prefill", queued=50)]
    chosen = policy("power_of_two", seed=7)
    draws = random.Random(7)  # the policy draws from the address-sorted candidates: decode first, then prefill
    picked = []
    for _ in range(20):
        plan = chosen.choose_pair(request(64), prefill, decode)
        decode_pair = draws.sample(sorted(decode, key=lambda p: p.address), 2)
        prefill_pair = draws.sample(sorted(prefill, key=lambda p: p.address), 2)
        assert plan.decode is max(decode_pair, key=lambda p: p.load.free_kv_blocks)
        assert plan.prefill is min(prefill_pair, key=lambda p: p.load.queued_prefill_tokens)
        picked.append(plan.decode.address)
    assert "d1" not in picked  # the most loaded pod always loses its draw
    assert {"d2", "d3", "d4"} <= set(picked)


def test_power_of_two_with_two_pods_always_takes_the_less_loaded():
    decode = [pod("d1", free=10), pod("d2", free=90)]
    chosen = policy("power_of_two", seed=0)
    assert {chosen.choose_pair(request(8), [], decode).decode.address for _ in range(10)} == {"d2"}


def test_prefix_aware_picks_the_longest_cached_prefix_at_each_pods_block_size():
    tokens = [10 + i for i in range(64)]
    by4, by8 = chained_block_hashes(tokens, 4), chained_block_hashes(tokens, 8)
    decode = [
        pod("d1", free=100, hashes=by4[:2]),  # 8 tokens
        pod("d2", free=10, hashes=by8[:3], block_size=8),  # 24 tokens
        pod("d3", free=100, hashes=by4[:5]),  # 20 tokens
        pod("d4", free=100, hashes=by4[1:10]),  # misses block 0: nothing usable
    ]
    prefill = [pod("p1", "prefill", hashes=by4[:1]), pod("p2", "prefill", hashes=by4[:3], queued=1000)]
    prompt = PromptBlocks(tokens)
    assert [prompt.cached_tokens(p) for p in decode] == [8, 24, 20, 0]
    plan = policy("prefix_aware", cached_fraction=0.9).choose_pair(request(tokens=tokens), prefill, decode)
    assert (plan.prefill.address, plan.decode.address) == ("p2", "d2")


def test_prefix_aware_ties_go_to_the_least_loaded():
    tokens = [10 + i for i in range(64)]
    hashes = chained_block_hashes(tokens, BLOCK)[:2]
    decode = [pod("d1", free=20, hashes=hashes), pod("d2", free=80, hashes=hashes), pod("d3", free=99)]
    prefill = [pod("p1", "prefill", queued=30), pod("p2", "prefill", queued=10)]
    plan = policy("prefix_aware").choose_pair(request(tokens=tokens), prefill, decode)
    assert (plan.prefill.address, plan.decode.address) == ("p2", "d2")


def test_short_prompt_prefills_on_the_decode_pod():
    plan = policy("least_loaded", threshold=32).choose_pair(request(31), [pod("p1", "prefill")], [pod("d1")])
    assert (plan.prefill, plan.decode.address) == (None, "d1")
    assert plan.reason == "short prompt (31 < 32 tokens): prefill on the decode pod"
    plan = policy("least_loaded", threshold=32).choose_pair(request(32), [pod("p1", "prefill")], [pod("d1")])
    assert plan.prefill.address == "p1"


def test_prompt_mostly_cached_on_the_decode_pod_prefills_there():
    tokens = [10 + i for i in range(40)]
    hashes = chained_block_hashes(tokens, BLOCK)  # 10 blocks
    prefill = [pod("p1", "prefill")]
    plan = policy("least_loaded").choose_pair(request(tokens=tokens), prefill, [pod("d1", hashes=hashes[:8])])
    assert plan.prefill is None and plan.reason == "80% of the prompt cached on the decode pod: prefill there"
    plan = policy("least_loaded").choose_pair(request(tokens=tokens), prefill, [pod("d1", hashes=hashes[:7])])
    assert plan.prefill.address == "p1"


def test_prefill_locally_rules():
    rule, p, d = LocalPrefill(32, 0.8), [pod("p1", "prefill")], pod("d1")
    assert rule.reason(100, 0, [], d) == "no prefill pod: prefill on the decode pod"
    assert rule.reason(10, 0, p, d).startswith("short prompt")
    assert rule.reason(100, 80, p, d).startswith("80% of the prompt cached")
    assert rule.reason(100, 79, p, d) is None
    assert LocalPrefill(0, 0.8).reason(100, 0, p, d) is None


def prefill_pod(address, queued, tokens_per_s):
    p = pod(address, "prefill", queued=queued)
    p.load.prefill_tokens_per_second = tokens_per_s
    return p


def test_load_aware_rule_lends_the_decode_pod_when_every_prefill_pod_is_behind():
    rule = LocalPrefill(threshold=0, queue_s=1.0)
    behind = [prefill_pod("p1", queued=600, tokens_per_s=300), prefill_pod("p2", queued=300, tokens_per_s=300)]
    assert rule.reason(400, 0, behind, pod("d1")) == (
        "every prefill pod is at least 1.0 s behind (conditional_prefill_queue_s 1 s): prefill on the decode pod")
    # One prefill pod that would start it sooner than queue_s: the prompt goes there.
    assert rule.reason(400, 0, behind + [prefill_pod("p3", queued=200, tokens_per_s=300)], pod("d1")) is None
    # The decode pod already has a prompt of its own queued: at most one at a time.
    assert rule.reason(400, 0, behind, pod("d1", queued=128)) is None
    # A prefill pod that has not measured its rate yet is not known to be behind.
    assert rule.reason(400, 0, [prefill_pod("p1", queued=10_000, tokens_per_s=0)], pod("d1")) is None
    # queue_s 0 turns the rule off, however far behind.
    assert LocalPrefill(threshold=0).reason(400, 0, behind, pod("d1")) is None


def test_load_aware_plan_counts_the_routers_own_queued_prompts():
    """The router's own count of prompts it sent (queued_prompt_tokens) makes a prefill pod behind before its next
    report says so, and makes the decode pod's one local prompt count against a second."""
    p, d = prefill_pod("p1", queued=0, tokens_per_s=400), pod("d1")
    least = policy("least_loaded", threshold=0, queue_s=1.0)
    assert least.choose_pair(request(300), [p], [d]).prefill is p  # 0 s behind
    p.queued_prompt_tokens = 500  # 1.25 s at 400 tokens/s
    plan = least.choose_pair(request(300), [p], [d])
    assert plan.prefill is None and plan.decode is d and plan.reason.startswith("every prefill pod")
    d.queued_prompt_tokens = 300  # that prompt now queues on d: the next one goes to p, behind or not
    assert least.choose_pair(request(300), [p], [d]).prefill is p


def test_only_mixed_pods_means_every_request_prefills_locally():
    mixed = [pod("m1", "mixed", free=30), pod("m2", "mixed", free=60)]
    plan = policy("least_loaded").choose_pair(request(64), [], mixed)
    assert (plan.prefill, plan.decode.address) == (None, "m2")


def test_mixed_pods_are_decode_pods_that_a_prefill_pod_can_feed():
    plan = policy("least_loaded").choose_pair(request(64), [pod("p1", "prefill")], [pod("m1", "mixed")])
    assert (plan.prefill.address, plan.decode.address) == ("p1", "m1")


def test_decode_pods_without_room_are_skipped_and_none_left_is_resource_exhausted():
    # 64 prompt tokens + the first output token need ceil(65 / 4) = 17 blocks.
    assert has_room(pod("d", free=17), 64) and not has_room(pod("d", free=16), 64)
    plan = policy("least_loaded").choose_pair(request(64), [], [pod("d1", free=16), pod("d2", free=17)])
    assert plan.decode.address == "d2"
    with pytest.raises(StatusError) as caught:
        policy("least_loaded").choose_pair(request(64), [], [pod("d1", free=16)])
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_pod_with_a_sliding_window_needs_room_for_the_window_alone():
    """A model whose every layer is windowed (``PodLoad.kv_window``) holds a request's window and two blocks, however
    long its prompt: 64 tokens under a window of 16 take ceil((16 + 2 * 4) / 4) = 6 blocks there, not 17."""
    windowed = pod("d", free=6)
    windowed.load.kv_window = 16
    assert has_room(windowed, 64) and windowed.blocks_for(10) == 3
    windowed.load.free_kv_blocks = 5
    assert not has_room(windowed, 64)


def test_no_decode_pod_is_unavailable():
    with pytest.raises(StatusError) as caught:
        policy("round_robin").choose_pair(request(64), [pod("p1", "prefill")], [])
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.message == "no decode pod is serving"
    assert caught.value.retry_after_s == NO_DECODE_POD_RETRY_S  # a restarting pod is usually back in seconds


def test_unknown_policy_name_is_an_error():
    with pytest.raises(ValueError, match="policy must be one of round_robin, least_loaded, power_of_two, prefix_aware"):
        make_policy("random")

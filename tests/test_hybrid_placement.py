"""Hybrid placement (router/latency.py, HybridPlacement) on hand-made pod states, one per SLO regime: the prompt
goes where its first token is predicted first, or, once the prefill pod's queue eats into the TTFT target, where it
leaves the prefill pod the least work and still meets the target (on the decode pod, or split across both); the
decode pod's TPOT slack bounds what it may be lent."""

import math

import pytest

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.step_time import StepTimeModel
from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.latency import TTFT_HEADROOM, HybridPlacement
from splitserve.router.pods.registry import PodInfo, PodLoad
from splitserve.router.policies import LocalPrefill, make_policy
from splitserve.router.route_plan import PromptBlocks, SLOTargets

BLOCK = 16
# This machine's SmolLM2 pods, roughly: a decode step ~30 ms, a prefilling step's own pass as much, a prompt token
# ~3.5 ms (a step that does both pays both passes).
MODEL = StepTimeModel(base=0.028, per_decode_row=0.001, per_prefill_token=0.0035, per_context_token=2e-7,
                      prefill_pass=0.028, num_samples=100)
TIGHT_TTFT = SLOTargets(ttft_s=2.0, tpot_s=0.5)  # TaiChi's regimes, in this machine's terms
BALANCED = SLOTargets(ttft_s=3.0, tpot_s=0.15)
TIGHT_TPOT = SLOTargets(ttft_s=8.0, tpot_s=0.04)


def prefill_pod(queued=0, model=MODEL, hashes=()):
    load = PodLoad(free_kv_blocks=1000, total_kv_blocks=1000, block_size=BLOCK, queued_prefill_tokens=queued,
                   prefill_tokens_per_second=1 / MODEL.per_prefill_token, step_time=model)
    return PodInfo("p", "prefill", load, set(hashes), serving=True)


def decode_pod(running=2, targets=BALANCED, model=MODEL, hashes=(), behind_s=0.0, queued=0):
    """A decode pod with ``running`` decodes of 300 tokens each under ``targets``' TPOT: the allowance it reports
    is that target (less ``behind_s`` the decodes already lost), headroom applied, as the pod computes it."""
    allowance = 0.8 * (targets.tpot_s - behind_s) if running else None
    load = PodLoad(num_running=running, free_kv_blocks=1000, total_kv_blocks=1000, block_size=BLOCK,
                   running_context_tokens=300 * running, step_time=model, tpot_allowance_seconds=allowance,
                   queued_prefill_tokens=queued)
    return PodInfo("d", "decode", load, set(hashes), serving=True)


def prompt(num_tokens=384) -> PromptBlocks:
    return PromptBlocks([10 + i % 200 for i in range(num_tokens)])


def decide(prefill, decode, targets, num_tokens=384, hybrid=None, may_split=True):
    return (hybrid or HybridPlacement()).decide(prompt(num_tokens), prefill, decode, targets, may_split)


def test_tight_ttft_relaxed_tpot_lends_the_prompt_when_the_prefill_pod_has_a_queue():
    plan = decide(prefill_pod(queued=600), decode_pod(targets=TIGHT_TTFT), TIGHT_TTFT)
    assert plan.prefill is None and plan.reason.startswith("hybrid lent")
    assert "meets the 2 s TTFT target" in plan.reason


def test_tight_ttft_with_an_idle_prefill_pod_prefills_there():
    plan = decide(prefill_pod(queued=0), decode_pod(targets=TIGHT_TTFT), TIGHT_TTFT)
    assert plan.prefill is not None and plan.reason.startswith("hybrid remote")


def test_tight_tpot_never_lends_a_decode_pod_with_no_slack_to_spare():
    # The decodes' 40 ms target leaves room for a few tokens a step: the prompt waits in a queue instead.
    plan = decide(prefill_pod(queued=1200), decode_pod(targets=TIGHT_TPOT), TIGHT_TPOT)
    assert plan.decision == "disaggregated", plan.reason  # neither lent nor split: every split's rest is lent too
    # Decodes already behind their target: no chunk at all.
    estimate = HybridPlacement().lent(prompt(), decode_pod(targets=TIGHT_TPOT, behind_s=0.02))
    assert estimate.ttft_s == math.inf and "no slack" in estimate.detail


def test_an_idle_decode_pod_is_predicted_at_its_long_chunks_unless_a_decode_is_on_its_way():
    """An idle D with no KV on its way reports 4 targets' allowance (a joiner would wait at most the gap cap): the
    lent prompt is predicted in a few long chunks. A request this router sent through P to D joins with no slack
    banked: the prediction starts at the target's own allowance, as D's chunks will once its KV is on the way."""
    idle = decode_pod(running=0, targets=BALANCED)
    idle.load.tpot_allowance_seconds = 0.8 * 4 * BALANCED.tpot_s
    alone = HybridPlacement.on_decode_pod(idle, 0, 1000, BALANCED.tpot_s)
    idle.active_requests = 1
    joined = HybridPlacement.on_decode_pod(idle, 0, 1000, BALANCED.tpot_s)
    assert alone.ttft_s < joined.ttft_s < math.inf
    assert "allowance 0.120 s at first" in joined.detail


def test_a_lent_prompt_spends_the_slack_its_decodes_banked_and_no_more():
    """D's decode reports 4 targets' worth of allowance (it banked slack decoding faster than its target): the lent
    prompt is predicted sooner than beside a decode that banked nothing, but later than if every chunk could take
    that whole allowance: the first long chunk spends the bank, and the later ones get what each step earns."""
    fresh = decode_pod(running=1, targets=BALANCED)
    banked = decode_pod(running=1, targets=BALANCED)
    banked.load.tpot_allowance_seconds = 0.8 * 4 * BALANCED.tpot_s

    def lent(pod, tpot_s):
        return HybridPlacement.on_decode_pod(pod, 0, 1000, tpot_s).ttft_s

    assert lent(banked, None) < lent(banked, BALANCED.tpot_s) < lent(fresh, BALANCED.tpot_s) < math.inf
    # A decode whose steps alone take longer than its target banks nothing: never a chunk, as before.
    slow = decode_pod(running=1, targets=BALANCED, model=StepTimeModel(
        base=0.2, per_decode_row=0.001, per_prefill_token=0.0035, prefill_pass=0.028, num_samples=100))
    assert lent(slow, BALANCED.tpot_s) == math.inf


@pytest.mark.parametrize("queued,lent", [(0, False), (100, False), (900, True)])
def test_balanced_lends_once_the_prefill_queue_makes_the_chunks_faster(queued, lent):
    plan = decide(prefill_pod(queued=queued), decode_pod(targets=BALANCED), BALANCED)
    assert plan.decision == ("prefill_on_decode" if lent else "disaggregated"), plan.reason


def test_a_prompt_mostly_cached_on_the_decode_pod_prefills_there():
    blocks = prompt().hashes(BLOCK)
    plan = decide(prefill_pod(), decode_pod(targets=BALANCED, hashes=blocks[:22]), BALANCED)
    assert plan.decision == "prefill_on_decode", plan.reason
    # ... and one cached on the prefill pod takes its cached prefix from there, even behind a queue the decode pod
    # could beat: split at that prefix (352 tokens, 22 blocks), it leaves the prefill pod no work at all (its queue
    # makes the least work that meets the target the rule), and the decode pod prefills the 32 tokens past it.
    plan = decide(prefill_pod(queued=300, hashes=blocks[:22]), decode_pod(targets=BALANCED), BALANCED)
    assert (plan.decision, plan.prefix_tokens) == ("split", 352), plan.reason


def test_a_decode_pod_with_no_tpot_to_keep_prefills_at_its_full_rate():
    estimate = HybridPlacement().lent(prompt(), decode_pod(running=0))
    assert estimate.ttft_s == pytest.approx(MODEL.prefill_seconds(384), rel=1e-6)
    # An idle lending pod still keeps room for a decode to join: it reports its default target's allowance.
    idle = decode_pod(running=0)
    idle.load.tpot_allowance_seconds = 0.8 * BALANCED.tpot_s
    assert "16 chunks of 25 tokens" in HybridPlacement().lent(prompt(), idle).detail


def test_decodes_on_their_way_to_an_idle_decode_pod_stop_lending_where_a_chunk_beside_them_breaks_their_tpot():
    """D reports no decode, but this router has a request in flight there (its prompt prefilling on P, its KV
    landing on D): the lent prompt's chunks would run beside that decode within the prefill, and beside a decode a
    chunk pays both passes, more than a 40 ms target allows: not lent (issue 35: the hybrid stops lending rather
    than break the user's TPOT target). The same pod with nothing on its way lends, in small chunks."""
    idle = decode_pod(running=0)
    idle.load.tpot_allowance_seconds = 0.8 * TIGHT_TPOT.tpot_s
    assert HybridPlacement().lent(prompt(), idle).ttft_s < math.inf
    idle.active_requests = 1
    estimate = HybridPlacement().lent(prompt(), idle)
    assert estimate.ttft_s == math.inf and "beside 1 decodes" in estimate.detail
    assert decide(prefill_pod(queued=600), idle, TIGHT_TPOT).decision == "disaggregated"


def test_an_idle_decode_pod_slower_than_its_target_is_predicted_in_probe_chunks_as_it_prefills():
    """Its default target's allowance fits not one token (the pod prefills 16-token chunks then, as the engine's
    TPOTSlackBudget does): the estimate is those steps, not 'no slack'."""
    idle = decode_pod(running=0)
    idle.load.tpot_allowance_seconds = 0.8 * 0.02  # below its 28 ms step
    estimate = HybridPlacement().lent(prompt(), idle)
    assert "24 chunks of 16 tokens" in estimate.detail and estimate.ttft_s < math.inf


def test_a_prompt_shorter_than_one_chunk_is_predicted_at_its_own_length_not_the_chunks():
    """An idle decode pod fits a chunk of hundreds of tokens in its allowance; a 10-token prompt is one step of 10
    tokens (as the engine runs it), not one of the whole chunk."""
    idle = decode_pod(running=0)
    idle.load.tpot_allowance_seconds = 0.8 * BALANCED.tpot_s
    estimate = HybridPlacement().lent(prompt(10), idle)
    assert "1 chunks of 10 tokens" in estimate.detail, estimate.detail
    assert estimate.ttft_s == pytest.approx(MODEL.predict(0, 10, 10), rel=0.01)
    assert estimate.ttft_s < 0.1  # not a whole chunk's step: 26 tokens, 0.119 s here, before the fix


def test_a_decode_pod_without_a_step_time_model_is_never_lent_to():
    plan = decide(prefill_pod(queued=5000), decode_pod(model=StepTimeModel()), BALANCED)
    assert plan.decision == "disaggregated" and "no step-time model" in plan.reason


def test_no_prefill_pod_lends_everything():
    assert decide(None, decode_pod(), TIGHT_TPOT).prefill is None


def test_a_slow_kv_transfer_counts_against_the_prefill_pod():
    hybrid = HybridPlacement()
    assert decide(prefill_pod(queued=100), decode_pod(), BALANCED, hybrid=hybrid).decision == "disaggregated"
    hybrid.observe_transfer(384, 1.5)  # the KV took 1.5 s to land after the prefill
    assert decide(prefill_pod(queued=100), decode_pod(), BALANCED, hybrid=hybrid).decision == "prefill_on_decode"


def test_the_policy_decides_by_prediction_only_with_hybrid_scheduling():
    request = RouterRequest("r", prompt().token_ids, SamplingParams())
    rules = make_policy("least_loaded", LocalPrefill(threshold=32))
    hybrid = make_policy("least_loaded", LocalPrefill(threshold=32), hybrid=HybridPlacement())
    state = ([prefill_pod(queued=600)], [decode_pod(targets=TIGHT_TTFT)])
    assert rules.choose_pair(request, *state, TIGHT_TTFT).reason == "disaggregated"
    assert hybrid.choose_pair(request, *state, TIGHT_TTFT).decision == "prefill_on_decode"


def test_a_prompt_never_splits_across_pods_that_prefill_in_different_formats():
    """The prompt mostly cached on the prefill pod splits there (test above); with a decode pod that prefills in
    float32 (a tensor-parallel one under auto) beside a bfloat16 prefill pod, it goes whole to one pod instead."""
    request = RouterRequest("r", prompt().token_ids, SamplingParams())
    policy = make_policy("least_loaded", LocalPrefill(threshold=32), hybrid=HybridPlacement())
    prefill, decode = prefill_pod(queued=300, hashes=prompt().hashes(BLOCK)[:22]), decode_pod(targets=BALANCED)
    assert policy.choose_pair(request, [prefill], [decode], BALANCED).decision == "split"
    prefill.load.prefill_compute_dtype, decode.load.prefill_compute_dtype = "bfloat16", "float32"
    plan = policy.choose_pair(request, [prefill], [decode], BALANCED)
    assert plan.decision != "split" and plan.prefix_tokens == 0, plan.reason
    decode.load.prefill_compute_dtype = "bfloat16"
    assert policy.choose_pair(request, [prefill], [decode], BALANCED).decision == "split"


def test_a_request_names_its_own_targets():
    config = RouterConfig(decode_pods=["d:1"], slo_ttft_s=2.0, slo_tpot_s=0.1)
    own = RouterRequest("r", [1, 2], SamplingParams(), slo_ttft_s=0.5)
    assert SLOTargets.of(own, config) == SLOTargets(0.5, 0.1)
    assert SLOTargets.of(RouterRequest("s", [1], SamplingParams()), config) == SLOTargets(2.0, 0.1)


# ---- split prefills: a prefix on the prefill pod, the rest on the decode pod ------------------------------------

def test_a_busy_decode_pod_takes_the_tail_of_a_prompt_while_the_prefill_pod_does_its_prefix():
    """P's queue (1.05 s) eats into the 3.6 s target; D has a lent prompt of its own queued (300 tokens), so lending
    this one whole is not predicted within the target's headroom. A split is, with less work on P than a remote
    prefill: P's prefix and D's own queue overlap, and D prefills only the tail."""
    targets = SLOTargets(ttft_s=3.6, tpot_s=BALANCED.tpot_s)
    within = TTFT_HEADROOM * targets.ttft_s
    p, d = prefill_pod(queued=300), decode_pod(targets=BALANCED, queued=300)
    options = HybridPlacement().options(prompt(), p, d)
    lent, remote = options[-1], options[0]
    assert lent.estimate.ttft_s > within >= remote.estimate.ttft_s
    plan = decide(p, d, targets)
    assert plan.decision == "split" and plan.prefill is p and plan.reason.startswith("hybrid split")
    assert 0 < plan.prefix_tokens < 384 and plan.prefix_tokens % BLOCK == 0
    assert plan.predicted_ttft_s <= within
    # The least P work that meets the target: every option with less work on P (lent, here) misses it.
    less_work = [option for option in options if option.prefill_work < plan.prefix_tokens]
    assert less_work and all(option.estimate.ttft_s > within for option in less_work)
    # Without the headroom a split with less work on P would do: within 3.6 s, not within 2.88 s.
    assert any(within < option.estimate.ttft_s <= targets.ttft_s for option in less_work)


def test_a_split_is_predicted_as_the_later_of_the_prefix_and_the_decode_pods_queue_then_the_tail():
    hybrid = HybridPlacement()
    hybrid.observe_transfer(384, 0.384)  # 1 ms a token
    p, d = prefill_pod(queued=100), decode_pod(targets=BALANCED, queued=300)
    split = hybrid.split(prompt(), 192, p, d)
    on_p = hybrid.remote(prompt(), p, 192)
    assert on_p.ttft_s == pytest.approx(100 * MODEL.per_prefill_token + MODEL.predict(0, 192, 192 * 193 // 2)
                                        + 0.192)
    queue = hybrid.on_decode_pod(d, 0, 300).ttft_s
    tail = hybrid.on_decode_pod(d, 192, 192).ttft_s
    assert split.ttft_s == pytest.approx(max(on_p.ttft_s, queue) + tail)


def test_with_a_short_prefill_queue_a_split_is_not_chosen_where_it_is_not_sooner():
    """With P nearly idle, the first token comes soonest from P alone: a split (P's prefix, then D's tail in chunks
    beside its decodes) only adds D's slower tail."""
    plan = decide(prefill_pod(queued=50), decode_pod(targets=BALANCED), BALANCED)
    assert plan.decision == "disaggregated"


def test_a_prefix_cached_on_the_prefill_pod_is_a_split_point():
    """P holds 20 of the prompt's 24 blocks: behind P's queue, it pushes them without computing them, and D
    prefills the last 4 blocks, leaving P no work at all."""
    blocks = prompt().hashes(BLOCK)
    plan = decide(prefill_pod(queued=300, hashes=blocks[:20]), decode_pod(targets=BALANCED), BALANCED)
    assert (plan.decision, plan.prefix_tokens) == ("split", 20 * BLOCK)


def test_split_points_are_whole_blocks_of_the_decode_pod_past_what_it_has_cached():
    blocks = prompt().hashes(BLOCK)
    points = HybridPlacement.split_points(prompt(), 0, decode_pod(hashes=blocks[:10]))
    assert points == [288, 192]  # 96 is within D's 160 cached tokens: lending covers it
    assert HybridPlacement.split_points(prompt(100), 70, decode_pod()) == [64, 48, 16]


def test_a_request_that_may_not_split_gets_remote_or_lent_only():
    p, d = prefill_pod(queued=300), decode_pod(targets=BALANCED, queued=300)
    targets = SLOTargets(ttft_s=3.6, tpot_s=BALANCED.tpot_s)
    assert decide(p, d, targets).decision == "split"
    assert decide(p, d, targets, may_split=False).decision == "disaggregated"
    for params in (SamplingParams(max_tokens=0), SamplingParams(prompt_logprobs=1)):
        assert not RouterRequest("r", [1, 2], params).may_split_prefill
    assert RouterRequest("r", [1, 2], SamplingParams()).may_split_prefill


def test_an_infinite_predicted_ttft_is_not_a_queue_past_the_limit():
    """The hybrid predicts an infinite TTFT for a prompt lent where no chunk fits beside D's decodes now (as when no
    prefill pod serves and D is the only choice); D prefills it as they end, so the router's max_queue_time_s check
    judges D's queue, not the infinity (it refused such a request with 429 at 0.5 req/s in an SLO-map run); a finite
    prediction past the limit is refused, with the time past it as the retry hint."""
    from splitserve.router.placement import Placement
    from splitserve.router.pods.registry import PodSnapshot
    from splitserve.router.route_plan import RoutePlan
    from splitserve.runtime.errors import StatusError

    placement = Placement(RouterConfig(max_queue_time_s=30.0, decode_pods=["d:1"]), make_policy("least_loaded"))
    d = decode_pod(running=2)
    pods = PodSnapshot([], [d])
    for predicted, refused in ((math.inf, False), (29.0, False), (31.0, True)):
        placement.policy.choose_pair = lambda *_, ttft=predicted: RoutePlan(None, d, "lent", predicted_ttft_s=ttft)
        if refused:
            with pytest.raises(StatusError, match="max_queue_time_s") as caught:
                placement.route(RouterRequest("r", [1, 2], SamplingParams()), pods)
            assert caught.value.retry_after_s == 1.0
        else:
            assert placement.route(RouterRequest("r", [1, 2], SamplingParams()), pods).predicted_ttft_s == predicted


"""Answers checked while serving (issue 35, router/shadow.py): with --shadow-check-fraction a finished greedy answer
is served again through the other path, off the client's path, and compared: tokens, and their logprobs within
``LOGPROB_TOLERANCE``.

On the real router with fake pods (tests/test_router_flow.py's): the other path is taken and counted, nothing happens
when the option is off, a drawn request's logprobs come from the pods without reaching a client that did not ask, and
a logprob moved past the tolerance is a divergence at its position. With real pod processes of the tiny model: a
lossless codec matches (tokens and logprobs), a 2-bit KV codec's answers diverge and their first differing positions
are recorded."""

from __future__ import annotations

import grpc
import pytest

import tests.test_router_flow as flow
from splitserve.bench.soak import DIVERGED
from splitserve.engine.sampling.params import SamplingParams
from splitserve.router.config import RouterConfig
from splitserve.router.intake import RouterRequest
from splitserve.router.shadow import LOGPROB_TOLERANCE, Comparison, ShadowChecks, compare, first_divergence
from tests.reliability.live_cluster import TINY, prompts, router_counter, stream, wait_until
from tests.test_router_flow import (
    LONG_PROMPT,
    SCRIPT,
    SHORT_PROMPT,
    eventually,
    generate_all,
    run,
    running_cluster,
    sample,
)

CHECKS = "splitserve_router_shadow_checks_total"


def test_first_divergence_is_the_first_position_that_differs_or_where_the_second_run_stopped():
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == 1
    assert first_divergence([5, 6, 7], [5, 6]) == 2
    assert first_divergence([5, 6], [5, 6, 7]) is None  # served fewer (a stop string the pods do not apply)


def test_logprobs_diverge_where_the_same_token_moved_past_the_tolerance_before_any_token_differs():
    tokens, logprobs = [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4]
    near = [-0.1, -0.2 + LOGPROB_TOLERANCE / 2, -0.3, -0.4]
    assert compare(tokens, logprobs, tokens, near) == Comparison(None, "", pytest.approx(LOGPROB_TOLERANCE / 2))
    moved = [-0.1, -0.2, -0.3 - 2 * LOGPROB_TOLERANCE, -0.4]
    assert compare(tokens, logprobs, tokens, moved) == Comparison(2, "logprob", pytest.approx(2 * LOGPROB_TOLERANCE))
    # A token differing first is the divergence; logprobs past it are not compared (another context).
    assert compare(tokens, logprobs, [5, 9, 7, 8], moved) == Comparison(1, "token", 0.0)
    assert compare(tokens, logprobs, [5, 6, 7, 8], [-0.1, -5.0, -0.3, -0.4], tolerance=10.0).position is None
    # A run without logprobs compares tokens only.
    assert compare(tokens, None, [5, 6, 7, 9], moved) == Comparison(3, "token", None)
    assert compare(tokens, logprobs, tokens, None) == Comparison(None, "", None)


def test_the_share_is_drawn_at_arrival_and_asks_the_pods_for_logprobs_only_of_replayable_requests():
    def request(**params) -> RouterRequest:
        return RouterRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, **params))

    def config(**fields) -> RouterConfig:
        return RouterConfig(decode_pods=["127.0.0.1:1"], **fields)

    checks = ShadowChecks(config(shadow_check_fraction=1.0), None, None, None)
    assert checks.draw(request(temperature=0.0)).params.logprobs == 0
    assert checks.draw(request(temperature=0.0, logprobs=3)).params.logprobs == 3  # the client's, unchanged
    assert checks.draw(request(temperature=0.7, seed=1)) is not None
    assert checks.draw(request(temperature=0.7)) is None  # sampled without a seed: not replayable
    assert ShadowChecks(config(), None, None, None).draw(request(temperature=0.0)) is None  # off


def test_a_client_that_asked_for_no_logprobs_gets_none_while_the_check_compares_the_pods_ones():
    async def scenario():
        async with running_cluster(shadow_check_fraction=1.0) as env:
            _, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=5, temperature=0.0)
            assert done.finish_reason == "length" and all(delta.logprobs is None for delta in deltas)
            assert env.prefill[0].prefill_requests[0].sampling_params.HasField("logprobs")  # asked of the pods
            await eventually(lambda: sample(env.router, CHECKS, outcome="match") == 1)
            assert sample(env.router, "splitserve_router_shadow_logprob_delta_count") == 1  # logprobs compared
    run(scenario())


def test_a_logprob_moved_past_the_tolerance_is_a_divergence_at_its_position(monkeypatch, caplog):
    moved = []  # set once the answer went out: the check's run gets the third token's logprob moved

    def logprob(token_id):
        entry = fake_logprob(token_id)
        if moved and token_id == SCRIPT[2]:
            entry.logprob -= 2 * LOGPROB_TOLERANCE
        return entry

    fake_logprob = flow.fake_logprob
    monkeypatch.setattr(flow, "fake_logprob", logprob)

    async def scenario():
        async with running_cluster(shadow_check_fraction=1.0) as env:
            await generate_all(env.router, LONG_PROMPT, max_tokens=5, temperature=0.0)
            moved.append(True)
            await eventually(lambda: sample(env.router, CHECKS, outcome="diverged") == 1)
            assert sample(env.router, "splitserve_router_shadow_divergence_position_sum") == 2
    run(scenario())
    # bench soak lists divergences from this warning in the router's log
    [found] = DIVERGED.findall(caplog.text)
    assert found[1:] == ("logprob", "2", "5"), caplog.text


@pytest.mark.parametrize("prompt, served_by, checked_by", [(LONG_PROMPT, "prefill and decode pod", "decode pod"),
                                                          (SHORT_PROMPT, "decode pod", "prefill and decode pod")])
def test_a_greedy_answer_is_served_again_through_the_other_path_and_matches(prompt, served_by, checked_by):
    async def scenario():
        async with running_cluster(shadow_check_fraction=1.0) as env:
            req, _, done = await generate_all(env.router, prompt, max_tokens=5, temperature=0.0)
            assert done.finish_reason == "length"
            await eventually(lambda: sample(env.router, CHECKS, outcome="match") == 1)
            shadow_id = f"shadow-{req.request_id}"
            prefill_calls = [call for call in env.prefill[0].calls if call[1] == shadow_id]
            decode_calls = [call for call in env.decode[0].calls if call[1] == shadow_id]
            if checked_by == "decode pod":  # the original's prefill pod is left out: D prefills it
                assert (prefill_calls, decode_calls) == ([], [("Decode", shadow_id, None)])
            else:
                assert [call[0] for call in prefill_calls + decode_calls] == ["Prefill", "Decode"]
                assert decode_calls[0][2] is not None  # D claimed the KV P pushed, with P's first token
            assert sum(sample(env.router, "splitserve_router_routing_decisions_total", decision=d)
                       for d in ("disaggregated", "prefill_on_decode", "split")) == 1  # the check is no request
    run(scenario())


def test_a_check_whose_prefill_pod_fails_after_its_push_is_failed_and_drops_the_kv_it_pushed():
    """The answer was prefilled on the decode pod, so the check goes through the prefill pod, which pushes the KV to
    D and then fails (killed before it answered): the check is counted ``failed`` (neither match nor divergence),
    and the KV pushed for it is dropped on D (Abort), not left to its lease."""
    async def scenario():
        async with running_cluster(shadow_check_fraction=1.0) as env:
            prefill, decode = env.prefill[0], env.decode[0]
            prefill.fail_after_push = grpc.StatusCode.UNAVAILABLE  # the served request never calls it
            req, _, done = await generate_all(env.router, SHORT_PROMPT, max_tokens=5, temperature=0.0)
            assert done.finish_reason == "length"
            await eventually(lambda: sample(env.router, CHECKS, outcome="failed") == 1)
            shadow_id = f"shadow-{req.request_id}"
            assert [call[:2] for call in prefill.calls] == [("Prefill", shadow_id)]
            assert (decode.address, shadow_id) in env.prefill[0].cluster.pushed
            await eventually(lambda: ("Abort", shadow_id) in decode.calls)
            assert decode.calls == [("Decode", req.request_id, None), ("Abort", shadow_id)]  # no claim, one drop
            assert sample(env.router, CHECKS, outcome="match") == sample(env.router, CHECKS, outcome="diverged") == 0
    run(scenario())


def test_off_by_default_and_never_for_sampled_answers():
    async def scenario():
        async with running_cluster() as env:
            await generate_all(env.router, LONG_PROMPT, max_tokens=5, temperature=0.0)
            # A check starts (or not) as the request ends, before generate_all returns: none was started.
            assert env.router.shadow_checks.running is None
        async with running_cluster(shadow_check_fraction=1.0) as env:
            await generate_all(env.router, LONG_PROMPT, max_tokens=5, temperature=0.8)  # no seed: not replayable
            assert env.router.shadow_checks.running is None
            for outcome in ("match", "diverged", "failed"):
                assert sample(env.router, CHECKS, outcome=outcome) == 0
            assert not [call for pod in env.decode + env.prefill for call in pod.calls if call[1].startswith("shadow")]
    run(scenario())


@pytest.mark.parametrize("codec, diverges", [("none", False), ("kivi2", True)])
@pytest.mark.e2e
def test_real_pods_match_with_a_lossless_codec_and_a_lossy_ones_divergences_are_placed(tmp_path, start_cluster, codec,
                                                                                        diverges):
    cluster = start_cluster(tmp_path, **{**TINY, "kv_codec": codec, "shadow_check_fraction": 1.0,
                                         "conditional_prefill_threshold": 8})
    try:
        for checked, prompt in enumerate(prompts(6, 48, seed=35)):
            assert stream(cluster, prompt, 24).finish == "FINISH_REASON_LENGTH"
            # One check runs at a time: wait for this one, so that the next request is checked too.
            wait_until(lambda n=checked: sum(router_counter(cluster, CHECKS, outcome=o)
                                             for o in ("match", "diverged", "failed")) > n, 30, "the shadow check")
        counts = {o: router_counter(cluster, CHECKS, outcome=o) for o in ("match", "diverged", "failed")}
        assert counts["failed"] == 0 and counts["match"] + counts["diverged"] == 6, counts
        assert (counts["diverged"] > 0) == diverges, counts
        positions = router_counter(cluster, "splitserve_router_shadow_divergence_position_count")
        assert positions == counts["diverged"]
        assert router_counter(cluster, "splitserve_router_shadow_logprob_delta_count") == 6  # logprobs compared
    finally:
        cluster.stop()

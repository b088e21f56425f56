"""Failures before the first token (issue 35), on the real router with fake pods (tests/test_router_flow.py's):

- a split whose decode pod refuses the rest of the prompt (full: RESOURCE_EXHAUSTED) before it claimed the prefix
  the prefill pod pushed there: the prefix is dropped on that pod (Abort) before the retry, not left to its lease;
- a split whose prefill pod pushed the prefix to D and then failed (killed before it answered): the prefix is
  dropped on D before the retry;
- a decode pod whose call fails as if it were gone (UNAVAILABLE) is suspect at once: the retry backs off and waits
  for a decode pod (``decode_pod_wait_s``) as a stream that broke mid-way does, instead of failing twice at once on
  the same pod while its health stream still says it serves; the suspicion lapses for a pod that was not gone.

Each test acts at a known point of the request's path (the retry waiting for a decode pod, a Decode call
arriving), never after a sleep that guesses how long the router takes."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2

from splitserve.engine.sampling.params import SamplingParams
from splitserve.router.pods.registry import SUSPECT_S
from splitserve.router.route_plan import RoutePlan
from tests.test_router_flow import (
    LONG_PROMPT,
    SCRIPT,
    SHORT_PROMPT,
    eventually,
    generate_all,
    router_view,
    run,
    running_cluster,
    sample,
)


def test_a_split_refused_by_its_full_decode_pod_drops_the_prefix_there_and_is_retried_on_another():
    async def scenario():
        async with running_cluster(num_decode=2) as env:
            full, roomy = env.decode
            full.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
            prefill, full_view = router_view(env.router, env.prefill[0]), router_view(env.router, full)
            # A split on the full pod; the retry is offered only the other one (it avoids pods that failed).
            env.router.placement.policy.choose_pair = lambda _request, _prefill, decode, _targets: RoutePlan(
                prefill, full_view if len(decode) == 2 else decode[0], "split", prefix_tokens=16)
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=5)
            assert full.calls == [("Decode", req.request_id, None), ("Abort", req.request_id)]
            assert roomy.calls == [("Decode", req.request_id, None)]
            assert (done.finish_reason, [t for d in deltas for t in d.token_ids]) == ("length", SCRIPT[:5])
            assert sample(env.router, "splitserve_router_retries_total", code="RESOURCE_EXHAUSTED") == 1
    run(scenario())


def test_a_split_whose_prefill_pod_fails_after_its_push_drops_the_prefix_there_before_the_retry():
    """The prefill pod pushed the prefix's KV to D, then its call failed (UNAVAILABLE: killed before it answered):
    D holds the prefix under a lease that no Decode call will claim. The router drops it there (Abort) before the
    retry, which, with no prefill pod left, prefills the prompt on D: the prefix is not left to its lease."""
    async def scenario():
        async with running_cluster() as env:
            prefill, decode = env.prefill[0], env.decode[0]
            prefill.fail_after_push = grpc.StatusCode.UNAVAILABLE
            prefill_view, decode_view = router_view(env.router, prefill), router_view(env.router, decode)
            env.router.placement.policy.choose_pair = lambda _request, prefill_pods, _decode, _targets: (
                RoutePlan(prefill_view, decode_view, "split", prefix_tokens=16) if prefill_pods
                else RoutePlan(None, decode_view, "the retry, with no prefill pod left: on the decode pod"))
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=5)
            assert (decode.address, req.request_id) in env.prefill[0].cluster.pushed  # the prefix did arrive
            assert [call[0] for call in prefill.calls] == ["Prefill"]
            assert decode.calls == [("Abort", req.request_id), ("Decode", req.request_id, None)]
            assert req.request_id not in decode.kv_prefixes  # the retry prefilled the whole prompt there
            assert (done.finish_reason, [t for d in deltas for t in d.token_ids]) == ("length", SCRIPT[:5])
            assert sample(env.router, "splitserve_router_retries_total", code="UNAVAILABLE") == 1
    run(scenario())


def test_a_lent_prompt_whose_only_decode_pod_died_waits_for_its_restart_instead_of_failing():
    """The pod's first answer is UNAVAILABLE (the process died; its health stream has not broken yet here): the
    router takes it out of placement at once, backs off, waits, and serves the request on the restarted pod."""
    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=1, max_retries=2) as env:
            pod = env.decode[0]
            view = router_view(env.router, pod)
            pod.fail_with = grpc.StatusCode.UNAVAILABLE
            waiting = waits_for_a_decode_pod(env.router)

            async def restart() -> None:
                # The restart comes once the retry, backed off, waits for a decode pod: not a guess of how long that
                # takes (a restart during the backoff would find the pod back before the router looked for one).
                await waiting.wait()
                assert view.suspect and view.serving and env.router.registry.decode_pods() == []  # by the call
                pod.fail_with = None
                await pod.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                await eventually(lambda: not view.serving)
                await pod.health.set("", health_pb2.HealthCheckResponse.SERVING)

            restarting = asyncio.ensure_future(restart())
            _, deltas, done = await generate_all(env.router, SHORT_PROMPT, max_tokens=4)
            await restarting
            assert (done.finish_reason, [t for d in deltas for t in d.token_ids]) == ("length", SCRIPT[:4])
            assert [call[0] for call in pod.calls] == ["Decode", "Decode"]  # one failure, then the restarted pod
            assert sample(env.router, "splitserve_router_decode_pod_waits_total", outcome="found") == 1
    run(scenario())


def test_a_decode_pod_that_refused_once_but_kept_serving_is_routed_to_again_after_the_suspicion():
    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=1, max_retries=1) as env:
            pod = env.decode[0]
            view = router_view(env.router, pod)
            pod.fail_with = grpc.StatusCode.UNAVAILABLE
            seen: list[tuple[bool, bool]] = []  # at each Decode call: (suspected before, suspect now)
            pod.on_decode = lambda: seen.append((view.suspect_since is not None, view.suspect))
            waiting = waits_for_a_decode_pod(env.router)
            req = await env.router.make_request(SHORT_PROMPT, SamplingParams(max_tokens=3))
            answer = asyncio.ensure_future(_collect(env.router, req))
            await waiting.wait()  # suspect since the failed call: the retry waits for a decode pod
            assert view.suspect and env.router.registry.decode_pods() == []
            pod.fail_with = None  # it was never gone: no restart will tell the router
            *_, done = await asyncio.wait_for(answer, SUSPECT_S + 10)
            assert done.finish_reason == "length"
            # The second call came once the suspicion was over, and not by a restart (the pod never stopped serving):
            assert seen == [(False, False), (True, False)] and view.serving_since <= view.suspect_since
            assert sample(env.router, "splitserve_router_decode_pod_waits_total", outcome="found") == 1
    run(scenario())


def waits_for_a_decode_pod(router) -> asyncio.Event:
    """An event set when ``router`` first waits for a decode pod (``PodRegistry.wait_until``: none routable), so a
    test acts at that known point of the request's path instead of after a guessed sleep."""
    waiting, wait_until = asyncio.Event(), router.registry.wait_until

    async def noted(condition, timeout_s):
        waiting.set()
        return await wait_until(condition, timeout_s)

    router.registry.wait_until = noted
    return waiting


async def _collect(router, req):
    return [item async for item in router.generate(req)]

"""Failures before the first token (issue 35), on the real router with fake pods (tests/test_router_flow.py's):

- a split whose decode pod refuses the rest of the prompt (full: RESOURCE_EXHAUSTED) before it claimed the prefix
  the prefill pod pushed there: the prefix is dropped on that pod (Abort) before the retry, not left to its lease;
- a decode pod whose call fails as if it were gone (UNAVAILABLE) is suspect at once: the retry backs off and waits
  for a decode pod (``decode_pod_wait_s``) as a stream that broke mid-way does, instead of failing twice at once on
  the same pod while its health stream still says it serves; the suspicion lapses for a pod that was not gone."""

from __future__ import annotations

import asyncio
import time

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


def test_a_lent_prompt_whose_only_decode_pod_died_waits_for_its_restart_instead_of_failing():
    """The pod's first answer is UNAVAILABLE (the process died; its health stream has not broken yet here): the
    router takes it out of placement at once, backs off, waits, and serves the request on the restarted pod."""
    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=1, max_retries=2) as env:
            pod = env.decode[0]
            view = router_view(env.router, pod)
            pod.fail_with = grpc.StatusCode.UNAVAILABLE

            async def restart() -> None:
                await eventually(lambda: view.suspect)  # marked by the failed call, not by the health watch
                assert view.serving and env.router.registry.decode_pods() == []
                await asyncio.sleep(0.5)  # the restart takes a while: longer than the retries' backoff
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
            pod.fail_with = grpc.StatusCode.UNAVAILABLE
            req = await env.router.make_request(SHORT_PROMPT, SamplingParams(max_tokens=3))
            started = time.monotonic()
            answer = asyncio.ensure_future(_collect(env.router, req))
            await eventually(lambda: router_view(env.router, pod).suspect)
            pod.fail_with = None  # it was never gone: no restart will tell the router
            *_, done = await asyncio.wait_for(answer, 10)
            assert done.finish_reason == "length"
            assert SUSPECT_S * 0.9 <= time.monotonic() - started < SUSPECT_S + 3
    run(scenario())


async def _collect(router, req):
    return [item async for item in router.generate(req)]

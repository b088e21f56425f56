"""The Router against fake pods: real grpc.aio servers on loopback that implement Prefill, Decode, health and
PodStatus (load pushed as it changes).

A fake pod "generates" SCRIPT, token by token: a prefill pod returns SCRIPT[0] as the first token and records
the KV push in the shared FakeCluster; a decode pod streams the rest (or, with no first token, all of it). The
tokenizer is the tiny-random model's byte-level one: one token per byte, so texts and token counts line up.
"""

import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.text.tokenizer_files import tiny_random_tokenizer_data
from splitserve.protos.convert import sampling_params_from_proto, sampling_params_to_proto
from splitserve.router.config import RouterConfig
from splitserve.router.intake import ServiceLevel
from splitserve.router.outputs import Completion, OutputDelta
from splitserve.router.route_plan import RoutePlan
from splitserve.router.router import Router
from splitserve.router.server import RouterServer
from splitserve.runtime.errors import StatusError
from splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    pod_status_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

TOKENIZER = Tokenizer.from_gguf(tiny_random_tokenizer_data())
EOS = 2
SCRIPT_TEXT = "The fox jumps. END of story"
SCRIPT = TOKENIZER.encode(SCRIPT_TEXT) + [EOS]
LONG_PROMPT = "Tell me a story about a fox, please."  # 36 tokens: disaggregated (threshold 8)
SHORT_PROMPT = "Hi"  # 2 tokens: prefilled on the decode pod
MODEL = "tiny-random"


@dataclass
class FakeCluster:
    pods: dict = field(default_factory=dict)  # address -> FakePod
    pushed: dict = field(default_factory=dict)  # (decode address, request id) -> prompt token ids


class FakePod(prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer,
              pod_status_pb2_grpc.PodStatusServicer):
    def __init__(self, cluster: FakeCluster, role: str, queued_prefill_tokens: int = 0, free_kv_blocks: int = 1000,
                 port: int = 0):
        self.cluster, self.role = cluster, role
        self.load = common_pb2.PodLoad(free_kv_blocks=free_kv_blocks, total_kv_blocks=1000, block_size=16,
                                       queued_prefill_tokens=queued_prefill_tokens, version=1)
        self.calls: list[tuple] = []
        self.resumed: dict[str, list[int]] = {}  # request id -> resume_token_ids of a migrated Decode
        self.priorities: dict[str, int] = {}  # request id -> the priority its Prefill / Decode call carried
        self.prefill_requests: list[prefill_pb2.PrefillRequest] = []
        self.kv_prefixes: dict[str, int] = {}  # request id -> kv_prefix_tokens of a split prefill's Decode
        self.cancelled: set[str] = set()
        self.fail_with: grpc.StatusCode | None = None  # every Prefill / Decode call fails with this
        # Prefill: the KV pushed to the decode pod, then the call fails with this (a pod killed before it answered)
        self.fail_after_push: grpc.StatusCode | None = None
        self.fail_after_tokens: int | None = None  # Decode: UNAVAILABLE after streaming this many tokens
        self.token_delay_s = 0.001
        self.on_decode: Callable[[], None] | None = None  # called as each Decode call arrives (what the router saw)
        self.first_token_delay_s = 0.0  # Prefill, or a Decode that prefills: time before the first token
        self.server = grpc.aio.server()
        if role == "prefill":
            prefill_pb2_grpc.add_PrefillServicer_to_server(self, self.server)
        else:
            decode_pb2_grpc.add_DecodeServicer_to_server(self, self.server)
        pod_status_pb2_grpc.add_PodStatusServicer_to_server(self, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port(f'127.0.0.1:{port}')}"
        cluster.pods[self.address] = self

    async def start(self) -> None:
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def report(self, **fields) -> None:
        """A new load snapshot, pushed to the router's WatchLoad stream."""
        for name, value in fields.items():
            setattr(self.load, name, value)
        self.load.version += 1

    async def GetLoad(self, request, context):
        return self.load

    async def WatchLoad(self, request, context):
        while True:
            sent = common_pb2.PodLoad()
            sent.CopyFrom(self.load)
            yield sent
            while self.load.version == sent.version:
                await asyncio.sleep(0.01)

    async def Abort(self, request, context):
        self.calls.append(("Abort", request.request_id))
        return common_pb2.AbortResponse(found=False)

    async def Prefill(self, request, context):
        self.calls.append(("Prefill", request.request_id, request.decode_address, request.kv_codec))
        self.priorities[request.request_id] = request.priority
        self.prefill_requests.append(request)
        await asyncio.sleep(self.first_token_delay_s)
        if self.fail_with is not None:
            await context.abort(self.fail_with, f"fake prefill pod says {self.fail_with.name}")
        if request.decode_address not in self.cluster.pods:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV push failed: decode pod unreachable")
        self.cluster.pushed[request.decode_address, request.request_id] = list(request.prompt_token_ids)
        if self.fail_after_push is not None:
            await context.abort(self.fail_after_push, "fake prefill pod gone after its push")
        response = prefill_pb2.PrefillResponse(
            first_token_id=SCRIPT[0], num_cached_tokens=16, queue_seconds=0.01, prefill_seconds=0.02,
            kv_transfer=prefill_pb2.KVTransferStats(codec=request.kv_codec, exposed_transfer_seconds=0.003))
        if request.sampling_params.HasField("logprobs"):
            response.first_token_logprob.CopyFrom(fake_logprob(SCRIPT[0]))
        return response

    async def Decode(self, request, context):
        has_first = request.HasField("first_token_id")
        self.calls.append(("Decode", request.request_id, request.first_token_id if has_first else None))
        if self.on_decode is not None:
            self.on_decode()
        self.priorities[request.request_id] = request.priority
        if self.fail_with is not None:
            await context.abort(self.fail_with, f"fake decode pod says {self.fail_with.name}")
        if has_first and (self.address, request.request_id) not in self.cluster.pushed:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no KV pushed for this request")
        if request.kv_prefix_tokens:
            self.kv_prefixes[request.request_id] = request.kv_prefix_tokens
            pushed = self.cluster.pushed.get((self.address, request.request_id))
            if pushed != list(request.prompt_token_ids[:request.kv_prefix_tokens]):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the pushed KV is not the prompt's prefix")
        if not has_first:
            await asyncio.sleep(self.first_token_delay_s)
        params = request.sampling_params
        output = SCRIPT[: params.max_tokens]
        resumed = list(request.resume_token_ids)
        if resumed:
            self.resumed[request.request_id] = resumed
            if resumed != SCRIPT[:len(resumed)]:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resumed tokens are not the script's")
        finished = False
        try:
            for index, token_id in enumerate(output[1:] if has_first else output[len(resumed):]):
                if self.fail_after_tokens is not None and index == self.fail_after_tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode pod lost its accelerator")
                await asyncio.sleep(self.token_delay_s)
                chunk = decode_pb2.DecodeChunk(token_ids=[token_id])
                if params.HasField("logprobs"):
                    chunk.logprobs.tokens.append(fake_logprob(token_id))
                yield decode_pb2.DecodeResponse(chunk=chunk)
            reason = common_pb2.FINISH_REASON_STOP if output[-1] == EOS else common_pb2.FINISH_REASON_LENGTH
            finished = True
            yield decode_pb2.DecodeResponse(complete=decode_pb2.DecodeComplete(
                finish_reason=reason,
                usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(output),
                                       cached_tokens=0 if has_first else 5 + request.kv_prefix_tokens),
                queue_seconds=0.5, prefill_seconds=0.0 if has_first else 0.25))
        finally:
            if not finished:
                self.cancelled.add(request.request_id)


def fake_logprob(token_id: int) -> common_pb2.TokenLogprob:
    """The sampled token ranks second, behind token 7."""
    return common_pb2.TokenLogprob(token_id=token_id, logprob=-1.5, top_logprobs=[
        common_pb2.TopLogprob(token_id=7, logprob=-0.25), common_pb2.TopLogprob(token_id=token_id, logprob=-1.5)])


@dataclass
class Env:
    router: Router
    prefill: list[FakePod]
    decode: list[FakePod]
    mixed: list[FakePod]


@contextlib.asynccontextmanager
async def running_cluster(num_prefill=1, num_decode=1, num_mixed=0, extra_decode_addresses=(), **config):
    """Fake pods behind a real router; the conditional_* rules' scheduling unless ``config`` names another (the
    fakes report no step-time model, which hybrid placement predicts from)."""
    cluster = FakeCluster()
    pods = {role: [FakePod(cluster, role) for _ in range(n)]
            for role, n in (("prefill", num_prefill), ("decode", num_decode), ("mixed", num_mixed))}
    for pod in cluster.pods.values():
        await pod.start()
    router_config = RouterConfig(
        model=MODEL, max_model_len=2048, grpc_port=0, http_port=0,
        prefill_pods=[p.address for p in pods["prefill"]],
        decode_pods=[p.address for p in pods["decode"]] + list(extra_decode_addresses),
        mixed_pods=[p.address for p in pods["mixed"]],
        conditional_prefill_threshold=8, kv_codec="int8", **{"scheduling": "disaggregated", **config})
    router = Router(router_config)  # loads the tiny-random tokenizer by name
    await router.start()
    try:
        yield Env(router, pods["prefill"], pods["decode"], pods["mixed"])
    finally:
        await router.stop()
        for pod in cluster.pods.values():
            await pod.server.stop(None)


async def generate_all(router: Router, prompt, **params):
    req = await router.make_request(prompt, SamplingParams(**params))
    items = [item async for item in router.generate(req)]
    assert all(isinstance(item, OutputDelta) for item in items[:-1])
    assert isinstance(items[-1], Completion)
    return req, items[:-1], items[-1]


def joined(deltas):
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


def router_view(router: Router, pod: FakePod):
    return router.registry.pods[pod.address]


async def eventually(condition, timeout_s=3.0):
    """Server-side cancellation, load reports and health changes reach the other side asynchronously."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never became true")


async def background_calls_done(router: Router, timeout_s: float = 3.0) -> None:
    """Until every call the router made in the background (``PodClientPool.drop_in_background``: a request's
    leftovers dropped on its pods) has ended, within ``timeout_s``: then what they did, or that there were none,
    can be asserted without a sleep that guesses how long they take."""
    pending = set(router.pod_clients._background)
    if pending:
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        assert not late, f"background pod calls still running after {timeout_s} s: {late}"


def sample(router: Router, name: str, **labels) -> float:
    value = router.metrics.registry.get_sample_value(name, {"role": "router", "model_name": MODEL, **labels})
    return 0.0 if value is None else value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unserved_port() -> socket.socket:
    """A loopback port bound but never listened on, for a pod that is not up yet: connections to it are refused, and
    no pod the test starts on port 0 can be given it (a port ``free_port`` released can be). Close it before starting
    a pod there."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("codec", ["gzip", "", "int8+gzip"])
def test_the_router_refuses_an_unknown_kv_codec_at_start(codec):
    with pytest.raises(ValueError, match=r"^kv_codec must be one of none, bf16, fp8, int8, int4, kivi8, kivi4, "
                                         rf"kivi2, none\+zstd, .*, kivi2\+zstd, auto, got '{re.escape(codec)}'$"):
        RouterConfig(decode_pods=["127.0.0.1:1"], kv_codec=codec)
    for good in ("int4+zstd", "kivi2", "auto"):
        assert RouterConfig(decode_pods=["127.0.0.1:1"], kv_codec=good).kv_codec == good


@pytest.mark.e2e
def test_the_router_process_with_an_unknown_kv_codec_exits_at_once_naming_it():
    done = subprocess.run([sys.executable, "-m", "splitserve.router.server", "--decode-pods", "127.0.0.1:1",
                           "--kv-codec", "gzip"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: kv_codec must be one of none, bf16" in done.stderr and "got 'gzip'" in done.stderr


def test_sampling_params_cross_the_wire_unchanged():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=-0.5, seed=2**62, stop=["\n\n", "END"],
                            stop_token_ids=[2, 5], max_tokens=100, min_tokens=3, ignore_eos=True, logprobs=5,
                            skip_special_tokens=False, include_stop_str_in_output=True)
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    greedy = SamplingParams(temperature=0.0, max_tokens=None, seed=0, logprobs=0)
    assert sampling_params_from_proto(sampling_params_to_proto(greedy)) == greedy
    # Unset fields are vLLM's defaults, and unset max_tokens means "until the context is full".
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams(max_tokens=None)
    with pytest.raises(ValueError, match="^top_p must be in"):
        sampling_params_from_proto(common_pb2.SamplingParams(top_p=0.0))


def test_disaggregated_request_prefills_on_p_then_streams_from_d():
    async def scenario():
        async with running_cluster() as env:
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, temperature=0.0, max_tokens=10)
            assert deltas[0].token_ids == [SCRIPT[0]]  # P's first token goes out before D's stream
            assert joined(deltas) == (SCRIPT[:10], "The fox ju")
            assert env.prefill[0].calls == [("Prefill", req.request_id, env.decode[0].address, "int8")]
            assert env.decode[0].calls == [("Decode", req.request_id, SCRIPT[0])]
            assert (done.finish_reason, done.stop_reason) == ("length", None)
            assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (36, 10, 16)
            assert {k: done.timings[k] for k in ("queue", "prefill", "kv_transfer")} == \
                {"queue": 0.01, "prefill": 0.02, "kv_transfer": 0.003}
            assert 0 < done.timings["ttft"] <= done.timings["e2e"]
            assert done.error is None
    run(scenario())


def test_eos_ends_the_request_with_stop_and_full_text():
    async def scenario():
        async with running_cluster() as env:
            assert env.router.ready()
            _, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=None)
            assert joined(deltas) == (SCRIPT, SCRIPT_TEXT)  # EOS is a token, not text
            assert (done.finish_reason, done.stop_reason, done.completion_tokens) == ("stop", None, len(SCRIPT))
    run(scenario())


def test_short_prompt_skips_the_prefill_pod():
    async def scenario():
        async with running_cluster() as env:
            req, deltas, done = await generate_all(env.router, SHORT_PROMPT, max_tokens=5)
            assert env.prefill[0].calls == []
            assert env.decode[0].calls == [("Decode", req.request_id, None)]
            assert joined(deltas) == (SCRIPT[:5], "The f")
            # D prefilled, so its summary is the report.
            assert (done.cached_tokens, done.timings["queue"], done.timings["prefill"], done.timings["kv_transfer"]) \
                == (5, 0.5, 0.25, 0.0)
    run(scenario())


def test_a_requests_priority_travels_to_every_pod_it_runs_on():
    async def scenario():
        async with running_cluster() as env:
            for prompt, priority in ((LONG_PROMPT, -2), (SHORT_PROMPT, 5), (LONG_PROMPT, 0)):
                req = await env.router.make_request(prompt, SamplingParams(max_tokens=3),
                                                    service=ServiceLevel(priority=priority))
                _ = [item async for item in env.router.generate(req)]
            prefilled, short, default = (call[1] for call in env.decode[0].calls)
            assert env.prefill[0].priorities == {prefilled: -2, default: 0}
            assert env.decode[0].priorities == {prefilled: -2, short: 5, default: 0}
    run(scenario())


def test_a_split_prefill_sends_the_prefix_to_the_prefill_pod_and_the_rest_to_the_decode_pod():
    async def scenario():
        async with running_cluster() as env:
            policy = env.router.placement.policy
            prefill, decode = router_view(env.router, env.prefill[0]), router_view(env.router, env.decode[0])
            policy.choose_pair = lambda request, *_: RoutePlan(prefill, decode, "split", prefix_tokens=16)
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=5, temperature=0.8, seed=3)
            pushed = env.prefill[0].prefill_requests[-1]
            # P prefills the first 16 tokens alone, greedy and for one token (only their KV is wanted) ...
            assert list(pushed.prompt_token_ids) == req.prompt_token_ids[:16]
            assert (pushed.decode_address, pushed.sampling_params.max_tokens) == (env.decode[0].address, 1)
            assert sampling_params_from_proto(pushed.sampling_params).temperature == 0.0
            # ... and D, told so, prefills the rest and samples every token, the first one included.
            assert env.decode[0].calls == [("Decode", req.request_id, None)]
            assert env.decode[0].kv_prefixes == {req.request_id: 16}
            assert joined(deltas) == (SCRIPT[:5], "The f")
            # P's 16 cached tokens, and D's own hits past the prefix it was handed (5); P's times and D's added.
            assert done.cached_tokens == 16 + 5
            assert done.timings["queue"] == pytest.approx(0.01 + 0.5)
            assert done.timings["prefill"] == pytest.approx(0.02 + 0.25)
            assert sample(env.router, "splitserve_router_routing_decisions_total", decision="split") == 1
            await eventually(lambda: router_view(env.router, env.decode[0]).active_requests == 0)
            assert router_view(env.router, env.prefill[0]).queued_prompt_tokens == 0
            assert router_view(env.router, env.decode[0]).queued_prompt_tokens == 0
    run(scenario())


def test_stop_string_truncates_the_text_and_cancels_the_decode_stream():
    async def scenario():
        async with running_cluster() as env:
            env.decode[0].token_delay_s = 0.02  # D is still streaming when the router stops reading
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=None, stop=["jumps", "zebra"])
            token_ids, text = joined(deltas)
            assert text == "The fox "
            assert token_ids == SCRIPT[:13]  # up to the token that completed "jumps"
            assert (done.finish_reason, done.stop_reason, done.completion_tokens) == ("stop", "jumps", 13)
            await eventually(lambda: req.request_id in env.decode[0].cancelled)
    run(scenario())


async def first_prefill_pod_broken(env: Env) -> tuple[FakePod, FakePod]:
    """Of two prefill pods, the one least_loaded tries first fails every call (UNAVAILABLE): the other reports a
    queue."""
    broken, healthy = env.prefill
    broken.fail_with = grpc.StatusCode.UNAVAILABLE
    healthy.report(queued_prefill_tokens=500)
    await eventually(lambda: router_view(env.router, healthy).load.queued_prefill_tokens == 500)
    return broken, healthy


def test_retry_on_another_prefill_pod_when_the_first_is_unavailable():
    async def scenario():
        async with running_cluster(num_prefill=2) as env:
            broken, healthy = await first_prefill_pod_broken(env)
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=4)
            assert [c[0] for c in broken.calls] == ["Prefill"]
            assert [c[0] for c in healthy.calls] == ["Prefill"]
            assert joined(deltas) == (SCRIPT[:4], "The ")
            assert done.finish_reason == "length"
    run(scenario())


def test_failure_on_every_attempt_is_unavailable_to_the_client():
    async def scenario():
        async with running_cluster(num_prefill=2, max_retries=1) as env:
            for pod in env.prefill:
                pod.fail_with = grpc.StatusCode.UNAVAILABLE
            req = await env.router.make_request(LONG_PROMPT, SamplingParams(max_tokens=4))
            with pytest.raises(StatusError) as caught:
                [item async for item in env.router.generate(req)]
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert sorted(len(pod.calls) for pod in env.prefill) == [1, 1]
            # D decoded nothing; after each failed Prefill whatever P may have pushed there is dropped.
            assert env.decode[0].calls == [("Abort", req.request_id)] * 2
    run(scenario())


def test_no_serving_pod_is_unavailable_after_the_wait_for_one():
    async def scenario():
        with unserved_port() as never:
            address = f"127.0.0.1:{never.getsockname()[1]}"
            async with running_cluster(num_prefill=1, num_decode=0, extra_decode_addresses=[address],
                                       decode_pod_wait_s=0.3) as env:
                req = await env.router.make_request(LONG_PROMPT, SamplingParams())
                started = time.monotonic()
                with pytest.raises(StatusError) as caught:
                    [item async for item in env.router.generate(req)]
                assert time.monotonic() - started >= 0.3
                assert (caught.value.code, caught.value.http_status) == (grpc.StatusCode.UNAVAILABLE, 503)
                assert caught.value.message == "no decode pod is serving"
                assert env.prefill[0].calls == []
                assert not env.router.ready()
                assert sample(env.router, "splitserve_router_decode_pod_waits_total", outcome="none") == 1
    run(scenario())


def test_a_request_waits_for_a_decode_pod_to_come_up_and_is_served_by_it():
    async def scenario():
        reserved = unserved_port()
        port = reserved.getsockname()[1]
        async with running_cluster(num_prefill=1, num_decode=0, extra_decode_addresses=[f"127.0.0.1:{port}"]) as env:
            req = await env.router.make_request(LONG_PROMPT, SamplingParams(max_tokens=4))
            waiting = asyncio.ensure_future(collect(env.router, req))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # no decode pod yet: it waits instead of a 503
            reserved.close()
            late = FakePod(FakeCluster(), "decode", port=port)
            late.cluster = env.prefill[0].cluster  # the prefill pod's pushes land in the same fake cluster
            late.cluster.pods[late.address] = late
            await late.start()
            try:
                *_, done = await asyncio.wait_for(waiting, 10)
                assert (done.finish_reason, done.completion_tokens) == ("length", 4)
                assert [call[0] for call in late.calls] == ["Decode"]
                assert sample(env.router, "splitserve_router_decode_pod_waits_total", outcome="found") == 1
            finally:
                await late.server.stop(None)
    run(scenario())


def test_a_stream_whose_only_decode_pod_restarts_migrates_back_to_it():
    """Mid-stream the only decode pod goes away and comes back at the same address (a supervisor's restart): the
    router waits for it and moves the request there, from its last token; it never goes back to a pod that failed
    the request and did not restart (the other migration tests)."""
    async def scenario():
        async with running_cluster(num_decode=1) as env:
            pod = env.decode[0]
            pod.fail_after_tokens = 3
            view = router_view(env.router, pod)

            async def restart() -> None:
                await eventually(lambda: pod.cancelled or len(pod.calls) == 1)
                await asyncio.sleep(0.2)
                pod.fail_after_tokens = None
                await pod.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                await eventually(lambda: not view.serving)
                await pod.health.set("", health_pb2.HealthCheckResponse.SERVING)

            restarting = asyncio.ensure_future(restart())
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=10)
            await restarting
            assert joined(deltas) == (SCRIPT[:10], "The fox ju")  # every token once, none lost
            assert (done.finish_reason, done.completion_tokens) == ("length", 10)
            assert pod.resumed[req.request_id] == SCRIPT[:4]
            assert sample(env.router, "splitserve_router_decode_pod_waits_total", outcome="found") == 1
    run(scenario())


def test_a_pod_that_dies_is_skipped_at_once_and_its_last_load_is_shown():
    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=2) as env:
            gone, alive = sorted(env.decode, key=lambda pod: pod.address)
            await gone.server.stop(None)  # its health stream breaks: no poll, no timeout to wait for
            await eventually(lambda: [pod.address for pod in env.router.registry.decode_pods()] == [alive.address],
                             timeout_s=2.0)
            assert [(pod["address"], pod["role"], pod["healthy"]) for pod in env.router.pods()] == [
                (gone.address, "decode", False), (alive.address, "decode", True)]
            alive_view = env.router.pods()[1]
            assert alive_view["load"]["free_kv_blocks"] == 1000 and 0 <= alive_view["seconds_since_report"] < 5
            await generate_all(env.router, SHORT_PROMPT, max_tokens=2)
            assert (len(gone.calls), len(alive.calls)) == (0, 1)
    run(scenario())


def test_pods_shows_the_weight_format_each_pod_reports():
    async def scenario():
        async with running_cluster(num_prefill=1, num_decode=1) as env:
            assert {pod["quantization"] for pod in env.router.pods()} == {None}  # the fake pods say none yet
            env.prefill[0].report(quantization="none")
            env.decode[0].report(quantization="gguf")
            await eventually(lambda: [(pod["role"], pod["quantization"]) for pod in env.router.pods()] == [
                ("decode", "gguf"), ("prefill", "none")], timeout_s=2.0)
    run(scenario())


def test_a_draining_pod_gets_no_new_requests_and_a_quiet_one_stays_routable():
    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=2) as env:
            draining, other = sorted(env.decode, key=lambda pod: pod.address)
            draining.report(draining=True)
            await eventually(lambda: [pod.address for pod in env.router.registry.decode_pods()] == [other.address])
            await generate_all(env.router, SHORT_PROMPT, max_tokens=2)
            assert (len(draining.calls), len(other.calls)) == (0, 1)
            await draining.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # the pod's own drain says so
            draining.report(draining=False)
            await asyncio.sleep(0.3)
            assert not router_view(env.router, draining).healthy  # its health still says NOT_SERVING
            # No load report for a long while (a pod deep in a long step) is no reason to skip a pod.
            await asyncio.sleep(2.5)
            assert router_view(env.router, other).healthy
    run(scenario())


def test_a_pod_that_comes_up_late_is_routed_to_about_a_second_after_it_serves():
    """gRPC backs a channel's reconnects off exponentially (1 s, 1.6 s, 2.6 s, ...): with its defaults, a pod that
    starts serving 12 s after the router began polling it stays unreachable for seconds more, and requests meant for
    it go elsewhere (a long prompt prefilled on the decode pod). The router's channels retry every second."""
    reserved = unserved_port()
    late_port = reserved.getsockname()[1]
    late_address = f"127.0.0.1:{late_port}"

    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=1, extra_decode_addresses=[late_address]) as env:
            await asyncio.sleep(12)  # watched all along: the channel has failed to connect over and over
            assert late_address not in [pod.address for pod in env.router.registry.decode_pods()]
            reserved.close()
            late = FakePod(FakeCluster(), "decode", port=late_port)
            await late.start()
            started = time.monotonic()
            try:
                await eventually(lambda: late_address in [pod.address for pod in env.router.registry.decode_pods()],
                                 timeout_s=15)
                assert time.monotonic() - started < 2.5
                assert next(pod for pod in env.router.pods() if pod["address"] == late_address)["healthy"]
            finally:
                await late.server.stop(None)
    run(scenario())


def test_resource_exhausted_tries_another_pod_then_reaches_the_client():
    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=2, max_retries=1) as env:
            full, roomy = sorted(env.decode, key=lambda pod: pod.address)  # least_loaded ties go by address
            full.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
            _, deltas, done = await generate_all(env.router, SHORT_PROMPT, max_tokens=3)
            assert (len(full.calls), len(roomy.calls), joined(deltas)[1]) == (1, 1, "The")

            roomy.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
            req = await env.router.make_request(SHORT_PROMPT, SamplingParams(max_tokens=3))
            with pytest.raises(StatusError) as caught:
                [item async for item in env.router.generate(req)]
            assert (caught.value.code, caught.value.http_status) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 429)
            assert (len(full.calls), len(roomy.calls)) == (2, 2)
    run(scenario())


def test_a_decode_pod_failing_mid_stream_hands_the_request_to_another_which_resumes_it():
    async def scenario():
        async with running_cluster(num_decode=2) as env:
            first_d, second_d = sorted(env.decode, key=lambda pod: pod.address)
            first_d.fail_after_tokens = 3
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=10)
            assert joined(deltas) == (SCRIPT[:10], "The fox ju")  # every token once, none lost
            assert (done.finish_reason, done.completion_tokens) == ("length", 10)
            # P's token and D1's three went out; D2 prefilled the prompt and those four, then went on.
            assert [c[0] for c in first_d.calls] == [c[0] for c in second_d.calls] == ["Decode"]
            assert second_d.resumed[req.request_id] == SCRIPT[:4]
            assert sample(env.router, "splitserve_router_migrations_total") == 1
            assert sample(env.router, "splitserve_request_success_total", finished_reason="length") == 1
    run(scenario())


def test_failure_after_output_started_with_nowhere_to_migrate_ends_with_an_error_completion():
    async def scenario():
        async with running_cluster(num_decode=1, decode_pod_wait_s=0.2) as env:
            env.decode[0].fail_after_tokens = 3
            _, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=10)
            assert joined(deltas) == (SCRIPT[:4], "The ")  # P's token and D's first three
            assert (done.finish_reason, done.completion_tokens) == ("error", 4)
            assert done.error.code == grpc.StatusCode.UNAVAILABLE
            assert "fake decode pod lost its accelerator" in done.error.message
            assert "no other decode pod" in done.error.message
            assert sample(env.router, "splitserve_request_success_total", finished_reason="error") == 1
    run(scenario())


async def ranked_decode_pods(env: Env) -> list[FakePod]:
    """The decode pods, made the least loaded policy's choices in this order (most free KV blocks first)."""
    ranked = sorted(env.decode, key=lambda pod: pod.address)
    for rank, pod in enumerate(ranked):
        pod.report(free_kv_blocks=1000 - 10 * rank)
    await eventually(lambda: all(router_view(env.router, pod).load.free_kv_blocks == pod.load.free_kv_blocks
                                 for pod in ranked))
    return ranked


def test_a_migration_target_that_fails_before_its_first_token_is_passed_over_for_the_next():
    async def scenario():
        async with running_cluster(num_decode=3) as env:
            first_d, dead_target, last_d = await ranked_decode_pods(env)
            first_d.fail_after_tokens = 3
            dead_target.fail_with = grpc.StatusCode.UNAVAILABLE
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=10)
            assert joined(deltas) == (SCRIPT[:10], "The fox ju")  # every token once, none lost
            assert (done.finish_reason, done.completion_tokens) == ("length", 10)
            assert [len(pod.calls) for pod in (first_d, dead_target, last_d)] == [1, 1, 1]
            assert last_d.resumed[req.request_id] == SCRIPT[:4]
            assert sample(env.router, "splitserve_router_migrations_total") == 2
    run(scenario())


def test_a_second_migration_never_goes_back_to_a_pod_that_failed_the_request():
    async def scenario():
        async with running_cluster(num_decode=3, decode_pod_wait_s=0.2) as env:
            first_d, second_d, last_d = await ranked_decode_pods(env)
            first_d.fail_after_tokens = 3  # it would fail again: the router must not come back to it
            second_d.fail_after_tokens = 2
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=10)
            assert joined(deltas) == (SCRIPT[:10], "The fox ju")
            assert (done.finish_reason, done.completion_tokens) == ("length", 10)
            assert [len(pod.calls) for pod in (first_d, second_d, last_d)] == [1, 1, 1]
            assert (second_d.resumed[req.request_id], last_d.resumed[req.request_id]) == (SCRIPT[:4], SCRIPT[:6])
            assert sample(env.router, "splitserve_router_migrations_total") == 2
    run(scenario())


def test_migrations_stop_at_max_migrations_even_with_pods_left():
    async def scenario():
        async with running_cluster(num_decode=3, max_migrations=1) as env:
            first_d, second_d, last_d = await ranked_decode_pods(env)
            first_d.fail_after_tokens = 3
            second_d.fail_with = grpc.StatusCode.UNAVAILABLE
            _, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=10)
            assert (done.finish_reason, joined(deltas)[0]) == ("error", SCRIPT[:4])
            assert "fake decode pod says UNAVAILABLE" in done.error.message
            assert (len(second_d.calls), last_d.calls) == (1, [])
    run(scenario())


def test_migration_can_be_turned_off():
    async def scenario():
        async with running_cluster(num_decode=2, max_migrations=0) as env:
            for pod in env.decode:
                pod.fail_after_tokens = 3
            _, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=10)
            assert (done.finish_reason, joined(deltas)[0]) == ("error", SCRIPT[:4])
            assert sum(len(pod.calls) for pod in env.decode) == 1
    run(scenario())


def test_deadline_before_the_first_token_is_deadline_exceeded():
    async def scenario():
        async with running_cluster(request_timeout_s=0.1) as env:
            env.decode[0].token_delay_s = 1.0
            req = await env.router.make_request(SHORT_PROMPT, SamplingParams(max_tokens=3))
            with pytest.raises(StatusError) as caught:
                [item async for item in env.router.generate(req)]
            assert (caught.value.code, caught.value.http_status) == (grpc.StatusCode.DEADLINE_EXCEEDED, 504)
    run(scenario())


def test_client_closing_the_stream_cancels_the_decode_pod():
    async def scenario():
        async with running_cluster() as env:
            env.decode[0].token_delay_s = 0.02
            req = await env.router.make_request(LONG_PROMPT, SamplingParams(max_tokens=None))
            stream = env.router.generate(req)
            received = [await anext(stream), await anext(stream)]
            await stream.aclose()
            assert [d.token_ids for d in received] == [[SCRIPT[0]], [SCRIPT[1]]]
            await eventually(lambda: req.request_id in env.decode[0].cancelled)
            assert sample(env.router, "splitserve_num_requests_running") == 0
            assert sample(env.router, "splitserve_request_success_total", finished_reason="abort") == 1
    run(scenario())


@pytest.mark.parametrize("how", ["abort", "client gone"])
def test_a_request_ended_early_asks_the_decode_pod_to_drop_the_kv_pushed_to_it(how):
    """P may have pushed the KV to D already while the request ends during its prefill: D would hold those blocks
    until the lease expires, unless the router's Abort drops them at once."""
    async def scenario():
        async with running_cluster() as env:
            prefill, decode = env.prefill[0], env.decode[0]
            prefill.first_token_delay_s = 1.0
            req = await env.router.make_request(LONG_PROMPT, SamplingParams(max_tokens=None))
            task = asyncio.create_task(collect(env.router, req))
            await eventually(lambda: [c[0] for c in prefill.calls] == ["Prefill"])
            if how == "abort":
                assert await env.router.abort(req.request_id) is True
                assert [item.finish_reason for item in await task] == ["abort"]
            else:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await eventually(lambda: decode.calls == [("Abort", req.request_id)])
    run(scenario())


def test_a_request_that_ran_to_its_end_sends_no_abort():
    async def scenario():
        async with running_cluster() as env:
            req, _, done = await generate_all(env.router, LONG_PROMPT, max_tokens=5)
            assert done.finish_reason == "length"
            # An Abort would be sent in the background, from the request's end (which ran before generate_all
            # returned): wait for every such call to be over, then look.
            await background_calls_done(env.router)
            assert [c[0] for c in env.decode[0].calls] == ["Decode"]
    run(scenario())


def test_abort_ends_the_stream_with_an_abort_completion():
    async def scenario():
        async with running_cluster() as env:
            env.decode[0].token_delay_s = 0.02
            req = await env.router.make_request(LONG_PROMPT, SamplingParams(max_tokens=None))
            items = []
            async for item in env.router.generate(req):
                items.append(item)
                if len(items) == 3:
                    assert await env.router.abort(req.request_id) is True
            assert [item.finish_reason for item in items[3:]] == ["abort"]
            assert items[-1].completion_tokens == 3
            await eventually(lambda: req.request_id in env.decode[0].cancelled)
            assert await env.router.abort(req.request_id) is False
    run(scenario())


def test_logprobs_are_one_dict_per_token_top_alternatives_first():
    async def scenario():
        async with running_cluster() as env:
            _, deltas, _ = await generate_all(env.router, LONG_PROMPT, max_tokens=3, logprobs=1)
            assert [d.logprobs for d in deltas] == [[{7: -0.25, t: -1.5}] for t in SCRIPT[:3]]
    run(scenario())


def test_invalid_requests_are_invalid_argument_naming_the_field():
    async def scenario():
        async with running_cluster() as env:
            router = env.router
            cases = [
                ("", SamplingParams(), "prompt: must not be empty"),
                ([5, 259], SamplingParams(), "prompt: token ids must be integers in [0, 259), got [259]"),
                ("x" * 2048, SamplingParams(), "prompt: 2048 tokens leave no room for output"),
                ("abc", SamplingParams(max_tokens=2046),
                 "max_tokens: the prompt's 3 tokens + max_tokens 2046 exceed the model's context of 2048 tokens"),
            ]
            for prompt, params, message in cases:
                with pytest.raises(StatusError) as caught:
                    await router.make_request(prompt, params)
                assert (caught.value.code, caught.value.http_status) == (grpc.StatusCode.INVALID_ARGUMENT, 400)
                assert caught.value.message.startswith(message)
            assert (await router.make_request("abc", SamplingParams(max_tokens=None))).params.max_tokens == 2045
    run(scenario())


def test_metrics_count_requests_and_tokens():
    async def scenario():
        async with running_cluster() as env:
            streamed = 0
            for prompt, max_tokens in ((LONG_PROMPT, 6), (SHORT_PROMPT, 4), (LONG_PROMPT, 1)):
                _, deltas, _ = await generate_all(env.router, prompt, max_tokens=max_tokens)
                streamed += len(joined(deltas)[0])
            router = env.router
            assert streamed == 11
            assert sample(router, "splitserve_time_to_first_token_seconds_count") == 3
            assert sample(router, "splitserve_e2e_request_latency_seconds_count") == 3
            assert sample(router, "splitserve_generation_tokens_total") == 11
            assert sample(router, "splitserve_prompt_tokens_total") == 36 + 2 + 36
            assert sample(router, "splitserve_request_success_total", finished_reason="length") == 3
            # Chunks after the first: 5 + 3 + 0; TPOT for requests with more than one token.
            assert sample(router, "splitserve_inter_token_latency_seconds_count") == 8
            assert sample(router, "splitserve_request_time_per_output_token_seconds_count") == 2
            # The two disaggregated requests report a KV transfer; all three a queue and prefill time.
            assert sample(router, "splitserve_kv_transfer_time_seconds_count") == 2
            assert sample(router, "splitserve_request_queue_time_seconds_sum") == pytest.approx(0.01 + 0.5 + 0.01)
            assert sample(router, "splitserve_num_requests_running") == 0
    run(scenario())


async def grpc_generate(stub, **request_fields):
    return [response async for response in stub.Generate(generate_pb2.GenerateRequest(**request_fields))]


def test_grpc_generation_api_end_to_end_with_health_and_reflection():
    async def scenario():
        async with running_cluster(decode_pod_wait_s=0.2) as env:  # its last request fails with nowhere to go
            server = RouterServer(env.router.config, env.router)
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                    await check_generate(generate_pb2_grpc.GenerationStub(channel), env)
                    # Its last request left the decode pod suspect (up to 2 s): the router serves again once that
                    # lapses, the state whose health is checked (checked sooner, it is NOT_SERVING).
                    await serving_again(channel, timeout_s=10)
                    await check_health_and_reflection(channel)
            finally:
                await server.stop(grace_s=0)
    run(scenario())


async def check_generate(stub, env):
    responses = await grpc_generate(stub, request_id="g1", text=LONG_PROMPT, model=MODEL,
                                    sampling_params=common_pb2.SamplingParams(max_tokens=8, logprobs=1))
    assert {r.request_id for r in responses} == {"g1"}
    chunks, last = responses[:-1], responses[-1]
    assert all(r.WhichOneof("response") == "chunk" for r in chunks)
    assert [t for r in chunks for t in r.chunk.token_ids] == SCRIPT[:8]
    assert "".join(r.chunk.text for r in chunks) == "The fox "
    assert chunks[0].chunk.logprobs.tokens[0] == common_pb2.TokenLogprob(
        token_id=SCRIPT[0], logprob=-1.5, top_logprobs=[common_pb2.TopLogprob(token_id=7, logprob=-0.25)])
    complete = last.complete
    assert complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert complete.WhichOneof("stop_reason") is None
    assert complete.usage == common_pb2.Usage(prompt_tokens=36, completion_tokens=8, cached_tokens=16)
    assert (complete.timings.queue_seconds, complete.timings.kv_transfer_seconds) == (0.01, 0.003)

    responses = await grpc_generate(stub, token_ids=generate_pb2.TokenIds(ids=TOKENIZER.encode(LONG_PROMPT)),
                                    sampling_params=common_pb2.SamplingParams(stop=["fox"]))
    assert "".join(r.chunk.text for r in responses[:-1]) == "The "
    assert (responses[-1].complete.finish_reason, responses[-1].complete.stop_str) == \
        (common_pb2.FINISH_REASON_STOP, "fox")

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await grpc_generate(stub, text="hi", sampling_params=common_pb2.SamplingParams(temperature=-1))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling_params.temperature must be >= 0")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await grpc_generate(stub, text="hi", model="gpt-4")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    env.decode[0].fail_after_tokens = 2
    responses = await grpc_generate(stub, text=LONG_PROMPT, sampling_params=common_pb2.SamplingParams(max_tokens=8))
    assert [r.WhichOneof("response") for r in responses] == ["chunk"] * 3 + ["error"]
    assert responses[-1].error.code == grpc.StatusCode.UNAVAILABLE.value[0]


async def serving_again(channel, timeout_s: float) -> None:
    """Until the router's health says SERVING (it follows ``router.ready()`` every ``HEALTH_REFRESH_S``)."""
    health = health_pb2_grpc.HealthStub(channel)
    for _ in range(int(timeout_s / 0.05)):
        response = await health.Check(health_pb2.HealthCheckRequest(service=""))
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the router's health did not turn SERVING within {timeout_s} s")


async def check_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "splitserve.v1.Generation"):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = [r async for r in reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
    names = {service.name for service in responses[0].list_services_response.service}
    assert names == {"splitserve.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


def test_grpc_abort_ends_the_stream_with_abort():
    async def scenario():
        async with running_cluster() as env:
            env.decode[0].token_delay_s = 0.02
            server = RouterServer(env.router.config, env.router)
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                    stub = generate_pb2_grpc.GenerationStub(channel)
                    call = stub.Generate(generate_pb2.GenerateRequest(request_id="a1", text=LONG_PROMPT))
                    responses = [await call.read()]
                    aborted = await stub.Abort(common_pb2.AbortRequest(request_id="a1"))
                    while (response := await call.read()) is not grpc.aio.EOF:
                        responses.append(response)
                    assert aborted.found
                    assert responses[-1].complete.finish_reason == common_pb2.FINISH_REASON_ABORT
            finally:
                await server.stop(grace_s=0)
    run(scenario())


@pytest.mark.e2e
def test_router_process_serves_both_apis_and_stops_gracefully_on_sigterm():
    grpc_port, http_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "splitserve.router.server", "--model", MODEL,
         "--decode-pods", f"127.0.0.1:{free_port()}", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
         "--http-port", str(http_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            # Its only decode pod does not answer: the router is up but cannot serve, and says so.
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        for _ in range(100):  # the HTTP API starts right after the gRPC one
            try:
                models = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=5)
                break
            except httpx.ConnectError:
                time.sleep(0.05)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# ---- admission: shedding load before any work -------------------------------------------------------------------

def test_requests_beyond_max_pending_get_resource_exhausted_with_a_retry_hint():
    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=1, max_pending_requests=3) as env:
            env.decode[0].first_token_delay_s = 1.0
            requests = [await env.router.make_request(SHORT_PROMPT, SamplingParams(max_tokens=2)) for _ in range(4)]
            waiting = [asyncio.ensure_future(collect(env.router, req)) for req in requests[:3]]
            await eventually(lambda: len(env.decode[0].calls) == 3)
            with pytest.raises(StatusError) as caught:
                await collect(env.router, requests[3])
            assert (caught.value.code, caught.value.http_status) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 429)
            assert "3 requests are already waiting for their first token" in caught.value.message
            assert caught.value.retry_after_s is not None and caught.value.retry_after_s > 0
            assert len(env.decode[0].calls) == 3  # the refused request never reached a pod
            assert [done.finish_reason for *_, done in await asyncio.gather(*waiting)] == ["length"] * 3
            assert sample(env.router, "splitserve_router_rejected_requests_total", code="RESOURCE_EXHAUSTED") == 1
            # With the first tokens out, there is room again.
            again = await env.router.make_request(SHORT_PROMPT, SamplingParams(max_tokens=2))
            assert await collect(env.router, again)
    run(scenario())


def test_a_prompt_that_would_queue_past_max_queue_time_is_refused_with_the_wait_as_retry_after():
    async def scenario():
        async with running_cluster(num_prefill=1, num_decode=1, max_queue_time_s=30) as env:
            env.prefill[0].report(queued_prefill_tokens=10_000, prefill_tokens_per_second=200.0)  # 50 s of work
            await eventually(lambda: router_view(env.router, env.prefill[0]).load.prefill_tokens_per_second == 200)
            req = await env.router.make_request(LONG_PROMPT, SamplingParams(max_tokens=2))
            with pytest.raises(StatusError) as caught:
                await collect(env.router, req)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "would start this prompt in about 50.0 s" in caught.value.message
            assert caught.value.retry_after_s == pytest.approx(20.0)
            assert env.prefill[0].calls == []
            env.prefill[0].report(queued_prefill_tokens=1_000)  # 5 s: fine
            await eventually(lambda: router_view(env.router, env.prefill[0]).load.queued_prefill_tokens == 1_000)
            req = await env.router.make_request(LONG_PROMPT, SamplingParams(max_tokens=2))
            *_, done = await collect(env.router, req)
            assert done.finish_reason == "length"
    run(scenario())


def test_a_pods_own_cancellation_is_unavailable_and_retried_never_cancelled():
    async def scenario():
        async with running_cluster(num_prefill=0, num_decode=2, max_retries=1) as env:
            stopping, other = sorted(env.decode, key=lambda pod: pod.address)
            stopping.fail_with = grpc.StatusCode.CANCELLED  # a pod shutting down cancels what it holds
            req = await env.router.make_request(SHORT_PROMPT, SamplingParams(max_tokens=2))
            *_, done = await collect(env.router, req)
            assert done.finish_reason == "length" and len(other.calls) == 1
            other.fail_with = grpc.StatusCode.CANCELLED
            with pytest.raises(StatusError) as caught:
                await collect(env.router, await env.router.make_request(SHORT_PROMPT, SamplingParams(max_tokens=2)))
            assert (caught.value.code, caught.value.http_status) == (grpc.StatusCode.UNAVAILABLE, 503)
            assert "cancelled the request" in caught.value.message
    run(scenario())


@pytest.mark.parametrize("failure", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
                                     grpc.StatusCode.DEADLINE_EXCEEDED])
def test_when_every_prefill_pod_fails_the_decode_pod_prefills(failure):
    """A prefill pod gone, a corrupt transfer (DATA_LOSS) or one past its own deadline: try elsewhere."""
    async def scenario():
        async with running_cluster(num_prefill=1, num_decode=1) as env:
            env.prefill[0].fail_with = failure
            req, deltas, done = await generate_all(env.router, LONG_PROMPT, max_tokens=5)
            assert joined(deltas)[0] == SCRIPT[:5] and done.finish_reason == "length"
            assert [c[0] for c in env.prefill[0].calls] == ["Prefill"]
            # What P may have pushed to D before it failed is dropped there; then D prefills (no first token).
            assert env.decode[0].calls == [("Abort", req.request_id), ("Decode", req.request_id, None)]
            assert sample(env.router, "splitserve_router_retries_total", code=failure.name) == 1
            assert sample(env.router, "splitserve_router_routing_decisions_total", decision="prefill_on_decode") == 1
    run(scenario())


async def collect(router: Router, req):
    return [item async for item in router.generate(req)]


def test_grpc_clients_get_the_retry_hint_as_retry_pushback_metadata():
    async def scenario():
        async with running_cluster(num_prefill=1, num_decode=1, max_queue_time_s=30) as env:
            env.prefill[0].report(queued_prefill_tokens=10_000, prefill_tokens_per_second=200.0)
            await eventually(lambda: router_view(env.router, env.prefill[0]).load.prefill_tokens_per_second == 200)
            server = RouterServer(env.router.config, env.router)
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                    call = generate_pb2_grpc.GenerationStub(channel).Generate(
                        generate_pb2.GenerateRequest(text=LONG_PROMPT))
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call.read()
                    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert dict(caught.value.trailing_metadata())["grpc-retry-pushback-ms"] == "20000"
            finally:
                await server.stop(grace_s=0)
    run(scenario())

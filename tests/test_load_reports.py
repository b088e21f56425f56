"""A pod's load reports never wait for its engine, and a busy pod is never taken for a dead one.

A real decode pod (tiny random model) and a real router registry watching it over gRPC. The engine is kept busy
for seconds by a command that runs Python on the engine thread (holding the interpreter as a long, Python-heavy
step does): the pod's PodStatus must still answer at once, and the router must keep routing to it. Before, a
``GetLoad`` poll waited for the engine's step and the router skipped the pod after three late answers.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from splitserve.decode_service.config import DecodeConfig
from splitserve.decode_service.server import build_decode_services
from splitserve.router.config import RouterConfig
from splitserve.router.router import Router
from splitserve.runtime.pod_server import Pod
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, pod_status_pb2, pod_status_pb2_grpc

MODEL = "tiny-random"
BUSY_S = 3.0


def busy_python(seconds: float) -> None:
    """Keeps the calling thread in the interpreter, as a Python-heavy engine step does."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


async def start_decode_pod() -> Pod:
    config = DecodeConfig(host="127.0.0.1", port=0, metrics_port=0, model=MODEL, num_blocks=64)
    pod = Pod(config, "decode")
    await pod.start(await build_decode_services(pod, config))
    return pod


def test_a_pod_whose_engine_is_busy_answers_its_load_at_once_and_stays_routable():
    async def scenario():
        pod = await start_decode_pod()
        address = f"127.0.0.1:{pod.port}"
        router = Router(RouterConfig(model=MODEL, decode_pods=[address], grpc_port=0, http_port=0))
        await router.start()
        channel = grpc.aio.insecure_channel(address)
        try:
            assert [p.address for p in router.registry.decode_pods()] == [address]
            started = threading.Event()
            busy = pod.engine_loop.call(lambda engine: (started.set(), busy_python(BUSY_S)))
            while not started.is_set():
                await asyncio.sleep(0.01)

            status = pod_status_pb2_grpc.PodStatusStub(channel)
            slowest_answer, routable = 0.0, []
            while not busy.done():
                asked = time.perf_counter()
                await status.GetLoad(pod_status_pb2.LoadRequest(), timeout=2.0)
                slowest_answer = max(slowest_answer, time.perf_counter() - asked)
                routable.append(bool(router.registry.decode_pods()))
                await asyncio.sleep(0.1)
            assert len(routable) >= 10  # the engine was busy for the whole sampling
            assert all(routable), "the router dropped a busy pod"
            assert slowest_answer < 0.5, f"GetLoad waited {slowest_answer:.2f} s for the engine"
        finally:
            await channel.close()
            await router.stop()
            await pod.stop()
    asyncio.run(scenario())


def test_the_routers_view_follows_each_admission_without_polling():
    async def scenario():
        pod = await start_decode_pod()
        address = f"127.0.0.1:{pod.port}"
        router = Router(RouterConfig(model=MODEL, decode_pods=[address], grpc_port=0, http_port=0))
        await router.start()
        channel = grpc.aio.insecure_channel(address)
        try:
            view = router.registry.pods[address]
            assert (view.load.num_running, view.load.free_kv_blocks) == (0, 64)
            params = common_pb2.SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
            stream = decode_pb2_grpc.DecodeStub(channel).Decode(decode_pb2.DecodeRequest(
                request_id="long", prompt_token_ids=list(range(3, 40)), sampling_params=params))
            await stream.read()
            deadline = time.monotonic() + 2.0
            while view.load.num_running != 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert view.load.num_running == 1 and view.load.free_kv_blocks < 64
            assert view.load.decode_step_seconds > 0 and view.load.prefill_tokens_per_second > 0
            stream.cancel()
            deadline = time.monotonic() + 2.0
            while view.load.free_kv_blocks != 64 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert (view.load.num_running, view.load.free_kv_blocks) == (0, 64)
        finally:
            await channel.close()
            await router.stop()
            await pod.stop()
    asyncio.run(scenario())


def test_a_draining_pod_says_so_in_its_load_and_its_health_before_it_stops():
    async def scenario():
        pod = await start_decode_pod()
        address = f"127.0.0.1:{pod.port}"
        router = Router(RouterConfig(model=MODEL, decode_pods=[address], grpc_port=0, http_port=0))
        await router.start()
        try:
            assert router.ready()
            pod.config.shutdown_grace_s = 1.0
            stopping = asyncio.ensure_future(pod.stop())
            deadline = time.monotonic() + 1.0
            while router.ready() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert not router.ready()  # the router stopped routing to it at once, not after a timeout
            await stopping
        finally:
            await router.stop()
    asyncio.run(scenario())

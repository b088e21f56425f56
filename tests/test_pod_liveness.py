"""Liveness that sees a dead engine: a real decode pod (tiny random model, gRPC on loopback) whose engine thread is
killed, or held past ``engine_stall_s``, answers health NOT_SERVING (what the chart's liveness probe asks), and a
stall that ends turns it SERVING again."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.decode_service.config import DecodeConfig
from splitserve.decode_service.server import build_decode_services
from splitserve.runtime import transport
from splitserve.runtime.pod_server import Pod
from splitserve.runtime.roles import Role

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
STALL_S = 1.0


@contextlib.asynccontextmanager
async def started_pod():
    """A real decode pod on loopback, stopped (drained) on leaving."""
    config = DecodeConfig(model="tiny-random", host="127.0.0.1", port=0, metrics_port=0, num_blocks=16,
                          engine_stall_s=STALL_S)
    pod = Pod(config, Role.DECODE)
    await pod.start(await build_decode_services(pod, config))
    try:
        yield pod
    finally:
        await pod.stop()


async def _status(pod: Pod, service: str = "") -> int:
    async with transport.open_channel(f"127.0.0.1:{pod.port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=3)
        return reply.status


async def _wait_status(pod: Pod, wanted: int, within_s: float) -> float:
    """Seconds until health answers ``wanted``; fails after ``within_s``."""
    started = time.monotonic()
    while (status := await _status(pod)) != wanted:
        assert time.monotonic() - started < within_s, f"health still {status} after {within_s} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


def _kill(thread_id: int) -> None:
    """Raise SystemExit inside another thread, as an unhandled error would end it."""
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(SystemExit)) == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit we raised
def test_a_pod_whose_engine_thread_died_turns_not_serving():
    async def scenario():
        async with started_pod() as pod:
            assert await _status(pod) == SERVING
            _kill(pod.engine_loop._thread.ident)
            await _wait_status(pod, NOT_SERVING, within_s=5)
            assert not pod.engine_loop.is_running()
            assert await _status(pod, "splitserve.v1.Decode") == NOT_SERVING  # every service, not only ""
    asyncio.run(scenario())


def test_a_stalled_engine_turns_not_serving_and_serving_again_when_it_comes_round():
    async def scenario():
        async with started_pod() as pod:
            held = pod.engine_loop.call(lambda engine: time.sleep(4 * STALL_S))  # the engine thread is stuck
            await _wait_status(pod, NOT_SERVING, within_s=3 * STALL_S)
            await asyncio.wrap_future(held)
            await _wait_status(pod, SERVING, within_s=3)
    asyncio.run(scenario())


def test_an_idle_engine_stays_serving():
    async def scenario():
        async with started_pod() as pod:
            await asyncio.sleep(3 * STALL_S)  # idle: the loop comes round every half second
            assert await _status(pod) == SERVING
    asyncio.run(scenario())


def test_the_stall_bound_is_checked():
    with pytest.raises(ValueError, match="^engine_stall_s must be > 0, got 0$"):
        DecodeConfig(model="tiny-random", engine_stall_s=0)

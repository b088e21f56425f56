"""``PodMonitor``: the router's live view of one pod, from two streams the pod pushes, each reconnected when it breaks.

    health   grpc.health.v1 Health.Watch("") -> pod.serving follows SERVING / NOT_SERVING; a broken stream (the
             process died, the connection broke, keepalive pings went unanswered) -> not serving, at once
    load     PodStatus.WatchLoad -> pod.take_report(load) after each of the pod's engine steps; a broken stream
             keeps the last load: load is a hint, and liveness is the health stream's to say

A busy pod may answer late; neither stream has a deadline, so late is never taken for dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2

from splitserve.router.pods.client import PodClient
from splitserve.router.pods.registry import PodInfo, PodLoad

log = logging.getLogger(__name__)

RECONNECT_S = 0.5  # pause before watching again after a stream broke (the channel itself retries every second)


class PodMonitor:
    def __init__(self, pod: PodInfo, client: PodClient, on_change: Callable[[PodInfo], None]):
        self.pod = pod
        self.first_report = asyncio.Event()  # the first health and load answers (or failures to get them)
        self._first_health, self._first_load = False, False
        self._client = client
        self._on_change = on_change
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch_health(), name=f"health-{self.pod.address}"),
                       asyncio.create_task(self._watch_load(), name=f"load-{self.pod.address}")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _watch_health(self) -> None:
        while True:
            reason = "its health stream ended"
            try:
                async for reply in self._client.watch_health():
                    self._set_serving(reply.status == health_pb2.HealthCheckResponse.SERVING,
                                      health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.aio.AioRpcError as error:
                reason = f"{error.code().name}: {error.details()}"
            self._set_serving(False, reason)
            await asyncio.sleep(RECONNECT_S)

    def _set_serving(self, serving: bool, why: str) -> None:
        pod = self.pod
        if serving != pod.serving:
            if serving:
                log.info("pod %s (%s) is serving", pod.address, pod.role)
                pod.serving_since = time.monotonic()
            else:
                log.warning("pod %s (%s) is not serving (%s): not routing to it", pod.address, pod.role, why)
            pod.serving = serving
            self._on_change(pod)
        self._first_health = True
        self._note_first_report()

    def _note_first_report(self) -> None:
        if self._first_health and self._first_load:
            self.first_report.set()

    async def _watch_load(self) -> None:
        while True:
            try:
                async for load in self._client.watch_load():
                    self.pod.take_report(PodLoad.from_proto(load))
                    self._on_change(self.pod)
                    self._first_load = True
                    self._note_first_report()
            except grpc.aio.AioRpcError:
                pass  # the health stream tells whether the pod is gone; here, just try again
            self._first_load = True
            self._note_first_report()
            await asyncio.sleep(RECONNECT_S)

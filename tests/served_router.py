"""A real router (``RouterServer``: gRPC and HTTP on loopback) over the fake pods of ``test_router_flow``, on an
event loop in a thread of its own, so that a test can drive it with blocking clients (``openai``, ``httpx``,
``grpcurl``, grpc's synchronous stubs) as users do."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from dataclasses import dataclass
from typing import Any

from test_router_flow import Env, running_cluster

from splitserve.router.server import RouterServer


@dataclass
class Endpoints:
    grpc: str  # host:port
    http: str  # http(s)://host:port
    server: RouterServer
    env: Env  # the router and its fake pods (touch them only through ``call``)
    call: Any  # call(fn, *args): runs fn on the router's loop (a coroutine function is awaited); its result


class RouterInThread:
    """``with RouterInThread(**router_config) as endpoints:`` a started router, stopped on leaving."""

    def __init__(self, num_prefill: int = 1, num_decode: int = 1, **config):
        self.pods = {"num_prefill": num_prefill, "num_decode": num_decode}
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self.endpoints: Endpoints | None = None

    def __enter__(self) -> Endpoints:
        started = threading.Event()
        self._failure: BaseException | None = None

        async def serve():
            self._stop = asyncio.Event()
            try:
                async with running_cluster(**self.pods, **self.config) as env:
                    config = dataclasses.replace(env.router.config, http_port=free_port())
                    server = RouterServer(config, env.router)
                    await server.start()
                    scheme = "https" if config.tls_cert_file else "http"
                    self.endpoints = Endpoints(f"127.0.0.1:{server.grpc_port}",
                                               f"{scheme}://127.0.0.1:{config.http_port}", server, env, self.call)
                    started.set()
                    await self._stop.wait()
                    await server.stop(grace_s=0)
            except BaseException as error:  # noqa: BLE001 - reported to the test's thread
                self._failure = error
                started.set()
            finally:  # what the router left running (a registry poll between two ticks) ends with the loop
                for task in asyncio.all_tasks() - {asyncio.current_task()}:
                    task.cancel()

        self._thread = threading.Thread(target=lambda: self._loop.run_until_complete(serve()), daemon=True)
        self._thread.start()
        assert started.wait(60), "the router did not start"
        if self._failure is not None:
            raise self._failure
        return self.endpoints

    def call(self, fn, *args):
        async def on_the_loop():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(on_the_loop(), self._loop).result(30)

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self._loop.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

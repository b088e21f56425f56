"""The router process: both client-facing APIs over one ``Router``, in one event loop.

    python -m splitserve.router.server --decode-pods host:port --prefill-pods host:port   (flags: see RouterConfig)

``RouterServer.start()``: the router's registry starts (first load poll or scan done: the first request sees
the pods) -> the gRPC server (``Generation``, ``grpc.health.v1.Health`` reporting SERVING, server reflection
listing the services; with ``probe_port``, the same health alone in plain text there, for kubelet's gRPC probe
under TLS) -> the OpenAI-compatible HTTP API (``splitserve.router.openai.app.create_app``) on uvicorn -> with
``metrics_port``, a plain-HTTP Prometheus ``/metrics`` (the pods have one too): under mutual TLS a scraper cannot
reach the HTTPS API's ``/metrics`` without a client certificate.

Both servers take the router's TLS settings (``tls_*``: gRPC over TLS, HTTPS; with ``tls_require_client_cert``
both require client certificates), its API keys (``APIKeyInterceptor`` on gRPC, the app's middleware on HTTP)
and its request size limit (``max_request_bytes``: gRPC's receive limit, the HTTP body limit).

``serve(config)`` runs that until SIGTERM or SIGINT, then stops gracefully: health turns NOT_SERVING, the
HTTP and gRPC servers stop accepting together and give their in-flight requests ``shutdown_grace_s`` to end (the
chart's terminationGracePeriodSeconds is derived from it), and only then do the router's pod connections close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import sys

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from splitserve.router.api_keys import APIKeys
from splitserve.router.config import RouterConfig
from splitserve.router.grpc_api import GENERATION_SERVICE, APIKeyInterceptor, GenerationServicer, add_generation_service
from splitserve.router.router import Router
from splitserve.runtime import transport
from splitserve.runtime.config import parse_config
from splitserve.runtime.cpus import allowed_cpus, format_cpu_list, pin_cpu_set
from splitserve.runtime.logs import configure_logging

log = logging.getLogger(__name__)

HEALTH_REFRESH_S = 0.25  # how often the health status follows the router's readiness
CERTIFICATE_CHECK_S = 1.0  # how often the HTTPS listener looks for renewed certificate files


class _EmbeddedHTTPServer(uvicorn.Server):
    """uvicorn without its own signal handlers: ``serve`` owns SIGTERM/SIGINT for both APIs."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class RouterServer:
    """The gRPC and HTTP servers of one router. ``grpc_port`` is the bound port (useful with port 0)."""

    def __init__(self, config: RouterConfig, router: Router | None = None):
        self.config = config
        self.router = router if router is not None else Router(config)
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None  # bound port of the plain /metrics, with metrics_port set
        self._grpc_server: grpc.aio.Server | None = None
        self._probe_server: grpc.aio.Server | None = None  # with probe_port: health alone, plain text
        self._health = health.aio.HealthServicer()
        self._http: _EmbeddedHTTPServer | None = None
        self._http_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._https_reload_task: asyncio.Task | None = None
        self._metrics_http = None

    async def start(self) -> None:
        await self.router.start()
        await self._start_grpc()
        if self.config.http_port:
            await self._start_http()
        if self.config.metrics_port:
            http_server, _ = start_http_server(self.config.metrics_port, self.config.host,
                                               self.router.metrics.registry)
            self._metrics_http, self.metrics_port = http_server, http_server.server_port
        scheme = "HTTPS" if self.config.tls.cert_file else "HTTP"
        log.info("router serving %s: gRPC%s on %s:%d, %s %s; API keys %s", self.router.model_name,
                 " (TLS)" if self.config.tls.enabled else "", self.config.host, self.grpc_port, scheme,
                 f"on {self.config.host}:{self.config.http_port}" if self._http else "off",
                 "required" if self.config.api_keys else "off")

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain both APIs at once for ``grace_s`` (default: ``config.shutdown_grace_s``), then close the pods'
        connections."""
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        for task in (self._health_task, self._https_reload_task):
            if task is not None:
                task.cancel()
        await self._health.enter_graceful_shutdown()
        await asyncio.gather(self._stop_http(grace_s), self._stop_grpc(grace_s))
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        await self.router.stop()

    async def _stop_http(self, grace_s: float) -> None:
        if self._http is not None:
            self._http.config.timeout_graceful_shutdown = grace_s  # then uvicorn cancels what still runs
            self._http.should_exit = True
            await self._http_task

    async def _stop_grpc(self, grace_s: float) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace_s)
        if self._probe_server is not None:
            await self._probe_server.stop(None)

    async def _start_grpc(self) -> None:
        keys = APIKeys(self.config.api_keys)
        server = transport.new_server(self.config.max_request_bytes, [APIKeyInterceptor(keys)] if keys else [])
        add_generation_service(GenerationServicer(self.router), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.grpc_port = transport.bind(server, self.config.host, self.config.grpc_port, self.config.tls)
        for service in ("", GENERATION_SERVICE):  # not serving until a pod is known (the servicer starts SERVING)
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._grpc_server = server
        if self.config.probe_port:
            self._probe_server, _ = await transport.start_probe_server(self._health, self.config.host,
                                                                       self.config.probe_port)
        self._health_task = asyncio.create_task(self._track_health(), name="router-health")

    async def _track_health(self) -> None:
        """SERVING exactly while some decode-capable pod serves (``router.ready()``), so that a load balancer or
        ``splitserve up`` never sends traffic to a router that would answer UNAVAILABLE."""
        serving = None
        while True:
            ready = self.router.ready()
            if ready != serving:
                status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
                for service in ("", GENERATION_SERVICE):  # "": the server as a whole, as load balancers ask
                    await self._health.set(service, status)
                serving = ready
            await asyncio.sleep(HEALTH_REFRESH_S)

    async def _start_http(self) -> None:
        # The HTTP layer (FastAPI) loads only when the HTTP API is on.
        from splitserve.router.openai.app import create_app

        app = create_app(self.router)
        self._http = _EmbeddedHTTPServer(uvicorn.Config(app, host=self.config.host, port=self.config.http_port,
                                                        log_config=None, **_https_settings(self.config)))
        self._http_task = asyncio.create_task(self._http.serve(), name="http-api")
        while not self._http.started:
            if self._http_task.done():  # e.g. the port is taken: uvicorn logged why
                raise RuntimeError(f"the HTTP API could not start on {self.config.host}:{self.config.http_port}")
            await asyncio.sleep(0.05)
        if self._http.config.ssl is not None:
            self._https_reload_task = asyncio.create_task(self._reload_https_certificate(self._http.config.ssl),
                                                          name="https-certificate")

    async def _reload_https_certificate(self, context: ssl.SSLContext) -> None:
        """uvicorn reads the certificate once, but every new connection's handshake uses ``context``: renewed files
        (the gRPC servers' test of them, ``transport.CertificateReloader``) are loaded into it in place, so a
        renewal needs no restart here either. A renewed CA is added to the trusted ones (the old stays trusted
        until the router restarts: an SSLContext cannot forget a CA)."""
        tls = self.config.tls
        renewed = transport.CertificateReloader(tls)
        while True:
            await asyncio.sleep(CERTIFICATE_CHECK_S)
            if renewed() is None:
                continue
            try:
                context.load_cert_chain(tls.cert_file, tls.key_file)
                if tls.ca_file:
                    context.load_verify_locations(tls.ca_file)
            except (OSError, ssl.SSLError) as err:  # a set still being written: its next change is tried again
                log.warning("HTTPS: renewed TLS files cannot be loaded yet, keeping the current ones: %s", err)
                continue
            log.info("HTTPS: loaded the renewed certificate %s", tls.cert_file)


def _https_settings(config: RouterConfig) -> dict:
    """uvicorn's TLS settings from the router's: HTTPS with the router's certificate when TLS is on."""
    tls = config.tls
    if not tls.cert_file:
        return {}
    return {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file, "ssl_ca_certs": tls.ca_file or None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE}


async def serve(config: RouterConfig) -> None:
    """Runs the router until SIGTERM or SIGINT, then stops it gracefully."""
    # The handlers go in before the servers start: a SIGTERM that arrives while they start (the HTTP API may already
    # answer) still stops the router gracefully instead of killing it.
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    server = RouterServer(config)
    await server.start()
    await stop_requested.wait()
    log.info("stopping: draining in-flight requests (up to %.0f s)", config.shutdown_grace_s)
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()
    config = parse_config(RouterConfig, argv, prog="splitserve router")
    pinned = pin_cpu_set(config.cpus)  # before the servers start their threads
    log.info("CPUs %s%s, no torch threads", format_cpu_list(allowed_cpus()), "" if pinned else " (not pinned)")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()

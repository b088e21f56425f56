"""How every splitserve process opens gRPC servers and channels: one set of options, one place, TLS included.

    TLSConfig.of(config)                   the tls_* fields of a service's config (empty cert and CA: plaintext)
    new_server(max_receive_bytes, ...)     grpc.aio server with the message limits and no SO_REUSEPORT
    bind(server, host, port, tls)          the bound port, with TLS when ``tls`` is on (certificates reloaded
                                           when their files change); a RuntimeError naming the address when it
                                           is taken
    start_probe_server(health, host, port) (server, bound port): plain text, only grpc.health.v1 (kubelet's
                                           native gRPC probe speaks no TLS), beside a server on TLS
    open_channel(address, tls)             grpc.aio channel with the same limits, a reconnect backoff capped at
                                           1 s, and TLS (the process's own certificate presented, for mutual TLS;
                                           the peer checked against ``tls.server_name`` when set)

Servers never share a port: grpcio binds with ``SO_REUSEPORT`` unless told otherwise, and then a second pod
started on a taken port starts without complaint while the kernel splits connections between the two.

TLS: one certificate and key per process serve as its server identity and as its client identity on the links it
opens (mutual TLS); ``ca_file`` holds the certificates that peers' certificates must chain to. A process is on TLS
when it has a certificate or a CA file: its servers then speak only TLS (they need the certificate) and its channels
only TLS. With ``require_client_cert`` its servers also refuse a client without a certificate signed by ``ca_file``.

In a cluster, pods reach each other by pod IP (what they advertise), and no certificate can list every pod IP:
``server_name`` is then the name every pod's certificate lists (the chart's headless Service's DNS name), and
channels check the peer against it instead of the address they dial (gRPC's target name override). Without it a
channel's address must be a name or an IP address the peer's certificate lists (subjectAltName).

Certificates are renewed without a restart: a server re-reads its certificate, key and CA files before a new
connection's handshake when any of them changed (grpc's certificate-configuration fetcher; a Kubernetes Secret
volume swaps all three at once), so connections made after a renewal see the new ones and running calls go on.
A half-written set (a key that does not match its certificate) is skipped until it is whole. Channels read the
files when they are made: a channel opened before a renewal keeps presenting the certificate it started with.

``configure_process_tls`` sets the TLS of channels that a library module opens for this process without being
told (the prefill pod's KV channels to decode pods): a pod process sets it once, from its config, at start.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

logger = logging.getLogger(__name__)

# gRPC refuses messages over 4 MiB unless told otherwise. KV chunks (1 MiB by default), a long prompt's token
# ids (about 5 bytes per token) and a top-20 logprobs stream all fit far below this.
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# gRPC backs reconnects off exponentially (1 s, 1.6 s, 2.6 s, ...), so a pod that took a while to load its model,
# or restarted, would stay unreachable for seconds after it serves. Pods are near: try again at least every second.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]
# A peer that stops answering (a frozen process, a dead host, a cut link) fails the calls on its connection within
# about KEEPALIVE_S + KEEPALIVE_TIMEOUT_S. Pings are answered by gRPC's own threads, so a busy process answers them.
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 10, 5
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
                     ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
                     ("grpc.keepalive_permit_without_calls", 1)]
SERVER_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0),
                  # Accept the clients' keepalive pings (gRPC's default tolerates one every 5 minutes).
                  ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
                  ("grpc.keepalive_permit_without_calls", 1)]
CHANNEL_OPTIONS = [*MESSAGE_OPTIONS, *RECONNECT_OPTIONS, *KEEPALIVE_OPTIONS]


@dataclass(frozen=True)
class TLSConfig:
    """Certificates from files (PEM). All empty: plaintext."""

    cert_file: str = ""  # this process's certificate chain: its server identity and its client identity
    key_file: str = ""  # the certificate's private key
    ca_file: str = ""  # peers' certificates must chain to these (empty: the system's roots, for channels only)
    require_client_cert: bool = False  # servers refuse clients without a certificate signed by ca_file
    server_name: str = ""  # the name peers' certificates must list (empty: the host of the address dialled)

    @classmethod
    def of(cls, config: Any) -> "TLSConfig":
        """The ``tls_cert_file``, ``tls_key_file``, ``tls_ca_file``, ``tls_require_client_cert`` and (where the
        config has it: the services, not the command-line tools) ``tls_server_name`` fields of a config."""
        return cls(config.tls_cert_file, config.tls_key_file, config.tls_ca_file, config.tls_require_client_cert,
                   getattr(config, "tls_server_name", ""))

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.ca_file)

    def check(self, serves: bool = True) -> None:
        """Raises ValueError naming the config field at fault; ``serves``: the process runs servers (which need
        their own certificate), not only channels. The files are read (and a missing one reported) when a
        server or channel is made, at start: a config may name files mounted only where it runs."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls_cert_file and tls_key_file: set both or neither")
        if serves and self.ca_file and not self.cert_file:
            raise ValueError("tls_cert_file: a server on TLS needs its certificate (tls_ca_file is set)")
        if self.require_client_cert and not (self.ca_file and self.cert_file):
            raise ValueError("tls_require_client_cert: needs tls_ca_file (to verify clients) and tls_cert_file")
        if self.server_name and not self.enabled:
            raise ValueError("tls_server_name: names the peers' certificates, so it needs TLS (tls_cert_file)")

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server TLS whose certificate, key and CA are re-read when their files change (``CertificateReloader``)."""
        reloader = CertificateReloader(self)
        return grpc.dynamic_ssl_server_credentials(reloader.current, reloader,
                                                   require_client_authentication=self.require_client_cert)

    def server_certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        """The files as they are now; RuntimeError when one is unreadable or the key is not the certificate's."""
        key, chain = _read(self.key_file), _read(self.cert_file)
        try:  # the ssl module checks that the key belongs to the certificate (grpc would fail each handshake)
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, ValueError) as err:
            raise RuntimeError(f"TLS: {self.key_file} is not the key of {self.cert_file} ({err})") from None
        root = _read(self.ca_file) if self.ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=root)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if self.cert_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None)


class CertificateReloader:
    """grpc's certificate-configuration fetcher: called before every new connection's handshake, it returns the
    files' new configuration when their identity (inode, size, modification time, through symlinks) changed, and
    None (keep the current one) otherwise or while the new set is incomplete."""

    def __init__(self, tls: TLSConfig):
        self._paths = [path for path in (tls.cert_file, tls.key_file, tls.ca_file) if path]
        self._tls = tls
        self._lock = threading.Lock()  # handshakes of several connections may ask at once
        self._stamp = self._stamps()
        self.current = tls.server_certificate_configuration()

    def _stamps(self) -> tuple:
        stamps = []
        for path in self._paths:
            try:
                info = os.stat(path)
            except OSError:
                stamps.append(None)  # being replaced: compare again at the next connection
                continue
            stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
        return tuple(stamps)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            stamp = self._stamps()
            if stamp == self._stamp or None in stamp:
                return None
            try:
                self.current = self._tls.server_certificate_configuration()
            except RuntimeError as err:
                logger.warning("TLS files changed but cannot be loaded yet, keeping the current ones: %s", err)
                return None
            self._stamp = stamp
            logger.info("TLS: loaded the renewed certificate %s", self._tls.cert_file)
            return self.current


PLAINTEXT = TLSConfig()
_process_tls = PLAINTEXT


def configure_process_tls(tls: TLSConfig) -> None:
    """The TLS of channels opened without an explicit ``tls`` (see the module docstring)."""
    global _process_tls
    _process_tls = tls


def new_server(max_receive_bytes: int = MAX_MESSAGE_BYTES,
               interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A server; ``max_receive_bytes`` caps a request message (a larger one is refused with RESOURCE_EXHAUSTED
    before any handler runs)."""
    options = dict(SERVER_OPTIONS, **{"grpc.max_receive_message_length": max_receive_bytes})
    return grpc.aio.server(options=list(options.items()), interceptors=list(interceptors))


def bind(server: grpc.aio.Server, host: str, port: int, tls: TLSConfig = PLAINTEXT) -> int:
    """Listen on ``host:port`` (0: any free port) and return the port; raises if another process holds it."""
    credentials = tls.server_credentials() if tls.enabled else None  # a missing file: its own error
    try:
        if credentials is not None:
            return server.add_secure_port(f"{host}:{port}", credentials)
        return server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as err:
        raise RuntimeError(f"cannot listen on {host}:{port}: the port is taken or the address is not local "
                           f"({err})") from None


async def start_probe_server(health: health_pb2_grpc.HealthServicer, host: str,
                             port: int) -> tuple[grpc.aio.Server, int]:
    """Serve ``health`` (the same servicer as the main server's, so the same statuses) and nothing else, in plain
    text, on ``host:port``: kubelet's native gRPC probe cannot speak TLS, and an exec probe needs a client binary in
    the image for each architecture. It answers only whether the process serves, never a request."""
    server = new_server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = bind(server, host, port)
    await server.start()
    return server, bound


def open_channel(address: str, tls: TLSConfig | None = None) -> grpc.aio.Channel:
    """A channel to ``address``; ``tls`` None: the process's TLS (``configure_process_tls``)."""
    tls = _process_tls if tls is None else tls
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=_tls_channel_options(tls))
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def open_blocking_channel(address: str, tls: TLSConfig = PLAINTEXT) -> grpc.Channel:
    """A synchronous channel (command-line tools and health checks), with the same TLS rules."""
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=_tls_channel_options(tls))
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def _tls_channel_options(tls: TLSConfig) -> list[tuple[str, Any]]:
    """Dialled by IP, checked by name: the peer's certificate must list ``server_name``."""
    if not tls.server_name:
        return CHANNEL_OPTIONS
    return [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", tls.server_name)]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise RuntimeError(f"TLS: cannot read {path}: {err.strerror}") from None

"""How every splitserve process opens gRPC servers and channels: one set of options, one place.

    new_server()                       grpc.aio server with the message limits and no SO_REUSEPORT
    bind(server, host, port)           the bound port; a RuntimeError naming the address when it is taken
    open_channel(address)              grpc.aio channel with the same limits and a reconnect backoff capped at 1 s

Servers never share a port: grpcio binds with ``SO_REUSEPORT`` unless told otherwise, and then a second pod
started on a taken port starts without complaint while the kernel splits connections between the two.
"""

from __future__ import annotations

import grpc

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


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Listen on ``host:port`` (0: any free port) and return the port; raises if another process holds it."""
    try:
        return server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as err:
        raise RuntimeError(f"cannot listen on {host}:{port}: the port is taken or the address is not local "
                           f"({err})") from None


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)

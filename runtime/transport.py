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
SERVER_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0)]
CHANNEL_OPTIONS = [*MESSAGE_OPTIONS, *RECONNECT_OPTIONS]


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

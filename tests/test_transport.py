"""Every gRPC server and channel of splitserve comes from ``splitserve.runtime.transport``: ports are never shared, and
the message limits sit far above a KV chunk."""

import asyncio

import grpc
import pytest

from splitserve.kvtransfer.wire import MAX_CHUNK_BYTES
from splitserve.runtime import transport


def test_a_second_server_cannot_take_a_port_that_is_in_use():
    async def scenario():
        first = transport.new_server()
        port = transport.bind(first, "127.0.0.1", 0)
        await first.start()
        try:
            # grpcio's default (SO_REUSEPORT) would let this bind, and the kernel would split connections.
            with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
                transport.bind(transport.new_server(), "127.0.0.1", port)
        finally:
            await first.stop(None)
    asyncio.run(scenario())


def test_a_port_held_by_another_process_without_reuseport_is_refused_too():
    async def scenario():
        holder = grpc.aio.server()  # a foreign gRPC server, with grpcio's defaults
        port = holder.add_insecure_port("127.0.0.1:0")
        await holder.start()
        try:
            with pytest.raises(RuntimeError, match="cannot listen"):
                transport.bind(transport.new_server(), "127.0.0.1", port)
        finally:
            await holder.stop(None)
    asyncio.run(scenario())


def test_message_limits_sit_far_above_a_kv_chunk():
    for options in (transport.SERVER_OPTIONS, transport.CHANNEL_OPTIONS):
        limits = dict(options)
        assert limits["grpc.max_send_message_length"] == limits["grpc.max_receive_message_length"] == 64 << 20
        assert limits["grpc.max_receive_message_length"] >= 32 * MAX_CHUNK_BYTES

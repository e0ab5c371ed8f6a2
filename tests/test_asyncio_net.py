"""The I/O loop's sockets: httpcore's async network backend on plain asyncio streams (Python 3.11+)."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator

import httpcore
import pytest

from membase_strands._asyncio_net import AsyncioBackend, asyncio_backend
from tests.support.store_helpers import until

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the asyncio backend needs Python 3.11+")


class RawServer:
    """One TCP listener on 127.0.0.1 whose accepted connections the test drives by hand."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.ready = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        connection, _ = self.listener.accept()
        self.accepted.append(connection)
        self.ready.set()

    def close(self) -> None:
        for connection in self.accepted:
            connection.close()
        self.listener.close()


@pytest.fixture
def server() -> Iterator[RawServer]:
    made = RawServer()
    yield made
    made.close()


def test_it_is_the_backend_from_python_3_11() -> None:
    assert isinstance(asyncio_backend(), AsyncioBackend)


async def test_an_idle_connection_is_readable_once_the_server_sends_something_or_closes(server) -> None:
    stream = await AsyncioBackend().connect_tcp("127.0.0.1", server.port, timeout=5.0)
    assert server.ready.wait(5)
    try:
        assert stream.get_extra_info("is_readable") is False

        server.accepted[0].sendall(b"HTTP/1.1 408 Request Timeout\r\n\r\n")  # unasked: the connection is spoilt
        assert await until(lambda: stream.get_extra_info("is_readable"))
    finally:
        await stream.aclose()


async def test_a_connection_the_server_closed_is_readable(server) -> None:
    stream = await AsyncioBackend().connect_tcp("127.0.0.1", server.port, timeout=5.0)
    assert server.ready.wait(5)
    try:
        server.accepted[0].close()
        assert await until(lambda: stream.get_extra_info("is_readable"))
        assert await stream.read(100, timeout=5.0) == b""
    finally:
        await stream.aclose()


async def test_reads_and_writes_go_through_and_a_silent_server_is_a_read_timeout(server) -> None:
    stream = await AsyncioBackend().connect_tcp("127.0.0.1", server.port, timeout=5.0)
    assert server.ready.wait(5)
    try:
        await stream.write(b"ping", timeout=5.0)
        assert server.accepted[0].recv(4) == b"ping"
        server.accepted[0].sendall(b"pong")
        assert await stream.read(4, timeout=5.0) == b"pong"

        with pytest.raises(httpcore.ReadTimeout):
            await stream.read(4, timeout=0.05)
    finally:
        await stream.aclose()


async def test_a_port_nobody_listens_on_is_a_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connecting is refused

        with pytest.raises(httpcore.ConnectError):
            await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5.0)

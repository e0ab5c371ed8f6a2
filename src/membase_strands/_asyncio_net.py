"""The I/O loop's sockets: an httpcore network backend on plain ``asyncio`` streams.

httpcore opens its async connections through anyio by default, whose per-call bookkeeping (cancel
scopes, attribute lookups) costs about a fifth of an awaited request's CPU time, measured in
``benchmarks/`` (section 4: turns per second in the server pattern). The I/O loop is always an
``asyncio`` loop, so its connections are ``asyncio`` streams: the same reads and writes, each bounded
by httpcore's per-phase timeout, with errors mapped to httpcore's own as its anyio backend maps them.

TLS needs ``StreamWriter.start_tls`` (Python 3.11+); on 3.10 :func:`asyncio_backend` gives ``None``
and httpcore keeps its default backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore


def asyncio_backend() -> httpcore.AsyncNetworkBackend | None:
    """The backend for the I/O loop's clients, or ``None`` where it cannot do TLS (Python 3.10)."""
    return AsyncioBackend() if sys.version_info >= (3, 11) else None


@contextlib.contextmanager
def _mapped(timeout: type[Exception], failure: type[Exception]) -> Iterator[None]:
    """Raise httpcore's ``timeout`` or ``failure`` for what asyncio raises, as httpcore's own backends do."""
    try:
        yield
    except (asyncio.TimeoutError, TimeoutError) as error:
        raise timeout(str(error) or "timed out") from error
    except (OSError, EOFError, ssl.SSLError) as error:
        raise failure(str(error) or type(error).__name__) from error


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One connection: an ``asyncio`` reader and writer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        with _mapped(httpcore.ReadTimeout, httpcore.ReadError):
            return await asyncio.wait_for(self._reader.read(max_bytes), timeout)  # b"" once the server closed

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        with _mapped(httpcore.WriteTimeout, httpcore.WriteError):
            self._writer.write(buffer)
            await asyncio.wait_for(self._writer.drain(), timeout)

    async def aclose(self) -> None:
        # At once, as httpcore's other backends close a socket: a TLS close would wait (up to 30 s) for the
        # server's close_notify, and a server that never sends one would hold every request that closes an
        # expired connection first.
        self._writer.transport.abort()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
                start_tls = self._writer.start_tls  # type: ignore[attr-defined] # Python 3.11+, see asyncio_backend()
                # Bounded here, not by asyncio's handshake timeout, which ends in a connection error, not a timeout.
                await asyncio.wait_for(start_tls(ssl_context, server_hostname=server_hostname), timeout)
        except Exception:
            await self.aclose()
            raise
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._writer.get_extra_info("sockname")
        if info == "server_addr":
            return self._writer.get_extra_info("peername")
        if info == "socket":
            return self._writer.get_extra_info("socket")
        if info == "is_readable":
            # httpcore asks this of an idle connection: readable means the server closed it (or it failed), so
            # it must not be reused. The loop reads what arrives into the reader, so the reader knows.
            reader = self._reader
            unread = getattr(reader, "_buffer", b"")  # asyncio keeps what arrived there (private, hence getattr)
            return (
                self._writer.transport.is_closing() or reader.at_eof() or bool(unread) or reader.exception() is not None
            )
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """Opens httpcore's async connections as ``asyncio`` streams (TCP_NODELAY is asyncio's default)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        local = None if local_address is None else (local_address, 0)
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=local), timeout)
            _apply(writer, socket_options)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
    ) -> httpcore.AsyncNetworkStream:
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
            _apply(writer, socket_options)
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _apply(writer: asyncio.StreamWriter, options: Iterable[httpcore.SOCKET_OPTION] | None) -> None:
    sock: socket.socket | None = writer.get_extra_info("socket")
    for option in options or ():
        if sock is not None:
            sock.setsockopt(*option)

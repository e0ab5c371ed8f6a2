"""How stores built from a key reach Membase: shared ``httpx.Client``s over :class:`MembaseTransport`.

- A store reads the environment once, when it is built (proxies, certificates: its :class:`Route`); stores with the
  same route share one client, which keeps no cookies (a cookie one user's answer sets must never ride on another's).
- Every attempt runs on a library thread, over connections that thread alone uses: no thread can close a pooled
  socket another has just taken, and one user's hung call holds one thread's connection, never another user's.
- One attempt is bounded as a whole, headers and body (``request_timeout``), and an answer is read up to
  ``max_response_bytes``, not past it. Compressed answers are not asked for, so that bound is the bound in memory.
- A request that cannot have reached Membase is sent once more, on a fresh connection: the connection could not be
  made, or the request met a kept-alive connection the server had closed, before one byte of answer. A server closes
  a kept-alive connection only between requests, so a request that meets that close was never read: sending it again
  saves no note twice. A request that went out on a fresh connection and got no answer is not sent again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.cookiejar
import os
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
import weakref
from dataclasses import dataclass
from typing import Any

import httpx

from . import _background
from ._failures import BadResponseError

# One connection per thread and host, kept alive less long than common servers keep theirs (uvicorn and Node 5 s).
_LIMITS = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=4.0)
_SENT_AGAIN_ON = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)  # a kept-alive connection, closed
_CONNECTED = "connection.connect_tcp.started"  # httpcore's trace of a connection made for the request

_clients: weakref.WeakValueDictionary[tuple[int, Route], httpx.Client] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class Route:
    """How one store reaches Membase, read from the environment once, when the store is built."""

    base_url: str
    transport: httpx.BaseTransport | None  # the caller's, instead of httpx's own (then no proxy from the environment)
    proxy: str | None
    verify: ssl.SSLContext | None  # httpx's TLS settings under SSL_CERT_FILE / SSL_CERT_DIR as they were
    seconds: float  # one attempt, headers and body
    max_bytes: int


def route(base_url: str, transport: httpx.BaseTransport | None, seconds: float, max_bytes: int) -> Route:
    """The route to ``base_url`` under the environment as it is now (its proxy variables as the stdlib reads them)."""
    proxy, verify = None, None
    if transport is None:
        verify = _ssl_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        proxies, url = urllib.request.getproxies_environment(), urllib.parse.urlsplit(base_url)
        if not _bypassed(url.hostname or "", proxies.get("no", "")):
            proxy = proxies.get(url.scheme) or proxies.get("all")
    return Route(base_url, transport, proxy, verify, seconds, max_bytes)


def _bypassed(host: str, no_proxy: str) -> bool:
    """Whether ``NO_PROXY`` names ``host``: ``*``, the host itself, or a domain it is in."""
    for entry in no_proxy.lower().split(","):
        domain = entry.strip().lstrip("*.")
        if entry.strip() == "*" or (domain and (host == domain or host.endswith(f".{domain}"))):
            return True
    return False


def client_for(route: Route) -> httpx.Client:
    """This process's shared client for ``route`` (a forked child builds its own)."""
    key = (os.getpid(), route)
    with _background.LOCK:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = httpx.Client(
                base_url=route.base_url,
                transport=MembaseTransport(route),
                timeout=route.seconds,  # each read; the transport bounds the whole attempt
                headers={"Accept-Encoding": "identity"},
                cookies=http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[])),
            )
    return client


class MembaseTransport(httpx.BaseTransport):
    """Sends each attempt on a library thread within its bounds, once more if it cannot have reached Membase."""

    def __init__(self, route: Route) -> None:
        self._route = route

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        seconds, attempt = self._route.seconds, _Attempt()
        deadline = time.monotonic() + seconds
        send = functools.partial(self._attempt, request, deadline, attempt)
        if _background.worker_resources() is not None:  # recall and writes: already on a library thread
            _watchdog.watch(attempt, deadline)
            try:
                return send()
            except httpx.TransportError:
                if attempt.hung_up:
                    raise httpx.ReadTimeout(f"Membase did not answer within {seconds:g} s", request=request) from None
                raise
        lane = hash(request.headers.get("authorization"))  # one user's hung calls take turns with each other
        future = _background.submit(send, name="membase-request", lane=lane)
        try:
            return future.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            if not future.cancel():  # one still in line is never sent; one sent is hung up on, freeing its thread
                attempt.hang_up()
            raise httpx.ReadTimeout(f"Membase did not answer within {seconds:g} s", request=request) from None

    def _attempt(self, request: httpx.Request, deadline: float, attempt: _Attempt) -> httpx.Response:
        attempt.connection = connection = self._connection()
        try:
            for last in (False, True):
                steps: list[str] = []
                request.extensions["trace"] = functools.partial(_trace, steps, connection)  # httpx's public API
                try:
                    response = connection.transport.handle_request(request)
                    break
                except (httpx.ConnectError, httpx.ConnectTimeout):
                    if last:
                        raise
                except _SENT_AGAIN_ON:
                    reused = "http11.send_request_headers.started" in steps and _CONNECTED not in steps
                    if last or attempt.over or not reused or "http11.receive_response_headers.complete" in steps:
                        raise
            try:
                content = self._read(request, response, deadline)
            finally:
                response.close()
            return httpx.Response(response.status_code, headers=response.headers, content=content)
        finally:
            with _background.LOCK:
                attempt.over = True
                _watchdog.forget(attempt)

    def _read(self, request: httpx.Request, response: httpx.Response, deadline: float) -> bytes:
        """The body, whole, within the deadline and the size bound; a body whole by its length is kept however late."""
        limit, encoding = self._route.max_bytes, response.headers.get("content-encoding", "identity")
        if encoding.lower() != "identity":
            raise BadResponseError(
                f"Membase answered with a body compressed as {encoding!r}, which was not asked for",
                status=response.status_code,
            )
        stated = response.headers.get("content-length", "")
        length = int(stated) if stated.isdigit() else None
        body, overdue = bytearray(), False
        for chunk in response.iter_bytes():  # identity-encoded: the raw body, or a mock's, already read
            if overdue:
                raise httpx.ReadTimeout(
                    f"Membase did not finish answering within {self._route.seconds:g} s", request=request
                )
            body += chunk
            if len(body) > limit or (length or 0) > limit:
                raise BadResponseError(
                    f"Membase's answer is larger than max_response_bytes ({limit:,} bytes)", status=response.status_code
                )
            overdue = time.monotonic() > deadline and (length is None or len(body) < length)
        return bytes(body)

    def _connection(self) -> _Connection:
        """The caller's transport, or this thread's own connection to the host (kept until the thread retires)."""
        if self._route.transport is not None:
            return _Connection(self._route.transport)
        resources = _background.worker_resources()
        assert resources is not None  # every attempt runs on a library thread
        if self not in resources:
            proxy = httpx.Proxy(self._route.proxy) if self._route.proxy else None
            verify = self._route.verify or True
            resources[self] = _Connection(httpx.HTTPTransport(verify=verify, proxy=proxy, limits=_LIMITS))
        connection: _Connection = resources[self]
        return connection


@dataclass
class _Connection:
    """A transport, and the network stream it opened last: the one a request on it is using."""

    transport: httpx.BaseTransport
    stream: Any = None

    def close(self) -> None:
        self.transport.close()


@dataclass(eq=False)
class _Attempt:
    """One attempt: whether it is over (or hung up on), and the connection it is on, for whoever hangs up."""

    connection: _Connection | None = None
    over: bool = False
    hung_up: bool = False

    def hang_up(self) -> None:
        """Shut the attempt's connection down, so a server that keeps it going holds no thread (once, if running)."""
        with _background.LOCK:  # the thread cannot end the attempt and take another meanwhile
            if not self.over and self.connection is not None and self.connection.stream is not None:
                self.over = self.hung_up = True
                with contextlib.suppress(Exception):
                    self.connection.stream.get_extra_info("socket").shutdown(socket.SHUT_RDWR)


class _Watchdog:
    """Hangs up the attempts on library threads (recall, writes) still running at their deadline: no caller waits on
    them to, and httpx's read timeout never ends a server that drips its headers a line at a time. Its thread, a
    library thread of its own kind, watches until no attempt has started for ``IDLE_SECONDS``."""

    def __init__(self) -> None:
        self._deadlines: dict[_Attempt, float] = {}
        self._changed = threading.Condition(_background.LOCK)
        self._watching, self._pid = False, os.getpid()

    def watch(self, attempt: _Attempt, deadline: float) -> None:
        with self._changed:
            if self._pid != os.getpid():  # a forked child: the parent's attempts and watchdog are not here
                self._deadlines, self._watching, self._pid = {}, False, os.getpid()
            self._deadlines[attempt] = deadline
            if deadline <= min(self._deadlines.values()):  # due first (or alone): the watchdog's wait is too long
                self._changed.notify()
            start, self._watching = not self._watching, True
        if start:  # outside LOCK (see _background.submit)
            _background.submit(self._run, name="membase-watchdog", kind="watch")

    def forget(self, attempt: _Attempt) -> None:
        with self._changed:
            if self._deadlines.pop(attempt, None) is not None and not self._deadlines:
                self._changed.notify()  # none left: the watchdog waits for a new one, or goes

    def _run(self) -> None:
        thread = threading.current_thread()
        with self._changed:
            while True:
                now = time.monotonic()
                for attempt in [attempt for attempt, deadline in self._deadlines.items() if deadline <= now]:
                    del self._deadlines[attempt]
                    attempt.hang_up()
                if self._deadlines:
                    thread.name = "membase-watchdog"
                    self._changed.wait(min(self._deadlines.values()) - now)
                    continue
                # Idle, and named so, until an attempt starts: going at once, its thread would be the next call's,
                # not the thread of the last attempt, which holds a kept-alive connection.
                thread.name = _background.IDLE_NAME
                if not self._changed.wait(_background.IDLE_SECONDS):
                    self._watching = False
                    return


_watchdog = _Watchdog()


def _trace(steps: list[str], connection: _Connection, step: str, info: dict[str, Any]) -> None:
    """Note what httpcore did for a request, and the network stream of each connection it made (its ``socket``)."""
    steps.append(step)
    if step in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
        connection.stream = info.get("return_value")


@functools.lru_cache(maxsize=8)
def _ssl_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    """httpx's default TLS settings, which it reads from these two variables (as set now), built once (about 1 MiB)."""
    return httpx.create_ssl_context()

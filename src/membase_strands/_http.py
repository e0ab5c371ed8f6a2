"""The process's connection pools: a few shared ``httpx.Client`` per base URL and proxy/TLS environment.

Every store built from a key sends through :func:`shared_client` (the SDK sends the key with each request, so
stores share sockets, never credentials); the limits bound the idle sockets however many stores there are.
httpx's timeouts count per read, so a server that drips a byte at a time could hold a call as long as it drips:
:class:`DeadlineClient` ends an attempt whose body still arrives past its timeout (the SDK's 90 s). A forked
child starts with no pools: the parent's are dropped, not closed (a parent thread may have held their locks).
"""

from __future__ import annotations

import functools
import os
import ssl
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
from membase.client import DEFAULT_TIMEOUT

from . import _background

ATTEMPT_SECONDS = DEFAULT_TIMEOUT  # the whole-call deadline of one attempt: the SDK's own timeout
# A few pools per host, each store's by its key (32 busy threads queued on one pool's lock), of 6 connections each, all
# kept alive: past its keep-alive limit httpcore closes idle ones, even one just handed to a request (EBADF in a burst).
POOLS_PER_HOST = 8
LIMITS = httpx.Limits(max_connections=6, max_keepalive_connections=6, keepalive_expiry=5.0)
# httpx reads these when it builds a client: stores share a pool only when built under the same values.
_HTTP_ENVIRONMENT = tuple(
    name
    for base in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR")
    for name in (base, base.lower())
)


_lock = threading.Lock()
_clients: dict[tuple[str | int | None, ...], httpx.Client] = {}
_routes: weakref.WeakValueDictionary[str, httpx.Client] = weakref.WeakValueDictionary()


def shared_client(base_url: str, key: str) -> httpx.Client:
    """The shared client for ``base_url`` (one of its few, by ``key``) under the current environment."""
    routed = _routes.get(base_url)
    if routed is not None:
        return routed
    environment = tuple(os.environ.get(name) for name in _HTTP_ENVIRONMENT)
    pool = (base_url, hash(key) % POOLS_PER_HOST, *environment)
    with _lock:
        client = _clients.get(pool)
        if client is None:
            certificates = environment[-4:]  # SSL_CERT_FILE and SSL_CERT_DIR, in both cases
            client = DeadlineClient(
                base_url=base_url, timeout=ATTEMPT_SECONDS, limits=LIMITS, verify=_ssl_context(*certificates)
            )
            _clients[pool] = client
    return client


def route(base_url: str, transport: httpx.BaseTransport) -> httpx.Client:
    """Send through ``transport`` what stores built for ``base_url`` send, while the returned client lives: the
    testing kit's way to keep a store built from a key on the production path down to the transport."""
    client = DeadlineClient(base_url=base_url, transport=transport, timeout=ATTEMPT_SECONDS)
    _routes[base_url] = client
    return client


def _after_fork_in_child() -> None:
    global _lock, _clients
    _lock = threading.Lock()
    _clients = {}


@functools.lru_cache(maxsize=8)
def _ssl_context(*certificate_environment: str | None) -> ssl.SSLContext:
    """httpx's default TLS settings (certifi, or SSL_CERT_FILE/SSL_CERT_DIR), built once per setting (about 1 MiB)."""
    return httpx.create_ssl_context()


class DeadlineClient(httpx.Client):
    """An ``httpx.Client`` that ends an answer whose body still arrives past its timeout (its longest phase)."""

    def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        auth: Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        phases = (self.timeout.connect, self.timeout.read, self.timeout.write, self.timeout.pool)
        seconds = max((phase for phase in phases if phase is not None), default=DEFAULT_TIMEOUT)
        deadline = time.monotonic() + seconds
        response = super().send(request, stream=True, auth=auth, follow_redirects=follow_redirects)
        if stream:
            return response
        try:
            response.stream = _DeadlineBody(response, deadline, seconds)
            response.read()
        except BaseException:
            response.close()
            raise
        return response


class _DeadlineBody(httpx.SyncByteStream):
    """A response body that ends with a read timeout when more of it arrives after the deadline has passed."""

    def __init__(self, response: httpx.Response, deadline: float, seconds: float) -> None:
        self._stream: Iterable[bytes] = response.stream  # type: ignore[assignment]  # a sync client's body
        self._request = response.request
        self._deadline = deadline
        self._seconds = seconds
        length = response.headers.get("content-length", "")
        self._length = int(length) if length.isdigit() else None

    def __iter__(self) -> Iterator[bytes]:
        received, overdue = 0, False
        for chunk in self._stream:
            if overdue:  # more came after the deadline passed with the body not whole
                message = f"Membase did not finish answering within the whole-call deadline of {self._seconds:g} s"
                raise httpx.ReadTimeout(message, request=self._request)
            received += len(chunk)
            yield chunk
            # Whole by its length, or as no more coming shows, a body is kept however late it came.
            overdue = time.monotonic() > self._deadline and (self._length is None or received < self._length)

    def close(self) -> None:
        if isinstance(self._stream, httpx.SyncByteStream):
            self._stream.close()


_background.reset_after_fork(sys.modules[__name__])

"""How stores built from a key reach Membase: one shared ``httpx.Client`` per route, each attempt bounded in its socket.

- A route is read from the environment once, when a store is built: the proxy as httpx chooses it (``HTTP_PROXY``,
  ``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``) and the TLS settings (``SSL_CERT_FILE``, ``SSL_CERT_DIR``). Stores with
  the same route share one client, which keeps no cookies (a cookie one user's answer sets must never ride on
  another's) and follows no redirect.
- One attempt lasts at most ``request_timeout``, headers and body. Below httpcore's connections (its public network
  backend interface) every connect, read and write waits at most the time left to its attempt, so a stalled connect
  or a server that drips its answer a byte at a time ends at the deadline, on the caller's own thread. The answer is
  read up to ``max_response_bytes``; compressed answers are not asked for, so that is the bound in memory.
- The resend rule, the only place the library sends a request again on its own (once, on a new connection, within the
  same deadline): a request whose connection could not be made never reached Membase; a read (which changes nothing)
  may also go again when a kept-alive connection turns out closed before any answer. A write never goes out on a
  kept-alive connection (each has one of its own), and once it may have been read it is never sent again:
  :func:`may_have_arrived` tells its callers that its fate is unknown.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import http.cookiejar
import ipaddress
import os
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx
import membase

from ._failures import BadResponseError

_KEEP_ALIVE = 4.0  # seconds an idle connection is kept: less than common servers keep theirs (uvicorn, Node: 5 s)
_KEPT = 32  # idle connections kept for reads, at most
_WRITE_CHUNK = 64 * 1024  # a body is written in pieces, each within the time left


@dataclass
class _Attempt:
    """One send of a request: its deadline; whether a new connection was made (or tried) for it, rather than a
    kept-alive one taken; whether its answer began."""

    deadline: float
    connected: bool = False
    answered: bool = False


_attempt: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar("membase_attempt", default=None)


@dataclass(frozen=True)
class Route:
    """How one store reaches Membase, read from the environment once, when the store is built."""

    base_url: str
    transport: httpx.BaseTransport | None  # the caller's, instead of the network (then no proxy either)
    proxy: str | None = field(repr=False)  # it may hold a password
    verify: ssl.SSLContext | None  # httpx's TLS settings under SSL_CERT_FILE / SSL_CERT_DIR as they were
    seconds: float  # one attempt, headers and body
    max_bytes: int


def route(base_url: str, transport: httpx.BaseTransport | None, seconds: float, max_bytes: int) -> Route:
    """The route to ``base_url`` under the environment as it is now."""
    if transport is not None:
        return Route(base_url, transport, None, None, seconds, max_bytes)
    verify = _ssl_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    proxy = environment_proxy(httpx.URL(base_url))
    if proxy is not None and (scheme := httpx.URL(proxy).scheme) not in ("http", "https", "socks5", "socks5h"):
        raise ValueError(  # not httpx's own error, which quotes the URL, password and all
            f"the proxy the environment names for {base_url} (HTTP_PROXY, HTTPS_PROXY or ALL_PROXY) has the "
            f"scheme {scheme!r}; httpx takes http, https, socks5 or socks5h"
        )
    return Route(base_url, None, proxy, verify, seconds, max_bytes)


def environment_proxy(url: httpx.URL) -> str | None:
    """The proxy httpx would send a request to ``url`` through, from the environment (its rules, read as it reads
    them): ``NO_PROXY`` names hosts (``.example.com``, ``example.com``, ``localhost``), IP addresses (a CIDR is its
    first address) or ``*``; a proxy given without a scheme is ``http://``."""
    found = urllib.request.getproxies()
    rules: dict[str, str | None] = {}
    for scheme in ("http", "https", "all"):
        if found.get(scheme):
            rules[f"{scheme}://"] = found[scheme] if "://" in found[scheme] else f"http://{found[scheme]}"
    for host in (host.strip() for host in found.get("no", "").split(",")):
        if host == "*":
            return None
        if "://" in host:
            rules[host] = None
        elif host:
            rules[f"all://{_bypass_host(host)}"] = None
    matching = [(_priority(pattern), proxy) for pattern, proxy in rules.items() if _matches(pattern, url)]
    return min(matching, key=lambda match: match[0])[1] if matching else None


def _bypass_host(host: str) -> str:
    for kind, form in ((ipaddress.IPv4Address, "{}"), (ipaddress.IPv6Address, "[{}]")):
        with contextlib.suppress(ValueError):
            kind(host.split("/")[0])
            return form.format(host)
    return host if host.lower() == "localhost" else f"*{host}"


def _matches(pattern: str, url: httpx.URL) -> bool:
    rule = httpx.URL(pattern)
    if rule.scheme != "all" and rule.scheme != url.scheme:
        return False
    if rule.port is not None and rule.port != url.port:
        return False
    host = rule.host
    if host.startswith("*."):
        return url.host.endswith(host[1:]) and len(url.host) > len(host) - 1
    if host.startswith("*"):
        return url.host == host[1:] or url.host.endswith(f".{host[1:]}")
    return host in ("", url.host)


def _priority(pattern: str) -> tuple[int, int, int]:
    rule = httpx.URL(pattern)  # a port first, then the longer host, then the longer scheme
    return (rule.port is None, -len(rule.host), -len("" if rule.scheme == "all" else rule.scheme))


_clients: dict[Route, httpx.Client] = {}
_clients_lock = threading.Lock()


def client_for(route: Route) -> httpx.Client:
    """This process's shared client for ``route``; for a caller's transport, a client of its own (the transport is the
    caller's to keep alive, not this process's)."""
    with _clients_lock:
        client = _clients.get(route)
    if client is None:
        client = httpx.Client(
            base_url=route.base_url,
            transport=MembaseTransport(route),
            timeout=route.seconds,  # each connect, read and write; the network backend bounds the attempt
            headers={"Accept-Encoding": "identity"},
            cookies=http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[])),
        )
        if route.transport is None:
            with _clients_lock:
                client = _clients.setdefault(route, client)
    return client


def _forget_clients() -> None:
    _clients.clear()  # a forked child builds its own: the parent's pools hold the parent's sockets


os.register_at_fork(after_in_child=_forget_clients)


def clients(route: Route) -> tuple[httpx.Client, httpx.Client]:
    """Stand-in until the transport's rewrite lands: a store's own clients."""
    made = []
    for _ in range(2):
        made.append(
            httpx.Client(
                base_url=route.base_url,
                transport=MembaseTransport(route),
                timeout=route.seconds,
                headers={"Accept-Encoding": "identity"},
                cookies=http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[])),
            )
        )
    return made[0], made[1]


def may_have_arrived(error: BaseException) -> bool:
    """Whether the request that failed with ``error`` (or an error chained to it) may have been read by Membase:
    ``False`` when its connection could not be made, or Membase answered; ``True`` when it broke off after it was
    sent, or a gateway in front of Membase answered that Membase did not answer it in time (502, 504)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, membase.APIStatusError):
            return seen.status in (502, 504)
        if isinstance(seen, (httpx.ConnectError, httpx.ConnectTimeout)):
            return False
        if isinstance(seen, httpx.TransportError):
            return True
        seen = seen.__cause__
    return isinstance(error, membase.APIConnectionError)


class MembaseTransport(httpx.BaseTransport):
    """Sends an attempt within its deadline and its size bound, once more if the resend rule allows. Reads reuse
    kept-alive connections, the last freed first (a read never waits for one: it makes a new one)."""

    def __init__(self, route: Route) -> None:
        self._route = route
        self._idle: list[httpcore.HTTPConnection] = []
        self._idle_lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + self._route.seconds
        for last in (False, True):
            attempt = _Attempt(deadline)
            token = _attempt.set(attempt)
            try:
                status, headers, content = self._exchange(request, attempt, fresh=last)
                return httpx.Response(status, headers=headers, content=content, request=request)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if last or time.monotonic() >= deadline:
                    raise
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                if last or not _is_read(request) or attempt.connected or attempt.answered:
                    raise
            finally:
                _attempt.reset(token)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _exchange(self, request: httpx.Request, attempt: _Attempt, *, fresh: bool) -> tuple[int, httpx.Headers, bytes]:
        """One send of ``request`` and its answer, read whole within the bounds: a read goes on a kept-alive
        connection unless ``fresh``, a write always on a connection of its own."""
        if self._route.transport is not None:
            attempt.connected = True  # for all this library knows
            with contextlib.closing(self._route.transport.handle_request(request)) as response:
                chunks = response.iter_bytes()  # identity-encoded: the raw body, or a mock's, already read
                status, headers = response.status_code, response.headers
                return status, headers, self._body(status, headers, chunks, attempt.deadline)
        url = request.url
        target = httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path)
        sending = httpcore.Request(request.method, target, headers=request.headers.raw, content=request.stream)
        sending.extensions = request.extensions  # its timeouts
        reused = self._take() if _is_read(request) and not fresh else None
        connection = reused or self._connection(sending.url.origin)
        with _as_httpx(request):
            try:
                with contextlib.closing(connection.handle_request(sending)) as answer:
                    attempt.answered = True
                    headers = httpx.Headers(answer.headers)
                    body = self._body(answer.status, headers, answer.iter_stream(), attempt.deadline)
            except BaseException:
                connection.close()
                raise
        if _is_read(request) and isinstance(connection, httpcore.HTTPConnection):
            self._give_back(connection)
        else:
            connection.close()
        return answer.status, headers, body

    def _connection(self, origin: httpcore.Origin) -> httpcore.HTTPConnection | httpcore.ConnectionPool:
        """A new connection to Membase; through a proxy, a pool of one (httpcore's pool knows proxies), not kept."""
        if self._route.proxy is None:
            return httpcore.HTTPConnection(
                origin, ssl_context=self._route.verify, keepalive_expiry=_KEEP_ALIVE, network_backend=_BoundedBackend()
            )
        given = httpx.Proxy(self._route.proxy)
        return httpcore.ConnectionPool(
            ssl_context=self._route.verify,
            proxy=httpcore.Proxy(str(given.url), auth=given.raw_auth, ssl_context=given.ssl_context),
            max_keepalive_connections=0,
            network_backend=_BoundedBackend(),
        )

    def _take(self) -> httpcore.HTTPConnection | None:
        """The kept-alive connection freed last that can still be used; the ones that cannot are closed."""
        while True:
            with self._idle_lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None or (connection.is_available() and not connection.has_expired()):
                return connection
            connection.close()

    def _give_back(self, connection: httpcore.HTTPConnection) -> None:
        with self._idle_lock:
            kept = connection.is_idle() and len(self._idle) < _KEPT
            if kept:
                self._idle.append(connection)
        if not kept:
            connection.close()

    def _body(self, status: int, headers: httpx.Headers, chunks: Iterator[bytes], deadline: float) -> bytes:
        """The whole body, read within the deadline and the size bound."""
        limit, encoding = self._route.max_bytes, headers.get("content-encoding", "identity")
        if encoding.lower() != "identity":
            why = f"Membase answered with a body compressed as {encoding!r}, which was not asked for"
            raise BadResponseError(why, status=status)
        stated = headers.get("content-length", "")
        length = int(stated) if stated.isdigit() else None
        body: list[bytes] = []  # joined once at the end: a body read in one piece is not copied at all
        size, overdue = 0, False
        for chunk in chunks if (length or 0) <= limit else ():
            if overdue:  # a caller's transport has no socket to bound; only more data tells a late body was not whole
                raise httpx.ReadTimeout(f"Membase did not finish answering within {self._route.seconds:g} s")
            body.append(chunk)
            size += len(chunk)
            if size > limit:
                break
            overdue = time.monotonic() > deadline and (length is None or size < length)
        if size > limit or (length or 0) > limit:
            raise BadResponseError(
                f"Membase's answer is larger than max_response_bytes ({limit:,} bytes)", status=status
            )
        return body[0] if len(body) == 1 else b"".join(body)


def _is_read(request: httpx.Request) -> bool:
    return request.method == "GET" or (request.method == "POST" and request.url.path.endswith("/v1/search"))


@contextlib.contextmanager
def _as_httpx(request: httpx.Request) -> Iterator[None]:
    """httpcore's errors raised as httpx's of the same name, as ``httpx.HTTPTransport`` maps them (the SDK knows
    httpx's)."""
    try:
        yield
    except Exception as error:
        kinds = (kind for kind in type(error).__mro__ if kind.__module__.startswith("httpcore"))
        same = next((getattr(httpx, kind.__name__) for kind in kinds if hasattr(httpx, kind.__name__)), None)
        if same is None:
            raise
        raise same(str(error), request=request) from error


class _BoundedBackend(httpcore.NetworkBackend):
    """httpcore's own socket backend, each operation capped at the time left to its attempt (:data:`_deadline`)."""

    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        # Each address in turn within what is left (socket.create_connection would give each the whole timeout).
        # Resolving the name is the one step no timeout reaches: the standard library takes none.
        try:
            *others, last = [str(row[4][0]) for row in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        except OSError as error:
            raise httpcore.ConnectError(str(error)) from error
        for address in others:
            with contextlib.suppress(httpcore.ConnectError):
                return self._connect(address, port, timeout, local_address, socket_options)
        return self._connect(last, port, timeout, local_address, socket_options)

    def _connect(self, address: str, port: int, timeout: float | None, *options: Any) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        if (attempt := _attempt.get()) is not None:
            attempt.connected = True  # a request on this connection never went out on a kept-alive one
        return _BoundedStream(self._backend.connect_tcp(address, port, left, *options))


class _BoundedStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for start in range(0, len(buffer), _WRITE_CHUNK):
            self._stream.write(buffer[start : start + _WRITE_CHUNK], _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _BoundedStream(self._stream.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


def _left(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float | None:
    """``timeout`` capped at what is left of the current attempt; ``expired`` raised when nothing is."""
    attempt = _attempt.get()
    if attempt is None:
        return timeout
    left = attempt.deadline - time.monotonic()
    if left <= 0:
        raise expired("the attempt's deadline has passed")
    return left if timeout is None else min(timeout, left)


@functools.lru_cache(maxsize=8)
def _ssl_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    """httpx's default TLS settings, which it reads from these two variables (as set now), built once (about 1 MiB)."""
    return httpx.create_ssl_context()

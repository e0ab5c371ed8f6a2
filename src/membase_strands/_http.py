"""How a store built from a key reaches Membase: two ``httpx.Client`` of its own (reads, writes; no cookies, nothing
shared with another store) over httpcore's pool, whose every socket operation this module's network backend caps at
the time left to the attempt (``request_timeout``). Sent once more, within that deadline: a request that never reached
Membase, or a read after a kept-alive connection broke; never a write once it went out (:func:`may_have_arrived`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import http.cookiejar
import importlib.util
import ipaddress
import os
import re
import socket
import ssl
import threading
import time
import urllib.request
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx
import membase

from ._failures import BadResponseError

KEEP_ALIVE = 4.0  # seconds an idle connection is kept: less than common servers keep theirs (uvicorn, Node: 5 s)
_CHUNK = 64 * 1024  # a body is written in pieces, each within the time left


@dataclass
class _Attempt:
    """One send of a request: its deadline, and how far it went."""

    deadline: float
    new_connection: bool = False  # a new connection was made (or tried) for it
    sent: bool = False  # the request itself (not a proxy's CONNECT) began to go out
    answered: bool = False  # its answer began

    def trace(self, event: str, info: dict[str, Any]) -> None:  # httpcore's public ``trace`` extension
        if event.endswith("send_request_headers.started") and info["request"].method != b"CONNECT":
            self.sent = True


_attempt: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar("membase_attempt", default=None)


@dataclass(frozen=True)
class Route:
    """How one store reaches Membase, read from the environment once, when the store is built."""

    base_url: str
    transport: httpx.BaseTransport | None  # the caller's (the testing kit's), instead of the network
    proxy: httpcore.Proxy | None = field(repr=False)  # it may hold a password
    tls: ssl.SSLContext | None  # for an https:// Membase or proxy: httpx's, under SSL_CERT_FILE / SSL_CERT_DIR
    request_timeout: float  # one attempt, headers and body
    max_bytes: int  # max_response_bytes


def route(base_url: str, transport: httpx.BaseTransport | None, request_timeout: float, max_bytes: int) -> Route:
    """The route to ``base_url`` under the environment as it is now; ``ValueError`` naming the variable (never its
    value) where ``httpx.Client()`` would refuse, and for an https:// proxy to an https:// Membase (TLS inside TLS)."""
    if transport is not None:
        return Route(base_url, transport, None, None, request_timeout, max_bytes)
    chosen = _environment_proxy(url := httpx.URL(base_url))
    proxy_tls, tls = chosen is not None and chosen.url.scheme == "https", None
    if proxy_tls and url.scheme == "https":  # httpcore's TLS in TLS gives every socket receive the whole timeout again
        why = "an https:// proxy to an https:// Membase (TLS inside TLS) cannot be held to request_timeout"
        raise ValueError(f"HTTPS_PROXY or ALL_PROXY: {why}; give its http:// address (CONNECT keeps TLS end to end)")
    if url.scheme == "https" or proxy_tls:  # httpx's settings, read from SSL_CERT_FILE or SSL_CERT_DIR
        tls = _trust(*(_file(os.environ.get(name) or "") for name in ("SSL_CERT_FILE", "SSL_CERT_DIR")))
    proxy = None  # else as httpx.HTTPTransport hands it to httpcore; its TLS trusts what Membase's does
    if chosen is not None:
        proxy = httpcore.Proxy(_core(chosen.url), auth=chosen.raw_auth, ssl_context=tls if proxy_tls else None)
    return Route(base_url, None, proxy, tls, request_timeout, max_bytes)


def _core(url: httpx.URL) -> httpcore.URL:
    return httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path)


def _environment_proxy(url: httpx.URL) -> httpx.Proxy | None:
    """The proxy a plain ``httpx.Client()`` sends a request for ``url`` through, by a copy of httpx's private rules
    (``get_environment_proxies``, ``URLPattern``: each mount parsed, the most specific first; tested side by side)."""
    found = urllib.request.getproxies()
    mounts: dict[str, str | None] = {}
    for scheme in ("http", "https", "all"):
        if value := found.get(scheme):
            mounts[f"{scheme}://"] = value if "://" in value else f"http://{value}"
    for host in (host.strip() for host in found.get("no", "").split(",")):
        if host == "*":
            return None
        if host:  # a URL pattern as it is; an IP address, localhost; else a domain and the names under it
            mounts[host if "://" in host else f"all://{_bypass(host)}"] = None
    matching = []
    for index, (key, value) in enumerate(mounts.items()):
        rule, proxy = _parsed(key, value)
        host, scheme = "" if rule.host == "*" else rule.host, "" if rule.scheme == "all" else rule.scheme
        at = f"^{re.escape(host)}$" if host else ""
        if host.startswith("*"):
            at = f"^.+\\.{re.escape(host[2:])}$" if host.startswith("*.") else f"^(.+\\.)?{re.escape(host[1:])}$"
        if scheme in ("", url.scheme) and rule.port in (None, url.port) and re.match(at, url.host):
            matching.append(((rule.port is None, -len(host), -len(scheme)), index, proxy))
    return min(matching)[2] if matching else None


def _bypass(host: str) -> str:
    for kind, form in ((ipaddress.IPv4Address, "{}"), (ipaddress.IPv6Address, "[{}]")):
        with contextlib.suppress(ValueError):
            kind(host.split("/")[0])
            return form.format(host)
    return host if host.lower() == "localhost" else f"*{host}"


def _parsed(key: str, value: str | None) -> tuple[httpx.URL, httpx.Proxy | None]:
    """One mount's pattern and proxy, as httpx parses them; ``ValueError`` naming the variable where it cannot."""
    try:
        rule, proxy = httpx.URL(key), (None if value is None else httpx.Proxy(value))
    except (httpx.InvalidURL, ValueError):  # their text quotes the URL, password and all
        scheme = (value or key).partition("://")[0].lower()
        named = "it names no scheme"
        if re.fullmatch("[a-z][a-z0-9+.-]*", scheme):  # a scheme, never a password
            named = f"the scheme {scheme!r} is not one"
        why = f"{named} httpx takes (http, https, socks5, socks5h)"
        if scheme in ("http", "https", "socks5", "socks5h", "all"):
            why = "httpx cannot parse it (a '#', '/' or '?' in a password must be percent-encoded)"
    else:
        if proxy is None or proxy.url.scheme in ("http", "https") or importlib.util.find_spec("socksio"):
            return rule, proxy
        why = "a socks5 proxy needs the socksio package (pip install 'httpx[socks]'), which is not installed"
    variable = "NO_PROXY" if value is None else f"{key[:-3].upper()}_PROXY"
    raise ValueError(f"{variable}: {why}; its value is not shown here, as it may hold a password")


def _file(path: str) -> tuple[Any, ...]:
    with contextlib.suppress(OSError):
        stat = os.stat(path)
        return path, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns
    return (path,)


@functools.lru_cache(maxsize=8)
def _trust(*files: tuple[Any, ...]) -> ssl.SSLContext:
    """Built once per files as they are: a bundle rotated in place gets a new one, stores on one unchanged share it."""
    return httpx.create_ssl_context()


def clients(route: Route) -> tuple[httpx.Client, httpx.Client]:
    """(reads, writes): one store's clients, for the caller to keep and close. Reads keep connections alive for
    :data:`KEEP_ALIVE` s; each write gets a fresh one (a server closing an idle one never makes its fate unclear)."""
    writes = _Transport(route, keep_alive=False)
    return _client(route, _Transport(route, keep_alive=True, fresh=writes.pool)), _client(route, writes)


def _client(route: Route, transport: _Transport) -> httpx.Client:
    jar = http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))  # it keeps none
    # Compressed answers are not asked for (max_bytes bounds memory); the network backend caps each timeout.
    headers, timeout = {"Accept-Encoding": "identity"}, route.request_timeout
    return httpx.Client(base_url=route.base_url, transport=transport, timeout=timeout, headers=headers, cookies=jar)


def may_have_arrived(error: BaseException) -> bool:
    """The one rule: whether Membase may have read (and stored) the request that failed with ``error``. ``False`` when
    it answered one of its documented errors (a 4xx with its error envelope: ``code`` set) or the request never reached
    it (no connection, no tunnel, a proxy's refusal, anywhere in the chain); ``True`` when it went out and no answer of
    Membase's came back (a timeout or broken connection after sending, a 5xx, an answer without its error shape)."""
    seen: BaseException | None = error
    for _ in range(32):  # the chain as Python shows it; a cycle is not followed
        if isinstance(seen, membase.APIStatusError) and (seen.body is not None or seen.__cause__ is None):
            return seen.body is not None and not (400 <= (seen.status or 0) < 500 and seen.code)  # no body: not sent
        if isinstance(seen, (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError)):
            return False
        if isinstance(seen, httpx.TransportError):
            return True
        if seen is None or (seen.__cause__ is None and seen.__suppress_context__):
            break
        seen = seen.__cause__ or seen.__context__  # a status error of this library's own stands for its cause
    return getattr(error, "status", None) is not None  # an answer that could not be read (else: nothing was sent)


class _Transport(httpx.BaseTransport):
    """One client's requests, each attempt bounded, sent once more (on ``fresh``) if the resend rule allows it;
    ``keep_alive``: whether idle connections are kept (for reads; each write gets a new one)."""

    def __init__(self, route: Route, keep_alive: bool, fresh: httpcore.ConnectionPool | None = None) -> None:
        self._route, self._write, self.pool = route, not keep_alive, None
        if route.transport is None:  # no cap: a hung request holds a connection of its own, never one others wait for
            # Every idle read connection is kept until the sweeper ends it: httpcore closes surplus idle ones outside
            # its lock, so one just handed to a request can be closed after it went out (and the read sent twice).
            options: dict[str, Any] = {"ssl_context": route.tls, "proxy": route.proxy, "max_connections": None}
            self.pool = httpcore.ConnectionPool(
                max_keepalive_connections=None if keep_alive else 0,
                keepalive_expiry=KEEP_ALIVE,
                network_backend=_BACKEND,
                **options,
            )
        if keep_alive and self.pool is not None:
            _pools.add(weakref.ref(self.pool, _pools.discard))
        self._fresh = fresh or self.pool

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + self._route.request_timeout
        for last in (False, True):
            attempt = _Attempt(deadline)
            token = _attempt.set(attempt)
            try:
                return self._send(request, attempt, self._fresh if last else self.pool)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError):  # it never reached Membase
                if last or time.monotonic() >= deadline:
                    raise
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):  # a broken kept-alive connection?
                if last or self._write or attempt.new_connection or attempt.answered:
                    raise
            finally:
                _attempt.reset(token)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _send(self, request: httpx.Request, attempt: _Attempt, pool: httpcore.ConnectionPool | None) -> httpx.Response:
        if pool is None:  # the caller's transport: the bounds on its answer still hold
            attempt.new_connection = True  # for all this library knows
            with contextlib.closing(self._route.transport.handle_request(request)) as given:  # type: ignore[union-attr]
                return self._read(request, given.status_code, given.headers, given.iter_bytes(), attempt)
        sending = httpcore.Request(request.method, _core(request.url), headers=request.headers.raw)
        sending.stream, sending.extensions = request.stream, {**request.extensions, "trace": attempt.trace}
        with _as_httpx(request, attempt), contextlib.closing(pool.handle_request(sending)) as answer:
            attempt.answered = True
            response = self._read(request, answer.status, httpx.Headers(answer.headers), answer.iter_stream(), attempt)
        if pool is not self._fresh and _sweeping.acquire(blocking=False):  # a connection idles in the pool now
            try:
                threading.Thread(target=_sweep, name="membase-sweeper", daemon=True).start()
            except RuntimeError:  # no thread to be had now: the next read tries again
                _sweeping.release()
        return response

    def _read(
        self, request: httpx.Request, status: int, headers: httpx.Headers, chunks: Iterator[bytes], attempt: _Attempt
    ) -> httpx.Response:
        """The whole answer, its body read within the deadline and up to ``max_bytes`` (httpx reads any size)."""
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
                raise httpx.ReadTimeout(f"Membase did not finish answering within {self._route.request_timeout:g} s")
            body.append(chunk)
            size += len(chunk)
            if size > limit:
                break
            overdue = time.monotonic() > attempt.deadline and (length is None or size < length)
        if size > limit or (length or 0) > limit:
            why = f"Membase's answer is larger than max_response_bytes ({limit:,} bytes)"
            raise BadResponseError(why, status=status)
        content = body[0] if len(body) == 1 else b"".join(body)
        return httpx.Response(status, headers=headers, content=content, request=request)

    def close(self) -> None:  # requests in flight go on (a write still running is still saved); idle connections end
        for connection in self.pool.connections if self.pool is not None else ():
            if connection.is_idle():
                connection.close()


@contextlib.contextmanager
def _as_httpx(request: httpx.Request, attempt: _Attempt) -> Iterator[None]:
    """httpcore's errors as httpx's (the SDK knows those); one before the request began to go out as a connect error."""
    try:
        yield
    except Exception as error:
        kind = type(error)
        if not kind.__module__.startswith("httpcore") or not hasattr(httpx, kind.__name__):
            raise
        if not attempt.sent and not isinstance(error, (httpcore.ConnectError, httpcore.ProxyError)):
            kind = httpcore.ConnectTimeout if isinstance(error, httpcore.TimeoutException) else httpcore.ConnectError
        raise getattr(httpx, kind.__name__)(str(error), request=request) from error


_pools: set[weakref.ref[httpcore.ConnectionPool]] = set()  # the stores' kept-alive pools, while they live
_sweeping = threading.Lock()  # held by the sweeper thread, while one runs


def _sweep() -> None:
    """Until no connection is idle, close those past their keep-alive (httpcore does only on their pool's next use).

    A connection is closed only when it was past its keep-alive at the look before too (0.5 s earlier): httpcore hands
    an idle connection to a request a moment before the request marks it busy, and a socket closed under a request in
    flight leaves the request waiting out its timeout."""
    expired: set[Any] = set()
    while True:
        time.sleep(0.5)
        idle = [c for ref in list(_pools) for c in getattr(ref(), "connections", ()) if c.is_idle()]
        if not idle:
            _sweeping.release()  # then one more look: a read that found the lock held may have left a connection
            if not any(c.is_idle() for ref in list(_pools) for c in getattr(ref(), "connections", ())):
                return
            if not _sweeping.acquire(blocking=False):
                return  # another sweeper took over
        expired, expired_before = {c for c in idle if c.has_expired()}, expired
        for connection in expired & expired_before:
            connection.close()  # its pool drops it, closed, when next used


def _forget_sweeper() -> None:  # a forked child has no sweeper thread, nor any pool of the parent's
    _pools.clear()
    if _sweeping.locked():
        _sweeping.release()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_forget_sweeper)


class _Backend(httpcore.NetworkBackend):
    """httpcore's sockets, each operation held to its attempt's time left (httpcore gives each the whole timeout)."""

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, *options: Any, **named: Any) -> _Bounded:
        if (attempt := _attempt.get()) is not None:
            attempt.new_connection = True  # a request on this connection never went out on a kept-alive one
        try:  # resolving the name is the one step no timeout reaches: the standard library takes none
            *others, last = [str(row[4][0]) for row in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        except OSError as error:
            raise httpcore.ConnectError(str(error)) from error
        for index, address in enumerate(others):  # each address but the last gets its share of the time left
            with contextlib.suppress(httpcore.ConnectError, httpcore.ConnectTimeout):
                share = _left(timeout, httpcore.ConnectTimeout)
                share = share and share / (len(others) + 1 - index)
                return _Bounded(_SOCKETS.connect_tcp(address, port, share, *options, **named))
        return _Bounded(_SOCKETS.connect_tcp(last, port, _left(timeout, httpcore.ConnectTimeout), *options, **named))


class _Bounded(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for start in range(0, len(buffer), _CHUNK):
            self._stream.write(buffer[start : start + _CHUNK], _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: Any = None) -> Any:
        return _Bounded(self._stream.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


_SOCKETS, _BACKEND = httpcore.SyncBackend(), _Backend()


def _left(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float | None:
    """``timeout`` capped at what is left of the current attempt; ``expired`` raised when nothing is."""
    attempt = _attempt.get()
    if attempt is None:
        return timeout
    left = attempt.deadline - time.monotonic()
    if left <= 0:
        raise expired("the attempt's deadline has passed")
    return left if timeout is None else min(timeout, left)

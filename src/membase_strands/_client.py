"""The Membase client the store talks through: built from options, guarded, with a no-retry view of it.

The SDK sends every request through the ``httpx.Client`` it keeps in ``Membase._http`` (one
``_http.request()`` per attempt). The store gives it :class:`GuardedHTTP` there instead, on a copy of
the client (a client passed in is never changed), so that every attempt the store makes:

- ends within a whole-call deadline, the client's timeout. httpx's timeouts are per read: a server
  that sends a byte every few seconds would otherwise hold a call for as long as it drips. Each
  socket read, write and connect is bounded by the time left (:class:`_GuardedBackend`, wrapped
  around the connection pool's network backend), and the body is checked between chunks
  (:class:`_DeadlineBody`) for transports whose sockets cannot be reached. Past the deadline httpx
  raises a timeout, which the SDK turns into ``APITimeoutError``.
- never shares a connection with another process. A forked child inherits the parent's pooled
  keep-alive sockets, and two processes reading one socket get each other's answers. In a child,
  a client the store built is replaced by a fresh one before the child's first request (an
  ``os.register_at_fork`` hook flags it, holding the client only weakly). A client passed in is not
  the store's to replace: a connection opened through a guarded pool reports itself closed in any
  process but the one that opened it, so the pool drops it, and the child logs a warning once.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpcore
import httpx
import membase
from membase.client import DEFAULT_TIMEOUT

from ._asyncio_net import asyncio_backend
from ._failures import BadResponseError
from ._io_loop import IO, PoolSweep

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.app.membase.com"

T = TypeVar("T")


def build_client(
    client: membase.Membase | None,
    api_key: str | None,
    base_url: str | None,
    local: str | os.PathLike[str] | None,
    *,
    store_name: str = "membase",
) -> tuple[membase.Membase, Callable[[], None] | None]:
    """The client to use (guarded, see the module doc), and how to close what the store built.

    The closer is ``None`` for a client passed in: the store never closes a client it was given.

    Raises:
        ValueError: The options contradict each other, or there is no key.
    """
    if client is not None:
        if api_key is not None or base_url is not None or local is not None:
            raise ValueError("client: pass either a ready client or api_key/base_url/local, not both")
        if not isinstance(client, membase.Membase):
            raise ValueError(f"client must be a membase.Membase, got {type(client).__name__}")
        return guarded(client, store_name=store_name), None
    if local is not None:
        if api_key is not None or base_url is not None:
            raise ValueError("local: local Membase runs on this machine and takes no api_key or base_url")
        built = membase.Membase(local=local)
        return guarded(built, store_name=store_name), built.close
    key = api_key if api_key is not None else os.environ.get("MEMBASE_API_KEY")
    if key is None and os.environ.get("MEMBASE_LOCAL"):
        built = membase.Membase()  # the SDK's own convention: MEMBASE_LOCAL names a local store
        return guarded(built, store_name=store_name), built.close
    if not isinstance(key, str) or not key.strip():
        raise ValueError(
            "api_key: no Membase API key; pass api_key=, set MEMBASE_API_KEY, or pass local=DIR for local memory"
        )
    key = key.strip()  # a key read from a file or a vault often ends in a newline
    if not key.isascii() or not key.isprintable() or " " in key:
        # It could not go into an HTTP header, and the transport's error would quote it back.
        raise ValueError("api_key: the Membase API key has spaces or characters a key cannot have; check its value")
    url = (base_url or os.environ.get("MEMBASE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    # The SDK would build an httpx.Client with an SSL context of its own: ~0.8 MiB and ~20 ms per store
    # (measured in benchmarks/). Stores share one context instead; the SDK then leaves closing to us.
    # Looked up at call time (not bound here), so a forked child builds its pool the same way.
    http = GuardedHTTP(new_http_client(url), store_name=store_name, rebuild=lambda: new_http_client(url))
    return _view(membase.Membase(api_key=key, base_url=url, http_client=http.http), _http=http), http.close


def new_http_client(base_url: str) -> httpx.Client:
    """The connection pool for one hosted store: the SDK's timeout, and TLS settings shared by all stores."""
    return httpx.Client(base_url=base_url, timeout=DEFAULT_TIMEOUT, verify=shared_ssl_context())


def new_async_http_client(base_url: str, **options: Any) -> httpx.AsyncClient:
    """The connection pool for one hosted store's awaited calls (``_async_http``), set up as :func:`new_http_client`,
    on plain ``asyncio`` sockets where it can be (see ``_asyncio_net``). ``options`` go to ``httpx.AsyncClient``."""
    options.setdefault("timeout", DEFAULT_TIMEOUT)
    options.setdefault("verify", shared_ssl_context())
    client = httpx.AsyncClient(base_url=base_url, **options)
    backend = asyncio_backend()
    transport = getattr(client, "_transport", None)
    pool = getattr(transport, "_pool", None) if isinstance(transport, httpx.AsyncHTTPTransport) else None
    if backend is not None and isinstance(pool, httpcore.AsyncConnectionPool) and hasattr(pool, "_network_backend"):
        pool._network_backend = backend  # private in httpcore: a pool built another way keeps its own backend
    return client


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """httpx's default TLS settings (certifi's CA bundle, SSL_CERT_FILE/SSL_CERT_DIR honoured), built once."""
    return httpx.create_ssl_context()


def guarded(client: membase.Membase, *, store_name: str) -> membase.Membase:
    """A view of ``client`` whose requests go through :class:`GuardedHTTP`; ``client`` itself is not changed."""
    return _view(client, _http=GuardedHTTP(client._http, store_name=store_name))


def without_retries(client: membase.Membase) -> membase.Membase:
    """A view of ``client`` that makes one attempt per call, sharing its connections.

    The SDK retries timeouts, connection errors, 429 and 5xx twice for every method. A recall
    that ran out of time must hold the in-flight guard for one attempt, not three, and a POST
    that timed out may already be stored, so neither is retried blindly.
    """
    return _view(client, max_retries=0)


def _view(client: membase.Membase, **changes: Any) -> membase.Membase:
    """A shallow copy of ``client`` with ``changes``. The SDK's namespaces (``containers``, ``memories``,
    ...) point back at their client, so the copy gets namespaces of its own."""
    view = copy.copy(client)
    for name, value in changes.items():
        setattr(view, name, value)
    for namespace in ("containers", "memories", "documents"):
        if hasattr(client, namespace):
            setattr(view, namespace, type(getattr(client, namespace))(view))
    return view


# --- Answers that cannot be read ---------------------------------------------------------------

UNREADABLE = (json.JSONDecodeError, UnicodeDecodeError)
"""What the SDK lets through for a 2xx whose body it cannot decode (``response.json()`` raises either)."""


def unreadable_reason(error: ValueError) -> str:
    """Why a 2xx body could not be read, in a few words (for log lines and :class:`BadResponseError`)."""
    if isinstance(error, UnicodeDecodeError):
        return f"not valid UTF-8: {error.reason} at byte {error.start}"
    if isinstance(error, json.JSONDecodeError):
        return f"not JSON: {error.msg}"
    return type(error).__name__


@contextmanager
def readable_answers() -> Iterator[None]:
    """Turn a 2xx answer that cannot be decoded (not UTF-8, or not JSON) into a Membase error.

    Only the decoding errors the SDK lets through are caught: a ``ValueError`` of the library's own
    (an unknown Memory name, say) passes unchanged.
    """
    try:
        yield
    except UNREADABLE as error:
        raise BadResponseError(f"Membase answered with a body that is {unreadable_reason(error)}") from None


# --- Forked processes --------------------------------------------------------------------------

_FORK_RESETS: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()


def after_fork_in_child(owner: T, reset: Callable[[T], None]) -> None:
    """Call ``reset(owner)`` in every process forked from this one while ``owner`` lives.

    ``owner`` is held weakly, so the hook keeps nothing alive; ``reset`` must not hold ``owner``
    itself (pass an unbound method). One ``os.register_at_fork`` hook serves every owner, since
    hooks cannot be removed.
    """
    _FORK_RESETS[owner] = reset


def _reset_after_fork() -> None:
    # Runs in the child's only thread, before anything else: no lock is taken here.
    for owner, reset in list(_FORK_RESETS.items()):
        try:
            reset(owner)
        except Exception as error:  # noqa: BLE001 - one owner's failure must not keep the others from resetting
            logger.warning("reason=<%s> | could not reset after os.fork()", type(error).__name__)


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_reset_after_fork)


# --- The guarded HTTP client ---------------------------------------------------------------------


class GuardedHTTP:
    """Stands where the SDK keeps its ``httpx.Client``: every attempt within a whole-call deadline, and
    no connection shared with a forked parent (see the module doc).

    The SDK calls only ``request()`` and ``close()``; anything else (``timeout``, ``is_closed``, ...)
    is read from the ``httpx.Client`` in use.
    """

    def __init__(
        self, http: httpx.Client, *, store_name: str, rebuild: Callable[[], httpx.Client] | None = None
    ) -> None:
        """Guard ``http``.

        Args:
            http: The client to send through.
            store_name: The store's name, for log lines.
            rebuild: Makes a new client like ``http``, for a store that built it; ``None`` for a client
                that is not the store's to replace.
        """
        self.http = http
        self._store_name = store_name
        self._rebuild = rebuild
        self._pools = guard_pools(http)
        self._used = False
        self._fork_lock = threading.Lock()
        self._stale = False  # forked: ``http`` is the parent's, to be replaced before the first request here
        self._warn_in_child = False
        after_fork_in_child(self, GuardedHTTP._after_fork_in_child)

    def __getattr__(self, name: str) -> Any:
        if name == "http":  # not set yet (a half-built copy): never recurse
            raise AttributeError(name)
        return getattr(self.http, name)

    def request(self, method: str, url: httpx.URL | str, **kwargs: Any) -> httpx.Response:
        """One attempt, as ``httpx.Client.request``, ended with an httpx timeout if it runs past the deadline."""
        self._used = True
        if self._stale or self._warn_in_child:
            self._settle_after_fork()
        http = self.http
        seconds = attempt_seconds(http.timeout)
        deadline = time.monotonic() + seconds
        with _deadline_scope(deadline):
            request = http.build_request(method, url, **kwargs)
            _bound_phases(request, deadline)
            response = http.send(request, stream=True)
            try:
                response.stream = _DeadlineBody(response.stream, request, deadline, seconds, _length(response))
                response.read()
            except BaseException:
                response.close()
                raise
        return response

    def close(self) -> None:
        """Close the client in use (in a forked child that never sent a request, there is none of its own)."""
        if not self._stale:
            self.http.close()

    def _after_fork_in_child(self) -> None:
        # Only flags here: the work waits for the child's first request, so a child that never calls Membase
        # (or execs at once) pays nothing, however many stores it inherited.
        self._fork_lock = threading.Lock()  # a thread of the parent may have held the old one at the fork
        if self._rebuild is not None:
            self._stale = True
        else:
            self._warn_in_child = self._used or any(pool.connections for pool in self._pools)

    def _settle_after_fork(self) -> None:
        with self._fork_lock:
            if self._stale:
                # The parent's pool is dropped, not closed: closing takes its lock, which a thread of the parent
                # may have held at the fork. Its sockets are only this process's copies; the parent's stay open.
                assert self._rebuild is not None
                self.http = self._rebuild()
                self._pools = guard_pools(self.http)
                self._stale = False  # only now: a request that sees False must find the new client
            warn, self._warn_in_child = self._warn_in_child, False
        if warn:
            logger.warning(
                "store=<%s>, reason=<forked after its client was used> | this process was forked from one whose "
                "Membase client (passed in with client=) had open connections; the store does not reuse the "
                "connections it opened there, but it cannot rebuild a client it does not own: build the client "
                "after the fork (for gunicorn, in post_fork)",
                self._store_name,
            )


def attempt_seconds(timeout: httpx.Timeout) -> float:
    """The whole-call deadline of one attempt: the client's timeout (its longest phase), else the SDK's."""
    phases = [value for value in (timeout.connect, timeout.read, timeout.write, timeout.pool) if value is not None]
    return max(phases) if phases else DEFAULT_TIMEOUT


def _bound_phases(request: httpx.Request, deadline: float) -> None:
    """Cap each of httpx's per-phase timeouts (connect, write, read, wait for the pool) at the time left."""
    phases = request.extensions.get("timeout")
    if not isinstance(phases, dict):
        return
    left = max(deadline - time.monotonic(), 0.001)  # 0 would make the socket non-blocking, not a timeout
    request.extensions["timeout"] = {
        phase: left if value is None else min(value, left) for phase, value in phases.items()
    }


def _length(response: httpx.Response) -> int | None:
    try:
        return int(response.headers["content-length"])
    except (KeyError, ValueError):
        return None


class _DeadlineBody(httpx.SyncByteStream):
    """A response body that ends, with a read timeout, once the deadline has passed and more is still to come.

    This is what bounds a dripping body when the transport's sockets could not be guarded (a custom
    transport); a complete body is kept however late it came, as nothing would be gained by refusing it.
    """

    def __init__(
        self,
        stream: httpx.SyncByteStream | httpx.AsyncByteStream,
        request: httpx.Request,
        deadline: float,
        seconds: float,
        length: int | None,
    ) -> None:
        self._stream = stream
        self._request = request
        self._deadline = deadline
        self._seconds = seconds
        self._length = length

    def __iter__(self) -> Iterator[bytes]:
        assert isinstance(self._stream, Iterable)
        received = 0
        for chunk in self._stream:
            received += len(chunk)
            yield chunk
            complete = self._length is not None and received >= self._length
            if not complete and time.monotonic() > self._deadline:
                raise httpx.ReadTimeout(_past_deadline(self._seconds), request=self._request)

    def close(self) -> None:
        if isinstance(self._stream, httpx.SyncByteStream):
            self._stream.close()


def _past_deadline(seconds: float | None) -> str:
    within = f" of {seconds:g} s" if seconds is not None else ""
    return f"Membase did not finish answering within the whole-call deadline{within}"


# --- Sockets: every read, write and connect within the deadline ---------------------------------

_local = threading.local()  # the deadline of the attempt this thread is making, if any


@contextmanager
def _deadline_scope(deadline: float) -> Iterator[None]:
    outer: float | None = getattr(_local, "deadline", None)
    _local.deadline = deadline if outer is None else min(outer, deadline)
    try:
        yield
    finally:
        _local.deadline = outer


def _time_left(timeout: float | None, error: type[Exception]) -> float | None:
    """``timeout`` capped at the time left before this thread's deadline; raises ``error`` once it has passed."""
    deadline: float | None = getattr(_local, "deadline", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error(_past_deadline(None))
    return left if timeout is None else min(timeout, left)


def guard_pools(http: httpx.Client) -> list[httpcore.ConnectionPool]:
    """Put :class:`_GuardedBackend` under every connection pool of ``http`` that can be reached; the pools.

    httpx keeps its transports in ``_transport`` and ``_mounts`` (proxies), and httpcore opens every
    connection through the pool's ``_network_backend``. Both are private: a client built another way
    (a custom transport, a future httpx) is left as it is and relies on :class:`_DeadlineBody` alone.
    Guarding twice is harmless, so stores may share a client.
    """
    transports = [getattr(http, "_transport", None), *getattr(http, "_mounts", {}).values()]
    pools = []
    for transport in transports:
        pool = getattr(transport, "_pool", None) if isinstance(transport, httpx.HTTPTransport) else None
        backend = getattr(pool, "_network_backend", None)
        if not isinstance(pool, httpcore.ConnectionPool) or not isinstance(backend, httpcore.NetworkBackend):
            continue
        if not isinstance(backend, _GuardedBackend):
            pool._network_backend = _GuardedBackend(backend, PoolSweep(pool))
        pools.append(pool)
    return pools


class _GuardedBackend(httpcore.NetworkBackend):
    """Opens connections whose streams keep to the current attempt's deadline and to this process, and has the
    I/O loop close them once idle past their keep-alive expiry."""

    def __init__(self, backend: httpcore.NetworkBackend, sweep: PoolSweep) -> None:
        self._backend = backend
        self._sweep = sweep

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _time_left(timeout, httpcore.ConnectTimeout)
        stream = _GuardedStream(self._backend.connect_tcp(host, port, timeout, local_address, socket_options))
        self._watch()
        return stream

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
    ) -> httpcore.NetworkStream:
        timeout = _time_left(timeout, httpcore.ConnectTimeout)
        stream = _GuardedStream(self._backend.connect_unix_socket(path, timeout, socket_options))
        self._watch()
        return stream

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)

    def _watch(self) -> None:
        try:
            IO.watch(self._sweep)
        except RuntimeError as error:  # no thread to be had: the connection still works, it is only not swept
            logger.debug("reason=<%s> | could not have an idle connection swept", error)


class _GuardedStream(httpcore.NetworkStream):
    """One connection's stream: each read and write bounded by the time left, usable only in the process
    that opened it."""

    def __init__(self, stream: httpcore.NetworkStream, pid: int | None = None) -> None:
        self._stream = stream
        self._pid = os.getpid() if pid is None else pid

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._same_process(httpcore.ReadError)
        return self._stream.read(max_bytes, _time_left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._same_process(httpcore.WriteError)
        self._stream.write(buffer, _time_left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        # In a forked child this closes only the child's copy of the socket: no shutdown, no TLS close_notify.
        self._stream.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        timeout = _time_left(timeout, httpcore.ConnectTimeout)
        return _GuardedStream(self._stream.start_tls(ssl_context, server_hostname, timeout), self._pid)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and os.getpid() != self._pid:
            # httpcore drops an idle connection whose socket is readable (the server closed it): in a forked
            # child, every connection of the parent is dropped that way before it could be reused.
            return True
        return self._stream.get_extra_info(info)

    def _same_process(self, error: type[Exception]) -> None:
        if os.getpid() != self._pid:
            raise error("this connection belongs to the process this one was forked from")

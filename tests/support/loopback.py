"""A real HTTP server on 127.0.0.1 that answers like :class:`InMemoryMembase`, for faults that live in the transport.

``httpx.MockTransport`` never opens a socket, so it cannot show what a dripping server, a reset connection, a forked
process sharing a pooled socket or a cancelled request does to the store. :class:`LoopbackMembase` hands each request
to its fake (one account per key) over HTTP/1.1 with keep-alive, and lets a test replace the answer to one route (or
one key's requests on it) with a raw action on the socket (:func:`drip`, :func:`stall`, :func:`endless`...). It
records every request it reads (``seen``) and every answer it finished (``answered``); :meth:`LoopbackMembase.wait_for`
waits on those records, and on the ends of drips and streams, without polling.

Each server's URL is one no earlier server in this process had (a path of its own on a fresh port), and each request
it reads is recorded with the connection it came on. :class:`FullBacklog` and :class:`SilentTLS` are listeners whose
connects stall. Every wait in here is bounded, the servers bind to loopback only, and their threads are daemons.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import membase

from membase_strands.testing import API_KEY, InMemoryMembase

RawAction = Callable[["_Handler"], None]
"""Something done on the socket instead of the fake's answer; it owns the connection from then on."""

LIMIT = 30.0  # the longest any action here holds a connection
_SERVERS = itertools.count(1)


@dataclass(frozen=True)
class Seen:
    """One request the server read: its route, the key it carried, its ``Cookie`` header, its JSON body, and the
    connection it came on (numbered from 1, in the order the server took them)."""

    method: str
    path: str
    key: str
    cookie: str | None
    body: Any
    connection: int = 0


@dataclass(frozen=True)
class Streamed:
    """What one :func:`endless` or :func:`huge` answer sent of its body; ``ended``: "hung up", "stop" or "whole"."""

    sent: int
    ended: str


@dataclass(frozen=True)
class Dripped:
    """What one drip managed to send before it ended, and whether it ended because the client hung up."""

    sent: int
    hung_up: bool

    def lines_within(self, seconds: float, every: float) -> bool:
        """Whether no more was sent than fits in ``seconds`` at one line (or byte) every ``every`` s, with slack."""
        return self.sent <= seconds / every + 5


class LoopbackMembase:
    """A :class:`InMemoryMembase` served over real sockets on 127.0.0.1."""

    def __init__(self, fake: InMemoryMembase | None = None, tls: ssl.SSLContext | None = None) -> None:
        """Start serving on a free port (over TLS with ``tls``); use as a context manager or call :meth:`close`."""
        self.fake = fake if fake is not None else InMemoryMembase()
        self._actions: dict[tuple[str, str, str | None], list[RawAction]] = {}
        self._standing: dict[tuple[str, str], RawAction] = {}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified whenever a record below grows
        self._prefix = f"/loopback-{next(_SERVERS)}"
        self.connections = self.open_connections = 0
        self.in_flight = self.peak_in_flight = 0  # requests being handled now, and the most at once
        self.latency = 0.0  # seconds the server waits before each answer it gives as the fake
        self.drips: list[Dripped] = []  # each drip that ended, in order
        self.streams: list[Streamed] = []  # each endless or huge answer that ended, in order
        self.hung_up: list[int] = []  # connections the client closed after :func:`half_close` closed the server side
        self.seen: list[Seen] = []  # every request read, in order, before any raw action
        self.answered: list[Seen] = []  # the requests whose whole answer was written, in order
        self.cookie_for: Callable[[str], str | None] | None = None
        """When set, every answer carries ``Set-Cookie: <cookie_for(key)>; Path=/`` for the key of its request."""
        self.close_after: float | None = None
        """When set, each connection is closed this many seconds after each answer, and whatever the client sent on
        it meanwhile is never read (as a server closing an idle keep-alive connection over a real network)."""
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._scheme = "http"
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
            self._scheme = "https"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="loopback-membase", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{self._scheme}://{host}:{port}{self._prefix}"

    def client(self, **kwargs: Any) -> membase.Membase:
        """A real ``membase.Membase`` client over a real socket to this server."""
        return membase.Membase(api_key=API_KEY, base_url=self.url, **kwargs)

    def on(self, method: str, path: str, *actions: RawAction, key: str | None = None) -> None:
        """Replace the next answers to ``method path`` with ``actions``, one per request, in order; with ``key``,
        only for requests carrying that key (they take their own queue first, then the route's)."""
        with self._lock:
            self._actions.setdefault((method, path, key), []).extend(actions)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = LIMIT) -> bool:
        """Wait until ``predicate`` (of this server's records) holds, at most ``timeout`` seconds; whether it holds.

        It is checked whenever a request is read, an answer is sent, or a drip or stream ends.
        """
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def requests(self, method: str, path: str, keys: Any = None, answered: bool = False) -> list[Seen]:
        """The requests read to ``method path`` (``answered``: those whose whole answer went out), optionally only
        those carrying one of ``keys``."""
        with self._lock:
            records = self.answered if answered else self.seen
            return [s for s in records if (s.method, s.path) == (method, path) and (keys is None or s.key in keys)]

    def answers(self, method: str, path: str, keys: Any = None) -> list[Seen]:
        return self.requests(method, path, keys, answered=True)

    def always(self, method: str, path: str, action: RawAction) -> None:
        """Do ``action`` for every request to ``method path`` that no queued action (:meth:`on`) takes."""
        with self._lock:
            self._standing[(method, path)] = action

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(LIMIT)

    def __enter__(self) -> LoopbackMembase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _next_action(self, method: str, path: str, key: str) -> RawAction | None:
        with self._lock:
            for queued in (self._actions.get((method, path, key)), self._actions.get((method, path, None))):
                if queued:
                    return queued.pop(0)
            return self._standing.get((method, path))

    def _record(self, into: list[Any], entry: Any) -> None:
        with self._changed:
            into.append(entry)
            self._changed.notify_all()

    def _count(self, opened: int = 0, serving: int = 0) -> int:
        with self._changed:
            self.connections += opened > 0
            self.open_connections += opened
            self.in_flight += serving
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            if opened < 0:
                self._changed.notify_all()  # a wait on open_connections
            return self.connections


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default of 5 overflows when tens of stores connect at once (each hosted store opens one
    # connection for its recall and one for its writes), and an overflowing backlog can reset a connection.
    request_queue_size = 256
    owner: LoopbackMembase

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up mid-answer (a deadline, a reset, a closed store) is what many tests do on
        # purpose; socketserver would print its traceback into whichever test's output is current.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    answer: httpx.Response  # the fake's answer to the request being served
    seen: Seen  # the request being served, as the server recorded it
    number: int  # this connection's, among the server's
    timeout = LIMIT  # an idle keep-alive connection is dropped after this, so no handler thread lives forever

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.number = self.server.owner._count(+1)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # the action reset the connection
        finally:
            self.server.owner._count(-1)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self._serve(b"")

    do_DELETE = do_GET  # forget  # noqa: N815 - the stdlib's name

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        length = int(self.headers.get("Content-Length") or 0)
        self._serve(self.rfile.read(length) if length else b"")

    def _serve(self, body: bytes) -> None:
        owner = self.server.owner
        owner._count(serving=+1)
        try:
            self._answer(body)
        finally:
            owner._count(serving=-1)
        if owner.close_after is not None and not self.close_connection:
            # Read nothing more: a request the client sends meanwhile is never seen, and closing with it unread
            # resets the connection, as a server closing an idle keep-alive connection does over a real network.
            time.sleep(owner.close_after)
            self.close_connection = True

    def _answer(self, body: bytes) -> None:
        owner = self.server.owner
        # The path the SDK asked for, below the server's own; a proxy is sent the whole URL, and answers as the fake.
        target = re.sub(r"^(https?://[^/]+)?/loopback-\d+", "", self.path)
        path = target.split("?")[0]
        request = httpx.Request(
            self.command, f"http://loopback{target}", headers=dict(self.headers.items()), content=body
        )
        key = bearer(self.headers.get("Authorization"))
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        self.seen = Seen(self.command, path, key, self.headers.get("Cookie"), parsed, self.number)
        owner._record(owner.seen, self.seen)
        answer = owner.fake.handle(request)  # recorded by the fake, faults and all, before any raw action
        self.answer = answer
        action = owner._next_action(self.command, path, key)
        if action is not None:
            action(self)
            return
        if owner.latency:
            time.sleep(owner.latency)
        as_usual(self)

    def write_answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        """Send one whole answer on this connection, keeping it alive."""
        self.send_response(status)
        for name, value in (headers or {}).items():
            if name.lower() not in ("content-length", "connection", "transfer-encoding", "content-encoding"):
                self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        cookie_for = self.server.owner.cookie_for
        cookie = cookie_for(self.seen.key) if cookie_for is not None else None
        if cookie is not None:
            self.send_header("Set-Cookie", f"{cookie}; Path=/")
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.server.owner._record(self.server.owner.answered, self.seen)


def bearer(authorization: str | None) -> str:
    """The key an ``Authorization: Bearer <key>`` header carries (``""`` without one)."""
    return (authorization or "").removeprefix("Bearer ").strip()


def as_usual(handler: _Handler) -> None:
    """Answer as the fake did (its faults included): the action that ends most others."""
    answer = handler.answer
    handler.write_answer(answer.status_code, answer.read(), dict(answer.headers))


def raw_answer(status: int, body: bytes) -> RawAction:
    """Answer with exactly these bytes (for example a body that is not valid UTF-8)."""
    return lambda handler: handler.write_answer(status, body)


def drip(body: bytes = b'{"results": []}', every: float = 0.2, limit: float = LIMIT) -> RawAction:
    """Announce ``body`` and send it one byte every ``every`` seconds (for at most ``limit`` seconds), each byte well
    inside httpx's per-read timeout, so only a whole-call deadline ends the call; recorded in ``drips``."""

    def act(handler: _Handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.flush()
        handler.close_connection = True
        deadline, sent, hung_up = time.monotonic() + limit, 0, False
        for byte in body:
            try:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
            except OSError:
                hung_up = True  # the client gave up and closed the connection
                break
            sent += 1
            time.sleep(every)
            if time.monotonic() > deadline:
                break
        handler.server.owner._record(handler.server.owner.drips, Dripped(sent, hung_up))

    return act


def stall(release: threading.Event, then: RawAction | None = None, limit: float = LIMIT) -> RawAction:
    """Hold the connection without answering until ``release`` is set (at most ``limit`` s), then ``then`` (without
    it, the connection is closed with no answer)."""

    def act(handler: _Handler) -> None:
        release.wait(limit)
        if then is not None:
            then(handler)
        else:
            handler.close_connection = True

    return act


def ok_json(body: Any) -> RawAction:
    """Answer 200 with ``body`` as JSON."""
    return raw_answer(200, json.dumps(body).encode())


def meet(barrier: threading.Barrier, then: RawAction = as_usual) -> RawAction:
    """Wait until ``barrier``'s other parties are in too (at most ``LIMIT`` s), then ``then``: requests that meet are
    in flight at the same time, each on a connection of its own."""

    def act(handler: _Handler) -> None:
        barrier.wait(LIMIT)
        then(handler)

    return act


def arrived(event: threading.Event, then: RawAction) -> RawAction:
    """Set ``event`` once the request is in (the fake has recorded it), then do ``then``: a test waits for the moment
    a request is on the wire instead of sleeping."""

    def act(handler: _Handler) -> None:
        event.set()
        then(handler)

    return act


def drip_header_lines(every: float = 0.2, limit: float = 60.0, stop: threading.Event | None = None) -> RawAction:
    """Send the status line, then one whole header line every ``every`` seconds (well inside any per-read timeout),
    never ending the headers, until ``limit`` s pass, ``stop`` is set or the client hangs up; recorded in ``drips``."""

    def act(handler: _Handler) -> None:
        handler.close_connection = True
        stopping = stop if stop is not None else threading.Event()
        deadline = time.monotonic() + limit
        lines, hung_up = 0, False
        try:
            handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            handler.wfile.flush()
            while not stopping.wait(every) and time.monotonic() < deadline:
                handler.wfile.write(f"X-Drip-{lines}: still coming\r\n".encode())
                handler.wfile.flush()
                lines += 1
        except OSError:
            hung_up = True  # the client gave up and closed the connection
        handler.server.owner._record(handler.server.owner.drips, Dripped(lines, hung_up))

    return act


HANG_UPS = ("close", "half status line", "reset", "headers then close", "200 KB header")
"""Ways a server that has read a request can end its connection without a whole answer."""


def hang_up(way: str) -> RawAction:
    """End the connection one of the :data:`HANG_UPS` ways, after the request was read (and the fake acted on it)."""

    def act(handler: _Handler) -> None:
        handler.close_connection = True
        if way == "half status line":
            handler.wfile.write(b"HTTP/1.1 20")
        elif way == "reset":  # a linger of 0: closing sends RST, not FIN
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif way == "headers then close":
            handler.wfile.write(_OK + b"Content-Length: 100\r\n\r\n")
        elif way == "200 KB header":
            handler.wfile.write(_OK + b"X-Huge: " + b"h" * 200_000 + b"\r\n\r\n{}")
        handler.wfile.flush()

    return act


ERROR_FILLER = "The request was rejected because one of its fields is not valid for this Memory. " * 12
"""Readable text around an echoed key: long enough that a key at any offset up to 400 has text after it."""


def echo_key(offset: int, status: int = 400, tail: int = 300) -> RawAction:
    """Answer ``status`` with Membase's error envelope whose message echoes the request's bearer key ``offset``
    characters in (``tail`` characters of text after it), as a server quoting what it was sent does."""

    def act(handler: _Handler) -> None:
        message = ERROR_FILLER[:offset] + handler.seen.key + ERROR_FILLER[:tail]
        envelope = {"error": {"code": "bad_request", "message": message, "details": None, "retryable": False}}
        handler.write_answer(status, json.dumps(envelope).encode())

    return act


_CHUNK = b"x" * 65536
_SEND_BUFFER = 64 * 1024  # the server's socket send buffer for streams: what it has sent is nearly what was read
_HEAD = b'{"results": [{"content": "'
_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


def _stream(handler: _Handler, start: bytes, body: Iterator[bytes], stop: threading.Event | None) -> None:
    """Send ``start`` (ending in the JSON head), then ``body``'s pieces until they end, ``stop`` is set or the client
    hangs up; :attr:`LoopbackMembase.streams` records the body bytes sent (chunk framing aside) and why it ended."""
    handler.close_connection = True
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
    sent, ended = 0, "whole"
    try:
        handler.wfile.write(start)
        sent = len(_HEAD)
        for piece in body:
            if stop is not None and stop.is_set():
                ended = "stop"
                break
            handler.wfile.write(piece)
            sent += min(len(piece), len(_CHUNK))
        handler.wfile.flush()
    except OSError:
        ended = "hung up"
    handler.server.owner._record(handler.server.owner.streams, Streamed(sent, ended))


def endless(most: int, stop: threading.Event | None = None) -> RawAction:
    """Answer 200 with a chunked body that never ends, as fast as the client reads it (a JSON start, then filler),
    until the client hangs up, ``stop`` is set, or ``most`` bytes went out (a bound of the test's, so a client that
    reads everything cannot exhaust the machine)."""
    start = _OK + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(_HEAD) + _HEAD + b"\r\n"
    framed = b"%x\r\n" % len(_CHUNK) + _CHUNK + b"\r\n"
    body = itertools.repeat(framed, -(-(most - len(_HEAD)) // len(_CHUNK)))
    return lambda handler: _stream(handler, start, itertools.chain(body, [b"0\r\n\r\n"]), stop)


def huge(length: int, stop: threading.Event | None = None) -> RawAction:
    """Answer 200 announcing a body of ``length`` bytes and stream it (a JSON start, then filler), never building it,
    until it is all out, the client hangs up, or ``stop`` is set."""
    start = _OK + b"Content-Length: %d\r\n\r\n" % length + _HEAD
    sizes = range(len(_HEAD), length, len(_CHUNK))
    return lambda handler: _stream(handler, start, (_CHUNK[: length - sent] for sent in sizes), stop)


def twice(handler: _Handler) -> None:
    """The fake's answer and, right behind it in the same write, a copy of it: one answer more than was asked for, as
    a misbehaving proxy or gateway sends, so a client that reuses the connection reads it as its next answer."""
    answer, body = handler.answer, handler.answer.read()
    head = f"HTTP/1.1 {answer.status_code} OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    handler.wfile.write((head.encode() + body) * 2)
    handler.server.owner._record(handler.server.owner.answered, handler.seen)


def half_close(handler: _Handler) -> None:
    """Answer as usual, then close the server's side of the connection (as a server whose keep-alive ran out) and wait
    for the client to close its own, recorded in :attr:`LoopbackMembase.hung_up` (the client's socket sits in
    CLOSE_WAIT meanwhile)."""
    as_usual(handler)
    handler.close_connection = True
    handler.connection.shutdown(socket.SHUT_WR)
    handler.connection.settimeout(LIMIT)
    with contextlib.suppress(OSError):
        while handler.connection.recv(65536):
            pass
        owner = handler.server.owner
        owner._record(owner.hung_up, handler.number)


class FullBacklog:
    """A listener on ``host`` whose backlog is full: a connect to it stalls (its SYN is dropped) while it lives."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._listener.bind((host, port))
        self._listener.listen(0)  # room for one waiting connection: the filler's
        self._filler = socket.create_connection(self._listener.getsockname()[:2])
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}" if ":" not in host else f"http://[{host}]:{self.port}"

    def close(self) -> None:
        self._filler.close()
        self._listener.close()


class SilentTLS:
    """A listener on 127.0.0.1 that takes every connection and never answers its TLS handshake, so a connect (TCP,
    then TLS) to :attr:`url` stalls; it counts the connections it took (:attr:`taken`). After :meth:`answer_next`, the
    next one's handshake is answered ``after`` s late, and header lines drip to it until it hangs up
    (:attr:`dripped`)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self._listener.getsockname()[1]}"
        self.taken: list[socket.socket] = []
        self.dripped: list[Dripped] = []
        self._plan: tuple[ssl.SSLContext, float, float] | None = None
        self._changed = threading.Condition()
        threading.Thread(target=self._accept, name="silent-tls", daemon=True).start()

    def answer_next(self, tls: ssl.SSLContext, after: float, every: float) -> None:
        with self._changed:
            self._plan = (tls, after, every)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = LIMIT) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def close(self) -> None:
        self._listener.close()
        for taken in self.taken:
            taken.close()

    def _accept(self) -> None:
        while True:
            try:
                taken, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._changed:
                self.taken.append(taken)
                plan, self._plan = self._plan, None
                self._changed.notify_all()
            if plan is not None:
                threading.Thread(target=self._answer_late, args=(taken, *plan), daemon=True).start()

    def _answer_late(self, taken: socket.socket, tls: ssl.SSLContext, after: float, every: float) -> None:
        time.sleep(after)  # the server's own delay, not a wait for anything
        lines, hung_up = 0, False
        try:
            with tls.wrap_socket(taken, server_side=True) as connection:
                connection.settimeout(LIMIT)
                received = b""
                while b"\r\n\r\n" not in received:
                    received += connection.recv(65536)
                connection.sendall(_OK)
                deadline = time.monotonic() + LIMIT
                while time.monotonic() < deadline:
                    time.sleep(every)
                    connection.sendall(f"X-Drip-{lines}: still coming\r\n".encode())
                    lines += 1
        except OSError:
            hung_up = True
        with self._changed:
            self.dripped.append(Dripped(lines, hung_up))
            self._changed.notify_all()

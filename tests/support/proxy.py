"""A tiny HTTP forward proxy on 127.0.0.1 that records what it forwards, for tests of proxy settings.

A client told to use it (``HTTP_PROXY=proxy.url``) sends each ``http://`` request to it in absolute form; it forwards
the request to its host over a connection of its own, relays the answer, and records the method, URL and body in
:attr:`ForwardProxy.forwarded`. It binds to loopback only, every wait is bounded, and its threads are daemons.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

LIMIT = 30.0
# Headers about the hop to the proxy, not about the request: never forwarded.
_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer", "upgrade", "host"}


@dataclass(frozen=True)
class Forwarded:
    """One request the proxy forwarded: its method, absolute URL and JSON body (``None`` without one)."""

    method: str
    url: str
    body: Any


class ForwardProxy:
    """An HTTP forward proxy on 127.0.0.1 (plain ``http://`` targets only)."""

    def __init__(self) -> None:
        """Start serving on a free port; use as a context manager or call :meth:`close`."""
        self.forwarded: list[Forwarded] = []
        self._lock = threading.Lock()
        self._server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.owner = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="forward-proxy", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def bodies(self) -> list[Any]:
        """The JSON bodies of the requests forwarded so far."""
        with self._lock:
            return [entry.body for entry in self.forwarded]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(LIMIT)

    def __enter__(self) -> ForwardProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _record(self, entry: Forwarded) -> None:
        with self._lock:
            self.forwarded.append(entry)


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: ForwardProxy


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer
    timeout = LIMIT

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self._forward(b"")

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        length = int(self.headers.get("Content-Length") or 0)
        self._forward(self.rfile.read(length) if length else b"")

    def _forward(self, body: bytes) -> None:
        target = urlsplit(self.path)
        if target.scheme != "http" or not target.hostname:
            self.send_error(400, "this proxy forwards absolute http:// URLs only")
            return
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        self.server.owner._record(Forwarded(self.command, self.path, parsed))
        headers = {name: value for name, value in self.headers.items() if name.lower() not in _HOP}
        path = target.path + (f"?{target.query}" if target.query else "")
        upstream = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=LIMIT)
        try:
            upstream.request(self.command, path or "/", body=body or None, headers=headers)
            answer = upstream.getresponse()
            content = answer.read()
        finally:
            upstream.close()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in _HOP and name.lower() not in ("content-length", "transfer-encoding"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)
        self.wfile.flush()

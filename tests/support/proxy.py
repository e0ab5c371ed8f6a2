"""An HTTP proxy on loopback, and TLS certificates for loopback servers (trustme).

:class:`LoopbackProxy` takes ``CONNECT`` (a tunnel to the host and port it names) and absolute-URL requests (passed on
as they are to the host they name), over plain TCP or, given a TLS context, as an ``https://`` proxy. It records each
request line (``asked``), refuses or stalls the next ``CONNECT``s when told (``on_connect``), and can drip what comes
back from the target one byte at a time after the first ``fast`` bytes of each connection (``drip``). Each relayed
connection that ended is recorded in ``ended`` (what it sent back, and whether the client hung up first). Threads are
daemons, every wait is bounded, and it binds to loopback only.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import trustme

from tests.support.loopback import LIMIT, Dripped


class Certificates:
    """A certificate authority of its own, its PEM at ``ca_file`` (for ``SSL_CERT_FILE``), and server contexts with
    certificates it signs for 127.0.0.1, ::1 and localhost. Written again at the same path, it is rotated in place."""

    def __init__(self, ca_file: Path) -> None:
        self.ca, self.ca_file = trustme.CA(), ca_file
        with open(ca_file, "wb") as pem:  # in place: the same file (inode), new contents
            pem.write(self.ca.cert_pem.bytes())

    def server(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1", "::1", "localhost").configure_cert(context)
        return context


Refusal = int | threading.Event
"""What the proxy does with a ``CONNECT``: answer that status (a refusal), or hold it unanswered until the event is
set, then hang up."""


class LoopbackProxy:
    """An HTTP (or, with ``tls``, https) proxy on 127.0.0.1; use as a context manager or call :meth:`close`."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self._listener.getsockname()[1]}"
        self.address = self.url.split("//")[1]
        self.asked: list[str] = []  # every request line read: "CONNECT host:port", "POST http://host:port/path"
        self.on_connect: list[Refusal] = []  # what to do with the next CONNECTs, in order (else: tunnel)
        self.drip: float | None = None  # seconds between the bytes sent back, past the first ``fast`` of a connection
        self.fast = 0
        self.ended: list[Dripped] = []  # each relayed connection that ended: bytes sent back, whether the client left
        self._changed = threading.Condition()
        threading.Thread(target=self._accept, name="loopback-proxy", daemon=True).start()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = LIMIT) -> bool:
        """Wait until ``predicate`` (of this proxy's records) holds, at most ``timeout`` s; whether it holds."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> LoopbackProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), name="loopback-proxy", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with contextlib.ExitStack() as stack:
            stack.callback(client.close)
            client.settimeout(LIMIT)
            if self._tls is not None:
                try:
                    client = self._tls.wrap_socket(client, server_side=True)
                except OSError:
                    return
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                if not (received := client.recv(65536)):
                    return
                head += received
            method, target = head.split(b" ", 2)[:2]
            with self._changed:
                self.asked.append(f"{method.decode()} {target.decode()}")
                refusal = self.on_connect.pop(0) if method == b"CONNECT" and self.on_connect else None
                self._changed.notify_all()
            if isinstance(refusal, threading.Event):
                refusal.wait(LIMIT)
                return
            if refusal is not None:
                client.sendall(b"HTTP/1.1 %d Refused\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % refusal)
                return
            if method == b"CONNECT":
                host, port = target.decode().rsplit(":", 1)
                upstream = socket.create_connection((host.strip("[]"), int(port)), timeout=LIMIT)
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                first = head.split(b"\r\n\r\n", 1)[1]
            else:  # an absolute URL: the request goes on as it is
                host, port = target.decode().split("/")[2].rsplit(":", 1)
                upstream, first = socket.create_connection((host, int(port)), timeout=LIMIT), head
            stack.callback(upstream.close)
            if first:
                upstream.sendall(first)
            self._relay(client, upstream)

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        """Pass bytes both ways until either side ends; what comes back is dripped as told."""
        sent, hung_up, deadline = 0, False, time.monotonic() + LIMIT
        while time.monotonic() < deadline:
            pending = isinstance(client, ssl.SSLSocket) and client.pending()
            readable = [client] if pending else select.select([client, upstream], [], [], 0.1)[0]
            try:
                if client in readable:
                    if not (received := client.recv(65536)):
                        hung_up = True
                        break
                    upstream.sendall(received)
                if upstream in readable:
                    if not (received := upstream.recv(65536)):
                        break
                    at_once = received if self.drip is None else received[: max(0, self.fast - sent)]
                    client.sendall(at_once)
                    sent += len(at_once)
                    for byte in received[len(at_once) :]:
                        time.sleep(self.drip or 0)
                        client.sendall(bytes([byte]))
                        sent += 1  # byte by byte: what was sent to the client before it left is counted
            except OSError:
                hung_up = True  # the client hung up (or reset) while bytes were still going to it
                break
        with self._changed:
            self.ended.append(Dripped(sent, hung_up))
            self._changed.notify_all()

"""A loopback stand-in for the Membase REST routes the store uses, for the many-users benchmark
(``scenarios/many_users.py``), which also takes its fixed search answer from here.

Run as its own process so its threads and CPU time stay out of the client's figures::

    python benchmarks/_server.py LATENCY_MS

It prints ``PORT <n>`` once listening on 127.0.0.1, then serves until its standard input closes
(or 15 minutes pass). HTTP/1.1 with keep-alive and Content-Length on every answer, TCP_NODELAY, and
one answer per write, so neither Nagle nor delayed ACKs add latency. Every accepted TCP connection
is counted, and so is every one open now (``open_now``, back down as soon as the client closes it);
``GET /_stats`` answers the counts and ``POST /_reset`` zeroes them (the connections that carry these
control requests are counted in neither).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LIFETIME_S = 900.0


def search_answer(query: str = "", fact: str = "we chose Postgres for the ledger.") -> bytes:
    """A fixed, small search answer: three passages from one Memory (what a real search answers)."""
    return json.dumps(
        {
            "query": query,
            "results": [
                {
                    "content": f"Passage {i}: {fact}",
                    "container": "ctr_main",
                    "container_name": "Main",
                    "score": 0.9 - i / 10,
                    "source": "episode",
                    "title": "",
                }
                for i in range(3)
            ],
            "containers": [{"id": "ctr_main", "name": "Main"}],
        }
    ).encode()


SEARCH_ANSWER = search_answer()
CONTAINERS_ANSWER = json.dumps({"containers": [{"id": "ctr_main", "name": "Main"}]}).encode()


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connections = 0
        self.requests = 0
        self.open_now = 0
        self.open_peak = 0

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "connections": self.connections,
                "requests": self.requests,
                "open_now": self.open_now,
                "open_peak": self.open_peak,
            }

    def reset(self) -> None:
        with self.lock:
            self.connections = self.requests = 0
            self.open_peak = self.open_now


STATS = Stats()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    latency = 0.003
    control = False

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with STATS.lock:
            STATS.connections += 1
            STATS.open_now += 1
            STATS.open_peak = max(STATS.open_peak, STATS.open_now)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if not self.control:  # a control connection left the counts when its request was read
                with STATS.lock:
                    STATS.open_now -= 1

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/_stats":
            self._control()
            self._answer(200, json.dumps(STATS.snapshot()).encode())
        elif self.path.split("?")[0] == "/v1/containers":
            self._membase(CONTAINERS_ANSWER)
        else:
            self._answer(404, b'{"error": {"code": "not_found", "message": "no route"}}')

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.path == "/_reset":
            self._control()
            STATS.reset()
            self._answer(200, b"{}")
        elif self.path == "/v1/search":
            self._membase(SEARCH_ANSWER)
        else:
            self._answer(404, b'{"error": {"code": "not_found", "message": "no route"}}')

    def _control(self) -> None:
        if not self.control:
            self.control = True
            with STATS.lock:
                STATS.connections -= 1
                STATS.open_now -= 1

    def _membase(self, body: bytes) -> None:
        with STATS.lock:
            STATS.requests += 1
        time.sleep(self.latency)
        self._answer(200, body)

    def _answer(self, status: int, body: bytes) -> None:
        reason = "OK" if status == 200 else "Not Found"
        head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        if self.close_connection:
            head += "Connection: close\r\n"
        self.wfile.write(head.encode("ascii") + b"\r\n" + body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024


def main() -> None:
    Handler.latency = float(sys.argv[1]) / 1000 if len(sys.argv) > 1 else 0.003
    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    print(f"PORT {server.server_address[1]}", flush=True)
    # Serve until the parent closes our stdin (or dies), never longer than LIFETIME_S.
    done = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    done.wait(LIFETIME_S)
    server.shutdown()


if __name__ == "__main__":
    main()

"""A loopback stand-in for the two Membase routes a recall uses, run in its own process::

    python benchmarks/_server.py LATENCY_MS

It prints ``PORT <n>`` once listening on 127.0.0.1, then serves until its standard input closes (or 15
minutes pass). ``POST /v1/search`` answers a fixed three-passage body after ``LATENCY_MS``, ``GET
/v1/containers`` one Memory. HTTP/1.1 keep-alive, Content-Length, TCP_NODELAY and one write per answer, so
neither Nagle nor delayed ACKs add latency. ``GET /_stats`` answers the TCP connections accepted, the ones
open now and the Membase requests answered; ``POST /_reset`` zeroes them. The connections that carry these
two control requests are counted in neither.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LIFETIME_S = 900.0
FACT = "we chose Postgres for the ledger."
SEARCH_ANSWER = json.dumps(
    {
        "results": [
            {
                "content": f"Passage {i}: {FACT}",
                "container": "ctr_main",
                "container_name": "Main",
                "score": 0.9 - i / 10,
            }
            for i in range(3)
        ],
        "containers": [{"id": "ctr_main", "name": "Main"}],
    }
).encode()
CONTAINERS_ANSWER = json.dumps({"containers": [{"id": "ctr_main", "name": "Main"}]}).encode()
NOT_FOUND = b'{"error": {"code": "not_found", "message": "no route"}}'

_lock = threading.Lock()
_stats = {"connections": 0, "open_now": 0, "requests": 0}


def _count(**changes: int) -> None:
    with _lock:
        for key, change in changes.items():
            _stats[key] += change


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    latency = 0.0
    control = False  # set once this connection carried a control request: it then leaves the counts

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _count(connections=1, open_now=1)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if not self.control:
                _count(open_now=-1)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/_stats":
            self._control()
            with _lock:
                self._answer(200, json.dumps(_stats).encode())
        elif self.path.split("?")[0] == "/v1/containers":
            self._membase(CONTAINERS_ANSWER)
        else:
            self._answer(404, NOT_FOUND)

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/_reset":
            self._control()
            with _lock:
                _stats["connections"] = _stats["requests"] = 0
            self._answer(200, b"{}")
        elif self.path == "/v1/search":
            self._membase(SEARCH_ANSWER)
        else:
            self._answer(404, NOT_FOUND)

    def _control(self) -> None:
        if not self.control:
            self.control = True
            _count(connections=-1, open_now=-1)

    def _membase(self, body: bytes) -> None:
        _count(requests=1)
        time.sleep(self.latency)
        self._answer(200, body)

    def _answer(self, status: int, body: bytes) -> None:
        head = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}", "Content-Type: application/json"]
        head += [f"Content-Length: {len(body)}", *(["Connection: close"] if self.close_connection else [])]
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024


def main() -> None:
    Handler.latency = float(sys.argv[1]) / 1000 if len(sys.argv) > 1 else 0.0
    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    print(f"PORT {server.server_address[1]}", flush=True)
    watcher = threading.Thread(target=sys.stdin.read, daemon=True)  # the parent closes our stdin when done
    watcher.start()
    watcher.join(LIFETIME_S)
    server.shutdown()


if __name__ == "__main__":
    main()

"""Section 9: how long one attempt lasts when a server stalls it, over real sockets on 127.0.0.1. The library bounds
each attempt in its socket (every connect, read and write waits at most the time left to it); this section times the
attempt from the caller's side, for each way a server can hold it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import membase
from common import Plan, Section, fmt, median

from membase_strands import MembaseMemoryStore

ATTEMPT_S = 2.0  # request_timeout: longer than a stalled connect's first SYN resend (about 1 s on Linux)
SLACK_S = 0.5
KEY = "mb_benchmark_attempt_key"


class _Stalling:
    """A listener on 127.0.0.1 that holds each connection one way (``how``): its backlog full (connects stall), the
    backlog freed after a second and then headers dripped, headers dripped, or a body dripped."""

    def __init__(self, how: str) -> None:
        self.how, self.stop = how, threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0 if how.startswith("connect") else 16)
        self.filler = socket.create_connection(self.listener.getsockname()) if how.startswith("connect") else None
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        if self.how == "connect stalls":
            return  # the backlog stays full: nothing is ever accepted
        if self.how == "connect stalls, then headers drip":
            self.stop.wait(1.0)  # the stalled connect's SYN is sent again about a second in
            self.listener.accept()[0].close()  # the filler: its place is free now
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._drip, args=(connection,), daemon=True).start()

    def _drip(self, connection: socket.socket) -> None:
        with connection:
            received = b""
            while b"\r\n\r\n" not in received and (chunk := connection.recv(65536)):
                received += chunk
            start = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            if self.how == "body drips":
                start += b"Content-Length: 100000\r\n\r\n{"
            try:
                connection.sendall(start)
                while not self.stop.wait(0.1):
                    connection.sendall(b" " if self.how == "body drips" else b"X-Drip: still coming\r\n")
            except OSError:
                return  # the client hung up

    def close(self) -> None:
        self.stop.set()
        if self.filler is not None:
            self.filler.close()
        self.listener.close()


def _attempt_s(how: str, call: Callable[[MembaseMemoryStore], Any]) -> float:
    server = _Stalling(how)
    store = MembaseMemoryStore(api_key=KEY, base_url=server.url, request_timeout=ATTEMPT_S, recall_timeout=60.0)
    started = time.perf_counter()
    try:
        call(store)
    except membase.APITimeoutError:
        pass
    finally:
        seconds = time.perf_counter() - started
        server.close()
        store.close()
    return seconds


def attempt_bounds(plan: Plan) -> Section:
    section = Section(
        9,
        "Attempt bounds",
        f"One recall (one attempt, `request_timeout={ATTEMPT_S:g}`, `recall_timeout` far longer) against a server on "
        "127.0.0.1 that holds it: a full listen backlog (the connect stalls), a full backlog freed after a second and "
        "then header lines dripped every 0.1 s, header lines dripped, a body dripped a byte every 0.1 s. Each way "
        f"{plan.stall_trials} time(s); the seconds from the call to its timeout, medians and worst.",
        ["server", "attempt median s", "worst s"],
    )
    worst_of_all = 0.0
    for how in ("connect stalls", "connect stalls, then headers drip", "headers drip", "body drips"):
        runs = [_attempt_s(how, lambda store: asyncio.run(store.search("ledger"))) for _ in range(plan.stall_trials)]
        worst_of_all = max(worst_of_all, *runs)
        section.row(how, fmt(median(runs)), fmt(max(runs)))
    section.target(
        f"every attempt ends within request_timeout + {SLACK_S:g} s",
        worst_of_all <= ATTEMPT_S + SLACK_S,
        f"worst {fmt(worst_of_all)} s against {ATTEMPT_S + SLACK_S:g} s",
    )
    return section


SECTIONS = (attempt_bounds,)

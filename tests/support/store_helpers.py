"""Helpers shared by the store, recall, container and capture tests (not by the harness itself)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx

from tests.support.fake_membase import FakeMembase, Responder

RECALL_THREAD = "membase-recall["
QUESTION = "Which database did we choose for the ledger?"
FACT = "We chose Postgres for the ledger."


def routed(fake: FakeMembase) -> Responder:
    """A responder that answers as the fake normally would (for use after a hang or a delay)."""

    def respond(request: httpx.Request) -> httpx.Response:
        raw = request.content
        body = json.loads(raw) if raw else None
        return fake._route(request.method, request.url.path, body, dict(request.url.params))

    return respond


def delayed(fake: FakeMembase, seconds: float) -> Responder:
    """A responder that sleeps ``seconds`` and then answers normally."""
    answer = routed(fake)

    def respond(request: httpx.Request) -> httpx.Response:
        time.sleep(seconds)
        return answer(request)

    return respond


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, step: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def membase_threads(prefix: str = "membase-") -> list[threading.Thread]:
    """The live threads the library started (their names start with ``prefix``)."""
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


class Gates:
    """Hands out ``threading.Event`` gates and opens every one of them at the end of a test."""

    def __init__(self) -> None:
        self._events: list[threading.Event] = []

    def new(self) -> threading.Event:
        event = threading.Event()
        self._events.append(event)
        return event

    def open_all(self) -> None:
        for event in self._events:
            event.set()
        # Let the library's background threads finish so none lingers into the next test.
        wait_until(lambda: not membase_threads(), timeout=5.0)


def gates_fixture() -> Iterator[Gates]:
    """Body of a ``gates`` fixture: yields a :class:`Gates` and opens everything afterwards."""
    gates = Gates()
    try:
        yield gates
    finally:
        gates.open_all()

"""Helpers the tests share: agents over a store, responders, waits, gates, a clock and timers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar
from unittest import mock

import httpx
import membase
import pytest
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore, _client
from membase_strands._io_loop import THREAD_NAME as IO_THREAD
from membase_strands._workers import IDLE_NAME
from membase_strands.testing import InMemoryMembase, Responder, ScriptedModel, Step

T = TypeVar("T")

RECALL_THREAD = "membase-recall["
QUESTION = "Which database did we choose for the ledger?"
FACT = "We chose Postgres for the ledger."


def routed(fake: InMemoryMembase) -> Responder:
    """A responder that answers as the fake normally would (for use after a hang or a delay)."""
    return fake.answer


def delayed(fake: InMemoryMembase, seconds: float) -> Responder:
    """A responder that sleeps ``seconds`` and then answers normally."""
    answer = routed(fake)

    def respond(request: httpx.Request) -> httpx.Response:
        time.sleep(seconds)
        return answer(request)

    return respond


@dataclass
class HostedClients:
    """The HTTP clients hosted stores built while routed (:func:`route_hosted_clients`), in order."""

    blocking: list[httpx.Client] = field(default_factory=list)
    awaited: list[httpx.AsyncClient] = field(default_factory=list)
    base_urls: list[str] = field(default_factory=list)


def route_hosted_clients(
    monkeypatch: pytest.MonkeyPatch, handle: Responder, record: HostedClients | None = None
) -> HostedClients:
    """Send every request of every hosted store built from here on (``api_key=``) to ``handle``.

    Both of a store's clients: the blocking one (tools, writes) and the awaited one on the I/O loop
    (recall). ``handle`` blocks (a hung responder waits on a gate), so the awaited client calls it on a
    thread of its own: one hung request must not hold the loop that every store's recall runs on.
    The clients are recorded in ``record`` (or a new :class:`HostedClients`), which is returned.
    """
    built = record if record is not None else HostedClients()
    for name, builder in _routed_builders(handle, built).items():
        monkeypatch.setattr(_client, name, builder)
    return built


@contextmanager
def hosted_clients_routed(handle: Responder) -> Iterator[HostedClients]:
    """:func:`route_hosted_clients` for code without pytest's ``monkeypatch`` (undone on leaving)."""
    built = HostedClients()
    with contextlib.ExitStack() as patches:
        for name, builder in _routed_builders(handle, built).items():
            patches.enter_context(mock.patch.object(_client, name, builder))
        yield built


def _routed_builders(handle: Responder, built: HostedClients) -> dict[str, Callable[[str], Any]]:
    async def off_the_loop(request: httpx.Request) -> httpx.Response:
        return await asyncio.to_thread(handle, request)

    def blocking(base_url: str) -> httpx.Client:
        built.base_urls.append(base_url)
        built.blocking.append(httpx.Client(base_url=base_url, transport=httpx.MockTransport(handle)))
        return built.blocking[-1]

    def awaited(base_url: str) -> httpx.AsyncClient:
        built.awaited.append(httpx.AsyncClient(base_url=base_url, transport=httpx.MockTransport(off_the_loop)))
        return built.awaited[-1]

    return {"new_http_client": blocking, "new_async_http_client": awaited}


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, step: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


async def until(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` without blocking the event loop until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def membase_threads(prefix: str = "membase-") -> list[threading.Thread]:
    """The library's threads at work whose names start with ``prefix``.

    A worker thread carries the name of the call it runs; an idle worker (waiting for the next call,
    retiring after a few seconds) does no work for anyone and is not counted, nor is the I/O loop's
    thread, which serves every store (and retires once no call and no open connection is left).
    """
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(prefix) and t.name not in (IDLE_NAME, IO_THREAD) and t.is_alive()
    ]


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


def make_agent(
    store: MembaseMemoryStore, script: list[Step] | None = None, **manager_options: Any
) -> tuple[Agent, ScriptedModel]:
    """A real Strands agent with a MemoryManager over ``store`` and a scripted model."""
    model = ScriptedModel(script)
    agent = Agent(model=model, memory_manager=MemoryManager(stores=[store], **manager_options), callback_handler=None)
    return agent, model


def client_of(store: MembaseMemoryStore) -> membase.Membase:
    """The SDK client behind a store, through its gateway: the tests' one window into a store's insides."""
    return store._gateway.client


def result_text(result: dict[str, Any]) -> str:
    """The text of a tool result, its blocks joined by newlines."""
    return "\n".join(item["text"] for item in result["content"] if "text" in item)


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """Call ``fn(*args)``; return its result and the seconds it took."""
    started = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - started


class Clock:
    """A monotonic clock the test moves by hand: call it, or patch it in as a module's ``time``."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.monotonic() if start is None else start
        self.offset = 0.0

    def __call__(self) -> float:
        return self.start + self.offset

    def monotonic(self) -> float:
        return self()

    def advance(self, seconds: float) -> None:
        self.offset += seconds

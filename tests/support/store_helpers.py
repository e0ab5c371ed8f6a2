"""Helpers the tests share: agents over a store, responders, waits, gates, a clock, timers and forked children."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import membase
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore
from membase_strands._background import IDLE_NAME
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

    A thread carries the name of the call it runs; an idle one (waiting for the next call, retiring after a
    few seconds) does no work for anyone and is not counted.
    """
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.name != IDLE_NAME and t.is_alive()]


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
    """The SDK client behind a store's tools, through its gateway: the tests' one window into a store's insides."""
    return store._gateway._client(retry=True)


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


# --- Forked children --------------------------------------------------------------------------------

CHILD_LIMIT = 60.0
"""The longest a test waits for its forked children before it kills them (by their pids) and fails."""


@dataclass
class Child:
    """A forked child at work: its pid and the pipe it reports through."""

    pid: int
    reader: int


def fork_child(work: Callable[[], Any]) -> Child:
    """Fork; the child runs ``work`` and reports its result (or its traceback) as JSON through a pipe.

    The child never returns into pytest: it leaves with ``os._exit`` whatever happens.
    """
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(reader)
            try:
                report: dict[str, Any] = {"result": work()}
            except BaseException:  # noqa: BLE001 - reported to the parent
                report = {"error": traceback.format_exc()}
            data = json.dumps(report).encode()
            while data:
                data = data[os.write(writer, data) :]
        finally:
            os._exit(0)
    os.close(writer)
    return Child(pid, reader)


def child_reports(children: list[Child], timeout: float = CHILD_LIMIT) -> list[dict[str, Any]]:
    """Each child's report, ``{"result": ...}`` or ``{"error": ...}``, in the children's order.

    Waits for all of them at once, for at most ``timeout`` seconds in all: a child that has not reported by
    then is killed by its pid and reported as hung, so a stuck child fails the test instead of hanging the
    suite. Every child is reaped.
    """
    deadline = time.monotonic() + timeout
    data: dict[int, list[bytes]] = {child.reader: [] for child in children}
    open_pipes = set(data)
    try:
        while open_pipes:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select(list(open_pipes), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if chunk:
                    data[fd].append(chunk)
                else:
                    open_pipes.discard(fd)
    finally:
        for child in children:
            os.close(child.reader)
            _reap(child.pid, deadline)
    reports = []
    for child in children:
        if child.reader in open_pipes:
            reports.append({"error": f"the child (pid {child.pid}) hung: no report within {timeout:g} s; killed"})
        else:
            raw = b"".join(data[child.reader])
            reports.append(json.loads(raw) if raw else {"error": f"the child (pid {child.pid}) sent nothing"})
    return reports


def run_in_child(work: Callable[[], Any], timeout: float = CHILD_LIMIT) -> Any:
    """Fork, run ``work`` in the child, and return what it returned; fail if it raised or hung."""
    [report] = child_reports([fork_child(work)], timeout)
    assert "error" not in report, f"the child failed:\n{report['error']}"
    return report["result"]


def _reap(pid: int, deadline: float) -> None:
    """Wait for the child ``pid`` until ``deadline`` (at least a moment), then kill it by its pid."""
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)  # our own child, by its pid
    os.waitpid(pid, 0)


def set_recall_budget(store: MembaseMemoryStore, seconds: float | None) -> None:
    """Give ``store`` another recall budget from its next recall on (the store's own setting, reached directly).

    For a test whose one part is about a short budget and whose other parts are not: a healthy recall that must
    return memory gets a budget a loaded machine cannot run out of.
    """
    store._recall_timeout = seconds


# --- Write budgets and the writes still running ----------------------------------------------------

LONG = 30.0
"""A budget (seconds) a slow, loaded machine cannot run out of, for what a test does not time out on purpose."""


def set_write_budget(target: Any, seconds: float | None) -> None:
    """Give the captured writes of a store (or of a ``WriteRecord``) a new budget from now on.

    For a test that runs one write out of a short budget (the request held by the server) and then needs the
    manager's retry, or a close, to run under a budget a loaded machine cannot run out of.
    """
    record = getattr(target, "_writes", target)
    record._budget = seconds
    if record is not target:
        target._write_timeout = seconds


def settle(futures: Any, timeout: float = LONG) -> None:
    """Wait (bounded) for the futures of writes (``record.running()``, taken while they ran): each settles only
    once its outcome is on record, counted and logged."""
    from concurrent.futures import wait  # here, not at the top: this block is appended to the module

    _, not_done = wait(list(futures), timeout=timeout)
    assert not not_done, f"{len(not_done)} writes still running after {timeout:g} s"


def signalling(event: threading.Event, then: Responder) -> Responder:
    """A responder that sets ``event`` once the request is in (the fake has recorded it), then answers with
    ``then``: a test waits for that moment instead of sleeping."""

    def respond(request: httpx.Request) -> httpx.Response:
        event.set()
        return then(request)

    return respond


def drain_began(caplog: Any) -> Callable[[], bool]:
    """Whether a close (or the exit wait) has reached its wait for the writes still running (caplog at INFO)."""
    return lambda: any("waiting for writes still running" in record.getMessage() for record in caplog.records)


async def close_then_release(store: MembaseMemoryStore, caplog: Any, release: threading.Event) -> None:
    """``store.close()`` on a thread; ``release`` (the held write's gate) once close() waits for that write, so the
    write ends during the close, never before it; returns once close() has."""
    import logging  # here, not at the top: this block is appended to the module

    caplog.set_level(logging.INFO)
    closing = asyncio.ensure_future(asyncio.to_thread(store.close))
    assert await until(drain_began(caplog), timeout=LONG)
    release.set()
    await closing

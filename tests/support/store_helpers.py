"""Helpers the tests share: agents over a store, responders, waits, gates, captured writes and forked children.

Everything here goes through the library's public API: a test watches what a user could watch (requests that
reached Membase, counters, log lines, thread names), never a store's private state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import select
import signal
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import membase
import pytest
from strands import Agent
from strands.memory import MemoryManager
from strands.types.content import Message

from membase_strands import MembaseMemoryStore
from membase_strands._calls import IDLE_NAME
from membase_strands.testing import InMemoryMembase, Responder, ScriptedModel, Step

RECALL_THREAD = "membase-recall["
WRITE_THREAD = "membase-write["
QUESTION = "Which database did we choose for the ledger?"
FACT = "We chose Postgres for the ledger."
GREEN_TEA = "I like green tea."
LISBON = "I live in Lisbon."
MEMORIES = ("POST", "/v1/memories")

LONG = 30.0
"""A budget (seconds) a slow, loaded machine cannot run out of, for what a test does not time out on purpose."""


def sdk_client(fake: InMemoryMembase, **options: Any) -> membase.Membase:
    """A real ``membase.Membase`` client for ``fake``'s account, over its transport; without retries unless
    ``max_retries`` says otherwise, as a store that writes takes one."""
    http = httpx.Client(base_url=fake.base_url, transport=fake.transport)
    options.setdefault("max_retries", 0)
    return membase.Membase(api_key=fake.key, base_url=fake.base_url, http_client=http, **options)


def routed(fake: InMemoryMembase) -> Responder:
    return fake.answer


def delayed(fake: InMemoryMembase, seconds: float) -> Responder:
    answer = routed(fake)

    def respond(request: httpx.Request) -> httpx.Response:
        time.sleep(seconds)
        return answer(request)

    return respond


def signalling(event: threading.Event, then: Responder) -> Responder:
    """Sets ``event`` once the request is in (recorded), then answers with ``then``: a test waits for that."""

    def respond(request: httpx.Request) -> httpx.Response:
        event.set()
        return then(request)

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
    """The library's threads at work (named after their call) whose names start with ``prefix``; not idle ones."""
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
    model = ScriptedModel(script)
    agent = Agent(model=model, memory_manager=MemoryManager(stores=[store], **manager_options), callback_handler=None)
    return agent, model


def sized(head: str, size: int) -> str:
    """A passage of exactly ``size`` characters that starts with ``head``."""
    return (head + " lorem ipsum dolor sit amet" * (size // 10 + 1))[: size - 1] + "."


def result_text(result: dict[str, Any]) -> str:
    return "\n".join(item["text"] for item in result["content"] if "text" in item)


# --- Captured writes --------------------------------------------------------------------------------


def user(text: str) -> Message:
    return {"role": "user", "content": [{"text": text}]}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": [{"text": text}]}


def posted(fake: InMemoryMembase) -> list[str]:
    """The content of every POST /v1/memories this account's key sent, failed or not."""
    return [r.body["content"] for r in fake.sent(*MEMORIES)]


KEY_FIELD = re.compile(r", key=<[^>]*>")
"""The key's hint in a log line (``test_access.py`` checks it): the lines tests read here leave it out."""


def lines(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG, source: str = "") -> list[str]:
    """The messages of the log records at ``level`` or above (of loggers named ``source``...), in order, each
    without the key's hint."""
    return [
        KEY_FIELD.sub("", r.getMessage()) for r in caplog.records if r.levelno >= level and r.name.startswith(source)
    ]


def logged(caplog: pytest.LogCaptureFixture, words: str, level: int = logging.DEBUG) -> Callable[[], int]:
    """How many of the library's log records at ``level`` or above say ``words`` (a predicate for a wait)."""
    return lambda: sum(words in line for line in lines(caplog, level, "membase_strands"))


async def turn_and_flush(agent: Agent, text: str) -> None:
    """One async turn and the flush an async caller owes the manager, as a web handler does it."""
    await agent.invoke_async(text)
    await agent.memory_manager.flush()


async def cancelled_once_sent(write: Awaitable[Any], in_flight: threading.Event) -> None:
    """Run ``write`` and cancel it once its request is in (``in_flight``), as a web server whose client hung up
    would: nobody waits for that request any more, and it goes on in the background."""
    task = asyncio.ensure_future(write)
    assert await until(in_flight.is_set, timeout=LONG)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def drain_began(caplog: pytest.LogCaptureFixture) -> Callable[[], bool]:
    """Whether a close (or the exit wait) has reached its wait for the writes still running (caplog at INFO)."""
    return lambda: logged(caplog, "waiting for writes still running")() > 0


class Ticker:
    """A task that ticks every 10 ms while the test awaits something else, and calls ``release`` at tick
    ``release_after``. Only a loop that is not blocked runs it."""

    def __init__(self, release_after: int | None = None, release: Callable[[], None] = lambda: None) -> None:
        self.ticks = 0
        self._release_after, self._release = release_after, release
        self._task: asyncio.Task[None] | None = None

    def __enter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.ticks += 1
            if self.ticks == self._release_after:
                self._release()


def unreferenced(work: Callable[[], Awaitable[Any]]) -> threading.Event:
    """Run ``work()`` in a task that nothing references (a server's lifespan task, say); the event is set once
    ``work()`` has returned. The task is not kept here: only what it waits on can keep it alive."""
    done = threading.Event()

    async def run() -> None:
        await work()
        done.set()

    asyncio.get_running_loop().create_task(run())
    return done


# --- Forked children --------------------------------------------------------------------------------

CHILD_LIMIT = 60.0
"""The longest a test waits for its forked children before it kills them (by their pids) and fails."""


@dataclass
class Child:
    pid: int
    reader: int


def fork_child(work: Callable[[], Any]) -> Child:
    """Fork; the child runs ``work``, reports its result (or traceback) as JSON through a pipe, and ``os._exit``s."""
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
    """Each child's report, ``{"result": ...}`` or ``{"error": ...}``, in order, waiting ``timeout`` s in all: a child
    that has not reported by then is killed by its pid and reported as hung. Every child is reaped."""
    deadline = time.monotonic() + timeout
    data = {child.reader: b"" for child in children}
    open_pipes = set(data)
    try:
        while open_pipes and (left := deadline - time.monotonic()) > 0:
            for fd in select.select(list(open_pipes), [], [], left)[0]:
                chunk = os.read(fd, 65536)
                data[fd] += chunk
                if not chunk:
                    open_pipes.discard(fd)
    finally:
        for child in children:
            os.close(child.reader)
            _reap(child.pid, deadline)
    said = {c.reader: data[c.reader] if c.reader not in open_pipes else b"" for c in children}
    hung, silent = "the child (pid {}) hung: no report within {:g} s; killed", "the child (pid {}) sent nothing"
    why = {c.reader: (hung if c.reader in open_pipes else silent).format(c.pid, timeout) for c in children}
    return [json.loads(said[c.reader]) if said[c.reader] else {"error": why[c.reader]} for c in children]


def run_in_child(work: Callable[[], Any], timeout: float = CHILD_LIMIT) -> Any:
    """Fork, run ``work`` in the child, and return what it returned; fail if it raised or hung."""
    [report] = child_reports([fork_child(work)], timeout)
    assert "error" not in report, f"the child failed:\n{report['error']}"
    return report["result"]


def _reap(pid: int, deadline: float) -> None:
    """Wait for the child ``pid`` until ``deadline`` (at least a moment), then kill it by its pid."""
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)  # our own child, by its pid
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)

"""_threads: blocking calls on daemon threads, awaited with a budget from any event loop."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from concurrent.futures import Future

import pytest

from membase_strands._threads import start_daemon, wait_for_future
from tests.support.store_helpers import wait_until

SLACK = 2.0

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")


@pytest.fixture
def thread_errors(monkeypatch) -> list[BaseException]:
    """Exceptions that escape any thread (they would otherwise only be printed)."""
    caught: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: caught.append(args.exc_value))
    return caught


def test_start_daemon_runs_on_a_named_daemon_thread():
    seen: dict[str, object] = {}

    def work() -> int:
        me = threading.current_thread()
        seen.update(name=me.name, daemon=me.daemon, main=me is threading.main_thread())
        return 42

    future = start_daemon(work, name="membase-test[unit]")

    assert future.result(timeout=5) == 42
    assert seen == {"name": "membase-test[unit]", "daemon": True, "main": False}


def test_start_daemon_hands_the_error_to_the_future(thread_errors):
    future = start_daemon(lambda: 1 / 0, name="membase-test[error]")

    with pytest.raises(ZeroDivisionError):
        future.result(timeout=5)
    assert thread_errors == []


def test_start_daemon_carries_the_callers_context_variables():
    token = request_id.set("turn-7")
    try:
        future = start_daemon(request_id.get, name="membase-test[context]")
    finally:
        request_id.reset(token)

    assert future.result(timeout=5) == "turn-7"


def test_start_daemon_can_settle_a_future_the_caller_made():
    shared: Future[str] = Future()
    returned = start_daemon(lambda: "settled", name="membase-test[given]", future=shared)

    assert returned is shared
    assert shared.result(timeout=5) == "settled"


def test_wait_for_future_works_from_two_event_loops_in_turn():
    def slow(value: str) -> str:
        time.sleep(0.05)
        return value

    first = asyncio.run(wait_for_future(start_daemon(lambda: slow("one"), name="membase-test[1]"), 5.0))
    second = asyncio.run(wait_for_future(start_daemon(lambda: slow("two"), name="membase-test[2]"), 5.0))

    assert (first, second) == ("one", "two")


def test_two_loops_can_wait_for_the_same_future_at_once(gates):
    gate = gates.new()
    future = start_daemon(lambda: gate.wait(5) and "shared", name="membase-test[shared]")
    results: list[object] = []

    def waiter() -> None:
        results.append(asyncio.run(wait_for_future(future, 5.0)))

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    gate.set()
    for thread in threads:
        thread.join(5)

    assert results == ["shared", "shared"]


def test_an_already_finished_future_is_returned_at_once():
    future = start_daemon(lambda: "ready", name="membase-test[ready]")
    future.result(timeout=5)

    assert asyncio.run(wait_for_future(future, 0.001)) == "ready"


def test_wait_for_future_re_raises_the_threads_error():
    def fail() -> None:
        raise LookupError("not here")

    with pytest.raises(LookupError, match="not here"):
        asyncio.run(wait_for_future(start_daemon(fail, name="membase-test[fail]"), 5.0))


def test_no_timeout_waits_as_long_as_it_takes():
    def slow() -> str:
        time.sleep(0.4)
        return "done"

    assert asyncio.run(wait_for_future(start_daemon(slow, name="membase-test[slow]"), None)) == "done"


def test_a_timed_out_wait_leaves_the_thread_running_and_its_late_end_raises_nowhere(gates, thread_errors, caplog):
    caplog.set_level(logging.DEBUG)
    gate = gates.new()
    finished = threading.Event()

    def late() -> str:
        gate.wait(10)
        finished.set()
        return "late"

    future = start_daemon(late, name="membase-test[late]")
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(wait_for_future(future, 0.2))
    # asyncio.run did not wait for the thread to finish: it is a daemon thread, not an executor's.
    assert time.monotonic() - started < 0.2 + SLACK
    assert not future.done()
    assert any(t.name == "membase-test[late]" and t.is_alive() for t in threading.enumerate())

    # It completes after its loop has closed: the wake-up finds the loop gone and stays quiet.
    gate.set()
    assert finished.wait(5)
    assert future.result(timeout=5) == "late"
    assert wait_until(lambda: not any(t.name == "membase-test[late]" for t in threading.enumerate()))
    assert thread_errors == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_timed_out_wait_on_a_live_loop_ignores_the_late_answer(gates, caplog):
    caplog.set_level(logging.DEBUG)
    gate = gates.new()
    future = start_daemon(lambda: gate.wait(10) and "late", name="membase-test[live]")

    with pytest.raises(asyncio.TimeoutError):
        await wait_for_future(future, 0.2)
    gate.set()
    assert await asyncio.wrap_future(future) == "late"
    await asyncio.sleep(0.05)  # let the thread's wake-up callback run on this loop

    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_waiting_does_not_block_the_event_loop():
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        await wait_for_future(start_daemon(lambda: time.sleep(0.3), name="membase-test[block]"), 5.0)
    finally:
        ticker.cancel()

    assert ticks >= 5


def test_a_thread_that_cannot_start_raises_and_settles_the_future_so_nobody_waits_forever(monkeypatch):
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name == "membase-test[refused]":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    shared: Future[str] = Future()

    with pytest.raises(RuntimeError, match="can't start new thread"):
        start_daemon(lambda: "never", name="membase-test[refused]", future=shared)

    assert shared.done()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        shared.result(timeout=0)

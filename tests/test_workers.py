"""_workers: blocking calls on persistent daemon worker threads, awaited with a budget from any event loop.

The first part drives the shared pool through ``start_daemon`` / ``wait_for_future`` as the store does;
the second drives a pool of its own (``WorkerPool``), so its threads can be counted and its idle time
made short; the last part runs the store through a real ``strands.Agent`` on top of the workers.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import signal
import threading
import time
import weakref
from concurrent.futures import Future

import httpx
import pytest

from membase_strands._workers import IDLE_NAME, IDLE_SECONDS, WorkerPool, start_daemon, wait_for_future, worker_threads
from membase_strands.testing import InMemoryMembase, hang
from tests.support.store_helpers import (
    FACT,
    QUESTION,
    RECALL_THREAD,
    make_agent,
    membase_threads,
    routed,
    timed,
    wait_until,
)

SLACK = 2.0  # loaded 2-core machines
BUDGET = 0.3
KEEP = 10.0  # idle seconds for the pools made here: far longer than any test waits between two calls

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
    pool = WorkerPool()  # no idle worker: the call needs a new thread
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name == "membase-test[refused]":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    shared: Future[str] = Future()

    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool.submit(lambda: "never", name="membase-test[refused]", future=shared)

    assert shared.done()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        shared.result(timeout=0)


def test_a_worker_carries_the_name_of_the_call_it_runs_and_the_idle_name_between_calls(gates):
    pool = WorkerPool(idle_seconds=KEEP)
    gate = gates.new()
    running = threading.Event()

    def call() -> str:
        running.set()
        gate.wait(5)
        return threading.current_thread().name

    future = pool.submit(call, name="membase-recall[named]")
    assert running.wait(5)
    (worker,) = [t for t in threading.enumerate() if t.name == "membase-recall[named]"]
    gate.set()

    assert future.result(timeout=5) == "membase-recall[named]"
    assert wait_until(lambda: worker.name == IDLE_NAME)
    assert worker.is_alive() and worker.daemon


# --- The pool: reuse, growth, retirement ---------------------------------------------------------


def test_a_waiting_worker_takes_the_next_call_instead_of_a_new_thread():
    pool = WorkerPool(idle_seconds=KEEP)
    first = pool.submit(threading.get_ident, name="membase-test[first]").result(timeout=5)
    assert wait_until(lambda: pool.idle == 1)

    second = pool.submit(threading.get_ident, name="membase-test[second]").result(timeout=5)

    assert second == first
    assert pool.threads == 1


def test_the_pool_grows_while_every_worker_is_busy():
    pool = WorkerPool(idle_seconds=KEEP)
    # Each call returns only once all four run at the same time: four busy workers, or a broken barrier.
    together = threading.Barrier(4, timeout=10.0)

    def call() -> int:
        together.wait()
        return threading.get_ident()

    futures = [pool.submit(call, name=f"membase-test[grow-{i}]") for i in range(4)]

    assert len({future.result(timeout=15) for future in futures}) == 4
    assert pool.threads == 4


def test_a_call_never_waits_behind_a_hung_one(gates):
    pool = WorkerPool(idle_seconds=KEEP)
    hung_gate = gates.new()
    hung_started = threading.Event()

    def hung() -> str:
        hung_started.set()
        hung_gate.wait(10)
        return "late"

    held = pool.submit(hung, name="membase-test[hung]")
    assert hung_started.wait(5)

    assert pool.submit(lambda: "answered", name="membase-test[next]").result(timeout=5) == "answered"
    assert not held.done()
    assert pool.threads == 2

    hung_gate.set()
    assert held.result(timeout=5) == "late"


def test_idle_workers_retire_and_no_thread_is_left():
    pool = WorkerPool(idle_seconds=0.2)
    together = threading.Barrier(3, timeout=10.0)

    def call() -> threading.Thread:
        together.wait()
        return threading.current_thread()

    workers = [pool.submit(call, name=f"membase-test[retire-{i}]") for i in range(3)]
    threads = [future.result(timeout=15) for future in workers]
    assert pool.threads == 3

    assert wait_until(lambda: pool.threads == 0, timeout=10.0)
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()
    # A call after they all retired starts a worker again.
    assert pool.submit(lambda: "again", name="membase-test[again]").result(timeout=5) == "again"


def test_a_worker_keeps_nothing_of_a_call_once_it_has_ended():
    """An idle worker must not keep a store (and its client and sockets) alive through the call it ran."""

    class Store:
        pass

    pool = WorkerPool(idle_seconds=KEEP)
    store = Store()
    ref = weakref.ref(store)

    def call(held: Store = store) -> bool:  # the call holds the store, as the store's own calls do
        return ref() is held

    token = request_id.set(store)  # type: ignore[arg-type]  # the context copy holds it too
    try:
        future = pool.submit(call, name="membase-test[keep-nothing]")
    finally:
        request_id.reset(token)
    assert future.result(timeout=5) is True
    assert wait_until(lambda: pool.idle == 1)

    del store, call, future
    assert ref() is None  # freed by reference counting alone, while the worker that ran the call waits
    assert pool.threads == 1


def test_each_call_runs_in_its_own_callers_context_on_a_reused_worker():
    pool = WorkerPool(idle_seconds=KEEP)

    def read_then_set() -> tuple[str, int]:
        seen = request_id.get()
        request_id.set("set inside the call")  # stays inside that call's copy of the context
        return seen, threading.get_ident()

    token = request_id.set("turn-1")
    try:
        first, worker = pool.submit(read_then_set, name="membase-test[ctx-1]").result(timeout=5)
    finally:
        request_id.reset(token)
    assert wait_until(lambda: pool.idle == 1)
    second, same_worker = pool.submit(read_then_set, name="membase-test[ctx-2]").result(timeout=5)

    assert (first, second) == ("turn-1", "none")
    assert same_worker == worker
    assert request_id.get() == "none"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no os.fork()")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_starts_its_own_workers_instead_of_waiting_for_the_parents():
    pool = WorkerPool(idle_seconds=KEEP)
    pool.submit(lambda: None, name="membase-test[before-fork]").result(timeout=5)
    assert wait_until(lambda: pool.idle == 1)  # a worker waits for work; in a child its thread does not exist

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            code = 0 if pool.submit(lambda: "child", name="membase-test[child]").result(timeout=5) == "child" else 1
        except BaseException:  # noqa: BLE001 - reported through the exit code
            code = 2
        finally:
            os._exit(code)
    status = wait_for_child(pid, timeout=30.0)

    assert status == 0, "the child's call never ran: it went to a worker of the parent's"
    assert pool.submit(lambda: "parent", name="membase-test[parent]").result(timeout=5) == "parent"


def wait_for_child(pid: int, timeout: float) -> int | None:
    """The child's exit code, or ``None`` (and the child killed) if it did not end within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


# --- The store on the workers, through a real Agent ----------------------------------------------


def serving_threads(fake: InMemoryMembase) -> list[threading.Thread]:
    """Records the thread that sends each search; the fake answers as usual."""
    seen: list[threading.Thread] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(threading.current_thread())
        return fake.answer(request)

    fake.always("POST", "/v1/search", respond)
    return seen


def test_consecutive_recalls_run_on_one_reused_worker_not_a_thread_each(fake, make_store):
    fake.remember(FACT)
    seen = serving_threads(fake)
    store = make_store()
    agent, model = make_agent(store)

    for turn in range(5):
        agent(QUESTION)
        assert f"[Main] {FACT}" in (model.memory_block(turn) or "")
        assert wait_until(lambda: seen[-1].name == IDLE_NAME)  # back in the pool before the next turn

    assert len(seen) == 5
    assert len(set(seen)) == 1, f"{len(set(seen))} threads served 5 recalls one after another"


def test_a_late_request_on_a_worker_never_holds_a_synchronous_call(fake, make_store, gates):
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", lambda request: fake.answer(request), hang(stall, then=routed(fake)))
    store = make_store(recall_timeout=BUDGET)
    agent, model = make_agent(store)
    agent(QUESTION)  # a healthy turn first: its worker waits in the pool for the next call
    assert f"[Main] {FACT}" in (model.memory_block() or "")

    _, elapsed = timed(agent, QUESTION)  # asyncio.run of this call must not wait for the worker

    assert elapsed < BUDGET + SLACK
    assert model.memory_block() is None
    assert len(membase_threads(f"{RECALL_THREAD}{store.name}]")) == 1  # the late request still runs
    stall.set()
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1)
    agent(QUESTION)
    assert f"[Main] {FACT}" in (model.memory_block() or "")


def test_after_a_stall_ends_the_workers_retire_and_no_thread_is_left(fake, make_store, gates):
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall, then=routed(fake)))
    store = make_store(recall_timeout=BUDGET)
    agent, _ = make_agent(store)
    agent(QUESTION)
    assert worker_threads() >= 1

    stall.set()
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1)

    # Bounded by the idle time plus a generous margin for a loaded machine.
    assert wait_until(lambda: worker_threads() == 0, timeout=IDLE_SECONDS + 10.0)
    assert not membase_threads()


def test_a_pool_without_idle_time_starts_a_thread_per_call():
    pool = WorkerPool(idle_seconds=0)
    first = pool.submit(threading.current_thread, name="membase-test[once-1]").result(timeout=5)
    first.join(5)  # it retires as soon as its call ends

    second = pool.submit(threading.current_thread, name="membase-test[once-2]").result(timeout=5)

    assert not first.is_alive()
    assert second is not first
    second.join(5)
    assert pool.threads == 0


async def test_a_wait_cancelled_within_its_budget_leaves_nothing_behind_on_the_loop(gates):
    loop = asyncio.get_running_loop()
    problems: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: problems.append(context))
    gate = gates.new()
    future = start_daemon(lambda: gate.wait(10) and "late", name="membase-test[cancelled]")

    waiting = asyncio.create_task(wait_for_future(future, 0.2))
    await asyncio.sleep(0)  # the task is now waiting
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.4)  # past the budget: its timer, had it stayed, would have fired by now
    gate.set()
    assert await asyncio.wrap_future(future) == "late"
    await asyncio.sleep(0.05)  # the worker's wake-up reaches this loop

    assert problems == []
    assert not future.cancelled()

"""_background: the library's daemon threads, capped and retiring when idle, awaited with a budget from any loop.

The first part drives ``submit`` / ``wait_for_future`` as the store does; the second counts threads on a set of
threads of the test's own (the ``threads`` fixture), with a low cap or a short idle time where that is what is
tested; the last part runs the store through a real ``strands.Agent`` on top of them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import threading
import weakref

import httpx
import pytest

from membase_strands import MembaseRecallTimeout, _background
from membase_strands._background import IDLE_NAME, submit, threads_alive, wait_for_future
from membase_strands.testing import InMemoryMembase, hang
from tests.support.store_helpers import (
    FACT,
    QUESTION,
    RECALL_THREAD,
    make_agent,
    membase_threads,
    routed,
    run_in_child,
    set_recall_budget,
    wait_until,
)

BUDGET = 0.3  # for the tests about a budget: what must happen within it is held back by a gate, not by the clock
LONG = 30.0  # every other wait: a loaded machine cannot run out of it
KEEP = 10.0  # idle seconds for the threads made here: far longer than any test waits between two calls

request_id: contextvars.ContextVar[object] = contextvars.ContextVar("request_id", default="none")


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> _background._Threads:
    """The library's threads, fresh for this test (an earlier test's may still be idle), kept for ``KEEP`` s idle."""
    fresh = _background._Threads()
    monkeypatch.setattr(_background, "_threads", fresh)
    monkeypatch.setattr(_background, "IDLE_SECONDS", KEEP)
    return fresh


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """Exceptions that escape any thread (they would otherwise only be printed)."""
    caught: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: caught.append(args.exc_value))
    return caught


def idle(threads: _background._Threads) -> int:
    """How many of ``threads`` wait for a call (a call submitted now goes to one of them, no thread is started)."""
    return len(threads._idle)


# --- A call on a thread --------------------------------------------------------------------------


def test_a_call_runs_on_a_daemon_thread_named_after_it():
    seen: dict[str, object] = {}

    def work() -> int:
        me = threading.current_thread()
        seen.update(name=me.name, daemon=me.daemon, main=me is threading.main_thread())
        return 42

    assert submit(work, name="membase-test[unit]").result(timeout=LONG) == 42
    assert seen == {"name": "membase-test[unit]", "daemon": True, "main": False}


def test_a_calls_error_goes_to_its_future_and_escapes_nowhere(thread_errors):
    future = submit(lambda: 1 / 0, name="membase-test[error]")

    with pytest.raises(ZeroDivisionError):
        future.result(timeout=LONG)
    assert thread_errors == []


def test_a_call_carries_its_callers_context_variables():
    token = request_id.set("turn-7")
    try:
        future = submit(request_id.get, name="membase-test[context]")
    finally:
        request_id.reset(token)

    assert future.result(timeout=LONG) == "turn-7"


def test_a_thread_carries_the_name_of_its_call_and_the_idle_name_between_calls(threads, gates):
    gate = gates.new()
    running = threading.Event()

    def call() -> str:
        running.set()
        gate.wait(LONG)
        return threading.current_thread().name

    future = submit(call, name="membase-recall[named]")
    assert running.wait(LONG)
    (thread,) = [t for t in threading.enumerate() if t.name == "membase-recall[named]"]
    gate.set()

    assert future.result(timeout=LONG) == "membase-recall[named]"
    assert wait_until(lambda: idle(threads) == 1, timeout=LONG)
    assert thread.name == IDLE_NAME
    assert thread.is_alive() and thread.daemon
    assert thread not in membase_threads()  # an idle thread does no work for anyone


def refuse_next_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next ``threading.Thread.start()`` fail as a process at its thread limit does."""
    start = threading.Thread.start
    refused: list[threading.Thread] = []

    def refuse(thread: threading.Thread) -> None:
        if not refused:
            refused.append(thread)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)


def test_a_thread_that_cannot_start_while_none_is_alive_fails_the_call_at_once(threads, monkeypatch):
    refuse_next_thread(monkeypatch)

    with pytest.raises(RuntimeError, match="can't start new thread"):
        submit(lambda: "never", name="membase-test[refused]")

    assert threads_alive() == 0
    assert submit(lambda: "next", name="membase-test[after]").result(timeout=LONG) == "next"


def test_a_thread_that_cannot_start_leaves_the_call_to_a_thread_already_alive(threads, monkeypatch, gates):
    gate = gates.new()
    busy = threading.Event()
    held = submit(lambda: busy.set() or gate.wait(LONG), name="membase-test[busy]")
    assert busy.wait(LONG)
    refuse_next_thread(monkeypatch)

    waiting = submit(lambda: "taken later", name="membase-test[refused]")  # no error: a thread will take it
    gate.set()

    assert held.result(timeout=LONG) is True
    assert waiting.result(timeout=LONG) == "taken later"
    assert threads_alive() == 1


# --- Growth, the cap, retirement -----------------------------------------------------------------


def test_a_waiting_thread_takes_the_next_call_instead_of_starting_another(threads):
    first = submit(threading.get_ident, name="membase-test[first]").result(timeout=LONG)
    assert wait_until(lambda: idle(threads) == 1, timeout=LONG)

    second = submit(threading.get_ident, name="membase-test[second]").result(timeout=LONG)

    assert second == first
    assert threads_alive() == 1


def test_threads_grow_while_every_one_is_busy(threads):
    # Each call returns only once all four run at the same time: four busy threads, or a broken barrier.
    together = threading.Barrier(4, timeout=LONG)

    def call() -> int:
        together.wait()
        return threading.get_ident()

    futures = [submit(call, name=f"membase-test[grow-{i}]") for i in range(4)]

    assert len({future.result(timeout=LONG) for future in futures}) == 4
    assert threads_alive() == 4


def test_below_the_cap_a_call_never_waits_behind_a_hung_one(threads, gates):
    gate = gates.new()
    started = threading.Event()

    def hung() -> str:
        started.set()
        gate.wait(LONG)
        return "late"

    held = submit(hung, name="membase-test[hung]")
    assert started.wait(LONG)

    assert submit(lambda: "answered", name="membase-test[next]").result(timeout=LONG) == "answered"
    assert not held.done()
    assert threads_alive() == 2

    gate.set()
    assert held.result(timeout=LONG) == "late"


def test_threads_grow_only_up_to_the_cap_and_calls_past_it_wait_their_turn_in_order(threads, monkeypatch, gates):
    monkeypatch.setattr(_background, "MAX_THREADS", 2)
    gates_of = [gates.new(), gates.new()]
    running = [threading.Event(), threading.Event()]

    def busy(index: int) -> int:
        running[index].set()
        gates_of[index].wait(LONG)
        return threading.get_ident()

    first = submit(functools.partial(busy, 0), name="membase-test[cap-0]")
    second = submit(functools.partial(busy, 1), name="membase-test[cap-1]")
    assert running[0].wait(LONG) and running[1].wait(LONG)
    ran: list[tuple[int, int]] = []  # (which call, on which thread), in the order they ran

    def in_line(index: int) -> None:
        ran.append((index, threading.get_ident()))

    waiting = [submit(functools.partial(in_line, i), name=f"membase-test[in-line-{i}]") for i in range(6)]

    # Both threads are busy and the cap is reached: no thread was started for the six, none of them ran.
    assert threads_alive() == 2
    assert ran == []

    gates_of[0].set()  # one thread is free: it takes the six, one after another, first come first served
    freed = first.result(timeout=LONG)
    for future in waiting:
        future.result(timeout=LONG)
    assert [index for index, _ in ran] == list(range(6))
    assert {thread for _, thread in ran} == {freed}
    assert not second.done()
    assert threads_alive() == 2

    gates_of[1].set()
    assert second.result(timeout=LONG) != freed


def test_a_call_cancelled_while_it_waits_for_a_thread_never_runs(threads, monkeypatch, gates):
    monkeypatch.setattr(_background, "MAX_THREADS", 1)
    gate = gates.new()
    busy = threading.Event()
    held = submit(lambda: busy.set() or gate.wait(LONG), name="membase-test[busy]")
    assert busy.wait(LONG)
    ran: list[str] = []

    dropped = submit(lambda: ran.append("dropped"), name="membase-test[dropped]")
    kept = submit(lambda: ran.append("kept"), name="membase-test[kept]")
    assert dropped.cancel()  # still in line: nobody has started it
    gate.set()

    assert held.result(timeout=LONG) is True
    assert kept.result(timeout=LONG) is None
    assert ran == ["kept"]


async def test_a_recall_whose_budget_runs_out_while_it_waits_for_a_thread_is_never_sent(
    threads, monkeypatch, fake, make_store, gates
):
    monkeypatch.setattr(_background, "MAX_THREADS", 1)
    fake.remember(FACT)
    gate = gates.new()
    busy = threading.Event()
    held = submit(lambda: busy.set() or gate.wait(LONG), name="membase-test[busy]")
    assert busy.wait(LONG)  # the one thread there may be is busy until the gate opens
    store = make_store(name="in-line", recall_timeout=BUDGET)

    with pytest.raises(MembaseRecallTimeout, match="ran out of time"):
        await store.search(QUESTION)
    gate.set()
    assert held.result(timeout=LONG) is True
    # The line is first come first served: once this call has run, the recall's turn in line has passed.
    assert submit(lambda: "after", name="membase-test[after]").result(timeout=LONG) == "after"

    assert fake.sent("POST", "/v1/search") == []
    assert not store._recall.waking  # nothing of it is running, so the next recall is not skipped
    counters = store.counters()
    assert (counters["recalls"], counters["recall_timeouts"], counters["recall_late_completions"]) == (1, 1, 0)


def test_idle_threads_retire_and_a_later_call_starts_one_again(threads, monkeypatch):
    monkeypatch.setattr(_background, "IDLE_SECONDS", 0.2)
    together = threading.Barrier(3, timeout=LONG)

    def call() -> threading.Thread:
        together.wait()
        return threading.current_thread()

    futures = [submit(call, name=f"membase-test[retire-{i}]") for i in range(3)]
    ran_on = [future.result(timeout=LONG) for future in futures]
    assert len(set(ran_on)) == 3  # three threads, all busy at once

    for thread in ran_on:
        thread.join(LONG)
        assert not thread.is_alive()
    assert threads_alive() == 0
    assert submit(lambda: "again", name="membase-test[again]").result(timeout=LONG) == "again"


def test_a_thread_keeps_nothing_of_a_call_once_it_has_ended(threads):
    """An idle thread must not keep a store (and its client and sockets) alive through the call it ran."""

    class Store:
        pass

    store = Store()
    ref = weakref.ref(store)

    def call(held: Store = store) -> bool:  # the call holds the store, as the store's own calls do
        return ref() is held

    token = request_id.set(store)  # the context copy holds it too
    try:
        future = submit(call, name="membase-test[keep-nothing]")
    finally:
        request_id.reset(token)
    assert future.result(timeout=LONG) is True
    assert wait_until(lambda: idle(threads) == 1, timeout=LONG)

    del store, call, future
    assert ref() is None  # freed by reference counting alone, while the thread that ran the call waits
    assert threads_alive() == 1


def test_each_call_runs_in_its_own_callers_context_on_a_reused_thread(threads):
    def read_then_set() -> tuple[object, int]:
        seen = request_id.get()
        request_id.set("set inside the call")  # stays inside that call's copy of the context
        return seen, threading.get_ident()

    token = request_id.set("turn-1")
    try:
        first, thread = submit(read_then_set, name="membase-test[ctx-1]").result(timeout=LONG)
    finally:
        request_id.reset(token)
    assert wait_until(lambda: idle(threads) == 1, timeout=LONG)
    second, same_thread = submit(read_then_set, name="membase-test[ctx-2]").result(timeout=LONG)

    assert (first, second) == ("turn-1", "none")
    assert same_thread == thread
    assert request_id.get() == "none"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no os.fork()")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_starts_threads_of_its_own_instead_of_waiting_for_its_parents(threads):
    submit(lambda: None, name="membase-test[before-fork]").result(timeout=LONG)
    assert wait_until(lambda: idle(threads) == 1, timeout=LONG)  # waits for a call; in a child it does not exist

    def child() -> list[object]:
        return [threads_alive(), submit(lambda: "child", name="membase-test[child]").result(timeout=LONG)]

    assert run_in_child(child) == [0, "child"]
    assert submit(lambda: "parent", name="membase-test[parent]").result(timeout=LONG) == "parent"


# --- Waiting for a call from an event loop -------------------------------------------------------


def test_wait_for_future_works_from_two_event_loops_in_turn():
    first = asyncio.run(wait_for_future(submit(lambda: "one", name="membase-test[1]"), LONG))
    second = asyncio.run(wait_for_future(submit(lambda: "two", name="membase-test[2]"), LONG))

    assert (first, second) == ("one", "two")


def test_two_loops_can_wait_for_the_same_future_at_once(gates):
    gate = gates.new()
    future = submit(lambda: gate.wait(LONG) and "shared", name="membase-test[shared]")
    results: list[object] = []

    def waiter() -> None:
        results.append(asyncio.run(wait_for_future(future, LONG)))

    waiters = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in waiters:
        thread.start()
    gate.set()
    for thread in waiters:
        thread.join(LONG)

    assert results == ["shared", "shared"]


def test_an_already_finished_future_is_returned_at_once():
    future = submit(lambda: "ready", name="membase-test[ready]")
    future.result(timeout=LONG)

    assert asyncio.run(wait_for_future(future, 0.001)) == "ready"


def test_wait_for_future_re_raises_the_calls_error():
    def fail() -> None:
        raise LookupError("not here")

    with pytest.raises(LookupError, match="not here"):
        asyncio.run(wait_for_future(submit(fail, name="membase-test[fail]"), LONG))


def test_no_timeout_waits_as_long_as_the_call_takes(gates):
    gate = gates.new()
    future = submit(lambda: gate.wait(LONG) and "done", name="membase-test[slow]")
    threading.Timer(0.2, gate.set).start()

    assert asyncio.run(wait_for_future(future, None)) == "done"


def test_a_timed_out_wait_leaves_the_call_running_and_its_late_end_raises_nowhere(gates, thread_errors, caplog):
    caplog.set_level(logging.DEBUG)
    gate = gates.new()
    finished = threading.Event()

    def late() -> str:
        gate.wait(LONG)
        finished.set()
        return "late"

    future = submit(late, name="membase-test[late]")
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(wait_for_future(future, BUDGET))
    # asyncio.run returned while the call still waits for its gate: it did not wait for the thread.
    assert not future.done()
    assert any(t.name == "membase-test[late]" for t in membase_threads("membase-test"))

    # It completes after its loop has closed: the wake-up finds the loop gone and stays quiet.
    gate.set()
    assert finished.wait(LONG)
    assert future.result(timeout=LONG) == "late"
    assert wait_until(lambda: not membase_threads("membase-test[late]"), timeout=LONG)
    assert thread_errors == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_timed_out_wait_on_a_live_loop_ignores_the_late_answer(gates, caplog):
    caplog.set_level(logging.DEBUG)
    gate = gates.new()
    future = submit(lambda: gate.wait(LONG) and "late", name="membase-test[live]")

    with pytest.raises(asyncio.TimeoutError):
        await wait_for_future(future, BUDGET)
    gate.set()
    assert await asyncio.wrap_future(future) == "late"
    await asyncio.sleep(0)  # the thread's wake-up, queued before wrap_future's, has run on this loop

    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_waiting_does_not_block_the_event_loop():
    loop_ran = threading.Event()
    # The call ends only once this loop has run something while it waits for the call.
    future = submit(lambda: loop_ran.wait(LONG), name="membase-test[block]")
    asyncio.get_running_loop().call_soon(loop_ran.set)

    assert await wait_for_future(future, None) is True


async def test_a_wait_cancelled_within_its_budget_leaves_nothing_behind_on_the_loop(gates):
    loop = asyncio.get_running_loop()
    problems: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: problems.append(context))
    gate = gates.new()
    future = submit(lambda: gate.wait(LONG) and "late", name="membase-test[cancelled]")

    waiting = asyncio.create_task(wait_for_future(future, 0.1))
    await asyncio.sleep(0)  # the task is now waiting
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.3)  # past the budget: its timer, had it stayed, would have fired by now
    gate.set()
    assert await asyncio.wrap_future(future) == "late"
    await asyncio.sleep(0)  # the thread's wake-up reaches this loop

    assert problems == []
    assert not future.cancelled()


# --- The store on the threads, through a real Agent ----------------------------------------------


def serving_threads(fake: InMemoryMembase) -> list[threading.Thread]:
    """Records the thread that sends each search; the fake answers as usual."""
    seen: list[threading.Thread] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(threading.current_thread())
        return fake.answer(request)

    fake.always("POST", "/v1/search", respond)
    return seen


def test_consecutive_recalls_run_on_one_reused_thread_not_a_thread_each(threads, fake, make_store):
    fake.remember(FACT)
    seen = serving_threads(fake)
    store = make_store(recall_timeout=LONG)
    agent, model = make_agent(store)

    for turn in range(5):
        agent(QUESTION)
        assert f"[Main] {FACT}" in (model.memory_block(turn) or "")
        assert wait_until(lambda: idle(threads) == 1, timeout=LONG)  # waiting for the next call before the next turn

    assert len(seen) == 5
    assert len(set(seen)) == 1, f"{len(set(seen))} threads served 5 recalls one after another"
    assert threads_alive() == 1


def test_a_late_request_never_holds_a_synchronous_agent_call(fake, make_store, gates):
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", routed(fake), hang(stall, then=routed(fake)))
    store = make_store(name="never-holds", recall_timeout=LONG)
    agent, model = make_agent(store)
    agent(QUESTION)  # a healthy turn first: its thread waits for the next call
    assert f"[Main] {FACT}" in (model.memory_block() or "")

    set_recall_budget(store, BUDGET)
    agent(QUESTION)  # asyncio.run of this call must not wait for the thread that runs the late request

    # The call returned while the gate still holds that request: it is still running on its thread.
    assert model.memory_block() is None
    assert not stall.is_set()
    assert len(membase_threads(f"{RECALL_THREAD}{store.name}]")) == 1
    assert store.counters()["recall_late_completions"] == 0
    stall.set()
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=LONG)
    set_recall_budget(store, LONG)
    agent(QUESTION)
    assert f"[Main] {FACT}" in (model.memory_block() or "")


def test_after_a_stall_ends_the_threads_retire_and_none_is_left(threads, monkeypatch, fake, make_store, gates):
    monkeypatch.setattr(_background, "IDLE_SECONDS", 0.2)
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall, then=routed(fake)))
    store = make_store(name="stalled", recall_timeout=BUDGET)
    agent, _ = make_agent(store)
    agent(QUESTION)
    assert threads_alive() == 1  # the late request's

    stall.set()
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=LONG)

    assert wait_until(lambda: threads_alive() == 0, timeout=LONG)
    assert not membase_threads(f"{RECALL_THREAD}{store.name}]")

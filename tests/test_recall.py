"""Time-boxed, fail-open recall: through a real Agent, directly on the store, and TimeBoxedRecall itself."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import pytest
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore, MembaseRecallTimeout
from membase_strands._background import submit
from membase_strands._recall import RecallSkipped, TimeBoxedRecall
from membase_strands.testing import API_KEY, ScriptedModel, hang, status
from tests.support.loopback import LoopbackMembase, ok_json, stall
from tests.support.store_helpers import (
    FACT,
    QUESTION,
    RECALL_THREAD,
    delayed,
    make_agent,
    membase_threads,
    routed,
    set_recall_budget,
    until,
    wait_until,
)

BUDGET = 0.3  # for the tests about a budget: what must outlast it is held back by a gate, not by the clock
LONG = 30.0  # every other budget and wait: a loaded machine cannot run out of it


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


# --- Through a real Agent -----------------------------------------------------------------------


def test_a_stalled_recall_never_holds_a_synchronous_turn(fake, make_store, gates, caplog, no_key_in_logs):
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall, then=routed(fake)))
    store = make_store(name="stalled-turns", recall_timeout=BUDGET)
    agent, model = make_agent(store, ["Without memory.", "Still without.", "Again without.", "With memory."])

    # The first turn runs out of its budget and goes on without memory, while the gate still holds the request.
    assert "Without memory." in str(agent(QUESTION))
    assert not stall.is_set()
    assert model.memory_block() is None
    assert any("ran out of time" in m for m in messages(caplog, logging.WARNING))
    assert len(fake.sent("POST", "/v1/search")) == 1

    # While the late request still runs, the next turns skip recall, with no new request and no wait.
    for _ in range(2):
        agent(QUESTION)
        assert model.memory_block() is None
    assert len(fake.sent("POST", "/v1/search")) == 1
    counters = store.counters()
    assert (counters["recall_timeouts"], counters["recall_skipped"]) == (1, 2)
    assert len(membase_threads(f"{RECALL_THREAD}{store.name}]")) == 1

    # The late request ends: its outcome is logged and recall resumes.
    stall.set()
    assert wait_until(lambda: any("late recall finished" in m for m in messages(caplog)), timeout=LONG)
    assert wait_until(lambda: not store._recall.waking, timeout=LONG)
    set_recall_budget(store, LONG)  # the rest is not about the budget
    agent(QUESTION)
    assert len(fake.sent("POST", "/v1/search")) == 2
    assert f"[Main] {FACT}" in (model.memory_block() or "")


def test_a_late_recall_that_fails_is_logged_and_recall_resumes(fake, make_store, gates, caplog):
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall))  # then: a read timeout, as from a host that never answered
    store = make_store(recall_timeout=BUDGET)
    agent, model = make_agent(store, ["Without memory.", "With memory."])

    agent(QUESTION)
    stall.set()

    assert wait_until(lambda: any("late recall failed" in m for m in messages(caplog, logging.WARNING)), timeout=LONG)
    assert wait_until(lambda: not store._recall.waking, timeout=LONG)
    # One SDK attempt: the late recall was not retried while it held the guard.
    assert len(fake.sent("POST", "/v1/search")) == 1
    set_recall_budget(store, LONG)  # the rest is not about the budget
    agent(QUESTION)
    assert len(fake.sent("POST", "/v1/search")) == 2
    assert f"[Main] {FACT}" in (model.memory_block() or "")


def test_a_late_recall_holds_the_guard_for_one_attempt_only(fake, make_store, gates):
    stall = gates.new()
    # A host that fails with 503 after the budget: the SDK would retry it twice; the store must not.
    fake.always("POST", "/v1/search", hang(stall, then=status(503)))
    store = make_store(recall_timeout=BUDGET)
    agent, _ = make_agent(store, ["ok"])

    agent(QUESTION)
    stall.set()

    # Counted once the request has ended, its last attempt included.
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=LONG)
    assert not store._recall.waking
    assert len(fake.sent("POST", "/v1/search")) == 1


def test_repeated_stalled_turns_leave_at_most_one_recall_thread(fake, make_store, gates):
    stall = gates.new()
    fake.always("POST", "/v1/search", hang(stall, then=routed(fake)))
    store = make_store(name="repeated-stalls", recall_timeout=BUDGET)
    agent, _ = make_agent(store)

    for _ in range(4):
        agent(QUESTION)

    assert len([t for t in membase_threads(RECALL_THREAD) if store.name in t.name]) == 1
    assert len(fake.sent("POST", "/v1/search")) == 1


async def test_two_healthy_recalls_at_once_on_one_store_both_run(fake, make_store):
    fake.remember("We chose Postgres for the ledger.")
    fake.remember("Deploys happen on Tuesdays.")
    barrier = threading.Barrier(2, timeout=LONG)
    broke: list[bool] = []

    def together(request):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            broke.append(True)
        return fake.answer(request)

    fake.always("POST", "/v1/search", together)
    store = make_store(recall_timeout=LONG)
    first, first_model = make_agent(store, ["Postgres."])
    second, second_model = make_agent(store, ["Tuesdays."])

    await asyncio.gather(
        first.invoke_async("Which database did we choose for the ledger?"),
        second.invoke_async("When do deploys happen?"),
    )

    assert not broke, "the two recalls did not run at the same time"
    assert "[Main] We chose Postgres for the ledger." in (first_model.memory_block() or "")
    assert "[Main] Deploys happen on Tuesdays." in (second_model.memory_block() or "")
    assert len(fake.sent("POST", "/v1/search")) == 2
    assert not store._recall.waking


def test_without_a_budget_recall_waits_for_the_sdk(fake, make_store, caplog):
    fake.remember(FACT)
    fake.on("POST", "/v1/search", delayed(fake, 0.3))
    agent, model = make_agent(make_store(recall_timeout=None), ["Postgres."])

    agent(QUESTION)

    assert f"[Main] {FACT}" in (model.memory_block() or "")
    assert not any("ran out of time" in m for m in messages(caplog))


def test_without_a_budget_recall_uses_the_sdks_retries(fake, make_store):
    fake.remember(FACT)
    fake.on("POST", "/v1/search", status(503))
    agent, model = make_agent(make_store(recall_timeout=None), ["Postgres."])

    agent(QUESTION)

    assert len(fake.sent("POST", "/v1/search")) == 2
    assert f"[Main] {FACT}" in (model.memory_block() or "")


async def test_search_past_its_budget_raises_then_returns_nothing_without_a_request(fake, make_store, gates):
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall, then=routed(fake)))
    store = make_store(recall_timeout=BUDGET)

    with pytest.raises(MembaseRecallTimeout) as raised:
        await store.search(QUESTION)
    assert not stall.is_set()  # it gave up on the request, which the gate still holds
    assert isinstance(raised.value, TimeoutError)
    assert API_KEY not in str(raised.value)

    # Skipped while the late request runs: no memory this turn, and not a failure.
    assert await store.search("another question about the ledger") == []
    assert len(fake.sent("POST", "/v1/search")) == 1
    counters = store.counters()
    assert (counters["recall_timeouts"], counters["recall_skipped"], counters["recall_errors"]) == (1, 1, 0)


async def test_a_healthy_search_within_budget_leaves_no_guard(fake, make_store):
    fake.remember(FACT)
    store = make_store(recall_timeout=LONG)

    for _ in range(3):
        assert [e.content for e in await store.search(QUESTION)] == [f"[Main] {FACT}"]

    assert not store._recall.waking
    assert len(fake.sent("POST", "/v1/search")) == 3


def test_a_late_failure_that_echoes_the_key_does_not_log_it(fake, make_store, gates, caplog):
    caplog.set_level(logging.DEBUG)
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall, then=status(403, f"unknown key {API_KEY}")))
    store = make_store(recall_timeout=BUDGET)
    agent, _ = make_agent(store)

    agent(QUESTION)
    stall.set()

    assert wait_until(lambda: any("late recall failed" in m for m in messages(caplog)), timeout=LONG)
    assert not any(API_KEY in m for m in messages(caplog))


def test_a_recall_error_that_echoes_the_key_does_not_log_it(fake, make_store, caplog):
    caplog.set_level(logging.DEBUG)
    fake.on("POST", "/v1/search", status(401, f"bad bearer {API_KEY}"))
    agent, model = make_agent(make_store())

    agent(QUESTION)

    assert model.memory_block() is None
    assert not any(API_KEY in m for m in messages(caplog))


T = TypeVar("T")

# --- TimeBoxedRecall ----------------------------------------------------------------------------


def on_thread(request: Callable[[], T]) -> Callable[[], Future[T]]:
    """What the store hands the time box: the call, started on a thread of ``_background``."""
    return lambda: submit(request, name="membase-recall[unit]")


class Counter:
    """A request that counts its calls and, with a gate, waits for it before it answers."""

    def __init__(self, gate: threading.Event | None = None, result: object = "answer") -> None:
        self.calls = 0
        self.finished = 0
        self.gate = gate
        self.result = result
        self._lock = threading.Lock()

    def __call__(self) -> object:
        with self._lock:
            self.calls += 1
        if self.gate is not None:
            self.gate.wait(LONG)
        with self._lock:
            self.finished += 1
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


async def test_a_recall_within_budget_returns_its_answer_and_holds_no_guard():
    recall = TimeBoxedRecall("unit")
    request = Counter()

    assert await recall.run(on_thread(request), LONG) == "answer"
    assert await recall.run(on_thread(request), LONG) == "answer"
    assert request.calls == 2
    assert not recall.waking


async def test_an_error_within_budget_is_raised_and_holds_no_guard():
    recall = TimeBoxedRecall("unit")

    with pytest.raises(ValueError, match="boom"):
        await recall.run(on_thread(Counter(result=ValueError("boom"))), 5.0)

    assert not recall.waking
    assert await recall.run(on_thread(Counter()), LONG) == "answer"


async def test_the_guard_holds_only_after_a_timeout_and_until_the_late_one_ends(gates, caplog):
    caplog.set_level(logging.INFO)
    recall = TimeBoxedRecall("unit")
    stall = gates.new()
    late = Counter(stall)

    with pytest.raises(MembaseRecallTimeout, match="ran out of time"):
        await recall.run(on_thread(late), BUDGET)
    assert recall.waking
    # INFO: the manager logs the raised timeout as its warning.
    assert any("ran out of time" in m for m in messages(caplog, logging.INFO))
    assert not messages(caplog, logging.WARNING)

    skipped = Counter()
    with pytest.raises(RecallSkipped, match="memory waking"):
        await recall.run(on_thread(skipped), BUDGET)
    assert skipped.calls == 0

    stall.set()
    assert await until(lambda: not recall.waking, LONG)
    assert any("late recall finished" in m for m in messages(caplog, logging.INFO))
    assert await recall.run(on_thread(skipped), LONG) == "answer"
    assert skipped.calls == 1


async def test_concurrent_healthy_runs_both_execute():
    recall = TimeBoxedRecall("unit")
    barrier = threading.Barrier(2, timeout=LONG)

    def request() -> str:
        barrier.wait()
        return threading.current_thread().name

    names = await asyncio.gather(recall.run(on_thread(request), LONG), recall.run(on_thread(request), LONG))

    assert names == ["membase-recall[unit]", "membase-recall[unit]"]
    assert not recall.waking


async def test_a_late_failure_is_logged_at_warning(gates, caplog):
    caplog.set_level(logging.DEBUG)
    recall = TimeBoxedRecall("unit")
    stall = gates.new()

    with pytest.raises(MembaseRecallTimeout):
        await recall.run(on_thread(Counter(stall, result=ConnectionError("host went away"))), BUDGET)
    stall.set()

    assert await until(lambda: not recall.waking, LONG)
    failed = [r for r in caplog.records if "late recall failed" in r.getMessage()]
    assert len(failed) == 1
    assert failed[0].levelno == logging.WARNING
    assert "host went away" in failed[0].getMessage()


async def test_no_budget_waits_as_long_as_the_request_takes():
    recall = TimeBoxedRecall("unit")

    def slow() -> str:
        time.sleep(0.2)
        return "late but welcome"

    assert await recall.run(on_thread(slow), None) == "late but welcome"
    assert not recall.waking


def test_a_timed_out_run_does_not_hold_asyncio_run(gates):
    recall = TimeBoxedRecall("unit")
    stall = gates.new()
    late = Counter(stall)

    with pytest.raises(MembaseRecallTimeout):
        asyncio.run(recall.run(on_thread(late), BUDGET))
    # asyncio.run returned while the request still waits for its gate.
    assert (late.calls, late.finished) == (1, 0)
    assert recall.waking
    # The loop is gone; the late request finishes later without anyone waiting for it.
    stall.set()
    assert wait_until(lambda: not recall.waking, timeout=LONG)
    assert late.finished == 1
    assert asyncio.run(recall.run(on_thread(Counter()), LONG)) == "answer"


def test_a_late_request_holds_the_guard_for_at_most_one_sdk_attempt():
    now = [0.0]
    box = TimeBoxedRecall("membase", hold_limit=90.0, clock=lambda: now[0])
    gate = threading.Event()
    try:
        with pytest.raises(MembaseRecallTimeout):
            asyncio.run(box.run(on_thread(lambda: gate.wait(LONG)), 0.05))
        assert box.waking
        now[0] = 89.0
        assert box.waking
        now[0] = 91.0  # one SDK attempt later the guard lets recalls through again
        assert not box.waking
        assert asyncio.run(box.run(on_thread(lambda: "answer"), LONG)) == "answer"
    finally:
        gate.set()


# --- The faults a web server brings -------------------------------------------------------------

TURNS = 10
PASSAGE = {"content": FACT, "container": "ctr_main", "container_name": "Main", "score": 1.0}
SEARCH_ANSWER = {"results": [PASSAGE], "containers": [{"id": "ctr_main", "name": "Main"}]}


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        yield server


def logged(caplog: pytest.LogCaptureFixture, store: str, level: int = logging.DEBUG) -> list[str]:
    """Messages at ``level`` or above from every logger, except what other tests' stores log from the library's
    background threads (a late request of an earlier test may end during this one)."""
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= level
        and (
            not r.threadName.startswith("membase-")
            or f"[{store}]" in r.threadName
            or f"store=<{store}>" in r.getMessage()
        )
    ]


class WaitingModel(ScriptedModel):
    """A model that records what it was sent, then takes its time, like a real one mid-answer."""

    async def stream(
        self, messages: Any, tool_specs: Any = None, system_prompt: Any = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.calls.append({"messages": copy.deepcopy(messages), "tool_names": [], "system_prompt": system_prompt})
        await asyncio.sleep(30)  # the turn is cancelled long before
        yield {"messageStart": {"role": "assistant"}}


async def test_cancelled_turns_on_a_stalled_membase_leave_one_request_and_one_thread(loopback, caplog):
    """A web server cancels a request's task when its client disconnects; ten of them must not leave ten requests."""
    caplog.set_level(logging.DEBUG)
    release = threading.Event()
    loopback.on("POST", "/v1/search", *[stall(release, then=ok_json(SEARCH_ANSWER)) for _ in range(TURNS)])
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, name="cancelled-turns", recall_timeout=LONG)
    threads = lambda: membase_threads(f"{RECALL_THREAD}{store.name}]")  # noqa: E731
    searches = lambda: loopback.fake.sent("POST", "/v1/search")  # noqa: E731
    try:
        for turn in range(TURNS):
            # One agent per request, as a web app builds them.
            model = WaitingModel()
            agent = Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None)
            task = asyncio.create_task(agent.invoke_async(QUESTION))
            # The client goes away while this turn waits: on Membase, or (recall skipped) on the model.
            assert await until(lambda: len(searches()) > turn or bool(model.calls) or task.done(), LONG)  # noqa: B023
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        assert len(searches()) == 1, "each cancelled turn left its own request running"
        assert len(threads()) == 1
        counters = store.counters()
        assert (counters["recalls"], counters["recall_cancelled"], counters["recall_skipped"]) == (TURNS, 1, TURNS - 1)
        assert counters["recall_errors"] == counters["recall_timeouts"] == 0

        # The cancelled recall's request ends: logged and counted like a timed-out one, and recall resumes.
        release.set()
        assert await until(lambda: store.counters()["recall_late_completions"] == 1, LONG)
        assert await until(lambda: not store._recall.waking and not threads(), LONG)
        assert any("late recall finished" in m for m in logged(caplog, store.name, logging.INFO))
        agent, model = make_agent(store, ["Postgres."])
        await agent.invoke_async(QUESTION)
        assert len(searches()) == 2
        assert f"[Main] {FACT}" in (model.memory_block() or "")
    finally:
        release.set()
        store.close()


async def test_a_cancelled_search_propagates_and_holds_the_guard_while_its_request_runs(loopback, caplog):
    caplog.set_level(logging.DEBUG)
    release = threading.Event()
    loopback.on("POST", "/v1/search", stall(release, then=ok_json(SEARCH_ANSWER)))
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, name="cancelled-search", recall_timeout=None)
    try:
        task = asyncio.create_task(store.search(QUESTION))
        assert await until(lambda: len(loopback.fake.sent("POST", "/v1/search")) == 1, LONG)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        assert store._recall.waking
        assert await store.search("another question about the ledger") == []
        assert len(loopback.fake.sent("POST", "/v1/search")) == 1
        assert any("recall cancelled" in m for m in logged(caplog, store.name, logging.INFO))
        assert logged(caplog, store.name, logging.WARNING) == []

        release.set()
        assert await until(lambda: not store._recall.waking, LONG)
        assert [e.content for e in await store.search(QUESTION)] == [f"[Main] {FACT}"]
    finally:
        release.set()
        store.close()


# --- Agents built during an outage ---------------------------------------------------------------


def test_agents_built_during_an_outage_wait_for_the_set_up_check_once(fake, make_store, gates, caplog):
    caplog.set_level(logging.DEBUG)
    fake.remember(FACT)
    outage = gates.new()
    fake.on("GET", "/v1/containers", hang(outage, then=routed(fake)))
    store = make_store(name="outage", container="Main", recall_timeout=BUDGET)

    # The first agent waits the budget for the check, then is built without it.
    make_agent(store)
    assert len([m for m in messages(caplog, logging.WARNING) if "could not list the Memories" in m]) == 1

    # While that check is still late, more agents are built: none waits for it again, each says so at DEBUG.
    for _ in range(5):
        make_agent(store)
    assert len([m for m in messages(caplog) if "set-up check is still running" in m]) == 5
    assert len([m for m in messages(caplog, logging.WARNING) if "could not list the Memories" in m]) == 1
    assert len(fake.sent("GET", "/v1/containers")) == 1
    assert not outage.is_set()

    # The check ends: the next agent uses its answer, with no request of its own, and so does first use.
    outage.set()
    assert wait_until(lambda: not membase_threads(f"membase-check[{store.name}]"), timeout=LONG)
    set_recall_budget(store, LONG)  # the rest is not about the budget
    agent, model = make_agent(store, ["Postgres."])
    agent(QUESTION)
    assert len(fake.sent("GET", "/v1/containers")) == 1
    assert [r.body["container"] for r in fake.sent("POST", "/v1/search")] == ["ctr_main"]
    assert f"[Main] {FACT}" in (model.memory_block() or "")


def test_a_late_set_up_check_that_finds_an_unknown_memory_stops_the_next_agent(fake, make_store, gates):
    outage = gates.new()
    fake.on("GET", "/v1/containers", hang(outage, then=routed(fake)))
    store = make_store(name="late-check", container="Projects", recall_timeout=BUDGET)
    make_agent(store)  # built without the check: Membase did not answer in time

    outage.set()
    assert wait_until(lambda: not membase_threads(f"membase-check[{store.name}]"), timeout=LONG)
    with pytest.raises(ValueError, match="Memories in reach: 'Main'"):
        make_agent(store)
    assert len(fake.sent("GET", "/v1/containers")) == 1


# --- A long stall or 403 pause: one warning, details at DEBUG ----------------------------------


def test_a_hundred_turns_of_one_stall_warn_at_most_three_times(fake, make_store, gates, caplog):
    caplog.set_level(logging.DEBUG)
    fake.remember(FACT)
    outage = gates.new()
    fake.always("POST", "/v1/search", hang(outage))  # then a read timeout: the late recall fails
    store = make_store(name="stalled", recall_timeout=0.2)
    agent, model = make_agent(store, ["ok"] * 100)

    for turn in range(100):
        agent(f"{QUESTION} ({turn})")
    outage.set()
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=LONG)

    # Every WARNING or worse from any logger: caplog's handler sits on the root logger.
    warned = logged(caplog, store.name, logging.WARNING)
    assert len(warned) <= 3, warned
    assert sum("ran out of time" in w for w in warned) == 1  # the manager's line, from the exception's text
    assert sum("late recall failed" in w for w in warned) == 1
    # The details are at DEBUG, and the model saw what it saw before: no memory, the same tools.
    assert len([m for m in logged(caplog, store.name) if f"store=<{store.name}>" in m and "recall skipped" in m]) == 99
    assert all(model.memory_block(turn) is None for turn in range(100))
    assert all(call["tool_names"] == model.calls[0]["tool_names"] for call in model.calls)
    assert "membase_search" in model.calls[0]["tool_names"]
    counters = store.counters()
    assert (counters["recalls"], counters["recall_timeouts"], counters["recall_skipped"]) == (100, 1, 99)
    assert len(fake.sent("POST", "/v1/search")) == 1


def test_a_hundred_turns_of_one_403_pause_warn_at_most_three_times(fake, make_store, caplog):
    caplog.set_level(logging.DEBUG)
    fake.always("POST", "/v1/search", status(403, "key revoked"))
    store = make_store(name="refused", access_cooldown=600.0)
    agent, model = make_agent(store, ["ok"] * 100)

    for turn in range(100):
        agent(f"{QUESTION} ({turn})")

    # Every WARNING or worse from any logger: caplog's handler sits on the root logger.
    warned = logged(caplog, store.name, logging.WARNING)
    assert len(warned) <= 3, warned
    assert sum("narrowed or revoked" in w for w in warned) == 1
    assert len([m for m in logged(caplog, store.name, logging.INFO) if "automatic recall paused for 600 s" in m]) == 1
    assert len([m for m in logged(caplog, store.name) if f"store=<{store.name}>" in m and "recall skipped" in m]) == 99
    assert all(model.memory_block(turn) is None for turn in range(100))
    assert all(call["tool_names"] == model.calls[0]["tool_names"] for call in model.calls)
    counters = store.counters()
    assert (counters["recalls"], counters["recall_errors"], counters["recall_skipped"]) == (100, 1, 99)
    assert len(fake.sent("POST", "/v1/search")) == 1


# --- close() while a recall is running -----------------------------------------------------------


def own_lines(caplog: pytest.LogCaptureFixture, store: str) -> list[str]:
    """What this library and Strands logged for ``store`` (not the HTTP stack's own DEBUG traces)."""
    return [line for line in logged(caplog, store) if line.startswith(("membase_strands", "strands"))]


async def test_closing_the_store_during_a_recall_lets_the_recall_finish_with_its_memory(loopback, caplog):
    # A store built from a key has nothing of its own to close: its sockets belong to the shared pool, so
    # closing it does not pull the connection from under a recall that is running (it used to end it).
    caplog.set_level(logging.DEBUG)
    release = threading.Event()
    loopback.on("POST", "/v1/search", stall(release, then=ok_json(SEARCH_ANSWER)))
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, name="closing", recall_timeout=LONG)
    agent, model = make_agent(store, ["Postgres."])
    try:
        turn = asyncio.create_task(agent.invoke_async(QUESTION))
        assert await until(lambda: len(loopback.fake.sent("POST", "/v1/search")) == 1, LONG)
        store.close()  # the app shuts down while the recall is running
        release.set()
        assert "Postgres." in str(await asyncio.wait_for(turn, LONG))
    finally:
        release.set()
        store.close()

    assert f"[Main] {FACT}" in (model.memory_block() or "")
    counters = store.counters()
    assert (counters["recalls"], counters["recall_hits"], counters["recall_errors"]) == (1, 1, 0)
    assert "errors.connection" not in counters and "errors.closed" not in counters
    assert not any("Bad file descriptor" in line for line in own_lines(caplog, store.name))
    assert logged(caplog, store.name, logging.WARNING) == []
    with pytest.raises(RuntimeError, match="is closed"):
        await store.search(QUESTION)  # and the next one is refused


def test_closing_the_store_under_a_late_recall_lets_it_finish_and_logs_that(loopback, caplog):
    caplog.set_level(logging.DEBUG)
    release = threading.Event()
    loopback.on("POST", "/v1/search", stall(release, then=ok_json(SEARCH_ANSWER)))
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, name="closing-late", recall_timeout=BUDGET)
    agent, _ = make_agent(store, ["Without memory."])
    try:
        agent(QUESTION)  # runs out of time; the request goes on
        store.close()
        release.set()
        assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=LONG)
    finally:
        release.set()
        store.close()

    lines = own_lines(caplog, store.name)
    assert any("late recall finished" in line for line in lines)
    assert not any("Bad file descriptor" in line or "late recall failed" in line for line in lines)
    assert "errors.connection" not in store.counters()

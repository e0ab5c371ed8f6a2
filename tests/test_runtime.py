"""Where the library's blocking work runs: daemon threads, one per call at once, awaited from any event loop;
and the store on them, with many agents, many threads, a burst, a stalled Membase and a refused key.

The first part drives ``_runtime.submit`` / ``wait_for_future`` on threads of the test's own (``threads``); the
rest goes through a real ``strands.Agent`` and counts requests, counters and thread names.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
import weakref
from typing import Any

import httpx
import pytest

from membase_strands import MembaseAccessError, MembaseMemoryStore, _runtime
from membase_strands._runtime import IDLE_NAME, submit, wait_for_future
from membase_strands.testing import API_KEY, InMemoryMembase, Responder, ScriptedModel, ToolCall, hang, status
from tests.support.loopback import LoopbackMembase
from tests.support.store_helpers import (
    FACT,
    LONG,
    QUESTION,
    RECALL_THREAD,
    delayed,
    make_agent,
    membase_threads,
    routed,
    wait_until,
)

BUDGET = 0.5  # for the tests about a budget: what must outlast it is held back by a gate, not by the clock
KEEP = 10.0  # idle seconds for the threads made here: far longer than any test waits between two calls

request_id: contextvars.ContextVar[object] = contextvars.ContextVar("request_id", default="none")


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's threads, fresh for this test (an earlier test's may still be idle), kept for ``KEEP`` s idle."""
    monkeypatch.setattr(_runtime, "_workers", _runtime._Workers())
    monkeypatch.setattr(_runtime, "IDLE_SECONDS", KEEP)


def where() -> threading.Thread:
    return threading.current_thread()


def meet(barrier: threading.Barrier) -> threading.Thread:
    """A call that returns once all the barrier's parties run at the same time; where it ran."""
    barrier.wait()
    return threading.current_thread()


def held(gate: threading.Event, started: threading.Event | None = None) -> threading.Thread:
    """A call that runs until ``gate`` opens; where it ran."""
    if started is not None:
        started.set()
    gate.wait(LONG)
    return threading.current_thread()


# --- A call on a thread --------------------------------------------------------------------------
def test_a_call_runs_on_a_daemon_thread_named_after_it_in_its_callers_context(threads, monkeypatch):
    escaped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    token = request_id.set("turn-7")
    try:
        ran_on = submit(
            lambda: (where().name, where().daemon, where() is threading.main_thread()), name="membase-test[unit]"
        ).result(timeout=LONG)
        seen = submit(request_id.get, name="membase-test[context]").result(timeout=LONG)
    finally:
        request_id.reset(token)

    assert ran_on == ("membase-test[unit]", True, False)
    assert seen == "turn-7"
    with pytest.raises(ZeroDivisionError):
        submit(lambda: 1 / 0, name="membase-test[error]").result(timeout=LONG)
    assert escaped == []  # the error went to the future, and nowhere else
    # A new thread, or a task started there, begins with an empty context (which is falsy): its calls run too.
    assert contextvars.Context().run(submit, lambda: "ran", name="membase-test[empty]").result(timeout=LONG) == "ran"


def test_an_idle_thread_takes_the_next_call_in_that_calls_own_context_and_keeps_nothing_of_the_last(threads):
    class Store:
        pass

    store = Store()
    ref = weakref.ref(store)

    def first_call(held: Store = store) -> tuple[threading.Thread, object]:  # holds a store, as the store's calls do
        request_id.set("set inside the call")  # stays inside that call's copy of the context
        return where(), ref() is held

    token = request_id.set(store)  # the context copy holds it too
    try:
        thread, _ = submit(first_call, name="membase-test[first]").result(timeout=LONG)
    finally:
        request_id.reset(token)
    assert wait_until(lambda: thread.name == IDLE_NAME, timeout=LONG)
    assert thread.is_alive() and thread not in membase_threads()  # an idle thread does no work for anyone
    del store, first_call
    assert ref() is None  # freed by reference counting alone, while the thread that ran the call waits

    second, seen = submit(lambda: (where(), request_id.get()), name="membase-test[second]").result(timeout=LONG)
    assert (second, seen) == (thread, "none")
    assert request_id.get() == "none"


def test_every_call_gets_a_thread_at_once_however_many_others_hang(threads, gates):
    gates_of, running = [gates.new() for _ in range(40)], [threading.Event() for _ in range(40)]
    busy = [
        submit(functools.partial(held, gate, running[n]), name=f"membase-test[busy-{n}]")
        for n, gate in enumerate(gates_of)
    ]
    # Each call got a thread of its own while the others hung: no call waits behind a hung one.
    assert all(event.wait(LONG) for event in running)
    assert submit(lambda: "ran", name="membase-test[next]").result(timeout=LONG) == "ran"
    for gate in gates_of:
        gate.set()
    assert all(future.result(timeout=LONG) for future in busy)


def test_a_thread_that_cannot_start_fails_its_call_and_idle_threads_retire_and_a_later_call_starts_one(
    threads, monkeypatch
):
    start, refused = threading.Thread.start, []

    def refuse_once(thread: threading.Thread) -> None:
        if not refused:
            refused.append(thread)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse_once)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        submit(lambda: "never", name="membase-test[refused]").result(timeout=LONG)
    monkeypatch.setattr(_runtime, "IDLE_SECONDS", 0.2)
    together = threading.Barrier(3, timeout=LONG)
    ran_on = [submit(functools.partial(meet, together), name=f"membase-test[r{i}]") for i in range(3)]
    for thread in [future.result(timeout=LONG) for future in ran_on]:
        thread.join(LONG)
        assert not thread.is_alive()
    assert submit(lambda: "again", name="membase-test[again]").result(timeout=LONG) == "again"


# --- Waiting for a call from an event loop -------------------------------------------------------
def test_wait_for_future_waits_from_any_loop_and_raises_what_the_call_raised(gates):
    gate = gates.new()
    shared = submit(lambda: gate.wait(LONG) and "shared", name="membase-test[shared]")
    results: list[object] = []
    waiters = [
        threading.Thread(target=lambda: results.append(asyncio.run(wait_for_future(shared, LONG)))) for _ in "ab"
    ]
    for thread in waiters:
        thread.start()
    gate.set()
    for thread in waiters:
        thread.join(LONG)
    assert results == ["shared", "shared"]  # two loops waited for one future at once

    assert asyncio.run(wait_for_future(shared, 0.001)) == "shared"  # done already: at once, whatever the budget
    assert asyncio.run(wait_for_future(submit(lambda: "next", name="membase-test[next]"), None)) == "next"

    def fail() -> None:
        raise LookupError("not here")

    with pytest.raises(LookupError, match="not here"):
        asyncio.run(wait_for_future(submit(fail, name="membase-test[fail]"), LONG))


def test_a_wait_that_times_out_leaves_the_call_running_and_its_late_end_disturbs_nothing(gates, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    escaped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    gate = gates.new()
    late = submit(lambda: gate.wait(LONG) and "late", name="membase-test[late]")
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(wait_for_future(late, BUDGET))
    assert not late.done()  # asyncio.run returned while the call still runs: it did not wait for the thread

    async def cancelled_then_late() -> None:
        loop = asyncio.get_running_loop()
        problems: list[dict[str, object]] = []
        loop.set_exception_handler(lambda _, context: problems.append(context))
        later, ticked = submit(lambda: gate.wait(LONG) and "later", name="membase-test[later]"), threading.Event()
        waiting = asyncio.create_task(wait_for_future(later, LONG))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        loop.call_soon(ticked.set)
        assert await wait_for_future(submit(lambda: ticked.wait(LONG), name="membase-test[tick]"), None)
        gate.set()  # both end now: one after its loop closed, one on this live loop
        assert await asyncio.wrap_future(later) == "later" and not later.cancelled()
        await asyncio.sleep(0)
        assert problems == []

    asyncio.run(cancelled_then_late())
    assert late.result(timeout=LONG) == "late"
    assert wait_until(lambda: not membase_threads("membase-test[late"), timeout=LONG)
    assert escaped == [] and not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- Many agents, many threads, a burst --------------------------------------------------------------

TOPICS = ["aurora", "basalt", "cobalt", "dynamo", "ember", "fjord", "glacier", "harbor", "iris", "juniper"]


class InFlight:
    """Wraps a responder, records the most requests it served at once and the threads that sent them."""

    def __init__(self, responder: Responder) -> None:
        self._responder, self._lock = responder, threading.Lock()
        self.now = self.peak = 0
        self.senders: list[threading.Thread] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.senders.append(threading.current_thread())
        try:
            return self._responder(request)
        finally:
            with self._lock:
                self.now -= 1


def topic_agents(fake: InMemoryMembase, store: MembaseMemoryStore, topics: list[str]) -> dict[str, Any]:
    for topic in topics:
        fake.remember(f"The {topic} project keeps its records in {topic}db.")
    return {topic: make_agent(store, ["ok"] * 5) for topic in topics}


def assert_own_passages(model: ScriptedModel, topic: str) -> None:
    """Every call of this agent's model saw its own topic's passage and no other topic's."""
    assert len(model.calls) == 5
    for index in range(5):
        block = model.memory_block(index) or ""
        assert f"[Main] The {topic} project keeps its records in {topic}db." in block, (topic, index)
        assert [other for other in TOPICS if other != topic and other in block] == []


async def test_ten_agents_sharing_one_store_async_on_a_loop_and_sync_from_threads_each_recall_their_own(
    fake, make_store
):
    """Each agent runs its turns in order (Strands refuses concurrent calls on one agent); the ten run at once: five
    on this event loop, five synchronously, each from a thread of its own."""
    in_flight = InFlight(delayed(fake, 0.05))
    fake.always("POST", "/v1/search", in_flight)
    store = make_store()
    agents = topic_agents(fake, store, TOPICS)

    async def turns(topic: str) -> list[str]:
        agent, _ = agents[topic]
        if topic in TOPICS[:5]:
            return [str(await agent.invoke_async(f"What about {topic}, turn {turn}?")).strip() for turn in range(5)]
        return await asyncio.to_thread(lambda: [str(agent(f"What about {topic}, call {n}?")).strip() for n in range(5)])

    assert await asyncio.gather(*(turns(topic) for topic in TOPICS)) == [["ok"] * 5] * 10
    for topic, (_, model) in agents.items():
        assert_own_passages(model, topic)
    assert len(fake.sent("POST", "/v1/search")) == 50  # one per turn: none doubled, none lost
    assert in_flight.peak >= 2  # healthy recalls ran side by side
    counters = store.counters()
    assert (counters["recalls"], counters["recall_hits"], counters["recall_skipped"]) == (50, 50, 0)


def test_consecutive_recalls_run_on_one_reused_thread_named_after_the_store(threads, fake, make_store):
    fake.remember(FACT)
    in_flight = InFlight(routed(fake))
    fake.always("POST", "/v1/search", in_flight)
    agent, model = make_agent(make_store(name="reused"))
    for turn in range(5):
        agent(QUESTION)
        assert f"[Main] {FACT}" in (model.memory_block(turn) or "")
        assert wait_until(lambda: in_flight.senders[-1].name == IDLE_NAME, timeout=LONG)  # waits for the next call
    assert len(set(in_flight.senders)) == 1, f"{len(set(in_flight.senders))} threads served 5 recalls in turn"


def test_a_burst_of_a_hundred_recalls_on_one_store_all_return_memory(monkeypatch):
    """A burst of recalls on one store: none is dropped or doubled, and the connections they opened stay open for the
    next turns. Over a loopback server that answers in 20 ms; how fast the burst goes is measured in the benchmarks."""
    burst = 100
    monkeypatch.setattr(_runtime, "IDLE_SECONDS", LONG)  # no thread retires (closing its connection) meanwhile
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        server.latency = 0.02
        store = MembaseMemoryStore(api_key=API_KEY, base_url=server.url, name="burst", recall_timeout=120.0)
        agents = [make_agent(store, ["ok"]) for _ in range(burst)]  # several agents share one store, as users do

        async def all_at_once() -> list[object]:
            return await asyncio.gather(
                *(agent.invoke_async(f"{QUESTION} ({i})") for i, (agent, _) in enumerate(agents))
            )

        try:
            answers = asyncio.run(all_at_once())
        finally:
            store.close()

        assert [str(answer).strip() for answer in answers] == ["ok"] * burst
        assert all(f"[Main] {FACT}" in (model.memory_block() or "") for _, model in agents)
        assert len(server.fake.sent("POST", "/v1/search")) == burst  # each sent once: none dropped, none doubled
        counters = store.counters()
        assert (counters["recalls"], counters["recall_hits"], counters["recall_errors"]) == (burst, burst, 0)
        # Kept-alive connections for the next turns, up to 32 of them (the rest closed once their answer was read).
        assert 0 < server.open_connections <= 32 and server.connections <= burst


# --- A stalled Membase, a refused key ---------------------------------------------------------------------
def test_a_stalled_membase_holds_no_turn_and_leaves_at_most_one_recall_thread_per_store(fake, make_store, gates):
    fake.remember(FACT)
    gate = gates.new()
    fake.always("POST", "/v1/search", hang(gate, then=routed(fake)))
    stores = [make_store(name="first", recall_timeout=BUDGET), make_store(name="second", recall_timeout=BUDGET)]
    agents = [make_agent(store, ["ok"] * 10)[0] for store in stores]

    def recall_threads() -> list[threading.Thread]:
        return [t for t in membase_threads(RECALL_THREAD) if t.name.endswith(("[first]", "[second]"))]

    peak = 0
    for turn in range(20):  # each turn returns while the gate holds the request: none waits for the thread
        agents[turn % 2](f"{QUESTION} ({turn})")
        peak = max(peak, len(recall_threads()))

    assert peak <= len(stores)
    assert len(fake.sent("POST", "/v1/search")) == len(stores)  # one late request per store, the rest skipped
    assert [(s.counters()["recall_timeouts"], s.counters()["recall_skipped"]) for s in stores] == [(1, 9), (1, 9)]
    gate.set()
    assert wait_until(lambda: not recall_threads(), timeout=LONG)
    fake.heal()
    agent, model = make_agent(stores[0], ["ok"])
    agent(QUESTION)  # the stall is over: recall resumes at once
    assert FACT in (model.memory_block() or "")


async def test_after_a_403_automatic_recall_pauses_for_the_cooldown_while_the_tools_still_try(fake, make_store, caplog):
    caplog.set_level(logging.DEBUG)
    fake.remember(FACT)
    fake.always("POST", "/v1/search", status(403, "key revoked"))
    store = make_store(access_cooldown=0.3)
    agent, model = make_agent(store, ["ok", "ok", ToolCall("membase_search", {"query": "ledger"}), "ok"])

    await agent.invoke_async(QUESTION)
    [warned] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "narrowed or revoked" in warned  # one warning, the manager's: the store's own line that it paused is INFO
    await agent.invoke_async("And the ledger backups?")
    assert len(fake.sent("POST", "/v1/search")) == 1  # one refusal; the next turn sent nothing
    assert await store.search(QUESTION) == []  # skipped while paused: not a failure, so the manager stays quiet
    assert store.counters()["recall_skipped"] == 2
    await agent.invoke_async("Search the ledger for me")  # the tools still try, and the model hears why they failed
    assert len(fake.sent("POST", "/v1/search")) == 2
    assert model.tool_results()[-1]["status"] == "error"
    assert "narrowed or revoked" in model.tool_result_text()

    fake.heal()  # the key is restored: after the cool-down, automatic recall resumes
    deadline = time.monotonic() + LONG
    while not (found := await store.search(QUESTION)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert [entry.content for entry in found] == [f"[Main] {FACT}"]
    [paused] = [r for r in caplog.records if "automatic recall paused" in r.getMessage()]
    assert paused.levelname == "INFO" and "0.3 s" in paused.getMessage()

    unpaused = make_store(access_cooldown=None)
    fake.always("POST", "/v1/search", status(403))
    for _ in range(3):
        with pytest.raises(MembaseAccessError):
            await unpaused.search(QUESTION)
    assert len(fake.sent("POST", "/v1/search")) == 3 + 3  # without a cool-down every recall tries again

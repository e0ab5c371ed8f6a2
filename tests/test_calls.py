"""One way to call Membase: a ``Call`` on a daemon thread of its own, awaited from any event loop within a budget,
ending in one ``Outcome``; and the store on them, with many agents, many threads, a burst, a stalled Membase and a
refused key.

The first part drives ``_calls.Call`` directly with calls of the test's own; the rest goes through a real
``strands.Agent`` and counts requests, counters and thread names.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx
import pytest

from membase_strands import MembaseAccessError, MembaseMemoryStore, _calls
from membase_strands._calls import ANSWERED, FAILED, IDLE_NAME, MAY_HAVE_ARRIVED, REFUSED, Call, Outcome
from membase_strands._failures import Refused
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
    sdk_client,
    wait_until,
)

BUDGET = 0.5  # for the tests about a budget: what must outlast it is held back by a gate, not by the clock


class Ends:
    """Records what a call's ``on_end`` and ``on_late_end`` were told, in order."""

    def __init__(self) -> None:
        self.told: list[tuple[str, Any, str | None]] = []
        self.late = threading.Event()

    def on_end(self, outcome: Outcome[Any]) -> None:
        self.told.append(("end", outcome.kind, None))

    def on_late_end(self, outcome: Outcome[Any], why: str) -> None:
        self.told.append(("late", outcome.kind, why))
        self.late.set()


def call(work: Any, name: str = "membase-test[unit]", ends: Ends | None = None) -> Call[Any]:
    ends = ends or Ends()
    return Call(work, name=name, mask=lambda error: error, on_end=ends.on_end, on_late_end=ends.on_late_end).start()


# --- A call on a thread --------------------------------------------------------------------------
def test_a_call_runs_on_a_daemon_thread_named_after_it_and_ends_in_one_outcome(monkeypatch):
    escaped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    where = threading.current_thread
    ran = call(lambda: (where().name, where().daemon, where() is threading.main_thread()))
    assert ran.wait_blocking(LONG, owner=True) == Outcome(ANSWERED, ("membase-test[unit]", True, False))

    failed = call(lambda: 1 / 0).wait_blocking(LONG, owner=True)
    assert failed is not None and failed.kind == FAILED and isinstance(failed.error, ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    refused = call(lambda: (_ for _ in ()).throw(Refused("This Membase key may not save notes.", "level")))
    assert refused.wait_blocking(LONG, owner=True).kind == REFUSED  # type: ignore[union-attr]
    assert escaped == []  # every error went to the outcome, and nowhere else


def test_what_membase_answered_is_told_from_what_may_have_reached_it(fake):
    """The outcome of a call through the SDK: a Membase error (its envelope) failed for sure; a request that could not
    connect was never sent; a timeout after sending, or an answer from something in front of Membase (a 5xx), may
    have arrived."""

    def outcome_of(responder: Responder) -> str:
        fake.on("POST", "/v1/memories", responder)
        client = sdk_client(fake)
        return call(lambda: client.memories.add("I like green tea.")).wait_blocking(LONG, owner=True).kind  # type: ignore[union-attr]

    def connect_refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    def read_timed_out(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    assert outcome_of(fake.answer) == ANSWERED
    assert outcome_of(status(400, "content is required")) == FAILED
    assert outcome_of(status(429, "busy")) == FAILED
    assert outcome_of(connect_refused) == FAILED
    assert outcome_of(read_timed_out) == MAY_HAVE_ARRIVED
    for gateway_said in (502, 503, 520, 524):
        assert outcome_of(lambda request, code=gateway_said: httpx.Response(code, text="<html>")) == MAY_HAVE_ARRIVED


def test_every_call_gets_a_thread_at_once_however_many_others_hang(gates):
    gates_of, running = [gates.new() for _ in range(40)], [threading.Event() for _ in range(40)]

    def held(gate: threading.Event, started: threading.Event) -> bool:
        started.set()
        return gate.wait(LONG)

    busy = [call(lambda g=gate, r=running[n]: held(g, r), f"membase-test[busy-{n}]") for n, gate in enumerate(gates_of)]
    assert all(event.wait(LONG) for event in running)  # each got a thread of its own while the others hung
    assert call(lambda: "ran").wait_blocking(LONG, owner=True) == Outcome(ANSWERED, "ran")
    for gate in gates_of:
        gate.set()
    assert all(each.wait_blocking(LONG, owner=True) == Outcome(ANSWERED, True) for each in busy)


def test_a_call_whose_thread_cannot_start_ends_at_once_as_failed(monkeypatch):
    def refuse(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_calls, "_threads", _calls._Threads())  # no idle thread to take the call
    monkeypatch.setattr(threading.Thread, "start", refuse)
    ends = Ends()
    refused = call(lambda: "never", ends=ends)
    assert refused.done() and refused.outcome is not None and refused.outcome.kind == FAILED
    assert ends.told == [("end", FAILED, None)]


def test_an_idle_thread_takes_the_next_call(monkeypatch):
    monkeypatch.setattr(_calls, "IDLE_SECONDS", LONG)  # a slow machine cannot see it retire between the two calls
    monkeypatch.setattr(_calls, "_threads", _calls._Threads())
    where = threading.current_thread
    first = call(where, "membase-test[first]").wait_blocking(LONG, owner=True)
    assert first is not None and wait_until(lambda: first.value.name == IDLE_NAME, timeout=LONG)  # type: ignore[union-attr]
    second = call(lambda: (where(), where().name), "membase-test[second]").wait_blocking(LONG, owner=True)
    assert second is not None and second.value == (first.value, "membase-test[second]")  # type: ignore[union-attr]


def test_an_idle_thread_ends_once_idle_for_long(monkeypatch):
    monkeypatch.setattr(_calls, "IDLE_SECONDS", 0.05)
    monkeypatch.setattr(_calls, "_threads", _calls._Threads())
    ran = call(threading.current_thread, "membase-test[once]").wait_blocking(LONG, owner=True)
    assert ran is not None
    ran.value.join(LONG)  # type: ignore[union-attr]
    assert not ran.value.is_alive()  # type: ignore[union-attr]


def test_a_callback_that_raises_still_ends_the_call_and_wakes_its_waiters(monkeypatch):
    escaped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))

    def broken(outcome: Outcome[Any]) -> None:
        raise RuntimeError("a bug in a callback")

    broken_call = Call(threading.current_thread, name="membase-test[broken]", mask=lambda error: error, on_end=broken)
    outcome = broken_call.start().wait_blocking(LONG, owner=True)
    assert outcome is not None and outcome.kind == ANSWERED
    outcome.value.join(LONG)  # the bug surfaces on the call's thread, as any error a thread does not catch
    assert [str(error) for error in escaped] == ["a bug in a callback"]


# --- Waiting for a call from an event loop -------------------------------------------------------
def test_one_call_is_awaited_from_any_loop_and_a_call_that_ended_is_given_at_once(gates):
    gate = gates.new()
    shared = call(lambda: gate.wait(LONG) and "shared")
    results: list[object] = []
    wait = shared.wait
    waiters = [threading.Thread(target=lambda: results.append(asyncio.run(wait(LONG, owner=False)))) for _ in "ab"]
    for thread in waiters:
        thread.start()
    gate.set()
    for thread in waiters:
        thread.join(LONG)
    assert results == [Outcome(ANSWERED, "shared")] * 2  # two loops waited for one call at once
    # Ended: given at once, whatever the budget.
    assert asyncio.run(shared.wait(0.001, owner=True)) == Outcome(ANSWERED, "shared")


def test_an_owner_that_stops_waiting_leaves_the_call_running_and_hears_of_its_end_once(gates, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    escaped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    gate, ends = gates.new(), Ends()
    late = call(lambda: gate.wait(LONG) and "late", ends=ends)
    # asyncio.run returns while the call runs: nothing waits for its thread.
    assert asyncio.run(late.wait(BUDGET, owner=True)) is None
    assert not late.done()
    assert asyncio.run(late.wait(BUDGET, owner=False)) is None  # another waiter that leaves changes nothing

    async def cancelled_then_late() -> None:
        loop = asyncio.get_running_loop()
        problems: list[dict[str, object]] = []
        loop.set_exception_handler(lambda _, context: problems.append(context))
        later_ends = Ends()
        later = call(lambda: gate.wait(LONG) and "later", ends=later_ends)
        waiting = asyncio.create_task(later.wait(LONG, owner=True))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.set()  # both end now: one whose waiter's loop has closed, one whose waiter was cancelled on this loop
        assert await later.wait(LONG, owner=True) == Outcome(ANSWERED, "later")
        assert await asyncio.to_thread(later_ends.late.wait, LONG)
        assert later_ends.told == [("end", ANSWERED, None), ("late", ANSWERED, "cancelled")]
        await asyncio.sleep(0)
        assert problems == []

    asyncio.run(cancelled_then_late())
    assert ends.late.wait(LONG) and ends.told == [("end", ANSWERED, None), ("late", ANSWERED, "timeout")]
    assert wait_until(lambda: not membase_threads("membase-test[unit"), timeout=LONG)
    assert escaped == [] and not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_call_that_ends_as_its_budget_runs_out_gives_its_outcome_to_its_caller_not_to_a_late_report():
    ends = Ends()
    ended = call(lambda: "in time", ends=ends)
    assert ended.wait_blocking(LONG, owner=True) == Outcome(ANSWERED, "in time")
    # A budget that ran out at once changes nothing.
    assert asyncio.run(ended.wait(0, owner=True)) == Outcome(ANSWERED, "in time")
    assert ends.told == [("end", ANSWERED, None)]


# --- Many agents, many threads, a burst --------------------------------------------------------------

TOPICS = ["aurora", "basalt", "cobalt", "dynamo", "ember", "fjord", "glacier", "harbor", "iris", "juniper"]


class InFlight:
    """Wraps a responder, records the most requests it served at once and the threads that sent them."""

    def __init__(self, responder: Responder) -> None:
        self._responder, self._lock = responder, threading.Lock()
        self.now = self.peak = 0
        self.senders: list[threading.Thread] = []
        self.names: list[str] = []  # each sender's name as it sent

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.senders.append(threading.current_thread())
            self.names.append(threading.current_thread().name)
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


def test_consecutive_recalls_run_on_one_reused_thread_named_after_the_store(fake, make_store):
    fake.remember(FACT)
    in_flight = InFlight(routed(fake))
    fake.always("POST", "/v1/search", in_flight)
    agent, model = make_agent(make_store(name="reused"))
    for turn in range(5):
        agent(QUESTION)
        assert f"[Main] {FACT}" in (model.memory_block(turn) or "")
        assert wait_until(lambda: in_flight.senders[-1].name == IDLE_NAME, timeout=LONG)  # waits for the next call
    assert in_flight.names == ["membase-recall[reused]"] * 5
    assert len(set(in_flight.senders)) == 1, f"{len(set(in_flight.senders))} threads served 5 recalls in turn"


def test_a_burst_of_a_hundred_recalls_on_one_store_all_return_memory():
    """A burst of recalls on one store: none is dropped or doubled, and the connections they opened stay open for the
    next turns. Over a loopback server that answers in 20 ms; how fast the burst goes is measured in the benchmarks."""
    burst = 100
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
            opened = server.connections
            assert asyncio.run(store.search(QUESTION))  # the next turn goes out on a connection kept alive
            assert server.connections == opened <= burst
            # Up to 32 kept alive for the next turns; the rest closed once their answer was read.
            assert server.wait_for(lambda: server.open_connections <= 32)
        finally:
            store.close()

        assert [str(answer).strip() for answer in answers] == ["ok"] * burst
        assert all(f"[Main] {FACT}" in (model.memory_block() or "") for _, model in agents)
        assert len(server.fake.sent("POST", "/v1/search")) == burst + 1  # each sent once: none dropped, none doubled
        counters = store.counters()
        assert (counters["recalls"], counters["recall_hits"], counters["recall_errors"]) == (burst + 1, burst + 1, 0)


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

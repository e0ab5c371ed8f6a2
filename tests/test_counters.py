"""``store.counters()``: what recall, tools and writes did, counted through a real Agent."""

from __future__ import annotations

import asyncio
import threading

import pytest

from membase_strands._counters import Counters
from membase_strands.testing import ToolCall, hang, status
from tests.support.store_helpers import FACT, QUESTION, make_agent, routed, wait_until

STANDARD = (
    "recalls",
    "recall_hits",
    "recall_empty",
    "recall_timeouts",
    "recall_skipped",
    "recall_cancelled",
    "recall_late_completions",
    "recall_errors",
    "writes_saved",
    "writes_deduplicated",
    "write_timeouts",
    "write_cancellations",
    "write_errors",
)


def changed(counts: dict[str, int]) -> dict[str, int]:
    """Only the counts that are not zero."""
    return {name: value for name, value in counts.items() if value}


def test_a_new_store_has_every_standard_count_at_zero(make_store):
    counts = make_store().counters()

    assert type(counts) is dict
    assert set(STANDARD) <= set(counts)
    assert changed(counts) == {}
    assert all(type(value) is int for value in counts.values())


def test_a_snapshot_is_a_copy(fake, make_store):
    store = make_store()
    snapshot = store.counters()
    snapshot["recalls"] = 99

    assert store.counters()["recalls"] == 0


def test_a_conversation_counts_recalls_hits_and_empty_recalls(fake, make_store):
    fake.remember(FACT)
    store = make_store()
    agent, model = make_agent(store, ["Postgres.", "Hello.", "Postgres again."])

    agent(QUESTION)
    agent("Good morning, how are you")
    agent(QUESTION)

    assert changed(store.counters()) == {"recalls": 3, "recall_hits": 2, "recall_empty": 1}
    assert len(fake.sent("POST", "/v1/search")) == 3


def test_a_stalled_recall_counts_a_timeout_then_skips_then_a_late_completion(fake, make_store, gates):
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall, then=routed(fake)))
    # The first recall's budget runs out on the stall whatever it is; the last must fit a whole recall in it.
    store = make_store(recall_timeout=1.0)
    agent, model = make_agent(store, ["a", "b", "c", "d"])

    agent(QUESTION)
    assert changed(store.counters()) == {"recalls": 1, "recall_timeouts": 1}

    agent(QUESTION)
    agent(QUESTION)
    assert changed(store.counters()) == {"recalls": 3, "recall_timeouts": 1, "recall_skipped": 2}

    stall.set()
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=30.0)
    assert wait_until(lambda: not store._recall.waking, timeout=30.0)

    agent(QUESTION)
    assert FACT in (model.memory_block() or "")
    assert changed(store.counters()) == {
        "recalls": 4,
        "recall_hits": 1,
        "recall_timeouts": 1,
        "recall_skipped": 2,
        "recall_late_completions": 1,
    }


def test_a_late_recall_that_fails_still_counts_as_a_late_completion(fake, make_store, gates):
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall))  # then a read timeout
    store = make_store(recall_timeout=0.3)
    agent, _ = make_agent(store, ["a"])

    agent(QUESTION)
    stall.set()

    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=30.0)
    assert store.counters()["recall_errors"] == 0  # the turn already went on; the late failure was only logged


def test_a_refused_recall_counts_an_access_error_then_skips_while_paused(fake, make_store):
    fake.always("POST", "/v1/search", status(403))
    store = make_store()
    agent, model = make_agent(store, ["a", "b"])

    agent(QUESTION)
    assert changed(store.counters()) == {"recalls": 1, "recall_errors": 1, "errors.access": 1}

    agent(QUESTION)
    assert changed(store.counters()) == {"recalls": 2, "recall_errors": 1, "errors.access": 1, "recall_skipped": 1}
    assert len(fake.sent("POST", "/v1/search")) == 1
    assert model.memory_block() is None


def test_other_recall_failures_are_counted_by_kind(fake, make_store):
    fake.always("POST", "/v1/search", status(422, "no model configured"))
    store = make_store()
    agent, _ = make_agent(store, ["a"])

    agent(QUESTION)

    assert changed(store.counters()) == {"recalls": 1, "recall_errors": 1, "errors.unavailable": 1}


def test_tool_calls_are_counted_per_tool(fake, make_store):
    fake.remember(FACT)
    store = make_store()
    script = [
        ToolCall("membase_search", {"query": "ledger database"}),
        ToolCall("membase_search", {"query": "postgres"}),
        ToolCall("membase_profile", {}),
        ToolCall("membase_save", {"content": "I prefer green tea."}),
        "done",
    ]
    agent, model = make_agent(store, script, injection=False)

    agent("Look things up and remember that I prefer green tea.")

    assert changed(store.counters()) == {
        "tool_calls.membase_search": 2,
        "tool_calls.membase_profile": 1,
        "tool_calls.membase_save": 1,
    }


def test_a_failed_tool_call_counts_its_error_kind_but_not_as_a_recall(fake, make_store):
    fake.always("POST", "/v1/search", status(403))
    store = make_store()
    agent, model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), "done"], injection=False)

    agent("look it up")

    assert "narrowed or revoked" in model.tool_result_text()
    assert changed(store.counters()) == {"tool_calls.membase_search": 1, "errors.access": 1}


def test_captured_writes_are_counted_as_saved(fake, make_store):
    store = make_store(capture=True, extraction=True, container="Main")
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent("I like green tea")
    agent("I live in Lisbon")

    assert store.counters()["writes_saved"] == 2
    assert len(fake.sent("POST", "/v1/memories")) == 2


async def test_a_write_sent_again_is_counted_as_deduplicated(fake, make_store):
    store = make_store(capture=True, container="Main")

    await store.add("I prefer green tea.")
    await store.add("I prefer green tea.")

    counts = store.counters()
    assert counts["writes_saved"] == 1 and counts["writes_deduplicated"] == 1
    assert len(fake.sent("POST", "/v1/memories")) == 1


async def test_a_failed_write_is_counted_by_kind(fake, make_store):
    fake.always("POST", "/v1/memories", status(403))
    store = make_store(capture=True, container="Main")

    with pytest.raises(PermissionError):
        await store.add("I prefer green tea.")

    assert changed(store.counters()) == {"write_errors": 1, "errors.access": 1}


def test_counts_from_many_threads_and_event_loops_add_up_exactly(fake, make_store):
    fake.remember(FACT)
    store = make_store(recall_timeout=30.0)
    threads, searches = 8, 25
    start = threading.Barrier(threads)
    failures: list[BaseException] = []

    async def recall_many() -> None:
        for _ in range(searches):
            assert await store.search(QUESTION)

    def in_own_loop() -> None:
        start.wait()
        try:
            asyncio.run(recall_many())
        except BaseException as failure:  # noqa: BLE001 - reported below
            failures.append(failure)

    workers = [threading.Thread(target=in_own_loop) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)

    assert failures == []
    assert changed(store.counters()) == {"recalls": threads * searches, "recall_hits": threads * searches}


def test_the_counter_itself_is_exact_under_contention():
    counters = Counters()
    threads, adds = 8, 5000
    start = threading.Barrier(threads)

    def work() -> None:
        start.wait()
        for _ in range(adds):
            counters.add("recalls")
            counters.add("errors.timeout", 2)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)

    counts = counters.snapshot()
    assert counts["recalls"] == threads * adds
    assert counts["errors.timeout"] == 2 * threads * adds

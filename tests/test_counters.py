"""``store.counters()`` and ``pool.counters()``: what recall, tools and writes did, counted through a real Agent.

The count of each failure kind on each path is in the fault matrix (``test_faults.py``).
"""

from __future__ import annotations

import asyncio
import threading

from membase_strands._telemetry import STANDARD
from membase_strands.testing import ToolCall, hang, status
from tests.support.store_helpers import FACT, QUESTION, make_agent, routed, wait_until


def changed(counts: dict[str, int]) -> dict[str, int]:
    """Only the counts that are not zero."""
    return {name: value for name, value in counts.items() if value}


def test_a_new_store_counts_every_standard_name_at_zero_and_hands_out_a_copy(make_store):
    store = make_store()
    counts = store.counters()
    counts["recalls"] = 99

    assert type(counts) is dict and set(STANDARD) <= set(counts)
    assert {"writes_sent_again", "writes_lost"} <= set(STANDARD)
    assert changed(store.counters()) == {}
    assert all(type(value) is int for value in store.counters().values())


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
    # Counted last, once the guard is down and the outcome logged: the next recall is sent.
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=30.0)
    agent(QUESTION)
    assert FACT in (model.memory_block() or "")
    assert changed(store.counters()) == {
        "recalls": 4,
        "recall_hits": 1,
        "recall_timeouts": 1,
        "recall_skipped": 2,
        "recall_late_completions": 1,
    }


def test_a_refused_recall_counts_an_access_error_then_skips_while_paused(fake, make_store):
    fake.always("POST", "/v1/search", status(403))
    store = make_store()
    agent, model = make_agent(store, ["a", "b"])

    agent(QUESTION)
    agent(QUESTION)

    assert changed(store.counters()) == {"recalls": 2, "recall_errors": 1, "errors.access": 1, "recall_skipped": 1}
    assert len(fake.sent("POST", "/v1/search")) == 1
    assert model.memory_block() is None


def test_tool_calls_are_counted_per_tool_and_never_as_recalls(fake, make_store):
    fake.remember(FACT)
    fake.on("POST", "/v1/search", routed(fake), status(403))
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
        "errors.access": 1,
    }


async def test_a_write_sent_again_is_counted_as_deduplicated(fake, make_store):
    store = make_store(capture=True, container="Main")

    await store.add("I prefer green tea.")
    await store.add("I prefer green tea.")

    assert changed(store.counters()) == {"writes_saved": 1, "writes_deduplicated": 1}
    assert len(fake.sent("POST", "/v1/memories")) == 1


def test_counts_from_many_threads_and_event_loops_add_up_exactly(fake, make_store):
    fake.remember(FACT)
    store = make_store()
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


def test_a_pool_counts_what_every_store_it_built_did(fake):
    fake.account("key-bob").remember(FACT)
    with fake.pool(lambda user: f"key-{user}", recall_timeout=30.0) as pool:
        for user, turns in (("alice", 1), ("bob", 2)):
            agent, _ = make_agent(pool.store_for(user), ["ok"] * turns)
            for _ in range(turns):
                agent(QUESTION)

        assert changed(pool.store_for("bob").counters()) == {"recalls": 2, "recall_hits": 2}
        assert changed(pool.counters()) == {"recalls": 3, "recall_hits": 2, "recall_empty": 1}

"""What a store did, recorded once (``_log``): ``store.counters()`` and ``pool.counters()``, and the ``membase.*``
attributes the store sets on the span that is current (Strands' own: the library starts no span), through a real
Agent over the fake Membase. The counts of each failure kind on each path are asserted by the fault matrix
(``test_faults.py``).

OpenTelemetry's global tracer provider can be set once per process: conftest's ``spans`` keeps the spans that end
during a test (on the SDK tracer provider it sets or joins).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from membase_strands._log import STANDARD
from membase_strands.testing import API_KEY, ToolCall, hang, status
from tests.support.leaks import span_texts
from tests.support.store_helpers import FACT, QUESTION, make_agent, routed

BUDGET = 0.3
SAID = "I like green tea"


def attrs(span: ReadableSpan, *names: str) -> tuple[Any, ...]:
    """The span's ``membase.<name>`` attributes, in order (``None`` where one is absent)."""
    return tuple((span.attributes or {}).get(f"membase.{name}") for name in names)


def annotated(spans: InMemorySpanExporter, store: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if (s.attributes or {}).get("membase.store") == store]


# --- Attributes on the span that is current -----------------------------------------------------------
def test_the_store_starts_no_span_and_annotates_the_one_that_is_current_with_no_words_or_key(
    fake, make_store, gates, spans
):
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", routed(fake), routed(fake), hang(stall, then=routed(fake)))
    store = make_store(name="traced", recall_timeout=BUDGET, capture=True, extraction=True, container="Main")
    agent, _ = make_agent(store, [ToolCall("membase_search", {"query": "ledger database"}), "ok", "ok"])

    agent(SAID)  # a recall, a tool call and a captured write
    agent(QUESTION)  # a recall that runs out of time

    assert not [s.name for s in spans.get_finished_spans() if s.name.startswith("membase")]
    if "memory.search" in {s.name for s in spans.get_finished_spans()}:  # Strands 1.50+ has spans of its own
        recalls = [s for s in annotated(spans, "traced") if s.name == "memory.search"]
        assert [attrs(s, "outcome") for s in recalls] == [("empty",), ("timeout",)]
        [tool] = [s for s in annotated(spans, "traced") if s.name.startswith("execute_tool")]
        assert attrs(tool, "outcome", "passages") == ("hit", 1)
        assert all(str(attrs(s, "key")[0]).startswith("sha256:") for s in recalls)  # the key's hint, never the key
    for span in spans.get_finished_spans():  # Strands' own events hold the words; what the store set never does
        carried = " ".join(str(value) for name, value in (span.attributes or {}).items() if name.startswith("membase."))
        assert API_KEY not in carried and "green tea" not in carried and "Postgres" not in carried
    stall.set()


async def test_a_write_already_saved_is_said_on_the_span_that_is_current(fake, make_store, spans):
    store = make_store(name="dedupe", capture=True, container="Main")

    with trace.get_tracer("test").start_as_current_span("first"):
        await store.add(SAID)
    with trace.get_tracer("test").start_as_current_span("second"):
        await store.add(SAID)

    first, second = sorted(annotated(spans, "dedupe"), key=lambda s: s.name)
    assert (first.name, attrs(first, "sent", "deduplicated", "outcome")) == ("first", (1, 0, "saved"))
    assert (second.name, attrs(second, "sent", "deduplicated")) == ("second", (0, 1))
    assert len(fake.sent("POST", "/v1/memories")) == 1


async def test_a_failed_write_records_the_kind_never_the_servers_text(fake, make_store, spans):
    fake.on("POST", "/v1/memories", status(500, f"boom {API_KEY} {SAID}"))
    store = make_store(name="failwrite", capture=True, container="Main")

    with trace.get_tracer("test").start_as_current_span("turn"), pytest.raises(Exception, match="boom"):
        await store.add(SAID)

    [write] = annotated(spans, "failwrite")
    assert attrs(write, "outcome", "error_kind") == ("error", "server_error")
    assert not any(API_KEY in text or "boom" in text for text in span_texts(write))


# --- Counters ------------------------------------------------------------------------------------


def changed(counts: dict[str, int]) -> dict[str, int]:  # only the counts that are not zero
    return {name: value for name, value in counts.items() if value}


def test_a_new_store_counts_every_standard_name_at_zero_and_hands_out_a_copy(make_store):
    store = make_store()
    counts = store.counters()
    counts["recalls"] = 99

    assert type(counts) is dict and set(STANDARD) <= set(counts)
    assert {"writes_unknown", "writes_lost"} <= set(STANDARD)
    assert changed(store.counters()) == {}
    assert all(type(value) is int for value in store.counters().values())


def test_tool_calls_are_counted_per_tool_and_never_as_recalls(fake, make_store):
    fake.remember(FACT)
    fake.on("POST", "/v1/search", routed(fake), status(403))
    store = make_store()
    script = [ToolCall("membase_search", {"query": q}) for q in ("ledger database", "postgres")]
    script += [ToolCall("membase_profile", {}), ToolCall("membase_save", {"content": "I prefer green tea."}), "done"]
    agent, model = make_agent(store, script, injection=False)

    agent("Look things up and remember that I prefer green tea.")

    assert changed(store.counters()) == {
        "tool_calls.membase_search": 2,
        "tool_calls.membase_profile": 1,
        "tool_calls.membase_save": 1,
        "errors.access": 1,
    }


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
    [worker.start() for worker in workers]
    [worker.join(30) for worker in workers]

    assert failures == []
    assert changed(store.counters()) == {"recalls": threads * searches, "recall_hits": threads * searches}


def test_a_pool_counts_what_every_store_it_built_did(fake):
    fake.account("mb_key_of_bob").remember(FACT)
    with fake.pool(lambda user: f"mb_key_of_{user}", recall_timeout=30.0) as pool:
        for user, turns in (("alice", 1), ("bob", 2)):
            agent, _ = make_agent(pool.store_for(user), ["ok"] * turns)
            for _ in range(turns):
                agent(QUESTION)

        assert changed(pool.store_for("bob").counters()) == {"recalls": 2, "recall_hits": 2}
        assert changed(pool.counters()) == {"recalls": 3, "recall_hits": 2, "recall_empty": 1}

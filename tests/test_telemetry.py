"""What a store did, recorded once (``_telemetry``): ``store.counters()`` and ``pool.counters()``, and OpenTelemetry
spans, through a real Agent over the fake Membase. The counts of each failure kind on each path are asserted by the
fault matrix (``test_faults.py``).

OpenTelemetry's global tracer provider can be set once per process: conftest's ``spans`` keeps the spans that end
during a test (on the SDK tracer provider it sets or joins).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from membase_strands import MembaseWriteTimeout, _telemetry
from membase_strands._telemetry import STANDARD
from membase_strands.testing import API_KEY, ToolCall, hang, status
from tests.support.leaks import span_texts
from tests.support.store_helpers import FACT, QUESTION, make_agent, routed, wait_until

BUDGET = 0.3
SAID = "I like green tea"


@dataclass
class Telemetry:
    exporter: InMemorySpanExporter

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def ours(self, store: str, name: str | None = None) -> list[ReadableSpan]:
        return [
            s for s in self.spans() if (s.attributes or {}).get("membase.store") == store and name in (None, s.name)
        ]

    def one(self, store: str, name: str) -> ReadableSpan:
        assert wait_until(lambda: len(self.ours(store, name)) >= 1, timeout=30.0), f"no {name} span"
        [found] = self.ours(store, name)
        return found

    def parent_name(self, span: ReadableSpan) -> str | None:
        by_id = {s.context.span_id: s.name for s in self.spans()}
        return None if span.parent is None else by_id.get(span.parent.span_id, "<not exported>")


@pytest.fixture
def otel(spans: InMemorySpanExporter) -> Telemetry:
    return Telemetry(spans)


def attrs(span: ReadableSpan, *names: str) -> tuple[Any, ...]:
    """The span's ``membase.<name>`` attributes, in order (``None`` where one is absent)."""
    return tuple((span.attributes or {}).get(f"membase.{name}") for name in names)


def test_a_turn_with_a_timed_out_recall_and_a_captured_write(fake, make_store, gates, otel):
    fake.remember(FACT)
    stall = gates.new()
    fake.on("POST", "/v1/search", hang(stall, then=routed(fake)))
    store = make_store(
        name="traced", recall_timeout=BUDGET, write_timeout=30.0, capture=True, extraction=True, container="Main"
    )
    agent, model = make_agent(store, ["Without memory.", "Still without."])

    agent(SAID)

    recall = otel.one("traced", "membase.recall")
    assert attrs(recall, "outcome", "error.kind") == ("timeout", "timeout")
    assert recall.status.status_code == trace.StatusCode.ERROR
    write = otel.one("traced", "membase.write")
    assert attrs(write, "outcome", "parts", "sent", "deduplicated", "decision") == ("saved", 1, 1, 0, "send")
    strands_spans = {s.name for s in otel.spans()}
    if "memory.search" in strands_spans:  # Strands 1.50+ wraps the store's calls in spans of its own
        assert otel.parent_name(recall) == "memory.search"
        assert otel.parent_name(write) == "memory.extract"
        assert recall.context.trace_id == next(s for s in otel.spans() if s.name == "memory.search").context.trace_id

    # While the late request holds the guard, the next turn's recall is skipped, and its span says why.
    agent("And another thing")
    assert wait_until(lambda: len(otel.ours("traced", "membase.recall")) == 2, timeout=30.0)
    skipped = otel.ours("traced", "membase.recall")[-1]
    assert attrs(skipped, "outcome", "reason") == ("skipped", "memory waking")

    # The late request ends: a new root span records it, linked to the turn's recall span.
    stall.set()
    late = otel.one("traced", "membase.recall.late")
    assert late.parent is None and [link.context.span_id for link in late.links] == [recall.context.span_id]
    assert late.attributes["membase.outcome"] == "completed" and late.attributes["membase.elapsed_s"] >= BUDGET

    assert all(API_KEY not in text for span in otel.spans() for text in span_texts(span))
    for span in otel.ours("traced"):
        carried = " ".join(span_texts(span))
        assert "green tea" not in carried and "Postgres" not in carried and "another thing" not in carried


async def test_a_write_already_saved_is_not_sent_and_its_span_says_so(fake, make_store, otel):
    store = make_store(name="dedupe", capture=True, container="Main")

    with trace.get_tracer("test").start_as_current_span("turn"):
        await store.add(SAID)
        await store.add(SAID)

    first, second = otel.ours("dedupe", "membase.write")
    assert attrs(first, "decision", "sent") == ("send", 1) and otel.parent_name(second) == "turn"
    assert attrs(second, "decision", "sent", "deduplicated", "outcome") == ("already saved", 0, 1, "saved")
    assert len(fake.sent("POST", "/v1/memories")) == 1


async def test_a_late_write_outcome_gets_a_span_linked_to_the_write(fake, make_store, gates, otel):
    stall = gates.new()
    fake.on("POST", "/v1/memories", hang(stall, then=routed(fake)))
    store = make_store(name="latewrite", capture=True, container="Main", write_timeout=BUDGET)

    with pytest.raises(MembaseWriteTimeout):
        await store.add(SAID)
    write = otel.one("latewrite", "membase.write")
    assert attrs(write, "outcome") == ("timeout",)

    stall.set()
    late = otel.one("latewrite", "membase.write.late")
    assert late.parent is None and [link.context.span_id for link in late.links] == [write.context.span_id]
    assert attrs(late, "outcome", "reason") == ("saved", "timeout")
    assert fake.saved() == [SAID]


async def test_a_failed_write_records_the_kind_never_the_servers_text(fake, make_store, otel):
    fake.on("POST", "/v1/memories", status(500, f"boom {API_KEY} {SAID}"))
    store = make_store(name="failwrite", capture=True, container="Main")

    with pytest.raises(Exception, match="boom"):
        await store.add(SAID)

    write = otel.one("failwrite", "membase.write")
    assert attrs(write, "outcome", "error.kind") == ("error", "server_error")
    assert write.status.status_code == trace.StatusCode.ERROR
    assert not any(API_KEY in text or "boom" in text for text in span_texts(write))


@pytest.mark.parametrize(("route", "outcome", "kind"), [(None, "hit", None), (status(403), "error", "access")])
def test_each_tool_call_gets_a_span_under_the_tool_span(fake, make_store, otel, route, outcome, kind):
    fake.remember(FACT)
    if route is not None:
        fake.on("POST", "/v1/search", route)
    store = make_store(name="tools")
    agent, _ = make_agent(store, [ToolCall("membase_search", {"query": "ledger database"}), "done"], injection=False)

    agent("look it up")

    span = otel.one("tools", "membase.tool")
    passages = 1 if outcome == "hit" else span.attributes.get("membase.passages")
    assert attrs(span, "tool", "outcome", "error.kind", "passages") == ("membase_search", outcome, kind, passages)
    if any(s.name.startswith("execute_tool") for s in otel.spans()):
        assert otel.parent_name(span).startswith("execute_tool")


def test_the_recall_span_counts_memories_that_could_not_answer(fake, make_store, otel):
    fake.remember(FACT)
    fake.add_memory("Archive")
    fake.cannot_answer("Archive")
    store = make_store(name="metered")
    agent, _ = make_agent(store, ["ok", "ok"])
    agent(QUESTION)
    agent(QUESTION)

    recall = otel.ours("metered", "membase.recall")[-1]
    assert attrs(recall, "outcome", "passages", "unanswered") == ("hit", 1, 1)
    assert store.counters()["recalls"] == 2


def test_without_a_tracer_the_store_records_nothing_and_recalls_as_before(fake, make_store, otel, monkeypatch):
    monkeypatch.setattr(_telemetry, "_tracer", trace.NoOpTracer())
    fake.remember(FACT)
    store = make_store(name="untraced")
    agent, model = make_agent(store, ["ok"])

    agent(QUESTION)

    assert f"[Main] {FACT}" in (model.memory_block() or "")
    assert otel.ours("untraced") == []
    assert asyncio.run(_link_in_a_task()) is None  # nothing for a late outcome to link to


async def _link_in_a_task() -> object:
    with _telemetry.operation(_telemetry.RECALL, _telemetry.Ledger("untraced")):
        return _telemetry.link_here()


# --- Counters ------------------------------------------------------------------------------------


def changed(counts: dict[str, int]) -> dict[str, int]:  # only the counts that are not zero
    return {name: value for name, value in counts.items() if value}


def test_a_new_store_counts_every_standard_name_at_zero_and_hands_out_a_copy(make_store):
    store = make_store()
    counts = store.counters()
    counts["recalls"] = 99

    assert type(counts) is dict and set(STANDARD) <= set(counts)
    assert {"writes_sent_again", "writes_lost"} <= set(STANDARD)
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

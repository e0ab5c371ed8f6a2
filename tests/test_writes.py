"""Captured writes: time-boxed, never lost, never doubled; through a real Agent, on the store, and WriteRecord."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import logging
import threading
import time
import tracemalloc
from collections import Counter
from types import SimpleNamespace
from typing import Any

import membase
import pytest
from strands.memory import AddMessagesContext, ExtractionResult, ExtractorContext
from strands.types.content import Message

from membase_strands import MembaseMemoryStore, MembaseWriteTimeout, _workers, _writes
from membase_strands._counters import Counters
from membase_strands._writes import Part, WriteRecord
from membase_strands.testing import hang, status
from tests.support.loopback import LoopbackMembase, arrived, raw_answer, stall
from tests.support.store_helpers import (
    FACT,
    QUESTION,
    Clock,
    delayed,
    make_agent,
    membase_threads,
    routed,
    timed,
    until,
    wait_until,
)

BUDGET = 0.3
SLACK = 2.0  # loaded 2-core machines
WRITE_THREAD = "membase-write["
MEMORIES = ("POST", "/v1/memories")

GREEN_TEA = "I like green tea"
LISBON = "I live in Lisbon"


def capturing(make_store, **options: Any):
    options.setdefault("write_timeout", BUDGET)
    options.setdefault("extraction", True)
    return make_store(capture=True, container="Main", **options)


def posted(fake) -> list[str]:
    """The content of every POST /v1/memories that reached Membase, failed or not."""
    return [r.body["content"] for r in fake.sent(*MEMORIES)]


def held(fake) -> list[str]:
    """What Membase holds."""
    return [note.content for note in fake.notes]


def occurrences(texts: list[str], words: str) -> int:
    return sum(text.count(words) for text in texts)


def writes_settled() -> bool:
    return not membase_threads(WRITE_THREAD)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def user(text: str) -> Message:
    return {"role": "user", "content": [{"text": text}]}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": [{"text": text}]}


# strands 1.45 hands add_messages no batch context; 1.46 and later carry the sequence numbers in one.
MANAGER_SENDS_SEQUENCE_NUMBERS = "sequence_numbers" in {f.name for f in dataclasses.fields(AddMessagesContext)}


def batch_context(numbers: list[int]) -> Any:
    """The manager's batch context for ``numbers``; on strands 1.45, a stand-in with the same attribute."""
    if MANAGER_SENDS_SEQUENCE_NUMBERS:
        return AddMessagesContext(sequence_numbers=numbers)  # type: ignore[call-arg]
    return SimpleNamespace(sequence_numbers=numbers)


def spy_on_batches(store) -> list[Any]:
    """Record the sequence numbers of every batch the manager hands the store (the store still writes it)."""
    seen: list[Any] = []
    original = store.add_messages

    async def add_messages(messages, context=None):
        seen.append(getattr(context, "sequence_numbers", None))
        return await original(messages, context)

    store.add_messages = add_messages
    return seen


# --- A hung Membase never holds a synchronous turn -----------------------------------------------


def test_a_hung_write_returns_within_the_budget_and_nothing_is_reported_saved(fake, make_store, gates, caplog):
    caplog.set_level(logging.DEBUG)
    fake.on(*MEMORIES, hang(gates.new()))
    store = capturing(make_store)
    agent, _ = make_agent(store, ["Noted."])

    result, elapsed = timed(agent, GREEN_TEA)

    assert "Noted." in str(result)
    assert elapsed < BUDGET + SLACK
    assert posted(fake) == [GREEN_TEA]  # the request was made, and is still hanging
    assert fake.notes == []
    counters = store.counters()
    assert counters["writes_saved"] == 0
    assert counters["write_timeouts"] == 1
    assert counters["writes_deduplicated"] == 0
    logged = warnings(caplog)
    assert any("write ran out of time" in m for m in logged)
    # The manager saw the failure (and so keeps the batch for a retry).
    assert any("memory extraction failed" in m for m in logged)
    assert membase_threads(WRITE_THREAD)  # the request goes on in the background


# --- A late success is not sent again ------------------------------------------------------------


def test_a_write_that_succeeds_late_is_not_sent_again_by_the_managers_retry(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store)
    batches = spy_on_batches(store)
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent(GREEN_TEA)
    assert fake.notes == []
    gate.set()
    assert wait_until(lambda: store.counters()["writes_saved"] == 1)
    assert held(fake) == [GREEN_TEA]

    agent(LISBON)

    # The manager retried the rolled-back batch together with the new turn ...
    if MANAGER_SENDS_SEQUENCE_NUMBERS:
        assert batches == [[0, 1], [0, 1, 2, 3]]
    # ... and only the new words were sent.
    assert posted(fake) == [GREEN_TEA, LISBON]
    assert held(fake) == [GREEN_TEA, LISBON]
    counters = store.counters()
    assert counters["writes_deduplicated"] == 1
    assert counters["writes_saved"] == 2
    assert counters["write_timeouts"] == 1


def test_a_retry_that_arrives_while_the_write_still_runs_waits_for_it(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store, write_timeout=1.5)
    batches = spy_on_batches(store)
    original = store.add_messages

    async def release_during_the_retry(messages, context=None):
        if len(batches) == 1:  # the second flush, while the first write still hangs
            threading.Timer(0.2, gate.set).start()
        return await original(messages, context)

    store.add_messages = release_during_the_retry
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent(GREEN_TEA)
    assert store.counters()["write_timeouts"] == 1
    assert fake.notes == []

    agent(LISBON)

    assert posted(fake) == [GREEN_TEA, LISBON]
    assert held(fake) == [GREEN_TEA, LISBON]
    counters = store.counters()
    assert counters["write_timeouts"] == 1
    assert counters["writes_deduplicated"] == 1
    assert counters["writes_saved"] == 2


# --- A late failure is sent again, once --------------------------------------------------------


@pytest.mark.parametrize("then", [None, status(500, "internal")], ids=["read-timeout", "500"])
def test_a_write_that_fails_late_is_sent_again_by_the_retry_once(fake, make_store, gates, then):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=then))
    store = capturing(make_store)
    agent, _ = make_agent(store, ["Noted.", "Noted too.", "Fine."])

    agent(GREEN_TEA)
    gate.set()
    assert wait_until(writes_settled)
    assert fake.notes == []
    counters = store.counters()
    assert counters["writes_saved"] == 0
    # The late failure is counted by the thread that saw it, before that thread ends.
    assert counters["write_errors"] == 1
    assert counters["errors.timeout" if then is None else "errors.server_error"] == 1

    agent(LISBON)

    # The failed request, then one retry carrying the old words with the new ones.
    assert len(posted(fake)) == 2
    assert occurrences(held(fake), GREEN_TEA) == 1
    assert occurrences(held(fake), LISBON) == 1
    assert store.counters()["writes_deduplicated"] == 0

    agent("Call me Sam")

    assert occurrences(held(fake), GREEN_TEA) == 1
    assert occurrences(held(fake), LISBON) == 1
    assert posted(fake)[-1] == "Call me Sam"


# --- Extractor path: only the fact that failed is sent again ----------------------------------------

FACTS = ("Sam prefers green tea", "Sam lives in Lisbon", "Sam works on ledgers")


class ThreeFacts:
    """A strands.memory Extractor that always distills the same three facts."""

    def __init__(self) -> None:
        self.batches: list[list[Message]] = []

    async def extract(self, messages: list[Message], context: ExtractorContext | None = None) -> list[ExtractionResult]:
        self.batches.append(messages)
        return [ExtractionResult(content=fact) for fact in FACTS]


def test_on_the_extractor_path_only_the_fact_that_failed_is_sent_again(fake, make_store, caplog):
    failed_once: list[str] = []
    answer = routed(fake)

    def second_fact_fails_once(request):
        body = request.content.decode()
        if FACTS[1] in body and not failed_once:
            failed_once.append(body)
            return status(500, "internal")(request)
        return answer(request)

    fake.always(*MEMORIES, second_fact_fails_once)
    extractor = ThreeFacts()
    store = capturing(make_store, extraction={"extractor": extractor})
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent("I'm Sam, I like green tea, live in Lisbon and work on ledgers")
    assert sorted(held(fake)) == sorted([FACTS[0], FACTS[2]])
    assert any("memory extraction failed" in m for m in warnings(caplog))

    agent("Thanks")

    # The manager resent the whole batch; the store sent only the fact that had failed.
    assert len(extractor.batches) == 2
    assert Counter(posted(fake)) == {FACTS[0]: 1, FACTS[1]: 2, FACTS[2]: 1}
    assert Counter(held(fake)) == {fact: 1 for fact in FACTS}
    counters = store.counters()
    assert counters["writes_deduplicated"] == 2
    assert counters["writes_saved"] == 3


# --- A new run's sequence 0 is not the old run's -------------------------------------------------


@pytest.mark.parametrize("second_words", [LISBON, GREEN_TEA], ids=["different-words", "same-words"])
def test_two_agents_on_one_store_both_starting_at_sequence_zero_are_both_saved(fake, make_store, second_words):
    store = capturing(make_store)
    batches = spy_on_batches(store)
    first, _ = make_agent(store, ["Noted."])
    first(GREEN_TEA)
    del first
    gc.collect()  # the first run's messages are gone; their identities must not be reused

    second, _ = make_agent(store, ["Noted."])
    second(second_words)

    if MANAGER_SENDS_SEQUENCE_NUMBERS:
        assert batches == [[0, 1], [0, 1]]
    assert posted(fake) == [GREEN_TEA, second_words]
    assert held(fake) == [GREEN_TEA, second_words]
    counters = store.counters()
    assert counters["writes_saved"] == 2
    assert counters["writes_deduplicated"] == 0


def test_one_agent_saying_the_same_words_twice_saves_them_twice(fake, make_store):
    store = capturing(make_store)
    agent, _ = make_agent(store, ["Noted.", "Noted again."])

    agent(GREEN_TEA)
    agent(GREEN_TEA)

    assert held(fake) == [GREEN_TEA, GREEN_TEA]
    assert store.counters()["writes_deduplicated"] == 0


# --- Recall is not held by a stuck write ---------------------------------------------------------


def test_recall_works_normally_while_a_write_is_stuck(fake, make_store, gates):
    fake.remember(FACT)
    fake.always(*MEMORIES, hang(gates.new(), then=routed(fake)))
    store = capturing(make_store, recall_timeout=8.0)
    writer, _ = make_agent(store, ["Noted."])
    writer(GREEN_TEA)
    assert membase_threads(WRITE_THREAD)  # that write is stuck

    reader, model = make_agent(store, ["We chose Postgres."])
    _, elapsed = timed(reader, QUESTION)

    assert elapsed < BUDGET + SLACK  # far below the 8 s recall budget: recall did not wait for the write
    assert f"[Main] {FACT}" in (model.memory_block() or "")
    counters = store.counters()
    assert counters["recall_hits"] >= 1
    assert counters["recall_timeouts"] == 0
    assert counters["write_timeouts"] == 2  # both agents' writes ran out of budget
    assert len(fake.notes) == 1  # only the seeded note: nothing reported saved


# --- A retry waits for the earlier request instead of sending a second one -------------------------


async def test_concurrent_writes_of_one_batch_send_one_request(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store, write_timeout=5.0)
    batch = [user(GREEN_TEA), assistant("Noted.")]
    context = batch_context([0, 1])
    releaser = threading.Timer(0.3, gate.set)
    releaser.start()
    try:
        first, second = await asyncio.gather(store.add_messages(batch, context), store.add_messages(batch, context))
    finally:
        releaser.cancel()

    assert posted(fake) == [GREEN_TEA]
    assert held(fake) == [GREEN_TEA]
    assert first is not None and first["container"] == "ctr_main"
    assert second is None  # nothing sent by the second call
    counters = store.counters()
    assert counters["writes_saved"] == 1
    assert counters["writes_deduplicated"] == 1


async def test_a_retry_that_waited_past_its_budget_still_sends_nothing(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store)
    batch = [user(GREEN_TEA)]
    context = batch_context([0])

    for _ in range(2):  # the first call, then a retry while the first request still hangs
        with pytest.raises(MembaseWriteTimeout):
            await store.add_messages(batch, context)
    assert posted(fake) == [GREEN_TEA]
    assert store.counters()["write_timeouts"] == 2

    gate.set()
    assert wait_until(lambda: store.counters()["writes_saved"] == 1)
    assert await store.add_messages(batch, context) is None

    assert posted(fake) == [GREEN_TEA]
    assert held(fake) == [GREEN_TEA]


async def test_a_retry_whose_earlier_request_fails_while_it_waits_sends_the_words_itself(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=status(500, "internal")))
    store = capturing(make_store, write_timeout=5.0)
    old = user(GREEN_TEA)
    context = batch_context([0])
    retry_context = batch_context([0, 2])
    releaser = threading.Timer(0.3, gate.set)
    releaser.start()
    try:
        first, retry = await asyncio.gather(
            store.add_messages([old], context),
            store.add_messages([old, user(LISBON)], retry_context),  # the retry, with a newer message
            return_exceptions=True,
        )
    finally:
        releaser.cancel()

    assert isinstance(first, membase.MembaseError)  # the first attempt failed and says so
    # The retry waited for the first request instead of sending a second one at the same time; when that
    # request failed, the retry had budget left and sent the words itself (old and new, once each).
    assert not isinstance(retry, BaseException), retry
    assert occurrences(held(fake), GREEN_TEA) == 1
    assert occurrences(held(fake), LISBON) == 1


# --- Nothing lost ---------------------------------------------------------------------------------


async def test_a_failed_write_is_never_reported_saved_and_a_later_attempt_saves_it_once(fake, make_store):
    fake.on(*MEMORIES, status(500, "internal"))
    store = capturing(make_store)
    batch = [user(GREEN_TEA), assistant("Noted."), user(LISBON)]
    context = batch_context([0, 1, 2])

    with pytest.raises(membase.MembaseError):
        await store.add_messages(batch, context)
    assert fake.notes == []
    assert store.counters()["writes_saved"] == 0
    assert store.counters()["write_errors"] == 1

    answer = await store.add_messages(batch, context)
    assert answer is not None and answer["container"] == "ctr_main"
    assert await store.add_messages(batch, context) is None  # a third attempt sends nothing

    assert posted(fake) == [f"{GREEN_TEA}\n{LISBON}", f"{GREEN_TEA}\n{LISBON}"]  # the failed one, then the good one
    assert held(fake) == [f"{GREEN_TEA}\n{LISBON}"]
    counters = store.counters()
    assert counters["writes_saved"] == 2  # two parts (messages) saved
    assert counters["writes_deduplicated"] == 2


async def test_a_timed_out_write_that_then_fails_is_not_counted_saved_and_the_retry_sends_it(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate))  # a read timeout once released
    store = capturing(make_store)
    batch = [user(GREEN_TEA)]
    context = batch_context([0])

    with pytest.raises(MembaseWriteTimeout):
        await store.add_messages(batch, context)
    gate.set()
    assert wait_until(writes_settled)
    assert store.counters()["writes_saved"] == 0

    await store.add_messages(batch, context)

    assert posted(fake) == [GREEN_TEA, GREEN_TEA]
    assert held(fake) == [GREEN_TEA]
    assert store.counters()["writes_saved"] == 1


async def test_add_raises_on_failure_and_the_retry_sends_the_fact_once(fake, make_store):
    fake.on(*MEMORIES, status(503, "busy"))
    store = capturing(make_store)

    with pytest.raises(membase.MembaseError):
        await store.add(FACTS[0])
    await store.add(FACTS[0])
    await store.add(FACTS[0])

    assert posted(fake) == [FACTS[0], FACTS[0]]  # one attempt each (no SDK retries), then nothing
    assert held(fake) == [FACTS[0]]


# --- write_timeout=None waits for the request ----------------------------------------------------


def test_without_a_write_timeout_the_turn_waits_for_the_request(fake, make_store):
    fake.on(*MEMORIES, delayed(fake, 0.5))
    store = capturing(make_store, write_timeout=None)
    agent, _ = make_agent(store, ["Noted."])

    _, elapsed = timed(agent, GREEN_TEA)

    assert elapsed >= 0.5
    assert held(fake) == [GREEN_TEA]  # saved by the time the call returned
    counters = store.counters()
    assert counters["write_timeouts"] == 0
    assert counters["writes_saved"] == 1


async def test_without_a_write_timeout_add_waits_for_the_request(fake, make_store):
    fake.on(*MEMORIES, delayed(fake, 0.5))
    store = capturing(make_store, write_timeout=None)

    started = time.monotonic()
    answer = await store.add(FACTS[0])

    assert time.monotonic() - started >= 0.5
    assert answer["container"] == "ctr_main"
    assert held(fake) == [FACTS[0]]


# --- WriteRecord itself --------------------------------------------------------------------------


class Sender:
    """A blocking ``send``: records the texts of each request, optionally waits on a gate or fails."""

    def __init__(self, gate: threading.Event | None = None, fail: int = 0, pause: float = 0.0) -> None:
        self.requests: list[list[str]] = []
        self.gate = gate
        self.fail = fail
        self.pause = pause
        self.arrived = threading.Event()  # set once a request is on its way
        self._lock = threading.Lock()

    def __call__(self, parts: list[Part]) -> str:
        with self._lock:
            self.requests.append([part.text for part in parts])
            failing = self.fail > 0
            self.fail -= 1
        self.arrived.set()
        if self.gate is not None:
            self.gate.wait(5.0)
        if self.pause:
            time.sleep(self.pause)
        if failing:
            raise RuntimeError("Membase said no")
        return "saved"

    def sent(self) -> list[str]:
        return [text for request in self.requests for text in request]


def part(text: str) -> Part:
    return Part(key=("fact", text), text=text)


async def test_record_forgets_a_saved_write_after_its_time():
    clock = Clock()
    record = WriteRecord("t", seconds=10.0, clock=clock)
    send = Sender()

    assert await record.write([part("a")], send, 1.0) == "saved"
    clock.advance(9.0)
    assert await record.write([part("a")], send, 1.0) is None  # still remembered
    clock.advance(2.0)
    assert await record.write([part("a")], send, 1.0) == "saved"  # forgotten: sent again

    assert send.sent() == ["a", "a"]


async def test_record_size_bound_forgets_the_oldest_saved_write_first():
    record = WriteRecord("t", size=2, clock=Clock())
    send = Sender()
    for text in "abc":
        await record.write([part(text)], send, 1.0)

    assert await record.write([part("c")], send, 1.0) is None  # makes room: forgets the oldest, "a"
    assert len(record) == 2
    assert await record.write([part("b")], send, 1.0) is None
    assert await record.write([part("a")], send, 1.0) == "saved"

    assert send.sent() == ["a", "b", "c", "a"]


async def test_record_size_bound_never_forgets_a_write_in_flight():
    gate = threading.Event()
    clock = Clock()
    counters = Counters()
    record = WriteRecord("t", counters, size=1, clock=clock)
    stuck = Sender(gate=gate)
    send = Sender()
    try:
        with pytest.raises(MembaseWriteTimeout):
            await record.write([part("x")], stuck, 0.05)
        for text in "yzw":  # each pushes past the bound: only saved writes are forgotten
            await record.write([part(text)], send, 1.0)
        assert len(record) == 2  # "x" still running, and the newest saved one

        with pytest.raises(MembaseWriteTimeout):
            await record.write([part("x")], send, 0.05)  # waits for the running request, sends nothing
        assert stuck.sent() == ["x"]
        assert "x" not in send.sent()
    finally:
        gate.set()
    assert wait_until(lambda: counters.snapshot()["writes_saved"] == 4)

    assert await record.write([part("x")], send, 1.0) is None
    assert send.sent() == ["y", "z", "w"]


async def test_record_forgets_a_failed_write_so_the_next_attempt_sends_it():
    counters = Counters()
    record = WriteRecord("t", counters, clock=Clock())
    send = Sender(fail=1)

    with pytest.raises(RuntimeError, match="said no"):
        await record.write([part("a"), part("b")], send, 1.0)
    assert len(record) == 0
    assert counters.snapshot()["writes_saved"] == 0

    assert await record.write([part("a"), part("b")], send, 1.0) == "saved"
    assert send.requests == [["a", "b"], ["a", "b"]]
    assert counters.snapshot()["writes_saved"] == 2


async def test_record_sends_only_the_parts_not_saved_yet():
    counters = Counters()
    record = WriteRecord("t", counters, clock=Clock())
    send = Sender()

    await record.write([part("a")], send, 1.0)
    await record.write([part("a"), part("b")], send, 1.0)

    assert send.requests == [["a"], ["b"]]
    assert counters.snapshot()["writes_deduplicated"] == 1


async def test_record_sends_identical_facts_added_concurrently_once():
    counters = Counters()
    record = WriteRecord("t", counters, clock=Clock())
    send = Sender(pause=0.1)

    answers = await asyncio.gather(*(record.write([part("same")], send, 2.0) for _ in range(3)))

    assert send.sent() == ["same"]
    assert sorted(answers, key=str) == [None, None, "saved"]
    assert counters.snapshot()["writes_deduplicated"] == 2


async def test_record_waits_without_a_budget():
    record = WriteRecord("t", clock=Clock())
    send = Sender(pause=0.3)

    assert await record.write([part("a")], send, None) == "saved"


async def test_the_store_sends_identical_facts_of_one_batch_once(fake, make_store):
    fake.on(*MEMORIES, delayed(fake, 0.1))
    store = capturing(make_store)

    await asyncio.gather(store.add(FACTS[0]), store.add(FACTS[0]), store.add(FACTS[1]))

    assert Counter(posted(fake)) == {FACTS[0]: 1, FACTS[1]: 1}
    assert store.counters()["writes_deduplicated"] == 1


class _SlowCallbacksFuture(concurrent.futures.Future):
    """Widens a real window: a future is done (``done()`` is True, ``concurrent.futures.wait`` returns) before its
    done-callbacks have run. Nothing the record relies on may happen in that window."""

    made: list[concurrent.futures.Future] = []

    def __init__(self) -> None:
        super().__init__()
        type(self).made.append(self)

    def _invoke_callbacks(self) -> None:
        time.sleep(0.3)
        super()._invoke_callbacks()


@pytest.fixture
def slow_callbacks(monkeypatch) -> list[concurrent.futures.Future]:
    """Make the write record's futures run their done-callbacks late; yields the futures it makes."""
    made: list[concurrent.futures.Future] = []
    monkeypatch.setattr(_SlowCallbacksFuture, "made", made)
    monkeypatch.setattr(_writes, "Future", _SlowCallbacksFuture)
    return made


async def test_record_never_reports_a_failed_write_saved_before_it_has_settled(slow_callbacks):
    gate = threading.Event()
    record = WriteRecord("t", clock=Clock())
    failing = Sender(gate=gate, fail=1)
    send = Sender()
    try:
        with pytest.raises(MembaseWriteTimeout):
            await record.write([part("a")], failing, 0.05)
    finally:
        gate.set()
    # The request has failed (its future is done) and its callbacks are about to run.
    assert wait_until(lambda: bool(slow_callbacks) and slow_callbacks[0].done(), timeout=2.0)

    answer = await record.write([part("a")], send, 1.0)

    assert send.sent() == ["a"], f"nothing sent; the write reported {answer!r} as if saved"
    assert answer == "saved"
    assert wait_until(lambda: not membase_threads(WRITE_THREAD))
    assert await record.write([part("a")], send, 1.0) is None  # the failed request's end did not undo the new entry
    assert send.sent() == ["a"]


# --- strands 1.45: no context -------------------------------------------------------------------


async def test_without_a_context_a_retried_batch_is_deduplicated_and_a_new_one_saved(fake, make_store):
    store = capturing(make_store)
    batch = [user(GREEN_TEA), assistant("Noted.")]

    await store.add_messages(batch)
    assert await store.add_messages(batch) is None  # the manager's retry: the same message objects
    await store.add_messages([*batch, user(LISBON)])  # a retry with a newer message: only that is sent
    await store.add_messages([user(GREEN_TEA)])  # a new message with the same words: a new thing said

    assert posted(fake) == [GREEN_TEA, LISBON, GREEN_TEA]
    assert held(fake) == [GREEN_TEA, LISBON, GREEN_TEA]
    assert store.counters()["writes_deduplicated"] == 2


async def test_without_a_context_a_failed_batch_is_sent_again(fake, make_store):
    fake.on(*MEMORIES, status(500, "internal"))
    store = capturing(make_store)
    batch = [user(GREEN_TEA)]

    with pytest.raises(membase.MembaseError):
        await store.add_messages(batch)
    await store.add_messages(batch)
    await store.add_messages(batch)

    assert posted(fake) == [GREEN_TEA, GREEN_TEA]
    assert held(fake) == [GREEN_TEA]


# --- A write still running when the store closes --------------------------------------------------


async def test_close_lets_a_late_write_finish_before_closing_the_client(fake, gates, caplog):
    caplog.set_level(logging.INFO)
    release = gates.new()
    fake.on(*MEMORIES, hang(release, then=fake.answer))
    store = MembaseMemoryStore(client=fake.client(), capture=True, container="Main", write_timeout=0.5)
    with pytest.raises(MembaseWriteTimeout):
        await store.add("I like green tea.")
    release.set()  # the request is still on its way when close() starts: close waits for it instead of cutting it off
    store.close()
    assert [note.content for note in fake.notes] == ["I like green tea."]
    assert any("ran out of time finished" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("then", "kind"), [(status(500), "server_error"), (None, "timeout")], ids=["500", "read-timeout"]
)
async def test_a_late_write_that_fails_says_so_and_is_counted(fake, gates, caplog, then, kind):
    caplog.set_level(logging.INFO)
    release = gates.new()
    fake.on(*MEMORIES, hang(release, then=then))
    store = MembaseMemoryStore(client=fake.client(), capture=True, container="Main", write_timeout=0.5)
    with pytest.raises(MembaseWriteTimeout):
        await store.add("I like green tea.")
    release.set()
    store.close()

    assert any("ran out of time failed" in r.getMessage() for r in caplog.records)
    counters = store.counters()
    assert counters["writes_saved"] == 0
    assert counters["write_timeouts"] == 1
    assert counters["write_errors"] == 1
    assert counters[f"errors.{kind}"] == 1


# --- close() returns once every write it waited for is on record ---------------------------------


@pytest.mark.parametrize("fails", [False, True], ids=["saved", "500"])
async def test_close_returns_only_after_a_late_writes_outcome_is_logged_and_counted(
    fake, gates, caplog, slow_callbacks, fails
):
    """The writing thread records the outcome before it settles the future ``close()`` waits on. The future's
    done-callbacks run late here (``slow_callbacks``), so nothing that counts may rely on them."""
    caplog.set_level(logging.INFO)
    release = gates.new()
    fake.on(*MEMORIES, hang(release, then=status(500, "internal") if fails else routed(fake)))
    store = MembaseMemoryStore(client=fake.client(), capture=True, container="Main", write_timeout=0.5)
    with pytest.raises(MembaseWriteTimeout):
        await store.add(GREEN_TEA)
    release.set()

    store.close()

    logged = [r.getMessage() for r in caplog.records]
    counters = store.counters()
    if fails:
        assert any("a write that ran out of time failed; the manager's retry sends it again" in m for m in logged)
        assert (counters["write_errors"], counters["errors.server_error"], counters["writes_saved"]) == (1, 1, 0)
        assert held(fake) == []
    else:
        assert any("a write that ran out of time finished; it is saved" in m for m in logged)
        assert (counters["writes_saved"], counters["write_errors"]) == (1, 0)
        assert held(fake) == [GREEN_TEA]


# --- A caller that was cancelled: the write goes on, and its outcome is still logged and counted ------

ERROR_500 = json.dumps(
    {"error": {"code": "internal", "message": "internal", "details": None, "retryable": False, "trace_id": ""}}
).encode()


async def test_a_cancelled_turns_write_that_later_fails_is_logged_and_counted(caplog):
    """A web server cancels a request's task when its client disconnects; here that lands while the turn's
    memory flush waits for a POST /v1/memories that Membase holds, then answers 500."""
    caplog.set_level(logging.INFO)
    in_flight, release = threading.Event(), threading.Event()
    with LoopbackMembase() as server:
        server.fake.on(*MEMORIES, status(500, "internal"))  # what the fake records: the note is not kept
        server.on(*MEMORIES, arrived(in_flight, stall(release, then=raw_answer(500, ERROR_500))))
        client = server.client()
        store = MembaseMemoryStore(client=client, capture=True, container="Main", extraction=True, write_timeout=10.0)
        try:
            agent, model = make_agent(store, ["Noted."])

            async def handle_request() -> None:  # what a web handler does for one chat request
                await agent.invoke_async(GREEN_TEA)
                await agent.memory_manager.flush()

            task = asyncio.create_task(handle_request())
            assert await until(in_flight.is_set, timeout=10.0)
            task.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await task
            assert store.counters()["write_errors"] == 0  # nothing known yet: Membase has not answered
            release.set()
            store.close()  # returns once the write's outcome is on record
        finally:
            release.set()
            store.close()
            client.close()

    assert len(model.calls) == 1  # the turn itself ran before the flush was cancelled
    assert posted(server.fake) == [GREEN_TEA]
    counters = store.counters()
    assert counters["write_cancellations"] == 1
    assert counters["write_errors"] == 1
    assert counters["errors.server_error"] == 1
    assert counters["writes_saved"] == 0
    assert any("a write whose caller was cancelled failed; it is not saved" in m for m in warnings(caplog))


async def test_record_reports_and_forgets_a_failed_write_whose_caller_was_cancelled(caplog):
    caplog.set_level(logging.INFO)
    gate = threading.Event()
    counters = Counters()
    record = WriteRecord("t", counters, clock=Clock())
    failing = Sender(gate=gate, fail=1)
    send = Sender()
    try:
        task = asyncio.create_task(record.write([part("a")], failing, None))
        assert await until(failing.arrived.is_set)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        gate.set()
    assert record.drain(5.0)

    snapshot = counters.snapshot()
    assert (snapshot["write_cancellations"], snapshot["write_errors"], snapshot["errors.error"]) == (1, 1, 1)
    assert snapshot["writes_saved"] == 0
    assert any("a write whose caller was cancelled failed" in m for m in warnings(caplog))
    # Forgotten: the next attempt sends it.
    assert await record.write([part("a")], send, 1.0) == "saved"
    assert send.sent() == ["a"]


async def test_record_counts_every_cancelled_wait_and_a_write_saved_after_it_is_not_sent_again(caplog):
    caplog.set_level(logging.INFO)
    gate = threading.Event()
    counters = Counters()
    record = WriteRecord("t", counters, clock=Clock())
    stuck = Sender(gate=gate)
    send = Sender()
    try:
        first = asyncio.create_task(record.write([part("a")], stuck, None))
        assert await until(stuck.arrived.is_set)
        second = asyncio.create_task(record.write([part("a")], send, None))  # a retry: waits for the first
        await asyncio.sleep(0)  # let it reach its wait
        for task in (second, first):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        gate.set()
    assert record.drain(5.0)

    snapshot = counters.snapshot()
    assert snapshot["write_cancellations"] == 2
    assert (snapshot["writes_saved"], snapshot["write_errors"]) == (1, 0)
    assert any("a write whose caller was cancelled finished; it is saved" in r.getMessage() for r in caplog.records)
    assert await record.write([part("a")], send, 1.0) is None
    assert stuck.sent() == ["a"]
    assert send.sent() == []


# --- A thread that cannot start: the write fails cleanly and the retry sends it ----------------------


@pytest.fixture
def no_thread_for_one_write(monkeypatch) -> list[str]:
    """The next membase write thread fails to start, as when the process is out of threads.

    Out of threads, no worker waits for work either: every call needs a thread of its own.
    """
    monkeypatch.setattr(_workers, "_POOL", _workers.WorkerPool(idle_seconds=0))
    refused: list[str] = []
    start = threading.Thread.start

    def start_or_refuse(thread: threading.Thread) -> None:
        if thread.name.startswith(WRITE_THREAD) and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_refuse)
    return refused


def test_a_write_whose_thread_cannot_start_fails_and_the_managers_retry_sends_it(
    fake, make_store, no_thread_for_one_write, caplog
):
    store = capturing(make_store)
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent(GREEN_TEA)

    assert no_thread_for_one_write  # the write's thread was refused
    assert posted(fake) == []
    assert any("could not start the write" in m for m in warnings(caplog))
    assert any("memory extraction failed" in m for m in warnings(caplog))  # the manager keeps the batch
    counters = store.counters()
    assert (counters["write_errors"], counters["errors.error"], counters["write_timeouts"]) == (1, 1, 0)

    _, elapsed = timed(agent, LISBON)

    assert elapsed < BUDGET + SLACK  # the retry did not wait for a write that never started
    assert posted(fake) == [f"{GREEN_TEA}\n{LISBON}"]
    assert held(fake) == [f"{GREEN_TEA}\n{LISBON}"]
    counters = store.counters()
    assert (counters["writes_saved"], counters["write_timeouts"]) == (2, 0)


async def test_record_forgets_the_parts_of_a_write_whose_thread_cannot_start(no_thread_for_one_write):
    record = WriteRecord("t", clock=Clock())
    send = Sender()

    with pytest.raises(RuntimeError, match="can't start new thread"):
        await record.write([part("a")], send, 1.0)
    assert len(record) == 0
    assert record.drain(0.0)  # nothing left running

    assert await record.write([part("a")], send, 1.0) == "saved"
    assert send.sent() == ["a"]


# --- Memory: a saved write keeps its identity, and the text it keeps alive is bounded ---------------

BIG = 100 * 1024


def big_text(turn: int) -> str:
    """About 100 KB of words, a new string on every call."""
    return f"turn {turn}: " + "w" * BIG


async def test_the_record_keeps_its_byte_bound_of_words_alive_not_every_saved_message(fake, make_store):
    store = capturing(make_store)

    async def one_turn(turn: int) -> None:  # a new agent run: new message objects, sequence numbers from 0
        await store.add_messages([user(big_text(turn)), assistant("Noted.")], batch_context([0, 1]))

    def forget_what_the_fake_holds() -> None:
        fake.notes.clear()
        fake.requests.clear()
        gc.collect()

    await one_turn(-1)  # warm up connections and caches before measuring
    forget_what_the_fake_holds()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for turn in range(100):  # 10 MB of words
            await one_turn(turn)
        forget_what_the_fake_holds()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()

    assert store.counters()["writes_saved"] == 101
    assert grown < 2 * 1024 * 1024, f"the store kept {grown / 2**20:.1f} MiB alive"  # its 1 MiB bound, and room
    assert _writes.RECORD_BYTES - BIG < store._writes.retained_bytes <= _writes.RECORD_BYTES


def test_a_batch_saved_late_is_not_sent_again_even_after_the_byte_bound_forgot_newer_words(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store)
    agent, _ = make_agent(store, ["Noted.", "Noted too."])
    agent(GREEN_TEA)  # ran out of time: the manager keeps the batch for a retry
    gate.set()
    assert wait_until(lambda: store.counters()["writes_saved"] == 1)

    # Meanwhile other conversations on the same store save more words than the record keeps alive.
    others, _ = make_agent(store, ["Noted."] * 15)
    for turn in range(15):
        others(big_text(turn))
    assert store._writes.retained_bytes <= _writes.RECORD_BYTES

    agent(LISBON)  # the manager retries the old batch with the new turn

    assert occurrences(posted(fake), GREEN_TEA) == 1
    assert posted(fake)[-1] == LISBON
    assert occurrences(held(fake), GREEN_TEA) == 1


def sized(text: str, size: int) -> Part:
    """A message part whose anchor keeps ``size`` bytes alive."""
    return Part(key=("message", text), text=text, anchor=object(), anchor_bytes=size)


async def save_late(record: WriteRecord, saved: Part) -> None:
    """Save ``saved`` after its caller ran out of time (so the caller was told it failed, and a retry is expected)."""
    gate = threading.Event()
    try:
        with pytest.raises(MembaseWriteTimeout):
            await record.write([saved], Sender(gate=gate), 0.05)
    finally:
        gate.set()
    assert record.drain(5.0)


async def test_record_byte_bound_forgets_confirmed_words_before_a_late_save():
    record = WriteRecord("t", max_bytes=250, clock=Clock())
    send = Sender()
    await save_late(record, sized("late", 100))

    for text in "abc":
        await record.write([sized(text, 100)], send, 1.0)

    assert record.retained_bytes == 200  # "late" (the oldest, but a retry is expected) and "c", the newest
    assert await record.write([sized("late", 100), sized("c", 100)], send, 1.0) is None
    assert await record.write([sized("a", 100)], send, 1.0) == "saved"
    assert send.sent() == ["a", "b", "c", "a"]


async def test_record_keeps_the_newest_late_save_even_above_the_byte_bound():
    record = WriteRecord("t", max_bytes=250, clock=Clock())
    send = Sender()
    await save_late(record, sized("huge", 400))
    assert record.retained_bytes == 400

    await record.write([sized("x", 100)], send, 1.0)

    assert record.retained_bytes == 400  # "x" went: only the late save is over the bound, and it stays
    assert await record.write([sized("huge", 400)], send, 1.0) is None  # the manager's retry sends nothing
    assert send.sent() == ["x"]

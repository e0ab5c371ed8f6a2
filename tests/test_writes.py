"""Captured writes: time-boxed, never lost, never doubled; through a real Agent, on the store, and WriteRecord.

A test that is about the write budget runs that write out of a short one while the request is held (by a
gate, or by the loopback server), so the budget always runs out; everything else, the manager's retry
included, runs under a budget a loaded machine cannot run out of (``LONG``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import os
import threading
import time
import tracemalloc
from collections import Counter
from types import SimpleNamespace
from typing import Any

import httpx
import membase
import pytest
from strands.memory import AddMessagesContext, ExtractionResult, ExtractorContext
from strands.types.content import Message

from membase_strands import MembaseMemoryStore, MembaseWriteTimeout, _background, _writes
from membase_strands._counters import Counters
from membase_strands._writes import Part, WriteRecord
from membase_strands.testing import API_KEY, InMemoryMembase, Responder, hang, status
from membase_strands.testing._membase import error
from tests.support.loopback import LoopbackMembase, arrived, raw_answer, stall
from tests.support.store_helpers import (
    FACT,
    LONG,
    QUESTION,
    Clock,
    close_then_release,
    delayed,
    drain_began,
    make_agent,
    membase_threads,
    routed,
    run_in_child,
    set_write_budget,
    settle,
    signalling,
    until,
    wait_until,
)

BUDGET = 0.1  # only for writes a gate holds (or the server): it always runs out
WRITE_THREAD = "membase-write["
MEMORIES = ("POST", "/v1/memories")

GREEN_TEA = "I like green tea"
LISBON = "I live in Lisbon"

ERROR_500 = error(500, "internal", "internal").content
KEPT = "no retry will come from the manager; the store sends it again with its next write or when it closes"
SENT_AGAIN_SAVED = "a write the store sent again finished; it is saved"
SENT_AGAIN_LOST = "a write the store sent again failed; it is not saved, and nothing will send it again"


def capturing(make_store, **options: Any):
    options.setdefault("write_timeout", LONG)
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


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


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


async def started(coroutine: Any) -> asyncio.Task[Any]:
    """``coroutine`` as a task that has run up to its first wait (a write: until it waits for its request)."""
    task = asyncio.ensure_future(coroutine)
    await asyncio.sleep(0)
    return task


class ByWords:
    """Answers POST /v1/memories by the note's words: the responders queued for words the note contains, one per
    request, in turn; the fake's own answer otherwise. Two writes running at once cannot take each other's."""

    def __init__(self, fake: InMemoryMembase) -> None:
        self._fake = fake
        self._queued: dict[str, list[Responder]] = {}
        self._lock = threading.Lock()
        fake.always(*MEMORIES, self)

    def on(self, words: str, *responders: Responder) -> None:
        with self._lock:
            self._queued.setdefault(words, []).extend(responders)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        content = request.content.decode()
        with self._lock:
            queued = next((q for words, q in self._queued.items() if words in content and q), None)
            responder = queued.pop(0) if queued else self._fake.answer
        return responder(request)


# --- A hung Membase never holds a synchronous turn -----------------------------------------------


def test_a_hung_write_returns_within_the_budget_and_nothing_is_reported_saved(fake, make_store, gates, caplog):
    caplog.set_level(logging.DEBUG)
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate))
    store = capturing(make_store, write_timeout=BUDGET)
    agent, _ = make_agent(store, ["Noted."])

    result = agent(GREEN_TEA)

    # The turn is over while Membase still holds the request (only the gate, opened after the test, ends it).
    assert "Noted." in str(result)
    assert not gate.is_set()
    assert wait_until(lambda: posted(fake) == [GREEN_TEA], timeout=LONG)  # the request was made, and still hangs
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
    store = capturing(make_store, write_timeout=BUDGET)
    batches = spy_on_batches(store)
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent(GREEN_TEA)
    assert fake.notes == []
    gate.set()
    assert wait_until(lambda: store.counters()["writes_saved"] == 1, timeout=LONG)
    assert held(fake) == [GREEN_TEA]
    set_write_budget(store, LONG)

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
    store = capturing(make_store, write_timeout=BUDGET)
    batches = spy_on_batches(store)
    original = store.add_messages

    async def release_once_the_retry_waits(messages, context=None):
        if len(batches) == 1:  # the second flush, while the first write still hangs
            retry = await started(original(messages, context))  # now waiting for the first request
            gate.set()
            return await retry
        return await original(messages, context)

    store.add_messages = release_once_the_retry_waits
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent(GREEN_TEA)
    assert store.counters()["write_timeouts"] == 1
    assert fake.notes == []
    set_write_budget(store, LONG)

    agent(LISBON)

    assert posted(fake) == [GREEN_TEA, LISBON]
    assert held(fake) == [GREEN_TEA, LISBON]
    counters = store.counters()
    assert counters["write_timeouts"] == 1
    assert counters["writes_deduplicated"] == 1
    assert counters["writes_saved"] == 2


# --- A late failure is sent again, once --------------------------------------------------------


@pytest.mark.parametrize("then", [None, status(500, "internal")], ids=["read-timeout", "500"])
def test_a_write_that_fails_late_is_sent_again_by_the_retry_once(fake, make_store, gates, caplog, then):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=then))
    store = capturing(make_store, write_timeout=BUDGET)
    agent, _ = make_agent(store, ["Noted.", "Noted too.", "Fine."])

    agent(GREEN_TEA)
    held_writes = store._writes.running()
    gate.set()
    settle(held_writes)
    assert fake.notes == []
    counters = store.counters()
    assert counters["writes_saved"] == 0
    # The late failure is counted by the thread that saw it, before that thread ends.
    assert counters["write_errors"] == 1
    assert counters["errors.timeout" if then is None else "errors.server_error"] == 1
    # The store is open and the manager kept the batch: its retry sends it, not the store.
    assert any("ran out of time failed; the manager's retry sends it again" in m for m in warnings(caplog))
    set_write_budget(store, LONG)

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
    assert (store.counters()["writes_sent_again"], store.counters()["writes_lost"]) == (0, 0)


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
    store = capturing(make_store, write_timeout=BUDGET, recall_timeout=LONG)
    writer, _ = make_agent(store, ["Noted."])
    writer(GREEN_TEA)
    assert membase_threads(WRITE_THREAD)  # that write is stuck, until the test ends

    reader, model = make_agent(store, ["We chose Postgres."])
    reader(QUESTION)

    # Recall neither waited for the stuck write (it would have run out of its budget) nor was skipped.
    assert f"[Main] {FACT}" in (model.memory_block() or "")
    counters = store.counters()
    assert counters["recall_hits"] >= 1
    assert counters["recall_timeouts"] == 0
    assert counters["write_timeouts"] == 2  # both agents' writes ran out of budget
    assert len(fake.notes) == 1  # only the seeded note: nothing reported saved


# --- A retry waits for the earlier request instead of sending a second one -------------------------


async def test_concurrent_writes_of_one_batch_send_one_request(fake, make_store, gates):
    gate, in_flight = gates.new(), threading.Event()
    fake.on(*MEMORIES, signalling(in_flight, hang(gate, then=routed(fake))))
    store = capturing(make_store)
    batch = [user(GREEN_TEA), assistant("Noted.")]
    context = batch_context([0, 1])
    first = asyncio.create_task(store.add_messages(batch, context))
    second = asyncio.create_task(store.add_messages(batch, context))
    assert await until(in_flight.is_set)  # both calls have started: one sends, the other waits for it
    gate.set()

    first, second = await asyncio.gather(first, second)

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
    store = capturing(make_store, write_timeout=BUDGET)
    batch = [user(GREEN_TEA)]
    context = batch_context([0])

    for _ in range(2):  # the first call, then a retry while the first request still hangs
        with pytest.raises(MembaseWriteTimeout):
            await store.add_messages(batch, context)
    assert await until(lambda: posted(fake) == [GREEN_TEA], timeout=LONG)
    assert store.counters()["write_timeouts"] == 2

    gate.set()
    assert await until(lambda: store.counters()["writes_saved"] == 1, timeout=LONG)
    assert await store.add_messages(batch, context) is None

    assert posted(fake) == [GREEN_TEA]
    assert held(fake) == [GREEN_TEA]


async def test_a_retry_whose_earlier_request_fails_while_it_waits_sends_the_words_itself(fake, make_store, gates):
    gate, in_flight = gates.new(), threading.Event()
    fake.on(*MEMORIES, signalling(in_flight, hang(gate, then=status(500, "internal"))))
    store = capturing(make_store)
    old = user(GREEN_TEA)
    first = asyncio.create_task(store.add_messages([old], batch_context([0])))
    # The retry, with a newer message; it waits for the first request instead of sending a second one.
    retry = asyncio.create_task(store.add_messages([old, user(LISBON)], batch_context([0, 2])))
    assert await until(in_flight.is_set)
    gate.set()

    first, retry = await asyncio.gather(first, retry, return_exceptions=True)

    assert isinstance(first, membase.MembaseError)  # the first attempt failed and says so
    # When that request failed, the retry had budget left and sent the words itself (old and new, once each).
    assert not isinstance(retry, BaseException), retry
    assert occurrences(held(fake), GREEN_TEA) == 1
    assert occurrences(held(fake), LISBON) == 1
    assert store.counters()["writes_sent_again"] == 0  # its caller heard of the failure: nothing kept


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
    store = capturing(make_store, write_timeout=BUDGET)
    batch = [user(GREEN_TEA)]
    context = batch_context([0])

    with pytest.raises(MembaseWriteTimeout):
        await store.add_messages(batch, context)
    held_writes = store._writes.running()
    gate.set()
    settle(held_writes)
    assert store.counters()["writes_saved"] == 0
    set_write_budget(store, LONG)

    await store.add_messages(batch, context)

    assert posted(fake) == [GREEN_TEA, GREEN_TEA]
    assert held(fake) == [GREEN_TEA]
    assert store.counters()["writes_saved"] == 1
    assert store.counters()["writes_sent_again"] == 0  # the manager's retry sent it, not the store


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
    fake.on(*MEMORIES, delayed(fake, 0.2))
    store = capturing(make_store, write_timeout=None)
    agent, _ = make_agent(store, ["Noted."])

    agent(GREEN_TEA)

    assert held(fake) == [GREEN_TEA]  # saved by the time the call returned
    counters = store.counters()
    assert counters["write_timeouts"] == 0
    assert counters["writes_saved"] == 1


async def test_without_a_write_timeout_add_waits_for_the_request(fake, make_store):
    fake.on(*MEMORIES, delayed(fake, 0.2))
    store = capturing(make_store, write_timeout=None)

    answer = await store.add(FACTS[0])

    assert answer["container"] == "ctr_main"
    assert held(fake) == [FACTS[0]]


# --- A write still running when the store closes --------------------------------------------------

RAN_OUT_SAVED = "a write that ran out of time finished; it is saved"


async def test_close_lets_a_late_write_finish_and_logs_it_saved_before_returning(fake, make_store, gates, caplog):
    release = gates.new()
    fake.on(*MEMORIES, hang(release, then=fake.answer))
    store = capturing(make_store, write_timeout=BUDGET)
    with pytest.raises(MembaseWriteTimeout):
        await store.add(GREEN_TEA)
    set_write_budget(store, LONG)  # how long close() waits: not what this test is about

    await close_then_release(store, caplog, release)

    assert held(fake) == [GREEN_TEA]
    assert any(RAN_OUT_SAVED in m for m in logged(caplog))
    assert (store.counters()["writes_saved"], store.counters()["write_errors"]) == (1, 0)


@pytest.mark.parametrize(
    ("then", "kind"), [(status(500), "server_error"), (None, "timeout")], ids=["500", "read-timeout"]
)
async def test_a_late_write_that_fails_while_the_store_is_open_is_left_to_the_managers_retry(
    fake, make_store, gates, caplog, then, kind
):
    release = gates.new()
    fake.on(*MEMORIES, hang(release, then=then))
    store = capturing(make_store, write_timeout=BUDGET)
    with pytest.raises(MembaseWriteTimeout):
        await store.add(GREEN_TEA)
    running = store._writes.running()
    release.set()
    settle(running)

    store.close()

    assert any("a write that ran out of time failed; the manager's retry sends it again" in m for m in warnings(caplog))
    assert posted(fake) == [GREEN_TEA]  # close() sent nothing: the manager holds the batch for its retry
    counters = store.counters()
    assert (counters["writes_saved"], counters["write_timeouts"], counters["write_errors"]) == (0, 1, 1)
    assert counters[f"errors.{kind}"] == 1
    assert (counters["writes_sent_again"], counters["writes_lost"]) == (0, 0)


@pytest.mark.parametrize(
    ("then", "kind"), [(status(500), "server_error"), (None, "timeout")], ids=["500", "read-timeout"]
)
async def test_a_late_write_that_fails_while_the_store_closes_is_sent_again_once_before_close_returns(
    fake, make_store, gates, caplog, then, kind
):
    release = gates.new()
    fake.on(*MEMORIES, hang(release, then=then))  # the next request is answered as usual
    store = capturing(make_store, write_timeout=BUDGET)
    with pytest.raises(MembaseWriteTimeout):
        await store.add(GREEN_TEA)
    set_write_budget(store, LONG)

    await close_then_release(store, caplog, release)  # once close() began, no retry can come from the manager

    assert any(
        "a write that ran out of time failed; no retry will come from the manager (the store is closing); "
        "it is sent again before it closes" in m
        for m in warnings(caplog)
    )
    assert any(SENT_AGAIN_SAVED in m for m in logged(caplog))
    assert posted(fake) == [GREEN_TEA, GREEN_TEA]
    assert held(fake) == [GREEN_TEA]
    counters = store.counters()
    assert (counters["write_timeouts"], counters["write_errors"], counters[f"errors.{kind}"]) == (1, 1, 1)
    assert (counters["writes_sent_again"], counters["writes_saved"], counters["writes_lost"]) == (1, 1, 0)


@pytest.mark.parametrize("fails", [False, True], ids=["saved", "500-twice"])
async def test_close_returns_only_after_a_late_writes_outcome_is_logged_and_counted(
    fake, make_store, gates, caplog, slow_callbacks, fails
):
    """The writing thread records the outcome before it settles the future ``close()`` waits on. The future's
    done-callbacks run late here (``slow_callbacks``), so nothing that counts may rely on them."""
    release = gates.new()
    if fails:  # fails during the close, and again when the store sends it again: lost, with a warning
        fake.on(*MEMORIES, hang(release, then=status(500, "internal")), status(500, "internal"))
    else:
        fake.on(*MEMORIES, hang(release, then=routed(fake)))
    store = capturing(make_store, write_timeout=BUDGET)
    with pytest.raises(MembaseWriteTimeout):
        await store.add(GREEN_TEA)
    set_write_budget(store, LONG)

    await close_then_release(store, caplog, release)

    messages, counters = logged(caplog), store.counters()  # as they were when close() returned
    if fails:
        assert any(SENT_AGAIN_LOST in m for m in messages)
        assert (counters["write_errors"], counters["errors.server_error"], counters["writes_saved"]) == (2, 2, 0)
        assert (counters["writes_sent_again"], counters["writes_lost"]) == (1, 1)
        assert held(fake) == []
    else:
        assert any(RAN_OUT_SAVED in m for m in messages)
        assert (counters["writes_saved"], counters["write_errors"]) == (1, 0)
        assert held(fake) == [GREEN_TEA]


class HeldLogLine(logging.Handler):
    """A slow log handler (say, one that ships lines over the network): it holds the thread that logs a line
    containing ``words`` until ``go`` is set; ``reached`` is set when that line arrives."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words
        self.reached, self.go = threading.Event(), threading.Event()

    def handle(self, record: logging.LogRecord) -> bool:
        self.emit(record)  # without the handler's lock: lines logged meanwhile by other threads go on
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.reached.set()
            self.go.wait(LONG)


async def test_close_waits_for_the_outcome_of_a_write_that_ended_just_before_it_began(fake, make_store, gates, caplog):
    caplog.set_level(logging.INFO)
    release = gates.new()
    fake.on(*MEMORIES, hang(release, then=routed(fake)))
    store = capturing(make_store, write_timeout=BUDGET)
    with pytest.raises(MembaseWriteTimeout):
        await store.add(GREEN_TEA)
    set_write_budget(store, LONG)
    slow = HeldLogLine(RAN_OUT_SAVED)
    logging.getLogger("membase_strands._writes").addHandler(slow)
    try:
        release.set()  # the request ends: its thread is reporting the outcome when close() begins
        assert await until(slow.reached.is_set, timeout=LONG)
        closing = asyncio.ensure_future(asyncio.to_thread(store.close))
        assert await until(lambda: closing.done() or drain_began(caplog)(), timeout=LONG)
        assert not closing.done(), "close() returned before the outcome of the write was logged"
        slow.go.set()
        await closing
    finally:
        slow.go.set()
        logging.getLogger("membase_strands._writes").removeHandler(slow)

    assert any(RAN_OUT_SAVED in m for m in logged(caplog))
    assert held(fake) == [GREEN_TEA]


# --- A batch whose caller was cancelled and that then fails: the store sends it again, once ---------------


async def flush_cancelled_while_membase_holds_the_write(agent: Any, in_flight: threading.Event) -> None:
    """One async turn and the flush a web handler owes the manager, cancelled (its client hung up) while the
    store's POST /v1/memories is held by Membase. Strands then counts the batch as handled: it never sends it
    again."""

    async def handle_request() -> None:
        await agent.invoke_async(GREEN_TEA)
        await agent.memory_manager.flush()

    task = asyncio.create_task(handle_request())
    assert await until(in_flight.is_set, timeout=LONG)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.fixture
def membase_holding_the_first_write() -> Any:
    """A loopback Membase that holds the first POST /v1/memories until released, then answers it 500."""
    in_flight, release = threading.Event(), threading.Event()
    with LoopbackMembase() as server:
        server.fake.on(*MEMORIES, status(500, "internal"))  # what the fake records: that note is not kept
        server.on(*MEMORIES, arrived(in_flight, stall(release, then=raw_answer(500, ERROR_500))))
        try:
            yield server, in_flight, release
        finally:
            release.set()


@pytest.mark.parametrize("then", ["next turn", "close"])
async def test_a_cancelled_flush_whose_write_then_fails_reaches_membase_exactly_once(
    membase_holding_the_first_write, caplog, no_key_in_logs, then
):
    """Issue 19: the batch is kept by the store and sent again, with its next write or when it closes."""
    caplog.set_level(logging.INFO)
    server, in_flight, release = membase_holding_the_first_write
    store = MembaseMemoryStore(
        api_key=API_KEY, base_url=server.url, capture=True, container="Main", extraction=True, write_timeout=LONG
    )
    try:
        agent, model = make_agent(store, ["Noted."])
        await flush_cancelled_while_membase_holds_the_write(agent, in_flight)
        assert len(model.calls) == 1  # the turn itself ran before the flush was cancelled
        assert store.counters()["write_errors"] == 0  # nothing known yet: Membase has not answered
        failing = store._writes.running()
        release.set()  # Membase answers 500
        settle(failing)
        assert any(f"a write whose caller was cancelled failed; {KEPT}" in m for m in warnings(caplog))
        assert server.fake.saved() == []

        if then == "next turn":
            # The next request's turn, on a new agent as a web server builds one per request (the cancelled
            # agent's manager never saves for this store again: its next save waits on the cancelled one).
            agent, model = make_agent(store, ["Noted too."])
            await agent.invoke_async(LISBON)
            await agent.memory_manager.flush()  # the next write: the kept batch goes out beside it
            settle(store._writes.running())  # the store's own request, if still running or reporting how it ended
            assert any(SENT_AGAIN_SAVED in m for m in logged(caplog))
        else:
            await store.aclose()  # sends the kept batch, and returns once its outcome is on record
            assert any(SENT_AGAIN_SAVED in m for m in logged(caplog))
    finally:
        await store.aclose()

    assert occurrences(server.fake.saved(), GREEN_TEA) == 1
    assert occurrences(posted(server.fake), GREEN_TEA) == 2  # the request that failed, then the store's own, once
    if then == "next turn":
        assert occurrences(server.fake.saved(), LISBON) == 1
    counters = store.counters()
    assert counters["write_cancellations"] == 1
    assert (counters["write_errors"], counters["errors.server_error"]) == (1, 1)
    assert (counters["writes_sent_again"], counters["writes_lost"]) == (1, 0)


async def cancelled_while_sent(store: MembaseMemoryStore, batch: list[Message], context: Any, in_flight) -> list:
    """Write ``batch`` and cancel the caller once Membase has the request (the futures of the writes then running)."""
    task = asyncio.create_task(store.add_messages(batch, context))
    assert await until(in_flight.is_set, timeout=LONG)
    running = store._writes.running()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return running


async def test_a_kept_batch_the_managers_own_retry_sends_is_not_sent_twice(fake, make_store, gates, caplog):
    answers = ByWords(fake)
    in_flight, release = threading.Event(), gates.new()
    answers.on(GREEN_TEA, signalling(in_flight, hang(release, then=status(500, "internal"))))
    store = capturing(make_store)
    batch, context = [user(GREEN_TEA)], batch_context([0])
    failing = await cancelled_while_sent(store, batch, context, in_flight)
    release.set()
    settle(failing)
    assert any(KEPT in m for m in warnings(caplog))  # kept for sending again

    # A manager that does retry the batch (the same message objects): the store leaves it to that retry.
    await store.add_messages(batch, context)
    assert await store.add_messages([user(LISBON)], batch_context([1])) is not None  # nothing kept is left to send

    assert posted(fake) == [GREEN_TEA, GREEN_TEA, LISBON]
    assert held(fake) == [GREEN_TEA, LISBON]
    counters = store.counters()
    assert (counters["writes_sent_again"], counters["writes_lost"], counters["writes_saved"]) == (0, 0, 2)


async def test_a_managers_retry_that_comes_while_the_store_sends_the_batch_again_waits_for_it(fake, make_store):
    answers = ByWords(fake)
    in_flight, resending, release, release_resend = (threading.Event() for _ in range(4))
    answers.on(
        GREEN_TEA,
        signalling(in_flight, hang(release, then=status(500, "internal"))),
        signalling(resending, hang(release_resend, then=fake.answer)),
    )
    store = capturing(make_store)
    batch, context = [user(GREEN_TEA)], batch_context([0])
    try:
        failing = await cancelled_while_sent(store, batch, context, in_flight)
        release.set()
        settle(failing)

        await store.add_messages([user(LISBON)], batch_context([1]))  # the next write: the kept batch goes out too
        assert await until(resending.is_set, timeout=LONG)
        retry = await started(store.add_messages(batch, context))  # the manager's retry, while that request runs
        release_resend.set()

        assert await retry is None  # it waited for the store's own request, which saved the words
    finally:
        release.set()
        release_resend.set()
    assert occurrences(posted(fake), GREEN_TEA) == 2
    assert held(fake) == [LISBON, GREEN_TEA]
    counters = store.counters()
    assert (counters["writes_sent_again"], counters["writes_deduplicated"], counters["writes_lost"]) == (1, 1, 0)


async def test_a_kept_batch_that_fails_again_is_lost_with_a_warning_and_counted(fake, make_store, caplog):
    answers = ByWords(fake)
    in_flight, release = threading.Event(), threading.Event()
    answers.on(GREEN_TEA, signalling(in_flight, hang(release, then=status(500, "internal"))), status(503, "busy"))
    store = capturing(make_store)
    try:
        failing = await cancelled_while_sent(store, [user(GREEN_TEA)], batch_context([0]), in_flight)
    finally:
        release.set()
    settle(failing)

    await store.add_messages([user(LISBON)], batch_context([1]))  # sends the kept batch again: 503
    settle(store._writes.running())  # that request, if still running or reporting how it ended
    await store.add_messages([user("Call me Sam")], batch_context([2]))  # never a third attempt

    assert occurrences(posted(fake), GREEN_TEA) == 2
    assert held(fake) == [LISBON, "Call me Sam"]
    assert any(SENT_AGAIN_LOST in m for m in warnings(caplog))
    counters = store.counters()
    assert (counters["writes_sent_again"], counters["writes_lost"], counters["write_errors"]) == (1, 1, 2)


async def test_kept_batches_are_bounded_in_bytes_the_oldest_dropped_with_a_warning_and_counted(caplog):
    counters = Counters()
    record = WriteRecord("t", counters, budget=LONG, max_bytes=250, clock=Clock())
    gates = {text: threading.Event() for text in "abc"}
    senders = {text: Sender(gate=gates[text], fail=1) for text in "abc"}
    # Three batches of 100 bytes in flight at once, their callers cancelled (a web server shutting down).
    writes = [asyncio.create_task(record.write([sized(text, 100)], senders[text])) for text in "abc"]
    assert await until(lambda: all(sender.arrived.is_set() for sender in senders.values()), timeout=LONG)
    for task in writes:
        task.cancel()
    for task in writes:
        with pytest.raises(asyncio.CancelledError):
            await task
    for failed, text in enumerate("abc", start=1):  # then each fails, oldest first; room for two
        gates[text].set()
        assert wait_until(lambda n=failed: sum(KEPT in m for m in warnings(caplog)) == n, timeout=LONG)

    dropped = [m for m in warnings(caplog) if "dropped to stay within 250 bytes" in m]
    assert dropped == [
        "store=<t>, parts=<1> | a failed write kept for sending again was dropped to stay within 250 bytes; "
        "it is not saved"
    ]
    assert counters.snapshot()["writes_lost"] == 1
    assert record.retained_bytes == 200

    send = Sender()
    await record.write([part("d")], send)  # the next write: the two kept batches go out beside it
    assert wait_until(lambda: counters.snapshot()["writes_saved"] == 3, timeout=LONG)

    assert senders["a"].sent() == ["a"]  # dropped: never sent again
    assert senders["b"].sent() == ["b", "b"] and senders["c"].sent() == ["c", "c"]
    assert send.sent() == ["d"]
    assert counters.snapshot()["writes_sent_again"] == 2


async def test_a_failed_batch_over_the_byte_bound_on_its_own_is_lost_once_and_counted_once(caplog):
    counters = Counters()
    record = WriteRecord("t", counters, budget=LONG, max_bytes=50, clock=Clock())
    await cancelled_then_failed(record, [sized("huge", 100)])

    assert warnings(caplog) == [  # nothing about a batch kept, then dropped: it never was kept
        "store=<t>, reason=<Membase said no> | a write whose caller was cancelled failed; "
        "it is not saved, and nothing will send it again"
    ]
    assert counters.snapshot()["writes_lost"] == 1
    assert record.retained_bytes == 0


async def test_the_record_keeps_a_failed_write_whose_caller_was_cancelled_and_sends_it_with_the_next_write(caplog):
    caplog.set_level(logging.INFO)
    counters = Counters()
    record = WriteRecord("t", counters, budget=LONG, clock=Clock())
    failing = await cancelled_then_failed(record, [part("a")])

    snapshot = counters.snapshot()
    assert (snapshot["write_cancellations"], snapshot["write_errors"], snapshot["errors.error"]) == (1, 1, 1)
    assert snapshot["writes_saved"] == 0
    assert any(f"a write whose caller was cancelled failed; {KEPT}" in m for m in warnings(caplog))
    assert len(record) == 0  # forgotten as saved-or-running: a retry of "a" sends it

    send = Sender()
    assert await record.write([part("b")], send) == "saved"  # "a" goes out again beside it, once
    assert wait_until(lambda: counters.snapshot()["writes_saved"] == 2, timeout=LONG)
    assert failing.requests == [["a"], ["a"]]
    assert await record.write([part("a")], send) is None  # saved by the store's own request
    assert send.sent() == ["b"]
    assert counters.snapshot()["writes_sent_again"] == 1


async def test_a_retry_cancelled_while_an_earlier_write_sends_part_of_it_keeps_the_rest_and_sends_it_next(caplog):
    """A retry brings the old words and new ones; it waits while an earlier request still sends the old. Cancelled
    then (a flush a web server gave up on: no retry will come), the new words are kept and sent with the next write."""
    caplog.set_level(logging.INFO)
    gate = threading.Event()
    counters = Counters()
    record = WriteRecord("t", counters, budget=LONG, clock=Clock())
    stuck, send = Sender(gate=gate), Sender()
    try:
        first = asyncio.create_task(record.write([part("a")], stuck))
        assert await until(stuck.arrived.is_set, timeout=LONG)
        retry = await started(record.write([part("a"), part("b")], send))  # waits for the first's "a"
        retry.cancel()
        with pytest.raises(asyncio.CancelledError):
            await retry
        gate.set()
        assert await first == "saved"
    finally:
        gate.set()

    assert await record.write([part("c")], send) == "saved"  # "b" goes out beside it, "a" not again
    settle(record.running())
    assert sorted(send.sent()) == ["b", "c"]
    assert stuck.sent() == ["a"]
    assert counters.snapshot()["writes_sent_again"] == 1
    assert counters.snapshot()["writes_lost"] == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no os.fork()")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_batch_kept_for_sending_again_is_sent_again_by_the_parent_only_not_by_a_forked_child(caplog):
    record = WriteRecord("t", budget=LONG, clock=Clock())
    failing = asyncio.run(cancelled_then_failed(record, [part("a")]))
    assert any(KEPT in m for m in warnings(caplog))

    def next_write() -> list[list[str]]:
        asyncio.run(record.write([part("b")], Sender()))
        settle(record.running())
        return failing.requests

    assert run_in_child(next_write) == [["a"]]  # the child's next write sent only its own words
    assert next_write() == [["a"], ["a"]]  # the parent's sent the kept batch again, once


async def test_record_counts_every_cancelled_wait_and_a_write_saved_after_it_is_not_sent_again(caplog):
    caplog.set_level(logging.INFO)
    gate = threading.Event()
    counters = Counters()
    record = WriteRecord("t", counters, budget=LONG, clock=Clock())
    stuck = Sender(gate=gate)
    send = Sender()
    try:
        first = asyncio.create_task(record.write([part("a")], stuck))
        assert await until(stuck.arrived.is_set, timeout=LONG)
        running = record.running()
        second = await started(record.write([part("a")], send))  # a retry: waits for the first
        for task in (second, first):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        gate.set()
    settle(running)

    snapshot = counters.snapshot()
    assert snapshot["write_cancellations"] == 2
    assert (snapshot["writes_saved"], snapshot["write_errors"]) == (1, 0)
    assert any("a write whose caller was cancelled finished; it is saved" in m for m in logged(caplog))
    assert await record.write([part("a")], send) is None
    assert stuck.sent() == ["a"]
    assert send.sent() == []


# --- A thread that cannot start: the write fails cleanly and the retry sends it ----------------------


@pytest.fixture
def no_thread_for_one_write(monkeypatch) -> list[str]:
    """The next membase write thread fails to start, as when the process is out of threads.

    The library's threads start afresh and retire as soon as they are idle, so no thread is left alive to take
    the write instead: it fails at once.
    """
    submitting: list[str] = []  # the name of the call being handed to the threads right now, if any

    class Threads(_background._Threads):
        def submit(self, fn: Any, name: str, lane: Any) -> Any:
            submitting.append(name)
            try:
                return super().submit(fn, name, lane)
            finally:
                submitting.pop()

    monkeypatch.setattr(_background, "_threads", Threads())
    monkeypatch.setattr(_background, "IDLE_SECONDS", 0.0)
    refused: list[str] = []
    start = threading.Thread.start

    def start_or_refuse(thread: threading.Thread) -> None:
        if submitting and submitting[-1].startswith(WRITE_THREAD) and not refused:
            refused.append(submitting[-1])
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_refuse)
    return refused


def test_a_write_whose_thread_cannot_start_fails_and_the_managers_retry_sends_it(
    fake, make_store, no_thread_for_one_write, caplog
):
    store = capturing(make_store)
    original = store.add_messages

    async def once_no_thread_is_left(messages, context=None):
        # The recall's thread has retired: nothing alive could take the write in its place.
        assert await until(lambda: _background.threads_alive() == 0, timeout=LONG)
        return await original(messages, context)

    store.add_messages = once_no_thread_is_left
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent(GREEN_TEA)

    assert no_thread_for_one_write  # the write's thread was refused
    assert posted(fake) == []
    assert any("could not start the write" in m for m in warnings(caplog))
    assert any("memory extraction failed" in m for m in warnings(caplog))  # the manager keeps the batch
    counters = store.counters()
    assert (counters["write_errors"], counters["errors.error"], counters["write_timeouts"]) == (1, 1, 0)

    agent(LISBON)

    # The retry did not wait for a write that never started: it sent the old words with the new, at once.
    assert posted(fake) == [f"{GREEN_TEA}\n{LISBON}"]
    assert held(fake) == [f"{GREEN_TEA}\n{LISBON}"]
    counters = store.counters()
    assert (counters["writes_saved"], counters["write_timeouts"]) == (2, 0)


async def test_record_forgets_the_parts_of_a_write_whose_thread_cannot_start(no_thread_for_one_write):
    record = WriteRecord("t", budget=LONG, clock=Clock())
    send = Sender()

    with pytest.raises(RuntimeError, match="can't start new thread"):
        await record.write([part("a")], send)
    assert len(record) == 0
    assert record.running() == []  # nothing left running

    assert await record.write([part("a")], send) == "saved"
    assert send.sent() == ["a"]


# --- Memory: a saved write keeps its identity, and the text it keeps alive is bounded ---------------

BIG = 100 * 1024


def big_text(turn: int) -> str:
    """About 100 KB of words, a new string on every call."""
    return f"turn {turn}: " + "w" * BIG


async def test_the_record_keeps_its_byte_bound_of_words_alive_not_every_saved_message(fake, make_store):
    # LONG: under tracemalloc a loaded machine can take seconds for one write; this test is about memory.
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
    assert store.counters()["write_timeouts"] == 0
    assert grown < 2 * 1024 * 1024, f"the store kept {grown / 2**20:.1f} MiB alive"  # its 1 MiB bound, and room
    assert _writes.RECORD_BYTES - BIG < store._writes.retained_bytes <= _writes.RECORD_BYTES


def test_a_batch_saved_late_is_not_sent_again_even_after_the_byte_bound_forgot_newer_words(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store, write_timeout=BUDGET)
    agent, _ = make_agent(store, ["Noted.", "Noted too."])
    agent(GREEN_TEA)  # ran out of time: the manager keeps the batch for a retry
    gate.set()
    assert wait_until(lambda: store.counters()["writes_saved"] == 1, timeout=LONG)
    set_write_budget(store, LONG)

    # Meanwhile other conversations on the same store save more words than the record keeps alive.
    others, _ = make_agent(store, ["Noted."] * 15)
    for turn in range(15):
        others(big_text(turn))
    assert store._writes.retained_bytes <= _writes.RECORD_BYTES

    agent(LISBON)  # the manager retries the old batch with the new turn

    assert occurrences(posted(fake), GREEN_TEA) == 1
    assert posted(fake)[-1] == LISBON
    assert occurrences(held(fake), GREEN_TEA) == 1


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
            self.gate.wait(LONG)
        if self.pause:
            time.sleep(self.pause)
        if failing:
            raise RuntimeError("Membase said no")
        return "saved"

    def sent(self) -> list[str]:
        return [text for request in self.requests for text in request]


async def cancelled_then_failed(record: WriteRecord, parts: list[Part]) -> Sender:
    """Write ``parts`` with a send that fails, its caller cancelled while it runs; return once it has failed."""
    gate = threading.Event()
    failing = Sender(gate=gate, fail=1)
    try:
        task = asyncio.create_task(record.write(parts, failing))
        assert await until(failing.arrived.is_set, timeout=LONG)
        running = record.running()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        gate.set()
    settle(running)
    return failing


def part(text: str) -> Part:
    return Part(key=("fact", text), text=text)


def sized(text: str, size: int) -> Part:
    """A message part whose anchor keeps ``size`` bytes alive."""
    return Part(key=("message", text), text=text, anchor=object(), anchor_bytes=size)


async def test_record_forgets_a_saved_write_after_its_time():
    clock = Clock()
    record = WriteRecord("t", budget=LONG, seconds=10.0, clock=clock)
    send = Sender()

    assert await record.write([part("a")], send) == "saved"
    clock.advance(9.0)
    assert await record.write([part("a")], send) is None  # still remembered
    clock.advance(2.0)
    assert await record.write([part("a")], send) == "saved"  # forgotten: sent again

    assert send.sent() == ["a", "a"]


async def test_record_size_bound_forgets_the_oldest_saved_write_first():
    record = WriteRecord("t", budget=LONG, size=2, clock=Clock())
    send = Sender()
    for text in "abc":
        await record.write([part(text)], send)

    assert await record.write([part("c")], send) is None  # makes room: forgets the oldest, "a"
    assert len(record) == 2
    assert await record.write([part("b")], send) is None
    assert await record.write([part("a")], send) == "saved"

    assert send.sent() == ["a", "b", "c", "a"]


async def test_record_size_bound_never_forgets_a_write_in_flight():
    gate = threading.Event()
    counters = Counters()
    record = WriteRecord("t", counters, budget=BUDGET, size=1, clock=Clock())
    stuck = Sender(gate=gate)
    send = Sender()
    try:
        with pytest.raises(MembaseWriteTimeout):
            await record.write([part("x")], stuck)
        set_write_budget(record, LONG)
        for text in "yzw":  # each pushes past the bound: only saved writes are forgotten
            await record.write([part(text)], send)
        assert len(record) == 2  # "x" still running, and the newest saved one

        set_write_budget(record, BUDGET)
        with pytest.raises(MembaseWriteTimeout):
            await record.write([part("x")], send)  # waits for the running request, sends nothing
        assert await until(stuck.arrived.is_set, timeout=LONG)
        assert stuck.sent() == ["x"]
        assert "x" not in send.sent()
    finally:
        gate.set()
    assert wait_until(lambda: counters.snapshot()["writes_saved"] == 4, timeout=LONG)

    assert await record.write([part("x")], send) is None
    assert send.sent() == ["y", "z", "w"]


async def test_record_forgets_a_failed_write_so_the_next_attempt_sends_it():
    counters = Counters()
    record = WriteRecord("t", counters, budget=LONG, clock=Clock())
    send = Sender(fail=1)

    with pytest.raises(RuntimeError, match="said no"):
        await record.write([part("a"), part("b")], send)
    assert len(record) == 0
    assert counters.snapshot()["writes_saved"] == 0

    assert await record.write([part("a"), part("b")], send) == "saved"
    assert send.requests == [["a", "b"], ["a", "b"]]
    assert counters.snapshot()["writes_saved"] == 2
    assert counters.snapshot()["writes_sent_again"] == 0  # its caller heard of the failure: nothing kept


async def test_record_sends_only_the_parts_not_saved_yet():
    counters = Counters()
    record = WriteRecord("t", counters, budget=LONG, clock=Clock())
    send = Sender()

    await record.write([part("a")], send)
    await record.write([part("a"), part("b")], send)

    assert send.requests == [["a"], ["b"]]
    assert counters.snapshot()["writes_deduplicated"] == 1


async def test_record_sends_identical_facts_added_concurrently_once():
    counters = Counters()
    record = WriteRecord("t", counters, budget=LONG, clock=Clock())
    gate = threading.Event()
    send = Sender(gate=gate)

    writes = [asyncio.create_task(record.write([part("same")], send)) for _ in range(3)]
    assert await until(send.arrived.is_set, timeout=LONG)
    await asyncio.sleep(0)  # every write has started: one sends, two wait for it
    gate.set()
    answers = await asyncio.gather(*writes)

    assert send.sent() == ["same"]
    assert sorted(answers, key=str) == [None, None, "saved"]
    assert counters.snapshot()["writes_deduplicated"] == 2


async def test_record_waits_without_a_budget():
    record = WriteRecord("t", budget=None, clock=Clock())
    send = Sender(pause=0.2)

    assert await record.write([part("a")], send) == "saved"


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
    record = WriteRecord("t", budget=BUDGET, clock=Clock())
    failing = Sender(gate=gate, fail=1)
    send = Sender()
    try:
        with pytest.raises(MembaseWriteTimeout):
            await record.write([part("a")], failing)
    finally:
        gate.set()
    set_write_budget(record, LONG)
    # The request has failed (its future is done) and its callbacks are about to run.
    assert wait_until(lambda: bool(slow_callbacks) and slow_callbacks[0].done(), timeout=LONG)

    answer = await record.write([part("a")], send)

    assert send.sent() == ["a"], f"nothing sent; the write reported {answer!r} as if saved"
    assert answer == "saved"
    assert wait_until(lambda: not membase_threads(WRITE_THREAD), timeout=LONG)
    assert await record.write([part("a")], send) is None  # the failed request's end did not undo the new entry
    assert send.sent() == ["a"]


async def save_late(record: WriteRecord, saved: Part) -> None:
    """Save ``saved`` after its caller ran out of time (so the caller was told it failed, and a retry is expected)."""
    gate = threading.Event()
    set_write_budget(record, BUDGET)
    try:
        with pytest.raises(MembaseWriteTimeout):
            await record.write([saved], Sender(gate=gate))
        running = record.running()
    finally:
        gate.set()
    settle(running)
    set_write_budget(record, LONG)


async def test_record_byte_bound_forgets_confirmed_words_before_a_late_save():
    record = WriteRecord("t", max_bytes=250, clock=Clock())
    send = Sender()
    await save_late(record, sized("late", 100))

    for text in "abc":
        await record.write([sized(text, 100)], send)

    assert record.retained_bytes == 200  # "late" (the oldest, but a retry is expected) and "c", the newest
    assert await record.write([sized("late", 100), sized("c", 100)], send) is None
    assert await record.write([sized("a", 100)], send) == "saved"
    assert send.sent() == ["a", "b", "c", "a"]


async def test_record_keeps_the_newest_late_save_even_above_the_byte_bound():
    record = WriteRecord("t", max_bytes=250, clock=Clock())
    send = Sender()
    await save_late(record, sized("huge", 400))
    assert record.retained_bytes == 400

    await record.write([sized("x", 100)], send)

    assert record.retained_bytes == 400  # "x" went: only the late save is over the bound, and it stays
    assert await record.write([sized("huge", 400)], send) is None  # the manager's retry sends nothing
    assert send.sent() == ["x"]


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

"""Captured writes: off by default, time-boxed, never sent twice for the same thing, never lost without a word.

Driven through a real Agent where the manager's retry is the point, through ``add`` / ``add_messages`` where the
batch is. A write about the budget runs out of a short one (``BUDGET``) while a gate holds its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
import tracemalloc
from collections import Counter
from types import SimpleNamespace
from typing import Any

import httpx
import membase
import pytest
from strands.memory import AddMessagesContext, ExtractionResult, ExtractorContext, MemoryManager
from strands.types.content import Message

from membase_strands import MembaseAccessError, MembaseMemoryStore, MembaseWriteTimeout, _calls, _writes
from membase_strands.testing import InMemoryMembase, Responder, ToolCall, hang, status
from tests.support.store_helpers import (
    FACT,
    GREEN_TEA,
    LISBON,
    LONG,
    MEMORIES,
    QUESTION,
    WRITE_THREAD,
    assistant,
    cancelled_once_sent,
    delayed,
    lines,
    logged,
    make_agent,
    membase_threads,
    posted,
    routed,
    signalling,
    until,
    user,
    wait_until,
)

BUDGET = 0.5  # only for writes a gate holds: it always runs out; what follows it on the same store fits in it
RETRY_ONLY = "failed; it is not saved, and only the manager's retry sends it again (if its agent lives on)"
LOST = "failed; it is not saved, and nothing sends it again"
CYCLING = "I cycle to work."

# strands 1.45 hands add_messages no batch context; 1.46 and later carry the sequence numbers in one.
MANAGER_SENDS_SEQUENCE_NUMBERS = "sequence_numbers" in {f.name for f in dataclasses.fields(AddMessagesContext)}


def counts(source: Any, *names: str) -> tuple[int, ...]:
    """The counters ``names`` of a store or pool, in order."""
    counters = source.counters()
    return tuple(counters[name] for name in names)


def capturing(make_store, **options: Any) -> MembaseMemoryStore:
    options.setdefault("extraction", True)
    return make_store(capture=True, container="Main", **options)


def batch(numbers: list[int]) -> Any:
    """The manager's batch context for ``numbers``; on strands 1.45, a stand-in with the same attribute."""
    if MANAGER_SENDS_SEQUENCE_NUMBERS:
        return AddMessagesContext(sequence_numbers=numbers)  # type: ignore[call-arg]
    return SimpleNamespace(sequence_numbers=numbers)


def spy_on_batches(store: MembaseMemoryStore) -> list[Any]:
    """Record the sequence numbers of every batch the manager hands the store (the store still writes it)."""
    seen: list[Any] = []
    original = store.add_messages

    async def add_messages(messages, context=None):
        seen.append(getattr(context, "sequence_numbers", None))
        return await original(messages, context)

    store.add_messages = add_messages  # type: ignore[method-assign]
    return seen


async def started(coroutine: Any) -> asyncio.Task[Any]:
    """``coroutine`` as a task that has run up to its first wait (a write: until it waits for its request)."""
    task = asyncio.ensure_future(coroutine)
    await asyncio.sleep(0)
    return task


class ByWords:
    """Answers POST /v1/memories by the note's words: the responders queued for words the note contains, one per
    request, in turn; the fake's own answer otherwise. Writes running at once cannot take each other's."""

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


# --- Capture is opt-in ------------------------------------------------------------------------------
async def test_capture_is_off_by_default_and_nothing_is_written(fake, make_store):
    store = make_store()
    assert (store.writable, store.extraction) == (False, None)
    with pytest.raises(ValueError, match="writable"):
        MemoryManager(stores=[store], add_tool_config=True)
    with pytest.raises(ValueError, match="capture is off"):
        await store.add(GREEN_TEA)
    with pytest.raises(ValueError, match="capture is off"):
        await store.add_messages([user(GREEN_TEA)])

    agent, _ = make_agent(store, ["Noted."] * 3)
    for text in (GREEN_TEA, LISBON, "Call me Sam"):
        await agent.invoke_async(text)

    assert posted(fake) == []
    assert len(fake.sent("POST", "/v1/search")) == 3


def test_a_turn_saves_the_captured_roles_words_once_in_the_pinned_memory(fake, make_store):
    store = capturing(make_store)
    assert (store.writable, store.extraction) == (True, True)
    agent, _ = make_agent(store, ["Green tea noted, thanks.", "Noted too."])
    agent(GREEN_TEA)
    agent(LISBON)
    assert [r.body for r in fake.sent(*MEMORIES)] == [
        {"content": text, "static": False, "title": "", "container": "ctr_main"} for text in (GREEN_TEA, LISBON)
    ]

    for roles, saved in [(("user", "assistant"), f"user: {GREEN_TEA}\nassistant: Noted."), ("assistant", "Noted.")]:
        agent, _ = make_agent(capturing(make_store, capture_roles=roles), ["Noted."])
        agent(GREEN_TEA)
        assert posted(fake)[-1] == saved


def test_the_managers_add_memory_tool_saves_through_add(fake, make_store, no_key_in_logs):
    script = [ToolCall("add_memory", {"entries": ["Sam prefers green tea"]}), "Saved."]
    agent, model = make_agent(capturing(make_store, extraction=None), list(script), add_tool_config=True)
    agent("Please remember that I prefer green tea.")
    assert model.tool_results()[-1]["status"] == "success"
    assert [(r.body["content"], r.body["container"]) for r in fake.sent(*MEMORIES)] == [
        ("Sam prefers green tea", "ctr_main")
    ]  # a refusal (an error result, without the key) is in the fault matrix


async def test_add_saves_one_note_with_its_flags_a_batch_its_captured_lines_and_each_refuses_what_is_no_note(
    fake, make_store
):
    store = capturing(make_store)
    await store.add("Prefers green tea", {"title": "Drinks"})
    await store.add("Is vegetarian", {"static": True})
    for content, metadata in [("   ", None), ("x", {"static": "false"}), ("x", {"static": 1}), ("x", {"title": 5})]:
        with pytest.raises(ValueError):
            await store.add(content, metadata)
    with pytest.raises(ValueError):
        await store.add("x", ["static"])  # type: ignore[arg-type]
    tool_result = {"toolResult": {"toolUseId": "t1", "status": "success", "content": []}}
    no_text = [assistant("Green tea noted."), {"role": "user", "content": [tool_result]}, user("   ")]
    assert await store.add_messages(no_text) is None  # type: ignore[arg-type]
    assert await store.add_messages([]) is None
    await store.add_messages([user(GREEN_TEA), assistant("Noted."), user("And oolong")])  # no context needed

    first, second, third = [r.body for r in fake.sent(*MEMORIES)]
    assert first == {"content": "Prefers green tea", "static": False, "title": "Drinks", "container": "ctr_main"}
    assert second["static"] is True and "container" not in second
    assert fake.standing == ["Is vegetarian"]
    assert third["content"] == f"{GREEN_TEA}\nAnd oolong"


# --- Never twice: the manager's retries, concurrent writes, new runs ---------------------------------
@pytest.mark.parametrize("retry", ["after the write saved", "while the write runs"])
def test_a_write_past_its_budget_is_not_sent_again_by_the_managers_retry(fake, make_store, gates, retry):
    """A retry that comes while the write still runs waits for it; one after it saved sends only the new words."""
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store, write_timeout=BUDGET)
    batches = spy_on_batches(store)
    original = store.add_messages

    async def release_once_the_retry_waits(messages, context=None):
        if len(batches) == 1 and retry == "while the write runs":  # the second flush, while the first write hangs
            waiting = await started(original(messages, context))  # now waiting for the first request
            gate.set()
            return await waiting
        return await original(messages, context)

    store.add_messages = release_once_the_retry_waits  # type: ignore[method-assign]
    agent, _ = make_agent(store, ["Noted.", "Noted too."])
    agent(GREEN_TEA)  # runs out of its budget: the manager keeps the batch for a retry
    assert fake.notes == []
    if retry == "after the write saved":
        gate.set()
        assert wait_until(lambda: store.counters()["writes_saved"] == 1, timeout=LONG)
    agent(LISBON)

    if MANAGER_SENDS_SEQUENCE_NUMBERS:
        assert batches == [[0, 1], [0, 1, 2, 3]]  # the manager retried the old batch with the new turn ...
    assert posted(fake) == [GREEN_TEA, LISBON]  # ... and only the new words were sent
    assert fake.saved() == [GREEN_TEA, LISBON]
    assert counts(store, "writes_deduplicated", "writes_saved", "write_timeouts") == (1, 2, 1)


async def test_concurrent_writes_of_one_batch_send_one_request_and_a_waiting_retry_sends_what_that_one_failed_to(
    fake, make_store, gates
):
    gates_of, arrived = [gates.new(), gates.new()], [threading.Event(), threading.Event()]
    answers = [routed(fake), status(429, "rate limited")]
    fake.on(*MEMORIES, *(signalling(arrived[n], hang(gates_of[n], then=answers[n])) for n in (0, 1)))
    store = capturing(make_store)
    for n, (old, new) in enumerate([(GREEN_TEA, None), (LISBON, "Call me Sam")]):
        messages = [user(old)]
        first = asyncio.create_task(store.add_messages(messages, batch([0])))
        # The manager's retry, the same batch (perhaps with a newer message): it waits for the first request.
        retry = asyncio.create_task(store.add_messages(messages + ([user(new)] if new else []), batch([0, 1][: 1 + n])))
        assert await until(arrived[n].is_set)  # both calls have started: one sends, the other waits for it
        gates_of[n].set()
        outcomes = await asyncio.gather(first, retry, return_exceptions=True)
        if n == 0:
            assert outcomes[0]["container"] == "ctr_main" and outcomes[1] is None  # nothing sent by the retry
        else:  # the first request failed (and says so); the retry, with budget left, sent the words itself
            assert isinstance(outcomes[0], membase.MembaseError) and not isinstance(outcomes[1], BaseException)
    fake.on(*MEMORIES, delayed(fake, 0.1))
    await asyncio.gather(store.add("Sam likes oolong"), store.add("Sam likes oolong"), store.add("Sam runs"))

    assert fake.saved()[:2] == [GREEN_TEA, f"{LISBON}\nCall me Sam"]
    assert sorted(fake.saved()[2:]) == ["Sam likes oolong", "Sam runs"]
    assert counts(store, "writes_deduplicated", "writes_lost") == (2, 0)


FACTS = ("Sam prefers green tea", "Sam lives in Lisbon", "Sam works on ledgers")


class ThreeFacts:
    """A strands.memory Extractor that always distills the same three facts."""

    def __init__(self) -> None:
        self.batches: list[list[Message]] = []

    async def extract(self, messages: list[Message], context: ExtractorContext | None = None) -> list[ExtractionResult]:
        self.batches.append(messages)
        return [ExtractionResult(content=fact) for fact in FACTS]


def test_on_the_extractor_path_only_the_fact_that_failed_is_sent_again(fake, make_store, caplog):
    answers = ByWords(fake)
    answers.on(FACTS[1], status(429, "rate limited"))
    extractor = ThreeFacts()
    agent, _ = make_agent(capturing(make_store, extraction={"extractor": extractor}), ["Noted.", "Noted too."])

    agent("I'm Sam, I like green tea, live in Lisbon and work on ledgers")
    assert sorted(fake.saved()) == sorted([FACTS[0], FACTS[2]])
    assert "memory extraction failed" in caplog.text
    agent("Thanks")

    assert len(extractor.batches) == 2  # the manager resent the whole batch; the store sent only the failed fact
    assert Counter(posted(fake)) == {FACTS[0]: 1, FACTS[1]: 2, FACTS[2]: 1}
    assert Counter(fake.saved()) == {fact: 1 for fact in FACTS}


def test_a_new_run_starting_at_sequence_zero_is_saved_and_the_same_words_said_again_are_too(fake, make_store):
    store = capturing(make_store)
    batches = spy_on_batches(store)
    for words in (GREEN_TEA, LISBON, GREEN_TEA):  # a new agent each time: new messages, sequence numbers from 0
        agent, _ = make_agent(store, ["Noted."])
        agent(words)
        del agent
        gc.collect()  # the earlier run's messages are gone; their identities must not be reused
    agent, _ = make_agent(store, ["Noted.", "Noted again."])
    agent(LISBON)
    agent(LISBON)  # one agent saying the same words twice: said twice

    if MANAGER_SENDS_SEQUENCE_NUMBERS:
        assert batches == [[0, 1], [0, 1], [0, 1], [0, 1], [2, 3]]
    assert fake.saved() == [GREEN_TEA, LISBON, GREEN_TEA, LISBON, LISBON]
    assert store.counters()["writes_deduplicated"] == 0


async def test_without_a_context_a_retried_batch_sends_only_what_is_new(fake, make_store):
    """strands 1.45 hands the store no context: a retry is told apart by its message objects."""
    store = capturing(make_store)
    messages = [user(GREEN_TEA), assistant("Noted.")]
    await store.add_messages(messages)
    assert await store.add_messages(messages) is None  # the manager's retry: the same message objects
    await store.add_messages([*messages, user(LISBON)])  # a retry with a newer message: only that is sent
    await store.add_messages([user(GREEN_TEA)])  # a new message with the same words: a new thing said
    fake.on(*MEMORIES, status(429, "rate limited"))
    failing = [user("Call me Sam")]
    with pytest.raises(membase.MembaseError):
        await store.add_messages(failing)
    await store.add_messages(failing)

    assert posted(fake) == [GREEN_TEA, LISBON, GREEN_TEA, "Call me Sam", "Call me Sam"]
    assert fake.saved() == [GREEN_TEA, LISBON, GREEN_TEA, "Call me Sam"]
    assert store.counters()["writes_deduplicated"] == 2


# --- A write past its budget: the turn goes on, and one line tells how the write ended ------------------
@pytest.mark.parametrize("late", ["saved", "failed"])
def test_a_write_past_its_budget_on_an_agent_built_for_one_request_logs_one_true_line_when_it_ends(
    fake, make_store, gates, caplog, late
):
    """Issue 26 (6): no manager is left to retry, so no line may promise one."""
    caplog.set_level(logging.DEBUG, logger="membase_strands")
    fake.remember(FACT)
    release = gates.new()
    fake.on(*MEMORIES, hang(release, then=fake.answer if late == "saved" else status(429, "rate limited")))
    store = capturing(make_store, write_timeout=BUDGET)
    agent, _ = make_agent(store, ["Noted."])  # built for this one request, as a web handler does

    assert "Noted." in str(agent(GREEN_TEA))
    del agent

    # The turn is over while Membase still holds the request, which goes on in the background; recall goes on as
    # usual meanwhile, neither waiting for the stuck write nor skipped.
    assert wait_until(lambda: posted(fake) == [GREEN_TEA], timeout=LONG) and fake.saved() == []
    assert membase_threads(WRITE_THREAD)
    assert [entry.content for entry in asyncio.run(store.search(QUESTION))] == [f"[Main] {FACT}"]
    assert counts(store, "write_timeouts", "writes_saved", "recall_timeouts") == (1, 0, 0)
    said = [line.split(" | ")[1] for line in lines(caplog, source="membase_strands")]
    assert said == ["Membase write ran out of time; it goes on in the background"]  # at INFO: the manager warns
    release.set()
    outcome = "finished; it is saved" if late == "saved" else RETRY_ONLY
    assert wait_until(lambda: logged(caplog, f"a write that ran out of time {outcome}")() > 0, timeout=LONG)
    store.close()

    said = [line.split(" | ")[1] for line in lines(caplog, source="membase_strands") if "a write" in line]
    assert said == [f"a write that ran out of time {outcome}"]
    assert posted(fake) == [GREEN_TEA]
    assert fake.saved() == ([GREEN_TEA] if late == "saved" else [])
    assert counts(store, "writes_lost", "write_errors") == (0, 0 if late == "saved" else 1)


async def test_a_retry_that_waited_past_its_budget_for_the_earlier_request_still_sends_nothing(fake, make_store, gates):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store, write_timeout=0.1)  # both calls wait on the gate; the third one sends nothing
    messages, context = [user(GREEN_TEA)], batch([0])

    with pytest.raises(MembaseWriteTimeout, match="goes on in the background"):
        await store.add_messages(messages, context)
    with pytest.raises(MembaseWriteTimeout, match="an earlier write of the same content is still running"):
        await store.add_messages(messages, context)
    gate.set()
    assert await until(lambda: store.counters()["writes_saved"] == 1, timeout=LONG)
    assert await store.add_messages(messages, context) is None

    assert posted(fake) == [GREEN_TEA]
    assert store.counters()["write_timeouts"] == 2


async def test_without_a_write_timeout_the_caller_waits_for_the_request(fake, make_store):
    fake.always(*MEMORIES, delayed(fake, 0.2))
    store = capturing(make_store, write_timeout=None)
    agent, _ = make_agent(store, ["Noted."])
    await agent.invoke_async(GREEN_TEA)
    await agent.memory_manager.flush()
    answer = await store.add(FACTS[0])

    assert answer["container"] == "ctr_main"
    assert fake.saved() == [GREEN_TEA, FACTS[0]]  # saved by the time each call returned
    assert (store.counters()["write_timeouts"], store.counters()["writes_saved"]) == (0, 2)


# --- A failed write: raised to the caller, or kept by the store and sent again once ----------------------
async def test_a_failed_write_raises_to_its_caller_is_never_reported_saved_and_the_next_attempt_saves_it_once(
    fake, make_store
):
    fake.on(*MEMORIES, status(429, "rate limited"))
    store = capturing(make_store)
    messages, context = [user(GREEN_TEA), assistant("Noted."), user(LISBON)], batch([0, 1, 2])

    with pytest.raises(membase.MembaseError):
        await store.add_messages(messages, context)
    assert (fake.notes, store.counters()["writes_saved"], store.counters()["write_errors"]) == ([], 0, 1)
    assert (await store.add_messages(messages, context))["container"] == "ctr_main"
    assert await store.add_messages(messages, context) is None  # a third attempt sends nothing
    fake.on(*MEMORIES, status(429, "busy"))
    with pytest.raises(membase.MembaseError):
        await store.add(FACTS[0])
    await store.add(FACTS[0])
    await store.add(FACTS[0])
    fake.on(*MEMORIES, status(403), status(403))
    for refused in (store.add("Prefers oolong"), store.add_messages([user("Call me Sam")])):
        with pytest.raises(MembaseAccessError, match="narrowed or revoked"):  # a PermissionError
            await refused

    both = f"{GREEN_TEA}\n{LISBON}"
    assert posted(fake) == [both, both, FACTS[0], FACTS[0], "Prefers oolong", "Call me Sam"]  # one attempt each
    assert fake.saved() == [both, FACTS[0]]
    assert counts(store, "writes_saved", "writes_deduplicated", "writes_lost") == (3, 3, 0)


def test_a_write_that_fails_late_is_sent_again_by_the_managers_retry_once(fake, make_store, gates, caplog):
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=status(429, "rate limited")))
    store = capturing(make_store, write_timeout=BUDGET)
    agent, _ = make_agent(store, ["Noted.", "Noted too.", "Fine."])

    agent(GREEN_TEA)
    gate.set()
    assert wait_until(logged(caplog, f"a write that ran out of time {RETRY_ONLY}", logging.WARNING), timeout=LONG)
    assert (store.counters()["writes_saved"], store.counters()["write_errors"]) == (0, 1)
    agent(LISBON)  # the manager's retry carries the old words with the new: the store sends them with it, once
    agent("Call me Sam")

    assert posted(fake) == [GREEN_TEA, f"{GREEN_TEA}\n{LISBON}", "Call me Sam"]
    assert fake.saved() == [f"{GREEN_TEA}\n{LISBON}", "Call me Sam"]
    assert store.counters()["writes_lost"] == 0


@pytest.mark.parametrize("then", ["next turn", "close"])
async def test_a_cancelled_flush_whose_write_then_fails_is_said_lost_in_one_warning_and_never_sent_twice(
    fake, make_store, gates, caplog, no_key_in_logs, then
):
    """A web server cancels the flush (its client hung up); Strands counts the batch as handled and never sends it
    again. The store does not either (it keeps no batch to send again): the words are lost, and a WARNING says so."""
    caplog.set_level(logging.INFO)
    in_flight, release = threading.Event(), gates.new()
    fake.on(*MEMORIES, signalling(in_flight, hang(release, then=status(429, "rate limited"))))
    store = capturing(make_store)
    agent, model = make_agent(store, ["Noted."])

    async def handle_request() -> None:
        await agent.invoke_async(GREEN_TEA)
        await agent.memory_manager.flush()

    await cancelled_once_sent(handle_request(), in_flight)
    assert len(model.calls) == 1  # the turn itself ran before the flush was cancelled
    release.set()
    assert await until(logged(caplog, f"a write whose caller was cancelled {LOST}", logging.WARNING), timeout=LONG)
    if then == "next turn":  # a new agent, as a web server builds one per request
        agent, model = make_agent(store, ["Noted too."])
        await agent.invoke_async(LISBON)
        await agent.memory_manager.flush()
    else:
        await store.aclose()

    assert sorted(fake.saved()) == ([LISBON] if then == "next turn" else [])
    assert posted(fake).count(GREEN_TEA) == 1  # the request that failed, once
    assert counts(store, "write_cancellations", "write_errors", "errors.rate_limited") == (1, 1, 1)
    assert counts(store, "writes_lost") == (1,)


@pytest.mark.parametrize("first_request", ["saved", "failed"])
async def test_every_cancelled_wait_is_counted_and_words_a_cancelled_retry_never_sent_are_said_lost(
    fake, make_store, gates, caplog, first_request
):
    """A retry brings the old words and new ones and waits while an earlier request still sends the old. Cancelled
    then (a flush a web server gave up on: no retry will come), its new words were never sent: a WARNING says they
    are lost. The old ones, saved after their caller was cancelled too, are never sent again; failed, they are lost
    too, said once."""
    caplog.set_level(logging.INFO)
    saved, gate, in_flight = first_request == "saved", gates.new(), threading.Event()
    fake.on(*MEMORIES, signalling(in_flight, hang(gate, then=routed(fake) if saved else status(429, "rate limited"))))
    store = capturing(make_store)
    old = [user(GREEN_TEA), user(CYCLING)]
    first = asyncio.create_task(store.add_messages(old, batch([0, 1])))
    assert await until(in_flight.is_set, timeout=LONG)
    retry = await started(store.add_messages([*old, user(LISBON)], batch([0, 1, 2])))  # waits for the first's words
    for task in (retry, first):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert logged(caplog, "was cancelled before it was sent: its words are not saved", logging.WARNING)() == 1
    gate.set()
    outcome = "finished; it is saved" if saved else LOST
    assert await until(logged(caplog, f"a write whose caller was cancelled {outcome}"), timeout=LONG)
    if saved:
        assert await store.add_messages(old, batch([0, 1])) is None

    await store.add_messages([user("Call me Sam")], batch([3]))  # the old words are never sent again
    assert sorted(posted(fake)) == sorted([f"{GREEN_TEA}\n{CYCLING}", "Call me Sam"])
    names = ("write_cancellations", "write_errors", "writes_lost")
    assert counts(store, *names) == ((2, 0, 1) if saved else (2, 1, 3))  # writes_lost counts words: by message


# --- Bounds: what the store keeps alive ---------------------------------------------------------------
BIG = 100 * 1024


def big_text(turn: int) -> str:
    """About 100 KB of words, a new string on every call."""
    return f"turn {turn}: " + "w" * BIG


async def test_the_store_keeps_its_byte_bound_of_words_alive_not_every_saved_message(fake, make_store):
    store = capturing(make_store)

    async def one_turn(turn: int) -> None:  # a new agent run: new message objects, sequence numbers from 0
        await store.add_messages([user(big_text(turn)), assistant("Noted.")], batch([0, 1]))

    def forget_what_the_fake_holds() -> None:
        fake.notes.clear()
        fake.requests.clear()
        gc.collect()

    await one_turn(-1)  # warm up connections and caches before measuring
    forget_what_the_fake_holds()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for turn in range(40):  # 4 MB of words, four times the bound
            await one_turn(turn)
        forget_what_the_fake_holds()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()

    assert (store.counters()["writes_saved"], store.counters()["write_timeouts"]) == (41, 0)
    assert grown < 2 * _writes.RECORD_BYTES, f"the store kept {grown / 2**20:.1f} MiB alive"  # its bound, and room


@pytest.mark.parametrize("late_size", [10, _writes.RECORD_BYTES + 1], ids=["small", "over-the-bound"])
def test_a_batch_saved_late_is_not_sent_again_after_newer_words_fill_the_byte_bound(fake, make_store, gates, late_size):
    """The byte bound forgets the oldest saved words first, but never the newest late save: the manager's retry of
    that batch is on its way, and must send nothing."""
    gate = gates.new()
    fake.on(*MEMORIES, hang(gate, then=routed(fake)))
    store = capturing(make_store, write_timeout=BUDGET)
    late_words = "late " + "w" * late_size
    agent, _ = make_agent(store, ["Noted.", "Noted too."])
    agent(late_words)  # runs out of time: the manager keeps the batch for a retry
    gate.set()
    assert wait_until(lambda: store.counters()["writes_saved"] == 1, timeout=LONG)

    for turn in range(12):  # other conversations on the same store: more words than the bound keeps
        asyncio.run(store.add_messages([user(big_text(turn))], batch([0])))
    agent(LISBON)  # the manager retries the old batch with the new turn

    assert posted(fake).count(late_words) == 1
    assert posted(fake)[-1] == LISBON


async def test_past_its_size_bound_the_store_forgets_the_oldest_saved_part_never_a_running_one(fake, make_store, gates):
    gate, in_flight = gates.new(), threading.Event()
    fake.on(*MEMORIES, signalling(in_flight, hang(gate, then=routed(fake))))
    store = capturing(make_store)
    running = [user("running")]
    await cancelled_once_sent(store.add_messages(running, batch([0])), in_flight)
    many = [user(f"note {n}") for n in range(_writes.RECORD_SIZE + 1)]  # one more part than the store remembers
    await store.add_messages(many, batch(list(range(1, len(many) + 1))))

    assert await store.add_messages(many[-1:], batch([len(many)])) is None  # the newest is remembered
    await store.add_messages(many[:1], batch([1]))  # the oldest was forgotten: sent again
    retry = await started(store.add_messages(running, batch([0])))  # the running one: waited for, not sent
    gate.set()
    assert await retry is None

    assert [text.count("\n") + 1 for text in posted(fake)] == [1, len(many), 1]
    assert posted(fake)[-1] == "note 0"


# --- A write whose thread cannot start -----------------------------------------------------------------
def test_a_write_whose_thread_cannot_start_fails_at_once_and_the_managers_retry_sends_it(
    fake, make_store, monkeypatch, caplog
):
    """The next write thread fails to start, as when the process is out of threads. The library's threads start
    afresh and end as soon as they are idle, so no thread is left to take the write instead."""
    earlier = set(threading.enumerate())  # the idle threads of the set replaced here never take its calls
    monkeypatch.setattr(_calls, "_threads", _calls._Threads())
    monkeypatch.setattr(_calls, "IDLE_SECONDS", 0.0)
    refused, start = [], threading.Thread.start

    def start_or_refuse(thread: threading.Thread) -> None:
        if thread.name.startswith(WRITE_THREAD) and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_refuse)
    store = capturing(make_store, write_timeout=5.0)  # failing at once, the write never meets its budget
    original = store.add_messages

    async def once_no_thread_is_left(messages, context=None):  # not even an idle one that could take the write
        ours = lambda: {thread for thread in threading.enumerate() if thread.name.startswith("membase-")}  # noqa: E731
        assert await until(lambda: not ours() - earlier, timeout=LONG)
        return await original(messages, context)

    store.add_messages = once_no_thread_is_left  # type: ignore[method-assign]
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent(GREEN_TEA)

    assert refused  # the write's thread was refused
    assert posted(fake) == []
    assert "memory extraction failed" in caplog.text  # the manager keeps the batch
    assert counts(store, "write_errors", "write_timeouts") == (1, 0)
    agent(LISBON)
    # The retry did not wait for a write that never started: it sent the old words with the new, at once.
    assert posted(fake) == [f"{GREEN_TEA}\n{LISBON}"]
    assert counts(store, "writes_saved", "write_timeouts") == (2, 0)


@pytest.mark.parametrize("gateway_status", [502, 503, 504, 520, 524])
def test_a_note_stored_behind_a_gateway_that_gave_up_on_it_is_never_sent_again(fake, make_store, gateway_status):
    """A proxy, load balancer or CDN in front of Membase answers with a 5xx (Membase documents none of its own) after
    Membase read the note: it may be stored. The manager's retry (the next turn's flush) sends nothing again, and
    membase_save says the note may or may not have been saved."""

    def stored_then_gateway_gave_up(request: httpx.Request) -> httpx.Response:
        fake.answer(request)  # Membase stored it...
        return httpx.Response(gateway_status, text="<html>Gateway Timeout</html>")  # ...its gateway gave up

    fake.on(*MEMORIES, stored_then_gateway_gave_up)
    agent, _ = make_agent(capturing(make_store), ["Noted.", "Noted again."])
    agent(GREEN_TEA)  # the flush fails: the manager keeps the batch
    agent(LISBON)  # the retry sends only the new words
    fake.on(*MEMORIES, stored_then_gateway_gave_up)
    tool_agent, model = make_agent(make_store(container="Main"), [ToolCall("membase_save", {"content": FACT}), "ok"])
    tool_agent("Please remember it.")

    assert Counter(fake.saved()) == Counter([GREEN_TEA, LISBON, FACT])
    assert [text.count(GREEN_TEA) for text in posted(fake)] == [1, 0, 0]
    assert "may or may not have been saved" in model.tool_result_text()


async def test_closing_after_turns_whose_words_never_reached_the_store_warns_once_with_what_to_call(
    fake, make_store, caplog
):
    """An async caller that never flushes: the manager keeps the turns' words, and the store, closing, says how to
    hand them over; one that flushes hears nothing."""
    caplog.set_level(logging.DEBUG, logger="membase_strands")
    for flushed in (False, True):
        caplog.clear()
        store = capturing(make_store)
        agent, _ = make_agent(store, ["Noted.", "Noted too."])
        async with store:
            await agent.invoke_async(GREEN_TEA)
            await agent.invoke_async(LISBON)
            if flushed:
                await agent.memory_manager.flush()
        warned = lines(caplog, logging.WARNING, "membase_strands")
        if flushed:
            assert warned == [] and fake.saved() == [f"{GREEN_TEA}\n{LISBON}"]
        else:
            [said] = warned
            assert "closed with 2 turn(s) recalled since the last captured batch" in said
            assert "agent.shutdown_async()" in said and "agent.memory_manager.flush()" in said
            assert fake.saved() == []

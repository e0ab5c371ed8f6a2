"""Closing a store: ``close()``, ``await aclose()``, ``with`` / ``async with``, and interpreter exit.

A close waits up to ``close_timeout`` for the writes still running, and returns once every outcome it waited for is
on record and said; ``aclose()`` without blocking the event loop.
Interpreter exit is tested in process (the exit hook over the test's own stores) and once for real, in a subprocess.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from membase_strands import MembaseMemoryStore, MembaseWriteTimeout, _writes
from membase_strands.testing import API_KEY, InMemoryMembase, ToolCall, hang, status
from tests.support.exit_program import Program
from tests.support.loopback import LoopbackMembase, arrived, ok_json, stall
from tests.support.store_helpers import (
    FACT,
    GREEN_TEA,
    LONG,
    MEMORIES,
    QUESTION,
    Ticker,
    cancelled_once_sent,
    drain_began,
    lines,
    logged,
    make_agent,
    sdk_client,
    signalling,
    turn_and_flush,
    unreferenced,
    until,
    user,
)

BUDGET = 0.25  # only for writes a gate holds: it always runs out
EXITING = "the interpreter is exiting; waiting up to"
NOT_FINISHED = "not confirmed saved, and lost if the process ends now"
WAITING = "waiting for writes still running"
CANCELLED_SAVED = "a write whose caller was cancelled finished; it is saved"
CANCELLED_LOST = "a write whose caller was cancelled failed; it is not saved, and nothing sends it again"
SAVED_ANSWER = {"memory_id": "ctr_main:1", "container": "ctr_main"}


def capturing(membase: InMemoryMembase, write_timeout: float = LONG, **options: Any) -> MembaseMemoryStore:
    return membase.store(capture=True, extraction=True, container="Main", write_timeout=write_timeout, **options)


async def held_write(membase: InMemoryMembase, store: MembaseMemoryStore, then: Any, release: threading.Event) -> None:
    """A write of GREEN_TEA whose caller is cancelled once Membase holds it; ``then`` answers it on ``release``."""
    in_flight = threading.Event()
    membase.on(*MEMORIES, signalling(in_flight, hang(release, then=then)))
    await cancelled_once_sent(store.add(GREEN_TEA), in_flight)


async def timed_out_write(membase: InMemoryMembase, store: MembaseMemoryStore, then: Any, release: threading.Event):
    """A write of GREEN_TEA out of its (short) budget while Membase holds it; ``then`` answers on ``release``."""
    membase.on(*MEMORIES, hang(release, then=then))
    with pytest.raises(MembaseWriteTimeout):
        await store.add(GREEN_TEA)


# --- Closed: refused at once, nothing sent, nothing else closed -------------------------------------------
async def test_every_way_of_closing_refuses_later_calls_and_leaves_the_host_and_a_passed_in_client_usable(fake, caplog):
    fake.remember(FACT)
    store = fake.store(capture=True, container="Main", recall_timeout=LONG)
    calls = [ToolCall("membase_search", {"query": "ledger"}), ToolCall("membase_save", {"content": "a note"})]
    agent, model = make_agent(store, [*calls, ToolCall("membase_profile", {}), "ok", "ok"])
    store.close()
    store.close()  # twice is harmless
    with fake.store(recall_timeout=LONG) as second:
        assert await second.search(QUESTION)
    async with fake.store(recall_timeout=LONG) as third:
        assert [entry.content for entry in await third.search(QUESTION)] == [f"[Main] {FACT}"]
    sent = len(fake.requests)
    for call in (store.search("ledger"), store.add("a note"), store.add_messages([user("a note")])):
        with pytest.raises(RuntimeError, match="MembaseMemoryStore 'membase' is closed; create a new store"):
            await call
    for closed in (second, third):
        with pytest.raises(RuntimeError, match="closed"):
            await closed.search(QUESTION)

    await agent.invoke_async("go")  # the tools: each says the store was closed, in a sentence
    for result in model.tool_results():
        assert result["status"] == "error"
        assert "this memory store was closed" in result["content"][0]["text"]
        assert API_KEY not in result["content"][0]["text"]
    assert str(await agent.invoke_async(QUESTION)).strip() == "ok"  # a turn goes on without memory
    assert model.memory_block() is None
    assert len(fake.requests) == sent
    assert any("is closed" in r.getMessage() for r in caplog.records if r.name.startswith("strands.memory"))

    client = sdk_client(fake)
    with MembaseMemoryStore(client=client):
        pass
    async with MembaseMemoryStore(client=client):
        pass
    assert client.search("Postgres")["results"]  # still open: a store never closes a client it was given
    async with fake.store(recall_timeout=LONG) as again:  # and the host's shared connections still serve
        assert await again.search(QUESTION)


# --- Closing waits for the writes still running ---------------------------------------------------------
async def test_aclose_waits_for_a_running_write_while_the_event_loop_keeps_running(fake, gates, caplog):
    caplog.set_level(logging.INFO)
    in_flight, release = threading.Event(), gates.new()
    fake.on(*MEMORIES, signalling(in_flight, hang(release, then=fake.answer)))
    store = capturing(fake)
    agent, model = make_agent(store, ["Noted."])
    turn = asyncio.create_task(turn_and_flush(agent, GREEN_TEA))
    assert await until(in_flight.is_set, timeout=LONG)

    with Ticker(release_after=5, release=release.set) as ticker:
        await asyncio.wait_for(store.aclose(), LONG * 2)
        saved, ticked = store.counters()["writes_saved"], ticker.ticks  # on record when aclose() returns

    assert ticked >= 5  # the ticker ran while aclose() waited: only it released the write
    assert saved == 1
    assert fake.saved() == [GREEN_TEA]
    await asyncio.wait_for(turn, LONG)  # the turn's own flush got the same answer
    assert (len(model.calls), len(fake.sent(*MEMORIES))) == (1, 1)
    assert logged(caplog, WAITING, logging.INFO)()


async def test_aclose_gives_up_after_close_timeout_and_the_write_it_leaves_is_saved_once_and_said_so(gates, caplog):
    """Issue 21: close() waits its close_timeout and returns; the write it no longer waits for goes on, on the
    connection it has, and its outcome is logged in words true after close."""
    caplog.set_level(logging.INFO)
    with LoopbackMembase() as server:
        in_flight, release = threading.Event(), gates.new()
        server.on(*MEMORIES, arrived(in_flight, stall(release, then=ok_json(SAVED_ANSWER))))
        store = MembaseMemoryStore(
            api_key=API_KEY,
            base_url=server.url,
            capture=True,
            container="Main",
            write_timeout=BUDGET,
            close_timeout=BUDGET,
        )
        with pytest.raises(MembaseWriteTimeout):
            await store.add(GREEN_TEA)

        with Ticker() as ticker:
            await store.aclose()
            ticked = ticker.ticks
        assert ticked >= 1  # the loop ran meanwhile
        still = f"writes still running when closing stopped waiting after {BUDGET:g} s: {NOT_FINISHED}"
        assert logged(caplog, still, logging.WARNING)() == 1
        assert logged(caplog, WAITING, logging.INFO)() == 1  # one wait of close_timeout, announced once
        assert store.counters()["writes_saved"] == 0
        release.set()
        assert await until(logged(caplog, "a write that ran out of time finished; it is saved"), timeout=LONG)

    assert server.fake.saved() == [GREEN_TEA]
    assert len(server.fake.sent(*MEMORIES)) == 1  # saved once
    counters = store.counters()
    assert (counters["writes_saved"], counters["write_errors"], counters["writes_lost"]) == (1, 0, 0)
    texts = [*lines(caplog), *(record.exc_text or "" for record in caplog.records)]  # lines and their tracebacks
    assert not any("Bad file descriptor" in text or "Errno 9" in text for text in texts)  # no socket closed under it


async def test_a_cancelled_aclose_still_closes_and_every_later_close_returns_once_the_writes_are_on_record(
    fake, gates, caplog
):
    caplog.set_level(logging.INFO)
    in_flight, release = threading.Event(), gates.new()
    fake.on(*MEMORIES, signalling(in_flight, hang(release, then=fake.answer)))
    store = capturing(fake)
    agent, _ = make_agent(store, ["Noted."])
    turn = asyncio.create_task(turn_and_flush(agent, GREEN_TEA))
    assert await until(in_flight.is_set, timeout=LONG)
    closing = asyncio.create_task(store.aclose())
    assert await until(drain_began(caplog), timeout=LONG)  # it waits for the write
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    # Closed all the same, so the store never ends half closed; its closing goes on in the background.
    with pytest.raises(RuntimeError, match="closed"):
        await store.search(QUESTION)

    calling, from_a_thread = threading.Event(), Future[int]()

    def close_from_another_thread() -> None:
        calling.set()
        store.close()
        from_a_thread.set_result(store.counters()["writes_saved"])  # what that caller sees once close() returns

    async def aclose_again() -> int:
        await store.aclose()
        return store.counters()["writes_saved"]

    threading.Thread(target=close_from_another_thread, daemon=True).start()
    again = asyncio.create_task(aclose_again())  # each waits for the first closing, up to write_timeout
    assert await until(calling.is_set, timeout=LONG)
    await asyncio.sleep(0)  # let the second closer start waiting too
    release.set()

    assert await asyncio.wait_for(again, LONG) == 1  # neither returned before the write was on record
    assert await asyncio.wait_for(asyncio.wrap_future(from_a_thread), LONG) == 1
    await asyncio.wait_for(turn, LONG)
    assert fake.saved() == [GREEN_TEA]


class HeldLogLine(logging.Handler):
    """A slow log handler (one that ships lines over the network, say): it holds the thread that logs a line with
    ``words`` until ``go`` is set; ``reached`` is set when that line arrives."""

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


async def test_close_waits_for_the_outcome_of_a_write_that_ended_just_before_it_began(fake, gates, caplog):
    caplog.set_level(logging.INFO)
    release = gates.new()
    store = capturing(fake)
    await held_write(fake, store, fake.answer, release)
    slow = HeldLogLine(CANCELLED_SAVED)
    logging.getLogger("membase_strands").addHandler(slow)
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
        logging.getLogger("membase_strands").removeHandler(slow)
    assert logged(caplog, CANCELLED_SAVED)() == 1
    assert fake.saved() == [GREEN_TEA]


@pytest.mark.parametrize(("outcome", "closer"), [("saved", "aclose"), ("failed", "close")])
async def test_a_close_waits_for_a_write_nobody_waits_for_and_says_how_it_ended_before_it_returns(
    fake, gates, caplog, outcome, closer
):
    """The write ends while the store closes: every outcome is logged and counted when the close returns; a failed
    one is said lost (its caller was cancelled: no manager retry comes), never sent twice."""
    caplog.set_level(logging.INFO)
    release = gates.new()
    store = capturing(fake)
    await held_write(fake, store, fake.answer if outcome == "saved" else status(429, "rate limited"), release)
    closing = asyncio.ensure_future(store.aclose() if closer == "aclose" else asyncio.to_thread(store.close))
    assert await until(drain_began(caplog), timeout=LONG)
    release.set()
    await closing

    said = [line.split(" | ")[1] for line in lines(caplog, logging.INFO, "membase_strands")]
    names = ("writes_saved", "writes_lost", "write_errors", "errors.rate_limited")
    counters = {name: store.counters().get(name, 0) for name in names}
    if outcome == "saved":
        assert said.count(CANCELLED_SAVED) == 1 and fake.saved() == [GREEN_TEA]
        assert list(counters.values()) == [1, 0, 0, 0]
    else:
        assert said.count(CANCELLED_LOST) == 1 and fake.saved() == []
        assert list(counters.values()) == [0, 1, 1, 1]
    assert len(fake.sent(*MEMORIES)) == 1


async def test_aclose_awaited_by_a_task_nothing_references_finishes_once_the_write_it_waits_for_ends(
    fake, gates, caplog
):
    """Issue 26 (1): a server's lifespan task is referenced by nothing else; a garbage collection while it waits
    must not destroy it, or the close never completes."""
    caplog.set_level(logging.INFO)
    release = gates.new()
    store = capturing(fake)
    await held_write(fake, store, fake.answer, release)

    closed = unreferenced(store.aclose)
    assert await until(drain_began(caplog), timeout=LONG)  # the close waits for the write
    gc.collect()
    release.set()

    assert await until(closed.is_set, timeout=LONG), "the task awaiting aclose() never finished"
    assert fake.saved() == [GREEN_TEA]
    assert len(fake.sent(*MEMORIES)) == 1
    assert "Task was destroyed but it is pending" not in caplog.text


# --- Interpreter exit, in process: the exit hook itself ------------------------------------------------
@pytest.fixture
def exit_hook(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The atexit hook, over only the stores this test builds."""
    monkeypatch.setattr(_writes, "_records", weakref.WeakSet())
    return _writes._wait_at_exit


async def test_the_exit_hook_waits_for_a_write_its_close_stopped_waiting_for_and_is_quiet_with_nothing_to_do(
    exit_hook, fake, gates, caplog
):
    caplog.set_level(logging.INFO)
    idle = capturing(fake, name="idle")
    release, closed = gates.new(), capturing(fake, name="closed", write_timeout=BUDGET, close_timeout=LONG)
    await timed_out_write(fake, closed, fake.answer, release)

    hook = asyncio.create_task(asyncio.to_thread(exit_hook))  # the interpreter exits: it waits for the write
    assert await until(logged(caplog, f"store=<closed> | {EXITING}"), timeout=LONG)
    release.set()
    await asyncio.wait_for(hook, LONG)

    assert logged(caplog, "a write that ran out of time finished; it is saved")() == 1
    assert (fake.saved(), len(fake.sent(*MEMORIES))) == ([GREEN_TEA], 1)
    assert not any("store=<idle>" in line for line in lines(caplog))
    idle.close()


async def test_the_exit_hook_names_the_store_never_the_words_and_a_write_failing_in_its_wait_is_lost_in_one_line(
    exit_hook, fake, gates, caplog, no_key_in_logs
):
    notes, other, release = (
        capturing(fake, name="notes", write_timeout=BUDGET, close_timeout=BUDGET),
        InMemoryMembase(),
        gates.new(),
    )
    await timed_out_write(fake, notes, fake.answer, gates.new())  # not answered while the hook waits
    failing = capturing(other)
    await held_write(other, failing, status(429, "rate limited"), release)

    hook = asyncio.create_task(asyncio.to_thread(exit_hook))
    assert await until(logged(caplog, f"store=<membase> | {EXITING}"), timeout=LONG)
    release.set()  # it fails within the wait
    await asyncio.wait_for(hook, LONG)

    assert f"store=<notes> | {EXITING} {BUDGET:g} s for writes still running" in lines(caplog, logging.INFO)
    assert sorted(lines(caplog, logging.WARNING, "membase_strands")) == [
        f"store=<membase>, reason=<rate limited> | {CANCELLED_LOST}",  # one line, not two
        f"store=<notes>, writes=<1> | writes still running when closing stopped waiting after {BUDGET:g} s: "
        f"{NOT_FINISHED}",
    ]
    assert (failing.counters()["write_errors"], failing.counters()["writes_lost"]) == (1, 1)
    assert all(GREEN_TEA not in line for line in lines(caplog))


async def test_a_write_that_starts_while_the_exit_hook_waits_is_waited_for_too(exit_hook, fake, gates, caplog):
    """Daemon threads still run during atexit hooks: an agent on a daemon thread's loop may flush then."""
    caplog.set_level(logging.INFO)
    arrivals, releases = [threading.Event(), threading.Event()], [gates.new(), gates.new()]
    fake.on(*MEMORIES, *(signalling(arrivals[n], hang(releases[n], then=fake.answer)) for n in (0, 1)))
    store = capturing(fake)
    first = asyncio.create_task(store.add(GREEN_TEA))
    assert await until(arrivals[0].is_set, timeout=LONG)

    hook = asyncio.create_task(asyncio.to_thread(exit_hook))
    assert await until(logged(caplog, EXITING), timeout=LONG)
    second = asyncio.create_task(store.add("I live in Lisbon."))  # starts while the hook waits for the first
    assert await until(arrivals[1].is_set, timeout=LONG)
    releases[0].set()
    await asyncio.wait_for(first, LONG)
    # The hook saw the new write and waits for it as well, and says so.
    assert await until(lambda: logged(caplog, WAITING)() == 2, timeout=LONG)
    assert not hook.done()
    releases[1].set()
    await asyncio.wait_for(asyncio.gather(hook, second), LONG)

    assert fake.saved() == [GREEN_TEA, "I live in Lisbon."]
    assert not logged(caplog, NOT_FINISHED)()


# --- Interpreter exit, for real: one subprocess, three stores, two forks -------------------------------------
def test_at_exit_each_process_waits_for_its_own_running_writes_within_close_timeout_and_says_how_they_ended(gates):
    servers = [LoopbackMembase() for _ in range(3)]
    try:
        preloaded, graced, cut = servers
        releases = {"preloaded": gates.new(), "graced": gates.new()}
        preloaded.on(*MEMORIES, stall(releases["preloaded"], then=ok_json(SAVED_ANSWER)))
        graced.on(*MEMORIES, stall(releases["graced"], then=ok_json(SAVED_ANSWER)))
        cut.on(*MEMORIES, stall(gates.new()))  # never answers while the program runs
        program = Program(*(server.url for server in servers))
        try:
            for name in ("preloaded", "graced"):  # each write is still running when its process's exit begins
                assert program.wait_for_line(f"store=<{name}> | {EXITING} 30 s"), program.output()
                releases[name].set()
        finally:
            code = program.finish()
    finally:
        for server in servers:
            server.close()

    assert code == 0, program.output()
    assert API_KEY not in program.output()
    parent, child = program.process.pid, program.pid_of("INFO program preloaded child")
    # A store built before the fork gets its exit wait in the child that used it, and only there.
    said = program.lines(child)
    assert any(f"store=<preloaded>, writes=<1> | {WAITING}" in line for line in said), program.output()
    assert any(f"store=<preloaded>, reason=<cancelled> | {CANCELLED_SAVED}" in line for line in said)
    assert program.counters(child)["preloaded"]["writes_saved"] == 1
    assert preloaded.fake.saved() == [GREEN_TEA]
    # A child forked while its parent's writes run neither waits for them nor reports them.
    forked = program.pid_of("INFO program forked child")
    assert not any(EXITING in line or NOT_FINISHED in line for line in program.lines(forked)), program.output()
    assert program.counters(forked)["graced"]["writes_saved"] == 0
    # The parent: one write ends within the wait and is saved; the other is cut off after 0.5 s, and it says so.
    said = program.lines(parent)
    exiting = next(i for i, line in enumerate(said) if f"store=<graced> | {EXITING}" in line)
    assert any(f"store=<graced>, reason=<cancelled> | {CANCELLED_SAVED}" in line for line in said[exiting:])
    cut_off = [
        f"INFO membase_strands store=<cut> | {EXITING} 0.5 s for writes still running",
        f"INFO membase_strands store=<cut>, writes=<1> | {WAITING}",
        f"WARNING membase_strands store=<cut>, writes=<1> | writes still running when closing stopped waiting after "
        f"0.5 s: {NOT_FINISHED}",
    ]
    assert [line.split(" ", 2)[2] for line in said if "store=<cut>" in line][-3:] == cut_off
    assert not any(NOT_FINISHED in line for line in said if "store=<cut>" not in line)
    graced_counted, cut_counted = program.counters(parent)["graced"], program.counters(parent)["cut"]
    assert (graced_counted["writes_saved"], cut_counted["write_timeouts"], cut_counted["writes_saved"]) == (1, 1, 0)
    assert not any(GREEN_TEA in line for line in program.err if " membase_strands " in line)  # never the words

"""The lifecycle: ``close()``, ``await aclose()``, ``with`` / ``async with`` (store and pool), and interpreter exit.

``aclose()`` must drain captured writes still running without blocking the event loop: the tests
run a ticker task beside it, and only the ticker releases the held write, so an ``aclose()`` that
blocked the loop would wait out its whole budget and return with the write not saved.

Closing never pulls a connection from under a running write: a store built from a key sends through the
process's shared connection pool, which it never closes, and a local engine closes only after the last
running write has ended. A write still running when the wait ends has its outcome logged when it ends, in
words that are true after close. These are tested over a real loopback server and the real local engine.

Interpreter exit is tested in process (the exit hook itself, over only the test's own stores) and with real
subprocesses: a small program builds a store over the loopback HTTP server started here, runs one
synchronous turn whose captured write outlives its budget (the server holds it), and exits. The test reads
the program's log lines as they come and releases the held write on the line that says the interpreter is
exiting.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import membase
import pytest

from membase_strands import MembaseMemoryStore, MembaseStorePool, MembaseWriteTimeout, _background, _http
from membase_strands.testing import API_KEY, InMemoryMembase, hang, status
from membase_strands.testing._membase import error
from tests.support.local_engine import engine_unavailable
from tests.support.loopback import LoopbackMembase, RawAction, arrived, ok_json, raw_answer, stall
from tests.support.store_helpers import (
    FACT,
    LONG,
    QUESTION,
    Gates,
    client_of,
    drain_began,
    make_agent,
    set_write_budget,
    settle,
    signalling,
    until,
    wait_until,
)

MEMORIES = ("POST", "/v1/memories")
GREEN_TEA = "I like green tea."
BUDGET = 0.1  # only for writes the server holds: it always runs out
EXITING = "the interpreter is exiting; waiting up to"
NOT_FINISHED = "they were not confirmed saved"
WAITING = "waiting for writes still running"
SAVED_ANSWER = {"memory_id": "ctr_main:1", "container": "ctr_main"}
ERROR_500 = error(500, "internal", "internal").content


class Ticker:
    """A task that ticks every 10 ms while the test awaits something else, and calls ``release`` at tick
    ``release_after``. Only a loop that is not blocked runs it."""

    def __init__(self, release_after: int | None = None, release: Callable[[], None] = lambda: None) -> None:
        self.ticks = 0
        self._release_after = release_after
        self._release = release
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def __enter__(self) -> Ticker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.ticks += 1
            if self.ticks == self._release_after:
                self._release()


async def turn_and_flush(agent: Any, text: str) -> None:
    """One async turn and the flush an async caller owes the manager, as a web handler does it."""
    await agent.invoke_async(text)
    await agent.memory_manager.flush()


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= level]


def capturing(membase: InMemoryMembase, write_timeout: float) -> MembaseMemoryStore:
    return membase.store(capture=True, extraction=True, container="Main", write_timeout=write_timeout)


def answered(done: threading.Event, then: RawAction) -> RawAction:
    """Answer with ``then``, then set ``done``: the whole answer went out on the request's own connection."""

    def act(handler: Any) -> None:
        then(handler)
        done.set()

    return act


def no_bad_file_descriptor(caplog: pytest.LogCaptureFixture) -> bool:
    """No log line (nor the traceback of one) says a socket was closed under a request."""
    texts = [*messages(caplog), *(record.exc_text or "" for record in caplog.records)]
    return not any("Bad file descriptor" in text or "Errno 9" in text for text in texts)


# --- await store.aclose() --------------------------------------------------------------------------


async def test_aclose_awaits_a_running_write_while_the_event_loop_keeps_running(gates, caplog):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    in_flight, release = threading.Event(), gates.new()
    membase.on(*MEMORIES, signalling(in_flight, hang(release, then=membase.answer)))
    store = capturing(membase, write_timeout=LONG)
    agent, model = make_agent(store, ["Noted."])
    turn = asyncio.create_task(turn_and_flush(agent, GREEN_TEA))
    assert await until(in_flight.is_set, timeout=LONG)

    with Ticker(release_after=5, release=release.set) as ticker:
        await asyncio.wait_for(store.aclose(), LONG * 2)
        # On record when aclose() returns, not some time after.
        saved, ticked = store.counters()["writes_saved"], ticker.ticks

    assert ticked >= 5  # the ticker ran while aclose() waited: only it released the write
    assert saved == 1
    assert membase.saved() == [GREEN_TEA]
    await asyncio.wait_for(turn, LONG)  # the turn's own flush got the same answer
    assert len(model.calls) == 1
    assert len(membase.sent(*MEMORIES)) == 1
    assert any("waiting for writes still running" in m for m in messages(caplog, logging.INFO))
    with pytest.raises(RuntimeError, match="closed"):
        await store.search(QUESTION)


async def test_aclose_lets_a_write_that_ran_out_of_time_finish_and_logs_it_before_returning(gates, caplog):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    release = gates.new()
    membase.on(*MEMORIES, hang(release, then=membase.answer))
    store = capturing(membase, write_timeout=BUDGET)
    agent, _ = make_agent(store, ["Noted."])
    await turn_and_flush(agent, GREEN_TEA)  # the write runs out of its budget; the manager keeps the batch
    assert store.counters()["write_timeouts"] == 1
    set_write_budget(store, LONG)  # how long aclose() waits: not what this test is about

    with Ticker(release_after=3, release=release.set):
        await store.aclose()
        logged = messages(caplog, logging.INFO)
        counters = store.counters()

    assert any("a write that ran out of time finished; it is saved" in m for m in logged)
    assert (counters["writes_saved"], counters["write_errors"]) == (1, 0)
    assert membase.saved() == [GREEN_TEA]


async def test_aclose_gives_up_after_write_timeout_without_blocking_the_loop(gates, caplog):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    # Never answers while the test runs; saved once the test opens the gate, so nothing is left for exit to send.
    membase.on(*MEMORIES, hang(gates.new(), then=membase.answer))
    store = capturing(membase, write_timeout=BUDGET)
    agent, _ = make_agent(store, ["Noted."])
    await turn_and_flush(agent, GREEN_TEA)

    with Ticker() as ticker:
        await store.aclose()
        ticked = ticker.ticks

    assert ticked >= 1  # the loop ran meanwhile
    # It gave the write its budget and no more: it returned with the write still running, and says so.
    assert any(
        f"writes still running after {BUDGET:g} s; their outcome is logged when they end" in m
        for m in messages(caplog, logging.WARNING)
    )
    assert store.counters()["writes_saved"] == 0


async def test_async_with_closes_the_store_and_leaves_the_shared_connections_and_a_passed_in_client_open():
    """Changed by design (issue 18): a store built from a key sends through the process's shared connection pool,
    so closing it closes the store (further use raises), never the connections other stores use."""
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        async with MembaseMemoryStore(api_key=API_KEY, base_url=server.url, container="Main") as built:
            agent, model = make_agent(built, ["Postgres."])
            await agent.invoke_async(QUESTION)
            assert FACT in (model.memory_block() or "")
        with pytest.raises(RuntimeError, match="closed"):
            await built.search(QUESTION)
        connections = server.connections
        assert server.open_connections == connections  # none closed by the store

        # The next store for that Membase (the same key's next request, say) reuses the warm connection.
        async with MembaseMemoryStore(api_key=API_KEY, base_url=server.url, container="Main") as again:
            assert [entry.content for entry in await again.search(QUESTION)] == [f"[Main] {FACT}"]
        assert server.connections == connections

        client = server.client()
        try:
            async with MembaseMemoryStore(client=client, container="Main") as given:
                agent, model = make_agent(given, ["Postgres."])
                await agent.invoke_async(QUESTION)
            with pytest.raises(RuntimeError, match="closed"):
                await given.search(QUESTION)
            assert client.containers.list()["containers"]  # the caller's client still works
        finally:
            client.close()


async def test_a_cancelled_aclose_still_closes_the_store_and_a_second_aclose_waits_for_its_writes(gates, caplog):
    caplog.set_level(logging.INFO)
    with LoopbackMembase() as server:
        in_flight, release = threading.Event(), gates.new()
        server.on(*MEMORIES, arrived(in_flight, stall(release, then=ok_json(SAVED_ANSWER))))
        store = MembaseMemoryStore(
            api_key=API_KEY, base_url=server.url, capture=True, extraction=True, container="Main", write_timeout=LONG
        )
        agent, _ = make_agent(store, ["Noted."])
        turn = asyncio.create_task(turn_and_flush(agent, GREEN_TEA))
        try:
            assert await until(in_flight.is_set, timeout=LONG)
            closing = asyncio.create_task(store.aclose())
            assert await until(drain_began(caplog), timeout=LONG)  # it waits for the write
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing

            # Closed all the same, so the store never ends half closed; its closing goes on in the background.
            with pytest.raises(RuntimeError, match="closed"):
                await store.search(QUESTION)
            second = asyncio.create_task(store.aclose())  # waits for the first closing, up to write_timeout
            release.set()
            await asyncio.wait_for(second, LONG)
            assert store.counters()["writes_saved"] == 1  # the write's outcome is on record when it returns
        finally:
            release.set()
        # The write kept its connection: it ends saved, and the turn's flush got that answer.
        await asyncio.wait_for(turn, LONG)
    assert store.counters()["writes_saved"] == 1
    assert server.fake.saved() == [GREEN_TEA]
    assert no_bad_file_descriptor(caplog)


async def test_a_close_while_another_caller_closes_returns_once_the_writes_are_on_record(gates, caplog):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    in_flight, release = threading.Event(), gates.new()
    membase.on(*MEMORIES, signalling(in_flight, hang(release, then=membase.answer)))
    store = capturing(membase, write_timeout=LONG)
    agent, _ = make_agent(store, ["Noted."])
    turn = asyncio.create_task(turn_and_flush(agent, GREEN_TEA))
    assert await until(in_flight.is_set, timeout=LONG)

    first = asyncio.create_task(store.aclose())
    assert await until(drain_began(caplog), timeout=LONG)
    calling, second = threading.Event(), Future[int]()

    def close_from_another_thread() -> None:
        calling.set()
        store.close()
        second.set_result(store.counters()["writes_saved"])  # what that caller sees once close() returns

    async def aclose_again() -> int:
        await store.aclose()
        return store.counters()["writes_saved"]

    threading.Thread(target=close_from_another_thread, daemon=True).start()
    third = asyncio.create_task(aclose_again())
    assert await until(calling.is_set, timeout=LONG)
    await asyncio.sleep(0)  # let the third closer start waiting too
    release.set()

    await asyncio.wait_for(first, LONG)
    assert await asyncio.wait_for(third, LONG) == 1  # neither returned before the write was on record
    assert await asyncio.wait_for(asyncio.wrap_future(second), LONG) == 1
    await asyncio.wait_for(turn, LONG)


# --- A write that outlives close(): never cut off, and its outcome told in words true after close -------


@pytest.fixture
def exit_hook(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The atexit hook, over only the stores this test builds, with the 'exiting' flag put back afterwards."""
    monkeypatch.setattr(_background, "_exit_members", weakref.WeakSet())
    monkeypatch.setattr(_background, "_exiting", False)
    return _background._at_exit


def hosted_capturing(server: LoopbackMembase, write_timeout: float) -> MembaseMemoryStore:
    return MembaseMemoryStore(
        api_key=API_KEY, base_url=server.url, capture=True, container="Main", write_timeout=write_timeout
    )


async def test_a_write_that_outlives_close_is_saved_once_on_its_own_connection_and_logged_as_saved(gates, caplog):
    """Issue 21: close() waits its write_timeout, returns, and the write it no longer waits for goes on."""
    caplog.set_level(logging.INFO)
    with LoopbackMembase() as server:
        in_flight, release, sent = threading.Event(), gates.new(), threading.Event()
        server.on(*MEMORIES, arrived(in_flight, stall(release, then=answered(sent, ok_json(SAVED_ANSWER)))))
        store = hosted_capturing(server, write_timeout=BUDGET)
        with pytest.raises(MembaseWriteTimeout):
            await store.add(GREEN_TEA)
        running = store._writes.running()

        await store.aclose()  # waits BUDGET for the held write, then returns with it still running

        assert any(
            f"writes still running after {BUDGET:g} s; their outcome is logged when they end" in m
            for m in messages(caplog, logging.WARNING)
        )
        assert store.counters()["writes_saved"] == 0
        release.set()
        settle(running)
        assert sent.wait(LONG)  # the server's answer went out on the write's connection (it sets this just after)
        assert server.open_connections == server.connections  # ... which nobody closed: it stays in the pool

    assert any("a write that ran out of time finished; it is saved" in m for m in messages(caplog, logging.INFO))
    assert server.fake.saved() == [GREEN_TEA]
    assert len(server.fake.sent(*MEMORIES)) == 1  # saved once
    counters = store.counters()
    assert (counters["writes_saved"], counters["write_errors"], counters["writes_lost"]) == (1, 0, 0)
    assert no_bad_file_descriptor(caplog)


async def test_a_write_that_outlives_close_and_then_fails_says_no_retry_will_come_and_is_sent_again_at_exit(
    exit_hook, gates, caplog
):
    caplog.set_level(logging.INFO)
    with LoopbackMembase() as server:
        in_flight, release = threading.Event(), gates.new()
        server.fake.on(*MEMORIES, status(500, "internal"))  # what the fake records: that note is not kept
        server.on(*MEMORIES, arrived(in_flight, stall(release, then=raw_answer(500, ERROR_500))))
        store = hosted_capturing(server, write_timeout=BUDGET)
        with pytest.raises(MembaseWriteTimeout):
            await store.add(GREEN_TEA)
        running = store._writes.running()
        await store.aclose()
        release.set()
        settle(running)

        assert any(
            "a write that ran out of time failed; no retry will come from the manager (the store is closed); "
            "it is sent again at interpreter exit" in m
            for m in messages(caplog, logging.WARNING)
        )
        assert not any("the manager's retry sends it again" in m for m in messages(caplog))
        assert server.fake.saved() == []

        await asyncio.to_thread(exit_hook)  # the interpreter exits: the store sends the kept batch, once

    assert any("a write the store sent again finished; it is saved" in m for m in messages(caplog, logging.INFO))
    assert server.fake.saved() == [GREEN_TEA]
    assert len(server.fake.sent(*MEMORIES)) == 2  # the one that failed, and the store's own, once
    counters = store.counters()
    assert (counters["write_errors"], counters["errors.server_error"]) == (1, 1)
    assert (counters["writes_sent_again"], counters["writes_saved"], counters["writes_lost"]) == (1, 1, 0)
    assert no_bad_file_descriptor(caplog)


ENGINE_UNAVAILABLE = engine_unavailable()


@pytest.mark.skipif(ENGINE_UNAVAILABLE is not None, reason=f"the local engine cannot run here: {ENGINE_UNAVAILABLE}")
async def test_close_of_a_local_store_closes_the_engine_only_after_its_running_write_ends(tmp_path, gates, caplog):
    """The engine is the store's own: closing it under a running write would fail that write. A standing fact is
    saved without the engine's LLM, so the real engine runs here offline; the test holds the write at the door
    between the store and the engine."""
    caplog.set_level(logging.INFO)
    directory = tmp_path / "membase"
    store = MembaseMemoryStore(local=directory, capture=True, write_timeout=BUDGET)
    gateway, engine = store._gateway, client_of(store)
    at_the_door, release = threading.Event(), gates.new()
    engine_closed: list[int] = []  # writes saved when the engine was closed
    save, close = gateway.save, engine.close

    def held_save(*args: Any, **kwargs: Any) -> Any:
        at_the_door.set()
        release.wait(LONG)
        return save(*args, **kwargs)

    def recorded_close() -> None:
        saved = store.counters()["writes_saved"]
        close()
        engine_closed.append(saved)  # once closed: nothing may call into the engine while it closes

    gateway.save, engine.close = held_save, recorded_close  # type: ignore[method-assign]
    with pytest.raises(MembaseWriteTimeout):
        await store.add("Sam prefers green tea", {"static": True})
    assert await until(at_the_door.is_set, timeout=LONG)
    running = store._writes.running()

    await store.aclose()  # its wait ends with the write still running: the engine stays open for it

    assert engine_closed == []
    release.set()
    settle(running)
    assert wait_until(lambda: engine_closed == [1], timeout=LONG)  # closed, after the write was saved
    assert any("a write that ran out of time finished; it is saved" in m for m in messages(caplog, logging.INFO))
    assert store.counters()["write_errors"] == 0

    reopened = membase.Membase(local=directory)  # the engine wrote it down before it closed
    try:
        assert reopened.profile()["static"] == ["Sam prefers green tea"]
    finally:
        reopened.close()


# --- The pool ---------------------------------------------------------------------------------------


def key_of(user_id: str) -> str:
    return f"mb_key_of_{user_id}_s3cret"


@pytest.fixture
def memberships() -> Iterator[tuple[str, dict[str, InMemoryMembase]]]:
    """One in-memory Membase per user, reached only with that user's key, at one base URL (routed while the test
    runs): the base URL, and the fakes by user."""
    fakes = {user: InMemoryMembase() for user in ("alice", "bob")}
    by_key = {key_of(user): fake for user, fake in fakes.items()}

    def handle(request: httpx.Request) -> httpx.Response:
        fake = by_key.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        return fake.handle(request) if fake is not None else error(403, "unauthorized", "unknown key")

    url = "https://memberships.test"
    routed = _http.route(url, httpx.MockTransport(handle))
    try:
        yield url, fakes
    finally:
        routed.close()


async def test_async_with_pool_closes_every_store_side_by_side_without_blocking_the_loop(memberships, gates):
    url, fakes = memberships
    release = gates.new()
    arrivals = {user: threading.Event() for user in fakes}
    for user, fake in fakes.items():
        fake.on(*MEMORIES, signalling(arrivals[user], hang(release, then=fake.answer)))

    async with MembaseStorePool(
        key_of, base_url=url, capture=True, extraction=True, container="Main", write_timeout=LONG
    ) as pool:
        stores = {user: pool.store_for(user) for user in fakes}
        turns = [
            asyncio.create_task(turn_and_flush(make_agent(store, ["Noted."])[0], f"{user} likes green tea."))
            for user, store in stores.items()
        ]
        assert await until(lambda: all(event.is_set() for event in arrivals.values()), timeout=LONG)
        ticker = Ticker(release_after=5, release=release.set).start()  # runs while the pool closes, below
    ticker.stop()
    saved = {user: store.counters()["writes_saved"] for user, store in stores.items()}

    assert ticker.ticks >= 5  # only the ticker released the writes: the loop ran while the pool closed
    assert saved == {"alice": 1, "bob": 1}
    assert {user: fake.saved() for user, fake in fakes.items()} == {
        "alice": ["alice likes green tea."],
        "bob": ["bob likes green tea."],
    }
    for store in stores.values():
        assert store._closed
        with pytest.raises(RuntimeError, match="closed"):
            await store.search(QUESTION)
    with pytest.raises(RuntimeError, match="closed"):
        pool.store_for("alice")
    await pool.aclose()  # twice is fine
    await asyncio.wait_for(asyncio.gather(*turns), LONG)


# --- Interpreter exit, in process: the hook itself ----------------------------------------------------


def test_the_exit_hook_does_nothing_when_no_write_is_running(exit_hook, caplog):
    caplog.set_level(logging.DEBUG, logger="membase_strands")
    store = InMemoryMembase().store(capture=True, container="Main", write_timeout=LONG)  # nothing running
    exit_hook()
    assert messages(caplog) == []
    store.close()


async def test_the_exit_hook_names_the_store_of_a_write_that_did_not_finish(exit_hook, gates, caplog, no_key_in_logs):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    in_flight = threading.Event()
    membase.on(*MEMORIES, signalling(in_flight, hang(gates.new())))
    store = membase.store(capture=True, container="Main", name="notes", write_timeout=BUDGET)
    write = asyncio.create_task(store.add(GREEN_TEA))
    assert await until(in_flight.is_set, timeout=LONG)
    write.cancel()  # a web server cancels the request's task: the write goes on
    with pytest.raises(asyncio.CancelledError):
        await write

    await asyncio.to_thread(exit_hook)

    logged = messages(caplog, logging.INFO)
    assert any(f"store=<notes> | {EXITING} {BUDGET:g} s for writes still running" in m for m in logged)
    warned = [m for m in messages(caplog, logging.WARNING) if NOT_FINISHED in m]
    assert warned == [
        f"store=<notes>, writes=<1> | writes still running after {BUDGET:g} s; they were not confirmed saved"
    ]
    assert all(GREEN_TEA not in m for m in messages(caplog))


async def test_a_write_that_fails_during_the_exit_grace_says_nothing_will_send_it_again(exit_hook, gates, caplog):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    in_flight, release = threading.Event(), gates.new()
    membase.on(*MEMORIES, signalling(in_flight, hang(release, then=status(500, "internal"))))
    store = capturing(membase, write_timeout=LONG)
    write = asyncio.create_task(store.add(GREEN_TEA))
    assert await until(in_flight.is_set, timeout=LONG)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write

    hook = asyncio.create_task(asyncio.to_thread(exit_hook))
    assert await until(lambda: any(EXITING in m for m in messages(caplog)), timeout=LONG)
    release.set()
    await asyncio.wait_for(hook, LONG)

    warned = messages(caplog, logging.WARNING)
    assert any(
        "a write whose caller was cancelled failed; it is not saved, and nothing will send it again" in m
        for m in warned
    )
    assert not any(NOT_FINISHED in m for m in warned)  # it ended within the grace: one line, not two
    assert (store.counters()["write_errors"], store.counters()["writes_lost"]) == (1, 1)


async def kept_after_a_cancelled_write(membase: InMemoryMembase, gates: Gates) -> MembaseMemoryStore:
    """A capturing store whose write of GREEN_TEA failed (500) after its caller was cancelled: the store keeps it."""
    in_flight, release = threading.Event(), gates.new()
    membase.on(*MEMORIES, signalling(in_flight, hang(release, then=status(500, "internal"))))
    store = capturing(membase, write_timeout=LONG)
    write = asyncio.create_task(store.add(GREEN_TEA))
    assert await until(in_flight.is_set, timeout=LONG)
    running = store._writes.running()
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write
    release.set()
    settle(running)
    return store


async def test_at_exit_a_batch_kept_for_sending_again_is_sent_once(exit_hook, gates, caplog):
    """Issue 19: a batch whose caller was cancelled and that then failed, with no next write and no close."""
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    store = await kept_after_a_cancelled_write(membase, gates)
    assert membase.saved() == []

    await asyncio.to_thread(exit_hook)

    assert any("a write the store sent again finished; it is saved" in m for m in messages(caplog, logging.INFO))
    assert membase.saved() == [GREEN_TEA]
    assert len(membase.sent(*MEMORIES)) == 2
    assert (store.counters()["writes_sent_again"], store.counters()["writes_lost"]) == (1, 0)


async def test_at_exit_a_kept_batch_whose_thread_cannot_start_is_reported_lost_in_one_line(
    exit_hook, gates, caplog, monkeypatch
):
    """Python 3.12 refuses new threads at interpreter exit: the store's own resend never starts, and no retry comes."""
    membase = InMemoryMembase()
    store = await kept_after_a_cancelled_write(membase, gates)
    caplog.clear()

    def refuse(thread: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    with monkeypatch.context() as exiting:
        exiting.setattr(_background, "_threads", _background._Threads())  # no thread alive to take the resend
        exiting.setattr(threading.Thread, "start", refuse)
        exit_hook()

    assert messages(caplog, logging.WARNING) == [
        "store=<membase>, reason=<can't create new thread at interpreter shutdown> | a write the store sent again "
        "failed; it is not saved, and nothing will send it again"
    ]
    assert membase.saved() == []
    assert len(membase.sent(*MEMORIES)) == 1
    assert (store.counters()["writes_sent_again"], store.counters()["writes_lost"]) == (1, 1)


async def test_a_write_that_starts_while_the_exit_hook_waits_is_waited_for_too(exit_hook, gates, caplog):
    """Daemon threads still run during atexit hooks: an agent on a daemon thread's loop may flush then."""
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    arrivals, releases = [threading.Event(), threading.Event()], [gates.new(), gates.new()]
    membase.on(*MEMORIES, *(signalling(arrivals[n], hang(releases[n], then=membase.answer)) for n in (0, 1)))
    store = capturing(membase, write_timeout=LONG)
    first = asyncio.create_task(store.add("I like green tea."))
    assert await until(arrivals[0].is_set, timeout=LONG)
    running = store._writes.running()

    hook = asyncio.create_task(asyncio.to_thread(exit_hook))
    assert await until(lambda: any(EXITING in m for m in messages(caplog)), timeout=LONG)
    second = asyncio.create_task(store.add("I live in Lisbon."))  # starts while the hook waits for the first
    assert await until(arrivals[1].is_set, timeout=LONG)
    releases[0].set()
    settle(running)  # the first is over and on record
    # The hook saw the new write and waits for it as well, and says so.
    assert await until(lambda: sum(WAITING in m for m in messages(caplog)) == 2, timeout=LONG)
    assert not hook.done()
    releases[1].set()
    await asyncio.wait_for(hook, LONG)

    await asyncio.wait_for(asyncio.gather(first, second), LONG)
    assert membase.saved() == ["I like green tea.", "I live in Lisbon."]
    assert not any(NOT_FINISHED in m for m in messages(caplog))


async def test_watching_writes_for_exit_keeps_no_store_alive():
    membase = InMemoryMembase()
    store = capturing(membase, write_timeout=LONG)
    agent, _ = make_agent(store, ["Noted."])
    await turn_and_flush(agent, GREEN_TEA)
    assert membase.saved() == [GREEN_TEA]
    gone = weakref.ref(store)
    del store, agent

    def collected() -> bool:
        gc.collect()
        return gone() is None

    # The background thread that ran the write lets go of it just after the write's caller wakes: wait
    # (bounded) for that, not for a fixed time. A store the exit watch kept would never be collected.
    assert await until(collected, timeout=LONG)


# --- Interpreter exit, for real: a subprocess -----------------------------------------------------------

PROGRAM = r"""
import atexit, json, logging, os, sys, warnings

warnings.simplefilter("ignore", DeprecationWarning)  # os.fork() in a process that has threads
store = None
# Registered before the library's exit hook (importing the library registers that one), so it runs after it.
atexit.register(
    lambda: print(json.dumps({"pid": os.getpid(), "counters": store.counters() if store else None}), flush=True)
)
logging.basicConfig(
    level=logging.INFO, stream=sys.stderr, format="%(process)d %(created).3f %(levelname)s %(name)s %(message)s"
)

from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore
from membase_strands.testing import API_KEY, ScriptedModel

url, write_timeout, grace, mode = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
store = MembaseMemoryStore(
    api_key=API_KEY, base_url=url, container="Main", capture=True, extraction=True, write_timeout=write_timeout
)
if mode == "preload":  # as gunicorn --preload: the store is built before the fork and used in the child only
    child = os.fork()
    if child != 0:
        os.waitpid(child, 0)
        sys.exit(0)
    logging.getLogger("program").info("forked")
agent = Agent(model=ScriptedModel(["Noted."]), memory_manager=MemoryManager(stores=[store]), callback_handler=None)
agent("I like green tea.")  # its captured write outlives its budget: the server holds it
store._writes._budget = grace  # how long the exit waits for it (the test's own knob; the store's write_timeout)
logging.getLogger("program").info("turn over")
if mode == "fork":
    child = os.fork()
    if child == 0:
        logging.getLogger("program").info("forked")
        sys.exit(0)  # a normal exit: the atexit hooks run in the child too
    os.waitpid(child, 0)
"""


class Program:
    """The program above, run in a subprocess; its log lines (stderr) read as they come.

    ``write_timeout`` is the turn's budget (the server holds its write, so it always runs out); ``grace`` is the
    exit's wait for that write.
    """

    def __init__(self, url: str, write_timeout: float, grace: float, mode: str = "plain") -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBASE_")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", PROGRAM, url, str(write_timeout), str(grace), mode],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.err: list[str] = []
        self.out: list[str] = []
        self._arriving: queue.Queue[str] = queue.Queue()
        assert self.process.stdout is not None and self.process.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stderr, self.err), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stdout, self.out), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))
            if into is self.err:
                self._arriving.put(line)

    def wait_for_line(self, text: str, timeout: float = 60.0) -> bool:
        """Wait until a log line containing ``text`` arrives (or the program ends, or ``timeout`` passes)."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                if text in self._arriving.get(timeout=min(remaining, 0.5)):
                    return True
            except queue.Empty:
                if self.process.poll() is not None and self._arriving.empty():
                    return False
        return False

    def finish(self, timeout: float = 60.0) -> int:
        try:
            code = self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(10)
        for reader in self._readers:
            reader.join(10)
        return code

    def counters(self, pid: int | None = None) -> dict[str, int]:
        reports = [json.loads(line) for line in self.out if line.startswith("{")]
        return next(r["counters"] for r in reports if pid in (None, r["pid"]))

    def lines(self, pid: int | None = None) -> list[str]:
        return [line for line in self.err if pid is None or line.startswith(f"{pid} ")]

    def output(self) -> str:
        return "\n".join([*self.err, *self.out])


@pytest.fixture
def server() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as serving:
        yield serving


def test_at_exit_a_running_write_gets_its_grace_and_is_saved(server, gates):
    release = gates.new()
    server.on(*MEMORIES, stall(release, then=ok_json(SAVED_ANSWER)))
    program = Program(server.url, write_timeout=BUDGET, grace=LONG)
    try:
        assert program.wait_for_line(EXITING), program.output()
        release.set()  # the write was still running when exit began; it ends within the grace
    finally:
        code = program.finish()

    assert code == 0, program.output()
    lines = program.lines()
    exiting = next(i for i, line in enumerate(lines) if EXITING in line)
    assert "store=<membase>, writes=<1> | waiting for writes still running" in " ".join(lines[exiting:])
    saved = [i for i, line in enumerate(lines) if " INFO " in line and "ran out of time finished; it is saved" in line]
    assert saved and saved[0] > exiting, program.output()
    assert not any(NOT_FINISHED in line for line in lines)
    counters = program.counters()
    assert (counters["write_timeouts"], counters["writes_saved"], counters["write_errors"]) == (1, 1, 0)
    assert server.fake.saved() == [GREEN_TEA]
    assert API_KEY not in program.output()


def test_at_exit_a_write_that_does_not_finish_gets_a_warning_naming_its_store(server, gates):
    server.on(*MEMORIES, stall(gates.new()))  # never answers while the program runs
    program = Program(server.url, write_timeout=BUDGET, grace=0.5)
    code = program.finish()

    assert code == 0, program.output()
    lines = program.lines()
    assert any(f"store=<membase> | {EXITING} 0.5 s for writes still running" in line for line in lines)
    warning = next(line for line in lines if NOT_FINISHED in line)
    # The grace was bounded: the program exited while the server still held the write, and said so.
    assert " WARNING " in warning
    assert "store=<membase>, writes=<1> | writes still running after 0.5 s; they were not confirmed saved" in warning
    assert program.counters()["writes_saved"] == 0
    assert not any(GREEN_TEA in line for line in lines if " membase_strands." in line)  # never the text
    assert API_KEY not in program.output()


def test_a_store_built_before_the_fork_gets_its_exit_wait_in_the_child_that_uses_it(server, gates):
    release = gates.new()
    server.on(*MEMORIES, stall(release, then=ok_json(SAVED_ANSWER)))
    program = Program(server.url, write_timeout=BUDGET, grace=LONG, mode="preload")
    try:
        assert program.wait_for_line(EXITING), program.output()  # the child's, with its write still running
        release.set()
    finally:
        code = program.finish()

    assert code == 0, program.output()
    child = int(next(line for line in program.lines() if line.endswith("INFO program forked")).split()[0])
    assert any("a write that ran out of time finished; it is saved" in line for line in program.lines(child))
    assert program.counters(child)["writes_saved"] == 1
    assert server.fake.saved() == [GREEN_TEA]


def test_a_forked_child_does_not_wait_for_or_report_its_parents_running_write(server, gates):
    release = gates.new()
    server.on(*MEMORIES, stall(release, then=ok_json(SAVED_ANSWER)))
    program = Program(server.url, write_timeout=BUDGET, grace=LONG, mode="fork")
    try:
        assert program.wait_for_line(EXITING), program.output()  # the parent's: it exits after its child
        release.set()
    finally:
        code = program.finish()

    assert code == 0, program.output()
    child = int(next(line for line in program.lines() if line.endswith("INFO program forked")).split()[0])
    parent = program.process.pid
    assert not any(EXITING in line or NOT_FINISHED in line for line in program.lines(child)), program.output()
    assert program.counters(child)["writes_saved"] == 0
    assert any(EXITING in line for line in program.lines(parent))
    assert any("a write that ran out of time finished; it is saved" in line for line in program.lines(parent))
    assert program.counters(parent)["writes_saved"] == 1

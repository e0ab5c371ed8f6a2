"""The lifecycle: ``close()``, ``await aclose()``, ``with`` / ``async with`` (store and pool), and interpreter exit.

``aclose()`` must drain captured writes still running without blocking the event loop: the tests
run a ticker task beside it, and only the ticker releases the held write, so an ``aclose()`` that
blocked the loop would wait out its whole budget and return with the write not saved.

Interpreter exit is tested with real subprocesses: a small program builds a store over the
loopback HTTP server started here, runs one synchronous turn whose captured write outlives its
budget (the server holds it), and exits. The test reads the program's log lines as they come and
releases the held write on the line that says the interpreter is exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
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
import pytest

from membase_strands import MembaseMemoryStore, MembaseStorePool, _exit
from membase_strands import _client as membase_client
from membase_strands.testing import API_KEY, InMemoryMembase, Responder, hang, status
from membase_strands.testing._membase import error
from tests.support.loopback import LoopbackMembase, arrived, ok_json, stall
from tests.support.store_helpers import FACT, QUESTION, HostedClients, make_agent, route_hosted_clients, until

MEMORIES = ("POST", "/v1/memories")
GREEN_TEA = "I like green tea."
EXITING = "the interpreter is exiting; waiting up to"
NOT_FINISHED = "a write still running at exit did not finish"
LONG = 10.0  # a budget no test waits out; only a broken implementation would


def signalling(event: threading.Event, then: Responder) -> Responder:
    """A responder that sets ``event`` once the request is in, then answers with ``then``."""

    def respond(request: httpx.Request) -> httpx.Response:
        event.set()
        return then(request)

    return respond


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


def draining(caplog: pytest.LogCaptureFixture) -> Callable[[], bool]:
    """Whether a close has reached its wait for the writes still running (needs caplog at INFO)."""
    return lambda: any("waiting for writes still running" in m for m in messages(caplog, logging.INFO))


@pytest.fixture
def connection_pools(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Client]:
    """Every connection pool a store builds for itself from here on (each with ``api_key=``), as built."""
    built: list[httpx.Client] = []
    build = membase_client.new_http_client

    def recorded(base_url: str) -> httpx.Client:
        built.append(build(base_url))
        return built[-1]

    monkeypatch.setattr(membase_client, "new_http_client", recorded)
    return built


# --- await store.aclose() --------------------------------------------------------------------------


async def test_aclose_awaits_a_running_write_while_the_event_loop_keeps_running(gates, caplog):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    in_flight, release = threading.Event(), gates.new()
    membase.on(*MEMORIES, signalling(in_flight, hang(release, then=membase.answer)))
    store = capturing(membase, write_timeout=LONG)
    agent, model = make_agent(store, ["Noted."])
    turn = asyncio.create_task(turn_and_flush(agent, GREEN_TEA))
    assert await until(in_flight.is_set)

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
    store = capturing(membase, write_timeout=1.5)
    agent, _ = make_agent(store, ["Noted."])
    await turn_and_flush(agent, GREEN_TEA)  # the write runs out of its 1.5 s; the manager keeps the batch
    assert store.counters()["write_timeouts"] == 1

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
    membase.on(*MEMORIES, hang(gates.new()))  # never answers while the test runs
    store = capturing(membase, write_timeout=0.5)
    agent, _ = make_agent(store, ["Noted."])
    await turn_and_flush(agent, GREEN_TEA)

    with Ticker() as ticker:
        started = time.monotonic()
        await store.aclose()
        took, ticked = time.monotonic() - started, ticker.ticks

    assert 0.4 <= took < 5.0, took  # it gave the write its budget, and no more than that (generously)
    assert ticked >= 1  # the loop ran meanwhile
    assert any("writes still running after 0.5 s" in m for m in messages(caplog, logging.WARNING))
    assert store.counters()["writes_saved"] == 0


async def test_async_with_closes_the_client_the_store_built_and_leaves_a_passed_in_one_open(connection_pools):
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        async with MembaseMemoryStore(api_key=API_KEY, base_url=server.url, container="Main") as built:
            agent, model = make_agent(built, ["Postgres."])
            await agent.invoke_async(QUESTION)
            assert FACT in (model.memory_block() or "")
        assert [pool.is_closed for pool in connection_pools] == [True]  # the store's own connection pool
        with pytest.raises(RuntimeError, match="closed"):
            await built.search(QUESTION)

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


async def test_a_cancelled_aclose_still_closes_the_client_and_a_second_aclose_returns(gates, connection_pools, caplog):
    caplog.set_level(logging.INFO)
    with LoopbackMembase() as server:
        in_flight, release = threading.Event(), gates.new()
        server.on(*MEMORIES, arrived(in_flight, stall(release)))  # then drops the connection without an answer
        store = MembaseMemoryStore(
            api_key=API_KEY, base_url=server.url, capture=True, extraction=True, container="Main", write_timeout=LONG
        )
        agent, _ = make_agent(store, ["Noted."])
        turn = asyncio.create_task(turn_and_flush(agent, GREEN_TEA))
        try:
            assert await until(in_flight.is_set)
            closing = asyncio.create_task(store.aclose())
            assert await until(draining(caplog))  # it waits for the write
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing

            # Closed all the same: its own client too, on a thread, so the store never ends half closed.
            assert await until(lambda: [pool.is_closed for pool in connection_pools] == [True])
            await asyncio.wait_for(store.aclose(), 2.0)  # a second aclose() has nothing left to wait for
            with pytest.raises(RuntimeError, match="closed"):
                await store.search(QUESTION)
        finally:
            release.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(turn, LONG)  # its connection was closed under it


async def test_a_close_while_another_caller_closes_returns_once_the_writes_are_on_record(gates, caplog):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    in_flight, release = threading.Event(), gates.new()
    membase.on(*MEMORIES, signalling(in_flight, hang(release, then=membase.answer)))
    store = capturing(membase, write_timeout=LONG)
    agent, _ = make_agent(store, ["Noted."])
    turn = asyncio.create_task(turn_and_flush(agent, GREEN_TEA))
    assert await until(in_flight.is_set)

    first = asyncio.create_task(store.aclose())
    assert await until(draining(caplog))
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
    assert await until(calling.is_set)
    await asyncio.sleep(0)  # let the third closer start waiting too
    release.set()

    await asyncio.wait_for(first, LONG)
    assert await asyncio.wait_for(third, LONG) == 1  # neither returned before the write was on record
    assert await asyncio.wait_for(asyncio.wrap_future(second), LONG) == 1
    await asyncio.wait_for(turn, LONG)


# --- The pool ---------------------------------------------------------------------------------------


def key_of(user_id: str) -> str:
    return f"mb_key_of_{user_id}_s3cret"


@pytest.fixture
def memberships(monkeypatch: pytest.MonkeyPatch, connection_pools: list[httpx.Client]) -> dict[str, InMemoryMembase]:
    """One in-memory Membase per user, reached only with that user's key, for every store the pool builds."""
    fakes = {user: InMemoryMembase() for user in ("alice", "bob")}
    by_key = {key_of(user): fake for user, fake in fakes.items()}

    def handle(request: httpx.Request) -> httpx.Response:
        fake = by_key.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        return fake.handle(request) if fake is not None else error(403, "unauthorized", "unknown key")

    route_hosted_clients(monkeypatch, handle, HostedClients(blocking=connection_pools))
    return fakes


async def test_async_with_pool_closes_every_store_side_by_side_without_blocking_the_loop(
    memberships, connection_pools, gates
):
    release = gates.new()
    arrivals = {user: threading.Event() for user in memberships}
    for user, fake in memberships.items():
        fake.on(*MEMORIES, signalling(arrivals[user], hang(release, then=fake.answer)))

    async with MembaseStorePool(key_of, capture=True, extraction=True, container="Main", write_timeout=LONG) as pool:
        stores = {user: pool.store_for(user) for user in memberships}
        turns = [
            asyncio.create_task(turn_and_flush(make_agent(store, ["Noted."])[0], f"{user} likes green tea."))
            for user, store in stores.items()
        ]
        assert await until(lambda: all(event.is_set() for event in arrivals.values()))
        ticker = Ticker(release_after=5, release=release.set).start()  # runs while the pool closes, below
    ticker.stop()
    saved = {user: store.counters()["writes_saved"] for user, store in stores.items()}

    assert ticker.ticks >= 5  # only the ticker released the writes: the loop ran while the pool closed
    assert saved == {"alice": 1, "bob": 1}
    assert {user: fake.saved() for user, fake in memberships.items()} == {
        "alice": ["alice likes green tea."],
        "bob": ["bob likes green tea."],
    }
    assert [pool.is_closed for pool in connection_pools] == [True, True]
    for store in stores.values():
        with pytest.raises(RuntimeError, match="closed"):
            await store.search(QUESTION)
    with pytest.raises(RuntimeError, match="closed"):
        pool.store_for("alice")
    await pool.aclose()  # twice is fine
    await asyncio.wait_for(asyncio.gather(*turns), LONG)


# --- Interpreter exit, in process: the hook itself ----------------------------------------------------


@pytest.fixture
def exit_hook(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The atexit hook, over only the writes this test starts, with the 'exiting' flag put back afterwards."""
    monkeypatch.setattr(_exit, "_running", {})
    monkeypatch.setattr(_exit, "_exiting", False)
    return _exit._drain_at_exit


def test_the_exit_hook_does_nothing_when_no_write_is_running(exit_hook, caplog):
    caplog.set_level(logging.DEBUG, logger="membase_strands")
    started = time.monotonic()
    exit_hook()
    assert time.monotonic() - started < 1.0
    assert messages(caplog) == []


async def test_the_exit_hook_names_the_store_of_a_write_that_did_not_finish(exit_hook, gates, caplog, no_key_in_logs):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    in_flight = threading.Event()
    membase.on(*MEMORIES, signalling(in_flight, hang(gates.new())))
    store = membase.store(capture=True, container="Main", name="notes", write_timeout=0.3)
    write = asyncio.create_task(store.add(GREEN_TEA))
    assert await until(in_flight.is_set)
    write.cancel()  # a web server cancels the request's task: the write goes on
    with pytest.raises(asyncio.CancelledError):
        await write

    await asyncio.to_thread(exit_hook)

    logged = messages(caplog, logging.INFO)
    assert any(f"store=<notes>, writes=<1> | {EXITING} 0.3 s" in m for m in logged)
    warned = [m for m in messages(caplog, logging.WARNING) if NOT_FINISHED in m]
    assert warned == [
        "store=<notes>, parts=<1>, reason=<interpreter exiting> | a write still running at exit did not finish "
        "within 0.3 s; it was not confirmed saved"
    ]
    assert all(GREEN_TEA not in m for m in messages(caplog))


async def test_a_write_that_fails_during_the_exit_grace_says_no_retry_will_come(exit_hook, gates, caplog):
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    in_flight, release = threading.Event(), gates.new()
    membase.on(*MEMORIES, signalling(in_flight, hang(release, then=status(500, "internal"))))
    store = capturing(membase, write_timeout=LONG)
    write = asyncio.create_task(store.add(GREEN_TEA))
    assert await until(in_flight.is_set)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write

    hook = asyncio.create_task(asyncio.to_thread(exit_hook))
    assert await until(lambda: any(EXITING in m for m in messages(caplog)))
    release.set()
    await asyncio.wait_for(hook, LONG)

    warned = messages(caplog, logging.WARNING)
    assert any(
        "a write whose caller was cancelled failed; it is not saved, and no retry will send it: "
        "the interpreter is exiting" in m
        for m in warned
    )
    assert not any(NOT_FINISHED in m for m in warned)  # it ended within the grace: one line, not two
    assert store.counters()["write_errors"] == 1


async def test_a_write_that_starts_while_the_exit_hook_waits_is_waited_for_too(exit_hook, gates, caplog):
    """Daemon threads still run during atexit hooks: an agent on a daemon thread's loop may flush then."""
    caplog.set_level(logging.INFO)
    membase = InMemoryMembase()
    arrivals, releases = [threading.Event(), threading.Event()], [gates.new(), gates.new()]
    membase.on(*MEMORIES, *(signalling(arrivals[n], hang(releases[n], then=membase.answer)) for n in (0, 1)))
    store = capturing(membase, write_timeout=LONG)
    first = asyncio.create_task(store.add("I like green tea."))
    assert await until(arrivals[0].is_set)

    def exiting_lines() -> int:
        return sum(EXITING in m for m in messages(caplog))

    hook = asyncio.create_task(asyncio.to_thread(exit_hook))
    assert await until(lambda: exiting_lines() == 1)
    second = asyncio.create_task(store.add("I live in Lisbon."))  # starts while the hook waits for the first
    assert await until(arrivals[1].is_set)
    releases[0].set()
    assert await until(lambda: exiting_lines() == 2)  # the hook saw the new write and waits for it as well
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
    assert await until(collected)


# --- Interpreter exit, for real: a subprocess -----------------------------------------------------------

PROGRAM = r"""
import atexit, json, logging, os, sys, warnings

warnings.simplefilter("ignore", DeprecationWarning)  # os.fork() in a process that has threads
store = None
# Registered before the library's exit hook (its first write registers that one), so it runs after it.
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

url, write_timeout, fork = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "fork"
store = MembaseMemoryStore(
    api_key=API_KEY, base_url=url, container="Main", capture=True, extraction=True, write_timeout=write_timeout
)
agent = Agent(model=ScriptedModel(["Noted."]), memory_manager=MemoryManager(stores=[store]), callback_handler=None)
agent("I like green tea.")  # its captured write outlives its budget: the server holds it
logging.getLogger("program").info("turn over")
if fork:
    child = os.fork()
    if child == 0:
        logging.getLogger("program").info("forked")
        sys.exit(0)  # a normal exit: the atexit hooks run in the child too
    os.waitpid(child, 0)
"""


class Program:
    """The program above, run in a subprocess; its log lines (stderr) read as they come."""

    def __init__(self, url: str, write_timeout: float, mode: str = "plain") -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBASE_")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", PROGRAM, url, str(write_timeout), mode],
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


SAVED_ANSWER = {"memory_id": "ctr_main:1", "container": "ctr_main"}


@pytest.fixture
def server() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as serving:
        yield serving


def test_at_exit_a_running_write_gets_its_grace_and_is_saved(server, gates):
    release = gates.new()
    server.on(*MEMORIES, stall(release, then=ok_json(SAVED_ANSWER)))
    program = Program(server.url, write_timeout=2.0)
    try:
        assert program.wait_for_line(EXITING), program.output()
        release.set()  # the write was still running when exit began; it ends within the grace
    finally:
        code = program.finish()

    assert code == 0, program.output()
    lines = program.lines()
    exiting = next(i for i, line in enumerate(lines) if EXITING in line)
    assert "store=<membase>, writes=<1>" in lines[exiting]
    saved = [i for i, line in enumerate(lines) if " INFO " in line and "ran out of time finished; it is saved" in line]
    assert saved and saved[0] > exiting, program.output()
    assert not any(NOT_FINISHED in line for line in lines)
    counters = program.counters()
    assert (counters["write_timeouts"], counters["writes_saved"], counters["write_errors"]) == (1, 1, 0)
    assert server.fake.saved() == [GREEN_TEA]
    assert API_KEY not in program.output()


def test_at_exit_a_write_that_does_not_finish_gets_a_warning_naming_its_store(server, gates):
    server.on(*MEMORIES, stall(gates.new()))  # never answers while the program runs
    program = Program(server.url, write_timeout=1.0)
    code = program.finish()

    assert code == 0, program.output()
    lines = program.lines()
    exiting = next(line for line in lines if EXITING in line)
    warning = next(line for line in lines if NOT_FINISHED in line)
    assert " WARNING " in warning
    assert (
        "store=<membase>, parts=<1>, reason=<interpreter exiting> | a write still running at exit did not "
        "finish within 1 s; it was not confirmed saved"
    ) in warning
    waited = float(warning.split()[1]) - float(exiting.split()[1])
    assert 0.9 <= waited < 10.0, waited  # it had its grace, and the grace was bounded
    assert program.counters()["writes_saved"] == 0
    assert not any(GREEN_TEA in line for line in lines if " membase_strands." in line)  # never the text
    assert API_KEY not in program.output()


def test_a_forked_child_does_not_wait_for_or_report_its_parents_running_write(server, gates):
    release = gates.new()
    server.on(*MEMORIES, stall(release, then=ok_json(SAVED_ANSWER)))
    program = Program(server.url, write_timeout=2.0, mode="fork")
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

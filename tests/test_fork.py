"""A store used before ``os.fork()`` (gunicorn ``--preload``, multiprocessing with fork).

The child inherits the parent's pooled keep-alive sockets; two processes reading one socket get each
other's answers. And it inherits every lock as it was at the fork, held or not, while the threads that held
them stay behind in the parent. These tests fork for real, against the loopback HTTP server (which runs in
the parent and serves every process). A child reports through a pipe and leaves with ``os._exit``; every wait
is bounded, and a child that does not report in time is killed by its pid and fails the test.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from membase_strands import MembaseMemoryStore, MembaseStorePool, _background, _http, _telemetry
from membase_strands.testing import API_KEY, InMemoryMembase
from tests.support.loopback import LoopbackMembase, arrived, as_usual, ok_json, stall
from tests.support.store_helpers import (
    child_reports,
    fork_child,
    membase_threads,
    run_in_child,
    until,
    wait_until,
)

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no os.fork()"),
    # The loopback server's threads (and, on purpose, other threads) are alive at the fork.
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]

SEARCHES = 30
NAME = "forked"  # every store here has this name, so its threads can be told from other tests' threads
LONG = 30.0  # every budget and wait here: none of these tests is about a budget
NOTE = "Remember that the ledger runs on Postgres."


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as server:
        for i in range(SEARCHES):
            for who in ("parent", "child"):
                server.fake.remember(f"Note for {who}{i:02d}.")
        yield server


def built_store(loopback: LoopbackMembase, **options: Any) -> MembaseMemoryStore:
    """A store built from the key for the loopback server, as in production."""
    options = {"name": NAME, "recall_timeout": LONG, **options}
    return MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, **options)


def fork_and_run(child: Callable[[], Any], parent: Callable[[], Any] = lambda: None) -> tuple[Any, Any]:
    """Fork; run ``child`` in the child and ``parent`` here at the same time; return both results."""
    forked = fork_child(child)
    parent_result = parent()
    [report] = child_reports([forked])
    assert "error" not in report, f"the child failed:\n{report['error']}"
    return report["result"], parent_result


def searches(store: MembaseMemoryStore, who: str) -> list[list[str]]:
    """``SEARCHES`` recalls, each for a word only one note holds; what each one got back."""
    return [recall(store, f"{who}{i:02d}") for i in range(SEARCHES)]


def recall(store: MembaseMemoryStore, query: str) -> list[str]:
    """What one recall returned (nothing, when it was skipped)."""
    return [entry.content for entry in asyncio.run(store.search(query))]


def expected(who: str) -> list[list[str]]:
    return [note(who, i) for i in range(SEARCHES)]


def note(who: str, i: int) -> list[str]:
    """What a recall for ``who`` and ``i`` finds: that one note."""
    return [f"[Main] Note for {who}{i:02d}."]


def warm(store: MembaseMemoryStore) -> None:
    """One search, so the pool holds a keep-alive connection at the fork; then no thread of ours runs."""
    assert recall(store, "parent00") == note("parent", 0)
    assert wait_until(lambda: not ours(), timeout=LONG)


def ours() -> list[threading.Thread]:
    """The live threads of this module's stores."""
    return [t for t in membase_threads() if t.name.endswith(f"[{NAME}]")]


async def cancel_when_sent(started: Callable[[], Any], sent: threading.Event) -> None:
    """Start ``started()`` as a task and cancel it once its request is on the wire, as a web server whose client
    hung up would: nobody waits for that request any more, and it goes on in the background."""
    task = asyncio.ensure_future(started())
    assert await until(sent.is_set, timeout=LONG)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# --- A store built from a key --------------------------------------------------------------------


def test_a_forked_child_never_gets_its_parents_answers(loopback) -> None:
    store = built_store(loopback)
    try:
        warm(store)
        connections_before = loopback.connections

        child, parent = fork_and_run(lambda: searches(store, "child"), lambda: searches(store, "parent"))

        assert child == expected("child")
        assert parent == expected("parent")
        assert loopback.connections > connections_before  # the child opened a connection of its own
    finally:
        store.close()


def test_a_forked_child_finishes_its_recall_while_a_parent_request_is_in_flight_on_the_shared_pool(loopback) -> None:
    # A thread of the parent is in the middle of a request on the shared pool at the moment of the fork (the
    # pool's own lock and sockets in use). That thread does not exist in the child: the child must not wait
    # for it, nor read its socket.
    store = built_store(loopback)
    sent, release = threading.Event(), threading.Event()
    answers: list[list[str]] = []
    in_flight = threading.Thread(target=lambda: answers.append(recall(store, "parent03")), daemon=True)
    try:
        warm(store)
        loopback.on("POST", "/v1/search", arrived(sent, stall(release, as_usual)))
        in_flight.start()
        assert sent.wait(LONG)

        try:
            got = run_in_child(lambda: recall(store, "child07"))
        finally:
            release.set()
            in_flight.join(LONG)

        assert got == note("child", 7)
        assert answers == [note("parent", 3)]  # and the parent's request got its own answer
    finally:
        release.set()
        store.close()


def test_a_forked_child_is_not_held_off_by_its_parents_recall_that_nobody_waits_for(loopback) -> None:
    sent, release = threading.Event(), threading.Event()
    loopback.on("POST", "/v1/search", arrived(sent, stall(release, ok_json({"results": [], "containers": []}))))
    store = built_store(loopback)
    try:
        # In the parent, a recall nobody waits for any more is still running: it holds the in-flight guard.
        asyncio.run(cancel_when_sent(lambda: store.search("ledger"), sent))
        assert recall(store, "child07") == []  # skipped: no memory
        assert store.counters()["recall_skipped"] == 1

        # That request's thread does not exist in the child: the child's recall runs.
        got, _ = fork_and_run(lambda: {"recalled": recall(store, "child07"), "counters": store.counters()})

        assert got["recalled"] == note("child", 7)
        assert got["counters"]["recall_skipped"] == 1  # the parent's skip, counted before the fork; none since
        assert store._recall.waking  # the parent's guard is untouched
    finally:
        release.set()
        wait_until(lambda: not ours(), timeout=LONG)
        store.close()


def test_a_forked_child_sends_a_note_its_parent_was_still_sending(loopback) -> None:
    sent, release = threading.Event(), threading.Event()
    loopback.on("POST", "/v1/memories", arrived(sent, stall(release, ok_json({"memory_id": "m1"}))))
    store = built_store(loopback, capture=True, write_timeout=LONG)
    try:
        asyncio.run(cancel_when_sent(lambda: store.add(NOTE), sent))  # still running in the parent

        # In the child no request of the parent's is running: the same note is sent, not waited for.
        got, _ = fork_and_run(lambda: asyncio.run(store.add(NOTE)))

        assert got is not None and got["container"] == "ctr_main"  # Membase's own answer to the child
        assert [r.body["content"] for r in loopback.fake.sent("POST", "/v1/memories")] == [NOTE, NOTE]
    finally:
        release.set()
        wait_until(lambda: not ours(), timeout=LONG)
        store.close()


def test_the_fork_hook_does_not_keep_a_store_alive(fake: InMemoryMembase) -> None:
    store = fake.store(capture=True)  # its counters, guard, write record and gateway each register for the fork
    ref = weakref.ref(store)
    store.close()
    del store
    gc.collect()
    assert ref() is None


# --- Forking while other threads are at work -------------------------------------------------------

CHILDREN = 12


class Hammer:
    """A daemon thread that calls ``work`` until stopped, counting its calls and keeping what it raised."""

    def __init__(self, name: str, work: Callable[[], object]) -> None:
        self.calls = 0
        self.errors: list[BaseException] = []
        self._work = work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hammer-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._work()
            except BaseException as error:  # noqa: BLE001 - reported by the test
                self.errors.append(error)
                return
            self.calls += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(LONG)
        assert not self._thread.is_alive(), f"{self._thread.name} did not stop"


def test_children_forked_while_threads_hammer_every_public_entry_point_each_finish_their_own_recall(loopback) -> None:
    store = built_store(loopback)
    pool = MembaseStorePool(lambda user: API_KEY, max_stores=4, name=NAME, base_url=loopback.url, recall_timeout=LONG)
    users = iter(range(10**9))
    hammers = [
        Hammer("counters", store.counters),
        Hammer("search", lambda: recall(store, "parent05")),
        Hammer("store_for", lambda: pool.store_for(f"user-{next(users) % 10}")),  # past max_stores: lets go of some
        Hammer("pooled-search", lambda: recall(pool.store_for("user-searching"), "parent06")),
        Hammer("build", lambda: built_store(loopback).close()),
    ]

    def child(i: int) -> dict[str, Any]:
        built = built_store(loopback)
        return {
            "store": recall(store, f"child{i:02d}"),
            "pool": recall(pool.store_for(f"child-user-{i}"), f"child{i:02d}"),
            "built": recall(built, f"child{i:02d}"),
            "counters": store.counters()["recall_errors"],
        }

    children = []
    try:
        for hammer in hammers:
            assert wait_until(lambda: hammer.calls > 0, timeout=LONG), f"{hammer._thread.name} never got going"  # noqa: B023
        for i in range(CHILDREN):
            # Each fork at another moment of the hammers' work: after the next search has gone through.
            done = hammers[1].calls
            assert wait_until(lambda: hammers[1].calls > done, timeout=LONG)  # noqa: B023
            children.append(fork_child(functools.partial(child, i)))
    finally:
        reports = child_reports(children)
        for hammer in hammers:
            hammer.stop()
        pool.close()
        store.close()

    failed = {i: report["error"] for i, report in enumerate(reports) if "error" in report}
    assert not failed, f"{len(failed)} of {CHILDREN} children failed:\n" + "\n".join(failed.values())
    for i, report in enumerate(reports):
        mine = note("child", i)
        assert report["result"] == {"store": mine, "pool": mine, "built": mine, "counters": 0}
    assert [hammer.errors for hammer in hammers] == [[]] * len(hammers)


def test_children_forked_while_another_thread_reads_the_counters_in_a_tight_loop_do_not_hang(loopback) -> None:
    # A metrics scrape or OpenTelemetry's periodic reader: the counters' lock is held most of the time.
    store = built_store(loopback)
    scrape = Hammer("counters", store.counters)
    children = []
    try:
        assert wait_until(lambda: scrape.calls > 0, timeout=LONG)
        for i in range(15):
            children.append(fork_child(lambda i=i: [store.counters()["recalls"], recall(store, f"child{i:02d}")]))
    finally:
        reports = child_reports(children)
        scrape.stop()
        store.close()

    assert [report.get("error") for report in reports] == [None] * 15
    assert [report["result"] for report in reports] == [[0, note("child", i)] for i in range(15)]


def held_locks(store: MembaseMemoryStore, pool: MembaseStorePool) -> dict[str, Any]:
    """Every lock the library owns, by what it guards (reached through the library's own private names)."""
    return {
        "counters": store._counters._lock,
        "recall guard": store._recall._lock,
        "write record": store._writes._lock,
        "gateway": store._gateway._lock,
        "Memory names": store._gateway._resolver._lock,
        "store": store._lock,
        "pool": pool._lock,
        "threads": _background._threads._lock,
        "fork and exit registries": _background._lock,
        "connection pools": _http._lock,
        "metrics registry": _telemetry._lock,
        "set-up check": store._setup._lock,
    }


@pytest.mark.parametrize(
    "lock",
    [
        "counters",
        "recall guard",
        "write record",
        "gateway",
        "Memory names",
        "store",
        "pool",
        "threads",
        "fork and exit registries",
        "connection pools",
        "metrics registry",
        "set-up check",
    ],
)
def test_a_child_forked_while_another_thread_holds_a_lock_of_the_librarys_uses_everything(loopback, lock) -> None:
    store = built_store(loopback, container="Main", capture=True, write_timeout=LONG)
    pool = MembaseStorePool(lambda user: API_KEY, name=NAME, base_url=loopback.url, recall_timeout=LONG)
    pool.store_for("parent-user")
    warm(store)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with held_locks(store, pool)[lock]:
            held.set()
            release.wait(LONG)

    holder = threading.Thread(target=hold, name="holds-a-lock", daemon=True)
    holder.start()
    assert held.wait(LONG)

    def child() -> dict[str, Any]:
        counted = store.counters()["recalls"]
        asyncio.run(store.initialize())  # the set-up check: the Memory names, the set-up lock
        recalled = recall(store, "child07")
        saved = asyncio.run(store.add(NOTE))  # the write record
        pooled = recall(pool.store_for("child-user"), "child08")  # the pool, a new store: the registries
        built = built_store(loopback)
        fresh = recall(built, "child09")
        built.close()
        store.close()
        return {"counted": counted, "recalled": recalled, "saved": saved is not None, "pooled": pooled, "fresh": fresh}

    try:
        got = run_in_child(child, timeout=LONG)
    finally:
        release.set()
        holder.join(LONG)
        pool.close()
        store.close()

    assert got == {
        "counted": 1,
        "recalled": note("child", 7),
        "saved": True,
        "pooled": note("child", 8),
        "fresh": note("child", 9),
    }


# --- A store given a client -----------------------------------------------------------------------


def test_a_passed_in_client_used_before_the_fork_is_refused_in_the_child_with_how_to_fix_it(loopback) -> None:
    client = loopback.client()
    store = MembaseMemoryStore(name=NAME, client=client, recall_timeout=LONG)
    try:
        warm(store)

        def child() -> dict[str, Any]:
            try:
                recall(store, "child07")
            except RuntimeError as refused:
                return {"refused": str(refused), "recall_errors": store.counters()["recall_errors"]}
            return {"refused": None}

        got = run_in_child(child)

        assert "build the client after the fork" in got["refused"]
        assert API_KEY not in got["refused"]
        assert got["recall_errors"] == 1
        assert len(loopback.fake.sent("POST", "/v1/search")) == 1  # the parent's warm-up only: the child sent none
        assert searches(store, "parent") == expected("parent")  # the parent goes on with its client
    finally:
        store.close()
        client.close()


def test_a_passed_in_client_never_used_before_the_fork_serves_the_child(loopback) -> None:
    client = loopback.client()
    store = MembaseMemoryStore(name=NAME, client=client, recall_timeout=LONG)
    try:

        def child() -> dict[str, Any]:
            heard = Warnings()
            logging.getLogger("membase_strands").addHandler(heard)
            return {"answers": searches(store, "child"), "warnings": heard.messages}

        got = run_in_child(child)

        assert got["answers"] == expected("child")
        assert got["warnings"] == []
    finally:
        store.close()
        client.close()

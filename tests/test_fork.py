"""A store used before ``os.fork()`` (gunicorn ``--preload``, multiprocessing with fork).

A child inherits its parent's memory as it was at the fork: keep-alive sockets two processes must not both read,
requests and writes whose threads stayed behind in the parent, and the library's locks, taken or not (the child makes
them anew, as ``logging`` does its handlers'). These tests
fork for real, against the loopback HTTP server (which runs in the parent and serves every process). A child reports
through a pipe and leaves with ``os._exit``; a child that does not report in time is killed by its pid and fails.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from membase_strands import MembaseMemoryStore, MembaseStorePool
from membase_strands.testing import API_KEY, status
from tests.support.loopback import LoopbackMembase, arrived, as_usual, ok_json, raw_answer, stall
from tests.support.store_helpers import (
    LONG,
    MEMORIES,
    cancelled_once_sent,
    child_reports,
    fork_child,
    logged,
    membase_threads,
    run_in_child,
    until,
    user,
    wait_until,
)

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no os.fork()"),
    # The loopback server's threads (and, on purpose, other threads) are alive at the fork.
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]

SEARCHES = 30
NAME = "forked"  # every store here has this name, so its threads can be told from other tests' threads


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


def recall(store: MembaseMemoryStore, query: str) -> list[str]:  # what one recall returned (nothing: skipped)
    return [entry.content for entry in asyncio.run(store.search(query))]


def note(who: str, i: int) -> list[str]:  # the one note a recall for ``who`` and ``i`` finds
    return [f"[Main] Note for {who}{i:02d}."]


def searches(store: MembaseMemoryStore, who: str) -> list[list[str]]:
    """``SEARCHES`` recalls, each for a word only one note holds; what each one got back."""
    return [recall(store, f"{who}{i:02d}") for i in range(SEARCHES)]


def warm(store: MembaseMemoryStore) -> None:
    """One search, so a keep-alive connection is open at the fork; then no thread of ours runs."""
    assert recall(store, "parent00") == note("parent", 0)
    assert wait_until(lambda: not [t for t in membase_threads() if t.name.endswith(f"[{NAME}]")], timeout=LONG)


# --- A store built from a key --------------------------------------------------------------------
def test_a_forked_child_never_gets_its_parents_answers(loopback) -> None:
    store = built_store(loopback)
    try:
        warm(store)
        connections_before = loopback.connections
        forked = fork_child(lambda: searches(store, "child"))
        parent = searches(store, "parent")
        [child] = child_reports([forked])

        assert child == {"result": [note("child", i) for i in range(SEARCHES)]}
        assert parent == [note("parent", i) for i in range(SEARCHES)]
        assert loopback.connections > connections_before  # the child opened a connection of its own
    finally:
        store.close()


async def test_a_forked_child_recalls_while_parent_recalls_are_in_flight_one_waited_for_and_one_nobody_waits_for(
    loopback,
) -> None:
    """Threads of the parent mid-request at the fork do not exist in the child, which must not wait for them, nor read
    their sockets, nor skip its recalls while the parent's late one runs."""
    store = built_store(loopback)
    waited_sent, late_sent, release = threading.Event(), threading.Event(), threading.Event()
    try:
        await asyncio.to_thread(warm, store)
        loopback.on(
            "POST",
            "/v1/search",
            arrived(waited_sent, stall(release, as_usual)),
            arrived(late_sent, stall(release, ok_json({"results": [], "containers": []}))),
        )
        waited = asyncio.ensure_future(asyncio.to_thread(recall, store, "parent03"))
        assert await until(waited_sent.is_set, timeout=LONG)
        # In the parent, a recall nobody waits for any more is still running: recalls skip until it ends.
        await cancelled_once_sent(store.search("ledger"), late_sent)
        assert await store.search("child07") == []

        child = await asyncio.to_thread(run_in_child, lambda: (recall(store, "child07"), store.counters()))

        assert child[0] == note("child", 7)
        assert child[1]["recall_skipped"] == 1  # the parent's skip, counted before the fork; none since
        assert await store.search("child07") == []  # the parent still skips while its request runs
        release.set()
        assert await asyncio.wait_for(waited, LONG) == note("parent", 3)  # the parent's request got its own answer
    finally:
        release.set()
        store.close()


async def test_a_forked_child_sends_its_own_writes_only_never_waiting_for_or_sending_its_parents(
    loopback, caplog
) -> None:
    caplog.set_level(logging.INFO)
    running, release, failing, fail = (threading.Event() for _ in range(4))
    loopback.on(
        *MEMORIES,
        arrived(running, stall(release, ok_json({"memory_id": "m1"}))),  # the parent's, still running at the fork
        arrived(failing, stall(fail, raw_answer(429, b'{"error": {"code": "rate_limited"}}'))),  # the parent's, failed
    )
    loopback.fake.on(*MEMORIES, loopback.fake.answer, status(429, "rate limited"))  # what the fake keeps of them
    store = built_store(loopback, capture=True, write_timeout=LONG)
    try:
        await cancelled_once_sent(store.add("Note one."), running)
        await cancelled_once_sent(store.add_messages([user("Note two.")]), failing)
        fail.set()
        assert await until(logged(caplog, "nothing sends it again", logging.WARNING), timeout=LONG)  # said lost

        def child() -> bool:  # the parent's running note is of unknown fate here: never sent again, nor waited for
            return asyncio.run(store.add("Note one.")) is None and asyncio.run(store.add("Note three.")) is not None

        assert await asyncio.to_thread(run_in_child, child)
        await store.add("Note four.")  # the parent's next write: it sends only its own words
    finally:
        release.set()
        fail.set()
        store.close()
    posted = [r.body["content"] for r in loopback.fake.sent(*MEMORIES)]
    assert sorted(posted) == sorted(["Note one.", "Note two.", "Note three.", "Note four."])


# --- Forking while other threads are at work -------------------------------------------------------
class Hammer:
    """A daemon thread that calls ``work`` until stopped or it raises, counting its calls and keeping what it raised."""

    def __init__(self, name: str, work: Callable[[], object]) -> None:
        self.calls, self.errors, self.stopping = 0, list[BaseException](), threading.Event()
        self.thread = threading.Thread(target=self.run, args=(work,), name=f"hammer-{name}", daemon=True)
        self.thread.start()

    def run(self, work: Callable[[], object]) -> None:
        while not self.stopping.is_set() and not self.errors:
            try:
                work()
                self.calls += 1
            except BaseException as error:  # noqa: BLE001 - reported by the test
                self.errors.append(error)


def test_children_forked_while_threads_hammer_every_public_entry_point_each_finish_their_own_work(loopback) -> None:
    store = built_store(loopback)
    pool = MembaseStorePool(lambda user: API_KEY, max_stores=4, name=NAME, base_url=loopback.url, recall_timeout=LONG)
    users = iter(range(10**9))
    hammers = [
        Hammer("counters", store.counters),  # a metrics scrape: the lock is taken most of the time
        Hammer("search", lambda: recall(store, "parent05")),
        Hammer("store_for", lambda: pool.store_for(f"user-{next(users) % 10}")),  # past max_stores: lets go of some
        Hammer("pooled-search", lambda: recall(pool.store_for("user-searching"), "parent06")),
        Hammer("build", lambda: built_store(loopback).close()),
        Hammer("pool counters", pool.counters),
    ]

    def child(i: int) -> dict[str, Any]:
        built = built_store(loopback)
        return {
            "store": recall(store, f"child{i:02d}"),
            "pool": recall(pool.store_for(f"child-user-{i}"), f"child{i:02d}"),
            "built": recall(built, f"child{i:02d}"),
            "errors": store.counters()["recall_errors"],
        }

    children = []
    try:
        for hammer in hammers:
            assert wait_until(lambda: hammer.calls > 0, timeout=LONG), f"{hammer.thread.name} never got going"  # noqa: B023
        for i in range(10):  # each fork at another moment of the hammers' work: after the next search has gone through
            done = hammers[1].calls
            assert wait_until(lambda: hammers[1].calls > done, timeout=LONG)  # noqa: B023
            children.append(fork_child(functools.partial(child, i)))
    finally:
        reports = child_reports(children)
        for hammer in hammers:
            hammer.stopping.set()
            hammer.thread.join(LONG)
        pool.close()
        store.close()

    assert [report.get("error") for report in reports] == [None] * len(children)
    assert [report["result"] for report in reports] == [
        {"store": note("child", i), "pool": note("child", i), "built": note("child", i), "errors": 0}
        for i in range(len(children))
    ]
    assert [(hammer.errors, hammer.thread.is_alive()) for hammer in hammers] == [([], False)] * len(hammers)


# --- A store given a client -----------------------------------------------------------------------
def test_a_passed_in_client_serves_a_child_only_if_unused_before_the_fork(loopback) -> None:
    used, fresh = loopback.client(max_retries=0), loopback.client(max_retries=0)  # a store that saves takes no retry
    before = MembaseMemoryStore(name=NAME, client=used, recall_timeout=LONG)
    after = MembaseMemoryStore(name=NAME, client=fresh, recall_timeout=LONG)
    try:
        warm(before)

        def child() -> dict[str, Any]:
            answers = searches(after, "child")
            try:
                recall(before, "child07")
            except RuntimeError as refused:
                return {"refused": str(refused), "errors": before.counters()["recall_errors"], "answers": answers}
            return {"refused": "not refused"}

        got = run_in_child(child)

        assert "build the client after the fork" in got["refused"] and API_KEY not in got["refused"]
        assert got["errors"] == 1
        assert got["answers"] == [note("child", i) for i in range(SEARCHES)]
        assert len(loopback.fake.sent("POST", "/v1/search")) == 1 + SEARCHES  # the warm-up; none from the used one
        assert searches(before, "parent") == [note("parent", i) for i in range(SEARCHES)]  # the parent goes on
    finally:
        for closable in (before, after, used, fresh):
            closable.close()

"""A store used before ``os.fork()`` (gunicorn ``--preload``, multiprocessing with fork).

The child inherits the parent's pooled keep-alive sockets; two processes reading one socket get each
other's answers. These tests fork for real, against the loopback HTTP server (which runs in the
parent and serves both processes). The child reports through a pipe and leaves with ``os._exit``;
every wait is bounded, and a child that does not finish in time is killed by its pid.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import select
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from membase_strands import MembaseMemoryStore, MembaseRecallTimeout, MembaseWriteTimeout
from membase_strands.testing import API_KEY, InMemoryMembase
from tests.support.loopback import LoopbackMembase, ok_json, stall
from tests.support.store_helpers import client_of, membase_threads, wait_until

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no os.fork()"),
    # The loopback server's threads are alive at the fork; the child never touches what they hold.
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]

SEARCHES = 30
NAME = "forked"  # every store here has this name, so its threads can be told from other tests' threads
CHILD_LIMIT = 60.0  # the longest the parent waits for a child before killing it
NOTE = "Remember that the ledger runs on Postgres."


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as server:
        for i in range(SEARCHES):
            for who in ("parent", "child"):
                server.fake.remember(f"Note for {who}{i:02d}.")
        yield server


def fork_and_run(child: Callable[[], Any], parent: Callable[[], Any] = lambda: None) -> tuple[Any, Any]:
    """Fork; run ``child`` in the child and ``parent`` here at the same time; return both results.

    The child's result (or its traceback) comes back as JSON through a pipe.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            try:
                report: dict[str, Any] = {"result": child()}
            except BaseException:  # noqa: BLE001 - reported to the parent
                report = {"error": traceback.format_exc()}
            data = json.dumps(report).encode()
            while data:
                data = data[os.write(write_end, data) :]
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + CHILD_LIMIT
    try:
        parent_result = parent()
        report = json.loads(_read_until_eof(read_end, deadline) or b'{"error": "the child sent nothing"}')
    finally:
        os.close(read_end)
        _reap(pid, deadline)
    assert "error" not in report, f"the child failed:\n{report['error']}"
    return report["result"], parent_result


def _read_until_eof(fd: int, deadline: float) -> bytes:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the child did not report within {CHILD_LIMIT:g} s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _reap(pid: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)  # our own child, by its pid
    os.waitpid(pid, 0)


def searches(store: MembaseMemoryStore, who: str) -> list[list[str]]:
    """``SEARCHES`` recalls, each for a word only one note holds; what each one got back."""
    got = []
    for i in range(SEARCHES):
        entries = asyncio.run(store.search(f"{who}{i:02d}"))
        got.append([entry.content for entry in entries])
    return got


def recall(store: MembaseMemoryStore, query: str) -> list[str]:
    """What one recall returned; a skipped recall returns nothing (or raises, as it may say it was skipped)."""
    try:
        return [entry.content for entry in asyncio.run(store.search(query))]
    except MembaseRecallTimeout as skipped:
        assert "skipped" in str(skipped)
        return []


def expected(who: str) -> list[list[str]]:
    return [[f"[Main] Note for {who}{i:02d}."] for i in range(SEARCHES)]


def warm(store: MembaseMemoryStore) -> None:
    """One search, so the client's pool holds a keep-alive connection at the fork; then no thread of ours runs."""
    assert asyncio.run(store.search("parent00"))
    assert wait_until(lambda: not ours(), timeout=5.0)


def ours() -> list[threading.Thread]:
    """The live threads of this module's stores."""
    return [t for t in membase_threads() if t.name.endswith(f"[{NAME}]")]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# --- A store that built its client ---------------------------------------------------------------


def test_a_forked_child_never_gets_its_parents_answers(loopback) -> None:
    store = MembaseMemoryStore(name=NAME, api_key=API_KEY, base_url=loopback.url, recall_timeout=10.0)
    try:
        warm(store)
        connections_before = loopback.connections

        child, parent = fork_and_run(lambda: searches(store, "child"), lambda: searches(store, "parent"))

        assert child == expected("child")
        assert parent == expected("parent")
        assert loopback.connections > connections_before  # the child opened a connection of its own
    finally:
        store.close()


def test_a_forked_child_is_not_stuck_on_a_pool_lock_its_parent_held_at_the_fork(loopback) -> None:
    # A thread of the parent holds the connection pool's lock at the moment of the fork (httpcore takes it
    # briefly on every request). That thread does not exist in the child, so the child's copy of the lock is
    # never released: the child must not use the parent's pool at all.
    store = MembaseMemoryStore(name=NAME, api_key=API_KEY, base_url=loopback.url, recall_timeout=3.0)
    try:
        warm(store)
        pool_lock = client_of(store)._http.http._transport._pool._optional_thread_lock
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with pool_lock:
                held.set()
                release.wait(10.0)

        holder = threading.Thread(target=hold, name="holds-the-pool-lock", daemon=True)
        holder.start()
        assert held.wait(5.0)
        try:
            got, _ = fork_and_run(lambda: [entry.content for entry in asyncio.run(store.search("child07"))])
        finally:
            release.set()
            holder.join(5.0)

        assert got == ["[Main] Note for child07."]
    finally:
        store.close()


def test_a_forked_child_is_not_held_off_by_its_parents_late_recall(loopback) -> None:
    release = threading.Event()
    loopback.on("POST", "/v1/search", stall(release, ok_json({"results": [], "containers": []})))
    store = MembaseMemoryStore(name=NAME, api_key=API_KEY, base_url=loopback.url, recall_timeout=0.2)
    try:
        # In the parent, a recall that ran out of time is still running: it holds the in-flight guard.
        with pytest.raises(MembaseRecallTimeout, match="ran out of time"):
            asyncio.run(store.search("ledger"))
        assert not recall(store, "child07")  # skipped: no memory
        assert store.counters()["recall_skipped"] == 1

        # That request's thread does not exist in the child: the child's recall runs.
        got, _ = fork_and_run(lambda: {"recalled": recall(store, "child07"), "counters": store.counters()})

        assert got["recalled"] == ["[Main] Note for child07."]
        assert got["counters"]["recall_skipped"] == 1  # the parent's skip, counted before the fork; none since
        assert store._recall.waking  # the parent's guard is untouched
    finally:
        release.set()
        wait_until(lambda: not ours(), timeout=5.0)
        store.close()


def test_a_forked_child_sends_a_note_its_parent_was_still_sending(loopback) -> None:
    release = threading.Event()
    loopback.on("POST", "/v1/memories", stall(release, ok_json({"memory_id": "m1"})))
    store = MembaseMemoryStore(name=NAME, api_key=API_KEY, base_url=loopback.url, capture=True, write_timeout=0.2)
    try:
        with pytest.raises(MembaseWriteTimeout):
            asyncio.run(store.add(NOTE))  # still running in the parent

        # In the child no request of the parent's is running: the same note is sent, not waited for.
        got, _ = fork_and_run(lambda: asyncio.run(store.add(NOTE)))

        assert got is not None and got["container"] == "ctr_main"  # Membase's own answer to the child
        assert [r.body["content"] for r in loopback.fake.sent("POST", "/v1/memories")] == [NOTE, NOTE]
    finally:
        release.set()
        wait_until(lambda: not ours(), timeout=5.0)
        store.close()


def test_the_fork_hook_does_not_keep_a_store_alive(fake: InMemoryMembase) -> None:
    store = MembaseMemoryStore(client=fake.client())
    ref = weakref.ref(store)
    store.close()
    del store
    gc.collect()
    assert ref() is None


# --- A store given a client -----------------------------------------------------------------------


def test_a_passed_in_client_used_before_the_fork_is_not_shared_and_the_child_is_told_once(loopback) -> None:
    client = loopback.client()
    store = MembaseMemoryStore(name=NAME, client=client, recall_timeout=10.0)
    try:
        warm(store)

        def child() -> dict[str, Any]:
            heard = Warnings()
            logging.getLogger("membase_strands").addHandler(heard)
            return {"answers": searches(store, "child"), "warnings": heard.messages}

        got, parent = fork_and_run(child, lambda: searches(store, "parent"))

        assert got["answers"] == expected("child")
        assert parent == expected("parent")
        [warning] = [m for m in got["warnings"] if "reason=<forked after its client was used>" in m]
        assert "build the client after the fork" in warning
        assert API_KEY not in warning
    finally:
        store.close()
        client.close()


def test_a_passed_in_client_never_used_before_the_fork_needs_no_warning(loopback) -> None:
    client = loopback.client()
    store = MembaseMemoryStore(name=NAME, client=client, recall_timeout=10.0)
    try:

        def child() -> dict[str, Any]:
            heard = Warnings()
            logging.getLogger("membase_strands").addHandler(heard)
            return {"answers": searches(store, "child"), "warnings": heard.messages}

        got, _ = fork_and_run(child)

        assert got["answers"] == expected("child")
        assert [m for m in got["warnings"] if "fork" in m.split("|", 1)[-1]] == []
    finally:
        store.close()
        client.close()

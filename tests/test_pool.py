"""``MembaseStorePool``: one store per user, from that user's own credential, LRU-bounded, thread-safe.

Request-level tests route the Membase host every store is built for (``MEMBASE_BASE_URL``) to a transport
that hands each request to the fake Membase of the user whose key is in its ``Authorization`` header, so a
request sent with the wrong user's key would reach the wrong memory and show in the model's prompt. The
stores are built from their keys as in production. The many-users tests serve the same per-user fakes over
real sockets (``LoopbackMembase``), so they can count the connections the stores open.

Every store built from a key sends through the process's shared connection pool for its base URL: users
share sockets, never credentials. The bound lets go of stores without closing them (a store let go of keeps
working for whoever holds it, and is collected once nothing does); ``close()`` closes every store still alive.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

import membase_strands.pool as pool_module
from membase_strands import MembaseMemoryStore, MembaseStorePool, _http
from membase_strands.testing import InMemoryMembase, hang
from membase_strands.testing._membase import error
from tests.support.local_engine import engine_unavailable
from tests.support.loopback import LoopbackMembase
from tests.support.store_helpers import (
    LONG,
    QUESTION,
    client_of,
    make_agent,
    routed,
    set_write_budget,
    settle,
    until,
    wait_until,
)

T = TypeVar("T")
BUDGET = 0.1  # only for writes a gate holds: it always runs out
ROOT = Path(__file__).resolve().parent.parent
FACTS = {
    "alice": "We chose Postgres for the ledger.",
    "bob": "We chose SQLite for the ledger.",
    "carol": "We chose DuckDB for the ledger.",
}


def key_of(user_id: str) -> str:
    return f"mb_key_of_{user_id}_s3cret"


_HOSTS = itertools.count(1)


class Users:
    """One fake Membase per user, reached only with that user's key, at a host of their own (``base_url``)."""

    def __init__(self, facts: dict[str, str]) -> None:
        self.fakes: dict[str, InMemoryMembase] = {}
        for user, fact in facts.items():
            self.fakes[user] = InMemoryMembase()
            self.fakes[user].remember(fact)
        self.by_key = {key_of(user): user for user in facts}
        self.keys_seen: list[str] = []
        self._lock = threading.Lock()
        self.base_url = f"https://users-{next(_HOSTS)}.test"
        # Stores built for base_url send here while these users live: the production path, minus the sockets.
        self._routed = _http.route(self.base_url, httpx.MockTransport(self.handle))

    def handle(self, request: httpx.Request) -> httpx.Response:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        with self._lock:
            self.keys_seen.append(key)
        user = self.by_key.get(key)
        if user is None:
            return error(403, "unauthorized", "unknown key")
        return self.fakes[user].handle(request)


def route_users(monkeypatch: pytest.MonkeyPatch, users: Users) -> Users:
    """Build every store from here on (with no ``base_url``) for the users' host, as ``MEMBASE_BASE_URL`` does."""
    monkeypatch.setenv("MEMBASE_BASE_URL", users.base_url)
    return users


@pytest.fixture
def users(monkeypatch: pytest.MonkeyPatch) -> Users:
    return route_users(monkeypatch, Users(FACTS))


@pytest.fixture
def pool() -> Iterator[MembaseStorePool]:
    made = MembaseStorePool(key_of)
    yield made
    made.close()


def is_closed(store: MembaseMemoryStore) -> bool:
    """Closed as its user sees it: further use raises (checked before any request is made)."""
    if not store._closed:
        return False
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(store.search(QUESTION))
    return True


def in_thread(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run ``fn(*args)`` on a daemon thread of its own; its outcome in a future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as failure:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(failure)

    threading.Thread(target=run, daemon=True).start()
    return future


# --- Through the real Agent ---------------------------------------------------------------------


def test_each_users_agent_recalls_only_from_that_users_own_memory(users):
    with MembaseStorePool(key_of) as pool:
        for user, fact in FACTS.items():
            agent, model = make_agent(pool.store_for(user), ["ok"])
            agent(QUESTION)

            block = model.memory_block() or ""
            assert f"[Main] {fact}" in block
            assert all(other not in block for other in FACTS.values() if other != fact)
            assert len(users.fakes[user].sent("POST", "/v1/search")) == 1

    assert set(users.keys_seen) == {key_of(user) for user in FACTS}


def test_a_users_next_turns_reuse_the_same_store_and_client(users):
    with MembaseStorePool(key_of) as pool:
        first = pool.store_for("alice")
        for _ in range(3):
            agent, model = make_agent(pool.store_for("alice"), ["ok"])
            agent(QUESTION)
            assert FACTS["alice"] in (model.memory_block() or "")
        assert pool.store_for("alice") is first
        assert client_of(pool.store_for("alice")) is client_of(first)
        assert not first._closed
    assert users.keys_seen == [key_of("alice")] * 3


def test_the_pool_works_from_several_event_loops_at_once(users):
    seen: dict[str, set[int]] = {user: set() for user in FACTS}
    failures: list[BaseException] = []
    lock = threading.Lock()

    async def turns(pool: MembaseStorePool) -> None:
        for _ in range(5):
            for user, fact in FACTS.items():
                store = pool.store_for(user)
                found = await store.search(QUESTION)
                assert [entry.content for entry in found] == [f"[Main] {fact}"]
                with lock:
                    seen[user].add(id(store))

    def in_own_loop(pool: MembaseStorePool) -> None:
        try:
            asyncio.run(turns(pool))
        except BaseException as failure:  # noqa: BLE001 - reported by the test below
            failures.append(failure)

    with MembaseStorePool(key_of) as pool:
        threads = [threading.Thread(target=in_own_loop, args=(pool,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)

    assert failures == []
    assert all(len(ids) == 1 for ids in seen.values())
    assert sum(len(users.fakes[user].sent("POST", "/v1/search")) for user in FACTS) == 4 * 5 * len(FACTS)


def test_shared_options_reach_every_users_store(users):
    for fake in users.fakes.values():
        fake.containers = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_work", "name": "Work"}]
    with MembaseStorePool(key_of, container="work", recall_timeout=2.5, max_recall_chars=500) as pool:
        for user in ("alice", "bob"):
            store = pool.store_for(user)
            assert store._container == "work"
            assert store._recall_timeout == 2.5
            assert store._max_recall_chars == 500
            agent, _ = make_agent(store, ["ok"])
            agent(QUESTION)
            searches = users.fakes[user].sent("POST", "/v1/search")
            assert [request.body["container"] for request in searches] == ["ctr_work"]


def test_a_shared_base_url_reaches_every_users_client():
    with MembaseStorePool(key_of, base_url="https://membase.example") as pool:
        assert client_of(pool.store_for("alice")).base_url == "https://membase.example"
        assert client_of(pool.store_for("bob")).base_url == "https://membase.example"


# --- One store per user, each from its own credential -------------------------------------------


def test_the_same_user_gets_the_same_store_and_client(pool):
    store = pool.store_for("alice")

    assert pool.store_for("alice") is store
    assert client_of(pool.store_for("alice")) is client_of(store)
    assert len(pool) == 1


def test_different_users_get_different_stores_built_from_their_own_key(pool):
    alice, bob = pool.store_for("alice"), pool.store_for("bob")

    assert alice is not bob and client_of(alice) is not client_of(bob)
    assert client_of(alice).api_key == key_of("alice")
    assert client_of(bob).api_key == key_of("bob")
    assert len(pool) == 2


def test_building_a_store_makes_no_request(monkeypatch):
    def no_network(self, request):  # pragma: no cover - failing is the point
        raise AssertionError(f"unexpected request {request.method} {request.url}")

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", no_network)
    with MembaseStorePool(key_of, container="Main", capture=True) as pool:
        assert client_of(pool.store_for("alice")).api_key == key_of("alice")


def test_the_pool_and_its_repr_never_show_a_key(pool):
    pool.store_for("alice")
    assert key_of("alice") not in repr(pool)
    assert key_of("alice") not in repr(pool.store_for("alice"))


@pytest.mark.parametrize("user_id", ["", "   ", None, 42])
def test_a_blank_or_non_string_user_id_is_refused(pool, user_id):
    with pytest.raises(ValueError, match="user_id"):
        pool.store_for(user_id)


def test_a_failing_credential_function_names_the_user_and_never_leaks_a_key():
    def credential_for(user_id: str) -> str:
        if user_id == "carol":
            raise KeyError(f"vault is down; last keys read: {key_of('alice')}, {key_of('bob')}")
        return key_of(user_id)

    with MembaseStorePool(credential_for) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")

        with pytest.raises(ValueError) as caught:
            pool.store_for("carol")

        message = str(caught.value)
        assert "'carol'" in message
        assert key_of("alice") not in message and key_of("bob") not in message
        assert len(pool) == 2
        assert pool.store_for("alice") is alice and pool.store_for("bob") is bob
        assert client_of(alice).api_key == key_of("alice")


def test_a_credential_function_that_fails_once_is_asked_again_next_time():
    calls: list[str] = []

    def flaky(user_id: str) -> str:
        calls.append(user_id)
        if len(calls) == 1:
            raise TimeoutError("vault timed out")
        return key_of(user_id)

    with MembaseStorePool(flaky) as pool:
        with pytest.raises(ValueError, match="'dave'"):
            pool.store_for("dave")
        assert client_of(pool.store_for("dave")).api_key == key_of("dave")


@pytest.mark.parametrize("credential", ["", "   ", None, 42, b"mb_bytes_key", ["a", "list"]])
def test_a_blank_or_wrong_type_credential_is_refused(credential):
    with MembaseStorePool(lambda user_id: credential) as pool:
        with pytest.raises(ValueError, match="'erin'"):
            pool.store_for("erin")
        assert len(pool) == 0


@pytest.mark.parametrize("option", ["api_key", "client", "local"])
def test_per_user_options_given_to_the_pool_are_refused(fake, option):
    value = {"api_key": "mb_shared_key", "client": fake.client(), "local": "/tmp/shared"}[option]
    with pytest.raises(ValueError, match=option):
        MembaseStorePool(key_of, **{option: value})


@pytest.mark.parametrize("max_stores", [0, -1, True, 1.5, "2", None])
def test_max_stores_must_be_a_positive_whole_number(max_stores):
    with pytest.raises(ValueError, match="max_stores"):
        MembaseStorePool(key_of, max_stores=max_stores)


def test_an_invalid_shared_store_option_is_reported_naming_it():
    with pytest.raises(ValueError, match="recall_timeout"):
        MembaseStorePool(key_of, recall_timeout=0).store_for("alice")


# --- The bound: the pool lets go of the least recently used, never closing it under its user ----


def collected(ref: weakref.ref[Any]) -> bool:
    """Whether the object behind ``ref`` is gone after a full collection (a thread may still be letting go)."""

    def gone() -> bool:
        gc.collect()
        return ref() is None

    return wait_until(gone, timeout=10.0)


def test_a_third_user_makes_the_pool_let_go_of_the_least_recently_used_without_closing_it():
    with MembaseStorePool(key_of, max_stores=2) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")

        carol = pool.store_for("carol")

        assert len(pool) == 2 and list(pool._stores) == ["bob", "carol"]
        assert not any(store._closed for store in (alice, bob, carol))
        # Alice's store is still held (here: by this test; in an app: by her agent mid-turn), so she gets
        # that same store back, not a second client, and now bob is the least recently used.
        assert pool.store_for("alice") is alice
        assert list(pool._stores) == ["carol", "alice"]
        assert not bob._closed


def test_a_store_let_go_of_is_collected_once_nothing_holds_it_and_the_user_then_gets_a_new_one(users):
    """Changed by design (issue 18): a store built from a key has no connections of its own to close; once nothing
    holds a store the pool let go of, it is simply collected."""
    with MembaseStorePool(key_of, max_stores=1) as pool:
        alice = pool.store_for("alice")
        gone = weakref.ref(alice)
        pool.store_for("bob")
        assert not alice._closed

        del alice

        assert collected(gone)
        again = pool.store_for("alice")
        assert not again._closed
        assert client_of(again).api_key == key_of("alice")
        found = asyncio.run(again.search(QUESTION))
        assert [entry.content for entry in found] == [f"[Main] {FACTS['alice']}"]


def test_touching_a_store_keeps_it_recent():
    with MembaseStorePool(key_of, max_stores=2) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")
        assert pool.store_for("alice") is alice  # alice is now the most recent
        bob_gone = weakref.ref(bob)
        del bob

        pool.store_for("carol")

        assert list(pool._stores) == ["alice", "carol"]
        assert collected(bob_gone)
        assert pool.store_for("alice") is alice and not alice._closed


def test_a_bound_of_one_keeps_only_the_latest_users_store():
    with MembaseStorePool(key_of, max_stores=1) as pool:
        refs = []
        for user in ("alice", "bob", "carol"):
            store = pool.store_for(user)
            refs.append(weakref.ref(store))
        del store

        assert len(pool) == 1 and list(pool._stores) == ["carol"]
        assert collected(refs[0]) and collected(refs[1]) and refs[2]() is not None
        assert not refs[2]()._closed


def test_an_agent_keeps_its_memory_when_the_pool_lets_go_of_its_store_before_the_turn(users):
    with MembaseStorePool(key_of, max_stores=1, capture=True, extraction=True) as pool:
        store = pool.store_for("alice")
        agent, model = make_agent(store, ["ok"])
        pool.store_for("bob")  # another user's request fills the pool while alice's turn is in flight

        agent(QUESTION)

        assert f"[Main] {FACTS['alice']}" in (model.memory_block() or "")
        saved = [note.content for note in users.fakes["alice"].notes]
        assert len(saved) == 2 and QUESTION in saved[1]  # the seeded fact, then alice's captured words
        assert store.counters()["writes_saved"] == 1
        assert pool.store_for("alice") is store


def test_a_write_still_running_on_a_store_let_go_of_and_dropped_is_saved_once(users):
    release = threading.Event()
    alice = users.fakes["alice"]
    alice.on("POST", "/v1/memories", hang(release, routed(alice)))
    try:
        with MembaseStorePool(key_of, max_stores=1, capture=True, extraction=True, write_timeout=BUDGET) as pool:
            store = pool.store_for("alice")
            counters = store._counters
            agent, _ = make_agent(store, ["ok"])
            agent(QUESTION)  # the write runs out of its budget and goes on in the background
            assert wait_until(lambda: len(alice.sent("POST", "/v1/memories")) == 1, timeout=LONG)
            still_running = store._writes.running()
            assert still_running
            pool.store_for("bob")
            del agent, store
            gc.collect()

            release.set()
            settle(still_running)
            assert any(QUESTION in note.content for note in alice.notes)
            assert len(alice.sent("POST", "/v1/memories")) == 1
            assert (counters.snapshot()["writes_saved"], counters.snapshot()["write_errors"]) == (1, 0)
    finally:
        release.set()


def test_store_for_never_waits_for_the_writes_of_a_store_it_lets_go_of(users):
    release = threading.Event()
    alice = users.fakes["alice"]
    alice.on("POST", "/v1/memories", hang(release, routed(alice)))
    try:
        with MembaseStorePool(key_of, max_stores=1, capture=True, extraction=True, write_timeout=60) as pool:
            store = pool.store_for("alice")
            agent, _ = make_agent(store, ["ok"])
            turn = in_thread(lambda: agent(QUESTION))  # its flush waits for the held write
            assert wait_until(lambda: len(alice.sent("POST", "/v1/memories")) == 1, timeout=LONG)

            # An event loop asking for bob's store must not wait (up to 60 s) for alice's write.
            bob = in_thread(lambda: pool.store_for("bob")).result(timeout=LONG)

            assert client_of(bob).api_key == key_of("bob")
            assert not turn.done() and not store._closed
            release.set()
            turn.result(timeout=LONG)
            assert store.counters()["writes_saved"] == 1
            assert any(QUESTION in note.content for note in alice.notes)
    finally:
        release.set()


# --- Closing: every store side by side, within one write budget ---------------------------------


def test_close_closes_every_store_and_the_pool_refuses_more():
    pool = MembaseStorePool(key_of)
    stores = [pool.store_for(user) for user in FACTS]

    pool.close()

    assert all(is_closed(store) for store in stores)
    assert len(pool) == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.store_for("alice")
    pool.close()  # twice is fine


def test_the_pool_as_a_context_manager_closes_its_stores():
    with MembaseStorePool(key_of) as pool:
        store = pool.store_for("alice")
    assert is_closed(store)


def test_a_store_built_while_the_pool_closes_is_closed_and_not_handed_out(built_stores):
    entered, release = threading.Event(), threading.Event()
    outcome: list[BaseException | MembaseMemoryStore] = []

    def slow_vault(user_id: str) -> str:
        entered.set()
        release.wait(10)
        return key_of(user_id)

    pool = MembaseStorePool(slow_vault)

    def ask() -> None:
        try:
            outcome.append(pool.store_for("alice"))
        except BaseException as failure:  # noqa: BLE001 - inspected below
            outcome.append(failure)

    asker = threading.Thread(target=ask)
    asker.start()
    assert entered.wait(10)
    pool.close()
    release.set()
    asker.join(10)

    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    assert len(built_stores) == 1 and is_closed(built_stores[0])


def test_close_also_closes_the_stores_it_let_go_of_that_are_still_in_use():
    with MembaseStorePool(key_of, max_stores=1) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")
        assert len(pool) == 1
    assert is_closed(alice) and is_closed(bob)


def test_close_waits_for_every_users_running_writes_side_by_side(users):
    release = threading.Event()
    for fake in users.fakes.values():
        fake.on("POST", "/v1/memories", hang(release, routed(fake)))
    pool = MembaseStorePool(key_of, capture=True, extraction=True, write_timeout=60)
    try:
        stores = [pool.store_for(user) for user in FACTS]
        turns = [in_thread(make_agent(store, ["ok"])[0], QUESTION) for store in stores]
        assert wait_until(lambda: all(fake.sent("POST", "/v1/memories") for fake in users.fakes.values()), timeout=10)

        closing = in_thread(pool.close)

        # Every store is closing (waiting for its own write) at the same moment, not one after another.
        assert wait_until(lambda: all(store._closed for store in stores), timeout=10)
        assert not closing.done()
        release.set()
        closing.result(timeout=10)
        for turn in turns:
            turn.result(timeout=10)
        assert all(is_closed(store) for store in stores)
        assert [store.counters()["writes_saved"] for store in stores] == [1, 1, 1]
        assert all(any(QUESTION in note.content for note in fake.notes) for fake in users.fakes.values())
    finally:
        release.set()
        pool.close()


def test_close_returns_within_one_write_budget_however_many_stores_wait(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="membase_strands")
    many = Users({f"user{n}": f"User {n} chose Postgres for the ledger." for n in range(8)})
    route_users(monkeypatch, many)
    release = threading.Event()
    for fake in many.fakes.values():
        fake.on("POST", "/v1/memories", hang(release, routed(fake)))
    pool = MembaseStorePool(key_of, capture=True, extraction=True, write_timeout=BUDGET)
    try:
        stores = [pool.store_for(user) for user in many.fakes]
        turns = [in_thread(make_agent(store, ["ok"])[0], QUESTION) for store in stores]
        for turn in turns:
            turn.result(timeout=LONG)  # each write ran out of its budget and stays in flight
        assert wait_until(lambda: all(fake.sent("POST", "/v1/memories") for fake in many.fakes.values()), LONG)
        for store in stores:
            set_write_budget(store, 1.0)  # how long each close waits: long enough for 8 threads to start on any machine

        pool.close()

        assert all(store._closed for store in stores)
        # Side by side: every store began waiting for its write before the first one's wait ended, so the
        # whole close took about one budget (one after another, 8 stores would take 8 budgets).
        lines = [record.getMessage() for record in caplog.records]
        first_given_up = next(i for i, line in enumerate(lines) if "writes still running after 1 s" in line)
        assert sum("waiting for writes still running" in line for line in lines[:first_given_up]) == 8
        assert sum("writes still running after 1 s" in line for line in lines) == 8
    finally:
        release.set()


# --- Threads ------------------------------------------------------------------------------------


@pytest.fixture
def built_stores(monkeypatch: pytest.MonkeyPatch) -> list[MembaseMemoryStore]:
    """Every store the pool builds, including any built in a race and then dropped."""
    built: list[MembaseMemoryStore] = []
    lock = threading.Lock()

    class Recording(MembaseMemoryStore):
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            with lock:
                built.append(self)

    monkeypatch.setattr(pool_module, "MembaseMemoryStore", Recording)
    return built


def hammer(pool: MembaseStorePool, user_ids: list[str], threads: int, calls: int) -> list[tuple[str, Any]]:
    """``threads`` threads, started together, each asking for ``calls`` stores round the users."""
    start = threading.Barrier(threads)
    seen: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def work(offset: int) -> None:
        start.wait()
        mine = []
        for i in range(calls):
            user = user_ids[(i * 7 + offset) % len(user_ids)]
            mine.append((user, pool.store_for(user)))
        with lock:
            seen.extend(mine)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert len(seen) == threads * calls
    return seen


def slow_key_of(user_id: str) -> str:
    time.sleep(0.001)  # a vault look-up: widens the window in which two threads build the same user
    return key_of(user_id)


def test_threads_get_exactly_one_store_per_user_each_for_that_user(users, built_stores):
    user_ids = [f"user{n}" for n in range(20)]
    with MembaseStorePool(slow_key_of) as pool:
        seen = hammer(pool, user_ids, threads=8, calls=200)

        per_user: dict[str, set[int]] = {}
        for user, store in seen:
            assert client_of(store).api_key == key_of(user)
            per_user.setdefault(user, set()).add(id(store))
        assert set(per_user) == set(user_ids)
        assert all(len(ids) == 1 for ids in per_user.values())
        assert len(pool) == 20

        handed_out = {id(store) for _, store in seen}
        for store in built_stores:
            # A store built in a race and not handed out is closed at once; the ones handed out stay open.
            assert is_closed(store) is (id(store) not in handed_out)


def test_threads_over_a_small_bound_never_get_another_users_store(users, built_stores):
    # ``users`` gives each client a mock transport: building one is cheap, so the bound can churn.
    user_ids = [f"user{n}" for n in range(20)]
    with MembaseStorePool(slow_key_of, max_stores=5) as pool:
        seen = hammer(pool, user_ids, threads=8, calls=200)

        assert all(client_of(store).api_key == key_of(user) for user, store in seen)
        assert len(pool) == 5
        # Every store handed out is still held by a thread here, so a returning user always got that
        # same store back: one store per user, however often the pool let go of it.
        per_user: dict[str, set[int]] = {}
        for user, store in seen:
            per_user.setdefault(user, set()).add(id(store))
        assert all(len(ids) == 1 for ids in per_user.values())
        handed_out = {id(store) for _, store in seen}
        for store in built_stores:
            # Only a store built in a race and never handed out is closed; none is closed under its user.
            assert is_closed(store) is (id(store) not in handed_out)


def test_two_threads_racing_for_one_new_user_get_the_same_store(built_stores):
    both_in = threading.Barrier(2)

    def racing_key_of(user_id: str) -> str:
        both_in.wait(10)  # both threads are building this user's store at the same moment
        return key_of(user_id)

    with MembaseStorePool(racing_key_of) as pool:
        seen = hammer(pool, ["alice"], threads=2, calls=1)

        assert seen[0][1] is seen[1][1]
        assert len(built_stores) == 2
        loser = next(store for store in built_stores if store is not seen[0][1])
        assert is_closed(loser) and not seen[0][1]._closed


# --- Many users at once, over real sockets ------------------------------------------------------


def test_forty_users_at_once_on_a_pool_of_sixteen_all_keep_their_memory_and_writes():
    facts = {f"user{n:02d}": f"User {n:02d} chose engine{n:02d} for the ledger." for n in range(40)}
    many = Users(facts)
    turns = len(facts)
    all_asked = threading.Barrier(turns)
    blocks: dict[str, str | None] = {}
    refs: dict[str, weakref.ref[MembaseMemoryStore]] = {}
    lock = threading.Lock()

    def turn(pool: MembaseStorePool, user: str) -> None:
        store = pool.store_for(user)
        with lock:
            refs[user] = weakref.ref(store)
        all_asked.wait(60)  # 40 requests in flight at once: the pool has let go of 24 stores already
        agent, model = make_agent(store, ["ok"])
        agent(QUESTION)
        with lock:
            blocks[user] = model.memory_block()

    with LoopbackMembase(many) as server:  # type: ignore[arg-type] - Users answers like a InMemoryMembase
        pool = MembaseStorePool(
            key_of,
            max_stores=16,
            base_url=server.url,
            capture=True,
            extraction=True,
            recall_timeout=30,
            write_timeout=30,
        )
        try:
            running = [in_thread(turn, pool, user) for user in facts]
            for each in running:
                each.result(timeout=120)

            # Every user's first turn was sent that user's memory, and only theirs.
            for user, fact in facts.items():
                block = blocks[user] or ""
                assert f"[Main] {fact}" in block, user
                assert sum(other in block for other in facts.values()) == 1, user
            # Every user's captured words reached their own memory, once.
            for user, fake in many.fakes.items():
                assert [QUESTION in r.body["content"] for r in fake.sent("POST", "/v1/memories")] == [True], user

            # The agents are gone: the stores the pool let go of are collected; the 16 it keeps stay open.
            kept = set(pool._stores)
            assert len(kept) == 16
            let_go = [user for user in facts if user not in kept]
            assert all(collected(refs[user]) for user in let_go)
            assert not any(store._closed for store in pool._stores.values())
            # (That the stores share one pool of sockets, whatever the bound, is the next test's.)
        finally:
            pool.close()
        assert all(is_closed(refs[user]()) for user in kept)


def test_many_users_stores_share_the_hosts_few_connection_pools():
    """A store per user, a few pools of sockets per Membase host: user after user, every turn (the set-up check, the
    recall and the captured write) reuses a warm connection of its pool, each request with its own user's key."""
    facts = {f"user{n:02d}": f"User {n:02d} chose engine{n:02d} for the ledger." for n in range(20)}
    many = Users(facts)
    with LoopbackMembase(many) as server:  # type: ignore[arg-type] - Users answers like a InMemoryMembase
        options = dict(base_url=server.url, capture=True, extraction=True, container="Main", write_timeout=LONG)
        with MembaseStorePool(key_of, max_stores=5, recall_timeout=LONG, **options) as pool:
            for user, fact in facts.items():
                agent, model = make_agent(pool.store_for(user), ["ok"])
                agent(QUESTION)
                assert f"[Main] {fact}" in (model.memory_block() or ""), user
        assert server.connections <= _http.POOLS_PER_HOST  # one warm connection a pool, not one a user
    assert [many.keys_seen.count(key_of(user)) for user in facts] == [3] * len(facts)
    for user, fake in many.fakes.items():
        assert [QUESTION in r.body["content"] for r in fake.sent("POST", "/v1/memories")] == [True], user


# --- Local directories --------------------------------------------------------------------------

ENGINE_UNAVAILABLE = engine_unavailable()


@pytest.mark.skipif(ENGINE_UNAVAILABLE is not None, reason=f"local Membase cannot run here: {ENGINE_UNAVAILABLE}")
def test_a_path_credential_builds_a_local_store_for_that_user(tmp_path, monkeypatch):
    for variable in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "MEMBASE_API_KEY"):
        monkeypatch.delenv(variable, raising=False)  # building needs no LLM and no key

    def directory_of(user_id: str) -> Path:
        return tmp_path / user_id

    with MembaseStorePool(directory_of) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")

        assert alice is not bob
        assert f"local={os.fspath(tmp_path / 'alice')!r}" in repr(alice)
        assert f"local={os.fspath(tmp_path / 'bob')!r}" in repr(bob)
        assert client_of(alice).api_key == "" and str(client_of(alice).base_url) == "http://membase.local"
        assert pool.store_for("alice") is alice
    assert is_closed(alice) and is_closed(bob)


@pytest.mark.skipif(ENGINE_UNAVAILABLE is not None, reason=f"local Membase cannot run here: {ENGINE_UNAVAILABLE}")
def test_a_local_store_let_go_of_and_dropped_mid_write_closes_its_engine_only_after_that_write(tmp_path, caplog):
    """A web server cancelled the turn (its client hung up) while the write ran, and nothing holds the store any more:
    it is collected, but its engine is closed only once the write that still uses it has ended. A standing fact is
    saved without the engine's LLM, so the real engine runs here; the test holds the write at the door between the
    store and the engine, and watches the engine's own close."""
    caplog.set_level(logging.DEBUG, logger="membase_strands")
    at_the_door, release = threading.Event(), threading.Event()
    closed_after: list[int] = []  # writes saved when the engine was closed
    with MembaseStorePool(lambda user_id: tmp_path / user_id, max_stores=1, capture=True, write_timeout=LONG) as pool:
        store = pool.store_for("alice")
        gateway, counters, engine, gone = store._gateway, store._counters, client_of(store), weakref.ref(store)
        save, close = gateway.save, engine.close

        def held_save(*args: Any, **kwargs: Any) -> Any:
            at_the_door.set()
            release.wait(LONG)
            return save(*args, **kwargs)

        def recorded_close() -> None:
            saved = counters.snapshot()["writes_saved"]
            close()
            closed_after.append(saved)

        gateway.save, engine.close = held_save, recorded_close  # type: ignore[method-assign]

        async def cancelled_mid_write(writing: MembaseMemoryStore) -> None:
            write = asyncio.create_task(writing.add("Alice prefers green tea", {"static": True}))
            assert await until(at_the_door.is_set, timeout=LONG)
            write.cancel()
            with pytest.raises(asyncio.CancelledError):
                await write

        try:
            asyncio.run(cancelled_mid_write(store))
            running = store._writes.running()
            pool.store_for("bob")  # the pool lets go of alice's store, and nothing else holds it
            del store
            assert collected(gone)
            waits = "closing its local engine once its running writes end"
            assert wait_until(lambda: any(waits in m for m in caplog.messages) or closed_after, timeout=LONG)
            assert closed_after == []  # not closed under the write
        finally:
            release.set()
        settle(running)
        assert (counters.snapshot()["writes_saved"], counters.snapshot()["write_errors"]) == (1, 0)
        assert wait_until(lambda: closed_after == [1], timeout=LONG)  # and closed once it ended


# --- The example --------------------------------------------------------------------------------


def load_example():
    spec = importlib.util.spec_from_file_location("many_users_example", ROOT / "examples" / "many_users.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_with_hosted_keys_gives_each_user_their_own_memory(users, capsys, monkeypatch):
    example = load_example()
    monkeypatch.setenv("MEMBASE_USER_KEYS", ",".join(f"{user}={key_of(user)}" for user in ("alice", "bob")))
    monkeypatch.setattr(example, "QUESTION", QUESTION)

    assert example.main() == 0

    out = capsys.readouterr().out
    assert FACTS["alice"] in out and FACTS["bob"] in out
    assert key_of("alice") not in out and key_of("bob") not in out
    for user in ("alice", "bob"):
        assert len(users.fakes[user].sent("POST", "/v1/search")) >= 1
    assert set(users.keys_seen) == {key_of("alice"), key_of("bob")}


def test_close_leaves_the_calling_threads_own_event_loop_in_place(users):
    mine = asyncio.new_event_loop()
    asyncio.set_event_loop(mine)  # old-style code that runs its own loop with run_until_complete
    try:
        pool = MembaseStorePool(key_of)
        store = pool.store_for("alice")

        pool.close()

        assert asyncio.get_event_loop_policy().get_event_loop() is mine
        with pytest.raises(RuntimeError, match="closed"):
            mine.run_until_complete(store.search(QUESTION))  # the store is closed; the caller's loop still runs
    finally:
        asyncio.set_event_loop(None)
        mine.close()

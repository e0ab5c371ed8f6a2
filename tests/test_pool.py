"""``MembaseStorePool``: one store per user, each from that user's own credential, LRU-bounded, thread-safe.

The testing kit keeps one account per key on one host (``fake.account(key)``), so a request sent with the wrong
user's key would reach the wrong memory and show in the model's prompt. The stores are built from their keys as in
production (``fake.pool``). The many-users tests serve the same accounts over real sockets (``LoopbackMembase``).

The bound lets go of stores without closing them (a store let go of keeps working for whoever holds it, and is
collected once nothing does); ``close()`` closes every store still alive; ``counters()`` sums every store's counts.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import importlib.util
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

import membase_strands.pool as pool_module
from membase_strands import MembaseMemoryStore, MembaseStorePool
from membase_strands.testing import API_KEY, InMemoryMembase, hang
from tests.support.loopback import LoopbackMembase
from tests.support.store_helpers import (
    GREEN_TEA,
    LONG,
    MEMORIES,
    QUESTION,
    Ticker,
    cancelled_once_sent,
    lines,
    logged,
    make_agent,
    sdk_client,
    signalling,
    turn_and_flush,
    unreferenced,
    until,
    wait_until,
)

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
FACTS = {
    "alice": "We chose Postgres for the ledger.",
    "bob": "We chose SQLite for the ledger.",
    "carol": "We chose DuckDB for the ledger.",
}


def key_of(user_id: str) -> str:
    return f"mb_key_of_{user_id}_s3cret"


def accounts(fake: InMemoryMembase, facts: dict[str, str]) -> dict[str, InMemoryMembase]:
    """Each user's account on the fake's host, reached only with that user's key, holding that user's fact."""
    made = {user: fake.account(key_of(user)) for user in facts}
    for user, fact in facts.items():
        made[user].remember(fact)
    return made


@pytest.fixture
def users(fake: InMemoryMembase) -> dict[str, InMemoryMembase]:
    return accounts(fake, FACTS)


def is_closed(store: MembaseMemoryStore) -> bool:
    """Closed as its user sees it: a call raises at once (a blank query sends nothing on an open store)."""
    try:
        asyncio.run(store.search(" "))
    except RuntimeError as refused:
        return "closed" in str(refused)
    return False


def collected(ref: weakref.ref[Any]) -> bool:
    """Whether the object behind ``ref`` is gone after a full collection (a thread may still be letting go)."""

    def gone() -> bool:
        gc.collect()
        return ref() is None

    return wait_until(gone, timeout=10.0)


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


# --- Each user's own memory -------------------------------------------------------------------------
def test_each_users_agent_recalls_and_saves_only_in_that_users_own_memory(fake, users):
    """Issue 26 (7): the kit keeps each key's memory apart, so a pool's users can be tested offline."""
    with fake.pool(key_of, capture=True, extraction=True, container="Main", recall_timeout=LONG) as pool:
        for user, fact in FACTS.items():
            agent, model = make_agent(pool.store_for(user), ["ok"])
            agent(f"{user} asks: {QUESTION}")

            block = model.memory_block() or ""
            assert f"[Main] {fact}" in block
            assert all(other not in block for other in FACTS.values() if other != fact)
            assert users[user].saved() == [f"{user} asks: {QUESTION}"]

    assert {r.key for r in fake.requests} == {key_of(user) for user in FACTS}  # never a shared key
    assert [len(account.sent("POST", "/v1/search")) for account in users.values()] == [1, 1, 1]
    assert fake.notes == []


def test_shared_options_reach_every_users_store_and_building_one_sends_nothing(fake, users):
    for account in users.values():
        account.add_memory("Work", "ctr_work")
    with fake.pool(key_of, container="work", recall_timeout=2.5, max_recall_chars=500) as pool:
        stores = {user: pool.store_for(user) for user in ("alice", "bob")}
        assert fake.requests == []
        for user, store in stores.items():
            assert f"base_url={fake.base_url!r}, container='work'" in repr(store)
            assert "recall_timeout=2.5" in repr(store)
            assert key_of(user) not in repr(store) and key_of(user) not in repr(pool)
            agent, _ = make_agent(store, ["ok"])
            agent(QUESTION)
            assert [request.body["container"] for request in users[user].sent("POST", "/v1/search")] == ["ctr_work"]


# --- Refused when built, or for the one user -------------------------------------------------------------
def test_the_pool_refuses_a_bad_or_misspelt_store_option_when_it_is_built(fake):
    """Issue 26 (5): checked once, at construction, not at every user's first turn (each value the store refuses is
    in test_store's BAD_OPTIONS)."""
    for options, named in [
        ({"recall_timeout": 0}, "recall_timeout"),
        ({"recal_timeout": 8.0}, "recal_timeout': did you mean 'recall_timeout'"),
        ({"api_key": "mb_shared_key"}, "api_key"),
        ({"client": sdk_client(fake)}, "client"),
        ({"local": "/tmp/shared"}, "local"),
        *(({"max_stores": bad}, "max_stores") for bad in (0, -1, True, 1.5, "2", None)),
    ]:
        with pytest.raises(ValueError, match=named):
            MembaseStorePool(key_of, **options)
    with pytest.raises(ValueError, match="credential_for"):
        MembaseStorePool("mb_not_a_function")  # type: ignore[arg-type]
    assert fake.requests == []


def test_a_credential_that_is_no_key_is_refused_naming_the_user_and_never_a_key(fake, tmp_path):
    calls: list[str] = []

    def credential_for(user_id: str) -> Any:
        calls.append(user_id)
        if user_id == "carol" and calls.count("carol") == 1:
            raise KeyError(f"vault is down; last keys read: {key_of('alice')}, {key_of('bob')}")
        paths = {"dave": str(tmp_path), "dora": f"/srv/membase/users/{user_id}"}  # a path that does not exist yet too
        return {**paths, "erin": "", "frank": "   ", "gus": None, "hal": 42}.get(user_id, key_of(user_id))

    with fake.pool(credential_for) as pool:
        alice = pool.store_for("alice")
        with pytest.raises(ValueError) as caught:
            pool.store_for("carol")
        assert "'carol'" in str(caught.value)
        assert key_of("alice") not in str(caught.value) and key_of("bob") not in str(caught.value)
        pool.store_for("carol")  # the credential function is asked again next time
        for user in ("dave", "dora"):  # sent to the hosted API, it would be a key that is a path
            with pytest.raises(ValueError, match="str naming a path; for local Membase, return a pathlib.Path"):
                pool.store_for(user)
        for user in ("erin", "frank", "gus", "hal"):
            with pytest.raises(ValueError, match=f"'{user}'"):
                pool.store_for(user)
        for user_id in ("", "   ", None, 42):
            with pytest.raises(ValueError, match="user_id"):
                pool.store_for(user_id)  # type: ignore[arg-type]
        assert len(pool) == 2 and pool.store_for("alice") is alice


def test_a_credential_that_cannot_be_used_is_refused_naming_the_user_and_never_quoting_a_key(fake, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    keys = {"ivy": "k", "jay": "mb_key_with\x01_a_control"}
    with fake.pool(keys.__getitem__) as pool, MembaseStorePool(lambda user: a_file) as local_pool:
        for user, said in (("ivy", "too short"), ("jay", "characters a key cannot have"), ("kim", "is a file")):
            with pytest.raises(ValueError, match=f"credential for user '{user}' cannot be used: .*{said}") as caught:
                (local_pool if user == "kim" else pool).store_for(user)
            assert "'k'" not in str(caught.value) and "\x01" not in str(caught.value)
    assert fake.requests == []


@pytest.mark.skipif(sys.platform == "win32", reason="the lock is taken with fcntl here")
def test_a_local_directory_another_process_holds_is_a_runtime_error_naming_the_user(tmp_path):
    """A user whose memory this process cannot open now (a web app answers 503, not 403: it is no credential
    problem). The directory is held as another process holds it: an exclusive lock on its lock file."""
    import fcntl

    (tmp_path / "lee").mkdir()
    with (tmp_path / "lee" / ".membase-strands.lock").open("a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with MembaseStorePool(lambda user: tmp_path / user) as pool:
            with pytest.raises(RuntimeError, match=r"user 'lee' cannot be served in this process: .*another process"):
                pool.store_for("lee")


# --- The bound: the pool lets go of the least recently used, never closing it under its user --------------
def test_past_max_stores_the_pool_lets_go_of_the_least_recently_used_without_closing_it(fake, users):
    with fake.pool(key_of, max_stores=2, capture=True, extraction=True, recall_timeout=LONG) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")
        assert pool.store_for("alice") is alice  # alice is now the most recent
        refs = {user: weakref.ref(store) for user, store in (("alice", alice), ("bob", bob))}
        agent, model = make_agent(alice, ["ok"])
        del alice, bob

        carol = pool.store_for("carol")

        assert len(pool) == 2
        assert collected(refs["bob"])  # let go of, and held by nothing
        assert refs["alice"]() is pool.store_for("alice") and not is_closed(carol)  # kept
        again = pool.store_for("bob")  # a new store for bob, which works; carol's is let go of, not closed
        assert [entry.content for entry in asyncio.run(again.search(QUESTION))] == [f"[Main] {FACTS['bob']}"]
        assert not is_closed(carol)
        pool.store_for("carol")  # alice's store is let go of too, while her agent still holds it mid-turn
        agent(QUESTION)  # her agent keeps its memory: recalled and saved in her own account
        assert f"[Main] {FACTS['alice']}" in (model.memory_block() or "")
        assert users["alice"].saved() == [QUESTION]
        assert pool.store_for("alice") is refs["alice"]()  # still held by her agent: the same store comes back


def test_a_write_running_on_a_store_let_go_of_and_collected_is_saved_once_and_counted_by_the_pool(fake, users, gates):
    """Issue 26 (7): ``pool.counters()`` sums every store the pool built, one it let go of and that was collected
    too; the store is collected while its write runs, the write still ends saved, once, and the pool's close waits
    for it."""
    release, alice = gates.new(), users["alice"]
    alice.on(*MEMORIES, hang(release, then=alice.answer))
    options = dict(capture=True, extraction=True, recall_timeout=LONG, write_timeout=0.5)
    with fake.pool(key_of, max_stores=1, **options) as pool:  # type: ignore[arg-type]
        store = pool.store_for("alice")
        gone = weakref.ref(store)
        agent, _ = make_agent(store, ["ok"])
        agent(QUESTION)  # the write runs out of its budget and goes on in the background
        assert wait_until(lambda: len(alice.sent(*MEMORIES)) == 1, timeout=LONG)
        asyncio.run(pool.store_for("bob").search(QUESTION))  # lets go of alice's store
        del agent, store
        assert collected(gone)
        totals = pool.counters()  # alice's store is gone, its counts are not
        assert [totals[name] for name in ("recalls", "recall_hits", "write_timeouts", "writes_saved")] == [2, 2, 1, 0]

        closing = in_thread(pool.close)  # waits for the write of a store that is gone, too
        assert not wait_until(closing.done, timeout=0.5)  # the write is held, and so is the close
        release.set()
        closing.result(timeout=LONG)
        # Once the close returned, the write has ended, after its store was collected: that outcome counts too.
        assert alice.saved() == [QUESTION] and pool.counters()["writes_saved"] == 1
        assert pool.counters()["write_errors"] == 0
    assert len(alice.sent(*MEMORIES)) == 1


def test_store_for_never_waits_for_the_writes_of_a_store_it_lets_go_of_and_a_close_from_an_empty_context_does(
    fake, users, gates
):
    release, alice = gates.new(), users["alice"]
    alice.on(*MEMORIES, hang(release, then=alice.answer))
    with fake.pool(key_of, max_stores=1, capture=True, extraction=True, write_timeout=LONG) as pool:
        store = pool.store_for("alice")
        turn = in_thread(make_agent(store, ["ok"])[0], QUESTION)  # its flush waits for the held write
        assert wait_until(lambda: len(alice.sent(*MEMORIES)) == 1, timeout=LONG)

        bob = in_thread(pool.store_for, "bob").result(timeout=LONG)  # no wait for alice's write

        assert bob is not store and not turn.done() and not is_closed(store)
        # A thread starts with an empty context (until something, OpenTelemetry say, sets a variable in it), and so
        # does a server's lifespan task started there: a close from it runs its calls as from anywhere else.
        closing = in_thread(contextvars.Context().run, asyncio.run, store.aclose())  # waits for the running write
        assert not closing.done()
        release.set()
        closing.result(timeout=LONG)
        turn.result(timeout=LONG)
        in_thread(contextvars.Context().run, pool.close).result(timeout=LONG)
        assert store.counters()["writes_saved"] == 1 and alice.saved() == [QUESTION] and is_closed(store)


# --- Closing: every store it built, side by side --------------------------------------------------------
@pytest.fixture
def built_stores(monkeypatch: pytest.MonkeyPatch) -> list[MembaseMemoryStore]:
    """Every store a pool builds for a user once it is built, including any built in a race and then dropped."""
    built: list[MembaseMemoryStore] = []
    lock = threading.Lock()

    @functools.wraps(MembaseMemoryStore)
    def recording(**options: Any) -> MembaseMemoryStore:
        store = MembaseMemoryStore(**options)
        with lock:
            built.append(store)
        return store

    monkeypatch.setattr(pool_module, "MembaseMemoryStore", recording)
    return built


def test_close_closes_every_store_it_built_even_one_let_go_of_and_refuses_more(fake, built_stores):
    pool = fake.pool(key_of, max_stores=1)
    stores = [pool.store_for(user) for user in FACTS]
    assert len(pool) == 1

    pool.close()

    assert all(is_closed(store) for store in stores)
    assert len(pool) == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.store_for("alice")
    pool.close()  # twice is fine
    mine = asyncio.new_event_loop()
    asyncio.set_event_loop(mine)  # old-style code that runs its own loop with run_until_complete
    try:
        with fake.pool(key_of) as other:
            store = other.store_for("alice")
        assert asyncio.get_event_loop_policy().get_event_loop() is mine  # the caller's loop is left in place
        with pytest.raises(RuntimeError, match="closed"):
            mine.run_until_complete(store.search(QUESTION))
    finally:
        asyncio.set_event_loop(None)
        mine.close()

    entered, release = threading.Event(), threading.Event()

    def slow_vault(user_id: str) -> str:
        entered.set()
        release.wait(LONG)
        return key_of(user_id)

    racing = fake.pool(slow_vault)
    asker = in_thread(racing.store_for, "alice")
    assert entered.wait(LONG)
    racing.close()  # while alice's store is being built
    release.set()
    with pytest.raises(RuntimeError, match="closed"):
        asker.result(timeout=LONG)
    assert is_closed(built_stores[-1])  # built meanwhile: closed, never handed out


def test_close_waits_for_every_users_running_writes_side_by_side_within_one_close_timeout(fake, caplog):
    caplog.set_level(logging.INFO, logger="membase_strands")
    many = accounts(fake, {f"user{n}": f"User {n} chose Postgres for the ledger." for n in range(8)})
    release = threading.Event()
    for account in many.values():
        account.on(*MEMORIES, hang(release, then=account.answer))
    pool = fake.pool(key_of, capture=True, extraction=True, recall_timeout=LONG, write_timeout=0.5, close_timeout=0.5)
    try:
        stores = [pool.store_for(user) for user in many]
        for turn in [in_thread(make_agent(store, ["ok"])[0], QUESTION) for store in stores]:
            turn.result(timeout=LONG)  # each write ran out of its budget and stays in flight

        pool.close()

        assert all(is_closed(store) for store in stores)
        # Side by side: every store began waiting for its write before the first one's wait ended, so the whole
        # close took about one store's wait (one after another, 8 stores would take 8). The gate holds every write:
        # each always runs out of its short budget.
        said = lines(caplog, logging.INFO)
        given_up = "writes still running when closing stopped waiting after 0.5 s"
        first_given_up = next(i for i, line in enumerate(said) if given_up in line)
        assert sum("waiting for writes still running" in line for line in said[:first_given_up]) >= 8
        assert sum(given_up in line for line in said) == 8
        release.set()
        assert wait_until(lambda: all(account.saved() == [QUESTION] for account in many.values()), timeout=LONG)
    finally:
        release.set()


async def test_async_with_closes_every_store_side_by_side_without_blocking_the_loop(fake, users, gates):
    release = gates.new()
    arrivals = {user: threading.Event() for user in ("alice", "bob")}
    for user, arrived in arrivals.items():
        users[user].on(*MEMORIES, signalling(arrived, hang(release, then=users[user].answer)))
    async with fake.pool(key_of, capture=True, extraction=True, container="Main", write_timeout=LONG) as pool:
        stores = {user: pool.store_for(user) for user in arrivals}
        turns = [
            asyncio.create_task(turn_and_flush(make_agent(s, ["ok"])[0], f"{u} likes tea")) for u, s in stores.items()
        ]
        assert await until(lambda: all(event.is_set() for event in arrivals.values()), timeout=LONG)
        ticker = Ticker(release_after=5, release=release.set).__enter__()  # only it releases the writes
    ticker.__exit__()

    assert ticker.ticks >= 5  # so the loop ran while the pool closed
    assert {user: store.counters()["writes_saved"] for user, store in stores.items()} == {"alice": 1, "bob": 1}
    assert {user: users[user].saved() for user in stores} == {"alice": ["alice likes tea"], "bob": ["bob likes tea"]}
    for store in stores.values():
        with pytest.raises(RuntimeError, match="closed"):
            await store.search(QUESTION)
    with pytest.raises(RuntimeError, match="closed"):
        pool.store_for("alice")
    await pool.aclose()  # twice is fine
    await asyncio.wait_for(asyncio.gather(*turns), LONG)


async def test_pool_aclose_awaited_by_a_task_nothing_references_finishes_once_the_write_it_waits_for_ends(
    fake, users, gates, caplog
):
    """Issue 26 (1): a server's lifespan task closing the pool is referenced by nothing else."""
    caplog.set_level(logging.INFO)
    alice = users["alice"]
    in_flight, release = threading.Event(), gates.new()
    alice.on(*MEMORIES, signalling(in_flight, hang(release, then=alice.answer)))
    pool = fake.pool(key_of, capture=True, container="Main", write_timeout=LONG)
    store = pool.store_for("alice")
    await cancelled_once_sent(store.add(GREEN_TEA), in_flight)
    pool.store_for("bob")

    closed = unreferenced(pool.aclose)
    assert await until(logged(caplog, "waiting for writes still running"), timeout=LONG)  # alice's store waits
    gc.collect()
    release.set()

    assert await until(closed.is_set, timeout=LONG), "the task awaiting pool.aclose() never finished"
    assert alice.saved() == [GREEN_TEA]
    assert len(alice.sent(*MEMORIES)) == 1
    assert "Task was destroyed but it is pending" not in caplog.text


# --- Many threads, many users ------------------------------------------------------------------------
def hammer(pool: MembaseStorePool, user_ids: list[str], threads: int, calls: int) -> list[tuple[str, Any]]:
    """``threads`` threads, started together, each asking for ``calls`` stores round the users."""
    start = threading.Barrier(threads)
    seen: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def work(offset: int) -> None:
        start.wait()
        mine = [
            (user, pool.store_for(user)) for user in (user_ids[(i * 7 + offset) % len(user_ids)] for i in range(calls))
        ]
        with lock:
            seen.extend(mine)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(LONG)
    assert len(seen) == threads * calls
    return seen


def slow_key_of(user_id: str) -> str:
    time.sleep(0.001)  # a vault look-up: widens the window in which two threads build the same user
    return key_of(user_id)


@pytest.mark.parametrize("max_stores", [1000, 5])
def test_threads_get_exactly_one_store_per_user_each_for_that_user(fake, built_stores, max_stores):
    user_ids = [f"user{n}" for n in range(20)]
    with fake.pool(slow_key_of, max_stores=max_stores) as pool:
        seen = hammer(pool, user_ids, threads=8, calls=200)

        # Every store handed out is still held here, so a returning user always got that same store back.
        per_user: dict[str, set[int]] = {}
        for user, store in seen:
            per_user.setdefault(user, set()).add(id(store))
        assert set(per_user) == set(user_ids) and all(len(ids) == 1 for ids in per_user.values())
        assert len(pool) == min(20, max_stores)
        for user, store in {user: store for user, store in seen}.items():
            asyncio.run(store.search(f"{user}?"))
        assert {r.key for r in fake.requests} == {key_of(user) for user in user_ids}
        assert all(len(fake.account(key_of(user)).sent()) == 1 for user in user_ids)  # each to that user's key
        handed_out = {id(store) for _, store in seen}
        for store in built_stores:
            # A store built in a race and never handed out is closed at once; none is closed under its user.
            assert is_closed(store) is (id(store) not in handed_out)


def test_two_threads_racing_for_one_new_user_get_the_same_store(fake, built_stores):
    both_in = threading.Barrier(2)

    def racing_key_of(user_id: str) -> str:
        both_in.wait(10)  # both threads are building this user's store at the same moment
        return key_of(user_id)

    with fake.pool(racing_key_of) as pool:
        built_stores.clear()  # the one the pool built to check its options
        seen = hammer(pool, ["alice"], threads=2, calls=1)

        assert seen[0][1] is seen[1][1]
        assert len(built_stores) == 2
        loser = next(store for store in built_stores if store is not seen[0][1])
        assert is_closed(loser) and not is_closed(seen[0][1])


USERS_AT_ONCE, KEEPS = 20, 8


def test_more_users_at_once_than_the_pool_keeps_then_one_after_another_all_keep_their_memory_and_writes(fake):
    facts = {f"user{n:02d}": f"User {n:02d} chose engine{n:02d} for the ledger." for n in range(USERS_AT_ONCE)}
    many = accounts(fake, facts)
    all_asked = threading.Barrier(len(facts))
    blocks: dict[str, str | None] = {}
    refs: dict[str, weakref.ref[MembaseMemoryStore]] = {}
    lock = threading.Lock()

    def turn(pool: MembaseStorePool, user: str) -> None:
        store = pool.store_for(user)
        with lock:
            refs[user] = weakref.ref(store)
        all_asked.wait(60)  # every user asked at once: the pool has let go of all but KEEPS already
        agent, model = make_agent(store, ["ok"])
        agent(QUESTION)
        with lock:
            blocks[user] = model.memory_block()

    with LoopbackMembase(fake) as server:
        options = dict(max_stores=KEEPS, capture=True, extraction=True, recall_timeout=LONG, write_timeout=LONG)
        pool = MembaseStorePool(key_of, base_url=server.url, **options)  # type: ignore[arg-type]
        try:
            for running in [in_thread(turn, pool, user) for user in facts]:
                running.result(timeout=120)

            for user, fact in facts.items():  # every user's first turn was sent that user's memory, only theirs
                block = blocks[user] or ""
                assert f"[Main] {fact}" in block, user
                assert sum(other in block for other in facts.values()) == 1, user
            assert all(account.saved() == [QUESTION] for account in many.values())  # each user's words, once
            # The agents are gone: the stores the pool let go of are collected; the ones it keeps stay open.
            assert len(pool) == KEEPS
            assert wait_until(
                lambda: not gc.collect() and sum(ref() is None for ref in refs.values()) == USERS_AT_ONCE - KEEPS, LONG
            )
            kept = [ref() for ref in refs.values() if ref() is not None]
            assert len(kept) == KEEPS and not any(is_closed(store) for store in kept)
        finally:
            pool.close()
        assert all(is_closed(store) for store in kept)

        # Then user after user on a pool of its own (a store per user, each with connections of its own): the set-up
        # check, the recall and the write each go out with its user's key, never on a connection another user's took.
        sent = {user: len(account.sent()) for user, account in many.items()}
        options |= {"max_stores": 5, "container": "Main"}
        with MembaseStorePool(key_of, base_url=server.url, **options) as pool:  # type: ignore[arg-type]
            for user, fact in facts.items():
                agent, model = make_agent(pool.store_for(user), ["ok"])
                agent(QUESTION)
                assert f"[Main] {fact}" in (model.memory_block() or ""), user
        keys_of: dict[int, set[str]] = {}
        for seen in server.seen:
            keys_of.setdefault(seen.connection, set()).add(seen.key)
        assert [keys for keys in keys_of.values() if len(keys) > 1] == []  # no connection carried two users' requests
    assert {user: len(account.sent()) - sent[user] for user, account in many.items()} == dict.fromkeys(facts, 3)
    assert all(account.saved() == [QUESTION] * 2 for account in many.values())


def test_the_example_with_hosted_keys_gives_each_user_their_own_memory(fake, users, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # as `python examples/many_users.py` does
    spec = importlib.util.spec_from_file_location("many_users_example", ROOT / "examples" / "many_users.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setenv("MEMBASE_USER_KEYS", ",".join(f"{user}={key_of(user)}" for user in ("alice", "bob")))
    monkeypatch.setattr(example, "QUESTION", QUESTION)
    with LoopbackMembase(fake) as server:
        monkeypatch.setenv("MEMBASE_BASE_URL", server.url)
        assert example.main() == 0

    out = capsys.readouterr().out
    assert FACTS["alice"] in out and FACTS["bob"] in out
    assert key_of("alice") not in out and key_of("bob") not in out
    assert {r.key for r in fake.requests} == {key_of("alice"), key_of("bob")}
    assert API_KEY not in out

"""``MembaseStorePool``: one store per user, from that user's own credential, LRU-bounded, thread-safe.

Request-level tests swap ``membase.Membase`` for a subclass whose only change is its transport: each
request goes to the fake Membase of the user whose key is in its ``Authorization`` header, so a
request sent with the wrong user's key would reach the wrong memory and show in the model's prompt.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from membase.requirements import local_unavailable

import membase_strands.pool as pool_module
from membase_strands import MembaseMemoryStore, MembaseStorePool
from membase_strands import _client as membase_client
from tests.conftest import make_agent
from tests.support.fake_membase import FakeMembase, error
from tests.support.store_helpers import QUESTION

ROOT = Path(__file__).resolve().parent.parent
FACTS = {
    "alice": "We chose Postgres for the ledger.",
    "bob": "We chose SQLite for the ledger.",
    "carol": "We chose DuckDB for the ledger.",
}


def key_of(user_id: str) -> str:
    return f"mb_key_of_{user_id}_s3cret"


class Users:
    """One fake Membase per user, reached only with that user's key."""

    def __init__(self, facts: dict[str, str]) -> None:
        self.fakes: dict[str, FakeMembase] = {}
        for user, fact in facts.items():
            self.fakes[user] = FakeMembase()
            self.fakes[user].remember(fact)
        self.by_key = {key_of(user): user for user in facts}
        self.keys_seen: list[str] = []
        self._lock = threading.Lock()

    def handle(self, request: httpx.Request) -> httpx.Response:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        with self._lock:
            self.keys_seen.append(key)
        user = self.by_key.get(key)
        if user is None:
            return error(403, "unauthorized", "unknown key")
        return self.fakes[user].handle(request)


@pytest.fixture
def users(monkeypatch: pytest.MonkeyPatch) -> Users:
    """Route every hosted ``membase.Membase`` built from here on to the fake of the user whose key it holds."""
    routed = Users(FACTS)

    def routed_http_client(base_url: str) -> httpx.Client:
        return httpx.Client(base_url=base_url, transport=httpx.MockTransport(routed.handle))

    monkeypatch.setattr(membase_client, "new_http_client", routed_http_client)
    return routed


@pytest.fixture
def pool() -> Iterator[MembaseStorePool]:
    made = MembaseStorePool(key_of)
    yield made
    made.close()


def is_closed(store: MembaseMemoryStore) -> bool:
    return store._closed and store._client._http.is_closed


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
        assert pool.store_for("alice")._client is first._client
        assert not first._client._http.is_closed
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
        assert pool.store_for("alice")._client.base_url == "https://membase.example"
        assert pool.store_for("bob")._client.base_url == "https://membase.example"


# --- One store per user, each from its own credential -------------------------------------------


def test_the_same_user_gets_the_same_store_and_client(pool):
    store = pool.store_for("alice")

    assert pool.store_for("alice") is store
    assert pool.store_for("alice")._client is store._client
    assert len(pool) == 1


def test_different_users_get_different_stores_built_from_their_own_key(pool):
    alice, bob = pool.store_for("alice"), pool.store_for("bob")

    assert alice is not bob and alice._client is not bob._client
    assert alice._client.api_key == key_of("alice")
    assert bob._client.api_key == key_of("bob")
    assert len(pool) == 2


def test_building_a_store_makes_no_request(monkeypatch):
    def no_network(self, request):  # pragma: no cover - failing is the point
        raise AssertionError(f"unexpected request {request.method} {request.url}")

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", no_network)
    with MembaseStorePool(key_of, container="Main", capture=True) as pool:
        assert pool.store_for("alice")._client.api_key == key_of("alice")


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
        assert alice._client.api_key == key_of("alice")


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
        assert pool.store_for("dave")._client.api_key == key_of("dave")


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


# --- The bound: least recently used goes first, and is closed ------------------------------------


def test_a_third_user_evicts_the_least_recently_used_and_closes_it():
    with MembaseStorePool(key_of, max_stores=2) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")

        carol = pool.store_for("carol")

        assert len(pool) == 2
        assert is_closed(alice)
        assert not bob._closed and not bob._client._http.is_closed
        assert not carol._closed and carol._client._http.is_closed is False
        again = pool.store_for("alice")
        assert again is not alice and not again._closed
        assert again._client.api_key == key_of("alice")
        assert is_closed(bob)  # bob was now the least recently used


def test_touching_a_store_keeps_it_recent():
    with MembaseStorePool(key_of, max_stores=2) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")
        assert pool.store_for("alice") is alice  # alice is now the most recent

        pool.store_for("carol")

        assert not alice._closed and is_closed(bob)
        assert pool.store_for("alice") is alice


def test_a_bound_of_one_keeps_only_the_latest_user():
    with MembaseStorePool(key_of, max_stores=1) as pool:
        stores = [pool.store_for(user) for user in ("alice", "bob", "carol")]
        assert len(pool) == 1
        assert [is_closed(store) for store in stores] == [True, True, False]


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
            assert store._client.api_key == key_of(user)
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

        assert all(store._client.api_key == key_of(user) for user, store in seen)
        assert len(pool) <= 5
        kept = {id(store) for store in pool._stores.values()}
        for store in built_stores:
            assert is_closed(store) is (id(store) not in kept)


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


# --- Local directories --------------------------------------------------------------------------


@pytest.mark.skipif(local_unavailable() is not None, reason=f"local Membase cannot run here: {local_unavailable()}")
def test_a_path_credential_builds_a_local_store_for_that_user(tmp_path, monkeypatch):
    for variable in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "MEMBASE_API_KEY"):
        monkeypatch.delenv(variable, raising=False)  # building needs no LLM and no key

    def directory_of(user_id: str) -> Path:
        return tmp_path / user_id

    with MembaseStorePool(directory_of) as pool:
        alice, bob = pool.store_for("alice"), pool.store_for("bob")

        assert alice is not bob
        assert os.fspath(alice._local) == os.fspath(tmp_path / "alice")
        assert os.fspath(bob._local) == os.fspath(tmp_path / "bob")
        assert alice._client.api_key == "" and str(alice._client.base_url) == "http://membase.local"
        assert pool.store_for("alice") is alice
    assert is_closed(alice) and is_closed(bob)


# --- The example --------------------------------------------------------------------------------


def load_example():
    spec = importlib.util.spec_from_file_location("many_users_example", ROOT / "examples" / "many_users.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_without_keys_says_how_to_run_it_and_exits_0():
    env = {name: value for name, value in os.environ.items() if not name.startswith("MEMBASE_")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "many_users.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "MEMBASE_USER_KEYS" in done.stdout


def test_the_example_gives_each_user_their_own_memory(users, capsys):
    example = load_example()
    user_keys = ",".join(f"{user}={key_of(user)}" for user in ("alice", "bob"))

    assert example.main(user_keys, question=QUESTION) == 0

    out = capsys.readouterr().out
    assert FACTS["alice"] in out and FACTS["bob"] in out
    assert key_of("alice") not in out and key_of("bob") not in out
    for user in ("alice", "bob"):
        assert len(users.fakes[user].sent("POST", "/v1/search")) >= 1
    assert set(users.keys_seen) == {key_of("alice"), key_of("bob")}

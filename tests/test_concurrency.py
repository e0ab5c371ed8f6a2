"""Concurrency and lifecycle: many agents sharing one store, sync calls from many threads, a stalled
Membase over many turns, use after ``close()``, and the pause of automatic recall after a 403.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import membase_strands.store
from membase_strands import MembaseAccessError, MembaseMemoryStore
from membase_strands.testing import API_KEY, InMemoryMembase, Responder, ScriptedModel, ToolCall, hang, status
from tests.support.store_helpers import Clock, client_of, delayed, make_agent, membase_threads, routed, wait_until

TOPICS = ["aurora", "basalt", "cobalt", "dynamo", "ember", "fjord", "glacier", "harbor", "iris", "juniper"]


def seed_topics(fake: InMemoryMembase, topics: list[str]) -> None:
    for topic in topics:
        fake.remember(f"The {topic} project keeps its records in {topic}db.")


class InFlight:
    """Wraps a responder and records the most requests it ever served at once."""

    def __init__(self, responder: Responder) -> None:
        self._responder = responder
        self._lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            return self._responder(request)
        finally:
            with self._lock:
                self.now -= 1


def assert_own_passages(model: ScriptedModel, topic: str, turns: int) -> None:
    """Every call of this agent's model saw its own topic's passage and no other topic's."""
    assert len(model.calls) == turns
    for index in range(turns):
        block = model.memory_block(index)
        assert block is not None, f"{topic}: turn {index} got no memory"
        assert f"[Main] The {topic} project keeps its records in {topic}db." in block
        others = [other for other in TOPICS if other != topic and other in block]
        assert others == [], f"{topic}: turn {index} saw {others}"


# --- Many agents on one store --------------------------------------------------------------------


async def test_ten_agents_sharing_one_store_run_fifty_async_turns_concurrently(fake, make_store):
    """Each agent runs its five turns in order (Strands refuses concurrent calls on one agent); the ten
    agents run at the same time on one event loop, so ten recalls are in flight together."""
    seed_topics(fake, TOPICS)
    in_flight = InFlight(delayed(fake, 0.05))
    fake.always("POST", "/v1/search", in_flight)
    store = make_store(recall_timeout=5.0)
    agents = {topic: make_agent(store, ["ok"] * 5) for topic in TOPICS}

    async def chain(topic: str) -> list[str]:
        agent, _ = agents[topic]
        return [str(await agent.invoke_async(f"What about {topic}, turn {turn}?")).strip() for turn in range(5)]

    started = time.perf_counter()
    answers = await asyncio.gather(*(chain(topic) for topic in TOPICS))
    elapsed = time.perf_counter() - started

    assert answers == [["ok"] * 5] * 10
    for topic, (_, model) in agents.items():
        assert_own_passages(model, topic, 5)
    assert len(fake.sent("POST", "/v1/search")) == 50  # one per turn: none doubled, none lost
    assert in_flight.peak >= 2  # healthy recalls ran side by side; none was told the memory is waking
    counters = store.counters()
    assert (counters["recalls"], counters["recall_hits"]) == (50, 50)
    assert counters["recall_skipped"] == counters["recall_timeouts"] == 0
    assert elapsed < 50 * 0.05  # faster than one at a time


def test_synchronous_agent_calls_from_eight_threads_share_one_store(fake, make_store):
    topics = TOPICS[:8]
    seed_topics(fake, topics)
    in_flight = InFlight(delayed(fake, 0.03))
    fake.always("POST", "/v1/search", in_flight)
    store = make_store(recall_timeout=5.0)
    agents = {topic: make_agent(store, ["ok"] * 5) for topic in topics}

    def calls(topic: str) -> list[str]:
        agent, _ = agents[topic]
        return [str(agent(f"What about {topic}, call {n}?")).strip() for n in range(5)]

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(calls, topics))

    assert answers == [["ok"] * 5] * 8
    for topic, (_, model) in agents.items():
        assert_own_passages(model, topic, 5)
    assert len(fake.sent("POST", "/v1/search")) == 40
    assert in_flight.peak >= 2
    counters = store.counters()
    assert counters["recall_skipped"] == counters["recall_timeouts"] == 0


# --- A stalled Membase ---------------------------------------------------------------------------


def test_a_stalled_membase_leaves_at_most_one_recall_thread_per_store(fake, make_store, gates):
    fake.remember("We chose Postgres for the ledger.")
    baseline = len(membase_threads())
    gate = gates.new()
    fake.always("POST", "/v1/search", hang(gate, then=routed(fake)))
    stores = [make_store(name="first", recall_timeout=0.05), make_store(name="second", recall_timeout=0.05)]
    agents = [make_agent(store, ["ok"] * 50)[0] for store in stores]

    peak = 0
    started = time.perf_counter()
    for turn in range(100):
        agents[turn % 2](f"Which database did we choose for the ledger? ({turn})")
        peak = max(peak, len(membase_threads()))
    elapsed = time.perf_counter() - started

    assert peak <= baseline + len(stores)
    assert len(fake.sent("POST", "/v1/search")) == len(stores)  # one late request per store, the rest skipped
    assert elapsed < 30.0
    for store in stores:
        counters = store.counters()
        assert counters["recall_timeouts"] == 1
        assert counters["recall_skipped"] == 49

    gate.set()
    assert wait_until(lambda: len(membase_threads()) <= baseline, timeout=5.0)
    # The stall is over: recall resumes at once.
    fake.heal()
    agent, model = make_agent(stores[0], ["ok"])
    agent("Which database did we choose for the ledger?")
    assert "We chose Postgres for the ledger." in (model.memory_block() or "")


# --- Use after close -----------------------------------------------------------------------------


async def test_a_closed_store_refuses_search_and_writes_with_a_clear_runtime_error(fake, make_store):
    store = make_store(capture=True)
    store.close()
    for call in (
        lambda: store.search("ledger"),
        lambda: store.add("a note"),
        lambda: store.add_messages([{"role": "user", "content": [{"text": "a note"}]}]),
    ):
        with pytest.raises(RuntimeError, match="MembaseMemoryStore 'membase' is closed; create a new store"):
            await call()
    assert fake.sent() == []


def test_an_agent_turn_after_close_goes_on_without_memory(fake, make_store, caplog):
    fake.remember("We chose Postgres for the ledger.")
    store = make_store()
    agent, model = make_agent(store, ["ok"])
    store.close()
    assert str(agent("Which database for the ledger?")).strip() == "ok"
    assert model.memory_block() is None
    assert fake.sent() == []
    assert any("is closed" in r.getMessage() for r in caplog.records if r.name.startswith("strands.memory"))


def test_the_tools_after_close_say_the_store_is_closed_and_send_nothing(fake, make_store):
    store = make_store()
    agent, model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), "ok"], injection=False)
    store.close()
    agent("go")
    result = model.tool_results()[-1]
    assert result["status"] == "error"
    assert "closed" in result["content"][0]["text"]
    assert fake.sent() == []


def test_the_tools_after_close_of_an_owned_client_answer_in_a_sentence(monkeypatch):
    """What happens today with a client the store built: the closed httpx client refuses, and the
    model reads a generic failure sentence that names the closed client (no request, no key)."""
    monkeypatch.delenv("MEMBASE_BASE_URL", raising=False)
    store = MembaseMemoryStore(api_key=API_KEY, base_url="http://127.0.0.1:9")  # loopback, never reached
    calls = [
        ToolCall(name, args)
        for name, args in [
            ("membase_search", {"query": "ledger"}),
            ("membase_save", {"content": "a note"}),
            ("membase_profile", {}),
        ]
    ]
    agent, model = make_agent(store, [*calls, "ok"], injection=False)
    store.close()
    agent("go")
    for result in model.tool_results():
        text = result["content"][0]["text"]
        assert result["status"] == "error"
        assert "this memory store was closed" in text
        assert API_KEY not in text


def test_close_twice_is_harmless_and_a_passed_in_client_stays_open(fake):
    client = fake.client()
    store = MembaseMemoryStore(client=client)
    store.close()
    store.close()
    assert not client._http.is_closed
    assert client.search("anything")["results"] == []


def test_the_context_manager_closes_the_client_it_built_only(fake, monkeypatch):
    monkeypatch.delenv("MEMBASE_BASE_URL", raising=False)
    with MembaseMemoryStore(api_key=API_KEY, base_url="http://127.0.0.1:9") as store:
        built = client_of(store)
        assert not built._http.is_closed
    assert built._http.is_closed
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(store.search("ledger"))

    client = fake.client()
    with MembaseMemoryStore(client=client):
        pass
    assert not client._http.is_closed


# --- The pause after a 403 -----------------------------------------------------------------------


def test_after_a_403_automatic_recall_pauses_for_the_cooldown_while_the_tools_still_try(
    fake, make_store, caplog, monkeypatch
):
    clock = Clock()
    monkeypatch.setattr(membase_strands.store, "time", clock)
    caplog.set_level(logging.DEBUG)
    fake.remember("We chose Postgres for the ledger.")
    fake.always("POST", "/v1/search", status(403, "key revoked"))
    store = make_store(access_cooldown=0.3)
    agent, model = make_agent(store, ["ok", "ok", "ok", ToolCall("membase_search", {"query": "ledger"}), "ok", "ok"])

    agent("Which database for the ledger?")
    agent("And the ledger backups?")
    agent("And the ledger owner?")
    assert len(fake.sent("POST", "/v1/search")) == 1  # one refusal; the next turns sent nothing
    assert store.counters()["recall_skipped"] == 2
    paused = [r for r in caplog.records if "automatic recall paused" in r.getMessage()]
    assert len(paused) == 1 and "0.3 s" in paused[0].getMessage()

    # The tools still try, and the model hears why they failed.
    agent("Search the ledger for me")
    assert len(fake.sent("POST", "/v1/search")) == 2
    result = model.tool_results()[-1]
    assert result["status"] == "error"
    assert "narrowed or revoked" in result["content"][0]["text"]

    # After the cool-down (and with the key restored) automatic recall resumes.
    fake.heal()
    clock.advance(0.31)
    agent("Which database for the ledger?")
    assert len(fake.sent("POST", "/v1/search")) == 3
    assert "We chose Postgres for the ledger." in (model.memory_block() or "")
    assert len([r for r in caplog.records if "automatic recall paused" in r.getMessage()]) == 1


async def test_during_the_cooldown_search_returns_nothing_without_a_request(fake, make_store):
    fake.always("POST", "/v1/search", status(403))
    store = make_store(access_cooldown=60.0)
    with pytest.raises(MembaseAccessError, match="narrowed or revoked"):
        await store.search("ledger")
    assert await store.search("ledger") == []  # skipped while paused: not a failure, so the manager stays quiet
    assert len(fake.sent("POST", "/v1/search")) == 1
    assert store.counters()["recall_skipped"] == 1


async def test_without_a_cooldown_every_recall_tries_again(fake, make_store):
    fake.always("POST", "/v1/search", status(403))
    store = make_store(access_cooldown=None)
    for _ in range(3):
        with pytest.raises(MembaseAccessError):
            await store.search("ledger")
    assert len(fake.sent("POST", "/v1/search")) == 3

"""Concurrency and lifecycle: many agents sharing one store, sync calls from many threads, a burst past the
thread cap, a stalled Membase over many turns, use after ``close()``, and the pause of automatic recall after a 403.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from membase_strands import MembaseAccessError, MembaseMemoryStore, _background, _http
from membase_strands.testing import API_KEY, InMemoryMembase, Responder, ScriptedModel, ToolCall, hang, status
from tests.support.loopback import LoopbackMembase
from tests.support.store_helpers import (
    FACT,
    QUESTION,
    RECALL_THREAD,
    Clock,
    delayed,
    make_agent,
    membase_threads,
    routed,
    set_recall_budget,
    wait_until,
)

LONG = 30.0  # every budget and wait not under test: a loaded machine cannot run out of it
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
    store = make_store(recall_timeout=LONG)
    agents = {topic: make_agent(store, ["ok"] * 5) for topic in TOPICS}

    async def chain(topic: str) -> list[str]:
        agent, _ = agents[topic]
        return [str(await agent.invoke_async(f"What about {topic}, turn {turn}?")).strip() for turn in range(5)]

    answers = await asyncio.gather(*(chain(topic) for topic in TOPICS))

    assert answers == [["ok"] * 5] * 10
    for topic, (_, model) in agents.items():
        assert_own_passages(model, topic, 5)
    assert len(fake.sent("POST", "/v1/search")) == 50  # one per turn: none doubled, none lost
    assert in_flight.peak >= 2  # healthy recalls ran side by side; none was told the memory is waking
    counters = store.counters()
    assert (counters["recalls"], counters["recall_hits"]) == (50, 50)
    assert counters["recall_skipped"] == counters["recall_timeouts"] == 0


def test_synchronous_agent_calls_from_eight_threads_share_one_store(fake, make_store):
    topics = TOPICS[:8]
    seed_topics(fake, topics)
    in_flight = InFlight(delayed(fake, 0.03))
    fake.always("POST", "/v1/search", in_flight)
    store = make_store(recall_timeout=LONG)
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


def test_three_hundred_recalls_at_once_on_one_store_all_return_memory():
    """A burst past the thread cap: the calls past it wait their turn inside their budget, none is dropped.

    Over a loopback server that answers in 20 ms, with a budget no loaded machine runs out of: how fast the
    burst goes is measured in the benchmarks, not here.
    """
    burst = 300
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        server.latency = 0.02
        store = MembaseMemoryStore(api_key=API_KEY, base_url=server.url, name="burst", recall_timeout=120.0)
        agents = [make_agent(store, ["ok"]) for _ in range(burst)]  # several agents share one store, as users do

        async def all_at_once() -> list[object]:
            return await asyncio.gather(
                *(agent.invoke_async(f"{QUESTION} ({i})") for i, (agent, _) in enumerate(agents))
            )

        try:
            answers = asyncio.run(all_at_once())
        finally:
            store.close()

        assert [str(answer).strip() for answer in answers] == ["ok"] * burst
        assert [f"[Main] {FACT}" in (model.memory_block() or "") for _, model in agents] == [True] * burst
        assert len(server.fake.sent("POST", "/v1/search")) == burst  # each sent once: none dropped, none doubled
        counters = store.counters()
        assert (counters["recalls"], counters["recall_hits"]) == (burst, burst)
        assert counters["recall_timeouts"] == counters["recall_skipped"] == counters["recall_errors"] == 0
        # At most one request per thread was ever in flight: the rest waited their turn.
        assert server.peak_in_flight <= _background.MAX_THREADS
        # One store's requests share one pool, its connections all kept alive: none was closed under the burst (past
        # its keep-alive limit httpcore closes idle connections, even one just handed to a request: EBADF).
        assert server.connections <= _http.LIMITS.max_connections
        assert server.open_connections == server.connections


# --- A stalled Membase ---------------------------------------------------------------------------


def test_a_stalled_membase_leaves_at_most_one_recall_thread_per_store(fake, make_store, gates):
    fake.remember("We chose Postgres for the ledger.")
    gate = gates.new()
    fake.always("POST", "/v1/search", hang(gate, then=routed(fake)))
    stores = [make_store(name="first", recall_timeout=0.05), make_store(name="second", recall_timeout=0.05)]
    agents = [make_agent(store, ["ok"] * 50)[0] for store in stores]

    def recall_threads() -> list[object]:
        return [t for t in membase_threads(RECALL_THREAD) if t.name.endswith(("[first]", "[second]"))]

    peak = 0
    for turn in range(100):
        agents[turn % 2](f"Which database did we choose for the ledger? ({turn})")
        peak = max(peak, len(recall_threads()))

    assert peak <= len(stores)
    assert len(fake.sent("POST", "/v1/search")) == len(stores)  # one late request per store, the rest skipped
    for store in stores:
        counters = store.counters()
        assert counters["recall_timeouts"] == 1
        assert counters["recall_skipped"] == 49

    gate.set()
    assert wait_until(lambda: not recall_threads(), timeout=LONG)
    # The stall is over: recall resumes at once.
    fake.heal()
    set_recall_budget(stores[0], LONG)  # the rest is not about the budget
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


def test_the_tools_after_close_of_a_store_built_from_a_key_answer_in_a_sentence(monkeypatch):
    """The shared pool stays open for other stores: the closed store's tools refuse on their own, and the
    model reads a sentence that says the store was closed (no request, no key)."""
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
    assert client.search("anything")["results"] == []  # still open: the store never closes a client it was given


def test_the_context_manager_closes_the_store_and_leaves_the_shared_pool_and_a_passed_in_client_open(fake):
    fake.remember(FACT)
    with fake.store(recall_timeout=LONG) as store:
        assert asyncio.run(store.search(QUESTION))
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(store.search(QUESTION))
    # Another store for the same Membase still reaches it through the same pool.
    with fake.store(recall_timeout=LONG) as another:
        assert [entry.content for entry in asyncio.run(another.search(QUESTION))] == [f"[Main] {FACT}"]

    client = fake.client()
    with MembaseMemoryStore(client=client):
        pass
    assert client.search("anything")["results"] == []


# --- The pause after a 403 -----------------------------------------------------------------------


def test_after_a_403_automatic_recall_pauses_for_the_cooldown_while_the_tools_still_try(
    fake, make_store, caplog, monkeypatch
):
    clock = Clock()
    caplog.set_level(logging.DEBUG)
    fake.remember("We chose Postgres for the ledger.")
    fake.always("POST", "/v1/search", status(403, "key revoked"))
    store = make_store(access_cooldown=0.3, recall_timeout=LONG)
    monkeypatch.setattr(store._recall, "_clock", clock)  # the guard's clock: the pause lives there
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

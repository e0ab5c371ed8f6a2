"""The public testing kit, ``membase_strands.testing``: each feature at work. (The README's example, which uses it,
runs in ``test_docs.py`` with its test functions.)"""

from __future__ import annotations

import re
import threading
from typing import Any

import httpx
import membase as sdk
import pytest
from strands import Agent

from membase_strands import MembaseMemoryStore, MembaseStorePool
from membase_strands.testing import (
    API_KEY,
    InMemoryMembase,
    ScriptedModel,
    ToolCall,
    hang,
    rate_limited,
    refuse_connection,
    status,
)
from tests.support.store_helpers import FACT, make_agent, sdk_client


def _agent(store: MembaseMemoryStore, script: list[Any]) -> tuple[Agent, ScriptedModel]:
    return make_agent(store, script, search_tool_config=False)


def test_search_finds_notes_by_shared_words_across_several_memories() -> None:
    membase = InMemoryMembase()
    work = membase.add_memory("Work")
    membase.remember(FACT, "Work")
    membase.remember("Dinner with Sam on Friday.", "Main")
    client = sdk_client(membase)

    [found] = client.search("ledger postgres")["results"]

    assert (found["container_name"], found["content"], found["source"]) == ("Work", FACT, f"episode:{work}:1")
    assert client.search("dinner", container=work)["results"] == []


def test_a_memory_that_cannot_answer_is_reported_to_the_model() -> None:
    membase = InMemoryMembase()
    membase.add_memory("Work")
    membase.cannot_answer("Work", "no model configured")
    agent, model = _agent(membase.store(), ["ok"])

    agent("What did we decide?")

    assert "could not be searched: no model configured" in (model.memory_block() or "")


def test_saved_lists_notes_saved_through_the_api_and_standing_facts_go_to_the_profile() -> None:
    membase = InMemoryMembase()
    membase.remember("Seeded before the test.")
    script = [
        ToolCall("membase_save", {"content": "I like green tea."}),
        ToolCall("membase_save", {"content": "My name is Ada.", "standing_fact": True}),
        ToolCall("membase_profile"),
        "Done.",
    ]
    agent, model = _agent(membase.store(), script)

    agent("Remember these.")

    assert membase.saved() == membase.saved("Main") == ["I like green tea."]
    assert membase.standing == ["My name is Ada."]
    assert "Standing facts:\n- My name is Ada." in model.tool_result_text()


def test_a_note_is_forgotten_only_when_confirmed() -> None:
    membase = InMemoryMembase()
    note = membase.remember("The launch is in May.")
    client = sdk_client(membase)

    assert client.memories.forget(note, confirm=False)["status"] == "confirmation_required"
    assert membase.forgotten == []
    assert client.memories.forget(note, confirm=True)["status"] == "forgotten"
    assert [n.content for n in membase.forgotten] == ["The launch is in May."] and membase.notes == []


def test_a_function_step_sees_the_tool_results_of_the_turn_and_can_use_the_id_search_just_returned() -> None:
    membase = InMemoryMembase()
    membase.remember("Dinner with Sam on Friday.")
    note = membase.remember("The launch is in May.")
    seen: list[str] = []
    search = ToolCall("membase_search", {"query": "launch"})
    forget = lambda sent: ToolCall("membase_forget", {"memory_id": re.findall(r"id: ([^)]+)", sent)[-1]})  # noqa: E731
    script = [search, lambda sent: seen.append(sent) or forget(sent), "I forgot it."]
    agent, model = _agent(membase.store(tools=("search", "forget")), script)

    result = agent("Please forget when the launch is.")
    while result.stop_reason == "interrupt":  # approved
        result = agent([{"interruptResponse": {"interruptId": i.id, "response": True}} for i in result.interrupts])

    [sent] = seen
    assert sent == model.sent_text(1) and sent.startswith("Please forget when the launch is.")
    assert sent.endswith(f"The launch is in May. (id: {note})")  # the search's result, the latest text last
    assert [n.content for n in membase.forgotten] == ["The launch is in May."]
    assert "Forgotten" in model.sent_text().splitlines()[-1]  # and the forget's result, in the next call


def test_a_scripted_tool_call_has_an_id_no_other_call_has() -> None:
    ids = set()
    for _ in range(2):  # two models, as two requests of a served app build them
        membase = InMemoryMembase()
        agent, model = _agent(membase.store(), [ToolCall("membase_save", {"content": "I like tea."}), "ok"])
        agent("Remember that I like tea.")
        ids |= {result["toolUseId"] for result in model.tool_results()}
    assert len(ids) == 2


@pytest.mark.parametrize(("responder", "counter"), [(status(429), "errors.rate_limited"), (refuse_connection, None)])
def test_faults_are_injected_per_route_until_healed(responder: Any, counter: str | None) -> None:
    membase = InMemoryMembase()
    membase.always("POST", "/v1/search", responder)
    store = membase.store(recall_timeout=30.0)
    agent, model = _agent(store, ["ok"])

    agent("What did we decide?")

    assert model.memory_block() is None
    assert store.counters()[counter or "errors.connection"] == 1
    membase.heal()
    assert sdk_client(membase).search("anything")["results"] == []


def test_a_hang_holds_the_request_until_released() -> None:
    membase = InMemoryMembase()
    release = threading.Event()
    membase.on("POST", "/v1/search", hang(release, then=status(500), limit=10.0))
    store = membase.store(recall_timeout=0.2)
    agent, model = _agent(store, ["ok"])
    try:
        agent("What did we decide?")
        assert store.counters()["recall_timeouts"] == 1
    finally:
        release.set()
        store.close()
    assert model.memory_block() is None


def test_the_store_helper_passes_options() -> None:
    membase = InMemoryMembase()
    store = membase.store(container="Main", max_search_results=3)

    assert store.max_search_results == 3 and "container='Main'" in repr(store)


def test_each_key_has_a_memory_of_its_own_on_one_host_and_every_request_records_its_key() -> None:
    alice = InMemoryMembase()
    bob = alice.account("mb_key_of_bob")
    bob.remember("Bob rides a green Brompton bicycle.")
    assert alice.account("mb_key_of_bob") is bob and (bob.base_url, bob.transport) == (alice.base_url, alice.transport)

    with alice.pool(lambda user: {"alice": API_KEY, "bob": "mb_key_of_bob"}[user]) as pool:
        assert isinstance(pool, MembaseStorePool)
        for user in ("alice", "bob"):
            agent, model = _agent(pool.store_for(user), ["ok"])
            agent("What bicycle do I ride?")
            assert ("Brompton" in (model.memory_block() or "")) is (user == "bob")
        agent, _ = _agent(pool.store_for("alice"), [ToolCall("membase_save", {"content": "Alice walks."}), "ok"])
        agent("Remember that I walk.")

    assert (alice.saved(), bob.saved()) == (["Alice walks."], [])
    assert [r.path for r in alice.sent()] == ["/v1/search", "/v1/search", "/v1/memories"]  # its own key's only
    assert [r.key for r in alice.requests] == [API_KEY, "mb_key_of_bob", API_KEY, API_KEY]  # the host's, each its key


def test_it_answers_as_hosted_membase_documents_it_for_a_keys_level_and_tick() -> None:
    membase = InMemoryMembase(level="read", profile=False, hosted=True)
    note = membase.remember(FACT)
    client = sdk_client(membase, max_retries=0)
    for refused, verb in [
        (lambda: client.memories.add("x"), "add_memory"),
        (lambda: client.memories.forget(note), "forget_memory"),
        (lambda: client.profile(), "get_profile"),
    ]:
        with pytest.raises(sdk.PermissionDeniedError, match=f"'{verb}' is not in this agent's capability"):
            refused()
    membase.level, membase.profile = "full", True
    raw = httpx.Client(
        base_url=membase.base_url, transport=membase.transport, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    added = raw.post("/v1/memories", json={"content": "I like tea."})
    assert added.status_code == 202 and added.json()["status"] == "queued"
    fact = raw.post("/v1/memories", json={"content": "My name is Ada.", "static": True})
    assert fact.status_code == 202 and fact.json()["status"] == "recorded"
    asked = client.memories.forget(note)
    assert asked["status"] == "confirmation_required" and "content" not in asked and asked["how"]
    membase.sources = False
    assert "source" not in client.search("ledger")["results"][0]
    membase.on("POST", "/v1/memories", rate_limited)
    busy = raw.post("/v1/memories", json={"content": "x", "static": True})
    assert (
        busy.status_code == 429 and "retry-after" not in busy.headers and busy.json()["error"]["code"] == "rate_limited"
    )
    membase.revoked = True
    with pytest.raises(sdk.PermissionDeniedError, match="revoked"):
        client.search("ledger")
    with pytest.raises(ValueError, match="level"):
        InMemoryMembase(level="admin")

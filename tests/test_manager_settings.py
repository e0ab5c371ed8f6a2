"""The MemoryManager settings the README documents, each checked through a real Agent.

These use the public testing kit (``membase_strands.testing``) the way a user's own tests would.
"""

from __future__ import annotations

from strands import Agent
from strands.memory import MemoryManager

from membase_strands.testing import InMemoryMembase, ScriptedModel, ToolCall

QUESTION = "Which database did we choose for the ledger?"


def _agent(manager: MemoryManager, script: list[str | ToolCall] | None = None) -> tuple[Agent, ScriptedModel]:
    model = ScriptedModel(script)
    return Agent(model=model, memory_manager=manager, callback_handler=None), model


def test_a_default_manager_gives_the_model_two_search_tools_and_the_recommended_one_gives_one() -> None:
    membase = InMemoryMembase()
    default, _ = _agent(MemoryManager(stores=[membase.store()]))
    recommended, _ = _agent(MemoryManager(stores=[membase.store()], search_tool_config=False))

    assert {"search_memory", "membase_search"} <= set(default.tool_names)
    assert "search_memory" not in recommended.tool_names
    assert {"membase_search", "membase_save", "membase_profile"} <= set(recommended.tool_names)


def test_with_capture_and_the_add_tool_on_the_model_gets_add_memory_beside_membase_save() -> None:
    membase = InMemoryMembase()
    store = membase.store(capture=True, container="Main")
    agent, _ = _agent(MemoryManager(stores=[store], search_tool_config=False, add_tool_config=True))

    assert {"add_memory", "membase_save"} <= set(agent.tool_names)


def test_injection_max_entries_overrides_the_stores_max_search_results() -> None:
    membase = InMemoryMembase()
    for n in range(8):
        membase.remember(f"Ledger note {n}: we chose Postgres for the ledger database.")
    store = membase.store(max_search_results=2)
    agent, model = _agent(MemoryManager(stores=[store], search_tool_config=False, injection={"max_entries": 4}))

    agent(QUESTION)

    assert [r.body["limit"] for r in membase.sent("POST", "/v1/search")] == [4]
    assert (model.memory_block() or "").count("<entry") == 4


def test_trigger_every_turn_recalls_before_every_model_call_not_only_the_users_turn() -> None:
    membase = InMemoryMembase()
    membase.remember("We chose Postgres for the ledger.")
    # On a model call after a tool, the manager's query is the assistant's latest text.
    script: list[str | ToolCall] = [ToolCall("membase_profile", text="Checking the ledger database."), "Postgres."]

    user_turn, _ = _agent(MemoryManager(stores=[membase.store()], search_tool_config=False), list(script))
    user_turn(QUESTION)
    searches_on_user_turns = len(membase.sent("POST", "/v1/search"))

    every_turn, model = _agent(
        MemoryManager(stores=[membase.store()], search_tool_config=False, injection={"trigger": "everyTurn"}),
        list(script),
    )
    every_turn(QUESTION)

    assert searches_on_user_turns == 1
    assert len(membase.sent("POST", "/v1/search")) - searches_on_user_turns == len(model.calls) == 2


async def test_async_callers_must_flush_for_captured_words_to_be_saved() -> None:
    membase = InMemoryMembase()
    store = membase.store(capture=True, extraction=True, container="Main")
    manager = MemoryManager(stores=[store], search_tool_config=False)
    agent, _ = _agent(manager, ["Noted."])

    await agent.invoke_async("I like green tea.")
    assert membase.saved() == []  # the async path does not flush at the end of a call

    await manager.flush()
    assert membase.saved() == ["I like green tea."]


def test_a_synchronous_call_flushes_captured_words_at_its_end() -> None:
    membase = InMemoryMembase()
    store = membase.store(capture=True, extraction=True, container="Main")
    agent, _ = _agent(MemoryManager(stores=[store], search_tool_config=False), ["Noted."])

    agent("I like green tea.")

    assert membase.saved() == ["I like green tea."]

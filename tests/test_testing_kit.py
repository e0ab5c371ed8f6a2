"""The public testing kit, ``membase_strands.testing``: the README's example runs, and each feature works."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
from membase import Membase
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore
from membase_strands.testing import InMemoryMembase, ScriptedModel, ToolCall, hang, refuse_connection, status

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_section_code(heading: str) -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"expected one python block under '{heading}'"
    return blocks[0]


def _agent(store: MembaseMemoryStore, script: list[Any]) -> tuple[Agent, ScriptedModel]:
    model = ScriptedModel(script)
    manager = MemoryManager(stores=[store], search_tool_config=False)
    return Agent(model=model, memory_manager=manager, callback_handler=None), model


def test_the_readme_example_runs_and_its_tests_pass() -> None:
    namespace: dict[str, Any] = {}
    exec(compile(_readme_section_code("Testing your own agent"), "README.md", "exec"), namespace)  # noqa: S102
    tests = [name for name in namespace if name.startswith("test_")]

    assert tests == ["test_the_agent_recalls_and_saves", "test_the_agent_carries_on_when_membase_is_down"]
    for name in tests:
        namespace[name]()


def test_search_finds_notes_by_shared_words_across_several_memories() -> None:
    membase = InMemoryMembase()
    work = membase.add_memory("Work")
    membase.remember("We chose Postgres for the ledger.", "Work")
    membase.remember("Dinner with Sam on Friday.", "Main")
    client = membase.client()

    hits = client.search("ledger postgres")["results"]
    scoped = client.search("dinner", container=work)["results"]

    assert [(h["container_name"], h["content"]) for h in hits] == [("Work", "We chose Postgres for the ledger.")]
    assert scoped == []


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

    assert membase.saved() == ["I like green tea."]
    assert membase.saved("Main") == ["I like green tea."]
    assert membase.standing == ["My name is Ada."]
    assert "Standing facts:\n- My name is Ada." in model.tool_result_text()


@pytest.mark.parametrize(
    ("responder", "counter"),
    [(status(429), "errors.rate_limited"), (refuse_connection, "errors.connection")],
)
def test_faults_are_injected_per_route(responder: Any, counter: str) -> None:
    membase = InMemoryMembase()
    membase.always("POST", "/v1/search", responder)
    store = membase.store(recall_timeout=30.0)
    agent, model = _agent(store, ["ok"])

    agent("What did we decide?")

    assert model.memory_block() is None
    assert store.counters()[counter] == 1
    membase.heal()
    assert membase.client().search("anything")["results"] == []


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


def test_the_store_helper_passes_options_and_the_client_is_the_real_sdk() -> None:
    membase = InMemoryMembase()
    store = membase.store(container="Main", max_search_results=3)

    assert isinstance(membase.client(), Membase)
    assert store.max_search_results == 3
    assert "container='Main'" in repr(store)

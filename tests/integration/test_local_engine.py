"""The store through a real Strands agent against the real Membase engine, over HTTP (``membase serve``'s server on
loopback) and in process (``local=DIR``). With the deterministic stand-in LLM the engine really learns (an episode
per note) and ranks (hashed bag-of-words embeddings), scoring each Memory on its own and interleaving them by rank:
a store that sent the wrong query, container or content fails here. Budgets are generous unless a test is about one.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from examples.standin_llm import StandInLLM
from membase_strands import MembaseMemoryStore, check
from membase_strands.testing import ToolCall
from tests.support.agents import entries
from tests.support.local_engine import EngineMemory, engine_unavailable
from tests.support.store_helpers import make_agent, wait_until

if _REASON := engine_unavailable():
    pytest.skip(f"real Membase engine tests skipped: {_REASON}", allow_module_level=True)

pytestmark = pytest.mark.integration
one_form = pytest.mark.parametrize("memory", ["http"], indirect=True)  # what the other form would show again

LEDGER = "Our billing ledger runs on Postgres 16 in Frankfurt."
BACKUPS = "Ledger backups run nightly at two in the morning."
CELLO = "My daughter plays the cello on Tuesdays."
BICYCLE = "My bicycle is a green Brompton folding bike."
QUESTION = "Which database does the billing ledger run on?"


def test_notes_saved_in_one_session_are_recalled_by_a_new_agent_in_the_next(memory: EngineMemory, llm: StandInLLM):
    with memory.store() as store:
        saves = [ToolCall("membase_save", {"content": fact}) for fact in (LEDGER, CELLO)]
        standing = ToolCall("membase_save", {"content": "I am allergic to peanuts.", "standing_fact": True})
        agent, model = make_agent(store, [*saves, standing, "I saved them."])
        agent(f"Please remember: {LEDGER} {CELLO} And for good: I am allergic to peanuts.")

        assert model.memory_block(0) is None  # nothing in memory yet
        assert [model.tool_result_text(call) for call in (1, 2)] == ["Saved to Membase."] * 2
        assert model.tool_result_text(3) == "Saved as a standing fact in the user's Membase profile."
    assert llm.count("episode") == 2  # the engine turned each note into an episode

    # A new store and agent on the same memory. Only the best entry is injected: the engine's ranking of the question
    # against both notes decides what the model sees.
    with memory.store() as store:
        script = ["Postgres 16.", ToolCall("membase_profile", {}), "Peanuts."]
        agent, model = make_agent(store, script, injection={"max_entries": 1})
        assert str(agent(QUESTION)).strip() == "Postgres 16."
        assert entries(model.memory_block(0)) == [f"[default] {LEDGER}"]  # attributed to the Memory it came from

        agent("What do you know about me?")
        assert "Standing facts:\n- I am allergic to peanuts." in model.tool_result_text(-1)


def test_captured_words_are_searchable_by_a_later_agent(memory: EngineMemory, llm: StandInLLM):
    with memory.store(capture=True, extraction=True) as store:
        agent, _ = make_agent(store, ["What a lovely companion she must be."])
        agent("My cat is called Pixel and she is nine years old.")  # a synchronous call saves its batch by its end
    assert llm.count("episode") == 1

    with memory.store() as store:
        agent, model = make_agent(store, ["Pixel."])
        agent("What is my cat called?")
        # capture_roles defaults to the user's words only: the model's reply was not saved.
        assert entries(model.memory_block(0)) == ["[default] My cat is called Pixel and she is nine years old."]


def test_recall_and_the_tool_put_the_best_scored_passage_first_and_show_a_shared_fact_once(memory: EngineMemory, llm):
    memory.seed(LEDGER, container="Archive")
    memory.seed(BACKUPS, container="Archive")
    memory.seed(LEDGER, container="Notes")
    with memory.client() as client:
        raw = [(hit["score"], hit["content"]) for hit in client.search(QUESTION, limit=5)["results"]]
    # What makes this mean something: the engine's own order is not best first, and it repeats LEDGER.
    assert [score for score, _ in raw] != sorted([score for score, _ in raw], reverse=True), raw
    assert [text for _, text in raw].count(LEDGER) == 2 and raw[0][1] == BACKUPS, raw

    with memory.store() as store:
        agent, model = make_agent(store, ["Postgres 16.", ToolCall("membase_search", {"query": QUESTION}), "ok"])
        agent(QUESTION)
        assert entries(model.memory_block(0)) == [f"[Notes] [Archive] {LEDGER}", f"[Archive] {BACKUPS}"]
        assert store.counters()["recall_duplicates_merged"] == 1

        agent("look it up")
        assert model.tool_result_text(-1).splitlines() == [
            f'Membase found 2 passages for "{QUESTION}":',
            f"1. [Notes] [Archive] {LEDGER}",
            f"2. [Archive] {BACKUPS}",
        ]
        # Not an async test: the in-process engine refuses calls from a thread that runs an event loop.
        found = asyncio.run(store.search(QUESTION))
        scores = [entry.metadata["score"] for entry in found if entry.metadata]
        assert scores == sorted(scores, reverse=True) and found[0].metadata["memories"] == ["Notes", "Archive"]


def test_a_pinned_memory_name_resolves_against_the_engines_real_memories(memory: EngineMemory, llm: StandInLLM):
    memory.seed("The launch review for the indexer is on Friday.", container="Work Notes")
    memory.seed("The launch party for the garden is on Sunday.", container="Home")
    with memory.client() as client:
        listed = {row["name"]: row["id"] for row in client.containers.list()["containers"]}
    assert listed == {"Work Notes": "work-notes", "Home": "home"}

    # The engine matches a Memory by exact id or name only; the store resolves a name in any case, the tool too.
    with memory.store(container="WORK NOTES") as store:
        agent, model = make_agent(store, [ToolCall("membase_search", {"query": "launch", "container": "HOME"}), "ok"])
        agent("When is the launch?")
        assert entries(model.memory_block(0)) == ["[Work Notes] The launch review for the indexer is on Friday."]
        found = model.tool_result_text(1)
        assert "[Home] The launch party for the garden is on Sunday." in found and "Work Notes" not in found

    with memory.store(container="Hobbies") as store, pytest.raises(ValueError, match=r"Hobbies.*'Home', 'Work Notes'"):
        make_agent(store)  # an unknown name fails when the agent is built, listing the Memories in reach


@one_form
def test_when_the_engines_llm_is_down_the_turn_goes_on_without_memory_and_recall_resumes_after(
    memory: EngineMemory, llm: StandInLLM, caplog: pytest.LogCaptureFixture
):
    # With its LLM endpoint unreachable the engine retries the embedding call (up to minutes) before reporting the
    # Memory as unable to answer: the store's budget protects the turn, and the request finishes in the background.
    caplog.set_level(logging.INFO, logger="membase_strands")
    memory.seed(BICYCLE)
    store = memory.store(recall_timeout=1.0)  # the budget this test is about
    agent, model = make_agent(store, ["I could not check your memory just now."])

    llm.stop()
    try:
        result = agent("What bicycle do I ride?")
        assert store.counters()["recall_late_completions"] == 0  # the budget ended the wait, not an answer
    finally:
        llm.start()

    assert str(result).strip() == "I could not check your memory just now." and model.memory_block(0) is None
    assert store.counters()["recall_timeouts"] == 1
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=120.0)
    assert any("late recall finished" in record.getMessage() for record in caplog.records)

    def recalled() -> bool:  # a turn within the same budget, as many as a loaded machine needs
        model.script.append("You ride a green Brompton.")
        agent("What bicycle do I ride?")
        return BICYCLE in (model.memory_block(-1) or "")

    assert wait_until(recalled, timeout=60.0), "automatic recall did not resume after the LLM came back"


@one_form
def test_a_memory_whose_llm_refuses_is_injected_as_a_framed_notice_not_as_a_fact(memory: EngineMemory, llm):
    # An error the engine does not retry (401 from its provider) comes back at once, as the Memory's `error`.
    memory.seed(BICYCLE)
    with memory.store() as store:
        agent, model = make_agent(store, ["I could not check your memory just now."])
        with llm.failing(401):
            agent("What bicycle do I ride?")

        [notice] = entries(model.memory_block(0))
        assert notice.startswith("[Membase notice] The Memory (default) could not be searched: AuthenticationError")
        assert "its silence is not evidence" in notice


def test_membase_local_names_the_directory_or_with_1_or_true_the_engines_default(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("MEMBASE_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # the engine's default directory is ~/.membase
    named, default = tmp_path / "memory", tmp_path / ".membase"
    for setting, directory in [(str(named), named), ("1", default), ("true", default)]:
        monkeypatch.setenv("MEMBASE_LOCAL", setting)
        with MembaseMemoryStore() as store:  # the SDK's convention, and nothing else given
            assert f"local={str(directory.resolve())!r}" in repr(store), setting
            assert (directory / ".membase-strands.lock").is_file()


@pytest.mark.parametrize("memory", ["in-process"], indirect=True)
def test_a_new_local_directory_is_pinned_by_the_name_of_its_first_memory(memory: EngineMemory, llm: StandInLLM, capsys):
    """Local Membase makes its first Memory, "default" (the name the README shows), at the first save: a store and the
    check can be pinned to it before that."""
    memory.root.mkdir(parents=True)
    assert check.main(["check", "--local", str(memory.root), "--container", "default"]) == 0
    assert "[  ok] container: 'default' is made by the first save to it" in capsys.readouterr().out
    with memory.store(container="default") as store:
        agent, model = make_agent(store, [ToolCall("membase_save", {"content": LEDGER}), "Saved."])
        agent(f"Please remember: {LEDGER}")
        assert model.memory_block(0) is None and model.tool_result_text(1) == "Saved to the Memory 'default'."
    with memory.store(container="default") as store:
        agent, model = make_agent(store, ["Postgres."])
        agent(QUESTION)
        assert entries(model.memory_block()) == [f"[default] {LEDGER}"]

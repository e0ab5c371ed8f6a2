"""The store through a real Strands agent, against the real Membase engine on loopback.

Each store test runs twice: over HTTP (``membase serve``'s server on loopback, the store built with
``api_key``/``base_url``) and in process (``local=DIR``). Stores get budgets a loaded machine cannot run out
of, except where a test is about one. The engine's LLM is the deterministic stand-in, so the engine
really learns (an episode per note) and ranks (hashed bag-of-words embeddings): a store that sent
the wrong query, container or content would fail these tests, not just a mock's bookkeeping.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import membase
import pytest

from membase_strands.testing import StandInLLM, ToolCall
from tests.support.local_engine import EngineMemory, engine_unavailable, offline_env
from tests.support.store_helpers import make_agent, wait_until

_REASON = engine_unavailable()
if _REASON:
    pytest.skip(f"real Membase engine tests skipped: {_REASON}", allow_module_level=True)

pytestmark = pytest.mark.integration

LEDGER = "Our billing ledger runs on Postgres 16 in Frankfurt."
CELLO = "My daughter plays the cello on Tuesdays."
BICYCLE = "My bicycle is a green Brompton folding bike."


def test_a_fact_saved_in_one_session_is_recalled_by_a_new_agent_in_the_next(
    memory: EngineMemory, llm: StandInLLM
) -> None:
    with memory.store() as store:
        agent, model = make_agent(
            store,
            [
                ToolCall("membase_save", {"content": LEDGER}),
                ToolCall("membase_save", {"content": CELLO}),
                "I saved both.",
            ],
        )
        agent(f"Please remember two things: {LEDGER} {CELLO}")

        assert model.memory_block(0) is None  # nothing in memory yet
        assert model.tool_result_text(1) == "Saved to Membase."
        assert model.tool_result_text(2) == "Saved to Membase."
    assert llm.count("episode") == 2  # the engine turned each note into an episode

    # A later session: a new store and a new agent on the same memory. Only the best entry is
    # injected, so the engine's ranking of the question against both notes decides what the model sees.
    with memory.store() as store:
        agent, model = make_agent(store, ["Postgres 16."], injection={"max_entries": 1})
        result = agent("Which database does the billing ledger run on?")

        block = model.memory_block(0)
        assert block is not None, "nothing was recalled before the question"
        assert f"[default] {LEDGER}" in block  # attributed to the Memory it came from
        assert "cello" not in block
        assert str(result).strip() == "Postgres 16."


def test_a_standing_fact_saved_through_the_tool_is_in_the_profile(memory: EngineMemory, llm: StandInLLM) -> None:
    with memory.store() as store:
        agent, model = make_agent(
            store,
            [ToolCall("membase_save", {"content": "I am allergic to peanuts.", "standing_fact": True}), "Noted."],
        )
        agent("Remember for good: I am allergic to peanuts.")
        assert model.tool_result_text(1) == "Saved as a standing fact in the user's Membase profile."

    with memory.store() as store:
        agent, model = make_agent(store, [ToolCall("membase_profile", {}), "You are allergic to peanuts."])
        agent("What do you know about me?")

        profile = model.tool_result_text(1)
        assert "Standing facts:\n- I am allergic to peanuts." in profile
        assert model.tool_results(1)[-1]["status"] == "success"


def test_capture_with_extraction_makes_the_users_words_searchable_by_a_later_agent(
    memory: EngineMemory, llm: StandInLLM
) -> None:
    with memory.store(capture=True, extraction=True) as store:
        agent, model = make_agent(store, ["What a lovely companion she must be."])
        # A synchronous call flushes extraction at its end: the batch is saved before it returns.
        agent("My cat is called Pixel and she is nine years old.")
    assert llm.count("episode") == 1

    with memory.store() as store:
        agent, model = make_agent(store, ["Pixel."], injection={"max_entries": 1})
        agent("What is my cat called?")

        block = model.memory_block(0)
        assert block is not None, "the captured conversation was not recalled"
        assert "[default] My cat is called Pixel and she is nine years old." in block
        assert "lovely companion" not in block  # capture_roles defaults to the user's words only


def test_when_the_engines_llm_is_down_the_turn_goes_on_without_memory_within_the_budget(
    memory: EngineMemory, llm: StandInLLM, caplog: pytest.LogCaptureFixture
) -> None:
    # What the engine really does: with its LLM endpoint unreachable it retries the embedding call
    # (tenacity, 8 attempts, up to minutes) before reporting the Memory as unable to answer. So the
    # store's time box is what protects the turn: recall gives up, the turn goes on without memory,
    # and the request finishes in the background once the endpoint is back.
    caplog.set_level(logging.INFO, logger="membase_strands")
    memory.seed(BICYCLE)
    store = memory.store(recall_timeout=1.0)  # the budget this test is about
    agent, model = make_agent(store, ["I could not check your memory just now."])

    llm.stop()
    try:
        result = agent("What bicycle do I ride?")
        # The turn is over while the engine still retries its LLM: the budget ended the wait, not an answer.
        assert store.counters()["recall_late_completions"] == 0
    finally:
        llm.start()

    assert str(result).strip() == "I could not check your memory just now."
    assert model.memory_block(0) is None
    assert store.counters()["recall_timeouts"] == 1
    assert any("ran out of time" in record.getMessage() for record in caplog.records)

    # The endpoint is back: the late recall finishes in the background and automatic recall resumes.
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=120.0)
    assert any("late recall finished" in record.getMessage() for record in caplog.records)

    def recalled() -> bool:  # a turn within the same budget, as many as a loaded machine needs
        model.script.append("You ride a green Brompton.")
        agent("What bicycle do I ride?")
        return BICYCLE in (model.memory_block(-1) or "")

    assert wait_until(recalled, timeout=60.0), "automatic recall did not resume after the LLM came back"


def test_a_memory_whose_llm_refuses_is_injected_as_a_framed_notice_not_as_a_fact(
    memory: EngineMemory, llm: StandInLLM
) -> None:
    # An error the engine does not retry (401 from its provider) comes back at once, as the
    # container's `error`: the store frames it as a notice naming the Memory and the reason.
    memory.seed(BICYCLE)
    with memory.store() as store:
        agent, model = make_agent(store, ["I could not check your memory just now."])
        with llm.failing(401):
            result = agent("What bicycle do I ride?")

        block = model.memory_block(0)
        assert block is not None, "the Memory that could not answer was dropped silently"
        assert "[Membase notice] The Memory (default) could not be searched: AuthenticationError" in block
        assert "its silence is not evidence" in block
        assert "Brompton" not in block
        assert str(result).strip() == "I could not check your memory just now."


def test_a_pinned_container_name_resolves_against_the_engines_real_containers(
    memory: EngineMemory, llm: StandInLLM
) -> None:
    memory.seed("The launch review for the indexer is on Friday.", container="Work Notes")
    memory.seed("The launch party for the garden is on Sunday.", container="Home")
    with memory.client() as client:
        listed = {row["name"]: row["id"] for row in client.containers.list()["containers"]}
    assert listed == {"Work Notes": "work-notes", "Home": "home"}

    # The engine matches a container by exact id or name only; the store resolves the name in any case.
    with memory.store(container="WORK NOTES") as store:
        agent, model = make_agent(store, [ToolCall("membase_search", {"query": "launch", "container": "HOME"}), "ok"])
        agent("When is the launch?")

        block = model.memory_block(0)
        assert block is not None
        assert "[Work Notes] The launch review for the indexer is on Friday." in block
        assert "garden" not in block and "[Home]" not in block

        found = model.tool_result_text(1)  # the tool resolves a Memory name the model gives, too
        assert "[Home] The launch party for the garden is on Sunday." in found
        assert "Work Notes" not in found

    # Control: unpinned, the same question reaches both Memories.
    with memory.store() as store:
        agent, model = make_agent(store, ["ok"])
        agent("When is the launch?")
        block = model.memory_block(0) or ""
        assert "[Work Notes] The launch review" in block and "[Home] The launch party" in block

    # An unknown name fails when the agent is built, listing the Memories in reach.
    with memory.store(container="Hobbies") as store, pytest.raises(ValueError, match=r"Hobbies.*'Home', 'Work Notes'"):
        make_agent(store)


def test_the_setup_check_fails_for_a_local_memory_that_has_no_llm_to_search_with(
    llm: StandInLLM, tmp_path: Path
) -> None:
    # The most common local set-up mistake: no LLM provider. Every search then reports the Memory as
    # unable to answer ("Embeddings need OPENAI_API_KEY ...") and every save answers 422.
    root = tmp_path / "membase"
    with membase.Membase(local=str(root)) as client:  # learned while the stand-in was there
        client.memories.add(BICYCLE)
    done = subprocess.run(
        [sys.executable, "-m", "membase_strands", "check", "--local", str(root)],
        env=offline_env(),  # no LLM key, no MEMBASE_LLM_* variables
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Membase setup check for local Membase" in done.stdout, done.stderr  # the check itself ran
    assert done.returncode == 1, done.stdout
    assert "Embeddings need OPENAI_API_KEY" in done.stdout, done.stdout  # with the engine's own reason

"""Order and duplicate folding against the real Membase engine, over HTTP and in process.

The engine scores each Memory's passages on its own (reciprocal-rank fusion within the Memory) and
interleaves Memories by rank, not by score: every Memory's best before any second best. So for the
question below it lists a weaker backups passage ahead of the ledger passage the question is about,
and the ledger fact, saved in two Memories, comes back twice.

The engine applies the search ``limit`` itself, after interleaving, so the store can only order what
it is sent; that the best passages survive the store's own cuts (notices, the recall budget, a
Membase that sends more than asked) is shown over the fake in ``tests/test_recall_quality.py``.
"""

from __future__ import annotations

import asyncio
import html
import re

import pytest

from membase_strands.testing import StandInLLM, ToolCall
from tests.support.local_engine import EngineMemory, engine_unavailable
from tests.support.store_helpers import make_agent

_REASON = engine_unavailable()
if _REASON:
    pytest.skip(f"real Membase engine tests skipped: {_REASON}", allow_module_level=True)

pytestmark = pytest.mark.integration

QUESTION = "Which database does the billing ledger run on?"
LEDGER = "Our billing ledger runs on Postgres 16 in Frankfurt."
BACKUPS = "Ledger backups run nightly at two in the morning."


def seed(memory: EngineMemory) -> None:
    memory.seed(LEDGER, container="Archive")
    memory.seed(BACKUPS, container="Archive")
    memory.seed(LEDGER, container="Notes")


def engine_answer(memory: EngineMemory) -> list[tuple[float, str, str]]:
    """What the engine itself answers: (score, Memory, text) in its order."""
    with memory.client() as client:
        body = client.search(QUESTION, limit=5)
    return [(hit["score"], hit["container_name"], hit["content"]) for hit in body["results"]]


def entries(block: str | None) -> list[str]:
    assert block is not None, "nothing was recalled"
    return [html.unescape(e) for e in re.findall(r"<entry[^>]*>(.*?)</entry>", block, flags=re.DOTALL)]


def test_recall_puts_the_best_scored_passage_first_and_shows_a_shared_fact_once(
    memory: EngineMemory, llm: StandInLLM
) -> None:
    seed(memory)
    raw = engine_answer(memory)
    # What makes this test mean something: the engine's own order is not best first, and it repeats LEDGER.
    scores = [score for score, _, _ in raw]
    assert scores != sorted(scores, reverse=True), f"the engine answered best first already: {raw}"
    assert [text for _, _, text in raw].count(LEDGER) == 2, raw
    assert raw[0][2] == BACKUPS, raw

    with memory.store() as store:
        agent, model = make_agent(store, ["Postgres 16."])
        agent(QUESTION)

        assert entries(model.memory_block(0)) == [f"[Notes] [Archive] {LEDGER}", f"[Archive] {BACKUPS}"]
        assert store.counters()["recall_passages_folded"] == 1


def test_recalled_entries_come_best_first_by_the_engines_scores(memory: EngineMemory, llm: StandInLLM) -> None:
    seed(memory)

    with memory.store() as store:
        # Not an async test: the in-process engine refuses calls from a thread that runs an event loop.
        found = asyncio.run(store.search(QUESTION))

    scores = [entry.metadata["score"] for entry in found if entry.metadata]
    assert scores == sorted(scores, reverse=True)
    assert found[0].metadata is not None and found[0].metadata["memories"] == ["Notes", "Archive"]


def test_the_search_tool_lists_best_first_and_a_shared_fact_once(memory: EngineMemory, llm: StandInLLM) -> None:
    seed(memory)

    with memory.store() as store:
        agent, model = make_agent(store, [ToolCall("membase_search", {"query": QUESTION}), "ok"], injection=False)
        agent("look it up")

        assert model.tool_result_text(1).splitlines() == [
            f'Membase found 2 passages for "{QUESTION}":',
            f"1. [Notes] [Archive] {LEDGER}",
            f"2. [Archive] {BACKUPS}",
        ]

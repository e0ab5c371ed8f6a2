"""Recall that earns its tokens: passages best first, each text once, a relevance floor, and the set-up
check's score range.

Seen where the model reads them (the ``<memory>`` block and the ``membase_search`` tool result), through
a real Agent and the real Membase client over the fake Membase.
"""

from __future__ import annotations

import html
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from membase_strands import MembaseMemoryStore, check
from membase_strands.testing import API_KEY, InMemoryMembase, ScriptedModel, ToolCall
from tests.support.store_helpers import make_agent

QUESTION = "Which database runs the billing ledger?"
MEMORIES = [
    {"id": "ctr_work", "name": "Work"},
    {"id": "ctr_home", "name": "Home"},
    {"id": "ctr_garden", "name": "Garden"},
]
NAMES = {row["id"]: row["name"] for row in MEMORIES}


def hit(content: str, container: str, score: Any = None, **fields: Any) -> dict[str, Any]:
    row = {"content": content, "container": container, "container_name": NAMES[container], **fields}
    if score is not None:
        row["score"] = score
    return row


def answer_with(fake: InMemoryMembase, *hits: dict[str, Any]) -> None:
    """Answer every search with ``hits``, in this order, as Membase would send them."""
    body = json.dumps({"results": list(hits), "containers": MEMORIES})  # json.dumps: a NaN score goes through too
    fake.containers = MEMORIES
    fake.always(
        "POST",
        "/v1/search",
        lambda request: httpx.Response(200, content=body, headers={"content-type": "application/json"}),
    )


def entries(block: str | None) -> list[str]:
    """The text of each ``<entry>`` in a ``<memory>`` block, unescaped."""
    assert block is not None, "nothing was injected"
    return [html.unescape(e) for e in re.findall(r"<entry[^>]*>(.*?)</entry>", block, flags=re.DOTALL)]


def recall(store: MembaseMemoryStore, **manager_options: Any) -> tuple[list[str], ScriptedModel]:
    """One user turn through a real Agent; the entries the model was shown."""
    agent, model = make_agent(store, ["ok"], **manager_options)
    agent(QUESTION)
    return entries(model.memory_block()), model


def search_tool(store: MembaseMemoryStore, **arguments: Any) -> tuple[str, str]:
    """One turn in which the model calls ``membase_search``; the tool result's text and status."""
    agent, model = make_agent(
        store, [ToolCall("membase_search", {"query": QUESTION, **arguments}), "done"], injection=False
    )
    agent("look it up")
    return model.tool_result_text(), model.tool_results()[-1]["status"]


# The local engine interleaves Memories by rank, not score: every Memory's best before any second best.
LEDGER = "The billing ledger runs on Postgres 16 in Frankfurt."
BACKUPS = "Ledger backups run nightly at 02:00."
CELLO = "My daughter plays the cello on Tuesdays."
PARTY = "The garden party is on Sunday."
INTERLEAVED = [
    hit(PARTY, "ctr_garden", 0.016),
    hit(LEDGER, "ctr_work", 0.033),
    hit(CELLO, "ctr_home", 0.017),
    hit(BACKUPS, "ctr_work", 0.030),
]


# --- Order -----------------------------------------------------------------------------------


def test_recall_shows_passages_best_first_across_memories(fake, make_store):
    answer_with(fake, *INTERLEAVED)

    shown, _ = recall(make_store())

    assert shown == [f"[Work] {LEDGER}", f"[Work] {BACKUPS}", f"[Home] {CELLO}", f"[Garden] {PARTY}"]


def test_the_best_passages_survive_the_entry_limit(fake, make_store):
    # A Membase that answers more than was asked (the hosted fan-out answers per Memory): the limit
    # keeps the best three, not the first three.
    answer_with(fake, *INTERLEAVED, hit("A weak fourth-Memory passage.", "ctr_garden", 0.001))

    shown, _ = recall(make_store(), injection={"max_entries": 3})

    assert shown == [f"[Work] {LEDGER}", f"[Work] {BACKUPS}", f"[Home] {CELLO}"]


def test_the_best_passages_survive_the_recall_budget(fake, make_store):
    long_weak = "A long and weak passage about gardening. " * 6  # 246 characters: first in Membase's order
    answer_with(fake, hit(long_weak, "ctr_garden", 0.01), hit(LEDGER, "ctr_work", 0.03), hit(CELLO, "ctr_home", 0.02))

    shown, _ = recall(make_store(max_recall_chars=200))

    assert shown == [f"[Work] {LEDGER}", f"[Home] {CELLO}"]


def test_ties_keep_membases_order(fake, make_store):
    answer_with(fake, hit(PARTY, "ctr_garden", 0.5), hit(LEDGER, "ctr_work", 0.5), hit(CELLO, "ctr_home", 0.5))

    shown, _ = recall(make_store())

    assert shown == [f"[Garden] {PARTY}", f"[Work] {LEDGER}", f"[Home] {CELLO}"]


@pytest.mark.parametrize("missing", [None, "high", float("nan"), True], ids=["absent", "text", "nan", "bool"])
def test_when_a_score_is_missing_membases_order_stands(fake, make_store, missing):
    answer_with(fake, hit(PARTY, "ctr_garden", 0.1), hit(LEDGER, "ctr_work", missing), hit(CELLO, "ctr_home", 0.9))

    shown, _ = recall(make_store())

    assert shown == [f"[Garden] {PARTY}", f"[Work] {LEDGER}", f"[Home] {CELLO}"]


def test_the_search_tool_lists_passages_best_first(fake, make_store):
    answer_with(fake, *INTERLEAVED)

    text, status = search_tool(make_store())

    assert status == "success"
    assert text.splitlines()[1:] == [
        f"1. [Work] {LEDGER}",
        f"2. [Work] {BACKUPS}",
        f"3. [Home] {CELLO}",
        f"4. [Garden] {PARTY}",
    ]


# --- Duplicates ------------------------------------------------------------------------------


def test_a_passage_in_two_memories_is_shown_once_naming_both(fake, make_store):
    answer_with(
        fake,
        hit(LEDGER, "ctr_work", 0.03),
        hit("  The billing ledger runs on\nPostgres 16   in Frankfurt. ", "ctr_home", 0.02),  # same words, spaced
        hit(CELLO, "ctr_home", 0.01),
    )
    store = make_store()

    shown, _ = recall(store)

    assert shown == [f"[Work] [Home] {LEDGER}", f"[Home] {CELLO}"]
    assert store.counters()["recall_passages_folded"] == 1


async def test_a_folded_entry_lists_every_memory_in_its_metadata(fake, make_store):
    answer_with(fake, hit(LEDGER, "ctr_home", 0.02), hit(LEDGER, "ctr_work", 0.03))

    [entry] = await make_store().search(QUESTION)

    assert entry.content == f"[Work] [Home] {LEDGER}"  # the Memory where it scored best comes first
    assert entry.metadata is not None
    assert entry.metadata["memory"] == "Work" and entry.metadata["memories"] == ["Work", "Home"]
    assert entry.metadata["score"] == 0.03 and entry.metadata["container"] == "ctr_work"


def test_the_same_passage_twice_in_one_memory_is_shown_once(fake, make_store):
    answer_with(fake, hit(LEDGER, "ctr_work", 0.03), hit(LEDGER, "ctr_work", 0.02), hit(CELLO, "ctr_home", 0.01))

    shown, _ = recall(make_store())

    assert shown == [f"[Work] {LEDGER}", f"[Home] {CELLO}"]


def test_a_duplicate_counts_once_against_the_entry_limit(fake, make_store):
    answer_with(
        fake,
        hit(LEDGER, "ctr_work", 0.04),
        hit(LEDGER, "ctr_home", 0.035),
        hit(BACKUPS, "ctr_work", 0.03),
        hit(CELLO, "ctr_home", 0.02),
    )

    shown, _ = recall(make_store(), injection={"max_entries": 3})

    assert shown == [f"[Work] [Home] {LEDGER}", f"[Work] {BACKUPS}", f"[Home] {CELLO}"]


def test_a_duplicate_counts_once_against_the_recall_budget(fake, make_store):
    ledger = LEDGER + " It was chosen in March after the load tests."  # 97 characters
    backups = BACKUPS + " They are kept for thirty days, offsite in Oslo."  # 84 characters
    answer_with(fake, hit(ledger, "ctr_work", 0.04), hit(ledger, "ctr_home", 0.035), hit(backups, "ctr_work", 0.03))
    folded = [f"[Work] [Home] {ledger}", f"[Work] {backups}"]
    cap = sum(len(text) for text in folded)
    # Counted twice, the ledger passage would leave no room for the backups passage.
    assert len(f"[Work] {ledger}") + len(f"[Home] {ledger}") + len(f"[Work] {backups}") > cap >= 200

    shown, _ = recall(make_store(max_recall_chars=cap))

    assert shown == folded


def test_a_folded_passage_longer_than_the_budget_is_cut_with_both_labels_inside_it(fake, make_store):
    long = "The billing ledger history, in detail: " + "one more line of history. " * 20
    answer_with(fake, hit(long, "ctr_work", 0.04), hit(long, "ctr_home", 0.03))

    shown, _ = recall(make_store(max_recall_chars=200))

    [only] = shown
    assert only.startswith("[Work] [Home] The billing ledger history")
    assert only.endswith("[... cut: this passage is longer than the recall budget]")
    assert len(only) <= 200


def test_folding_and_the_floor_are_logged_at_debug(fake, make_store, caplog):
    caplog.set_level(logging.DEBUG, logger="membase_strands")
    answer_with(fake, hit(LEDGER, "ctr_work", 0.04), hit(LEDGER, "ctr_home", 0.03), hit(PARTY, "ctr_garden", 0.01))

    recall(make_store(min_score=0.02))

    assert "store=<membase>, folded=<1>, below_floor=<1> | passages left out of recall" in caplog.messages


def test_the_search_tool_shows_a_duplicate_once_naming_both(fake, make_store):
    answer_with(fake, hit(LEDGER, "ctr_work", 0.03), hit(CELLO, "ctr_home", 0.02), hit(LEDGER, "ctr_home", 0.01))

    text, _ = search_tool(make_store())

    assert text.splitlines() == [
        f'Membase found 2 passages for "{QUESTION}":',
        f"1. [Work] [Home] {LEDGER}",
        f"2. [Home] {CELLO}",
    ]


# --- The relevance floor ---------------------------------------------------------------------


def test_the_floor_keeps_weak_passages_out_of_recall(fake, make_store):
    answer_with(fake, *INTERLEAVED)
    store = make_store(min_score=0.025)

    shown, _ = recall(store)

    assert shown == [f"[Work] {LEDGER}", f"[Work] {BACKUPS}"]
    assert store.counters()["recall_passages_below_floor"] == 2


def test_a_passage_exactly_at_the_floor_is_kept(fake, make_store):
    answer_with(fake, *INTERLEAVED)

    shown, _ = recall(make_store(min_score=0.030))

    assert shown == [f"[Work] {LEDGER}", f"[Work] {BACKUPS}"]


def test_a_passage_without_a_score_is_not_held_against_the_floor(fake, make_store):
    answer_with(fake, hit(LEDGER, "ctr_work"), hit(PARTY, "ctr_garden", 0.001))

    shown, _ = recall(make_store(min_score=0.5))

    assert shown == [f"[Work] {LEDGER}"]


def test_when_every_passage_is_below_the_floor_nothing_is_injected(fake, make_store):
    answer_with(fake, *INTERLEAVED)
    store = make_store(min_score=0.9)

    agent, model = make_agent(store, ["ok"])
    agent(QUESTION)

    assert model.memory_block() is None
    counts = store.counters()
    assert counts["recall_empty"] == 1 and counts["recall_hits"] == 0
    assert counts["recall_passages_below_floor"] == 4


def test_a_memory_that_could_not_answer_is_still_reported_under_a_floor(fake, make_store):
    body = {
        "results": [hit(PARTY, "ctr_garden", 0.001)],
        "containers": [*MEMORIES[1:], {**MEMORIES[0], "error": "the memory is waking up"}],
    }
    fake.containers = MEMORIES
    fake.always("POST", "/v1/search", lambda request: httpx.Response(200, json=body))

    shown, _ = recall(make_store(min_score=0.5))

    assert len(shown) == 1
    assert shown[0].startswith("[Membase notice] The Memory (Work) could not be searched: the memory is waking up")


def test_the_search_tool_says_how_many_passages_were_below_the_floor(fake, make_store):
    answer_with(fake, *INTERLEAVED)

    text, status = search_tool(make_store(min_score=0.025))

    assert status == "success"
    assert text == "\n".join(
        [
            f'Membase found 2 passages for "{QUESTION}":',
            f"1. [Work] {LEDGER}",
            f"2. [Work] {BACKUPS}",
            "",
            "(2 weaker passages scored below the relevance floor (min_score=0.025) and are not shown.)",
        ]
    )


def test_the_search_tool_with_everything_below_the_floor_does_not_claim_nothing_matched(fake, make_store):
    answer_with(fake, hit(PARTY, "ctr_garden", 0.016))

    text, status = search_tool(make_store(min_score=0.5))

    assert status == "success"
    assert text == (
        f'Nothing matched "{QUESTION}" above the relevance floor: 1 weaker passage scored below the relevance '
        "floor (min_score=0.5) and is not shown."
    )
    assert "Nothing in Membase matched" not in text


def test_without_a_floor_the_search_tool_mentions_none(fake, make_store):
    answer_with(fake, *INTERLEAVED)

    text, _ = search_tool(make_store())

    assert "floor" not in text
    assert len(text.splitlines()) == 5


@pytest.mark.parametrize("value", [0, -1, 0.5, 3, -0.25])
def test_min_score_accepts_any_finite_number(value, make_store):
    make_store(min_score=value)


@pytest.mark.parametrize("value", [True, False, "0.5", float("nan"), float("inf"), float("-inf"), [0.5], {}])
def test_min_score_must_be_a_finite_number(value, fake):
    with pytest.raises(ValueError, match="min_score"):
        fake.store(min_score=value)


# --- The set-up check reports the scores it saw ------------------------------------------------


def test_the_check_reports_the_score_range_of_its_probe_searches(fake):
    answer_with(fake, *INTERLEAVED)

    report = check.run_check(api_key=API_KEY, base_url=fake.base_url)

    assert report.ok
    assert report.scores == [0.033, 0.030, 0.017, 0.016]
    assert report.score_range == (0.016, 0.033)
    assert 'passage scores for "membase-strands setup check": 0.016 to 0.033 (4 passages)' in report.to_text()
    assert "min_score" in report.to_text()
    assert report.to_dict()["score_range"] == (0.016, 0.033)
    searches = fake.sent("POST", "/v1/search")
    assert [request.body["limit"] for request in searches] == [check.PROBE_LIMIT] * 2


def test_the_check_says_when_no_passage_carried_a_score(fake):
    report = check.run_check(api_key=API_KEY, base_url=fake.base_url)  # an empty memory: nothing matches

    assert report.ok
    assert report.score_range is None
    assert 'passage scores for "membase-strands setup check": none' in report.to_text()
    assert "--query" in report.to_text()


@pytest.fixture
def cli_fake(fake: InMemoryMembase, monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemoryMembase]:
    """``python -m membase_strands check`` with ``MEMBASE_API_KEY`` and ``MEMBASE_BASE_URL`` naming the fake."""
    monkeypatch.delenv("MEMBASE_LOCAL", raising=False)
    monkeypatch.setenv("MEMBASE_API_KEY", API_KEY)
    monkeypatch.setenv("MEMBASE_BASE_URL", fake.base_url)
    yield fake


def test_the_check_cli_asks_the_query_given_and_prints_its_scores(cli_fake, capsys):
    cli_fake.remember(LEDGER)
    cli_fake.remember(CELLO)

    code = check.main(["check", "--query", "billing ledger Postgres", "--json"])

    out = capsys.readouterr().out
    data = json.loads(out)
    assert code == 0
    assert [request.body["q"] for request in cli_fake.sent("POST", "/v1/search")] == ["billing ledger Postgres"] * 2
    assert data["probe_query"] == "billing ledger Postgres"
    assert data["scores"] == [3.0] and data["score_range"] == [3.0, 3.0]
    assert API_KEY not in out

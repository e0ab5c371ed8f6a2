"""The recall size budget (``max_recall_chars``), seen where the model reads it: the ``<memory>`` block and
the ``membase_search`` tool result, through a real Agent over the fake Membase."""

from __future__ import annotations

import html
import re

import pytest

from membase_strands import MembaseMemoryStore
from membase_strands.testing import InMemoryMembase, ScriptedModel, ToolCall
from tests.support.store_helpers import make_agent

QUERY = "alpha bravo charlie delta?"
CAP = 300
LABEL = len("[Main] ")
CUT = "[... cut:"


def passage(head: str, size: int) -> str:
    """A passage of exactly ``size`` characters that starts with ``head`` (its query words and a tag)."""
    filler = " lorem ipsum dolor sit amet" * (size // 10 + 1)
    return (head + filler)[: size - 1] + "."


# The fake ranks passages by how many query words they share, so these arrive in this order.
BEST = passage("alpha bravo charlie delta: first-best", 150)  # 157 with its label: fits
SECOND = passage("alpha bravo charlie: second-too-long", 200)  # 157 + 207 > 300: skipped
THIRD = passage("alpha bravo: third-small", 40)  # 157 + 47 = 204: still fits after the skip
FOURTH = passage("alpha: fourth-too-long", 150)  # 204 + 157 > 300: skipped


def entries(block: str | None) -> list[str]:
    """The text of each ``<entry>`` in a ``<memory>`` block, unescaped."""
    assert block is not None, "nothing was injected"
    return [html.unescape(e) for e in re.findall(r"<entry[^>]*>(.*?)</entry>", block, flags=re.DOTALL)]


def recall(store: MembaseMemoryStore) -> tuple[list[str], ScriptedModel]:
    """One user turn through a real Agent; the entries the model was shown."""
    agent, model = make_agent(store, ["ok"])
    agent(QUERY)
    return entries(model.memory_block()), model


def search_tool_text(store: MembaseMemoryStore) -> str:
    """One turn in which the model calls ``membase_search``; the tool result it read."""
    agent, model = make_agent(store, [ToolCall("membase_search", {"query": QUERY}), "done"], injection=False)
    agent("look it up")
    return model.tool_result_text()


def seed(fake: InMemoryMembase, *notes: str) -> None:
    for note in notes:
        fake.remember(note)


# --- The <memory> block -------------------------------------------------------------------------


def test_whole_passages_best_first_and_a_smaller_later_one_still_fits(fake, make_store):
    seed(fake, BEST, SECOND, THIRD, FOURTH)

    shown, _ = recall(make_store(max_recall_chars=CAP))

    assert shown == [f"[Main] {BEST}", f"[Main] {THIRD}"]
    assert sum(len(text) for text in shown) <= CAP
    assert all(CUT not in text for text in shown)


def test_without_a_cap_every_passage_is_shown_whole(fake, make_store):
    seed(fake, BEST, SECOND, THIRD, FOURTH)

    shown, _ = recall(make_store(max_recall_chars=None))

    assert shown == [f"[Main] {text}" for text in (BEST, SECOND, THIRD, FOURTH)]


def test_a_best_passage_larger_than_the_cap_is_cut_with_a_visible_marker(fake, make_store):
    huge = passage("alpha bravo charlie delta: huge-best", 1000)
    seed(fake, huge, THIRD)

    shown, model = recall(make_store(max_recall_chars=CAP))

    assert len(shown) == 1
    (text,) = shown
    assert text.startswith("[Main] alpha bravo charlie delta: huge-best")
    assert CUT in text
    assert len(text) <= CAP
    assert huge not in model.sent_text()


def test_the_cap_counts_the_memory_label_and_a_passage_that_fits_exactly_is_whole(fake, make_store):
    exact = passage("alpha bravo charlie delta: exact", CAP - LABEL)
    seed(fake, exact)

    shown, _ = recall(make_store(max_recall_chars=CAP))

    assert shown == [f"[Main] {exact}"]
    assert len(shown[0]) == CAP


def test_one_character_over_the_cap_is_cut(fake, make_store):
    over = passage("alpha bravo charlie delta: over", CAP - LABEL + 1)
    seed(fake, over)

    shown, _ = recall(make_store(max_recall_chars=CAP))

    assert len(shown) == 1 and CUT in shown[0] and len(shown[0]) <= CAP


def test_memories_that_could_not_answer_are_still_reported_when_the_budget_is_full(fake, make_store):
    fake.containers = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_notes", "name": "Notes"}]
    fake.unsearchable = {"ctr_notes": "the memory is asleep"}
    seed(fake, passage("alpha bravo charlie delta: fills-the-budget", 1000))

    shown, _ = recall(make_store(max_recall_chars=CAP))

    assert CUT in shown[0]
    notices = [t for t in shown if t.startswith("[Membase notice]")]
    assert len(notices) == 1
    assert "The Memory (Notes) could not be searched: the memory is asleep" in notices[0]


def test_a_notice_survives_a_full_page_of_passages(fake, make_store):
    fake.containers = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_notes", "name": "Notes"}]
    fake.unsearchable = {"ctr_notes": "the memory is asleep"}
    seed(fake, *(f"alpha bravo charlie delta: short note {n}" for n in range(6)))

    shown, _ = recall(make_store())  # the manager asks for 5 entries; Membase returns 5 passages

    assert len(shown) == 5  # the weakest passage gave way to the notice
    assert shown[:4] == [f"[Main] alpha bravo charlie delta: short note {n}" for n in range(4)]
    assert "The Memory (Notes) could not be searched: the memory is asleep" in shown[4]


def test_the_default_cap_keeps_a_10_mb_passage_from_flooding_the_prompt(fake, make_store):
    flood = "alpha bravo charlie delta: flood " + "z" * 10_000_000
    seed(fake, flood)

    shown, model = recall(make_store(recall_timeout=30.0))  # the default max_recall_chars

    assert len(shown) == 1 and CUT in shown[0]
    assert len(shown[0]) <= 20_000
    assert len(model.sent_text()) < 21_000


def test_the_default_cap_keeps_a_long_passage_under_20000_chars_whole(fake, make_store):
    long_one = passage("alpha bravo charlie delta: long", 19_000)
    seed(fake, long_one)

    shown, _ = recall(make_store(recall_timeout=30.0))

    assert shown == [f"[Main] {long_one}"]


def test_the_injected_block_is_for_that_one_model_call_only(fake, make_store):
    seed(fake, BEST)
    store = make_store(max_recall_chars=CAP)
    agent, model = make_agent(store, ["ok"])

    agent(QUERY)

    assert BEST in (model.memory_block() or "")
    history = "\n".join(block.get("text", "") for message in agent.messages for block in message["content"])
    assert "<memory>" not in history


# --- Validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 199, -1, True, False, "x", "300", 250.0, 1.5])
def test_an_invalid_cap_is_refused_naming_the_option(fake, value):
    with pytest.raises(ValueError, match="max_recall_chars"):
        MembaseMemoryStore(client=fake.client(), max_recall_chars=value)


@pytest.mark.parametrize("value", [200, 300, 20_000, 10**9, None])
def test_valid_caps_are_accepted(fake, value):
    with MembaseMemoryStore(client=fake.client(), max_recall_chars=value):
        pass


# --- The membase_search tool --------------------------------------------------------------------


def test_the_search_tool_respects_the_same_cap(fake, make_store):
    seed(fake, BEST, SECOND, THIRD, FOURTH)

    text = search_tool_text(make_store(max_recall_chars=CAP))

    assert f"1. [Main] {BEST}" in text
    assert f"2. [Main] {THIRD}" in text
    assert "second-too-long" not in text and "fourth-too-long" not in text
    assert "Membase found 2 passages" in text


def test_the_search_tool_cuts_an_oversized_best_passage_with_the_marker(fake, make_store):
    huge = passage("alpha bravo charlie delta: huge-best", 5000)
    seed(fake, huge)

    text = search_tool_text(make_store(max_recall_chars=CAP))

    assert "1. [Main] alpha bravo charlie delta: huge-best" in text
    assert CUT in text
    assert len(text) < CAP + 200  # the cap plus the tool's own header line


def test_the_search_tool_still_lists_memories_that_could_not_answer(fake, make_store):
    fake.containers = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_notes", "name": "Notes"}]
    fake.unsearchable = {"ctr_notes": "the memory is asleep"}
    seed(fake, passage("alpha bravo charlie delta: fills-the-budget", 1000))

    text = search_tool_text(make_store(max_recall_chars=CAP))

    assert CUT in text
    assert "Not searched" in text and "- Notes: the memory is asleep" in text


def test_the_search_tool_under_the_default_cap_is_not_flooded_by_10_mb(fake, make_store):
    seed(fake, "alpha bravo charlie delta: flood " + "z" * 10_000_000)

    text = search_tool_text(make_store())

    assert CUT in text
    assert len(text) < 21_000


def test_the_search_tool_without_a_cap_returns_every_passage_whole(fake, make_store):
    seed(fake, BEST, SECOND, THIRD, FOURTH)

    text = search_tool_text(make_store(max_recall_chars=None))

    for number, body in enumerate((BEST, SECOND, THIRD, FOURTH), start=1):
        assert f"{number}. [Main] {body}" in text

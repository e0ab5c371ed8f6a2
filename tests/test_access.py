"""Membase as its documentation says it behaves (docs/access.md): key levels, reach, the profile tick, a revoked key,
queued notes, confirmations without content, 429 without Retry-After, Membase's size cap and the key's hint.

Driven through a real ``strands.Agent`` and ``MemoryManager`` (synchronous calls, which flush captured writes every
turn) over the testing kit's ``InMemoryMembase`` answering as the hosted docs word it: ``level=``, ``profile=``,
``hosted=True``, ``sources``, ``revoked`` and the ``rate_limited`` responder.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import tracemalloc
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from strands import Agent
from strands.memory import MemoryManager
from strands.session import FileSessionManager

from membase_strands import MembaseAccessError, MembaseMemoryStore
from membase_strands.testing import InMemoryMembase, ScriptedModel, ToolCall, rate_limited, status
from tests.support.agents import ALL_TOOLS, entries, resume, tool_texts, tool_turn
from tests.support.leaks import span_texts
from tests.support.store_helpers import FACT, LONG, MEMORIES, QUESTION, make_agent, user

MiB = 1024 * 1024
SAVE = ToolCall("membase_save", {"content": "I like green tea."})
KEY = "mbk_7f3a92d1_9c1e5b0a44d2f7e8b61c3a90d5e2f4b7"  # a developer key: mbk_<key id>_<token>
HINT, TOKEN = "mbk_7f3a92d1…", KEY.rsplit("_", 1)[1]


def warnings_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every WARNING or worse, from every logger."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


def turns(store: MembaseMemoryStore, count: int) -> ScriptedModel:
    """``count`` synchronous turns of one agent over ``store``; its model."""
    agent, model = make_agent(store, ["ok"] * count)
    for turn in range(count):
        agent(f"{QUESTION} ({turn})")
    return model


# --- Key levels --------------------------------------------------------------------------------------------------


def test_a_read_key_that_captures_sends_one_refused_save_in_five_turns_and_recalls_every_turn(caplog):
    caplog.set_level(logging.DEBUG)
    fake = InMemoryMembase(level="read", hosted=True)
    fake.remember(FACT)
    store = fake.store(capture=True, extraction=True, recall_timeout=LONG, write_timeout=LONG)

    model = turns(store, 5)

    assert len(fake.sent(*MEMORIES)) == 1  # one save reached Membase, refused; none after it
    warned = warnings_in(caplog)
    assert len(warned) <= 3, warned
    [ours] = [line for line in warned if line.startswith("membase_strands")]  # one of the store's own
    assert "Read & write" in ours and "capture=False" in ours and "narrowed or revoked" not in ours
    assert all(FACT in (model.memory_block(turn) or "") for turn in range(5))  # recall goes on untouched
    # The words of the later turns are said not saved, at DEBUG, and counted; the first batch is among them.
    not_saved = [r for r in caplog.records if "its words are not saved" in r.getMessage()]
    assert not_saved and all(r.levelno == logging.DEBUG for r in not_saved)
    counts = store.counters()
    assert (counts["writes_refused"], counts["writes_saved"], counts["errors.access"]) == (5, 0, 1)
    store.close()


def test_a_refused_level_is_tried_again_after_the_cooldown_so_a_raised_level_saves():
    fake = InMemoryMembase(level="read")
    store = fake.store(capture=True, access_cooldown=0.2, write_timeout=LONG)
    with pytest.raises(MembaseAccessError) as refused:
        asyncio.run(store.add("I like green tea."))
    assert refused.value.refusal == "level" and "Read & write" in str(refused.value)
    fake.level = "read_write"  # the owner raises the key's level: the same key, no new one

    deadline = time.monotonic() + LONG
    while time.monotonic() < deadline:  # each try while saving is off sends nothing
        try:
            asyncio.run(store.add("I like green tea."))
            break
        except MembaseAccessError:
            time.sleep(0.01)

    assert fake.saved() == ["I like green tea."] and len(fake.sent(*MEMORIES)) == 2
    store.close()


def test_the_tools_of_a_read_key_say_which_level_they_need_and_send_nothing_once_refused(caplog):
    caplog.set_level(logging.INFO)
    fake = InMemoryMembase(level="read")
    note = fake.remember("The launch is in May.")
    forget = ToolCall("membase_forget", {"memory_id": note})
    with fake.store(tools=ALL_TOOLS) as store:
        model = tool_turn(store, SAVE, SAVE, forget, forget, ToolCall("membase_search", {"query": "launch"}))

    said = tool_texts(model)
    assert [outcome for outcome, _ in said] == ["error"] * 4 + ["success"]
    assert said[0] == said[1] and "may not save notes" in said[0][1] and "Read & write" in said[0][1]
    assert said[2] == said[3] and "may not forget" in said[2][1] and "Full access" in said[2][1]
    assert "narrowed or revoked" not in " ".join(text for _, text in said)
    assert len(fake.sent(*MEMORIES)) == len(fake.sent("DELETE")) == 1  # the second of each sent nothing
    assert "The launch is in May." in said[4][1]  # reading goes on
    assert len([line for line in warnings_in(caplog) if line.startswith("membase_strands")]) == 2  # one a verb


def test_a_profile_the_owner_did_not_allow_is_asked_once_in_four_turns_while_recall_goes_on(caplog):
    caplog.set_level(logging.INFO)
    fake = InMemoryMembase(profile=False, hosted=True)
    fake.remember(FACT)
    fake.standing.append("Prefers answers in French.")
    store = fake.store(recall_profile=True, recall_timeout=LONG)

    model = turns(store, 4)

    assert len(fake.sent("GET", "/v1/profile")) == 1
    assert all(entries(model.memory_block(turn)) == [f"[Main] {FACT}"] for turn in range(4))
    [said] = [line for line in warnings_in(caplog) if line.startswith("membase_strands")]
    assert "did not allow" in said and "recall_profile" in said
    [(outcome, text)] = tool_texts(tool_turn(store, ToolCall("membase_profile")))
    assert outcome == "error" and "owner did not allow it" in text
    assert len(fake.sent("GET", "/v1/profile")) == 1  # the tool sent nothing either
    store.close()


# --- Reach and a revoked key ---------------------------------------------------------------------------------------


def test_a_memory_outside_the_keys_reach_is_named_and_the_others_still_work():
    fake = InMemoryMembase()
    fake.add_memory("Work", "ctr_work")
    fake.remember(FACT)
    outside = status(403, "unauthorized: may not use that container")
    with fake.store(container="Work") as store:
        assert asyncio.run(store.search(QUESTION)) == []  # the id of Work is cached
        fake.on("POST", "/v1/search", outside)  # Membase refuses Work, though it still lists it

        with pytest.raises(MembaseAccessError) as refused:
            asyncio.run(store.search(QUESTION))
        assert refused.value.refusal == "reach"
        assert "'Work'" in str(refused.value) and "outside this Membase key's reach" in str(refused.value)
        assert len(fake.sent("GET", "/v1/containers")) == 2  # the cached id was looked up once more, no more
        model = tool_turn(store, ToolCall("membase_search", {"query": "ledger", "container": "Main"}))
    assert tool_texts(model) == [("success", f'Membase found 1 passage for "ledger":\n1. [Main] {FACT}')]


def test_a_revoked_key_pauses_recall_for_the_cooldown_and_says_so_in_the_words_users_match():
    fake = InMemoryMembase()
    fake.remember(FACT)
    fake.revoked = True
    with fake.store(access_cooldown=600.0) as store:
        with pytest.raises(MembaseAccessError, match="this Membase key was narrowed or revoked") as refused:
            asyncio.run(store.search(QUESTION))
        assert refused.value.refusal == "revoked"
        assert asyncio.run(store.search(QUESTION)) == []  # paused: no request
        assert len(fake.sent("POST", "/v1/search")) == 1


# --- Writes: queued notes, 429 without Retry-After, the size cap ----------------------------------------------------


def test_a_queued_note_is_saved_and_the_model_hears_membase_learns_it_in_the_background():
    fake = InMemoryMembase(hosted=True)
    with fake.store() as store:
        model = tool_turn(store, SAVE, ToolCall("membase_save", {"content": "My name is Ada.", "standing_fact": True}))
    assert tool_texts(model) == [
        (
            "success",
            "Saved to Membase. Membase learns it in the background, so a search right away may not find it yet.",
        ),
        ("success", "Saved as a standing fact in the user's Membase profile."),
    ]
    assert fake.saved() == ["I like green tea."] and fake.standing == ["My name is Ada."]


def test_a_429_without_retry_after_is_sent_once_and_the_model_hears_membase_is_busy():
    fake = InMemoryMembase(hosted=True)
    note = fake.remember("The launch is in May.")
    fake.always(*MEMORIES, rate_limited)
    fake.always("DELETE", "/v1/memories/{id}", rate_limited)
    fact = ToolCall("membase_save", {"content": "My name is Ada.", "standing_fact": True})
    with fake.store(tools=ALL_TOOLS) as store:
        model = tool_turn(store, fact, ToolCall("membase_forget", {"memory_id": note}))

    for outcome, text in tool_texts(model):
        assert outcome == "error" and "busy" in text and "try again shortly" in text
    assert len(fake.sent(*MEMORIES)) == len(fake.sent("DELETE")) == 1  # one attempt each, no back-off loop


def test_a_note_larger_than_membase_takes_is_refused_before_it_is_copied_or_sent(caplog):
    fake = InMemoryMembase()
    store = fake.store(capture=True, write_timeout=LONG)
    wide = "€" * (12 * MiB)  # 36 MiB of UTF-8 in 12 M characters: only counting tells
    ascii_ = "x" * (33 * MiB)

    model = tool_turn(store, ToolCall("membase_save", {"content": ascii_}))
    [(outcome, text)] = tool_texts(model)
    assert outcome == "error" and "larger than Membase takes (32 MiB)" in text
    for note in (ascii_, wide):
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match="larger than Membase takes"):
                asyncio.run(store.add(note))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 * MiB, peak  # measured a slice at a time: never a copy of the whole
    assert asyncio.run(store.add_messages([user(wide), user("and a few words")])) is None
    [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "captured batch is larger than Membase takes" in said and "not saved" in said
    assert fake.sent(*MEMORIES) == [] and store.counters()["writes_lost"] == 2
    store.close()


# --- Forget as hosted Membase answers it ------------------------------------------------------------------------


def test_the_person_approves_the_passage_search_showed_and_membases_how_when_membase_sends_no_content():
    fake = InMemoryMembase(hosted=True)
    fake.remember("The launch is in May.")
    found = r"in May\. \(id: ([^)]+)\)"
    forget = lambda sent: ToolCall("membase_forget", {"memory_id": re.search(found, model.tool_result_text())[1]})  # noqa: E731
    agent, model = make_agent(
        fake.store(tools=ALL_TOOLS), [ToolCall("membase_search", {"query": "launch"}), forget, "Forgotten."]
    )

    result = agent("Forget when the launch is.")

    [interrupt] = result.interrupts
    how = "Forgetting removes it from your Memory for good: a search will not find it again."
    assert interrupt.reason == {
        "memory_id": "ctr_main:1",
        "content": "The launch is in May.",
        "memory": "Main",
        "how": how,
    }
    assert str(resume(agent, result, True)).strip() == "Forgotten."
    assert [n.content for n in fake.forgotten] == ["The launch is in May."]


def test_a_forget_approved_in_a_later_request_on_another_store_forgets_what_the_person_approved(tmp_path):
    """The person answers in a later request, served by another worker: a new store (which never showed the passage)
    and an agent restored by a session manager. Hosted Membase's preview holds no content, yet the question asked is
    found again and the approved passage is forgotten."""
    fake = InMemoryMembase(hosted=True)
    fake.remember("The launch is in May.")
    found = r"in May\. \(id: ([^)]+)\)"
    forget = lambda sent: ToolCall("membase_forget", {"memory_id": re.search(found, sent)[1]})  # noqa: E731

    def agent_of(script: list[Any]) -> Agent:
        session = FileSessionManager(session_id="alice", storage_dir=str(tmp_path))
        memory = MemoryManager(stores=[fake.store(tools=ALL_TOOLS)], search_tool_config=False)
        return Agent(model=ScriptedModel(script), memory_manager=memory, session_manager=session, callback_handler=None)

    asked = agent_of([ToolCall("membase_search", {"query": "launch"}), forget])("Forget when the launch is.")
    [interrupt] = asked.interrupts
    assert interrupt.reason["content"] == "The launch is in May."

    answered = resume(agent_of(["Forgotten."]), asked, True)  # another store, the same session

    assert str(answered).strip() == "Forgotten."
    assert [n.content for n in fake.forgotten] == ["The launch is in May."]


def test_an_id_search_never_showed_is_not_guessed_at_and_hits_without_ids_show_none(caplog):
    caplog.set_level(logging.INFO)
    fake = InMemoryMembase(hosted=True)
    note = fake.remember("The launch is in May.")
    with fake.store(tools=ALL_TOOLS) as store:
        model = tool_turn(store, ToolCall("membase_forget", {"memory_id": note}))
        [(outcome, text)] = tool_texts(model)
        assert outcome == "error" and "membase_search has not shown" in text and "Membase app" in text
        assert warnings_in(caplog) == [] and any("forget not asked for" in r.getMessage() for r in caplog.records)
        assert [r.params for r in fake.sent("DELETE")] == [{"confirm": "false"}] and fake.forgotten == []

        fake.sources = False  # hits with no source: no id to show
        [(_, shown)] = tool_texts(tool_turn(store, ToolCall("membase_search", {"query": "launch"})))
    assert "(id:" not in shown and "remove it in the Membase app" in shown


# --- The key's hint ---------------------------------------------------------------------------------------------------


def test_the_keys_hint_is_in_log_lines_spans_and_repr_and_its_token_never(caplog, spans: InMemorySpanExporter):
    caplog.set_level(logging.DEBUG)
    fake = InMemoryMembase(key=KEY, level="read")
    fake.remember(FACT)
    with fake.store(name="hinted", capture=True) as store:
        tool_turn(store, SAVE, ToolCall("membase_search", {"query": "ledger"}), injection=True)

        assert f"key={HINT!r}" in repr(store) and TOKEN[:8] not in repr(store)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("membase_strands")]
    assert ours and all(line.startswith(f"store=<hinted>, key=<{HINT}>") for line in ours)
    hinted = [span for span in spans.get_finished_spans() if (span.attributes or {}).get("membase.store") == "hinted"]
    assert hinted and all(span.attributes["membase.key"] == HINT for span in hinted)
    pieces = {TOKEN[i : i + 8] for i in range(len(TOKEN) - 7)}
    texts = [r.getMessage() for r in caplog.records] + [text for span in hinted for text in span_texts(span)]
    assert not [text for text in texts if any(piece in text for piece in pieces)]


def test_a_key_of_another_shape_shows_only_a_digest():
    fake = InMemoryMembase(key="sk-live-0123456789abcdef0123")
    with fake.store() as store:
        shown = repr(store)
    assert re.search(r"key='sha256:[0-9a-f]{8}'", shown) and "0123456789" not in shown


def test_a_developer_key_whose_token_is_too_short_to_mask_alone_is_masked_whole_and_ordinary_words_stay(caplog):
    caplog.set_level(logging.DEBUG)
    fake = InMemoryMembase(key="mbk_12345678_k")
    fake.on("POST", "/v1/search", status(400, "the request was rejected; check the key you sent: mbk_12345678_k"))
    with fake.store(recall_timeout=LONG) as store:
        shown = repr(store)
        with pytest.raises(Exception) as raised:
            asyncio.run(store.search(QUESTION))
    assert re.search(r"key='sha256:[0-9a-f]{8}'", shown) and "12345678" not in shown
    text = str(raised.value)
    assert "mbk_12345678_k" not in text and "check the key you sent" in text  # the key masked, the words whole


def test_a_save_refused_as_above_the_keys_level_does_not_look_the_memory_up_again():
    fake = InMemoryMembase(level="read", hosted=True)
    with fake.store(capture=True, container="Main", recall_timeout=LONG, write_timeout=LONG) as store:
        asyncio.run(store.initialize())  # the pinned Memory looked up once
        with pytest.raises(MembaseAccessError):
            asyncio.run(store.add("I like green tea."))
    assert [r.path for r in fake.sent()] == ["/v1/containers", "/v1/memories"]  # the refusal is the verb's

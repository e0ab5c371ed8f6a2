"""Writes: off by default, opt-in capture of the user's words, the manager's add_memory tool, failures."""

from __future__ import annotations

import membase
import pytest
from strands.memory import MemoryManager

from membase_strands import MembaseAccessError, MembaseMemoryStore
from membase_strands.testing import API_KEY, ToolCall, status
from tests.support.store_helpers import make_agent


def writes(fake) -> list[dict]:
    return [r.body for r in fake.sent("POST", "/v1/memories")]


def user(text: str) -> dict:
    return {"role": "user", "content": [{"text": text}]}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"text": text}]}


# --- Capture off (the default) --------------------------------------------------------------------


def test_capture_is_off_by_default(fake, make_store):
    store = make_store()
    assert store.writable is False
    assert store.extraction is None


def test_the_manager_refuses_an_add_tool_without_a_writable_store(fake, make_store):
    with pytest.raises(ValueError, match="writable"):
        MemoryManager(stores=[make_store()], add_tool_config=True)


@pytest.mark.parametrize("extraction", [True, {}])
def test_extraction_without_capture_needs_capture(fake, extraction):
    with pytest.raises(ValueError, match="needs capture=True"):
        MembaseMemoryStore(client=fake.client(), extraction=extraction)


async def test_direct_writes_with_capture_off_raise(fake, make_store):
    store = make_store()

    with pytest.raises(ValueError, match="capture is off"):
        await store.add("I like green tea")
    with pytest.raises(ValueError, match="capture is off"):
        await store.add_messages([user("I like green tea")])

    assert writes(fake) == []


def test_a_conversation_with_capture_off_writes_nothing(fake, make_store):
    agent, _ = make_agent(make_store(), ["Noted.", "Sure.", "Right.", "Okay.", "Fine.", "Yes."])

    for text in ["I like green tea", "I live in Lisbon", "I work on ledgers", "Call me Sam", "Bye", "Hi again"]:
        agent(text)

    assert writes(fake) == []
    assert len(fake.sent("POST", "/v1/search")) == 6


# --- Capture on --------------------------------------------------------------------------------


def test_capture_on_is_writable_and_keeps_the_extraction_config(fake, make_store):
    store = make_store(capture=True, extraction=True, container="Main")
    assert store.writable is True
    assert store.extraction is True


def test_a_synchronous_turn_saves_the_users_words_once_in_the_pinned_memory(fake, make_store):
    store = make_store(capture=True, extraction=True, container="Main")
    agent, _ = make_agent(store, ["Green tea noted, thanks."])

    agent("I like green tea")

    saved = writes(fake)
    assert len(saved) == 1
    assert saved[0]["container"] == "ctr_main"
    assert saved[0]["content"] == "I like green tea"
    assert saved[0]["static"] is False
    assert "noted" not in saved[0]["content"]
    assert [note.content for note in fake.notes] == ["I like green tea"]


def test_the_next_turn_does_not_save_the_earlier_words_again(fake, make_store):
    store = make_store(capture=True, extraction=True, container="Main")
    agent, _ = make_agent(store, ["Noted.", "Noted too."])

    agent("I like green tea")
    agent("I live in Lisbon")

    assert [body["content"] for body in writes(fake)] == ["I like green tea", "I live in Lisbon"]


def test_both_roles_are_kept_each_line_prefixed_by_its_role(fake, make_store):
    store = make_store(capture=True, extraction=True, container="Main", capture_roles=("user", "assistant"))
    agent, _ = make_agent(store, ["Green tea noted."])

    agent("I like green tea")

    saved = writes(fake)
    assert len(saved) == 1
    assert saved[0]["content"] == "user: I like green tea\nassistant: Green tea noted."


def test_assistant_only_capture_keeps_the_assistants_words(fake, make_store):
    store = make_store(capture=True, extraction=True, container="Main", capture_roles="assistant")
    agent, _ = make_agent(store, ["Green tea noted."])

    agent("I like green tea")

    assert [body["content"] for body in writes(fake)] == ["Green tea noted."]


def test_the_managers_add_memory_tool_writes_through_add(fake, make_store):
    store = make_store(capture=True, container="Main")
    script = [ToolCall("add_memory", {"entries": ["Sam prefers green tea"]}), "Saved."]
    agent, model = make_agent(store, script, add_tool_config=True)

    agent("Please remember that I prefer green tea.")

    saved = writes(fake)
    assert len(saved) == 1
    assert saved[0]["content"] == "Sam prefers green tea"
    assert saved[0]["container"] == "ctr_main"
    assert model.tool_results()[-1]["status"] == "success"


def test_a_refused_add_memory_tool_call_is_an_error_result_without_the_key(fake, make_store, no_key_in_logs):
    fake.always("POST", "/v1/memories", status(403))
    store = make_store(capture=True, container="Main")
    script = [ToolCall("add_memory", {"entries": ["Sam prefers green tea"]}), "Could not save."]
    agent, model = make_agent(store, script, add_tool_config=True)

    agent("Please remember that I prefer green tea.")

    result = model.tool_results()[-1]
    assert result["status"] == "error"
    assert API_KEY not in model.tool_result_text()
    assert len(writes(fake)) == 1


async def test_add_saves_one_note_with_title_and_static_flags(fake, make_store):
    store = make_store(capture=True, container="Main")

    await store.add("Prefers green tea", {"title": "Drinks"})
    await store.add("Is vegetarian", {"static": True})

    first, second = writes(fake)
    assert first == {"content": "Prefers green tea", "static": False, "title": "Drinks", "container": "ctr_main"}
    assert second["static"] is True and "container" not in second
    assert fake.standing == ["Is vegetarian"]


@pytest.mark.parametrize("metadata", [{"static": "false"}, {"static": 1}, {"title": 5}, ["static"]])
async def test_add_accepts_only_real_flags(fake, make_store, metadata):
    with pytest.raises(ValueError):
        await make_store(capture=True).add("Prefers green tea", metadata)
    assert writes(fake) == []


async def test_add_refuses_blank_content(fake, make_store):
    with pytest.raises(ValueError):
        await make_store(capture=True).add("   ")
    assert writes(fake) == []


async def test_a_403_on_add_raises_an_access_error(fake, make_store):
    fake.on("POST", "/v1/memories", status(403))

    with pytest.raises(MembaseAccessError, match="narrowed or revoked") as raised:
        await make_store(capture=True).add("Prefers green tea")

    assert isinstance(raised.value, PermissionError)
    assert len(writes(fake)) == 1


async def test_a_500_on_add_raises_a_membase_error(fake, make_store):
    fake.on("POST", "/v1/memories", status(500, "internal"))

    with pytest.raises(membase.MembaseError):
        await make_store(capture=True).add("Prefers green tea")


async def test_a_403_on_add_messages_raises_an_access_error(fake, make_store):
    fake.on("POST", "/v1/memories", status(403))

    with pytest.raises(MembaseAccessError):
        await make_store(capture=True).add_messages([user("I like green tea")])


async def test_a_batch_with_no_text_for_the_chosen_roles_sends_nothing(fake, make_store):
    store = make_store(capture=True)
    batch = [
        assistant("Green tea noted."),
        {"role": "user", "content": [{"toolResult": {"toolUseId": "t1", "status": "success", "content": []}}]},
        user("   "),
    ]

    assert await store.add_messages(batch) is None
    assert await store.add_messages([]) is None
    assert writes(fake) == []


async def test_add_messages_accepts_a_missing_context(fake, make_store):
    store = make_store(capture=True, container="Main")

    await store.add_messages([user("I like green tea"), assistant("Noted."), user("And oolong")])

    assert [body["content"] for body in writes(fake)] == ["I like green tea\nAnd oolong"]

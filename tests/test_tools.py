"""The model's Membase tools, driven through a real ``strands.Agent`` by a scripted model.

Every test asserts on what the model was sent (the tool result it read) and on which requests
reached the fake Membase.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import membase.client
import pytest

import membase_strands.store as store_module
from membase_strands import MembaseMemoryStore
from membase_strands._tools import CLOSED_SENTENCE as CLOSED
from membase_strands.testing import API_KEY, InMemoryMembase, ScriptedModel, ToolCall, hang, status
from tests.support.store_helpers import make_agent, result_text

FINAL = "done"
OUR_TOOLS = ("membase_search", "membase_save", "membase_profile")
TWO_MEMORIES = [{"id": "ctr_main", "name": "Main"}, {"id": "ctr_x", "name": "Work"}]

# --- Helpers -----------------------------------------------------------------------------------


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """An event for ``hang`` responders, always set when the test ends so no thread stays blocked."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def instant_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the SDK's retry back-off instant (it sleeps 0.25-1.5 s before retrying a timeout)."""
    monkeypatch.setattr(membase.client, "_backoff", lambda attempt, retry_after=None: 0.0)


def read_timeout(request: httpx.Request) -> httpx.Response:
    """A host that never answered: httpx gives up with a read timeout."""
    raise httpx.ReadTimeout("timed out", request=request)


def refuse_with_key(request: httpx.Request) -> httpx.Response:
    """A connection failure whose message echoes the key, to prove it is redacted."""
    raise httpx.ConnectError(f"[Errno 111] Connection refused (key {API_KEY})", request=request)


def search_body(*hits: tuple[str, str, str]) -> Callable[[httpx.Request], httpx.Response]:
    """A responder answering a search with fixed ``(content, container id, container name)`` hits."""
    results = [{"content": c, "container": cid, "container_name": name, "score": 1.0} for c, cid, name in hits]
    containers = [{"id": cid, "name": name} for _, cid, name in hits]
    return lambda request: httpx.Response(200, json={"results": results, "containers": containers})


def run(
    store: MembaseMemoryStore, *calls: ToolCall, injection: bool = False, prompt: str = "go"
) -> tuple[Any, ScriptedModel]:
    """Run one agent turn in which the model makes ``calls`` and then answers ``FINAL``."""
    agent, model = make_agent(store, [*calls, FINAL], injection=injection)
    result = agent(prompt)
    return result, model


# --- membase_search ---------------------------------------------------------------------------


def test_search_numbers_passages_with_their_memory(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    fake.remember("We chose Postgres for the ledger.")
    fake.remember("The ledger database runs nightly backups.", container="ctr_x")
    result, model = run(make_store(), ToolCall("membase_search", {"query": "ledger database"}))

    assert str(result).strip() == FINAL
    tool_result = model.tool_results()[-1]
    assert tool_result["status"] == "success"
    text = result_text(tool_result)
    assert 'Membase found 2 passages for "ledger database":' in text
    assert "1. [Work] The ledger database runs nightly backups." in text
    assert "2. [Main] We chose Postgres for the ledger." in text
    assert "Not searched" not in text
    [sent] = fake.sent("POST", "/v1/search")
    assert sent.body == {"q": "ledger database", "limit": 5}


def test_search_lists_memories_that_could_not_answer(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    fake.unsearchable = {"ctr_x": "the memory is waking up"}
    fake.remember("We chose Postgres for the ledger.")
    fake.remember("The ledger lives on the big server.", container="ctr_x")
    _, model = run(make_store(), ToolCall("membase_search", {"query": "ledger"}))

    text = model.tool_result_text()
    assert model.tool_results()[-1]["status"] == "success"
    assert "1. [Main] We chose Postgres for the ledger." in text
    assert "big server" not in text
    not_searched = text[text.index("Not searched") :]
    assert "not evidence of absence" in not_searched
    assert "- Work: the memory is waking up" in not_searched


def test_search_with_every_memory_unsearchable_does_not_claim_absence(fake: InMemoryMembase, make_store) -> None:
    fake.unsearchable = {"ctr_main": "no model configured"}
    fake.remember("We chose Postgres for the ledger.")
    _, model = run(make_store(), ToolCall("membase_search", {"query": "ledger"}))

    text = model.tool_result_text()
    assert 'Nothing matched "ledger" in the Memories that answered.' in text
    assert "Nothing in Membase matched" not in text
    assert "- Main: no model configured" in text


def test_search_says_clearly_when_nothing_matched(fake: InMemoryMembase, make_store) -> None:
    fake.remember("We chose Postgres for the ledger.")
    result, model = run(make_store(), ToolCall("membase_search", {"query": "favourite colour"}))

    assert str(result).strip() == FINAL
    assert model.tool_results()[-1]["status"] == "success"
    assert model.tool_result_text() == 'Nothing in Membase matched "favourite colour".'


def test_search_sends_a_named_container_as_its_id(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    fake.remember("We chose Postgres for the ledger.")
    fake.remember("The ledger runs nightly backups.", container="ctr_x")
    _, model = run(make_store(), ToolCall("membase_search", {"query": "ledger", "container": "work"}))

    [sent] = fake.sent("POST", "/v1/search")
    assert sent.body["container"] == "ctr_x"
    text = model.tool_result_text()
    assert "1. [Work] The ledger runs nightly backups." in text
    assert "Postgres" not in text


def test_search_with_an_unknown_container_lists_the_names_in_reach(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    result, model = run(make_store(), ToolCall("membase_search", {"query": "ledger", "container": "Holidays"}))

    assert str(result).strip() == FINAL
    tool_result = model.tool_results()[-1]
    assert tool_result["status"] == "error"
    text = result_text(tool_result)
    assert text.startswith("Nothing was searched:")
    assert "'Holidays'" in text
    assert "'Main'" in text and "'Work'" in text
    assert fake.sent("POST", "/v1/search") == []


def test_search_accepts_a_container_id(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    fake.remember("The ledger runs nightly backups.", container="ctr_x")
    _, model = run(make_store(), ToolCall("membase_search", {"query": "ledger", "container": "ctr_x"}))

    [sent] = fake.sent("POST", "/v1/search")
    assert sent.body["container"] == "ctr_x"
    assert "1. [Work] The ledger runs nightly backups." in model.tool_result_text()


def test_search_with_an_ambiguous_container_name_names_both(fake: InMemoryMembase, make_store) -> None:
    fake.containers = [*TWO_MEMORIES, {"id": "ctr_y", "name": "work"}]
    _, model = run(make_store(), ToolCall("membase_search", {"query": "ledger", "container": "WORK"}))

    assert model.tool_results()[-1]["status"] == "error"
    text = model.tool_result_text()
    assert "ctr_x" in text and "ctr_y" in text
    assert fake.sent("POST", "/v1/search") == []


def test_search_with_a_pinned_container_searches_only_it(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    fake.remember("We chose Postgres for the ledger.")
    fake.remember("The ledger runs nightly backups.", container="ctr_x")
    _, model = run(make_store(container="Work"), ToolCall("membase_search", {"query": "ledger"}))

    [sent] = fake.sent("POST", "/v1/search")
    assert sent.body["container"] == "ctr_x"
    assert "Postgres" not in model.tool_result_text()


def test_search_limit_zero_is_an_error_and_sends_nothing(fake: InMemoryMembase, make_store) -> None:
    fake.remember("We chose Postgres for the ledger.")
    result, model = run(make_store(), ToolCall("membase_search", {"query": "ledger", "limit": 0}))

    assert str(result).strip() == FINAL
    tool_result = model.tool_results()[-1]
    assert tool_result["status"] == "error"
    assert "limit must be a whole number from 1 to 50" in result_text(tool_result)
    assert fake.sent("POST", "/v1/search") == []


def test_search_limit_above_fifty_is_sent_as_fifty(fake: InMemoryMembase, make_store) -> None:
    fake.remember("We chose Postgres for the ledger.")
    _, model = run(make_store(), ToolCall("membase_search", {"query": "ledger", "limit": 80}))

    [sent] = fake.sent("POST", "/v1/search")
    assert sent.body["limit"] == 50
    assert model.tool_results()[-1]["status"] == "success"


def test_search_uses_the_stores_default_limit(fake: InMemoryMembase, make_store) -> None:
    run(make_store(max_search_results=7), ToolCall("membase_search", {"query": "ledger"}))
    [sent] = fake.sent("POST", "/v1/search")
    assert sent.body["limit"] == 7


def test_search_with_a_blank_query_sends_nothing(fake: InMemoryMembase, make_store) -> None:
    _, model = run(make_store(), ToolCall("membase_search", {"query": "   "}))
    assert model.tool_results()[-1]["status"] == "error"
    assert "the query was empty" in model.tool_result_text()
    assert fake.sent("POST", "/v1/search") == []


def test_search_caps_a_huge_query(fake: InMemoryMembase, make_store) -> None:
    run(make_store(), ToolCall("membase_search", {"query": "ledger " * 1000}))
    [sent] = fake.sent("POST", "/v1/search")
    assert len(sent.body["q"]) == 2000


def test_search_waits_for_the_sdk_not_the_recall_budget(fake: InMemoryMembase, make_store, release) -> None:
    # The automatic recall's search hangs until the test ends, so its budget (0.1 s) runs out whatever the
    # machine's speed; the tool's own search answers only after five times that budget, and still arrives.
    answer = search_body(("We chose Postgres for the ledger.", "ctr_main", "Main"))
    searches = iter([hang(release, then=answer), hang(threading.Event(), then=answer, limit=0.5)])
    fake.always("POST", "/v1/search", lambda request: next(searches)(request))
    store = make_store(recall_timeout=0.1)

    result, model = run(store, ToolCall("membase_search", {"query": "ledger"}), injection=True)

    assert str(result).strip() == FINAL
    tool_result = model.tool_results()[-1]
    assert tool_result["status"] == "success"
    assert "1. [Main] We chose Postgres for the ledger." in result_text(tool_result)
    assert len(fake.sent("POST", "/v1/search")) == 2  # the recall's and the tool's, each sent once
    # The automatic recall ran out of its budget, so the model was sent no <memory> block.
    assert model.memory_block(0) is None
    assert store.counters()["recall_timeouts"] == 1


def test_search_retries_a_503_through_the_sdk(fake: InMemoryMembase, make_store) -> None:
    fake.remember("We chose Postgres for the ledger.")
    fake.on("POST", "/v1/search", status(503, "warming up"))
    _, model = run(make_store(), ToolCall("membase_search", {"query": "ledger"}))

    assert len(fake.sent("POST", "/v1/search")) == 2
    assert model.tool_results()[-1]["status"] == "success"
    assert "1. [Main] We chose Postgres for the ledger." in model.tool_result_text()


def test_search_with_an_unreadable_answer_says_so(fake: InMemoryMembase, make_store) -> None:
    fake.always("POST", "/v1/search", lambda request: httpx.Response(200, json={"unexpected": True}))
    result, model = run(make_store(), ToolCall("membase_search", {"query": "ledger"}))

    assert str(result).strip() == FINAL
    assert model.tool_results()[-1]["status"] == "error"
    assert "could not be read" in model.tool_result_text()


# --- membase_save ---------------------------------------------------------------------------


def test_save_writes_to_the_named_memory_by_id(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    result, model = run(make_store(), ToolCall("membase_save", {"content": "I prefer tea.", "container": "Work"}))

    assert str(result).strip() == FINAL
    [sent] = fake.sent("POST", "/v1/memories")
    assert sent.body["container"] == "ctr_x"
    assert sent.body["content"] == "I prefer tea."
    assert sent.body["static"] is False
    assert [(n.content, n.container) for n in fake.notes] == [("I prefer tea.", "ctr_x")]
    assert model.tool_results()[-1]["status"] == "success"
    assert model.tool_result_text() == "Saved to the Memory 'Work'."


def test_save_standing_fact_goes_to_the_profile(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES  # several Memories do not matter for a standing fact
    _, model = run(make_store(), ToolCall("membase_save", {"content": "I am vegetarian.", "standing_fact": True}))

    [sent] = fake.sent("POST", "/v1/memories")
    assert sent.body["static"] is True
    assert "container" not in sent.body
    assert fake.standing == ["I am vegetarian."]
    assert fake.notes == []
    assert model.tool_results()[-1]["status"] == "success"
    assert "standing fact" in model.tool_result_text()


def test_save_with_several_memories_and_none_named_asks_which(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    result, model = run(make_store(), ToolCall("membase_save", {"content": "I prefer tea."}))

    assert str(result).strip() == FINAL
    tool_result = model.tool_results()[-1]
    assert tool_result["status"] == "error"
    text = result_text(tool_result)
    assert "Nothing was saved" in text
    assert "'Main'" in text and "'Work'" in text
    assert "which one" in text
    assert fake.notes == [] and fake.standing == []


@pytest.mark.parametrize("content", ["", "   \n\t "])
def test_save_empty_content_saves_nothing_and_says_so(fake: InMemoryMembase, make_store, content: str) -> None:
    result, model = run(make_store(), ToolCall("membase_save", {"content": content}))

    assert str(result).strip() == FINAL
    assert model.tool_results()[-1]["status"] == "error"
    assert model.tool_result_text() == "Nothing was saved: the content was empty."
    assert fake.sent("POST", "/v1/memories") == []


def test_save_with_a_pinned_container_and_no_argument_writes_there(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    _, model = run(make_store(container="work"), ToolCall("membase_save", {"content": "I prefer tea."}))

    [sent] = fake.sent("POST", "/v1/memories")
    assert sent.body["container"] == "ctr_x"
    assert [(n.content, n.container) for n in fake.notes] == [("I prefer tea.", "ctr_x")]
    assert model.tool_results()[-1]["status"] == "success"


def test_save_to_an_unknown_memory_lists_the_names_and_saves_nothing(fake: InMemoryMembase, make_store) -> None:
    fake.containers = TWO_MEMORIES
    _, model = run(make_store(), ToolCall("membase_save", {"content": "I prefer tea.", "container": "Holidays"}))

    assert model.tool_results()[-1]["status"] == "error"
    text = model.tool_result_text()
    assert text.startswith("Nothing was saved:")
    assert "'Main'" in text and "'Work'" in text
    assert fake.sent("POST", "/v1/memories") == []


def test_save_that_times_out_is_sent_once_and_may_have_been_saved(fake: InMemoryMembase, make_store, release) -> None:
    fake.always("POST", "/v1/memories", hang(release, limit=0.2))  # then httpx.ReadTimeout
    result, model = run(make_store(), ToolCall("membase_save", {"content": "I prefer tea."}))

    assert str(result).strip() == FINAL
    assert len(fake.sent("POST", "/v1/memories")) == 1
    tool_result = model.tool_results()[-1]
    assert tool_result["status"] == "error"
    text = result_text(tool_result)
    assert "may or may not have been saved" in text
    assert "try again in a minute" in text


def test_save_whose_memory_lookup_timed_out_says_nothing_was_saved(
    fake: InMemoryMembase, make_store, instant_backoff
) -> None:
    fake.containers = TWO_MEMORIES
    fake.always("GET", "/v1/containers", read_timeout)
    result, model = run(make_store(), ToolCall("membase_save", {"content": "I prefer tea.", "container": "Work"}))

    assert str(result).strip() == FINAL
    assert fake.sent("POST", "/v1/memories") == []
    assert model.tool_results()[-1]["status"] == "error"
    text = model.tool_result_text()
    assert "try again in a minute" in text
    assert "may or may not have been saved" not in text


def test_save_answered_2xx_with_an_unreadable_body_is_not_reported_as_not_saved(
    fake: InMemoryMembase, make_store
) -> None:
    # A 2xx means Membase took the note; telling the model "nothing was saved" would get it saved twice.
    fake.always("POST", "/v1/memories", lambda request: httpx.Response(200, text="<html>OK</html>"))
    result, model = run(make_store(), ToolCall("membase_save", {"content": "I prefer tea."}))

    assert str(result).strip() == FINAL
    assert len(fake.sent("POST", "/v1/memories")) == 1
    text = model.tool_result_text()
    assert "Nothing was saved" not in text
    assert "Saved" in text or "saved" in text


@pytest.mark.parametrize(
    ("tool", "route", "arguments"),
    [
        ("membase_search", ("POST", "/v1/search"), {"query": "ledger"}),
        ("membase_profile", ("GET", "/v1/profile"), {}),
    ],
)
def test_read_answered_2xx_with_an_unreadable_body_says_so(
    fake: InMemoryMembase, make_store, tool: str, route: tuple[str, str], arguments: dict[str, Any]
) -> None:
    fake.always(*route, lambda request: httpx.Response(200, text="<html>gateway</html>"))
    result, model = run(make_store(), ToolCall(tool, arguments))

    assert str(result).strip() == FINAL
    assert model.tool_results()[-1]["status"] == "error"
    text = model.tool_result_text()
    assert "could not be read" in text
    assert "Nothing was searched" not in text


def test_save_description_asks_for_the_users_own_words(make_store) -> None:
    [save] = [t for t in make_store().get_tools() if t.tool_name == "membase_save"]
    description = save.tool_spec["description"]
    assert "Only save when the user asked" in description
    assert "user's own words" in description


# --- membase_profile -----------------------------------------------------------------------


def test_profile_gives_standing_facts_and_recent_changes(fake: InMemoryMembase, make_store) -> None:
    fake.standing = ["The user is vegetarian."]
    fake.remember("Moved the ledger to Postgres.")
    result, model = run(make_store(), ToolCall("membase_profile", {}))

    assert str(result).strip() == FINAL
    [sent] = fake.sent("GET", "/v1/profile")
    assert "q" not in sent.params
    assert model.tool_results()[-1]["status"] == "success"
    assert model.tool_result_text() == (
        "Standing facts:\n- The user is vegetarian.\n\nRecent changes:\n- Moved the ledger to Postgres."
    )


def test_profile_with_a_topic_sends_it_and_shows_the_results(fake: InMemoryMembase, make_store) -> None:
    fake.standing = ["The user is vegetarian."]
    fake.remember("We chose Postgres for the ledger.")
    _, model = run(make_store(), ToolCall("membase_profile", {"topic": "  ledger  "}))

    [sent] = fake.sent("GET", "/v1/profile")
    assert sent.params == {"q": "ledger"}
    text = model.tool_result_text()
    assert "Standing facts:\n- The user is vegetarian." in text
    assert 'On "ledger":\n1. [Main] We chose Postgres for the ledger.' in text


def test_profile_empty_says_so(fake: InMemoryMembase, make_store) -> None:
    _, model = run(make_store(), ToolCall("membase_profile", {}))

    assert model.tool_results()[-1]["status"] == "success"
    assert model.tool_result_text() == (
        "The Membase profile is empty: no standing facts or recent changes are recorded yet."
    )


def test_profile_empty_with_a_topic_names_it(fake: InMemoryMembase, make_store) -> None:
    _, model = run(make_store(), ToolCall("membase_profile", {"topic": "ledger"}))
    assert model.tool_result_text() == (
        'The Membase profile is empty: no standing facts, recent changes or results on "ledger".'
    )


# --- Every Membase failure becomes a distinct sentence ----------------------------------------

# name -> (responder, phrases the sentence must contain)
FAILURES: dict[str, tuple[Callable[[httpx.Request], httpx.Response], tuple[str, ...]]] = {
    "403": (status(403, f"key {API_KEY} revoked"), ("narrowed or revoked",)),
    "timeout": (read_timeout, ("try again in a minute", "in time")),
    "connection": (refuse_with_key, ("try again in a minute", "could not be reached")),
    "400": (status(400, f"bad field for {API_KEY}"), ("rejected",)),
    "422": (status(422, f"no model for {API_KEY}"), ("cannot run",)),
    "429": (status(429, "slow down"), ("busy", "shortly")),
    "500": (status(500, f"boom {API_KEY}"), ("internal error",)),
}
# tool -> (route, arguments, requests per failure: the SDK retries searches and profile reads,
# a save is sent once)
TOOLS: dict[str, tuple[tuple[str, str], dict[str, Any], dict[str, int]]] = {
    "membase_search": (
        ("POST", "/v1/search"),
        {"query": "ledger"},
        {"403": 1, "timeout": 3, "connection": 3, "400": 1, "422": 1, "429": 3, "500": 3},
    ),
    "membase_save": (
        ("POST", "/v1/memories"),
        {"content": "I prefer tea."},
        {"403": 1, "timeout": 1, "connection": 1, "400": 1, "422": 1, "429": 1, "500": 1},
    ),
    "membase_profile": (
        ("GET", "/v1/profile"),
        {"topic": "ledger"},
        {"403": 1, "timeout": 3, "connection": 3, "400": 1, "422": 1, "429": 3, "500": 3},
    ),
}


def fail_tool(tool: str, failure: str) -> tuple[Any, ScriptedModel, InMemoryMembase]:
    """Run one turn whose tool call meets ``failure`` on every request to its route."""
    fake = InMemoryMembase()
    (method, path), arguments, _ = TOOLS[tool]
    fake.always(method, path, FAILURES[failure][0])
    store = fake.store()  # built from the key: membase_save makes one attempt, the reads let the SDK retry
    try:
        result, model = run(store, ToolCall(tool, arguments))
    finally:
        store.close()
    return result, model, fake


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("tool", list(TOOLS))
def test_failure_becomes_an_error_sentence(tool: str, failure: str, instant_backoff, no_key_in_logs) -> None:
    result, model, fake = fail_tool(tool, failure)

    assert str(result).strip() == FINAL  # the turn completes
    tool_result = model.tool_results()[-1]
    assert tool_result["status"] == "error"
    text = result_text(tool_result)
    for phrase in FAILURES[failure][1]:
        assert phrase in text
    assert API_KEY not in text
    assert API_KEY not in str(model.calls[-1]["messages"])
    (method, path), _, expected_requests = TOOLS[tool]
    assert len(fake.sent(method, path)) == expected_requests[failure]


@pytest.mark.parametrize("tool", list(TOOLS))
def test_each_failure_has_its_own_sentence(tool: str, instant_backoff) -> None:
    sentences = {failure: result_text(fail_tool(tool, failure)[1].tool_results()[-1]) for failure in FAILURES}
    assert len(set(sentences.values())) == len(FAILURES), sentences
    # A timeout and a connection failure both say when to retry, and are told apart.
    assert "try again in a minute" in sentences["timeout"]
    assert "try again in a minute" in sentences["connection"]
    assert sentences["timeout"] != sentences["connection"]


def test_403_is_not_retried_and_names_the_cause(instant_backoff) -> None:
    for tool in TOOLS:
        _, model, fake = fail_tool(tool, "403")
        (method, path), _, _ = TOOLS[tool]
        assert len(fake.sent(method, path)) == 1
        assert "this Membase key was narrowed or revoked" in model.tool_result_text()


def test_save_failure_with_several_memories_still_lists_them_on_400(fake: InMemoryMembase, make_store) -> None:
    # A 400 for a save that named no Memory, with several in reach: the model is asked which one.
    fake.containers = TWO_MEMORIES
    fake.always("POST", "/v1/memories", status(400, "several containers are in reach; name one"))
    _, model = run(make_store(), ToolCall("membase_save", {"content": "I prefer tea."}))
    assert model.tool_results()[-1]["status"] == "error"
    assert "'Main'" in model.tool_result_text() and "'Work'" in model.tool_result_text()


def test_recall_and_tool_failures_keep_the_key_out_of_tool_results(
    fake: InMemoryMembase, make_store, instant_backoff
) -> None:
    fake.always("POST", "/v1/search", status(500, f"boom {API_KEY}"))
    result, model = run(make_store(), ToolCall("membase_search", {"query": "ledger"}), injection=True)

    assert str(result).strip() == FINAL
    assert model.tool_results()[-1]["status"] == "error"
    for call in range(len(model.calls)):
        assert API_KEY not in str(model.calls[call]["messages"])
        assert API_KEY not in str(model.calls[call]["system_prompt"])


@pytest.mark.parametrize("failure", ["400", "422", "500", "connection"])
def test_recall_failure_echoing_the_key_is_not_logged(
    fake: InMemoryMembase, make_store, instant_backoff, no_key_in_logs, failure: str
) -> None:
    # The manager logs the exception a failing store.search raised; a server echoing the key must
    # not put it in that log line.
    fake.always("POST", "/v1/search", FAILURES[failure][0])
    result, model = run(make_store(), ToolCall("membase_search", {"query": "ledger"}), injection=True)

    assert str(result).strip() == FINAL
    assert API_KEY not in model.tool_result_text()


# --- Which tools the model gets --------------------------------------------------------------


def tool_names_for(store: MembaseMemoryStore) -> list[str]:
    _, model = run(store)
    return model.calls[0]["tool_names"]


def test_default_tools_are_all_three_plus_the_managers_search(make_store) -> None:
    names = tool_names_for(make_store())
    assert names.count("search_memory") == 1
    assert [n for n in names if n.startswith("membase_")] == list(OUR_TOOLS)


def test_a_tools_subset_gives_only_those(make_store) -> None:
    names = tool_names_for(make_store(tools=("search",)))
    assert [n for n in names if n.startswith("membase_")] == ["membase_search"]
    assert "search_memory" in names


def test_no_tools_gives_none_of_ours(make_store) -> None:
    names = tool_names_for(make_store(tools=()))
    assert not [n for n in names if n.startswith("membase_")]
    assert "search_memory" in names


def test_a_read_key_setup_drops_save(make_store) -> None:
    names = tool_names_for(make_store(tools=("search", "profile")))
    assert [n for n in names if n.startswith("membase_")] == ["membase_search", "membase_profile"]


def test_repeated_tool_names_give_one_tool_each(make_store) -> None:
    names = tool_names_for(make_store(tools=("search", "search")))
    assert names.count("membase_search") == 1


@pytest.mark.parametrize("tools", [("search", "delete"), ("forget",), ("Search",), "search"])
def test_an_unknown_tool_name_is_a_value_error(fake: InMemoryMembase, tools: Any) -> None:
    with pytest.raises(ValueError, match="tools"):
        MembaseMemoryStore(client=fake.client(), tools=tools)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"tools": ("search",)},
        {"tools": ("save", "profile")},
        {"tools": ()},
        {"capture": True},
        {"capture": True, "extraction": True},
        {"container": "Main"},
    ],
)
def test_no_tool_can_delete_or_forget(make_store, options: dict[str, Any]) -> None:
    store = make_store(**options)
    direct = [t.tool_name for t in store.get_tools()]
    _, model = run(store)
    for name in [*direct, *model.calls[0]["tool_names"]]:
        assert "delete" not in name.lower()
        assert "forget" not in name.lower()
        assert "remove" not in name.lower()


# --- Tools built once per store ---------------------------------------------------------------


def test_get_tools_gives_the_same_tool_objects_every_time(make_store) -> None:
    store = make_store()

    first, second = store.get_tools(), store.get_tools()

    assert [t.tool_name for t in first] == list(OUR_TOOLS)
    assert all(a is b for a, b in zip(first, second, strict=True))
    first.clear()  # each call hands out a list of its own
    assert [t.tool_name for t in store.get_tools()] == list(OUR_TOOLS)


def test_agents_built_at_the_same_moment_get_the_same_tools(make_store) -> None:
    store = make_store()
    together = threading.Barrier(8, timeout=30.0)
    seen: list[list[Any]] = []

    def build() -> None:
        together.wait()
        seen.append(store.get_tools())

    threads = [threading.Thread(target=build) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert len(seen) == 8
    assert all(all(a is b for a, b in zip(tools, seen[0], strict=True)) for tools in seen)


def test_get_tools_again_builds_nothing(make_store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Building the tools cost about 3 ms a call; a store that already built them hands out the same ones.
    built: list[object] = []
    build = store_module.build_tools

    def counting_build(*args: Any, **kwargs: Any) -> Any:
        built.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(store_module, "build_tools", counting_build)
    store = make_store()
    first = store.get_tools()
    for _ in range(1000):
        assert all(a is b for a, b in zip(store.get_tools(), first, strict=True))

    assert len(built) == 1


def test_every_store_answers_its_own_tool_calls_though_the_tools_share_one_template() -> None:
    fakes = {user: InMemoryMembase() for user in ("alice", "bob")}
    for user, fake in fakes.items():
        fake.remember(f"{user} keeps the ledger on Postgres.")
    stores = {user: fake.store() for user, fake in fakes.items()}
    try:
        for user, store in stores.items():
            agent, model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), FINAL], injection=False)
            agent("Where is my ledger?")
            text = result_text(model.tool_results()[-1])
            assert f"{user} keeps the ledger" in text
            assert ("bob" if user == "alice" else "alice") not in text
        assert [len(fake.sent("POST", "/v1/search")) for fake in fakes.values()] == [1, 1]
    finally:
        for store in stores.values():
            store.close()


def test_a_store_whose_tools_were_built_first_is_not_kept_alive_by_the_others(fake: InMemoryMembase) -> None:
    first = fake.store()
    first.get_tools()
    gone = threading.Event()
    weakref.finalize(first, gone.set)
    later = fake.store()
    later.get_tools()

    del first
    gc.collect()

    assert gone.is_set()
    later.close()


def test_each_stores_tool_spec_is_its_own(fake: InMemoryMembase) -> None:
    one, two = fake.store(), fake.store()
    spec = one.get_tools()[0].tool_spec

    spec["description"] = "changed by someone's registry"

    assert two.get_tools()[0].tool_spec["description"] != spec["description"]
    assert fake.store().get_tools()[0].tool_spec["description"] != spec["description"]


def test_the_tools_still_work_for_every_agent_built_on_the_store(fake: InMemoryMembase, make_store) -> None:
    fake.remember("We chose Postgres for the ledger.")
    store = make_store()
    first, first_model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), FINAL], injection=False)
    second, second_model = make_agent(
        store,
        [ToolCall("membase_save", {"content": "Tea is green."}), ToolCall("membase_profile", {}), FINAL],
        injection=False,
    )

    second("remember my tea")
    first("which database?")

    assert "We chose Postgres for the ledger." in first_model.tool_result_text()
    assert [r["status"] for r in second_model.tool_results()] == ["success", "success"]
    assert [r.body["content"] for r in fake.sent("POST", "/v1/memories")] == ["Tea is green."]
    counters = store.counters()
    assert [counters[f"tool_calls.{name}"] for name in OUR_TOOLS] == [1, 1, 1]


def test_each_stores_tools_call_that_store(make_store) -> None:
    one, other = InMemoryMembase(), InMemoryMembase()
    one.remember("One remembers the ledger.")
    other.remember("Other remembers the ledger.")
    stores = [make_store(client=one.client()), make_store(client=other.client())]

    texts = []
    for store in stores:
        _, model = run(store, ToolCall("membase_search", {"query": "ledger"}))
        texts.append(model.tool_result_text())

    assert "One remembers" in texts[0] and "Other" not in texts[0]
    assert "Other remembers" in texts[1] and "One" not in texts[1]
    assert (len(one.sent("POST", "/v1/search")), len(other.sent("POST", "/v1/search"))) == (1, 1)
    assert stores[0].counters()["tool_calls.membase_search"] == 1
    assert stores[1].counters()["tool_calls.membase_search"] == 1


def test_a_closed_stores_tools_say_so_to_every_agent(fake: InMemoryMembase, make_store) -> None:
    store = make_store()
    make_agent(store)  # an agent built before the close keeps the same tools
    store.close()

    tools = {t.tool_name: t for t in store.get_tools()}
    assert result_text(tools["membase_search"](query="ledger")) == CLOSED
    assert fake.sent("POST", "/v1/search") == []

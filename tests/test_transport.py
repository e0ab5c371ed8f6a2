"""Faults a web server's network brings: dripping answers, bodies cut mid-character, too many hits.

The dripping and cut answers come from the real loopback HTTP server (``tests/support/loopback.py``):
``httpx.MockTransport`` has no socket, so it cannot drip. Every path runs through the real
``strands.Agent`` or the store's protocol methods and the real ``membase.Membase`` client.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import membase
import membase.client
import pytest

import membase_strands._client as membase_client
from membase_strands import MembaseMemoryStore, MembaseWriteTimeout
from membase_strands._async_http import RECENTLY_USED_SECONDS
from membase_strands.testing import API_KEY, InMemoryMembase, ToolCall
from tests.support.loopback import LoopbackMembase, drip, drip_headers, raw_answer
from tests.support.store_helpers import FACT, QUESTION, make_agent, membase_threads, wait_until

DEADLINE = 1.0  # the client's timeout: the whole-call deadline of one attempt
DRIP_EVERY = 0.2  # well inside httpx's per-read timeout, so only a whole-call deadline ends the call
DRIP_FOR = 15.0  # how long the server would keep dripping without one
SLACK = 4.0  # generous: a loaded 2-core machine
SDK_ATTEMPTS = 3
LONG_BODY = b'{"results": [], "pad": "' + b"x" * 500 + b'"}'  # 100 s of drip at DRIP_EVERY
CUT_MID_CHARACTER = b'{"a": "\xe2\x82'  # the first two bytes of a three-byte UTF-8 character, then nothing
NOTE = "Remember that the ledger runs on Postgres."


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        yield server


@pytest.fixture
def instant_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the SDK's retry back-off instant (it sleeps 0.25-1.5 s before retrying a timeout)."""
    monkeypatch.setattr(membase.client, "_backoff", lambda attempt, retry_after=None: 0.0)


@pytest.fixture
def stores() -> Iterator[list[MembaseMemoryStore]]:
    made: list[MembaseMemoryStore] = []
    yield made
    for store in made:
        store.close()


def tool_turn(store: MembaseMemoryStore, call: ToolCall) -> tuple[str, str, float]:
    """One agent turn in which the model makes ``call``: the tool result's status and text, and the turn's time."""
    agent, model = make_agent(store, [call, "done"], injection=False)
    started = time.monotonic()
    agent("go")
    elapsed = time.monotonic() - started
    result = model.tool_results()[-1]
    return result["status"], "\n".join(item["text"] for item in result["content"] if "text" in item), elapsed


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("membase_strands")]


# --- 2xx bodies that are not valid UTF-8 ---------------------------------------------------------


async def test_a_note_answered_with_a_body_cut_mid_character_is_saved_once(loopback, stores, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="membase_strands")
    loopback.on("POST", "/v1/memories", raw_answer(200, CUT_MID_CHARACTER))
    store = MembaseMemoryStore(client=loopback.client(), capture=True)
    stores.append(store)

    assert await store.add(NOTE) is None  # no answer to hand back, but no failure either

    assert [n.content for n in loopback.fake.notes if n.content == NOTE] == [NOTE]
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 1
    # Counted as the write's thread settles it, which may be a moment after add() returned.
    assert wait_until(lambda: store.counters()["writes_saved"] == 1, timeout=SLACK)
    assert store.counters()["write_errors"] == 0
    [warning] = [m for m in messages(caplog) if "counting it as saved" in m]
    assert "reason=<2xx answer is not valid UTF-8" in warning
    # The manager's retry of the same fact finds it saved and sends nothing.
    assert await store.add(NOTE) is None
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 1


def test_membase_save_answered_with_a_body_cut_mid_character_tells_the_model_it_was_saved(loopback, stores) -> None:
    loopback.on("POST", "/v1/memories", raw_answer(200, CUT_MID_CHARACTER))
    store = MembaseMemoryStore(client=loopback.client())
    stores.append(store)

    status, text, _ = tool_turn(store, ToolCall("membase_save", {"content": NOTE}))

    assert (status, text) == ("success", "Saved to Membase.")
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 1


def test_membase_search_answered_with_a_body_cut_mid_character_says_the_answer_was_unreadable(loopback, stores) -> None:
    loopback.on("POST", "/v1/search", raw_answer(200, CUT_MID_CHARACTER))
    store = MembaseMemoryStore(client=loopback.client())
    stores.append(store)

    status, text, _ = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))

    assert status == "error"
    assert text.startswith("Membase sent an answer that could not be read")
    assert "not valid UTF-8" in text
    assert "Nothing was searched" not in text
    assert len(loopback.fake.sent("POST", "/v1/search")) == 1  # a 2xx is an answer: not retried
    assert store.counters()["errors.bad_response"] == 1


def test_membase_profile_answered_with_a_body_cut_mid_character_says_the_answer_was_unreadable(
    loopback, stores
) -> None:
    loopback.on("GET", "/v1/profile", raw_answer(200, CUT_MID_CHARACTER))
    store = MembaseMemoryStore(client=loopback.client())
    stores.append(store)

    status, text, _ = tool_turn(store, ToolCall("membase_profile", {}))

    assert status == "error"
    assert "could not be read" in text and "not valid UTF-8" in text


def test_a_recall_answered_with_a_body_cut_mid_character_fails_open_as_an_unreadable_answer(loopback, stores) -> None:
    loopback.on("POST", "/v1/search", raw_answer(200, CUT_MID_CHARACTER))
    store = MembaseMemoryStore(client=loopback.client())
    stores.append(store)
    agent, model = make_agent(store, ["Postgres."])

    assert str(agent(QUESTION)).strip() == "Postgres."

    assert model.memory_block() is None
    counters = store.counters()
    assert (counters["recall_errors"], counters["errors.bad_response"]) == (1, 1)


# --- A server that drips its answer -------------------------------------------------------------


def test_membase_search_against_a_dripping_server_ends_each_attempt_at_its_deadline(
    loopback, stores, instant_backoff
) -> None:
    for _ in range(SDK_ATTEMPTS):
        loopback.on("POST", "/v1/search", drip(LONG_BODY, every=DRIP_EVERY, limit=DRIP_FOR))
    store = MembaseMemoryStore(client=loopback.client(timeout=DEADLINE))
    stores.append(store)

    status, text, elapsed = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))

    assert status == "error"
    assert "did not answer in time" in text and "try again in a minute" in text
    assert len(loopback.fake.sent("POST", "/v1/search")) == SDK_ATTEMPTS
    assert elapsed < SDK_ATTEMPTS * DEADLINE + SLACK, f"the tool call took {elapsed:.1f} s"
    # The requests ended, they were not merely abandoned: the server saw every connection close.
    assert wait_until(lambda: loopback.open_connections == 0, timeout=SLACK)


def test_a_late_recall_ends_at_its_deadline_even_when_the_headers_drip(loopback, stores, monkeypatch, caplog) -> None:
    # A store that builds its own client; its timeout is the deadline.
    monkeypatch.setattr(membase_client, "new_http_client", lambda url: httpx.Client(base_url=url, timeout=DEADLINE))
    monkeypatch.setattr(
        membase_client,
        "new_async_http_client",
        functools.partial(membase_client.new_async_http_client, timeout=DEADLINE),
    )
    caplog.set_level(logging.INFO, logger="membase_strands")
    loopback.on("POST", "/v1/search", drip_headers(every=DRIP_EVERY, limit=DRIP_FOR))
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, recall_timeout=0.2)
    stores.append(store)
    agent, model = make_agent(store, ["Postgres."])

    started = time.monotonic()
    assert str(agent(QUESTION)).strip() == "Postgres."
    assert model.memory_block() is None  # the turn went on without memory

    # No body chunk ever arrives: only each socket read being bounded by the time left ends the request.
    def late_failures() -> list[str]:
        return [m for m in messages(caplog) if "late recall failed" in m]

    assert wait_until(late_failures, timeout=DEADLINE + SLACK)
    assert time.monotonic() - started < DEADLINE + SLACK
    [late] = late_failures()
    assert "timed out" in late
    assert store.counters()["recall_late_completions"] == 1
    assert wait_until(lambda: loopback.open_connections == 0, timeout=SLACK)


async def test_a_captured_write_to_a_dripping_server_ends_in_the_background_at_its_deadline(
    loopback, stores, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="membase_strands")
    loopback.on("POST", "/v1/memories", drip(LONG_BODY, every=DRIP_EVERY, limit=DRIP_FOR))
    store = MembaseMemoryStore(client=loopback.client(timeout=DEADLINE), capture=True, write_timeout=0.2)
    stores.append(store)

    started = time.monotonic()
    with pytest.raises(MembaseWriteTimeout):
        await store.add(NOTE)

    assert wait_until(lambda: not membase_threads("membase-write"), timeout=DEADLINE + SLACK)
    assert time.monotonic() - started < DEADLINE + SLACK
    assert any("a write that ran out of time failed" in m for m in messages(caplog))
    # It failed, so the manager's retry sends it again (and this time Membase answers at once).
    assert await store.add(NOTE) is not None
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 2


class Passthrough(httpx.BaseTransport):
    """A user's own transport around httpx's: the store cannot reach its sockets."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_a_client_with_its_own_transport_still_ends_a_dripping_body_at_the_deadline(loopback, stores) -> None:
    loopback.on("POST", "/v1/memories", drip(LONG_BODY, every=DRIP_EVERY, limit=DRIP_FOR))
    http = httpx.Client(base_url=loopback.url, timeout=DEADLINE, transport=Passthrough())
    client = membase.Membase(api_key=API_KEY, base_url=loopback.url, http_client=http)
    store = MembaseMemoryStore(client=client)
    stores.append(store)

    try:
        status, text, elapsed = tool_turn(store, ToolCall("membase_save", {"content": NOTE}))
    finally:
        http.close()

    assert status == "error"
    assert "did not answer in time" in text and "may or may not have been saved" in text
    # Checked between body chunks: the deadline, then at most one more chunk.
    assert elapsed < DEADLINE + DRIP_EVERY + SLACK, f"the tool call took {elapsed:.1f} s"


def test_a_prompt_answer_is_untouched_by_the_deadline(loopback, stores) -> None:
    store = MembaseMemoryStore(client=loopback.client(timeout=DEADLINE))
    stores.append(store)

    status, text, _ = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))

    assert status == "success"
    assert f"1. [Main] {FACT}" in text


# --- A server that sends more hits than it was asked for ---------------------------------------


def three_hundred_hits(request: httpx.Request) -> httpx.Response:
    results = [
        {"content": f"Passage {i} about the ledger.", "container": "ctr_main", "container_name": "Main", "score": 1.0}
        for i in range(300)
    ]
    return httpx.Response(200, json={"results": results, "containers": [{"id": "ctr_main", "name": "Main"}]})


@pytest.mark.parametrize(("limit", "kept"), [(5, 5), (None, 5), (1, 1)])
def test_membase_search_keeps_at_most_the_limit_when_a_server_sends_too_many(
    fake: InMemoryMembase, make_store, limit, kept
):
    fake.always("POST", "/v1/search", three_hundred_hits)
    call: dict[str, Any] = {"query": "ledger"} if limit is None else {"query": "ledger", "limit": limit}

    status, text, _ = tool_turn(make_store(), ToolCall("membase_search", call))

    assert status == "success"
    assert text.startswith(f'Membase found {kept} passage{"s" if kept != 1 else ""} for "ledger":')
    assert f"{kept}. [Main] Passage {kept - 1} about the ledger." in text
    assert f"\n{kept + 1}. " not in text
    assert "Passage 280" not in text


def test_recall_keeps_at_most_the_limit_when_a_server_sends_too_many(fake: InMemoryMembase, make_store) -> None:
    fake.always("POST", "/v1/search", three_hundred_hits)
    agent, model = make_agent(make_store(), ["ok"])

    agent(QUESTION)

    block = model.memory_block()
    assert block is not None
    assert block.count("[Main] Passage") == 5
    assert "Passage 4 about" in block and "Passage 5 about" not in block


async def test_search_keeps_at_most_max_search_results_when_a_server_sends_too_many(fake, make_store) -> None:
    fake.always("POST", "/v1/search", three_hundred_hits)

    entries = await make_store().search("ledger", {"max_search_results": 3})

    assert [e.content for e in entries] == [f"[Main] Passage {i} about the ledger." for i in range(3)]


# --- Idle connections --------------------------------------------------------------------------------


def test_a_stores_idle_connections_close_after_their_keep_alive_expiry_without_another_request(
    loopback, stores, monkeypatch
) -> None:
    # Both of a store's clients, with a short keep-alive: the recall's (awaited) and the tools' (blocking).
    limits = httpx.Limits(keepalive_expiry=0.3)
    monkeypatch.setattr(membase_client, "new_http_client", lambda url: httpx.Client(base_url=url, limits=limits))
    monkeypatch.setattr(
        membase_client, "new_async_http_client", functools.partial(membase_client.new_async_http_client, limits=limits)
    )
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url)
    stores.append(store)
    agent, model = make_agent(store, [ToolCall("membase_save", {"content": NOTE}), "Saved."])

    agent(QUESTION)
    assert model.memory_block(0) is not None and loopback.fake.saved() == [NOTE]
    assert loopback.connections == 2  # one per client, each kept alive after its request

    idle_for = RECENTLY_USED_SECONDS + SLACK  # a pool used as recently as that is left to tidy itself
    assert wait_until(lambda: loopback.open_connections == 0, timeout=idle_for), "an idle connection stayed open"
    assert loopback.connections == 2  # closed by the sweep, not by a request that found it expired

    agent.messages.clear()
    agent(QUESTION)  # and the store goes on as before, on a new connection
    assert model.memory_block(2) is not None

"""Faults a web server's network brings: dripping answers, bodies cut mid-character, too many hits, many sockets.

The dripping and cut answers come from the real loopback HTTP server (``tests/support/loopback.py``):
``httpx.MockTransport`` has no socket, so it cannot drip. Every path runs through the real
``strands.Agent`` or the store's protocol methods and the real ``membase.Membase`` client, over the
connection pool the library shares between the stores built from a key for one base URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import membase
import membase.client
import pytest

from membase_strands import MembaseMemoryStore, MembaseWriteTimeout, _http
from membase_strands.testing import API_KEY, InMemoryMembase, ToolCall
from tests.support.loopback import LoopbackMembase, arrived, drip, drip_headers, meet, raw_answer
from tests.support.store_helpers import FACT, QUESTION, make_agent, result_text, until, wait_until

DEADLINE = 0.5  # the whole-call deadline of one attempt, for the tests about it
DRIP_EVERY = 0.1  # well inside httpx's per-read timeout, so only a whole-call deadline ends the call
DRIP_BOUND = int(10 * DEADLINE / DRIP_EVERY)  # bytes a drip sends in ten deadlines: far more than one attempt takes
BUDGET = 0.3  # the recall or write budget, for the tests about what happens after it runs out
LONG = 30.0  # every other wait: a loaded machine cannot run out of it
SDK_ATTEMPTS = 3
LONG_BODY = b'{"results": [], "pad": "' + b"x" * 500 + b'"}'  # 50 s of drip at DRIP_EVERY
CUT_MID_CHARACTER = b'{"a": "\xe2\x82'  # the first two bytes of a three-byte UTF-8 character, then nothing
NOTE = "Remember that the ledger runs on Postgres."


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        yield server


@pytest.fixture
def deadline(monkeypatch: pytest.MonkeyPatch) -> float:
    """Attempts through the shared pools end ``DEADLINE`` s after they start.

    Read when the pool for a base URL is built, at the first store for it: the loopback server's URL is one no
    earlier server had, so its pool is built after this.
    """
    monkeypatch.setattr(_http, "ATTEMPT_SECONDS", DEADLINE)
    return DEADLINE


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


@pytest.fixture
def built(loopback: LoopbackMembase, stores: list[MembaseMemoryStore]) -> Any:
    """Build a store from the key for the loopback server, as in production; each is closed after the test."""

    def build(**options: Any) -> MembaseMemoryStore:
        store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, **options)
        stores.append(store)
        return store

    return build


def tool_turn(store: MembaseMemoryStore, call: ToolCall) -> tuple[str, str]:
    """One agent turn in which the model makes ``call``: the tool result's status and text."""
    agent, model = make_agent(store, [call, "done"], injection=False)
    agent("go")
    result = model.tool_results()[-1]
    return result["status"], result_text(result)


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("membase_strands")]


# --- 2xx bodies that are not valid UTF-8 ---------------------------------------------------------


async def test_a_note_answered_with_a_body_cut_mid_character_is_saved_once(loopback, built, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="membase_strands")
    loopback.on("POST", "/v1/memories", raw_answer(200, CUT_MID_CHARACTER))
    store = built(capture=True, write_timeout=LONG)

    assert await store.add(NOTE) is None  # no answer to hand back, but no failure either

    assert [n.content for n in loopback.fake.notes if n.content == NOTE] == [NOTE]
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 1
    # Counted as the write's thread settles it, which may be a moment after add() returned.
    assert wait_until(lambda: store.counters()["writes_saved"] == 1, timeout=LONG)
    assert store.counters()["write_errors"] == 0
    [warning] = [m for m in messages(caplog) if "counting it as saved" in m]
    assert "reason=<2xx answer is not valid UTF-8" in warning
    # The manager's retry of the same fact finds it saved and sends nothing.
    assert await store.add(NOTE) is None
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 1


def test_membase_save_answered_with_a_body_cut_mid_character_tells_the_model_it_was_saved(loopback, built) -> None:
    loopback.on("POST", "/v1/memories", raw_answer(200, CUT_MID_CHARACTER))
    store = built()

    status, text = tool_turn(store, ToolCall("membase_save", {"content": NOTE}))

    assert (status, text) == ("success", "Saved to Membase.")
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 1


def test_membase_search_answered_with_a_body_cut_mid_character_says_the_answer_was_unreadable(loopback, built) -> None:
    loopback.on("POST", "/v1/search", raw_answer(200, CUT_MID_CHARACTER))
    store = built()

    status, text = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))

    assert status == "error"
    assert text.startswith("Membase sent an answer that could not be read")
    assert "not valid UTF-8" in text
    assert "Nothing was searched" not in text
    assert len(loopback.fake.sent("POST", "/v1/search")) == 1  # a 2xx is an answer: not retried
    assert store.counters()["errors.bad_response"] == 1


def test_membase_profile_answered_with_a_body_cut_mid_character_says_the_answer_was_unreadable(loopback, built) -> None:
    loopback.on("GET", "/v1/profile", raw_answer(200, CUT_MID_CHARACTER))
    store = built()

    status, text = tool_turn(store, ToolCall("membase_profile", {}))

    assert status == "error"
    assert "could not be read" in text and "not valid UTF-8" in text


def test_a_recall_answered_with_a_body_cut_mid_character_fails_open_as_an_unreadable_answer(loopback, built) -> None:
    loopback.on("POST", "/v1/search", raw_answer(200, CUT_MID_CHARACTER))
    store = built(recall_timeout=LONG)
    agent, model = make_agent(store, ["Postgres."])

    assert str(agent(QUESTION)).strip() == "Postgres."

    assert model.memory_block() is None
    counters = store.counters()
    assert (counters["recall_errors"], counters["errors.bad_response"]) == (1, 1)


# --- A server that drips its answer -------------------------------------------------------------


def test_membase_search_against_a_dripping_server_ends_each_attempt_at_its_deadline(
    loopback, built, deadline, instant_backoff
) -> None:
    for _ in range(SDK_ATTEMPTS):
        loopback.on("POST", "/v1/search", drip(LONG_BODY, every=DRIP_EVERY))
    store = built()

    status, text = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))

    assert status == "error"
    assert "did not answer in time" in text and "try again in a minute" in text
    assert len(loopback.fake.sent("POST", "/v1/search")) == SDK_ATTEMPTS
    # Each attempt was ended by the client a few bytes in: not by the body coming whole, nor by the server.
    assert wait_until(lambda: len(loopback.drips) == SDK_ATTEMPTS, timeout=LONG)
    for dripped in loopback.drips:
        assert dripped.hung_up and dripped.sent <= DRIP_BOUND, dripped
    # The requests ended, they were not merely abandoned: the server saw every connection close.
    assert wait_until(lambda: loopback.open_connections == 0, timeout=LONG)


def test_a_late_recall_against_dripping_headers_does_not_hold_the_turn_and_its_outcome_is_logged(
    loopback, built, caplog
) -> None:
    # Headers that drip are not bounded at the socket (no public API for that): the recall's budget bounds the
    # turn, and the request goes on in the background until the server stops.
    caplog.set_level(logging.INFO, logger="membase_strands")
    sent, stop = threading.Event(), threading.Event()
    loopback.on("POST", "/v1/search", arrived(sent, drip_headers(every=DRIP_EVERY, stop=stop)))
    store = built(recall_timeout=BUDGET)
    agent, model = make_agent(store, ["Postgres."])

    def late_failures() -> list[str]:
        return [m for m in messages(caplog) if "late recall failed" in m]

    try:
        assert str(agent(QUESTION)).strip() == "Postgres."

        # The turn went on without memory while the server still drips (it stops only when told to).
        assert model.memory_block() is None
        assert loopback.drips == []
        counters = store.counters()
        assert (counters["recall_timeouts"], counters["recall_late_completions"]) == (1, 0)
        assert late_failures() == []
        assert sent.wait(LONG)
    finally:
        stop.set()

    # The server stops and closes the connection mid-headers: the late request fails, and that is logged once.
    assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=LONG)
    [late] = late_failures()
    assert f"store=<{store.name}>" in late
    assert [dripped.hung_up for dripped in loopback.drips] == [False]  # the server stopped, the client waited
    assert len(loopback.fake.sent("POST", "/v1/search")) == 1
    assert wait_until(lambda: loopback.open_connections == 0, timeout=LONG)


async def test_a_captured_write_to_a_dripping_server_ends_in_the_background_and_its_failure_is_logged(
    loopback, built, deadline, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="membase_strands")
    loopback.on("POST", "/v1/memories", drip(LONG_BODY, every=DRIP_EVERY))
    store = built(capture=True, write_timeout=BUDGET)

    with pytest.raises(MembaseWriteTimeout):
        await store.add(NOTE)  # the body cannot arrive within the budget: it drips for longer than the deadline

    assert await until(lambda: any("a write that ran out of time failed" in m for m in messages(caplog)), LONG)
    assert await until(lambda: len(loopback.drips) == 1, LONG)  # the server finds the client gone at its next byte
    [dripped] = loopback.drips
    assert dripped.hung_up and dripped.sent <= DRIP_BOUND, dripped  # ended by the deadline, a few bytes in
    assert store.counters()["write_errors"] == 1
    # It failed, so the manager's retry sends it again (and this time Membase answers at once). That write is not
    # about the budget: if a loaded machine makes it late, it finishes in the background all the same.
    with contextlib.suppress(MembaseWriteTimeout):
        await store.add(NOTE)
    assert await until(lambda: store.counters()["writes_saved"] == 1, LONG)
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 2


def test_a_prompt_answer_is_untouched_by_the_deadline(loopback, built, deadline) -> None:
    store = built()

    status, text = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))

    assert status == "success"
    assert f"1. [Main] {FACT}" in text
    assert loopback.drips == []


class Chunks(httpx.SyncByteStream):
    """A body of no stated length, sent in chunks; those after ``late`` come once the deadline has passed."""

    def __init__(self, chunks: list[bytes], late: int, deadline: float) -> None:
        self.chunks, self.late, self.deadline = chunks, late, deadline

    def __iter__(self) -> Iterator[bytes]:
        for index, chunk in enumerate(self.chunks):
            while index == self.late and time.monotonic() <= self.deadline:  # what this test is about: the deadline
                time.sleep(0.01)
            yield chunk


def chunked_client(chunks: list[bytes], late: int) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Chunks(chunks, late, time.monotonic() + DEADLINE))

    return _http.DeadlineClient(transport=httpx.MockTransport(answer), timeout=DEADLINE)


def test_a_body_of_no_stated_length_whose_last_chunk_comes_after_the_deadline_is_kept_whole() -> None:
    """Only more data tells that such a body was not whole: a saved note must not read as failed (and be resent)."""
    with chunked_client([b'{"id": ', b'"mem_1"}'], late=1) as client:
        assert client.post("http://membase.test/v1/memories").json() == {"id": "mem_1"}


def test_a_body_of_no_stated_length_still_arriving_after_the_deadline_is_ended() -> None:
    with chunked_client([b'{"results": [', b"1, ", b"2]}"], late=1) as client:
        with pytest.raises(httpx.ReadTimeout, match="whole-call deadline"):
            client.post("http://membase.test/v1/search")


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

    status, text = tool_turn(make_store(), ToolCall("membase_search", call))

    assert status == "success"
    assert text.startswith(f'Membase found {kept} passage{"s" if kept != 1 else ""} for "ledger":')
    assert f"{kept}. [Main] Passage {kept - 1} about the ledger." in text
    assert f"\n{kept + 1}. " not in text
    assert "Passage 280" not in text


def test_recall_keeps_at_most_the_limit_when_a_server_sends_too_many(fake: InMemoryMembase, make_store) -> None:
    fake.always("POST", "/v1/search", three_hundred_hits)
    agent, model = make_agent(make_store(recall_timeout=LONG), ["ok"])

    agent(QUESTION)

    block = model.memory_block()
    assert block is not None
    assert block.count("[Main] Passage") == 5
    assert "Passage 4 about" in block and "Passage 5 about" not in block


async def test_search_keeps_at_most_max_search_results_when_a_server_sends_too_many(fake, make_store) -> None:
    fake.always("POST", "/v1/search", three_hundred_hits)

    entries = await make_store(recall_timeout=LONG).search("ledger", {"max_search_results": 3})

    assert [e.content for e in entries] == [f"[Main] Passage {i} about the ledger." for i in range(3)]


# --- Sockets ------------------------------------------------------------------------------------

KEEP_ALIVE = 3


def test_the_shared_pool_keeps_at_most_its_keep_alive_limit_of_idle_sockets_however_many_stores(
    loopback, built, monkeypatch
) -> None:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=KEEP_ALIVE, keepalive_expiry=LONG)
    monkeypatch.setattr(_http, "LIMITS", limits)  # read when the pool for the loopback server's URL is built
    users = 12
    # The server holds each search until all of them are in: twelve requests in flight at once, a socket each.
    together = threading.Barrier(users)
    loopback.on("POST", "/v1/search", *[meet(together) for _ in range(users)])
    made = [built(name=f"user-{i}", recall_timeout=LONG) for i in range(users)]

    async def recall_all() -> list[list[str]]:
        answers = await asyncio.gather(*(store.search(QUESTION) for store in made))
        return [[entry.content for entry in entries] for entries in answers]

    assert asyncio.run(recall_all()) == [[f"[Main] {FACT}"]] * users
    assert loopback.connections == users

    # Idle now: the pool closed the sockets past its keep-alive limit and keeps the rest for the next turns.
    assert wait_until(lambda: loopback.open_connections == KEEP_ALIVE, timeout=LONG)
    assert loopback.connections == users
    assert asyncio.run(made[0].search(QUESTION))  # a kept socket serves the next turn
    assert loopback.connections == users

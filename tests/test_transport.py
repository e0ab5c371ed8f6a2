"""How a store's requests travel: whole-attempt bounds on dripping answers and stalled connects, bodies of no stated
length, more hits than asked for, connections of each store's own (one answer too many never reaches another user),
idle connections closed once their keep-alive ends, a name's addresses tried in turn, TLS trust read when the store is
built, and the resend rule for a write a gateway answered with an error Membase does not document.

Sockets come from real loopback servers (``httpx.MockTransport`` has none), certificates from trustme. Proxies are in
``test_proxies.py``; what a hostile server does to users sharing a process (cookies, stale connections, the size cap,
an echoed key) is in ``test_shared_runtime.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import membase
import membase.client
import pytest

from membase_strands import MembaseMemoryStore, MembaseRecallTimeout, MembaseWriteTimeout
from membase_strands.testing import API_KEY, InMemoryMembase, ToolCall
from tests.support.loopback import (
    HANG_UPS,
    FullBacklog,
    LoopbackMembase,
    SilentTLS,
    as_usual,
    drip,
    drip_header_lines,
    half_close,
    hang_up,
    meet,
    raw_answer,
    twice,
)
from tests.support.proxy import Certificates
from tests.support.store_helpers import FACT, LONG, QUESTION, make_agent, result_text, until, wait_until

DEADLINE = 0.5  # request_timeout, for the tests about it
DRIP_EVERY = 0.1  # well inside httpx's per-read timeout: only the whole-attempt bound ends the call
DRIP_BOUND = int(10 * DEADLINE / DRIP_EVERY)  # bytes a drip sends in ten deadlines: far more than one attempt takes
LONG_BODY = b'{"results": [], "pad": "' + b"x" * 500 + b'"}'  # 50 s of drip
NOTE = "Remember that the ledger runs on Postgres."
KEEP_ALIVE = 4.0  # how long an idle connection is kept, as docs/servers.md says


def recall(store: MembaseMemoryStore) -> list[str]:
    return [entry.content for entry in asyncio.run(store.search(QUESTION))]


def tool_turn(store: MembaseMemoryStore, call: ToolCall) -> tuple[str, str]:
    """One agent turn in which the model makes ``call``: the tool result's status and text."""
    agent, model = make_agent(store, [call, "done"], injection=False)
    agent("go")
    result = model.tool_results()[-1]
    return result["status"], result_text(result)


# --- Answers that drip, and bodies of no stated length ----------------------------------------------
def test_a_tool_against_a_server_dripping_its_body_or_its_headers_ends_each_attempt_at_request_timeout(
    loopback, built, instant_backoff
):
    """Each byte of a body, or each header line, comes well inside any per-read timeout: only the bound on the whole
    attempt ends it. The SDK's three attempts meet a dripped body, header lines dripped without end, and a dripped
    body again; the tool tells the model to try again in a minute, and each drip was ended by the client hanging up
    a few bytes in (not by the body coming whole, nor by the server)."""
    stop = threading.Event()
    body = drip(LONG_BODY, every=DRIP_EVERY)
    loopback.on("POST", "/v1/search", body, drip_header_lines(every=DRIP_EVERY, limit=LONG, stop=stop), body)
    store = built(request_timeout=DEADLINE)
    try:
        status, text = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))
    finally:
        stop.set()

    assert status == "error" and "did not answer in time" in text and "try again in a minute" in text
    assert len(loopback.fake.sent("POST", "/v1/search")) == 3  # the SDK's three attempts
    assert wait_until(lambda: len(loopback.drips) == 3, timeout=LONG)
    assert all(dripped.hung_up and dripped.sent <= DRIP_BOUND for dripped in loopback.drips), loopback.drips
    assert wait_until(lambda: loopback.open_connections == 0, timeout=LONG)  # ended, not merely abandoned
    # A prompt answer is untouched by the bound.
    assert tool_turn(store, ToolCall("membase_search", {"query": "ledger"})) == ("success", search_text())


def search_text() -> str:  # what membase_search reads to the model when the loopback server answers at once
    return f'Membase found 1 passage for "ledger":\n1. [Main] {FACT}'


async def test_a_recall_and_a_captured_write_left_running_are_hung_up_at_request_timeout_when_headers_drip(
    loopback, built
):
    """A recall or write past its budget goes on alone on a library thread, with no caller to hang up: a server
    dripping its header lines (never a read timeout) is cut off at request_timeout, and the outcome is a timeout."""
    for route in ("/v1/search", "/v1/memories"):
        loopback.on("POST", route, drip_header_lines(every=DRIP_EVERY, limit=LONG))
    store = built(capture=True, recall_timeout=DEADLINE / 2, write_timeout=DEADLINE / 2, request_timeout=DEADLINE)

    with pytest.raises(MembaseRecallTimeout):
        await store.search("ledger")
    with pytest.raises(MembaseWriteTimeout):
        await store.add(NOTE)

    assert await until(lambda: len(loopback.drips) == 2, LONG)  # each drip ends at its next line: the client is gone
    assert all(dripped.hung_up and dripped.sent <= DRIP_BOUND for dripped in loopback.drips), loopback.drips
    assert await until(
        lambda: store.counters()["recall_late_completions"] == store.counters()["writes_unknown"] == 1, LONG
    )
    assert store.counters().get("errors.timeout") == 2  # each ended as a timeout, not as a lost connection


async def test_a_captured_write_cut_off_mid_answer_is_never_sent_again_and_said_so_once(loopback, built, caplog):
    """Membase read the note, then its answer dripped past request_timeout: the note may be saved, so neither the
    store nor the manager's retry sends it again (an unkeyed write sent twice is stored twice)."""
    caplog.set_level(logging.INFO, logger="membase_strands")
    loopback.on("POST", "/v1/memories", drip(LONG_BODY, every=DRIP_EVERY))
    store = built(capture=True, write_timeout=DEADLINE / 2, request_timeout=DEADLINE)

    with pytest.raises(MembaseWriteTimeout):
        await store.add(NOTE)  # the body drips for longer than the write budget

    unknown = "a write that ran out of time ended without an answer: Membase may or may not have saved it"
    assert await until(lambda: any(unknown in r.getMessage() for r in caplog.records), LONG)
    assert await until(lambda: len(loopback.drips) == 1, LONG)  # the server finds the client gone at its next byte
    assert loopback.drips[0].hung_up and loopback.drips[0].sent <= DRIP_BOUND, loopback.drips
    assert await store.add(NOTE) is None  # the manager's retry sends nothing
    store.close()
    assert len(loopback.fake.sent("POST", "/v1/memories")) == 1
    counters = store.counters()
    assert (counters["writes_unknown"], counters["writes_lost"], counters["writes_deduplicated"]) == (1, 0, 1)
    assert sum(unknown in r.getMessage() for r in caplog.records) == 1


class Chunks(httpx.SyncByteStream):
    """A body of no stated length; the chunks from ``late`` on come once the attempt's deadline has passed."""

    def __init__(self, chunks: list[bytes], late: int) -> None:
        self.chunks, self.late, self.deadline = chunks, late, time.monotonic() + DEADLINE

    def __iter__(self) -> Iterator[bytes]:
        for index, chunk in enumerate(self.chunks):
            while index == self.late and time.monotonic() <= self.deadline:  # what these tests are about: the bound
                time.sleep(0.01)
            yield chunk


def chunked(chunks: list[bytes], late: int, **options: Any) -> tuple[MembaseMemoryStore, list[httpx.Request]]:
    """A store whose every answer is ``chunks`` (from ``late`` on, past the deadline); and the requests it sent."""
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, stream=Chunks(chunks, late))

    transport = httpx.MockTransport(answer)
    options["request_timeout"] = DEADLINE
    store = MembaseMemoryStore(api_key=API_KEY, base_url="https://membase.test", transport=transport, **options)
    return store, sent


async def test_a_body_of_no_stated_length_is_kept_whole_when_its_last_chunk_is_late_and_ended_when_more_comes():
    """Only more data tells that such a body was not whole: a saved note must not read as failed (and be resent)."""
    store, sent = chunked([b'{"memory_id": ', b'"mem_1"}'], 1, capture=True, write_timeout=LONG)
    assert await store.add(NOTE) is not None
    assert (len(sent), store.counters()["writes_saved"], store.counters()["write_errors"]) == (1, 1, 0)
    store.close()

    store, sent = chunked([b'{"results": [', b"1, ", b"2]}"], 1, recall_timeout=LONG)
    with pytest.raises(membase.APITimeoutError):
        await store.search(QUESTION)
    assert (len(sent), store.counters()["errors.timeout"]) == (1, 1)
    store.close()


# --- More hits than were asked for ----------------------------------------------------------------
def three_hundred_hits(request: httpx.Request) -> httpx.Response:
    hits = [{"content": f"Passage {i} about the ledger.", "container": "ctr_main", "score": 1.0} for i in range(300)]
    return httpx.Response(200, json={"results": hits, "containers": [{"id": "ctr_main", "name": "Main"}]})


def test_recall_the_tool_and_search_keep_at_most_their_limit_when_a_server_sends_too_many(fake, make_store):
    fake.always("POST", "/v1/search", three_hundred_hits)
    store = make_store()

    for limit, kept in [(5, 5), (None, 5), (1, 1)]:
        call = {"query": "ledger"} if limit is None else {"query": "ledger", "limit": limit}
        status, text = tool_turn(store, ToolCall("membase_search", call))
        assert text.startswith(f'Membase found {kept} passage{"s" if kept != 1 else ""} for "ledger":'), text
        assert f"{kept}. [Main] Passage {kept - 1} about the ledger." in text and f"\n{kept + 1}. " not in text

    agent, model = make_agent(store, ["ok"])
    agent(QUESTION)
    assert (model.memory_block() or "").count("[Main] Passage") == 5
    entries = asyncio.run(store.search("ledger", {"max_search_results": 3}))
    assert [e.content for e in entries] == [f"[Main] Passage {i} about the ledger." for i in range(3)]


# --- Connections: each store's own --------------------------------------------------------------------------------
def test_requests_at_once_each_get_a_connection_their_store_keeps_alive_for_its_next_turns(loopback, built):
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
    for store in made:  # each store's kept socket serves its own next turn
        assert recall(store) == [f"[Main] {FACT}"]
    assert loopback.open_connections == loopback.connections == users
    assert len({seen.connection for seen in loopback.seen}) == users


def key_of(user: str) -> str:
    return "mb_" + hashlib.sha256(user.encode()).hexdigest()[:32]


def test_six_users_in_turn_after_one_answer_too_many_each_see_only_their_own_passages():
    """Something in front of Membase sends every answer twice, in one write: a connection is then one answer behind,
    and whoever sends the next request on it reads the answer before. Six users recall in turn, twice each, each with
    a store of their own: every one is shown their own passage only, and no connection ever carried two users' keys."""
    users = [f"user{n}" for n in range(1, 7)]
    fake = InMemoryMembase()
    for user in users:
        fake.account(key_of(user)).remember(f"The secret of {user} is in vault {user[-1]}.")
    with LoopbackMembase(fake) as server:
        server.always("POST", "/v1/search", twice)
        stores = [MembaseMemoryStore(api_key=key_of(u), base_url=server.url, recall_timeout=LONG) for u in users]
        try:
            shown = {user: [] for user in users}  # type: ignore[var-annotated]
            for _ in range(2):
                for user, store in zip(users, stores, strict=True):
                    shown[user].append("\n".join(recall(store)))
        finally:
            for store in stores:
                store.close()
        keys_of: dict[int, set[str]] = {}
        for seen in server.seen:
            keys_of.setdefault(seen.connection, set()).add(seen.key)

    for user in users:
        others = [other for other in users if other != user]
        assert all(f"secret of {user} " in text for text in shown[user]), (user, shown[user])
        assert not [text for text in shown[user] for other in others if f"secret of {other} " in text], shown[user]
    assert [keys for keys in keys_of.values() if len(keys) > 1] == []


@pytest.mark.parametrize("server_side", ["kept open", "closed by the server"])
def test_no_connection_is_left_open_2_s_after_its_keep_alive_ends(loopback, built, server_side):
    """Eight recalls at once leave eight idle connections, then nothing more is asked. The library closes each at
    most 2 s after its keep-alive ends: 4 s after its answer, or at once when the server closed its side (where the
    client's socket would otherwise sit in CLOSE_WAIT)."""
    users = 8
    together = threading.Barrier(users)
    then = as_usual if server_side == "kept open" else half_close
    loopback.on("POST", "/v1/search", *[meet(together, then) for _ in range(users)])
    made = [built(name=f"user-{i}", recall_timeout=LONG) for i in range(users)]

    async def recall_all() -> None:
        await asyncio.gather(*(store.search(QUESTION) for store in made))

    asyncio.run(recall_all())
    if server_side == "kept open":
        assert loopback.wait_for(lambda: loopback.open_connections == 0, KEEP_ALIVE + 2), loopback.open_connections
    else:
        assert loopback.wait_for(lambda: len(loopback.hung_up) == users, 2), f"{len(loopback.hung_up)} closed"
    assert len(loopback.requests("POST", "/v1/search")) == users


# --- TLS -------------------------------------------------------------------------------------------------------------
def test_a_store_trusts_the_certificates_the_environment_named_when_it_was_built(
    built, clean_network_env, certificates, instant_backoff
):
    with LoopbackMembase(tls=certificates.server()) as server:
        server.fake.remember(FACT)
        untrusting = built(base_url=server.url, recall_timeout=LONG)
        clean_network_env.setenv("SSL_CERT_FILE", str(certificates.ca_file))
        trusting = built(base_url=server.url, recall_timeout=LONG)
        clean_network_env.delenv("SSL_CERT_FILE")  # read once, when each store was built

        assert recall(trusting) == [f"[Main] {FACT}"]
        assert tool_turn(trusting, ToolCall("membase_search", {"query": "ledger"})) == ("success", search_text())
        with pytest.raises(membase.APIConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            recall(untrusting)
        assert "could not be reached" in tool_turn(untrusting, ToolCall("membase_search", {"query": "ledger"}))[1]
        assert len(server.fake.sent()) == 2


def test_a_ca_bundle_rotated_in_place_is_trusted_by_the_stores_built_after_it(built, clean_network_env, tmp_path):
    """SSL_CERT_FILE names a bundle that is then rewritten in place (same path, same file) with a new authority, as
    certificate rotation does: a store built afterwards trusts the new one, as a plain httpx.Client() built then does,
    and a store built before keeps what it trusted when it was built."""
    bundle = tmp_path / "company-ca.pem"
    clean_network_env.setenv("SSL_CERT_FILE", str(bundle))
    old = Certificates(bundle)
    with LoopbackMembase(tls=old.server()) as before_server:
        before_server.fake.remember(FACT)
        before = built(base_url=before_server.url, recall_timeout=LONG)
        assert recall(before) == [f"[Main] {FACT}"]
        new = Certificates(bundle)  # rotated in place
        with LoopbackMembase(tls=new.server()) as after_server:
            after_server.fake.remember(FACT)
            after = built(base_url=after_server.url, recall_timeout=LONG)
            assert recall(after) == [f"[Main] {FACT}"]
            with httpx.Client() as plain:
                headers = {"Authorization": f"Bearer {API_KEY}"}
                assert plain.get(f"{after_server.url}/v1/containers", headers=headers).status_code == 200
        assert recall(before) == [f"[Main] {FACT}"]


# --- A save Membase may have read is never sent again ----------------------------------------------------------------
@pytest.mark.parametrize("way", HANG_UPS)
def test_a_save_membase_read_before_the_connection_ended_is_stored_once_whichever_path_sent_it(loopback, built, way):
    """The server reads the save (the fake stores it), then ends the connection without a whole answer. Neither the
    transport, nor the store, nor the manager's retry sends it again: ``add``, a captured turn and ``membase_save``."""
    options = {"container": "Main", "capture": True, "write_timeout": LONG, "recall_timeout": LONG}
    noted = {path: f"Remember the {path} note about the ledger ({way})." for path in ("add", "captured", "tool")}

    loopback.on("POST", "/v1/memories", hang_up(way))
    store = built(name="add", **options)
    with pytest.raises(membase.APIConnectionError, match="may or may not have saved it"):  # said to the manager
        asyncio.run(store.add(noted["add"]))
    assert asyncio.run(store.add(noted["add"])) is None  # the manager's retry: nothing is sent

    loopback.on("POST", "/v1/memories", hang_up(way))
    agent, _ = make_agent(built(name="captured", extraction=True, **options), ["Noted.", "Noted again."])
    agent(noted["captured"])  # its flush fails: the manager keeps the batch
    agent("And that is all.")  # its flush retries the batch: only the new words are sent

    loopback.on("POST", "/v1/memories", hang_up(way))
    tool_agent, model = make_agent(
        built(name="tool", **options), [ToolCall("membase_save", {"content": noted["tool"]})]
    )
    tool_agent("Please remember it.")
    assert model.tool_results()[-1]["status"] == "error"

    saved = loopback.fake.saved()
    assert [saved.count(note) for note in noted.values()] == [1, 1, 1], saved
    assert "And that is all." in saved
    sent = [seen.body["content"] for seen in loopback.requests("POST", "/v1/memories")]
    assert len(sent) == len(set(sent)) == 4, sent  # each once: nothing went out twice


@pytest.mark.parametrize("answer", ["503", "520", "524", "400 without Membase's envelope"])
def test_a_note_membase_stored_before_a_gateway_answered_an_error_is_stored_once(loopback, built, answer):
    """Membase reads and stores the note, then what stands in front of it answers with an error Membase does not
    document: 503 (Envoy, Heroku), 520 or 524 (Cloudflare), or a 4xx page without Membase's error envelope. The note
    may be stored, so neither the store, nor the manager's retry, nor membase_save sends it again."""
    code = int(answer.split()[0])
    page = raw_answer(code, b"<html><body>error code: %d</body></html>" % code)
    options = {"container": "Main", "capture": True, "write_timeout": LONG, "recall_timeout": LONG}
    loopback.on("POST", "/v1/memories", page)
    store = built(name="add", **options)
    with pytest.raises(membase.APIStatusError, match="may or may not have saved it"):  # said to the manager
        asyncio.run(store.add(NOTE))
    assert asyncio.run(store.add(NOTE)) is None  # the manager's retry: nothing is sent

    loopback.on("POST", "/v1/memories", page)
    tool_agent, model = make_agent(built(name="tool", **options), [ToolCall("membase_save", {"content": FACT}), "ok"])
    tool_agent("Please remember it.")
    assert "may or may not have been saved" in model.tool_result_text()

    assert [loopback.fake.saved().count(note) for note in (NOTE, FACT)] == [1, 1]
    assert len(loopback.requests("POST", "/v1/memories")) == 2
    assert store.counters()["writes_unknown"] == 1


# --- Connects that stall, and names with several addresses -------------------------------------------------------
def test_a_connect_that_stalls_is_one_attempt_per_sdk_attempt_and_a_drip_after_it_ends_with_it(
    built, instant_backoff, certificates, clean_network_env
):
    """A server takes every connection and never answers its TLS handshake: the connect stalls (this test's own
    listener counts the connections). A recall's attempt ends at request_timeout with one connection, and is not tried
    again past its deadline; a tool's three attempts make three. Then a handshake is answered half an attempt late and
    the server drips header lines: the attempt's deadline ends both, the drip within the attempt's lines."""
    clean_network_env.setenv("SSL_CERT_FILE", str(certificates.ca_file))
    silent = SilentTLS()
    try:
        store = built(base_url=silent.url, recall_timeout=LONG, request_timeout=DEADLINE)
        with pytest.raises(membase.APITimeoutError):
            recall(store)
        assert silent.wait_for(lambda: len(silent.taken) >= 1) and len(silent.taken) == 1
        status, text = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))
        assert status == "error" and "did not answer in time" in text
        assert silent.wait_for(lambda: len(silent.taken) >= 4) and len(silent.taken) == 1 + 3  # one per SDK attempt

        attempt, every = 2.0, 0.1
        store = built(base_url=silent.url, recall_timeout=LONG, request_timeout=attempt)
        silent.answer_next(certificates.server(), after=attempt / 2, every=every)
        with pytest.raises(membase.APITimeoutError):
            recall(store)
        assert silent.wait_for(lambda: len(silent.dripped) == 1)
        [dripped] = silent.dripped
        assert dripped.hung_up and dripped.lines_within(attempt / 2, every), dripped
    finally:
        silent.close()


def test_a_name_whose_first_address_stalls_is_served_by_its_next_within_request_timeout(loopback, built, monkeypatch):
    """The name Membase is reached by has two addresses, as a hosts file giving ``localhost`` both would: ::1 first,
    where every connect stalls (a listener with a full backlog), then 127.0.0.1, where Membase serves. The recall is
    served within request_timeout: the first address does not take all of it."""
    port = int(loopback.url.split(":")[2].split("/")[0])
    try:
        stalled = FullBacklog("::1", port)
    except OSError as error:
        pytest.skip(f"no IPv6 loopback listener on the port: {error}")
    resolve = socket.getaddrinfo

    def two_addresses(host: Any, *args: Any, **kwargs: Any) -> Any:  # the hosts file's answer for the name
        if host != "membase.test":
            return resolve(host, *args, **kwargs)
        tcp = (socket.SOCK_STREAM, socket.IPPROTO_TCP, "")
        return [(socket.AF_INET6, *tcp, ("::1", port, 0, 0)), (socket.AF_INET, *tcp, ("127.0.0.1", port))]

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    attempt = 3.0
    try:
        named = loopback.url.replace("127.0.0.1", "membase.test")
        store = built(base_url=named, recall_timeout=LONG, request_timeout=attempt)
        assert recall(store) == [f"[Main] {FACT}"]  # a timeout if the first address had taken all of it
    finally:
        stalled.close()
    assert len(loopback.requests("POST", "/v1/search")) == 1

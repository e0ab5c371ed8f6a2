"""How a store's requests travel: whole-attempt bounds on dripping answers, bodies of no stated length, more hits than
asked for, connections of its own per library thread, and TLS and proxy settings read once, when the store is built.

Sockets come from the real loopback HTTP server (``httpx.MockTransport`` has none). What a hostile server does to
users sharing the runtime (cookies, stale connections, the size cap, an echoed key) is in ``test_shared_runtime.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
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
    drip,
    drip_header_lines,
    hang_up,
    listen_overflows,
    meet,
)
from tests.support.store_helpers import FACT, LONG, QUESTION, make_agent, result_text, until, wait_until

DEADLINE = 0.5  # request_timeout, for the tests about it
DRIP_EVERY = 0.1  # well inside httpx's per-read timeout: only the whole-attempt bound ends the call
DRIP_BOUND = int(10 * DEADLINE / DRIP_EVERY)  # bytes a drip sends in ten deadlines: far more than one attempt takes
LONG_BODY = b'{"results": [], "pad": "' + b"x" * 500 + b'"}'  # 50 s of drip
NOTE = "Remember that the ledger runs on Postgres."


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        yield server


@pytest.fixture
def built(loopback: LoopbackMembase) -> Iterator[Any]:
    """Build stores from the key for the loopback server, as in production; each is closed after the test."""
    made: list[MembaseMemoryStore] = []

    def build(**options: Any) -> MembaseMemoryStore:
        made.append(MembaseMemoryStore(api_key=API_KEY, base_url=options.pop("base_url", loopback.url), **options))
        return made[-1]

    yield build
    for store in made:
        store.close()


@pytest.fixture
def instant_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's retry back-off made instant (it sleeps 0.25-1.5 s before retrying a timeout)."""
    monkeypatch.setattr(membase.client, "_backoff", lambda attempt, retry_after=None: 0.0)


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


# --- Connections, TLS and proxies -----------------------------------------------------------------
def test_requests_at_once_each_get_a_connection_kept_alive_for_the_next_turns(loopback, built):
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
    for store in made:  # kept sockets serve the next turns, whoever's they were
        assert asyncio.run(store.search(QUESTION))
    assert loopback.open_connections == loopback.connections == users


@pytest.fixture
def clean_network_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "NO_PROXY", "ALL_PROXY", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


def self_signed(directory: Path) -> ssl.SSLContext:
    """A server context with a certificate for 127.0.0.1, made by the ``openssl`` command (``cert.pem`` in
    ``directory``)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = directory / "cert.pem", directory / "key.pem"
    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    command += ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"]
    subprocess.run([*command, "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def test_a_store_trusts_the_certificates_the_environment_named_when_it_was_built(
    built, clean_network_env, tmp_path, instant_backoff
):
    with LoopbackMembase(tls=self_signed(tmp_path)) as server:
        server.fake.remember(FACT)
        untrusting = built(base_url=server.url, recall_timeout=LONG)
        clean_network_env.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))
        trusting = built(base_url=server.url, recall_timeout=LONG)
        clean_network_env.delenv("SSL_CERT_FILE")  # read once, when each store was built

        assert [e.content for e in asyncio.run(trusting.search(QUESTION))] == [f"[Main] {FACT}"]
        assert tool_turn(trusting, ToolCall("membase_search", {"query": "ledger"})) == ("success", search_text())
        with pytest.raises(membase.APIConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            asyncio.run(untrusting.search(QUESTION))
        assert "could not be reached" in tool_turn(untrusting, ToolCall("membase_search", {"query": "ledger"}))[1]
        assert len(server.fake.sent()) == 2


def test_a_stores_recall_and_tools_go_through_the_proxy_the_environment_named_when_it_was_built(
    loopback, built, clean_network_env
):
    """``HTTP_PROXY`` is read once, when a store is built: set after a store was built, it changes neither that
    store's recall route nor its tools'; a store built while it is set sends both through it, even once it is unset."""
    with LoopbackMembase(InMemoryMembase()) as proxy:  # answers what it is sent as a proxy from its own memory
        proxy.fake.remember(f"Through the proxy: {FACT}")
        through = f"Through the proxy: {FACT}"

        def recalls_and_tool_find(store: MembaseMemoryStore, found: str) -> None:
            assert [e.content for e in asyncio.run(store.search(QUESTION))] == [f"[Main] {found}"]
            assert found in tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))[1]

        before = built(recall_timeout=LONG)
        clean_network_env.setenv("HTTP_PROXY", proxy.url.rsplit("/", 1)[0])
        proxied = built(recall_timeout=LONG)
        recalls_and_tool_find(before, FACT)
        recalls_and_tool_find(proxied, through)
        clean_network_env.delenv("HTTP_PROXY")
        recalls_and_tool_find(built(recall_timeout=LONG), FACT)
        recalls_and_tool_find(proxied, through)
        assert (len(proxy.fake.sent()), len(loopback.fake.sent())) == (4, 4)


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


# --- Proxies, as httpx reads them ------------------------------------------------------------------------------------
def through_proxy(store: MembaseMemoryStore, proxy: LoopbackMembase, target: str) -> bool:
    """Whether one recall by ``store``, and one request by a plain ``httpx.Client`` (httpx's own reading of the
    environment) to ``target``, went through ``proxy``; they must agree."""
    before = len(proxy.fake.sent())
    asyncio.run(store.search(QUESTION))
    ours = len(proxy.fake.sent()) > before
    with httpx.Client() as plain:
        plain.post(f"{target}/v1/search", json={"q": QUESTION}, headers={"Authorization": f"Bearer {API_KEY}"})
    theirs = len(proxy.fake.sent()) > before + ours
    assert ours == theirs, f"the store went {'through' if ours else 'around'} the proxy, httpx the other way"
    return ours


def test_the_proxy_variables_route_a_store_as_they_route_httpx(loopback, built, clean_network_env):
    with LoopbackMembase() as proxy:
        address = proxy.url.split("//")[1].split("/")[0]
        membase_port = loopback.url.split(":")[2].split("/")[0]
        cases = {  # NO_PROXY as users write it: httpx's reading of each is the route
            "": True,
            "127.0.0.1": False,
            f"127.0.0.1:{membase_port}": False,
            "127.0.0.1:1": True,  # another port
            "127.0.0.0/8": True,  # httpx reads a CIDR as its first address only
            "localhost,*": False,
            ".0.0.1": False,  # a domain suffix: 127.0.0.1 ends with it
        }
        for no_proxy, proxied in cases.items():
            clean_network_env.setenv("HTTP_PROXY", address)  # no scheme: httpx takes it as http://
            clean_network_env.setenv("NO_PROXY", no_proxy)
            assert through_proxy(built(recall_timeout=LONG), proxy, loopback.url) == proxied, no_proxy


def test_a_proxy_password_shows_nowhere_and_a_proxy_scheme_httpx_cannot_use_is_refused_when_built(
    built, clean_network_env, caplog
):
    caplog.set_level(logging.DEBUG)
    password = "pr0xy-s3cret-pass"
    with socket_nobody_answers() as dead:
        clean_network_env.setenv("HTTP_PROXY", f"http://user:{password}@{dead}")
        store = built(recall_timeout=LONG, request_timeout=1.0)
        with pytest.raises(membase.APIConnectionError) as raised:
            asyncio.run(store.search(QUESTION))
        agent, model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), "done"])
        agent("go")
    shown = [str(raised.value), repr(raised.value.__cause__), repr(store), model.tool_result_text(), caplog.text]
    assert not [text for text in shown if password in text or "s3cret" in text]
    clean_network_env.setenv("HTTP_PROXY", f"ftp://user:{password}@127.0.0.1:1")
    with pytest.raises(ValueError, match="scheme 'ftp'") as refused:
        built()
    assert password not in str(refused.value)


@contextlib.contextmanager
def socket_nobody_answers() -> Iterator[str]:
    """``host:port`` of a port that refuses connections (bound, never listening)."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{bound.getsockname()[1]}"


# --- A connect that stalls ---------------------------------------------------------------------------------------
needs_linux_counters = pytest.mark.skipif(listen_overflows() is None, reason="counts stalled connects on Linux only")


@needs_linux_counters
def test_a_connect_that_stalls_is_one_attempt_per_sdk_attempt_and_a_drip_after_it_ends_with_it(built, instant_backoff):
    """A server's listen backlog is full: each connect stalls (its SYN dropped, which the kernel counts; one test, so
    no other listener of the suite overflows meanwhile). A recall's attempt ends at request_timeout with one connect,
    and is not tried again past its deadline; a tool's three attempts make three. Then the stalled connect gets
    through when the kernel sends it again (about a second later) and the server drips header lines: the attempt's
    deadline ends both, the drip within the attempt's lines."""
    backlog = FullBacklog()
    try:
        store = built(base_url=backlog.url, recall_timeout=LONG, request_timeout=DEADLINE)
        before = listen_overflows() or 0
        with pytest.raises(membase.APITimeoutError):
            asyncio.run(store.search(QUESTION))
        assert (listen_overflows() or 0) - before == 1
        status, text = tool_turn(store, ToolCall("membase_search", {"query": "ledger"}))
        assert status == "error" and "did not answer in time" in text
        assert (listen_overflows() or 0) - before == 1 + 3  # the SDK's three attempts, one connect each

        attempt, every = 2.0, 0.1
        store = built(base_url=backlog.url, recall_timeout=LONG, request_timeout=attempt)
        serving = backlog.drip_to_next((listen_overflows() or 0) + 1, every)
        with pytest.raises(membase.APITimeoutError):
            asyncio.run(store.search(QUESTION))
        serving.join(LONG)
        [dripped] = backlog.dripped
        assert dripped.hung_up and dripped.lines_within(attempt, every), dripped
    finally:
        backlog.close()

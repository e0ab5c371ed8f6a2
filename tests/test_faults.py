"""The fault matrix: every path of the store through every fault a Membase host or its network can bring.

Paths and faults are listed below. Every fault's text echoes the key (across the 300th character, where a server's
message is cut): no :data:`PIECE` consecutive characters of it may reach a log record (every logger at DEBUG,
tracebacks too), the model, an error raised to the caller or a span. Each case has its own fake, store (from the key,
as in production) and agent. Nothing is timed: a budget holds when the path returns while the host still holds its
request; every other bound is shown by counting requests and bytes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import logging.handlers
import re
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx
import membase
import membase.client
import pytest
from opentelemetry.sdk.trace import ReadableSpan

from membase_strands import MembaseAccessError, MembaseMemoryStore, MembaseRecallTimeout, MembaseWriteTimeout
from membase_strands._failures import PIECE, BadResponseError
from membase_strands.testing import API_KEY, InMemoryMembase, Recorded, ToolCall, status
from tests.support.leaks import span_texts
from tests.support.spans import span_switch
from tests.support.store_helpers import FACT, QUESTION, make_agent, membase_threads, result_text, sdk_client, wait_until

SERVER_TEXT = "SRV-DETAIL"  # every fault's server text carries it, to spot where server text must not go
# The recall or write budget of a path under the hang (the one place a budget is the point): long enough for a loaded
# machine to start the thread that sends the request, since one whose budget ends before it is sent is never sent.
HANG_BUDGET = 0.5
GENEROUS = 30.0  # every other budget, and the longest a hung host holds a request
SDK_ATTEMPTS = 3  # the SDK's first try and its two retries (the tools that read)
TOOL_HANG = 0.05  # one simulated SDK attempt that times out
STORE = "matrix"  # the store's name: its threads carry it
NOTE = "Remember that the ledger runs on Postgres."
CAP = 256 * 1024  # max_response_bytes under the endless answer
CHUNK = 16 * 1024
RECALL_CHARS = 20_000  # the store's default recall budget
ENTRY = re.compile(r"<entry[^>]*>(.*?)</entry>", re.S)
KEY_PIECES = {API_KEY[start : start + PIECE] for start in range(len(API_KEY) - PIECE + 1)}


def leaks(text: str) -> list[str]:
    """The pieces of the key that ``text`` carries."""
    return sorted(piece for piece in KEY_PIECES if piece in text)


# --- The host and its faults ----------------------------------------------------------------------

Respond = Callable[["Host", httpx.Request], httpx.Response]


class Host:
    """One case's Membase host: it answers the faulty route with the fault, counting the requests it is holding and
    the bytes it streams; a hung request waits for :attr:`gate` (:attr:`hang` seconds at most)."""

    def __init__(self, respond: Respond, hang: float) -> None:
        self.respond, self.hang, self.gate, self.lock = respond, hang, threading.Event(), threading.Lock()
        self.holding = self.streamed = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.holding += 1
        try:
            return self.respond(self, request)
        finally:
            with self.lock:
                self.holding -= 1

    def endless(self) -> Iterator[bytes]:
        while True:
            with self.lock:
                self.streamed += CHUNK
            yield b" " * CHUNK


def echo(request: httpx.Request) -> str:
    """What a careless server puts in its error text: the marker and the credentials it was sent, and the key again
    across the 300th character, where the library cuts a server's message."""
    said = f"{SERVER_TEXT} {request.headers.get('Authorization', '')}"
    return f"{said} {'.' * (290 - len(said))}{API_KEY}"


def envelope(code: int, retry_after: str = "") -> Respond:
    def respond(host: Host, request: httpx.Request) -> httpx.Response:
        body = {"error": {"code": "error", "message": echo(request), "details": echo(request), "trace_id": "t-1"}}
        return httpx.Response(code, json=body, headers={"Retry-After": retry_after} if retry_after else {})

    return respond


def html_page(host: Host, request: httpx.Request) -> httpx.Response:
    page = f"<html><head><title>502</title></head><body><h1>Bad Gateway</h1>{echo(request)}</body></html>"
    return httpx.Response(502, content=page.encode(), headers={"Content-Type": "text/html"})


def answer(content: bytes | Callable[[], bytes], content_type: str = "application/json") -> Respond:
    return lambda host, request: httpx.Response(
        200, content=content if isinstance(content, bytes) else content(), headers={"Content-Type": content_type}
    )


def json_200(body: Any) -> Respond:
    return answer(json.dumps(body).encode())


def raising(error: type[httpx.TransportError], message: str) -> Respond:
    def respond(host: Host, request: httpx.Request) -> httpx.Response:
        if error is httpx.ReadTimeout:  # a host that never answers: it holds the request, then times out
            host.gate.wait(host.hang)
        raise error(f"{message} ({echo(request)})", request=request)

    return respond


@functools.cache
def huge_body() -> bytes:
    """About 10 MB of JSON (under the default answer cap): one enormous passage and one enormous standing fact."""
    half = ("ledger " * 800_000)[: 5 * 1024 * 1024]
    hit = {"content": half, "container": "ctr_main", "container_name": "Main", "score": 1.0}
    body = {"results": [hit], "containers": [{"id": "ctr_main", "name": "Main"}], "static": [half]}
    return json.dumps(body).encode()


@dataclass(frozen=True)
class Fault:
    """One fault. ``kind``: the failure kind it must produce on every path; a 2xx fault has none and says what it means
    per route: ``search`` for the search routes, ``profile`` for the profile and forget (a save's 2xx is a save)."""

    id: str
    respond: Respond
    kind: str | None = None
    search: str = "ok"
    profile: str = "ok"
    options: dict[str, Any] = field(default_factory=dict)


MAIN = {"id": "ctr_main", "name": "Main"}
UNREADABLE = {"search": "bad_response", "profile": "bad_response"}
REFUSED = raising(httpx.ConnectError, "[Errno 111] Connection refused")
FAULTS = [
    Fault("hang", raising(httpx.ReadTimeout, "timed out"), "timeout"),
    Fault("refused", REFUSED, "connection"),
    Fault("reset_protocol", raising(httpx.RemoteProtocolError, "Server disconnected"), "connection"),
    Fault("reset_read", raising(httpx.ReadError, "[Errno 104] Connection reset by peer"), "connection"),
    *(Fault(str(code), envelope(code), "server_error") for code in (500, 502, 503)),
    Fault("502_html", html_page, "server_error"),
    Fault("429", envelope(429), "rate_limited"),
    Fault("429_retry_after", envelope(429, retry_after="7"), "rate_limited"),
    *(Fault(str(code), envelope(code), kind) for code, kind in [(422, "unavailable"), (403, "access")]),
    *(Fault(str(code), envelope(code), kind) for code, kind in [(401, "unauthenticated"), (400, "bad_request")]),
    Fault("404", envelope(404), "not_found"),
    Fault("200_not_json", answer(b"not json {", "text/plain"), **UNREADABLE),
    Fault("200_empty", answer(b""), **UNREADABLE),
    Fault("200_html", answer(f"<html>{SERVER_TEXT}</html>".encode(), "text/html"), **UNREADABLE),
    Fault("200_cut_mid_character", answer(b'{"a": "\xe2\x82'), **UNREADABLE),  # not valid UTF-8
    Fault("200_no_results", json_200({"containers": []}), search="bad_response"),
    Fault("200_results_not_list", json_200({"results": {"content": SERVER_TEXT}}), search="bad_response"),
    Fault("200_hit_without_content", json_200({"results": [{"container": "ctr_main", "score": 1.0}]})),
    Fault("200_content_not_string", json_200({"results": [{"content": 42, "container": "ctr_main"}]})),
    Fault("200_memory_unsearchable", json_200({"results": [], "containers": [{**MAIN, "error": SERVER_TEXT}]})),
    Fault("200_10mb", answer(huge_body)),
    Fault(
        "200_endless",
        lambda host, request: httpx.Response(200, content=host.endless()),
        **UNREADABLE,  # a save's 2xx is a save: Membase took the note, however long its answer
        options={"max_response_bytes": CAP},
    ),
]
FAULTS_BY_ID = {fault.id: fault for fault in FAULTS}
LIST_FAULTS = [  # faults of ``GET /v1/containers`` while a store pinned by name resolves it
    Fault("list_500", envelope(500), "server_error"),
    Fault("list_refused", REFUSED, "connection"),
    Fault("list_403", envelope(403), "access"),
    Fault("list_not_json", answer(b"<html>oops</html>", "text/html"), "bad_response"),
]
LIST_FAULTS_BY_ID = {fault.id: fault for fault in LIST_FAULTS}

RECALL_PATHS = ("recall", "search_memory", "search")
TOOL_PATHS = ("membase_search", "membase_save", "membase_profile", "membase_forget")
WRITE_PATHS = ("add", "add_memory", "add_messages")
SEARCH, MEMORIES = ("POST", "/v1/search"), ("POST", "/v1/memories")
ROUTE = {
    **dict.fromkeys(("recall", "search_memory", "search", "membase_search"), SEARCH),
    **dict.fromkeys(("membase_save", *WRITE_PATHS), MEMORIES),
    "membase_profile": ("GET", "/v1/profile"),
    "membase_forget": ("DELETE", "/v1/memories/{id}"),
}
RETRIED = {"timeout", "connection", "server_error", "rate_limited"}  # the kinds the SDK retries
RETRYING_PATHS = {"membase_search", "membase_profile"}  # paths whose client retries; every other makes one attempt
KINDS = {  # each failure kind: the phrase its tool sentence carries (the README's table), what a direct call raises
    "timeout": ("did not answer in time", MembaseRecallTimeout),
    "connection": ("could not be reached", membase.APIConnectionError),
    "server_error": ("internal error", membase.InternalServerError),
    "rate_limited": ("busy", membase.RateLimitError),
    "unavailable": ("cannot run right now", membase.UnprocessableEntityError),
    "access": ("narrowed or revoked", MembaseAccessError),
    "unauthenticated": ("(401)", membase.AuthenticationError),
    "bad_request": ("rejected the request", membase.BadRequestError),
    "not_found": ("could not find", membase.NotFoundError),
    "bad_response": ("could not be read", BadResponseError),
    "not_confirmed": ("Nothing was forgotten: Membase answered", None),
}


def expected(path: str, fault: Fault) -> str:
    """``"ok"`` when the path must succeed under ``fault``, else the failure kind it must report."""
    if fault.kind is not None:
        return fault.kind
    if path in ("membase_save", *WRITE_PATHS):
        return "ok"
    if path == "membase_forget":  # any readable answer but "confirmation_required" forgets nothing
        return fault.profile if fault.profile != "ok" else "not_confirmed"
    return fault.profile if path == "membase_profile" else fault.search


def budgeted(path: str, fault: Fault) -> bool:
    """Whether the path's own budget ends its wait: only a host that never answers outlasts one, and the tools have
    none (each SDK attempt ends on its own, and they are counted)."""
    return fault.id == "hang" and path not in TOOL_PATHS


def attempts(path: str, fault: Fault) -> int:
    """The requests the faulty route must see."""
    sent = SDK_ATTEMPTS if path in RETRYING_PATHS and expected(path, fault) in RETRIED else 1
    if fault.id == "refused":
        sent *= 2  # it never reached Membase: sent once more
    return sent  # a write that ran out of time and then failed may have been read: never sent again


# --- Running one case -----------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one path did under one fault."""

    path: str
    fault: Fault
    pinned: bool
    status: str | None = None  # the tool result's, for tool paths
    text: str = ""  # the tool result's
    memory_block: str | None = None
    model_saw: str = ""  # everything the model was sent
    raised: BaseException | None = None
    records: list[logging.LogRecord] = field(default_factory=list)
    logs: str = ""  # every record as a log file shows it, tracebacks included
    requests: list[Recorded] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    hints: list[str | None] = field(default_factory=list)  # the Retry-After each SDK retry saw
    held: int = 0  # requests the host still held when the path handed back its result
    streamed: int = 0
    spans: list[ReadableSpan] = field(default_factory=list)

    def raised_text(self) -> str:
        return "" if self.raised is None else "".join(traceback.format_exception(self.raised)) + repr(self.raised)


@contextmanager
def recorded(hints: list[str | None]) -> Iterator[logging.handlers.BufferingHandler]:
    """Every record of every logger at DEBUG, every span, and the SDK's retries made instant (their hints kept)."""
    handler, root, names = logging.handlers.BufferingHandler(10**9), logging.getLogger(), ("", "strands", "httpx")
    levels = {name: logging.getLogger(name).level for name in (*names, "membase_strands", "membase")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.DEBUG)
    root.addHandler(handler)
    switch, exporter = span_switch()
    exporter.clear()
    switch.on = True

    def backoff(attempt: int, retry_after: str | None = None) -> float:
        hints.append(retry_after)
        return 0.0

    try:
        with mock.patch.object(membase.client, "_backoff", backoff):
            yield handler
    finally:
        switch.on = False
        root.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def own_threads() -> list[threading.Thread]:
    return [t for t in membase_threads() if t.name.endswith(f"[{STORE}]") or t.name == "membase-request"]


@functools.cache
def outcome(path: str, fault_id: str, pinned: bool = False) -> Outcome:
    """What ``path`` did under the fault (on the Memory list, ``pinned`` to "Main"), each case run once (callers pass
    ``pinned`` only when it is True): a fresh fake, store and agent; then the host's gate opens, the store closes."""
    fault = LIST_FAULTS_BY_ID[fault_id] if pinned else FAULTS_BY_ID[fault_id]
    fake, host = InMemoryMembase(), Host(fault.respond, TOOL_HANG if path in TOOL_PATHS else GENEROUS)
    note_id = fake.remember(FACT)
    fake.always(*(("GET", "/v1/containers") if pinned else ROUTE[path]), host)
    short, tools = budgeted(path, fault), ("search", "save", "profile", "forget")
    options: dict[str, Any] = {"name": STORE, "tools": tools, "container": "Main" if pinned else None, **fault.options}
    options["recall_timeout"] = HANG_BUDGET if short and path in RECALL_PATHS else GENEROUS
    options["write_timeout"] = HANG_BUDGET if short and path in WRITE_PATHS else GENEROUS
    options |= {"capture": path in WRITE_PATHS, "extraction": True if path == "add_messages" else None}
    o = Outcome(path, fault, pinned)
    with recorded(o.hints) as handler:
        store = fake.store(**options)
        try:
            _drive(path, store, o, note_id)
            o.held = host.holding
        finally:
            host.gate.set()
            settled = wait_until(lambda: not own_threads(), timeout=GENEROUS)  # late outcomes first: then the close
            # Closed from a thread of its own, with no context variables set, as a server's shutdown hook may close it.
            closing = threading.Thread(target=store.close)
            closing.start()
            closing.join(GENEROUS)
            settled = settled and wait_until(lambda: not own_threads(), timeout=GENEROUS)  # what the close sent
            o.counters = store.counters()
    assert settled, f"{path} under {fault.id}: the store's threads were still at work {GENEROUS:g} s later"
    o.records, o.requests, o.streamed = list(handler.buffer), fake.sent(), host.streamed
    o.logs = "\n".join(map(logging.Formatter("%(levelname)s %(name)s %(message)s").format, o.records))
    o.spans = list(span_switch()[1].get_finished_spans())
    return o


def _drive(path: str, store: MembaseMemoryStore, o: Outcome, note_id: str) -> None:
    if path in ("add", "search"):
        try:
            asyncio.run(store.add(NOTE) if path == "add" else store.search(QUESTION))
        except Exception as error:  # noqa: BLE001 - judged by the checks
            o.raised = error
        return
    manager: dict[str, Any] = {} if path == "recall" else {"injection": False}
    script: list[Any] = ["Noted." if path == "add_messages" else "done"]
    query = {"query": "ledger database"}
    args = {"membase_save": {"content": NOTE}, "membase_profile": {"topic": "ledger"}, "search_memory": query}
    args |= {"membase_forget": {"memory_id": note_id}, "add_memory": {"entries": [NOTE]}, "membase_search": query}
    script = [ToolCall(path, args[path]), *script] if path in args else script
    manager |= {"add_tool_config": True} if path == "add_memory" else {}
    agent, model = make_agent(store, script, **manager)
    agent(NOTE if path == "add_messages" else QUESTION)
    o.memory_block = model.memory_block(0)
    calls = range(len(model.calls))  # everything the model was sent, tool results included
    o.model_saw = "\n".join(model.sent_text(i) + json.dumps(model.tool_results(i)) for i in calls)
    if results := model.tool_results():
        o.status, o.text = results[-1]["status"], result_text(results[-1])


# --- What every case must show --------------------------------------------------------------------
def check_common(o: Outcome) -> None:
    assert o.held == (1 if budgeted(o.path, o.fault) else 0), f"{o.held} requests still held when it returned"
    where = {"logs": o.logs, "model": o.model_saw + o.text, "raised": o.raised_text()}
    where |= {f"span {span.name}": "\n".join(span_texts(span)) for span in o.spans}
    leaked = sorted(place for place, text in where.items() if leaks(text))
    assert not leaked, f"pieces of the key in: {', '.join(leaked)}"
    assert any(r.levelno == logging.DEBUG for r in o.records), "the capture did not run"
    assert [f"{r.name}: {r.getMessage()[:200]}" for r in o.records if r.levelno >= logging.ERROR] == []
    assert "Traceback" not in o.model_saw
    if o.path in RECALL_PATHS:
        assert "<html" not in o.model_saw
    if o.fault.id == "200_endless":  # the answer was not read past the cap
        assert o.streamed <= len(o.requests) * (CAP + 2 * CHUNK), o.streamed


def check_attempts(o: Outcome) -> None:
    method, path = ROUTE[o.path]
    sent = [r for r in o.requests if r.method == method and r.path.startswith(path.removesuffix("{id}"))]
    assert len(sent) == attempts(o.path, o.fault), f"{len(sent)} requests to {path}"


def check_recall(o: Outcome) -> None:
    """Recall contributes nothing, a framed notice, or (a 2xx it can read) capped passages."""
    kind, empty = expected(o.path, o.fault), o.fault.id in ("200_hit_without_content", "200_content_not_string")
    counted = {"ok": "recall_hits" if o.fault.id == "200_10mb" else "recall_empty", "timeout": "recall_timeouts"}
    assert o.counters["recalls"] == o.counters[counted.get(kind, "recall_errors")] == 1, o.counters
    if kind == "timeout":  # logged as running out of time, then as failing late
        said = [r.getMessage() for r in o.records if r.name.startswith("membase_strands")]
        assert any("ran out of time" in m for m in said) and any("late recall failed" in m for m in said), said
        assert o.counters["recall_late_completions"] == 1, o.counters
    if o.path == "search":
        assert o.raised is None if kind == "ok" else isinstance(o.raised, KINDS[kind][1]), repr(o.raised)  # type: ignore[arg-type]
        return
    if o.path == "search_memory":  # the manager's own tool skips a failing store: success, no entries
        assert o.status == "success"
        if kind != "ok" or empty:
            assert o.text == "[]"
        elif o.fault.id == "200_memory_unsearchable":
            assert o.text.startswith('[{"content": "[Membase notice] The Memory (Main) could not be searched: ')
        else:
            assert o.text.startswith('[{"content": "[Main] ledger ledger') and len(o.text) <= RECALL_CHARS + 1_000
        return
    if kind != "ok" or empty:
        assert o.memory_block is None and SERVER_TEXT not in o.model_saw
        return
    assert o.memory_block is not None
    entries = ENTRY.findall(o.memory_block)
    if o.fault.id == "200_memory_unsearchable":
        [notice] = entries
        assert notice.startswith("[Membase notice] The Memory (Main) could not be searched: ")
        assert "its silence is not evidence" in notice
    else:  # 10 MB: one passage, cut to the recall budget with a visible marker
        [passage] = entries
        assert passage.startswith("[Main] ledger ledger") and len(passage) <= RECALL_CHARS
        assert passage.endswith("[... cut: this passage is longer than the recall budget]")


def check_tool(o: Outcome) -> None:
    kind = expected(o.path, o.fault)
    if o.path == "membase_search" and o.fault.id == "200_memory_unsearchable":
        assert (o.status, "Not searched" in o.text) == ("error", True)  # no Memory could answer: nothing searched
    elif kind == "ok":
        assert o.status == "success"
        assert o.path != "membase_save" or o.text == "Saved to Membase."
        assert len(o.text) <= RECALL_CHARS + 1_000, f"{len(o.text)} characters reached the model"
    elif o.path == "membase_save" and (fate_unknown(o.fault) or kind == "timeout"):  # sent, no answer: fate unknown
        assert o.status == "error" and "may or may not have been saved" in o.text, o.text
    else:
        assert o.status == "error" and KINDS[kind][0] in o.text and o.text.endswith("."), o.text
    assert o.counters[f"tool_calls.{o.path}"] == 1
    assert not o.fault.kind or o.counters[f"errors.{o.fault.kind}"] == (2 if o.pinned else 1)  # a set-up check too


def fate_unknown(fault: Fault) -> bool:
    """Whether a write under ``fault`` may have been stored: the connection broke after it was sent, or something in
    front of Membase answered a 5xx (Membase documents none: it may have stored the note before that answer)."""
    return fault.id.startswith(("reset_", "5"))


def check_write(o: Outcome) -> None:
    kind, counts = expected(o.path, o.fault), o.counters
    if o.path == "add":
        wanted = MembaseWriteTimeout if kind == "timeout" else KINDS.get(kind, ("", None))[1]
        assert o.raised is None if kind == "ok" else isinstance(o.raised, wanted), repr(o.raised)  # type: ignore[arg-type]
    elif o.path == "add_memory":
        if kind == "ok":
            assert (o.status, o.text) == ("success", '{"stored": 1}')
        else:
            assert o.status == "error", o.text
            assert o.text.startswith("Error: AggregateMemoryError - MemoryManager: failed to add 1 of 1 entries")
            assert kind != "access" or "narrowed or revoked" in o.text
            assert kind != "timeout" or "ran out of time" in o.text
    else:  # add_messages: the manager's extraction hears of the failure
        failed = [r for r in o.records if r.name.startswith("strands.memory") and "extraction failed" in r.getMessage()]
        assert len(failed) == (0 if kind == "ok" else 1)
    if kind == "ok":
        assert (counts["writes_saved"], counts["write_errors"]) == (1, 0)
    elif kind == "timeout":  # out of time, then no answer: Membase may have it, so it is never sent again, and said so
        assert (counts["write_timeouts"], counts["writes_unknown"]) == (1, 1), counts
        assert (counts["writes_lost"], counts["write_errors"], counts["errors.timeout"]) == (0, 0, 1), counts
        [unknown] = [r for r in o.records if "ended without an answer" in r.getMessage()]
        assert unknown.levelno == logging.WARNING and "never saved twice" in unknown.getMessage()
    elif fate_unknown(o.fault):  # the request went out, then the connection broke (or a gateway gave up on it)
        assert (counts["writes_saved"], counts["write_errors"], counts["writes_unknown"]) == (0, 1, 1), counts
        assert counts[f"errors.{kind}"] == 1, counts  # one failure, counted once by kind
        assert len([r for r in o.records if "fate is unknown" in r.getMessage()]) == 1
    else:
        errors = 2 if o.pinned and o.path != "add" else 1  # pinned, the agent's set-up check failed too
        assert (counts["writes_saved"], counts["write_errors"], counts[f"errors.{kind}"]) == (0, 1, errors), counts
        assert counts["writes_unknown"] == 0, counts


CHECKS = {**dict.fromkeys(RECALL_PATHS, check_recall), **dict.fromkeys(WRITE_PATHS, check_write)}


def run(paths: tuple[str, ...], faults: list[Fault] = FAULTS) -> None:
    """Every path through every fault; the failures of all cases are reported together."""
    pinned = faults is LIST_FAULTS
    failures = []
    for path in paths:
        for fault in faults:
            o = outcome(path, fault.id, True) if pinned else outcome(path, fault.id)
            try:
                check_common(o)
                CHECKS.get(path, check_tool)(o)
                if pinned:  # never resolved, so nothing else was sent; an agent's set-up check said why
                    assert [r.path for r in o.requests if r.path != "/v1/containers"] == []
                    assert path in ("search", "add") or "could not list the Memories in reach; checking again" in o.logs
                else:
                    check_attempts(o)
            except AssertionError as error:
                failures.append(f"{path} under {fault.id}: {str(error).splitlines()[0][:300]}")
    if failures:
        pytest.fail(f"{len(failures)} cases failed:\n" + "\n".join(failures), pytrace=False)


# --- The matrix -----------------------------------------------------------------------------------
def test_recall_under_every_fault_fails_open_and_never_shows_server_text_as_a_fact() -> None:
    run(RECALL_PATHS)


def test_each_tool_under_every_fault_tells_the_model_what_went_wrong() -> None:
    run(TOOL_PATHS)


def test_captured_writes_under_every_fault_fail_to_the_manager_and_are_counted() -> None:
    run(WRITE_PATHS)


def test_the_memory_list_failing_while_a_pinned_name_is_resolved_sends_nothing_else() -> None:
    run(("recall", "search", "membase_search", "membase_save", *WRITE_PATHS), LIST_FAULTS)


# --- Across faults --------------------------------------------------------------------------------
def test_a_tools_sentences_tell_kinds_of_fault_apart_and_name_their_status() -> None:
    for tool in TOOL_PATHS:
        by_kind: dict[str, set[str]] = {}
        for fault in FAULTS:
            if (kind := expected(tool, fault)) != "ok":
                by_kind.setdefault(kind, set()).add(outcome(tool, fault.id).text)
        assert set(by_kind) >= {"timeout", "connection", "server_error", "rate_limited", "access", "bad_request"}
        for first in by_kind:
            for second in set(by_kind) - {first}:
                shared = by_kind[first] & by_kind[second]  # membase_save: one sentence for every note of unknown fate
                assert all("may or may not have been saved" in text for text in shared), f"{tool}: {first}, {second}"
    texts = {code: outcome("membase_search", code).text for code in ("500", "502", "503")}
    assert all(f"({code}: " in text for code, text in texts.items()) and len(set(texts.values())) == 3


def test_the_sdk_honours_retry_after_for_the_tools_but_recall_and_saves_never_retry() -> None:
    assert outcome("membase_search", "429_retry_after").hints == ["7", "7"]
    assert outcome("membase_search", "429").hints == [None, None]
    for path in ("recall", "search", "membase_save", "add"):
        assert outcome(path, "429_retry_after").hints == [], path


def test_a_2xx_save_answer_that_cannot_be_read_counts_as_saved_and_a_read_one_says_why() -> None:
    for path in ("add", "add_memory", "add_messages", "membase_save"):
        [warned] = [
            r for r in outcome(path, "200_cut_mid_character").records if "counting it as saved" in r.getMessage()
        ]
        assert "reason=<2xx answer is not valid UTF-8" in warned.getMessage(), path
    assert "not valid UTF-8" in outcome("membase_search", "200_cut_mid_character").text


def test_an_error_that_carried_the_key_is_raised_masked_without_its_chain() -> None:
    raised = outcome("search", "500").raised
    assert isinstance(raised, membase.InternalServerError) and "[redacted]" in str(raised)
    assert raised.__cause__ is None and (raised.__context__ is None or raised.__suppress_context__)


def test_a_store_given_a_client_recalls_through_that_client_as_it_is_retries_included() -> None:
    # Not the single attempt a store built from a key makes: the client's own retries (the SDK's default is two)
    # apply to automatic recall too, and a client built with max_retries=0 makes one attempt.
    for retries, searches, recalled in [(None, 3, True), (0, 1, False)]:
        fake = InMemoryMembase()
        fake.remember(FACT)
        fake.on(*SEARCH, status(503), status(503))
        client = sdk_client(fake, max_retries=2 if retries is None else retries)  # 2: the SDK's default
        store = MembaseMemoryStore(client=client, recall_timeout=GENEROUS, tools=("search",))  # a retrying one reads
        agent, model = make_agent(store, ["done"])
        with recorded([]):
            agent(QUESTION)
        store.close()

        assert len(fake.sent(*SEARCH)) == searches
        assert (f"[Main] {FACT}" in (model.memory_block() or "")) is recalled
        assert store.counters()["recall_errors"] == (0 if recalled else 1)
        assert not leaks(repr(store)) and not any(leaks(repr(tool.tool_spec)) for tool in store.get_tools())

"""A catalogue of transport faults and a runner that drives one library path through one of them.

Shared by ``tests/test_faults.py`` (the full matrix) and ``tests/test_secrets.py`` (a representative
subset at DEBUG level). Every path runs on a store built from a key (``fake.store()``), the production
path: the SDK clients the store builds over the shared pool, routed to the testing kit's transport
(``httpx.MockTransport`` in :class:`~membase_strands.testing.InMemoryMembase`). Every error body
echoes the request's ``Authorization`` header, so a library that leaks what a server sends back
would leak the API key.

:func:`run_case` is self-contained (its own fake, store, agent, log capture and SDK back-off
patch) so its outcomes can be cached and compared across faults. Nothing here is timed: a budget
is shown to hold by the path returning while its request is still held by a host that never
answers (the hang is gated by an event, so it holds however slow the machine is), and every other
bound by counting the requests that reached Membase.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx
import membase.client

from membase_strands import MembaseMemoryStore
from membase_strands.testing import API_KEY, InMemoryMembase, Recorded, Responder, ScriptedModel, ToolCall
from tests.support.store_helpers import (
    FACT,
    QUESTION,
    make_agent,
    membase_threads,
    result_text,
    wait_until,
)

# A marker every fault's server text carries, to spot server error text where it must not go.
SERVER_TEXT = "SRV-DETAIL"
HANG_BUDGET = 0.1  # the recall or write budget of a path under the hang: the one place a budget is the point
GENEROUS = 30.0  # every other budget: a slow, loaded machine never runs out of it
HANG_LIMIT = 30.0  # the longest a hung host holds a request before the test opens its gate
TOOL_HANG = 0.05  # one simulated SDK attempt that times out
SDK_ATTEMPTS = 3  # the SDK's first try and its two retries
STORE = "matrix"  # the store's name: its threads are named after it, so a case waits for its own threads only
SAVED_NOTE = "Remember that the ledger runs on Postgres."
HUGE_CHARS = 10 * 1024 * 1024

# --- Responders ----------------------------------------------------------------------------------


def _echo(request: httpx.Request) -> str:
    """What a careless server puts in its error text: the marker and the credentials it was sent."""
    return f"{SERVER_TEXT} {request.headers.get('Authorization', '')} (key {API_KEY})"


def envelope(code: int, *, retry_after: str | None = None) -> Responder:
    """Membase's JSON error envelope with the key echoed, optionally with a ``Retry-After`` header."""

    def respond(request: httpx.Request) -> httpx.Response:
        body = {"error": {"code": "error", "message": _echo(request), "details": _echo(request), "trace_id": "t-1"}}
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        return httpx.Response(code, json=body, headers=headers)

    return respond


def html_page(code: int) -> Responder:
    """An HTML error page, as a proxy or load balancer sends, echoing the key."""

    def respond(request: httpx.Request) -> httpx.Response:
        page = f"<html><head><title>{code}</title></head><body><h1>Bad Gateway</h1>{_echo(request)}</body></html>"
        return httpx.Response(code, content=page.encode(), headers={"Content-Type": "text/html"})

    return respond


def raw_200(content: bytes, content_type: str = "application/json") -> Responder:
    return lambda request: httpx.Response(200, content=content, headers={"Content-Type": content_type})


def json_200(body: Any) -> Responder:
    return lambda request: httpx.Response(200, json=body)


def raising(error: type[httpx.TransportError], message: str) -> Responder:
    """A transport failure whose message echoes the key."""

    def respond(request: httpx.Request) -> httpx.Response:
        raise error(f"{message} ({_echo(request)})", request=request)

    return respond


def hanging(gate: threading.Event, limit: float) -> Responder:
    """A host that never answers: blocks until ``gate`` opens (at most ``limit`` s), then times out."""

    def respond(request: httpx.Request) -> httpx.Response:
        gate.wait(limit)
        raise httpx.ReadTimeout(f"timed out ({_echo(request)})", request=request)

    return respond


_HUGE: bytes | None = None


def huge_body() -> bytes:
    """About 10 MB of JSON: one enormous passage and one enormous standing fact."""
    global _HUGE
    if _HUGE is None:
        half = ("ledger " * (HUGE_CHARS // 14))[: HUGE_CHARS // 2]
        body = {
            "results": [{"content": half, "container": "ctr_main", "container_name": "Main", "score": 1.0}],
            "containers": [{"id": "ctr_main", "name": "Main"}],
            "static": [half],
            "dynamic": [],
        }
        _HUGE = json.dumps(body).encode()
    return _HUGE


# --- The catalogue -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One fault.

    ``kind`` is the failure kind a non-2xx (or transport) fault must produce on every path. A 2xx
    fault has ``kind=None`` and says per route what it means: ``search`` for the search routes
    (recall, search_memory, membase_search), ``profile`` for ``membase_profile``; a 2xx on save is
    always a save (Membase took the note).
    """

    id: str
    make: Callable[[threading.Event, float], Responder]
    kind: str | None = None
    search: str = "ok"
    profile: str = "ok"


FAULTS: list[Fault] = [
    Fault("hang", lambda gate, limit: hanging(gate, limit), kind="timeout"),
    Fault("refused", lambda g, _: raising(httpx.ConnectError, "[Errno 111] Connection refused"), kind="connection"),
    Fault(
        "reset_protocol",
        lambda g, _: raising(httpx.RemoteProtocolError, "Server disconnected without sending a response."),
        kind="connection",
    ),
    Fault("reset_read", lambda g, _: raising(httpx.ReadError, "[Errno 104] Connection reset by peer"), "connection"),
    Fault("500", lambda g, _: envelope(500), kind="server_error"),
    Fault("502", lambda g, _: envelope(502), kind="server_error"),
    Fault("503", lambda g, _: envelope(503), kind="server_error"),
    Fault("502_html", lambda g, _: html_page(502), kind="server_error"),
    Fault("429", lambda g, _: envelope(429), kind="rate_limited"),
    Fault("429_retry_after", lambda g, _: envelope(429, retry_after="7"), kind="rate_limited"),
    Fault("422", lambda g, _: envelope(422), kind="unavailable"),
    Fault("403", lambda g, _: envelope(403), kind="access"),
    Fault("401", lambda g, _: envelope(401), kind="unauthenticated"),
    Fault("400", lambda g, _: envelope(400), kind="bad_request"),
    Fault("404", lambda g, _: envelope(404), kind="not_found"),
    Fault(
        "200_not_json", lambda g, _: raw_200(b"not json {", "text/plain"), search="bad_response", profile="bad_response"
    ),
    Fault("200_empty", lambda g, _: raw_200(b""), search="bad_response", profile="bad_response"),
    Fault(
        "200_html",
        lambda g, _: raw_200(f"<html><body>{SERVER_TEXT} gateway</body></html>".encode(), "text/html"),
        search="bad_response",
        profile="bad_response",
    ),
    Fault("200_no_results", lambda g, _: json_200({"containers": []}), search="bad_response"),
    Fault("200_results_not_list", lambda g, _: json_200({"results": {"content": SERVER_TEXT}}), search="bad_response"),
    Fault("200_hit_without_content", lambda g, _: json_200({"results": [{"container": "ctr_main", "score": 1.0}]})),
    Fault("200_content_not_string", lambda g, _: json_200({"results": [{"content": 42, "container": "ctr_main"}]})),
    Fault(
        "200_memory_unsearchable",
        lambda g, _: json_200(
            {"results": [], "containers": [{"id": "ctr_main", "name": "Main", "error": f"{SERVER_TEXT} waking up"}]}
        ),
    ),
    Fault("200_10mb", lambda g, _: raw_200(huge_body())),
]
FAULTS_BY_ID = {fault.id: fault for fault in FAULTS}

# Faults of ``GET /v1/containers`` while a store pinned by name resolves it.
LIST_FAULTS: list[Fault] = [
    Fault("list_500", lambda g, _: envelope(500), kind="server_error"),
    Fault("list_refused", lambda g, _: raising(httpx.ConnectError, "[Errno 111] Connection refused"), "connection"),
    Fault("list_403", lambda g, _: envelope(403), kind="access"),
    Fault("list_not_json", lambda g, _: raw_200(b"<html>oops</html>", "text/html"), kind="bad_response"),
]
LIST_FAULTS_BY_ID = {fault.id: fault for fault in LIST_FAULTS}

# --- Paths ---------------------------------------------------------------------------------------

RECALL_PATHS = ("recall", "search_memory")
TOOL_PATHS = ("membase_search", "membase_save", "membase_profile")
WRITE_PATHS = ("add", "add_memory", "add_messages")
PATHS = (*RECALL_PATHS, *TOOL_PATHS, *WRITE_PATHS)
SAVE_PATHS = ("membase_save", *WRITE_PATHS)

ROUTE = {
    "recall": ("POST", "/v1/search"),
    "search_memory": ("POST", "/v1/search"),
    "membase_search": ("POST", "/v1/search"),
    "membase_save": ("POST", "/v1/memories"),
    "membase_profile": ("GET", "/v1/profile"),
    "add": ("POST", "/v1/memories"),
    "add_memory": ("POST", "/v1/memories"),
    "add_messages": ("POST", "/v1/memories"),
}


def expected(path: str, fault: Fault) -> str:
    """``"ok"`` when the path must succeed under ``fault``, else the failure kind it must report."""
    if fault.kind is not None:
        return fault.kind
    if path in SAVE_PATHS:
        return "ok"
    return fault.profile if path == "membase_profile" else fault.search


def budgeted(path: str, fault: Fault) -> bool:
    """Whether the path's own budget (recall or write) must end its wait under ``fault``.

    Only a host that never answers outlasts a budget. The tools have no budget of their own: the SDK's
    attempts end each request (simulated here by a hang of :data:`TOOL_HANG` per attempt), and they are
    counted instead.
    """
    return fault.id == "hang" and path in (*RECALL_PATHS, *WRITE_PATHS)


# --- The runner ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one path did under one fault."""

    path: str
    fault: Fault
    status: str | None = None  # the tool result's status, for tool paths
    text: str = ""  # the tool result's text, for tool paths
    memory_block: str | None = None
    model_saw: str = ""  # everything the model was sent, joined
    raised: BaseException | None = None
    records: list[logging.LogRecord] = field(default_factory=list)
    logs: str = ""  # every record formatted with its traceback
    requests: list[Recorded] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    backoff_hints: list[str | None] = field(default_factory=list)
    held_when_it_returned: int = 0  # requests a host was still holding when the path handed back its result
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def traceback_text(self) -> str:
        if self.raised is None:
            return ""
        return "".join(traceback.format_exception(self.raised))


class ListHandler(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


FORMATTER = logging.Formatter("%(levelname)s %(name)s %(message)s")
LOGGERS = ("", "membase_strands", "strands", "httpx", "httpcore", "membase")


def format_records(records: list[logging.LogRecord]) -> str:
    """Every record as a log file would show it, tracebacks included."""
    lines = []
    for record in records:
        lines.append(FORMATTER.format(record))
        if record.exc_info and not record.exc_text:
            lines.append("".join(traceback.format_exception(*record.exc_info)))
    return "\n".join(lines)


@contextmanager
def capture_logs() -> Iterator[ListHandler]:
    """Capture every record of every logger at DEBUG, restoring levels afterwards."""
    handler = ListHandler()
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG)
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@contextmanager
def instant_sdk_backoff(hints: list[str | None]) -> Iterator[None]:
    """Make the SDK's retries instant; record the ``Retry-After`` each retry saw."""

    def backoff(attempt: int, retry_after: str | None = None) -> float:
        hints.append(retry_after)
        return 0.0

    with mock.patch.object(membase.client, "_backoff", backoff):
        yield


def tool_text(model: ScriptedModel) -> tuple[str, str]:
    """The status and text of the last tool result the model read."""
    result = model.tool_results()[-1]
    return result["status"], result_text(result)


def all_sent_text(model: ScriptedModel) -> str:
    """Everything the model was sent over every call, tool results included."""
    parts = []
    for call in model.calls:
        for message in call["messages"]:
            for block in message["content"]:
                if "text" in block:
                    parts.append(block["text"])
                if "toolResult" in block:
                    parts += [item.get("text", json.dumps(item)) for item in block["toolResult"]["content"]]
    return "\n".join(parts)


class Host:
    """Wraps a fault's responder to count the requests it is holding at any moment."""

    def __init__(self, responder: Responder) -> None:
        self._responder = responder
        self._lock = threading.Lock()
        self.holding = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.holding += 1
        try:
            return self._responder(request)
        finally:
            with self._lock:
                self.holding -= 1


def own_threads() -> list[threading.Thread]:
    """The library's threads at work for the matrix's store (a recall, a write, the set-up check)."""
    return [t for t in membase_threads() if t.name.endswith(f"[{STORE}]")]


def run_case(path: str, fault: Fault, *, pinned: bool = False) -> Outcome:
    """Drive ``path`` through ``fault`` with a fresh fake, store and agent; wait for background threads.

    The store is built from the key (``fake.store()``), as in production. With ``pinned`` the store is
    pinned to the Memory "Main" by name and ``fault`` hits the container list (``GET /v1/containers``)
    instead of the path's own route.
    """
    fake = InMemoryMembase()
    fake.remember(FACT)
    gate = threading.Event()
    limit = TOOL_HANG if path in TOOL_PATHS else HANG_LIMIT
    method, route = ("GET", "/v1/containers") if pinned else ROUTE[path]
    host = Host(fault.make(gate, limit))
    fake.always(method, route, host)
    hints: list[str | None] = []
    short = budgeted(path, fault)
    options: dict[str, Any] = {
        "name": STORE,
        "recall_timeout": HANG_BUDGET if short and path in RECALL_PATHS else GENEROUS,
        "write_timeout": HANG_BUDGET if short and path in WRITE_PATHS else GENEROUS,
    }
    if pinned:
        options["container"] = "Main"
    if path in WRITE_PATHS:
        options["capture"] = True
    if path == "add_messages":
        options["extraction"] = True

    outcome = Outcome(path=path, fault=fault)
    with capture_logs() as handler, instant_sdk_backoff(hints):
        store = fake.store(**options)
        try:
            _drive(path, store, outcome)
            outcome.held_when_it_returned = host.holding
        finally:
            gate.set()
            settled = wait_until(lambda: not own_threads(), timeout=HANG_LIMIT)
            outcome.counters = store.counters()
            store.close()
    assert settled, f"{path} under {fault.id}: the library's threads were still at work {HANG_LIMIT:g} s later"
    outcome.records = list(handler.records)
    outcome.logs = format_records(outcome.records)
    outcome.requests = fake.sent()
    outcome.backoff_hints = hints
    return outcome


def _drive(path: str, store: MembaseMemoryStore, outcome: Outcome) -> None:
    if path == "add":
        try:
            outcome.extra["answer"] = asyncio.run(store.add(SAVED_NOTE))
        except Exception as error:  # noqa: BLE001 - recorded for the test to judge
            outcome.raised = error
        return

    manager: dict[str, Any] = {}
    prompt = QUESTION
    if path == "recall":
        script: list[str | ToolCall] = ["done"]
    elif path == "add_messages":
        script, prompt = ["Noted."], SAVED_NOTE
        manager["injection"] = False
    else:
        manager["injection"] = False
        call = {
            "search_memory": ToolCall("search_memory", {"query": "ledger database"}),
            "membase_search": ToolCall("membase_search", {"query": "ledger database"}),
            "membase_save": ToolCall("membase_save", {"content": SAVED_NOTE}),
            "membase_profile": ToolCall("membase_profile", {"topic": "ledger"}),
            "add_memory": ToolCall("add_memory", {"entries": [SAVED_NOTE]}),
        }[path]
        script = [call, "done"]
        if path == "add_memory":
            manager["add_tool_config"] = True

    agent, model = make_agent(store, script, **manager)
    result = agent(prompt)
    outcome.extra["answer"] = str(result)
    outcome.memory_block = model.memory_block(0)
    outcome.model_saw = all_sent_text(model)
    if model.tool_results():
        outcome.status, outcome.text = tool_text(model)

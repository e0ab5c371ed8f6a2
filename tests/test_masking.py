"""Everything from Membase is masked before the model, a log line, a span or an exception sees it: a key echoed in a
Memory's name, a passage, a profile fact, a Memory's reason for not answering, an error's reason or a forget's ``how``
leaves no 8 characters of itself anywhere (the transport's own echoes are in ``test_shared_runtime.py``).

Driven through a real ``strands.Agent`` and ``MemoryManager`` (recall with the profile, the manager's own
``search_memory`` tool, every tool of the store, a forget's interrupt) over the testing kit, plus ``run_check``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from membase_strands import MembaseMemoryStore
from membase_strands.check import run_check
from membase_strands.testing import InMemoryMembase, ToolCall, status
from tests.support.agents import ALL_TOOLS, resume
from tests.support.leaks import error_texts, span_texts
from tests.support.loopback import LoopbackMembase, RawAction
from tests.support.store_helpers import LONG, MEMORIES, QUESTION, make_agent, sdk_client

KEY = "mb_" + hashlib.sha256(b"echoed by Membase").hexdigest()[:32]
PIECES = {KEY[i : i + 8] for i in range(len(KEY) - 7)}


def leaks(text: str) -> bool:
    return any(piece in text for piece in PIECES)


def echoing() -> InMemoryMembase:
    """An account whose Memories, passages, profile, reasons, errors and forget sentence all quote its key."""
    fake = InMemoryMembase(key=KEY, hosted=True)
    fake.containers[0]["name"] = f"Main {KEY}"
    fake.remember(f"The ledger vault code is {KEY}, said the ledger.")
    fake.add_memory(f"Archive {KEY[5:30]}")
    fake.cannot_answer("ctr_2", f"the ledger agent has no model for {KEY}")
    fake.standing.append(f"Keeps the ledger key {KEY} in a drawer.")
    how = f"Forgetting removes it for good (key {KEY})."
    fake.always("DELETE", "/v1/memories/{id}", lambda request: _confirmation(request, how))
    fake.always(*MEMORIES, status(400, f"the note was refused for {KEY}"))
    return fake


def _confirmation(request: httpx.Request, how: str) -> httpx.Response:
    if request.url.params.get("confirm") == "true":
        return httpx.Response(200, json={"status": "forgotten"})
    return httpx.Response(200, json={"status": "confirmation_required", "verb": "forget_memory", "how": how})


def test_a_key_membase_echoes_in_what_it_sends_leaves_no_8_characters_of_itself_anywhere(
    caplog: pytest.LogCaptureFixture, spans: InMemorySpanExporter
) -> None:
    caplog.set_level(logging.DEBUG)
    fake = echoing()
    seen: list[str] = []
    shown_id = r"\(id: ([^)]+)\)"
    forget = lambda sent: ToolCall("membase_forget", {"memory_id": re.findall(shown_id, model.tool_result_text())[0]})  # noqa: E731
    script = [
        ToolCall("search_memory", {"query": "ledger"}),  # the manager's tool: entries and their metadata
        ToolCall("membase_search", {"query": "ledger"}),
        ToolCall("membase_search", {"query": "ledger", "container": "Nowhere"}),  # the names in reach, listed
        ToolCall("membase_profile", {"topic": "ledger"}),
        ToolCall("membase_save", {"content": "I like green tea."}),  # several Memories in reach: their names
        ToolCall("membase_save", {"content": "I like green tea.", "container": "ctr_main"}),  # a 400 quoting it
        ToolCall("membase_search", {"query": "ledger vault"}),
        forget,
        "Done.",
    ]
    store = fake.store(tools=ALL_TOOLS, recall_profile=True, recall_timeout=LONG)
    agent, model = make_agent(store, script)

    result = agent(QUESTION)
    while result.stop_reason == "interrupt":
        seen += [json.dumps(interrupt.reason) for interrupt in result.interrupts]  # what the person is asked
        result = resume(agent, result, True)

    assert str(result).strip() == "Done." and fake.sent("DELETE")[-1].params == {"confirm": "true"}
    assert "key [redacted])" in seen[0] and "refused for [redacted]" in model.tool_result_text(-3)
    assert "[Membase profile]" in (model.memory_block(0) or "") and "[redacted]" in (model.memory_block(0) or "")
    seen += [json.dumps(call, default=str) for call in model.calls]  # all the model was sent
    for raised in _failures(fake, store):
        seen += error_texts(raised)
    report = run_check(client=sdk_client(fake, max_retries=0))
    seen += [report.to_text(), json.dumps(report.to_dict())]
    store.close()

    seen += [r.getMessage() for r in caplog.records] + [r.exc_text or "" for r in caplog.records]
    seen += [text for span in spans.get_finished_spans() for text in span_texts(span)]
    assert len(seen) > 20 and not [text for text in seen if leaks(text)]


def _failures(fake: InMemoryMembase, store: Any) -> list[BaseException]:
    """The exceptions a recall and a captured write raise when Membase's error echoes the key."""
    raised = []
    fake.on("POST", "/v1/search", status(403, f"unknown key {KEY}"))
    with fake.store(capture=True, container="ctr_main", write_timeout=LONG) as capturing:
        for call in (store.search(QUESTION), capturing.add("I like green tea.")):
            try:
                asyncio.run(call)
            except Exception as error:  # noqa: BLE001 - what a caller reads of it is checked
                raised.append(error)
    assert len(raised) == 2
    return raised


def echo_in_reason_and_header(status_code: int, body: bytes) -> RawAction:
    """Answer with ``body`` under a reason phrase and a header that both quote the request's key."""

    def act(handler: Any) -> None:
        handler.close_connection = True
        head = f"HTTP/1.1 {status_code} Refused for {handler.seen.key}\r\nX-Echo: {handler.seen.key}\r\n"
        handler.wfile.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        handler.wfile.flush()

    return act


@pytest.mark.parametrize("status_code", [200, 500, 403])
def test_a_key_echoed_in_a_reason_phrase_or_a_header_shows_nowhere(
    status_code: int, caplog: pytest.LogCaptureFixture, spans: InMemorySpanExporter
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger (httpx's request lines too) but httpcore's byte-level trace
    body = json.dumps({"results": [], "error": {"code": "error", "message": "refused"}}).encode()
    with LoopbackMembase(InMemoryMembase(key=KEY)) as server:
        for route in (("POST", "/v1/search"), ("POST", "/v1/search"), MEMORIES, ("GET", "/v1/profile")):
            server.always(*route, echo_in_reason_and_header(status_code, body))
        store = MembaseMemoryStore(api_key=KEY, base_url=server.url, capture=True, container=None, recall_timeout=LONG)
        raised = []
        for attempt in (store.search(QUESTION), store.add("A note for the ledger.")):
            try:
                asyncio.run(attempt)
            except Exception as error:  # noqa: BLE001 - what the caller would see is checked below
                raised.append(error)
        agent, model = make_agent(store, [ToolCall("membase_search", {"query": "ledger"}), "done"])
        agent("Look it up.")
        store.close()
    shown = [model.sent_text(), *(text for error in raised for text in error_texts(error)), repr(store)]
    shown += [record.getMessage() for record in caplog.records if not record.name.startswith("httpcore")] + [
        text for span in spans.get_finished_spans() for text in span_texts(span)
    ]
    assert not [text for text in shown if leaks(text)]

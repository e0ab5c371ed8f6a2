"""The API key never leaks: not in a log record (message or traceback, at DEBUG for every logger),
not in an exception or its traceback raised to the caller, not in ``repr()``/``str()`` of the
store or its errors, not in a tool result, and not in an OpenTelemetry span attribute or event.

Every fault here echoes the key: error bodies carry the ``Authorization`` header and the key, and
transport errors carry them in their message, to give a leak every chance.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from strands.telemetry import tracer as strands_tracer

from membase_strands import MembaseMemoryStore
from membase_strands.testing import API_KEY, InMemoryMembase
from tests.support.faults import (
    FAULTS_BY_ID,
    GENEROUS,
    LIST_FAULTS_BY_ID,
    PATHS,
    Fault,
    Outcome,
    capture_logs,
    envelope,
    format_records,
    hanging,
    instant_sdk_backoff,
    raising,
    run_case,
)
from tests.support.store_helpers import wait_until

# A representative set: refusals, a server error echoing the key, a connection error and an SDK
# timeout whose messages carry the key, and a hang past every budget.
SECRET_FAULTS = [
    Fault("403", lambda g, _: envelope(403), kind="access"),
    Fault("401", lambda g, _: envelope(401), kind="unauthenticated"),
    Fault("500", lambda g, _: envelope(500), kind="server_error"),
    Fault("connect", lambda g, _: raising(httpx.ConnectError, "[Errno 111] Connection refused"), "connection"),
    Fault("sdk_timeout", lambda g, _: raising(httpx.ReadTimeout, "The read operation timed out"), "timeout"),
    FAULTS_BY_ID["hang"],
]
SECRET_FAULTS_BY_ID = {fault.id: fault for fault in SECRET_FAULTS}


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Strands' tracer, writing to an in-memory exporter for this test only."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = strands_tracer.Tracer()
    tracer.tracer_provider = provider
    tracer.tracer = provider.get_tracer(strands_tracer.__name__)
    monkeypatch.setattr(strands_tracer, "_tracer_instance", tracer)
    yield exporter
    provider.shutdown()


def span_texts(exporter: InMemorySpanExporter) -> dict[str, list[str]]:
    """Every text a span carries (name, status, attributes, events and their attributes, links), by span."""
    found: dict[str, list[str]] = {}
    for span in exporter.get_finished_spans():
        texts = [span.name, span.status.description or ""]
        texts += [str(value) for value in (span.attributes or {}).values()]
        for event in span.events:
            texts += [event.name, *(str(value) for value in (event.attributes or {}).values())]
        for link in span.links:
            texts += [str(value) for value in (link.attributes or {}).values()]
        found.setdefault(span.name, []).extend(texts)
    return found


def leaks_in_spans(exporter: InMemorySpanExporter) -> list[str]:
    return [name for name, texts in span_texts(exporter).items() if any(API_KEY in text for text in texts)]


def exception_texts(error: BaseException) -> list[str]:
    return [str(error), repr(error), "".join(traceback.format_exception(error))]


def leaks_in(o: Outcome, exporter: InMemorySpanExporter) -> list[str]:
    where = []
    if API_KEY in o.logs:
        where.append("logs")
    if API_KEY in o.model_saw or API_KEY in o.text:
        where.append("model")
    if o.raised is not None and any(API_KEY in text for text in exception_texts(o.raised)):
        where.append("raised")
    where += [f"span:{name}" for name in leaks_in_spans(exporter)]
    return where


def _cases() -> list[Any]:
    return [pytest.param(path, fault.id, id=f"{path}-{fault.id}") for path in PATHS for fault in SECRET_FAULTS]


# --- Every path, every representative fault ------------------------------------------------------


@pytest.mark.parametrize(("path", "fault_id"), _cases())
def test_the_key_leaks_nowhere(spans: InMemorySpanExporter, path: str, fault_id: str) -> None:
    o = run_case(path, SECRET_FAULTS_BY_ID[fault_id])
    # The capture really ran at DEBUG and the spans were really recorded.
    assert any(r.levelname == "DEBUG" for r in o.records)
    if path != "add":
        assert spans.get_finished_spans()
    assert leaks_in(o, spans) == []


@pytest.mark.parametrize(
    "path",
    [
        "recall",
        "membase_search",
        "membase_save",
        "add_memory",
        pytest.param("add"),
        pytest.param("add_messages"),
    ],
)
def test_the_key_leaks_nowhere_when_the_container_list_refuses(spans: InMemorySpanExporter, path: str) -> None:
    o = run_case(path, LIST_FAULTS_BY_ID["list_403"], pinned=True)
    assert leaks_in(o, spans) == []


# --- Errors raised straight to the caller --------------------------------------------------------


def direct_store(fault: Fault, route: tuple[str, str], **options: Any) -> tuple[MembaseMemoryStore, InMemoryMembase]:
    """A store built from the key over a fake whose ``route`` always fails with ``fault``."""
    fake = InMemoryMembase()
    fake.always(*route, fault.make(threading.Event(), 0.05))
    options.setdefault("recall_timeout", GENEROUS)
    options.setdefault("write_timeout", GENEROUS)
    return fake.store(**options), fake


def raised_by(call: Any) -> BaseException:
    hints: list[str | None] = []
    with instant_sdk_backoff(hints):
        try:
            asyncio.run(call())
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            return error
    raise AssertionError("nothing was raised")


DIRECT_CASES = [
    pytest.param("search", "403"),
    pytest.param("search", "401"),
    pytest.param("search", "500"),
    pytest.param("search", "connect"),
    pytest.param("search", "sdk_timeout"),
    pytest.param("add", "403"),
    pytest.param("add", "401"),
    pytest.param("add", "500"),
    pytest.param("add", "connect"),
    pytest.param("add", "sdk_timeout"),
]


@pytest.mark.parametrize(("method", "fault_id"), DIRECT_CASES)
def test_no_error_raised_to_the_caller_carries_the_key(method: str, fault_id: str) -> None:
    fault = SECRET_FAULTS_BY_ID[fault_id]
    route = ("POST", "/v1/search") if method == "search" else ("POST", "/v1/memories")
    store, _ = direct_store(fault, route, capture=True)
    with capture_logs() as handler:
        error = raised_by(lambda: store.search("ledger") if method == "search" else store.add("a note"))
    store.close()
    assert API_KEY not in format_records(handler.records)
    for text in exception_texts(error):
        assert API_KEY not in text


def test_the_key_is_masked_in_the_message_of_an_error_that_carried_it() -> None:
    store, _ = direct_store(SECRET_FAULTS_BY_ID["500"], ("POST", "/v1/search"))
    error = raised_by(lambda: store.search("ledger"))
    assert "[redacted]" in str(error)
    assert error.__cause__ is None and error.__suppress_context__


def test_the_late_failure_of_a_hung_recall_is_logged_without_the_key() -> None:
    gate = threading.Event()
    fake = InMemoryMembase()
    fake.always("POST", "/v1/search", hanging(gate, 30.0))
    store = fake.store(recall_timeout=0.05)
    with capture_logs() as handler:
        raised_by(lambda: store.search("ledger"))
        gate.set()
        assert wait_until(lambda: store.counters()["recall_late_completions"] == 1, timeout=30.0)
    store.close()
    logs = format_records(handler.records)
    assert "late recall failed" in logs
    assert API_KEY not in logs


def test_initialize_logs_an_unlistable_memory_list_without_the_key() -> None:
    store, _ = direct_store(SECRET_FAULTS_BY_ID["500"], ("GET", "/v1/containers"), container="Main")
    with capture_logs() as handler:
        asyncio.run(store.initialize())
    logs = format_records(handler.records)
    assert "could not list the Memories in reach" in logs
    assert API_KEY not in logs


# --- repr and str --------------------------------------------------------------------------------


def test_repr_and_str_of_a_store_never_show_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMBASE_API_KEY", API_KEY)
    monkeypatch.delenv("MEMBASE_BASE_URL", raising=False)
    for store in (
        MembaseMemoryStore(),
        MembaseMemoryStore(api_key=API_KEY, base_url="http://127.0.0.1:9", container="Main", capture=True),
        MembaseMemoryStore(client=InMemoryMembase().client()),
    ):
        assert API_KEY not in repr(store)
        assert API_KEY not in str(store)
        assert API_KEY not in repr(store.counters())
        store.close()


def test_the_tools_descriptions_and_specs_never_show_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MembaseMemoryStore(client=InMemoryMembase().client())
    for tool in store.get_tools():
        assert API_KEY not in repr(tool.tool_spec)
    assert API_KEY not in store.description

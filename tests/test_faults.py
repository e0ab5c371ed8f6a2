"""The fault matrix: every path through every fault injected at the transport.

Every path runs on a store built from a key (``fake.store()``), the production path. Paths: the
automatic recall (an agent turn), the manager's ``search_memory`` tool, the three Membase tools, and the
captured writes (``await store.add``, the manager's ``add_memory`` tool, ``add_messages`` on a synchronous
turn with extraction). Faults: a hang past every budget, connection refused or reset, 5xx, 429 with and without
``Retry-After``, 4xx, 2xx answers that cannot be read or have the wrong shape, a 10 MB answer, and the
container list failing while a pinned Memory name is resolved. Every error body echoes the API key.

Each case runs once (cached) with its own fake, store and agent; see ``tests/support/faults.py``. A store
given its own ``client=`` uses it as it is (its retries apply to automatic recall too): one test below.
"""

from __future__ import annotations

import functools
import re

import membase
import pytest

from membase_strands import MembaseAccessError, MembaseMemoryStore, MembaseWriteTimeout
from membase_strands._failures import BadResponseError
from membase_strands.testing import InMemoryMembase, status
from tests.support.faults import (
    API_KEY,
    FAULTS,
    FAULTS_BY_ID,
    GENEROUS,
    LIST_FAULTS,
    LIST_FAULTS_BY_ID,
    PATHS,
    ROUTE,
    SDK_ATTEMPTS,
    SERVER_TEXT,
    TOOL_PATHS,
    Outcome,
    budgeted,
    capture_logs,
    expected,
    instant_sdk_backoff,
    run_case,
)
from tests.support.store_helpers import FACT, QUESTION, make_agent

# The phrase each failure kind's tool sentence must carry (the README's table).
PHRASES = {
    "timeout": "did not answer in time",
    "connection": "could not be reached",
    "server_error": "internal error",
    "rate_limited": "busy",
    "unavailable": "cannot run right now",
    "access": "narrowed or revoked",
    "unauthenticated": "(401)",
    "bad_request": "rejected the request",
    "not_found": "could not find",
    "bad_response": "could not be read",
}
# What a captured ``await store.add`` raises for each kind, so the manager keeps the write.
RAISES: dict[str, type[BaseException]] = {
    "timeout": MembaseWriteTimeout,
    "connection": membase.APIConnectionError,
    "server_error": membase.InternalServerError,
    "rate_limited": membase.RateLimitError,
    "unavailable": membase.UnprocessableEntityError,
    "access": MembaseAccessError,
    "unauthenticated": membase.AuthenticationError,
    "bad_request": membase.BadRequestError,
    "not_found": membase.NotFoundError,
    "bad_response": BadResponseError,
}
# Kinds the SDK retries (timeouts, connection errors, 429, 5xx).
RETRIED = {"timeout", "connection", "server_error", "rate_limited"}
# Paths that wait for the SDK's full timeout and retries; every other path makes one attempt.
RETRYING_PATHS = {"membase_search", "membase_profile"}
RECALL_CHARS = 20_000  # the store's default recall size budget
CUT_MARKER = "[... cut: this passage is longer than the recall budget]"
ENTRY = re.compile(r"<entry[^>]*>(.*?)</entry>", re.S)


@functools.cache
def outcome(path: str, fault_id: str, pinned: bool = False) -> Outcome:
    fault = LIST_FAULTS_BY_ID[fault_id] if pinned else FAULTS_BY_ID[fault_id]
    return run_case(path, fault, pinned=pinned)


def _cases() -> list[pytest.param]:
    cases = []
    for path in PATHS:
        for fault in FAULTS:
            cases.append(pytest.param(path, fault.id, id=f"{path}-{fault.id}"))
    return cases


# --- Checks every case shares ----------------------------------------------------------------


def check_common(o: Outcome) -> None:
    # On time: under a host that never answers, the recall and write paths hand back their result while
    # the request is still held (their budget ended the wait, not the host); every other path waits for
    # no request at all once it returns (the tools' attempts are counted in check_attempts).
    held = 1 if budgeted(o.path, o.fault) else 0
    assert o.held_when_it_returned == held, f"{o.path} under {o.fault.id}: {o.held_when_it_returned} still held"
    # The key goes nowhere: not in a log line (tracebacks included), nothing the model read, nothing raised.
    assert API_KEY not in o.logs
    assert API_KEY not in o.model_saw
    assert API_KEY not in o.text
    if o.raised is not None:
        assert API_KEY not in str(o.raised)
        assert API_KEY not in repr(o.raised)
    # Nothing here is an ERROR: each fault is an expected, handled condition (warnings at most).
    errors = [f"{r.name}: {r.getMessage()[:200]}" for r in o.records if r.levelno >= 40]
    assert errors == []
    # The model never reads a traceback; recall never hands it a raw HTML page.
    assert "Traceback" not in o.model_saw
    if o.path in ("recall", "search_memory"):
        assert "<html" not in o.model_saw


def check_attempts(o: Outcome, route: tuple[str, str]) -> None:
    """The budgeted paths and membase_save make one attempt; the search and profile tools let the SDK retry."""
    sent = [r for r in o.requests if (r.method, r.path) == route]
    kind = expected(o.path, o.fault)
    if o.path in RETRYING_PATHS and kind in RETRIED:
        assert len(sent) == SDK_ATTEMPTS
    else:
        assert len(sent) == 1


def check_recall(o: Outcome) -> None:
    """Recall contributes nothing, a framed notice, or (for a real 2xx success) capped passages."""
    kind = expected(o.path, o.fault)
    block = o.memory_block
    if kind != "ok" or o.fault.id in ("200_hit_without_content", "200_content_not_string"):
        assert block is None
        assert SERVER_TEXT not in o.model_saw
        return
    assert block is not None
    entries = ENTRY.findall(block)
    if o.fault.id == "200_memory_unsearchable":
        [notice] = entries
        assert notice.startswith("[Membase notice] The Memory (Main) could not be searched: ")
        assert "its silence is not evidence" in notice
    else:  # 10 MB: one passage, cut to the recall budget with a visible marker
        [passage] = entries
        assert passage.startswith("[Main] ledger ledger")
        assert passage.endswith(CUT_MARKER)
        assert len(passage) <= RECALL_CHARS
    for entry in entries:
        if SERVER_TEXT in entry:
            assert entry.startswith("[Membase notice]"), "server text injected as if it were a remembered fact"


def check_search_memory(o: Outcome) -> None:
    """The manager's own tool skips a failing store: it reports success with no entries (Strands' behaviour)."""
    kind = expected(o.path, o.fault)
    assert o.status == "success"
    if kind != "ok" or o.fault.id in ("200_hit_without_content", "200_content_not_string"):
        assert o.text == "[]"
        return
    if o.fault.id == "200_memory_unsearchable":
        assert o.text.startswith('[{"content": "[Membase notice] The Memory (Main) could not be searched: ')
    else:
        assert o.text.startswith('[{"content": "[Main] ledger ledger')
        assert len(o.text) <= RECALL_CHARS + 1_000


def check_tool(o: Outcome) -> None:
    kind = expected(o.path, o.fault)
    if o.path == "membase_search" and o.fault.id == "200_memory_unsearchable":
        # No Memory could answer, so nothing was really searched: an error status, and the reason.
        assert o.status == "error"
        assert "Not searched" in o.text
        return
    if kind == "ok":
        assert o.status == "success"
        if o.path == "membase_save":
            assert o.text == "Saved to Membase."
        if o.fault.id == "200_10mb":
            assert len(o.text) <= RECALL_CHARS + 1_000, f"{len(o.text)} characters reached the model"
        return
    assert o.status == "error"
    assert PHRASES[kind] in o.text
    assert o.text.endswith("."), o.text
    if o.path == "membase_save" and kind == "timeout":
        assert "may or may not have been saved" in o.text


def check_write(o: Outcome) -> None:
    kind = expected(o.path, o.fault)
    if o.path == "add":
        if kind == "ok":
            assert o.raised is None
        else:
            assert isinstance(o.raised, RAISES[kind]), repr(o.raised)
        return
    if o.path == "add_memory":
        if kind == "ok":
            assert (o.status, o.text) == ("success", '{"stored": 1}')
        else:
            assert o.status == "error"
            assert o.text.startswith("Error: AggregateMemoryError - MemoryManager: failed to add 1 of 1 entries")
            if kind == "access":
                assert "narrowed or revoked" in o.text
            if kind == "timeout":
                assert "ran out of time" in o.text
        return
    # add_messages: the manager's extraction hears of the failure (and keeps the batch for a retry).
    failed = [r for r in o.records if r.name.startswith("strands.memory") and "extraction failed" in r.getMessage()]
    if kind == "ok":
        assert failed == []
        assert o.counters["writes_saved"] == 1
    else:
        assert len(failed) == 1
        assert o.counters["writes_saved"] == 0
        # A hang runs out of the write budget, then fails in the background when the host gives up: both count.
        timeouts = 1 if kind == "timeout" else 0
        assert (o.counters["write_timeouts"], o.counters["write_errors"]) == (timeouts, 1)
        assert o.counters[f"errors.{kind}"] == 1


CHECKS = {
    "recall": check_recall,
    "search_memory": check_search_memory,
    "membase_search": check_tool,
    "membase_save": check_tool,
    "membase_profile": check_tool,
    "add": check_write,
    "add_memory": check_write,
    "add_messages": check_write,
}

# --- The matrix --------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "fault_id"), _cases())
def test_fault_matrix(path: str, fault_id: str) -> None:
    o = outcome(path, fault_id)
    check_common(o)
    check_attempts(o, ROUTE[path])
    CHECKS[path](o)


@pytest.mark.parametrize("fault_id", [f.id for f in LIST_FAULTS])
@pytest.mark.parametrize("path", [p for p in PATHS if p != "membase_profile"])
def test_container_list_failing_while_a_pinned_name_is_resolved(path: str, fault_id: str) -> None:
    o = outcome(path, fault_id, pinned=True)
    check_common(o)
    CHECKS[path](o)
    # Nothing reached the search or write route: the name was never resolved to an id.
    assert [r.path for r in o.requests if r.path != "/v1/containers"] == []


# --- Across faults -------------------------------------------------------------------------------


@pytest.mark.parametrize("tool", TOOL_PATHS)
def test_a_tools_sentences_tell_kinds_of_fault_apart(tool: str) -> None:
    by_kind: dict[str, set[str]] = {}
    for fault in FAULTS:
        o = outcome(tool, fault.id)
        kind = expected(tool, fault)
        if kind != "ok":
            by_kind.setdefault(kind, set()).add(o.text)
    assert set(by_kind) >= {"timeout", "connection", "server_error", "rate_limited", "access", "bad_request"}
    kinds = sorted(by_kind)
    for i, first in enumerate(kinds):
        for second in kinds[i + 1 :]:
            shared = by_kind[first] & by_kind[second]
            assert not shared, f"{tool}: {first} and {second} read the same: {shared}"


def test_distinct_statuses_of_one_kind_still_name_their_status() -> None:
    texts = {code: outcome("membase_search", code).text for code in ("500", "502", "503")}
    for code, text in texts.items():
        assert f"({code}: " in text
    assert len(set(texts.values())) == 3


def test_the_sdk_honours_retry_after_for_the_tools_but_recall_never_retries() -> None:
    assert outcome("membase_search", "429_retry_after").backoff_hints == ["7", "7"]
    assert outcome("membase_search", "429").backoff_hints == [None, None]
    assert outcome("recall", "429_retry_after").backoff_hints == []
    assert outcome("membase_save", "429_retry_after").backoff_hints == []
    assert outcome("add", "429_retry_after").backoff_hints == []


def test_a_hung_recall_is_logged_as_running_out_of_time_then_as_failing_late() -> None:
    o = outcome("recall", "hang")
    messages = [r.getMessage() for r in o.records if r.name.startswith("membase_strands")]
    assert any("ran out of time" in m for m in messages)
    assert any("late recall failed" in m for m in messages)
    assert o.counters["recall_timeouts"] == 1
    assert o.counters["recall_late_completions"] == 1


def test_a_refused_recall_pauses_and_says_so_once() -> None:
    o = outcome("recall", "403")
    paused = [r for r in o.records if "automatic recall paused" in r.getMessage()]
    assert len(paused) == 1
    # One warning for the refusal, the manager's (from the exception's text); the store's own line is INFO.
    assert paused[0].levelname == "INFO"
    warned = [r.getMessage() for r in o.records if r.levelno >= 30]
    assert len(warned) == 1 and "narrowed or revoked" in warned[0]


# --- A client passed in ------------------------------------------------------------------------------


@pytest.mark.parametrize(("retries", "searches", "recalled"), [(None, 3, True), (0, 1, False)])
def test_a_store_given_a_client_recalls_through_that_client_as_it_is_retries_included(
    retries: int | None, searches: int, recalled: bool
) -> None:
    # Not the single attempt a store built from a key makes: the client's own retries (the SDK's default
    # is two) apply to automatic recall too, and a client built with max_retries=0 makes one attempt.
    fake = InMemoryMembase()
    fake.remember(FACT)
    fake.on("POST", "/v1/search", status(503), status(503))
    client = fake.client() if retries is None else fake.client(max_retries=retries)
    store = MembaseMemoryStore(client=client, recall_timeout=GENEROUS)
    agent, model = make_agent(store, ["done"])
    with capture_logs(), instant_sdk_backoff([]):
        agent(QUESTION)
    store.close()

    assert len(fake.sent("POST", "/v1/search")) == searches
    assert (f"[Main] {FACT}" in (model.memory_block() or "")) is recalled
    assert store.counters()["recall_errors"] == (0 if recalled else 1)

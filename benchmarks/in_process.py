"""Sections 6-8: the library now, in this process, through the testing kit's ``InMemoryMembase`` (a store built
from a key, the production path down to the transport). They judge the library against its own budgets; nothing
is compared."""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
from _server import FACT
from common import Plan, Section, fmt, kit_client, median, spread
from strands import Agent
from strands.memory import MemoryManager
from strands.tools.decorator import DecoratedFunctionTool

from membase_strands import MembaseMemoryStore
from membase_strands.testing import InMemoryMembase, ScriptedModel, hang

QUESTION = "Which database did we choose for the ledger?"
JSON = {"content-type": "application/json"}
STALL_BUDGET_S = 0.5
FIRST_TURN_SLACK_S = 0.050
CAPTURE_SLACK_S = 0.100
DEFAULT_WRITE_TIMEOUT = inspect.signature(MembaseMemoryStore).parameters["write_timeout"].default
STORE_TIME_TARGET_MS = 15.0
SLOW_S = 1.0  # a shape whose store time is over this on the first trial is not repeated: one trial shows the miss
MB = 1024 * 1024


def _answering(body: bytes) -> InMemoryMembase:
    fake = InMemoryMembase()
    fake.always("POST", "/v1/search", lambda request: httpx.Response(200, content=body, headers=JSON))
    return fake


def _agent(store: MembaseMemoryStore) -> tuple[Agent, ScriptedModel]:
    model = ScriptedModel()
    return Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None), model


def _turn_s(agent: Agent, model: ScriptedModel, prompt: str = QUESTION) -> float:
    """One synchronous ``agent(prompt)`` on an empty history, in seconds."""
    agent.messages.clear()
    model.calls.clear()
    started = time.perf_counter()
    agent(prompt)
    return time.perf_counter() - started


def _recall_threads() -> int:
    return sum(t.name.startswith("membase-recall[") for t in threading.enumerate())


def _wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return bool(predicate())


def _stall_trial(turns: int) -> dict[str, float]:
    fake = InMemoryMembase()
    fake.remember(FACT)
    stall = threading.Event()
    store = fake.store(recall_timeout=STALL_BUDGET_S)
    try:
        agent, model = _agent(store)
        healthy = median([_turn_s(agent, model) for _ in range(3 + turns)][3:])
        fake.always("POST", "/v1/search", hang(stall, then=fake.answer, limit=30.0))
        sent, skipped = len(fake.sent("POST", "/v1/search")), store.counters()["recall_skipped"]
        first = _turn_s(agent, model)
        following, threads, injected = [], 0, 0
        for _ in range(turns):
            following.append(_turn_s(agent, model))
            injected += model.memory_block() is not None
            threads = max(threads, _recall_threads())
        result = {
            "first_s": first,
            "healthy_ms": healthy * 1000,
            "following_ms": median(following) * 1000,
            "sent": len(fake.sent("POST", "/v1/search")) - sent,
            "skipped": store.counters()["recall_skipped"] - skipped,
            "injected": injected,
            "threads": threads,
        }
        stall.set()
        result["threads_after"] = 0 if _wait_until(lambda: _recall_threads() == 0, 10.0) else _recall_threads()
        fake.heal()
        _turn_s(agent, model)
        result["resumed"] = model.memory_block() is not None
        return result
    finally:
        stall.set()
        store.close()


def stalled_memory(plan: Plan) -> Section:
    section = Section(
        6,
        "Stalled memory",
        f"`POST /v1/search` hangs (a testing-kit responder blocked on an event) under `recall_timeout="
        f"{STALL_BUDGET_S}`. Synchronous `agent(...)` turns through `strands.Agent`: the first meets the stall, "
        f"then {plan.stall_turns} more run while it lasts; then the stall ends. {plan.stall_trials} trial(s), "
        "each with a fresh store; medians, and the worst trial for the targets.",
        ["figure", "median", "per trial"],
    )
    trials = [_stall_trial(plan.stall_turns) for _ in range(plan.stall_trials)]

    def col(key: str) -> list[float]:
        return [float(t[key]) for t in trials]

    for label, key in (
        ("first turn (s)", "first_s"),
        ("healthy turn before the stall (ms)", "healthy_ms"),
        ("following turns (ms)", "following_ms"),
        ("search requests during the stall", "sent"),
        ("following turns that skipped recall", "skipped"),
        ("following turns with memory injected", "injected"),
        ("`membase-recall` threads during the stall, most", "threads"),
        ("`membase-recall` threads after it ended", "threads_after"),
    ):
        section.row(label, fmt(median(col(key))), spread(col(key)))
    limit = STALL_BUDGET_S + FIRST_TURN_SLACK_S
    section.target(
        f"first turn within recall_timeout + {FIRST_TURN_SLACK_S * 1000:.0f} ms ({limit:g} s)",
        max(col("first_s")) <= limit,
        f"worst {fmt(max(col('first_s')))} s",
    )
    section.target(
        "every following turn skips recall (no request, nothing injected)",
        min(col("skipped")) == plan.stall_turns and max(col("injected")) == 0,
        f"skipped {min(col('skipped')):.0f} of {plan.stall_turns}; {max(col('injected')):.0f} injected",
    )
    section.target(
        "exactly one search request during the stall",
        set(col("sent")) == {1.0},
        ", ".join(f"{s:.0f}" for s in col("sent")),
    )
    section.target(
        "at most one `membase-recall` thread during the stall, none after it",
        max(col("threads")) <= 1 and max(col("threads_after")) == 0,
        f"{max(col('threads')):.0f} during, {max(col('threads_after')):.0f} after",
    )
    section.target(
        "memory is injected again once the stall ends",
        all(t["resumed"] for t in trials),
        f"{sum(bool(t['resumed']) for t in trials)} of {len(trials)} trials",
    )
    return section


def _capture_turn(write_timeout: float | None, attempt_s: float) -> tuple[float, int]:
    fake = InMemoryMembase()
    release = threading.Event()
    fake.always("POST", "/v1/memories", hang(release, limit=attempt_s))  # a read timeout after attempt_s
    store = fake.store(capture=True, extraction=True, write_timeout=write_timeout)
    try:
        agent, model = _agent(store)
        elapsed = _turn_s(agent, model, "Remember that we chose Postgres for the ledger.")
        return elapsed, len(fake.sent("POST", "/v1/memories"))
    finally:
        release.set()
        fake.heal()  # the store sends the failed batch again at close: let it through
        store.close()


def hung_capture(plan: Plan) -> Section:
    section = Section(
        7,
        "Capture turn with a hung Membase",
        "A synchronous `agent(...)` over a store with `capture=True, extraction=True`: Strands flushes at the end "
        "of the call, so the store's write runs inside it. `POST /v1/memories` hangs, then raises a read timeout "
        "after a stand-in for one SDK attempt (the SDK's own is 90 s).",
        ["write_timeout", "stand-in attempt (s)", "turn (s)", "runs", "POST /v1/memories sent"],
    )
    for write_timeout, attempt_s, runs in plan.capture:
        results = [_capture_turn(write_timeout, attempt_s) for _ in range(runs)]
        walls, posts = [r[0] for r in results], max(r[1] for r in results)
        default = " (default)" if write_timeout == DEFAULT_WRITE_TIMEOUT else ""
        label = "None" if write_timeout is None else f"{write_timeout:g} s{default}"
        section.row(label, f"{attempt_s:g}", fmt(median(walls)), f"{runs}: {spread(walls)}", posts)
        if write_timeout is None:
            section.target(
                "write_timeout=None: the turn lasts one attempt, one POST",
                posts == 1 and max(walls) <= attempt_s + 1.0,
                f"{posts} POST, worst {fmt(max(walls))} s",
            )
        else:
            section.target(
                f"write_timeout={label}: the turn returns within it + {CAPTURE_SLACK_S * 1000:.0f} ms",
                max(walls) <= write_timeout + CAPTURE_SLACK_S,
                f"worst {fmt(max(walls))} s",
            )
    return section


# --- Large answers -----------------------------------------------------------------------------------

LINE = "We chose Postgres for the ledger after weighing replication, backups and cost. "
WIDE = "Wir wählten Postgres für das Hauptbuch, nach Replikation, Sicherung und Kosten: 数据库的选择。 "


def _page(line: str, late: str = "") -> str:
    """About 1 M characters of ``line``, ending with ``late``."""
    return (line * (MB // len(line) + 1))[: MB - len(late)] + late


def _shapes(passages: int, small_mb: int) -> Iterator[tuple[str, list[str], bool]]:
    """(label, passage texts, scored) for every shape measured, built one at a time."""
    count = range(passages)
    yield "differing passages", [f"Passage {i}: {_page(LINE)}" for i in count], True
    yield "differing passages, no scores", [f"Passage {i}: {_page(LINE)}" for i in count], False
    yield "one passage repeated", [_page(LINE)] * passages, True
    yield "passages that differ only at the end", [_page(LINE, f" #{i:06d}") for i in count], True
    yield "... no scores", [_page(LINE, f" #{i:06d}") for i in count], False
    yield "non-ASCII, differing only at the end", [_page(WIDE, f" #{i:06d}") for i in count], True
    small = [f"Note {i}: {LINE * 6}" for i in range(small_mb * MB // (len(LINE) * 6 + 12))]
    yield f"{len(small):,} small passages", small, True


def _body(texts: list[str], scored: bool) -> bytes:
    rows = [
        {
            "content": text,
            "container": "ctr_main",
            "container_name": "Main",
            **({"score": 0.9 - i / 1e7} if scored else {}),
        }
        for i, text in enumerate(texts)
    ]
    return json.dumps(
        {"results": rows, "containers": [{"id": "ctr_main", "name": "Main"}]}, ensure_ascii=False
    ).encode()


def _answer_trials(body: bytes, trials: int) -> dict[str, list[float]]:
    """Seconds of the raw SDK call, the recall, the ``membase_search`` tool and the JSON parse, per trial."""
    fake = _answering(body)
    client = kit_client(fake, max_retries=0)
    # One attempt, in a budget the work always fits, reading answers past the default max_response_bytes.
    store = fake.store(recall_timeout=60.0, max_response_bytes=256 * MB)
    [search] = [
        t for t in store.get_tools() if isinstance(t, DecoratedFunctionTool) and t.tool_name == "membase_search"
    ]
    times: dict[str, list[float]] = {"raw": [], "recall": [], "tool": [], "json": [], "shown": []}

    async def trial() -> None:
        gc.collect()
        clock = [time.perf_counter()]
        client.search(QUESTION, limit=5)
        clock.append(time.perf_counter())
        entries = await store.search(QUESTION)
        clock.append(time.perf_counter())
        reply = search(query=QUESTION, limit=50)
        clock.append(time.perf_counter())
        json.loads(body)
        clock.append(time.perf_counter())
        for key, start, end in zip(("raw", "recall", "tool", "json"), clock[:-1], clock[1:], strict=True):
            times[key].append(end - start)
        times["shown"] = [sum(len(entry.content) for entry in entries), len(reply["content"][0]["text"])]

    try:
        for _ in range(trials):
            asyncio.run(trial())
            if max(times["recall"][0], times["tool"][0]) - times["raw"][0] > SLOW_S:
                break
    finally:
        store.close()
    return times


def large_answers(plan: Plan) -> Section:
    section = Section(
        8,
        "The store's own work on large answers",
        f"Answers of {plan.passages} passages of 1 M characters each, in several shapes, and one of "
        f"{plan.small_answer_mb} MB of small passages, served by the testing kit over `httpx.MockTransport`. "
        "The store's own time is the recall (`await store.search(q)`, 5 passages wanted) or the `membase_search` "
        "tool (50 wanted) minus the raw SDK call `client.search(q)` on the same answer (which includes the JSON "
        f"parse); the default `max_recall_chars`. {plan.answer_trials} trial(s) each, medians (a shape over "
        f"{SLOW_S:g} s on its first trial runs once).",
        ["answer", "MB", "JSON parse ms", "raw SDK call ms", "recall: store ms", "tool: store ms", "shown chars"],
    )
    worst = (0.0, "")
    for label, texts, scored in _shapes(plan.passages, plan.small_answer_mb):
        body = _body(texts, scored)
        del texts
        times = _answer_trials(body, plan.answer_trials)
        raw = median(times["raw"])
        recall_ms = (median(times["recall"]) - raw) * 1000
        tool_ms = (median(times["tool"]) - raw) * 1000
        worst = max(worst, (recall_ms, f"{label}, recall"), (tool_ms, f"{label}, tool"))
        section.row(
            label,
            fmt(len(body) / MB),
            fmt(median(times["json"]) * 1000),
            fmt(raw * 1000),
            f"**{fmt(recall_ms)}**",
            f"**{fmt(tool_ms)}**",
            " / ".join(f"{s:,.0f}" for s in times["shown"]),
        )
    section.target(
        f"at most {STORE_TIME_TARGET_MS:g} ms of store time per answer, every shape, both paths",
        worst[0] <= STORE_TIME_TARGET_MS,
        f"worst {fmt(worst[0])} ms ({worst[1]})",
    )
    return section


SECTIONS = (stalled_memory, hung_capture, large_answers)

"""Automatic recall (``_recall``): time-boxed and fail-open, guarded while a late request runs, what it shows (order,
copies, the relevance floor, ``max_recall_chars``) and, with ``recall_profile``, the user's standing facts first.

Everything goes through a real Agent or ``store.search``; the guard is seen in the requests that reach Membase and
in the counters, never in the store's state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore, MembaseRecallTimeout
from membase_strands.testing import API_KEY, InMemoryMembase, ScriptedModel, hang, refuse_connection, status
from tests.support.agents import entries, logged, recall_turn
from tests.support.loopback import LoopbackMembase, ok_json, stall
from tests.support.store_helpers import (
    FACT,
    LONG,
    QUESTION,
    RECALL_THREAD,
    delayed,
    make_agent,
    membase_threads,
    routed,
    signalling,
    sized,
    until,
    wait_until,
)

BUDGET = 0.5  # for the tests about a budget: what must outlast it is held back by a gate, not by the clock


def searches(fake: InMemoryMembase) -> int:
    return len(fake.sent("POST", "/v1/search"))


def counted(store: MembaseMemoryStore, *names: str) -> tuple[int, ...]:
    return tuple(store.counters().get(name, 0) for name in names)


# --- The time box and the guard -------------------------------------------------------------------


@pytest.mark.parametrize("late", ["finished", "failed"])
def test_a_stalled_recall_costs_one_turn_its_budget_and_recalls_skip_until_it_ends(
    fake, make_store, gates, caplog, no_key_in_logs, late
):
    fake.remember(FACT)
    held = gates.new()
    # Answered, or failed with a 503 echoing the key after the budget: the SDK would retry it; the store must not.
    fake.on(
        "POST", "/v1/search", hang(held, then=routed(fake) if late == "finished" else status(503, f"warming {API_KEY}"))
    )
    store = make_store(name=f"stalled-{late}", recall_timeout=BUDGET)
    agent, model = make_agent(store, ["Without memory.", "Still without.", "Again without.", "With memory."])

    # The first recall runs out of its budget while the gate still holds the request: a turn goes on without memory,
    # and store.search raises (to the manager, which skips the store).
    if late == "finished":
        assert "Without memory." in str(agent(QUESTION)) and model.memory_block() is None
        assert any("ran out of time" in m for m in logged(caplog, store.name, logging.WARNING))
    else:
        with pytest.raises(MembaseRecallTimeout, match="ran out of time") as raised:
            asyncio.run(store.search(QUESTION))
        assert isinstance(raised.value, TimeoutError) and API_KEY not in str(raised.value)
        agent(QUESTION)
    assert not held.is_set()
    for _ in range(2):  # while the late request runs, recalls skip: no request, no wait, not a failure
        agent(QUESTION)
        assert model.memory_block() is None
    assert asyncio.run(store.search("another question about the ledger")) == []
    assert searches(fake) == 1
    skipped = 3 if late == "finished" else 4
    assert counted(store, "recall_timeouts", "recall_skipped", "recall_errors") == (1, skipped, 0)
    assert len(membase_threads(f"{RECALL_THREAD}{store.name}]")) == 1

    # The late request ends: its outcome is logged (before it is counted) and recall resumes.
    held.set()
    assert wait_until(lambda: counted(store, "recall_late_completions") == (1,), timeout=LONG)
    level = logging.WARNING if late == "failed" else logging.INFO
    [outcome] = [m for m in logged(caplog, store.name, level) if f"late recall {late}; automatic recall resumes" in m]
    assert "reason=<warming [redacted]>" in outcome if late == "failed" else "reason" not in outcome
    agent(QUESTION)
    assert searches(fake) == 2  # one attempt for the late one: not retried while it held the guard
    assert f"[Main] {FACT}" in (model.memory_block() or "")
    if late == "finished":  # every counter that moved, and by how much
        late_outcome = {"recall_timeouts": 1, "recall_skipped": 3, "recall_late_completions": 1}
        assert {name: n for name, n in store.counters().items() if n} == {"recalls": 5, "recall_hits": 1} | late_outcome


async def test_a_late_request_holds_the_guard_for_one_request_timeout_at_most(fake, make_store, gates):
    held = gates.new()
    fake.always("POST", "/v1/search", hang(held))
    store = make_store(recall_timeout=0.1, request_timeout=0.5)

    with pytest.raises(MembaseRecallTimeout):
        await store.search(QUESTION)
    assert await store.search(QUESTION) == [] and searches(fake) == 1  # skipped while the guard holds

    async def until_sent_again() -> None:
        while searches(fake) == 1:
            with contextlib.suppress(MembaseRecallTimeout):
                assert await store.search(QUESTION) == []
            await asyncio.sleep(0.02)

    # Once one attempt's time has passed the guard lets recalls through, though the first request is still held.
    await asyncio.wait_for(until_sent_again(), LONG)
    assert not held.is_set() and searches(fake) == 2


def test_without_a_budget_recall_waits_for_the_sdk_and_its_retries(fake, make_store, caplog):
    fake.remember(FACT)
    fake.on("POST", "/v1/search", status(503), delayed(fake, 0.2))
    agent, model = make_agent(make_store(recall_timeout=None), ["Postgres."])

    agent(QUESTION)

    assert searches(fake) == 2 and f"[Main] {FACT}" in (model.memory_block() or "")
    assert not any("ran out of time" in r.getMessage() for r in caplog.records)


def test_a_failing_recall_costs_the_turn_its_memory_only_and_never_logs_the_key(fake, no_key_in_logs):
    faults = [status(code, f"bad {API_KEY}") for code in (400, 401, 422, 500)] + [refuse_connection]
    for fault in faults:
        fake.always("POST", "/v1/search", fault)
        store = fake.store(recall_timeout=LONG)
        agent, model = make_agent(store, ["Without memory."])

        assert "Without memory." in str(agent(QUESTION))
        fake.heal()
        agent(QUESTION)  # a failure holds no guard: the next recall is sent

        assert model.memory_block(0) is None and counted(store, "recall_errors", "recall_timeouts") == (1, 0)
        assert API_KEY not in str(model.calls)
        store.close()


TURNS_IN_OUTAGE = 25  # far more than three: a warning a turn would show


def test_many_turns_of_one_stall_or_one_403_warn_at_most_three_times(fake, make_store, gates, caplog):
    caplog.set_level(logging.DEBUG)
    outage = gates.new()
    for fault in ("stall", "403"):
        if fault == "stall":
            fake.always("POST", "/v1/search", hang(outage))  # then a read timeout: the late recall fails
            store = make_store(name=fault, recall_timeout=0.2)
        else:
            fake.always("POST", "/v1/search", status(403, "key revoked"))
            store = make_store(name=fault, access_cooldown=600.0)
        agent, model = make_agent(store, ["ok"] * TURNS_IN_OUTAGE)

        for turn in range(TURNS_IN_OUTAGE):
            agent(f"{QUESTION} ({turn})")
        outage.set()
        if fault == "stall":
            assert wait_until(lambda: counted(store, "recall_late_completions") == (1,), timeout=LONG)  # noqa: B023

        # Every WARNING or worse from any logger (caplog's handler sits on the root logger); details at DEBUG.
        warned = logged(caplog, store.name, logging.WARNING)
        assert len(warned) <= 3, warned
        if fault == "stall":
            assert sum("ran out of time" in w for w in warned) == 1  # the manager's line, from the exception's text
            assert sum("late recall failed" in w for w in warned) == 1
        else:
            assert sum("narrowed or revoked" in w for w in warned) == 1
            paused = [m for m in logged(caplog, store.name, logging.INFO) if "automatic recall paused for 600 s" in m]
            assert len(paused) == 1
        skips = [m for m in logged(caplog, store.name) if f"store=<{store.name}>" in m and "recall skipped" in m]
        assert len(skips) == TURNS_IN_OUTAGE - 1
        # The model saw what it saw before: no memory, the same tools.
        assert all(model.memory_block(turn) is None for turn in range(TURNS_IN_OUTAGE))
        assert all(call["tool_names"] == model.calls[0]["tool_names"] for call in model.calls)
        failed = {"recall_timeouts": 1, "recall_late_completions": 1, "errors.timeout": 1}
        failed = failed if fault == "stall" else {"recall_errors": 1, "errors.access": 1}
        moved = {name: n for name, n in store.counters().items() if n}
        assert moved == {"recalls": TURNS_IN_OUTAGE, "recall_skipped": TURNS_IN_OUTAGE - 1} | failed
        assert len(fake.sent("POST", "/v1/search")) == 1
        fake.requests.clear()
        caplog.clear()


# --- Cancelled turns and closes, over real sockets ----------------------------------------------------

TURNS = 10
SEARCH_ANSWER = {
    "results": [{"content": FACT, "container": "ctr_main", "container_name": "Main", "score": 1.0}],
    "containers": [{"id": "ctr_main", "name": "Main"}],
}


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        yield server


class WaitingModel(ScriptedModel):
    """A model that records what it was sent, then takes its time, like a real one mid-answer."""

    async def stream(
        self, messages: Any, tool_specs: Any = None, system_prompt: Any = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        self.calls.append({"messages": copy.deepcopy(messages), "tool_names": [], "system_prompt": system_prompt})
        await asyncio.sleep(30)  # the turn is cancelled long before
        yield {"messageStart": {"role": "assistant"}}


async def test_cancelled_turns_on_a_stalled_membase_leave_one_request_and_one_thread(loopback, caplog):
    """A web server cancels a request's task when its client disconnects; ten of them must not leave ten requests."""
    caplog.set_level(logging.DEBUG)
    release = threading.Event()
    loopback.on("POST", "/v1/search", *[stall(release, then=ok_json(SEARCH_ANSWER)) for _ in range(TURNS)])
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, name="cancelled-turns", recall_timeout=LONG)
    sent = lambda: len(loopback.fake.sent("POST", "/v1/search"))  # noqa: E731
    try:
        task = asyncio.create_task(store.search(QUESTION))  # cancelled directly: the cancellation propagates
        assert await until(lambda: sent() == 1, LONG)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(TURNS):  # one agent per request, as a web app builds them
            model = WaitingModel()
            agent = Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None)
            turn = asyncio.create_task(agent.invoke_async(QUESTION))
            assert await until(lambda: bool(model.calls) or turn.done(), LONG)  # noqa: B023 - recall skipped
            turn.cancel()
            with pytest.raises(asyncio.CancelledError):
                await turn

        assert sent() == 1, "a cancelled turn left its own request running"
        assert len(membase_threads(f"{RECALL_THREAD}{store.name}]")) == 1
        assert counted(store, "recalls", "recall_cancelled", "recall_skipped") == (TURNS + 1, 1, TURNS)
        assert counted(store, "recall_errors", "recall_timeouts") == (0, 0)
        assert any("recall cancelled" in m for m in logged(caplog, store.name, logging.INFO))
        assert logged(caplog, store.name, logging.WARNING) == []

        # The cancelled recall's request ends: logged and counted like a timed-out one, and recall resumes.
        release.set()
        assert await until(lambda: counted(store, "recall_late_completions") == (1,), LONG)
        assert any("late recall finished" in m for m in logged(caplog, store.name, logging.INFO))
        assert [e.content for e in await store.search(QUESTION)] == [f"[Main] {FACT}"] and sent() == 2
    finally:
        release.set()
        store.close()


async def test_closing_the_store_during_a_recall_lets_it_finish_with_its_memory(loopback, caplog):
    caplog.set_level(logging.DEBUG)
    release = threading.Event()
    loopback.on("POST", "/v1/search", stall(release, then=ok_json(SEARCH_ANSWER)))
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, name="closing", recall_timeout=LONG)
    agent, model = make_agent(store, ["Postgres."])
    try:
        turn = asyncio.create_task(agent.invoke_async(QUESTION))
        assert await until(lambda: len(loopback.fake.sent("POST", "/v1/search")) == 1, LONG)
        store.close()  # the app shuts down while the recall is running
        release.set()
        assert "Postgres." in str(await asyncio.wait_for(turn, LONG))
    finally:
        release.set()
        store.close()

    assert f"[Main] {FACT}" in (model.memory_block() or "")
    assert counted(store, "recalls", "recall_hits", "recall_errors", "errors.connection") == (1, 1, 0, 0)
    assert logged(caplog, store.name, logging.WARNING) == []
    with pytest.raises(RuntimeError, match="is closed"):
        await store.search(QUESTION)  # and the next one is refused


def test_closing_the_store_under_a_late_recall_lets_it_finish_and_logs_that(loopback, caplog):
    caplog.set_level(logging.DEBUG)
    release = threading.Event()
    loopback.on("POST", "/v1/search", stall(release, then=ok_json(SEARCH_ANSWER)))
    store = MembaseMemoryStore(api_key=API_KEY, base_url=loopback.url, name="closing-late", recall_timeout=BUDGET)
    agent, _ = make_agent(store, ["Without memory."])
    try:
        agent(QUESTION)  # runs out of time; the request goes on
        store.close()
        release.set()
        assert wait_until(lambda: counted(store, "recall_late_completions") == (1,), timeout=LONG)
    finally:
        release.set()
        store.close()

    lines = [line for line in logged(caplog, store.name) if line.startswith(("membase_strands", "strands"))]
    assert any("late recall finished" in line for line in lines)
    assert not any("Bad file descriptor" in line or "late recall failed" in line for line in lines)
    assert "errors.connection" not in store.counters()


# --- What recall shows: best first, each text once, a relevance floor, within max_recall_chars ----------------

NAMES = {"ctr_main": "Main", "ctr_work": "Work", "ctr_home": "Home", "ctr_garden": "Garden"}
LEDGER = "The billing ledger runs on Postgres 16 in Frankfurt."
BACKUPS = "Ledger backups run nightly at 02:00."
CELLO = "My daughter plays the cello on Tuesdays."
PARTY = "The garden party is on Sunday."
CUT = "[... cut: this passage is longer than the recall budget]"


def hit(content: str, memory: str = "Main", score: Any = None) -> dict[str, Any]:
    scored = {} if score is None else {"score": score}
    return {"content": content, "container": f"ctr_{memory.lower()}", "container_name": memory} | scored


def answer_with(fake: InMemoryMembase, hits: list[dict[str, Any]], unsearched: dict[str, str] | None = None) -> None:
    """Answer every search with ``hits``, in this order, as Membase would send them (a NaN score too)."""
    fake.containers = [{"id": cid, "name": name} for cid, name in NAMES.items()]
    errors = {name: {"error": reason} for name, reason in (unsearched or {}).items()}
    rows = [{"id": cid, "name": name, **errors.get(name, {})} for cid, name in NAMES.items()]
    body, json_type = json.dumps({"results": hits, "containers": rows}), {"content-type": "application/json"}
    fake.always("POST", "/v1/search", lambda request: httpx.Response(200, content=body, headers=json_type))


INTERLEAVED = [hit(PARTY, "Garden", 0.016), hit(LEDGER, "Work", 0.033), hit(CELLO, "Home", 0.017)]
INTERLEAVED.append(hit(BACKUPS, "Work", 0.030))
BEST_FIRST = [f"[Work] {LEDGER}", f"[Work] {BACKUPS}", f"[Home] {CELLO}", f"[Garden] {PARTY}"]
IN_ORDER = [f"[Garden] {PARTY}", f"[Work] {LEDGER}", f"[Home] {CELLO}"]
LOW, UP, WEAK = hit(PARTY, "Garden", 0.1), hit(CELLO, "Home", 0.9), hit("weak", "Garden", 0.001)
TIED = [hit(PARTY, "Garden", 0.5), hit(LEDGER, "Work", 0.5), hit(CELLO, "Home", 0.5)]
CAP = 300
CAPPED = {"max_recall_chars": CAP}
# Scored by rank: 157 with its label (fits), 207 more (skipped), 47 more (fits after the skip), 157 more (skipped).
BUDGETED = [hit(sized("best", 150), score=4), hit(sized("second", 200), score=3), hit(sized("third", 40), score=2)]
BUDGETED.append(hit(sized("fourth", 150), score=1))
LONG_LEDGER = LEDGER + " It was chosen in March after the load tests."
LONG_BACKUPS = BACKUPS + " They are kept for thirty days, offsite in Oslo."
FOLDED_FIT = [f"[Work] [Home] {LONG_LEDGER}", f"[Work] {LONG_BACKUPS}"]
EXACT, HUGE_FIRST = [hit(sized("exact", CAP - 7))], [hit(sized("huge", 1000), score=2), hit("small", score=1)]
FLOOD, LONG_ONE = [hit("flood " + "z" * 10_000_000)], [hit(sized("long", 19_000))]
HISTORY = "The billing ledger history, in detail: " + "one more line of history. " * 20


def in_main(hits: list[dict[str, Any]]) -> list[str]:
    return [f"[Main] {h['content']}" for h in hits]


def cut_alone(start: str, cap: int = CAP) -> Any:
    return lambda shown: (
        len(shown) == 1 and shown[0].startswith(start) and shown[0].endswith(CUT) and len(shown[0]) <= cap
    )


ODD_SCORES = {"absent": {}, "as text": {"score": "high"}, "NaN": {"score": float("nan")}, "bool": {"score": True}}
COPIES = [hit(LEDGER, "Work", 0.03), hit("  The billing ledger runs on\nPostgres 16   in Frankfurt. ", "Home", 0.02)]
# name -> (hits, the store's options, what the model is shown); max_entries goes to the injection config.
RECALLS = {
    "best first across memories": (INTERLEAVED, {}, BEST_FIRST),
    "the best survive the entry limit": ([*INTERLEAVED, WEAK], {"max_entries": 3}, BEST_FIRST[:3]),
    "the best survive the budget": (
        [hit("A long and weak passage about gardening. " * 6, "Garden", 0.01), *INTERLEAVED[1:3]],
        {"max_recall_chars": 200},
        [f"[Work] {LEDGER}", f"[Home] {CELLO}"],
    ),
    "ties keep Membase's order": (TIED, {}, IN_ORDER),
    **{
        f"a score {name} leaves Membase's order": ([LOW, hit(LEDGER, "Work") | odd, UP], {}, IN_ORDER)
        for name, odd in ODD_SCORES.items()
    },
    "a passage in two memories is shown once naming both": (
        [*COPIES, hit(CELLO, "Home", 0.01)],
        {},
        [f"[Work] [Home] {LEDGER}", f"[Home] {CELLO}"],
    ),
    "a passage twice in one memory is shown once": (
        [COPIES[0], hit(LEDGER, "Work", 0.02), hit(CELLO, "Home", 0.01)],
        {},
        [f"[Work] {LEDGER}", f"[Home] {CELLO}"],
    ),
    "a copy counts once against the entry limit": (
        [hit(LEDGER, "Work", 0.04), hit(LEDGER, "Home", 0.035), hit(BACKUPS, "Work", 0.03), hit(CELLO, "Home", 0.02)],
        {"max_entries": 3},
        [f"[Work] [Home] {LEDGER}", f"[Work] {BACKUPS}", f"[Home] {CELLO}"],
    ),
    # Counted twice, the ledger passage would leave no room for the backups passage.
    "a copy counts once against the budget": (
        [hit(LONG_LEDGER, "Work", 0.04), hit(LONG_LEDGER, "Home", 0.035), hit(LONG_BACKUPS, "Work", 0.03)],
        {"max_recall_chars": sum(map(len, FOLDED_FIT))},
        FOLDED_FIT,
    ),
    "a copy longer than the budget is cut with both labels": (
        [hit(HISTORY, "Work", 0.04), hit(HISTORY, "Home", 0.03)],
        {"max_recall_chars": 200},
        cut_alone("[Work] [Home] The billing ledger history", 200),
    ),
    "the floor keeps weak passages out": (INTERLEAVED, {"min_score": 0.025}, BEST_FIRST[:2]),
    "a passage at the floor is kept": (INTERLEAVED, {"min_score": 0.030}, BEST_FIRST[:2]),
    "a passage without a score is not held against the floor": (
        [hit(LEDGER, "Work"), hit(PARTY, "Garden", 0.001)],
        {"min_score": 0.5},
        [f"[Work] {LEDGER}"],
    ),
    "below the floor nothing is injected": (INTERLEAVED, {"min_score": 0.9}, []),
    "whole passages best first and a smaller later one still fits": (BUDGETED, CAPPED, in_main(BUDGETED[::2])),
    "without a cap every passage is whole": (BUDGETED, {"max_recall_chars": None}, in_main(BUDGETED)),
    "the cap counts the label and a passage that fits exactly is whole": (EXACT, CAPPED, in_main(EXACT)),
    "one character over the cap is cut": ([hit(sized("over", CAP - 6))], CAPPED, cut_alone("[Main] over")),
    "a best passage over the cap is cut, alone": (HUGE_FIRST, CAPPED, cut_alone("[Main] huge lorem")),
    "the default cap keeps 10 MB from the prompt": (FLOOD, {}, cut_alone("[Main] flood", 20_000)),
    "the default cap keeps a 19,000-character passage whole": (LONG_ONE, {}, in_main(LONG_ONE)),
}


@pytest.mark.parametrize(("hits", "options", "expected"), list(RECALLS.values()), ids=list(RECALLS))
def test_what_recall_shows(fake, make_store, hits, options, expected):
    answer_with(fake, hits)
    options = dict(options)
    injection = {"max_entries": options.pop("max_entries")} if "max_entries" in options else {}

    shown, model = recall_turn(make_store(**options), QUESTION, injection=injection)

    assert expected(shown) if callable(expected) else shown == expected
    assert len(model.sent_text()) < 21_000


def test_recall_counts_and_describes_what_it_left_out(fake, make_store):
    answer_with(fake, [hit(LEDGER, "Work", 0.04), hit(LEDGER, "Home", 0.03), hit(PARTY, "Garden", 0.01)])
    store = make_store(min_score=0.02)

    [entry] = asyncio.run(store.search(QUESTION))

    assert entry.content == f"[Work] [Home] {LEDGER}"  # the Memory where it scored best comes first
    assert entry.metadata["memory"] == "Work" and entry.metadata["memories"] == ["Work", "Home"]
    assert entry.metadata["score"] == 0.04 and entry.metadata["container"] == "ctr_work"
    counters = ("recall_hits", "recall_empty", "recall_duplicates_merged", "recall_passages_below_min_score")
    assert counted(store, *counters) == (1, 0, 1, 1)
    answer_with(fake, INTERLEAVED)
    floored = make_store(min_score=0.9)
    assert asyncio.run(floored.search(QUESTION)) == []
    assert counted(floored, *counters) == (0, 1, 0, 4)


@pytest.mark.parametrize(
    ("hits", "options", "passages"),
    [
        ([hit(sized("fills the budget", 1000))], {"max_recall_chars": CAP}, 1),  # the budget is full
        (
            [hit(f"short note {n}", score=1 - n / 10) for n in range(6)],
            {},
            4,
        ),  # the page is full: the weakest gives way
        ([hit(PARTY, "Garden", 0.001)], {"min_score": 0.5}, 0),  # everything is below the floor
    ],
    ids=["budget", "page", "floor"],
)
def test_a_memory_that_could_not_answer_is_still_reported(fake, make_store, hits, options, passages):
    answer_with(fake, hits, unsearched={"Work": "the memory is asleep"})

    shown, _ = recall_turn(make_store(**options), QUESTION)

    assert len(shown) == passages + 1
    assert shown[-1].startswith("[Membase notice] The Memory (Work) could not be searched: the memory is asleep")


# --- The profile's standing facts, with recall_profile=True ---------------------------------------------


PROFILE = "[Membase profile] Standing facts about the user:"


def profile_reads(fake: InMemoryMembase) -> int:
    return len(fake.sent("GET", "/v1/profile"))


def test_the_standing_facts_come_first_and_two_turns_read_the_profile_once(fake, make_store):
    fake.standing = ["The user is vegetarian.", "Lives in\nLisbon."]
    fake.remember(FACT)
    for n in range(3):
        fake.remember(f"Ledger note {n}: Postgres for the ledger.")
    agent, model = make_agent(make_store(recall_profile=True), ["ok", "ok"], injection={"max_entries": 3})

    agent(QUESTION)
    agent(QUESTION)

    for call in (0, 1):
        shown = entries(model.memory_block(call))
        assert shown[0] == f"{PROFILE}\n- The user is vegetarian.\n- Lives in\n  Lisbon."
        assert len(shown) == 3 and shown[1].startswith("[Main] ")  # the profile takes one of the entries asked for
    assert profile_reads(fake) == 1 and searches(fake) == 2
    assert fake.sent("GET", "/v1/profile")[0].params == {}


def test_no_profile_is_read_unless_asked_and_a_blank_query_reads_nothing(fake, make_store):
    fake.standing = ["The user is vegetarian."]
    fake.remember(FACT)
    agent, model = make_agent(make_store(), ["ok"])
    agent(QUESTION)
    assert profile_reads(fake) == 0 and "vegetarian" not in (model.memory_block() or "")

    store = make_store(recall_profile=True)
    for blank in ["", " ", "\n\t  \r\n", "\u00a0\u2003\u3000"]:
        assert asyncio.run(store.search(blank)) == []
    assert fake.sent() == fake.sent("POST", "/v1/search")


@pytest.mark.parametrize("failure", ["500", "unreadable", "hang"])
def test_a_profile_that_fails_or_is_late_costs_no_passage_and_a_failed_one_is_read_again(
    fake, make_store, gates, failure
):
    fake.standing = ["The user is vegetarian."]
    fake.remember(FACT)
    held = gates.new()
    fault = {
        "500": status(500),
        "unreadable": lambda request: httpx.Response(200, json=["x"]),
        "hang": hang(held, then=fake.answer),
    }
    fake.on("GET", "/v1/profile", fault[failure])
    agent, model = make_agent(make_store(recall_profile=True, recall_timeout=BUDGET), ["ok", "ok"])

    agent(QUESTION)  # a late profile is waited for within the recall's budget, no longer
    assert entries(model.memory_block()) == [f"[Main] {FACT}"]
    if failure == "hang":  # still being read: not read again
        agent(QUESTION)
        assert profile_reads(fake) == 1 and entries(model.memory_block()) == [f"[Main] {FACT}"]
        held.set()
    # A failed read is tried again at once; a late one is used once it has ended.
    assert wait_until(lambda: agent(QUESTION) and "[Membase profile]" in model.memory_block(), timeout=LONG)

    assert profile_reads(fake) == (1 if failure == "hang" else 2)
    assert entries(model.memory_block())[0].startswith(f"{PROFILE}\n- The user")


def test_a_profile_read_that_hangs_holds_only_the_recall_that_started_it(fake, make_store, gates):
    """Recalls while an earlier recall's profile read still hangs use what they have, without waiting for it: the
    second turn is served while the read is held (its budget is long, so a wait would hold the turn)."""
    fake.remember(FACT)
    fake.standing = ["The user is vegetarian."]
    held, asked = gates.new(), threading.Event()
    fake.on("GET", "/v1/profile", signalling(asked, hang(held, then=fake.answer)))
    store = make_store(recall_profile=True, recall_timeout=LONG)
    first = concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, store.search(QUESTION))  # starts the read
    assert asked.wait(LONG)

    assert [entry.content for entry in asyncio.run(store.search(QUESTION))] == [f"[Main] {FACT}"]
    assert not held.is_set() and not first.done()  # served while the read is still held
    held.set()
    assert first.result(timeout=LONG)[0].content.startswith(PROFILE)
    assert profile_reads(fake) == 1


def test_the_profile_is_read_again_once_its_ttl_has_passed(fake, make_store):
    fake.standing = ["The user is vegetarian."]
    store = make_store(recall_profile=True, profile_ttl=0.05)
    assert asyncio.run(store.search(QUESTION))

    fake.standing = ["The user is vegan."]
    assert wait_until(lambda: "vegan" in asyncio.run(store.search(QUESTION))[0].content, timeout=LONG)
    assert 2 <= profile_reads(fake) <= searches(fake)

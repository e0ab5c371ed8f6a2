"""Section 3, stalled memory: synchronous turns while ``POST /v1/search`` hangs, with ``recall_timeout=0.5``.

The first turn meets the stall and should end within the budget; the turns after it should cost
almost nothing, since the in-flight guard skips recall while the late request runs. Exactly one
search request is sent and at most one ``membase-recall`` thread lives, back to none once it ends.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from report import Section, fmt, spread
from support import (
    FACT,
    RECALL_THREAD,
    Plan,
    make_agent,
    median,
    membase_threads,
    mock_client,
    percentile,
    sync_turn_ms,
    wait_for_threads,
)

from membase_strands import MembaseMemoryStore
from membase_strands.testing import InMemoryMembase, hang

NUMBER = 3
STALL_BUDGET_S = 0.5
FIRST_TURN_SLACK_S = 0.050
STALLED_TURN_TARGET_MS = 5.0


def _trial(plan: Plan) -> dict[str, Any]:
    """One fresh store: healthy turns, then the stall, then its release."""
    fake = InMemoryMembase()
    fake.remember(FACT)
    stall = threading.Event()
    with mock_client(fake.handle) as client:
        store = MembaseMemoryStore(client=client, recall_timeout=STALL_BUDGET_S)
        try:
            agent, model = make_agent(store)
            bare, bare_model = make_agent(None)
            for _ in range(3):
                sync_turn_ms(agent, model)
                sync_turn_ms(bare, bare_model)
            healthy = [sync_turn_ms(agent, model) for _ in range(plan.stall_turns)]
            without = [sync_turn_ms(bare, bare_model) for _ in range(plan.stall_turns)]
            threads_before = len(membase_threads(RECALL_THREAD))
            sent_before = len(fake.sent("POST", "/v1/search"))

            fake.always("POST", "/v1/search", hang(stall, then=fake.answer, limit=30.0))
            first_s = sync_turn_ms(agent, model) / 1000
            first_injected = model.memory_block() is not None
            stalled, recall_threads, injected = [], [], 0
            for _ in range(plan.stall_turns):
                stalled.append(sync_turn_ms(agent, model))
                injected += model.memory_block() is not None
                recall_threads.append(len(membase_threads(RECALL_THREAD)))
            sent_during = len(fake.sent("POST", "/v1/search")) - sent_before

            released = time.perf_counter()
            stall.set()
            back = wait_for_threads(RECALL_THREAD, at_most=threads_before, timeout=10.0)
            back_ms = (time.perf_counter() - released) * 1000
            threads_after = len(membase_threads(RECALL_THREAD))
            fake.heal()
            sync_turn_ms(agent, model)
            resumed = model.memory_block() is not None
            return {
                "first_s": first_s,
                "healthy_ms": median(healthy),
                "without_ms": median(without),
                "stalled_ms": median(stalled),
                "added_ms": median(stalled) - median(healthy),
                "added_vs_bare_ms": median(stalled) - median(without),
                "added_max_ms": max(stalled) - median(healthy),
                "added_p90_ms": percentile(stalled, 0.9) - median(healthy),
                "sent_during": sent_during,
                "threads_before": threads_before,
                "threads_during": max(recall_threads),
                "threads_after": threads_after,
                "back": back,
                "back_ms": back_ms,
                "injected_during": injected + first_injected,
                "resumed": resumed,
            }
        finally:
            stall.set()
            wait_for_threads(RECALL_THREAD, timeout=10.0)
            store.close()


def run(plan: Plan) -> Section:
    """Run the stall trials and check the time box and the in-flight guard."""
    section = Section(
        NUMBER,
        "Stalled memory",
        f"`POST /v1/search` hangs (a MockTransport responder blocked on an Event, released at the end) with "
        f'`recall_timeout={STALL_BUDGET_S}`. Synchronous `agent("...")` turns through `strands.Agent`: the first '
        f"turn meets the stall, then {plan.stall_turns} more turns run while it lasts. 'Added' is a stalled "
        "turn's time minus the median healthy turn of the same agent just before the stall. "
        f"{plan.stall_trials} trial(s), each with a fresh store; figures are medians over trials (targets use "
        "the worst trial).",
        ["figure", "median", "per trial"],
    )
    trials = [_trial(plan) for _ in range(plan.stall_trials)]

    def col(key: str) -> list[float]:
        return [float(t[key]) for t in trials]

    first = col("first_s")

    def timing(label: str, key: str) -> None:
        section.row(label, fmt(median(col(key))), spread(col(key)))

    def count(label: str, key: str) -> None:
        section.row(label, f"{max(col(key)):.0f} (max)", ", ".join(f"{v:.0f}" for v in col(key)))

    timing("first turn (s)", "first_s")
    timing("healthy turn before the stall (ms)", "healthy_ms")
    timing("turn without any memory (ms)", "without_ms")
    timing("turn during the stall, median of the following turns (ms)", "stalled_ms")
    timing("following turns: added per turn, median (ms)", "added_ms")
    timing("following turns: added per turn, p90 (ms)", "added_p90_ms")
    timing("following turns: added per turn, max (ms)", "added_max_ms")
    timing("following turns vs a turn without memory, median (ms)", "added_vs_bare_ms")
    count("search requests sent during the stall", "sent_during")
    count("live `membase-recall` threads during the stall", "threads_during")
    count("live `membase-recall` threads before the stall", "threads_before")
    count("live `membase-recall` threads after release", "threads_after")
    timing("release -> recall thread gone (ms)", "back_ms")
    count("turns that got memory injected during the stall", "injected_during")
    section.row("memory injected again after the stall", "yes" if all(t["resumed"] for t in trials) else "**NO**", "")
    section.figure("first_turn_s", "first stalled turn", median(first), "s", floor=0.02)
    section.figure(
        "stalled_turn_ms",
        "turn during the stall (median)",
        median(col("stalled_ms")),
        "ms",
        floor=1.0,
        reference="3.healthy_turn_ms",
    )
    section.figure("healthy_turn_ms", "healthy turn before the stall", median(col("healthy_ms")), "ms", better="info")
    section.figure("sent_during", "requests sent during the stall", max(col("sent_during")), "requests")
    section.figure("threads_during", "recall threads during the stall", max(col("threads_during")), "threads")

    limit = STALL_BUDGET_S + FIRST_TURN_SLACK_S
    section.target(
        f"first turn <= recall_timeout + {FIRST_TURN_SLACK_S * 1000:.0f} ms ({limit:.2f} s)",
        max(first) <= limit,
        f"worst {fmt(max(first))} s, median {fmt(median(first))} s",
    )
    worst_added = max(col("added_ms"))
    section.target(
        f"each following turn adds <= {STALLED_TURN_TARGET_MS:.0f} ms (median over {plan.stall_turns} turns)",
        worst_added <= STALLED_TURN_TARGET_MS,
        f"worst trial's median {fmt(worst_added)} ms; worst single turn {fmt(max(col('added_max_ms')))} ms",
    )
    sent = [int(s) for s in col("sent_during")]
    section.target(
        "exactly one search request in flight during the stall",
        all(s == 1 for s in sent),
        f"{', '.join(map(str, sent))} sent (per trial)",
    )
    section.target(
        "at most one live `membase-recall` thread during the stall, back to baseline after release",
        max(col("threads_during")) <= 1
        and all(t["back"] and t["threads_after"] <= t["threads_before"] for t in trials),
        f"max {int(max(col('threads_during')))} during; {int(max(col('threads_after')))} after "
        f"(baseline {int(max(col('threads_before')))})",
    )
    added = median(col("added_ms"))
    guard = "the in-flight guard skips the recall without a request or a thread, and nothing is injected"
    if added < 0:
        note = f"Here a stalled turn was {fmt(-added)} ms cheaper than a healthy one (the median 'added'): {guard}."
    else:
        note = f"Here a stalled turn took {fmt(added)} ms more than a healthy one (the median 'added'), though {guard}."
    section.notes.append(note)
    return section

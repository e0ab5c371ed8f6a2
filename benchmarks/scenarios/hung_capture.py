"""Section 6, a capture turn with a hung Membase: ``write_timeout`` bounds a synchronous turn.

A synchronous ``agent("...")`` with ``capture=True, extraction=True`` flushes extraction at its end,
so the store's ``add_messages`` runs inside the call. ``POST /v1/memories`` hangs and raises a read
timeout after a shortened stand-in for one SDK attempt. Slow, so each setting runs once or twice.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import membase
from report import Section, fmt, spread
from support import DEFAULT_WRITE_TIMEOUT, WRITE_THREAD, Plan, make_agent, median, mock_client, wait_for_threads

from membase_strands import MembaseMemoryStore
from membase_strands.testing import InMemoryMembase, hang

NUMBER = 6
CAPTURE_SLACK_S = 0.100
_SDK_DEFAULTS = inspect.signature(membase.Membase).parameters
SDK_ATTEMPT_S: float = _SDK_DEFAULTS["timeout"].default
"""How long one attempt of the installed SDK waits for an answer."""
SDK_RETRIES: int = _SDK_DEFAULTS["max_retries"].default
"""How many more attempts the installed SDK makes after a timeout."""
_COUNTS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def _turn(write_timeout: float | None, attempt_s: float, use_default: bool) -> tuple[float, int]:
    """One capturing turn while the write hangs: its wall time and the POSTs sent."""
    fake = InMemoryMembase()
    release = threading.Event()
    # The hung POST ends by itself: a read timeout after ``attempt_s``, as the SDK's own attempt would.
    fake.always("POST", "/v1/memories", hang(release, limit=attempt_s))
    options: dict[str, Any] = {} if use_default else {"write_timeout": write_timeout}
    with mock_client(fake.handle) as client:
        store = MembaseMemoryStore(client=client, capture=True, extraction=True, **options)
        try:
            agent, _ = make_agent(store)
            started = time.perf_counter()
            agent("Remember that we chose Postgres for the ledger.")
            elapsed = time.perf_counter() - started
            return elapsed, len(fake.sent("POST", "/v1/memories"))
        finally:
            release.set()
            wait_for_threads(WRITE_THREAD, timeout=attempt_s + 5)
            store.close()


def run(plan: Plan) -> Section:
    """Time capturing turns with each ``write_timeout`` of the plan."""
    attempt = plan.capture[0][1]
    one_call_min = SDK_ATTEMPT_S * (SDK_RETRIES + 1) / 60
    section = Section(
        NUMBER,
        "Capture turn with a hung Membase",
        'A synchronous `agent("...")` with `capture=True, extraction=True`: Strands flushes extraction at the end '
        "of the call, so the store's `add_messages` runs inside it. `POST /v1/memories` hangs; the responder "
        f"raises `httpx.ReadTimeout` after {attempt:g} s to stand for the SDK's attempt timing out. With the "
        f"real SDK an attempt times out after {SDK_ATTEMPT_S:g} s, and its own retries ({SDK_RETRIES} more) "
        f"would stretch one call to about {one_call_min:.1f} minutes; the store makes one attempt and never "
        "retries a write itself. Slow, so each setting runs once or twice.",
        ["write_timeout", "turn wall (s)", "runs", "POST /v1/memories sent", "what ends the turn"],
    )
    for write_timeout, attempt_s, runs in plan.capture:
        default = write_timeout == DEFAULT_WRITE_TIMEOUT
        results = [_turn(write_timeout, attempt_s, default) for _ in range(runs)]
        walls = [r[0] for r in results]
        posts = max(r[1] for r in results)
        wall = median(walls)
        label = f"{write_timeout:g} s{' (default)' if default else ''}" if write_timeout else "None"
        ends = (
            "the write budget; the request goes on in the background"
            if write_timeout is not None
            else f"the (simulated) attempt timeout after {attempt_s:g} s"
        )
        section.row(label, fmt(wall), f"{runs}: {spread(walls)}", posts, ends)
        key = f"turn_s[write_timeout={write_timeout if write_timeout is None else f'{write_timeout:g}'}"
        key += f",attempt={attempt_s:g}]" if write_timeout is None else "]"
        section.figure(key, f"capture turn, write_timeout={label}", wall, "s", floor=0.05)
        if write_timeout is not None:
            section.target(
                f"with write_timeout={write_timeout:g} s the turn returns within the budget + "
                f"{CAPTURE_SLACK_S * 1000:.0f} ms",
                max(walls) <= write_timeout + CAPTURE_SLACK_S,
                f"worst {fmt(max(walls))} s",
            )
        else:
            section.target(
                "with write_timeout=None the turn lasts one attempt (one POST), not the SDK's "
                + _COUNTS.get(SDK_RETRIES + 1, str(SDK_RETRIES + 1)),
                posts == 1 and max(walls) <= attempt_s + 1.0,
                f"{posts} POST; worst {fmt(max(walls))} s against one attempt of {attempt_s:g} s "
                f"(with the real SDK: {SDK_ATTEMPT_S:g} s)",
            )
    section.notes.append(
        "Without the write budget a hung Membase would hold this synchronous turn for a whole SDK attempt "
        f"({SDK_ATTEMPT_S:g} s), and for about {one_call_min:.1f} min had the store let the SDK retry. With the "
        "budget, the manager keeps the batch for a retry and the request finishes in the background."
    )
    return section

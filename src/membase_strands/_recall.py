"""Automatic recall: time-boxed, fail-open, and guarded against hammering a waking memory.

The first search after a quiet spell can take up to a minute while the memory wakes. Past its budget (or
cancelled) a recall's request runs on in the background, waking the memory; until it ends (one attempt at most),
recalls skip at once rather than pile on: not a failure, logged at DEBUG only, so a long stall does not write a
warning per turn. With ``recall_profile``, the profile's standing facts are read beside the search, within the same
budget, at most once per ``profile_ttl``: a profile that fails or is late costs no passage.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Future
from typing import Any

from strands.memory import MemoryEntry

from . import _runtime, _telemetry
from ._formatting import arrange, memory_entries, profile_entry, standing_facts
from ._gateway import RECALL, MembaseGateway
from ._runtime import wait_for_future
from .errors import MembaseRecallTimeout


class Recall:
    """One store's automatic recall: the budget, the in-flight guard, the 403 pause and the profile's cache.
    ``hold_limit``: the longest a late request holds the guard; ``profile_ttl``: ``None`` for no profile."""

    def __init__(
        self,
        gateway: MembaseGateway,
        *,
        container: str | None,
        budget: float | None,
        hold_limit: float,
        min_score: float | None,
        max_chars: int | None,
        profile_ttl: float | None,
    ) -> None:
        self._gateway, self._ledger, self._container = gateway, gateway.ledger, container
        self._budget, self._hold_limit = budget, hold_limit
        self._min_score, self._max_chars, self._profile_ttl = min_score, max_chars, profile_ttl
        self._late: tuple[Future[Any], float] | None = None  # the latest late request, and when it started
        self._profile: tuple[float, list[str]] = (-math.inf, [])  # the standing facts: when read, what they are
        self._profile_reading: Future[None] | None = None
        self._lock = _runtime.new_lock()
        self._thread_name = f"membase-recall[{self._ledger.store_name}]"
        _runtime.forget_in_child(self._forget_parent_requests)

    def _forget_parent_requests(self) -> None:
        self._late, self._profile_reading = None, None  # a forked child: their threads are the parent's

    async def run(self, query: str, limit: int) -> list[MemoryEntry]:
        """The entries for ``query``: the standing facts (if asked for), up to ``limit`` passages best first, a notice
        per Memory that could not answer; ``[]`` while the guard is up or recall is paused. ``MembaseRecallTimeout``
        when the budget runs out (the request goes on, holding the guard)."""
        if skip := self._skip():
            self._ledger.count("recall_skipped")
            _telemetry.mark("skipped")
            self._ledger.log(logging.DEBUG, "recall skipped", reason=skip)
            return []
        started, retry = time.monotonic(), self._budget is None
        searching = _runtime.submit(
            lambda: self._gateway.search(query, limit, self._container, retry=retry), name=self._thread_name
        )
        profile = self._read_profile()
        try:
            answer = await wait_for_future(searching, self._budget)
        except asyncio.TimeoutError:
            self._hold_guard(searching, started)
            message = (
                "recall ran out of time; the turn goes on without memory and the request finishes in the background"
            )
            # INFO, not WARNING: the manager logs the exception below as one, once is enough.
            self._ledger.count("recall_timeouts")
            self._ledger.log(logging.INFO, message, budget=self._budget)
            raise MembaseRecallTimeout(
                f"Membase recall ran out of time after {self._budget:g} s; it goes on in the background"
            ) from None
        except asyncio.CancelledError:
            if not searching.done():
                self._hold_guard(searching, started)
            self._ledger.count("recall_cancelled")
            self._ledger.log(logging.INFO, "recall cancelled")
            raise
        if profile is not None:  # wait for the standing facts within what is left of the budget
            left = None if self._budget is None else max(0.0, started + self._budget - time.monotonic())
            try:
                await wait_for_future(profile, left)
            except Exception as error:  # noqa: BLE001 - a profile that fails or is late costs no passage
                self._ledger.log(logging.DEBUG, "profile not read for recall", error=error)
        standing = self._profile[1]
        head = [profile_entry(standing, self._max_chars)] if standing else []
        budget = None if self._max_chars is None else self._max_chars - sum(len(entry.content) for entry in head)
        # The manager keeps the first `limit` entries: room for the notices, so no Memory's failure is dropped silently.
        most = max(0, limit - len(answer.unsearched) - len(head))
        shown = arrange(answer, most, min_score=self._min_score, budget=budget)
        entries = head + memory_entries(shown)
        for counter, count in [("folded", shown.folded), ("below_floor", shown.below_floor)]:
            if count:
                self._ledger.count(f"recall_passages_{counter}", amount=count)
        self._ledger.count("recall_hits" if shown.passages else "recall_empty")
        _telemetry.mark(
            "hit" if shown.passages else "empty",
            passages=len(shown.passages),
            chars_injected=sum(len(entry.content) for entry in entries),
            unanswered=len(shown.unsearched),
            folded=shown.folded or None,
            below_floor=shown.below_floor or None,
        )
        return entries

    def _skip(self) -> str | None:
        if self._gateway.off(RECALL):  # paused after a 403
            return "key refused (403)"
        late = self._late
        if late is not None and not late[0].done() and late[1] > time.monotonic() - self._hold_limit:
            return "memory waking"
        return None

    def _read_profile(self) -> Future[None] | None:
        """The read of the standing facts this recall starts and waits for, when none is fresh or running; ``None``:
        use the cache (one that an earlier recall started and is still running is not waited for again: a profile
        that hangs costs one recall its wait, not every one)."""

        def read() -> None:
            facts = standing_facts(self._gateway.profile(None, retry=False))
            self._profile = (time.monotonic(), facts)

        if self._profile_ttl is None:
            return None
        with self._lock:
            if time.monotonic() - self._profile[0] < self._profile_ttl:
                return None
            if self._profile_reading is not None and not self._profile_reading.done():
                return None
            reading = self._profile_reading = Future[None]()
        return _runtime.submit(read, name=self._thread_name, future=reading)  # outside the lock (see _runtime.submit)

    def _hold_guard(self, future: Future[Any], started: float) -> None:
        """Hold the guard until ``future`` ends, then trace, log and count how the late request ended."""
        linked = _telemetry.link_here()  # the turn's recall span: the late outcome's span links to it
        self._late = (future, started)

        def release(_: Future[Any]) -> None:
            error, elapsed = future.exception(), round(time.monotonic() - started, 1)
            outcome = "late recall finished" if error is None else "late recall failed"
            self._ledger.late(
                _telemetry.RECALL_LATE,
                linked,
                "completed",
                level=logging.INFO if error is None else logging.WARNING,
                message=f"{outcome}; automatic recall resumes",
                error=error,
                elapsed_s=elapsed,
            )
            self._ledger.count("recall_late_completions")  # last: whoever sees it finds the outcome logged

        future.add_done_callback(release)

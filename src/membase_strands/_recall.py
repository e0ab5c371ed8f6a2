"""Automatic recall: time-boxed, fail-open, and guarded against hammering a waking memory.

The first search after a quiet spell can take up to a minute while the memory wakes. Past its budget a recall
raises :class:`MembaseRecallTimeout` (the manager skips the store this turn) while its request runs on in the
background, waking the memory; a cancelled recall's request runs on the same way. Until such a late request ends
(one SDK attempt at most), recalls skip at once with :class:`RecallSkipped` rather than pile on: not a failure,
logged at DEBUG only, so a long stall does not write a warning per turn.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from membase.client import DEFAULT_TIMEOUT

from . import _background, _telemetry
from ._background import wait_for_future
from ._counters import Counters
from ._failures import detail_of
from .errors import MembaseRecallTimeout

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RecallSkipped(Exception):
    """Nothing was sent: a late or cancelled recall still runs, or recall is paused after a 403. Not a failure."""


class TimeBoxedRecall:
    """Waits for one store's recall requests within a budget; holds the guard while a late one still runs."""

    def __init__(
        self,
        store_name: str,
        counters: Counters | None = None,
        redact: Callable[[str], str] = str,
        *,
        hold_limit: float = DEFAULT_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``hold_limit``: the longest a late request holds the guard, from its start (one SDK attempt)."""
        self._store_name = store_name
        self._counters = counters if counters is not None else Counters()
        self._redact = redact
        self._hold_limit = hold_limit
        self._clock = clock
        self._lock = threading.Lock()
        self._late: dict[Future[Any], float] = {}  # late request -> when it started
        self._paused_until = 0.0  # after a 403: no recall before then
        _background.reset_after_fork(self)

    def _after_fork_in_child(self) -> None:
        # The parent's late requests have no thread here: they must not keep the child's recall switched off.
        self._lock, self._late = threading.Lock(), {}

    @property
    def waking(self) -> bool:
        """Whether a recall that nobody waits for any more is still running, and still holds the guard."""
        with self._lock:
            oldest_that_counts = self._clock() - self._hold_limit
            return any(started > oldest_that_counts for started in self._late.values())

    def pause(self, seconds: float) -> None:
        """Skip recalls for ``seconds`` (Membase refused the key: a revoked key is not hit on every turn)."""
        self._paused_until = self._clock() + seconds

    async def run(self, start: Callable[[], Future[T]], budget: float | None) -> T:
        """What the request ``start`` starts (it returns its future) returns, within ``budget`` seconds (``None``: no
        limit). :class:`RecallSkipped` (nothing sent) while the guard is up or recall is paused;
        :class:`MembaseRecallTimeout` past the budget, the request going on in the background holding the guard
        (as it does when the caller is cancelled)."""
        skip = "key refused (403)" if self._clock() < self._paused_until else "memory waking" if self.waking else None
        if skip is not None:
            self._counters.add("recall_skipped")
            logger.debug("store=<%s>, reason=<%s> | recall skipped", self._store_name, skip)
            raise RecallSkipped(skip)
        started = self._clock()
        future = start()
        try:
            return await wait_for_future(future, budget)
        except asyncio.TimeoutError:
            self._counters.add("recall_timeouts")
            if not future.cancel():  # it was sent; one still waiting for a free thread never will be
                self._hold_guard(future, started)
            # INFO, not WARNING: the manager logs the exception below as a warning, once is enough.
            logger.info(
                "store=<%s>, reason=<ran out of time after %.1f s> | recall ran out of time; "
                "the turn goes on without memory and the request finishes in the background",
                self._store_name,
                budget,
            )
            raise MembaseRecallTimeout(
                f"Membase recall ran out of time after {budget:g} s; it goes on in the background"
            ) from None
        except asyncio.CancelledError:
            self._counters.add("recall_cancelled")
            if not future.cancel() and not future.done():
                self._hold_guard(future, started)
                logger.info(
                    "store=<%s>, reason=<cancelled> | recall cancelled while its request was running; "
                    "the request finishes in the background",
                    self._store_name,
                )
            raise

    def _hold_guard(self, future: Future[Any], started: float) -> None:
        """Hold the guard until ``future`` ends, then report how it ended."""
        linked = _telemetry.link_here()  # the turn's recall span: the late outcome's span links to it
        with self._lock:
            self._late[future] = started
        future.add_done_callback(functools.partial(self._release, started, linked))

    def _release(self, started: float, linked: Any, future: Future[Any]) -> None:
        """Let the guard go, then trace, log and count how the late request ended."""
        with self._lock:
            del self._late[future]
        elapsed = self._clock() - started
        error = future.exception()
        name = self._store_name
        _telemetry.late(_telemetry.RECALL_LATE, name, linked, "completed", error=error, elapsed_s=round(elapsed, 3))
        if error is None:
            logger.info("store=<%s>, elapsed=<%.1f s> | late recall finished; automatic recall resumes", name, elapsed)
        else:
            reason = self._redact(detail_of(error))
            message = "store=<%s>, elapsed=<%.1f s>, reason=<%s> | late recall failed; automatic recall resumes"
            logger.warning(message, name, elapsed, reason)
        self._counters.add("recall_late_completions")  # last: whoever sees it finds the outcome logged and traced

"""Automatic recall: time-boxed, fail-open, and guarded against hammering a waking memory.

The first search after a quiet spell can take up to a minute while the account's memory wakes.
A turn should not wait for that, so :class:`TimeBoxedRecall` gives each recall a budget. A recall
that runs past it raises :class:`MembaseRecallTimeout` for the manager (which logs it once and skips
the store for this turn) while its request runs on to the end in the background, waking the memory
for the next turn. A recall whose task is cancelled (a web server does that when its client
disconnects) leaves its request running the same way, and lets the ``CancelledError`` through.

While such a late request is still running, further recalls skip at once with
:class:`RecallSkipped` instead of piling more requests onto a memory that is not
answering yet, for at most one SDK attempt from the late request's start. A skip is not a failure:
the store turns it into "no memory this turn" and logs it at DEBUG only, so a long stall does not
write a warning per turn. Recalls that finish within the budget never hold the guard, so healthy
concurrent recalls all run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from membase.client import DEFAULT_TIMEOUT

from . import _background, _telemetry
from ._background import wait_for_future
from ._counters import Counters
from ._failures import detail_of
from .errors import MembaseRecallTimeout

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RecallSkipped(Exception):
    """A late or cancelled recall still holds the guard, so this one sent nothing. Not a failure: no memory now."""


class TimeBoxedRecall:
    """Waits for recall requests (each on a thread of ``_background``) within a time budget, one late request at
    a time."""

    def __init__(
        self,
        store_name: str,
        counters: Counters | None = None,
        redact: Callable[[str], str] = str,
        *,
        is_closed: Callable[[], bool] = lambda: False,
        hold_limit: float = DEFAULT_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create the time box for one store.

        Args:
            store_name: The store's name, for log lines.
            counters: Where to count timeouts, skips and late completions.
            redact: Masks secrets in the text of a late failure before it is logged.
            is_closed: Whether the store was closed, so a late request that fails because its
                connection was closed under it is reported as that, not as a connection error.
            hold_limit: The longest a late request keeps recall switched off, from its start: one
                SDK attempt. (A recall that must first look its Memory up makes two requests.)
            clock: The monotonic clock (a parameter so tests can move time).
        """
        self._store_name = store_name
        self._counters = counters if counters is not None else Counters()
        self._redact = redact
        self._is_closed = is_closed
        self._hold_limit = hold_limit
        self._clock = clock
        self._lock = threading.Lock()
        self._late: dict[Future[object], float] = {}  # late request -> when it started
        _background.reset_after_fork(self)

    def _after_fork_in_child(self) -> None:
        # The parent's late requests have no thread here: they must not keep the child's recall switched off.
        self._lock = threading.Lock()
        self._late = {}

    @property
    def waking(self) -> bool:
        """Whether a recall that ran past its budget is still running, and still holds the guard."""
        with self._lock:
            return self._guard_up()

    def _guard_up(self) -> bool:
        """Called with the lock held."""
        oldest_that_counts = self._clock() - self._hold_limit
        return any(started > oldest_that_counts for started in self._late.values())

    async def run(self, start: Callable[[], Future[T]], budget: float | None) -> T:
        """Start a request off the event loop and wait at most ``budget`` seconds for it.

        Args:
            start: Starts the Membase call on a thread and returns its future.
            budget: Seconds to wait, or ``None`` to wait as long as the request takes.

        Returns:
            What the request returned.

        Raises:
            RecallSkipped: A late request is still running; nothing was sent.
            MembaseRecallTimeout: The budget ran out; the request goes on in the background.
            asyncio.CancelledError: The caller's task was cancelled; the request goes on in the
                background and holds the guard like a late one.
            Exception: Whatever the request raised within the budget.
        """
        with self._lock:
            if self._guard_up():
                self._counters.add("recall_skipped")
                logger.debug("store=<%s>, reason=<memory waking> | recall skipped", self._store_name)
                raise RecallSkipped(
                    "Membase recall skipped: an earlier recall that nobody waits for any more (it ran out of "
                    "time or was cancelled) is still running"
                )
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
                # Nobody waits for this request any more, but it still runs: the next recalls must not
                # add theirs to it, exactly as after a timeout.
                self._hold_guard(future, started)
                logger.info(
                    "store=<%s>, reason=<cancelled> | recall cancelled while its request was running; "
                    "the request finishes in the background",
                    self._store_name,
                )
            raise

    def _hold_guard(self, future: Future[T], started: float) -> None:
        late: Future[object] = future  # type: ignore[assignment]
        linked = _telemetry.link_here()  # the turn's recall span: the late outcome's span links to it
        with self._lock:
            self._late[late] = started

        def release(done: Future[object]) -> None:
            with self._lock:
                self._late.pop(done, None)
            elapsed = self._clock() - started
            error = done.exception()
            closed = error is not None and self._is_closed()
            _telemetry.late(
                _telemetry.RECALL_LATE,
                self._store_name,
                linked,
                "error" if closed else "completed",
                error=None if closed else error,
                error_kind="closed" if closed else None,
                elapsed_s=round(elapsed, 3),
            )
            if error is None:
                logger.info(
                    "store=<%s>, elapsed=<%.1f s> | late recall finished; automatic recall resumes",
                    self._store_name,
                    elapsed,
                )
            elif closed:
                # Closing the store closed the connection under the request: that, not the network, ended it.
                logger.info(
                    "store=<%s>, elapsed=<%.1f s>, reason=<store closed> | late recall ended: "
                    "the store was closed while the recall was running",
                    self._store_name,
                    elapsed,
                )
            else:
                logger.warning(
                    "store=<%s>, elapsed=<%.1f s>, reason=<%s> | late recall failed; automatic recall resumes",
                    self._store_name,
                    elapsed,
                    self._redact(detail_of(error)),
                )
            # Last, so whoever sees the count finds the outcome already logged and traced.
            self._counters.add("recall_late_completions")

        late.add_done_callback(release)

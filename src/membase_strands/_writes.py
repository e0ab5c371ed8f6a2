"""Captured writes: time-boxed, never sent twice for the same thing, never lost without a word.

The manager retries a write that raised, and a write that ran out of its budget may still succeed in the
background. So the record keeps a store's writes by identity: a retry of a saved one sends nothing, a retry of a
running one waits for that request, a failed one is forgotten so its retry sends it. A batch that fails when no
retry will come (its caller was cancelled, so Strands counts it as handled; or the store closed) is kept and sent
again once by the store itself. A part's anchor (a message's content block) is held while the record remembers
the part, so the ``id`` in its identity cannot be reused meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from . import _background, _options, _telemetry
from ._background import wait_for_future
from ._counters import Counters
from ._failures import describe_failure, detail_of
from .errors import MembaseWriteTimeout

logger = logging.getLogger(__name__)

RECORD_SIZE = 4096
RECORD_SECONDS = 3600.0
RECORD_BYTES = 1024 * 1024
"""The most message text (bytes of ``str`` objects) the record keeps alive: saved anchors, and kept batches."""

# Why nobody waits for a request any more: the words of the line that reports its outcome.
_RAN_OUT = "that ran out of time"
_CANCELLED = "whose caller was cancelled"
_SENT_AGAIN = "the store sent again"


@dataclass(frozen=True)
class Part:
    """One thing to write: its identity, its text, and an object to keep alive while it is recorded, with the bytes
    of text that object holds (for the byte bound)."""

    key: Hashable
    text: str
    anchor: object = None
    anchor_bytes: int = 0


Send = Callable[[list[Part]], Any]
"""Makes the blocking request for the parts that still need it."""


def fingerprint(*fields: object) -> str:
    """A compact, stable digest of some fields, for identities that must not hold whole texts."""
    return hashlib.sha256(repr(fields).encode("utf-8", "surrogatepass")).hexdigest()


class _Request:
    """One request the record started. Its thread records the outcome under the record's lock (``ended``), reports
    it when nobody waits for it any more (``abandoned`` says why), and only then settles ``future``."""

    def __init__(self, parts: list[Part], send: Send, abandoned: str | None = None) -> None:
        self.parts = parts
        self.send = send
        self.size = sum(part.anchor_bytes or len(part.text) for part in parts)
        self.future: Future[Any] = Future()
        self.ended = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = abandoned
        self.linked = _telemetry.link_here()  # the span of the write that started it, for a late outcome's span


@dataclass
class _Entry:
    request: _Request | None  # None once saved: a saved write keeps its identity, not the request or its answer
    anchor: object
    anchor_bytes: int
    saved_at: float = 0.0
    save: int = 0  # which save, in order; the parts of one request share it
    retry_expected: bool = False  # saved after its caller was told it failed, and no retry has come yet


class WriteRecord:
    """The writes one store started, by identity; safe to share between threads and event loops."""

    def __init__(
        self,
        store_name: str,
        counters: Counters | None = None,
        redact: Callable[[str], str] = str,
        *,
        budget: float | None = _options.DEFAULT_WRITE_TIMEOUT,
        size: int = RECORD_SIZE,
        seconds: float = RECORD_SECONDS,
        max_bytes: int = RECORD_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """An empty record. ``budget``: seconds a write may hold its caller (``None``: one whole request), and how
        long closing waits; ``size``, ``seconds``, ``max_bytes``: its bounds; ``clock``: for tests to move time."""
        self._store_name = store_name
        self._counters = counters if counters is not None else Counters()
        self._redact = redact
        self._budget = budget
        self._size = size
        self._seconds = seconds
        self._max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._kept: list[_Request] = []  # failed with nobody left to retry them: sent again once
        self._unsettled: set[_Request] = set()  # started, and their futures not settled yet
        self._saves = 0
        self._closing = False  # close() began: no retry will come from the manager
        self._closed = False  # close() stopped waiting: what fails now is sent again at interpreter exit
        _background.reset_after_fork(self)
        _background.finish_at_exit(self)

    def _after_fork_in_child(self) -> None:
        # The parent's running writes have no thread here: forget them, so a retry in the child sends them.
        # Its kept batches are the parent's to send again: sent from every child too, they would be saved twice.
        self._lock = threading.Lock()
        self._unsettled = set()
        self._kept = []
        for key in [key for key, entry in self._entries.items() if entry.request is not None]:
            del self._entries[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def retained_bytes(self) -> int:
        """The bytes of text the record keeps alive: the anchors of the writes it remembers, and kept batches."""
        with self._lock:
            kept = sum(request.size for request in self._kept)
            return kept + sum(entry.anchor_bytes for entry in self._entries.values())

    @property
    def _wait_budget(self) -> float:
        return self._budget if self._budget is not None else _options.WAIT_WITHOUT_BUDGET

    async def write(self, parts: Sequence[Part], send: Send) -> Any:
        """Send the parts not saved yet as one request, waiting at most the budget in all; what ``send`` returned,
        or ``None`` when every part was saved already. Kept batches go out first, in the background.

        Raises:
            MembaseWriteTimeout: The budget ran out; the request goes on in the background.
            asyncio.CancelledError: The caller was cancelled; the request goes on in the background.
            Exception: Whatever ``send`` raised (those parts are forgotten, so a retry sends them).
        """
        self._send_kept(without={part.key for part in parts})
        deadline = None if self._budget is None else self._clock() + self._budget
        saved_for_us: set[Hashable] = set()  # saved by an earlier call's request this call waited for
        while True:
            with self._lock:
                self._evict()
                running = self._running([part for part in parts if part.key not in saved_for_us])
                if not running:
                    saved = [part.key for part in parts if part.key in saved_for_us or part.key in self._entries]
                    todo = [part for part in parts if part.key not in saved_for_us and part.key not in self._entries]
                    request = self._register(todo, send) if todo else None
                    break
            # The same thing is being saved by an earlier call: wait for that request instead of sending
            # another. If it fails, its parts count as new on the next pass and this call sends them.
            for earlier, keys in running:
                await self._wait(earlier, deadline, "an earlier write of the same content is still running")
                if earlier.error is None:
                    saved_for_us.update(keys)  # saved, even if a bound has forgotten it since
        _telemetry.annotate(
            sent=len(todo),
            deduplicated=len(saved),
            waited_for_earlier=bool(saved_for_us),
            decision="send" if not saved else "partial" if todo else "already saved",
        )
        if saved:
            self._counters.add("writes_deduplicated", len(saved))
            logger.debug(
                "store=<%s>, already_saved=<%d> | not sending again what this store saved", self._store_name, len(saved)
            )
        result = None
        if request is not None:
            self._start(request)
            what = "it goes on in the background and the manager keeps the batch"
            result = await self._wait(request, deadline, what, own=True)
        self._retried(saved)
        return result

    def running(self) -> list[Future[Any]]:
        """The futures of the writes still running, or still reporting how they ended; each settles once its
        outcome is on record, logged and counted (and a failed batch kept for sending again)."""
        with self._lock:
            return [request.future for request in self._unsettled]

    def drain(self, until: float | None = None) -> bool:
        """Close the record: wait for the writes still running (those that start meanwhile too), then send the kept
        batches once and wait for those, each up to the budget (or both until the monotonic time ``until``); whether
        no write is left running. Every outcome waited for is on record and logged when this returns."""
        self._closing = True
        waited: set[Future[Any]] = set()
        self._wait_running(until, waited, kept=len(self._kept))
        self._closed = True
        waited.update(self._send_kept())  # each was counted above, as a kept batch or as the write that failed
        self._wait_running(until, waited)
        left = len(self.running())
        if left:
            logger.warning(
                "store=<%s>, writes=<%d> | writes still running after %g s; %s",
                self._store_name,
                left,
                self._wait_budget,
                "they were not confirmed saved" if _background.exiting() else "their outcome is logged when they end",
            )
        return not left

    def _wait_running(self, until: float | None, waited: set[Future[Any]], kept: int = 0) -> None:
        """Wait until no write is running, or the budget (or ``until``) is over; say so each time writes are
        running that were not waited for yet (a daemon thread may start one during the exit wait)."""
        deadline = time.monotonic() + self._wait_budget if until is None else until
        while True:
            running = self.running()
            new = [future for future in running if future not in waited]
            if new or kept:
                logger.info(
                    "store=<%s>, writes=<%d> | waiting for writes still running", self._store_name, len(new) + kept
                )
                waited.update(new)
                kept = 0
            left = deadline - time.monotonic()
            if not running or left <= 0:
                return
            wait(running, timeout=left, return_when=FIRST_COMPLETED)

    async def drain_async(self) -> bool:
        """:meth:`drain` for async code, on a thread: cancelling the wait leaves the writes and the drain running."""
        return await wait_for_future(_background.submit(self.drain, name=f"membase-close[{self._store_name}]"), None)

    def _finish_at_exit(self, started: float) -> None:
        """At interpreter exit: :meth:`drain` within the budget counted from ``started``."""
        if self.running() or self._kept:
            logger.info(
                "store=<%s> | the interpreter is exiting; waiting up to %g s for writes still running",
                self._store_name,
                self._wait_budget,
            )
            self.drain(until=started + self._wait_budget)

    # --- Waiting --------------------------------------------------------------------------------

    async def _wait(self, request: _Request, deadline: float | None, what: str, *, own: bool = False) -> Any:
        """Wait for ``request`` until ``deadline``. With ``own`` this caller started it: its failure is raised here,
        and if this caller stops waiting, the request's thread reports the outcome."""
        remaining = None if deadline is None else max(0.0, deadline - self._clock())
        try:
            return await wait_for_future(request.future, remaining)
        except asyncio.TimeoutError:
            if not own or self._abandon(request, _RAN_OUT):
                self._counters.add("write_timeouts")
                logger.warning(
                    "store=<%s>, reason=<write ran out of time> | Membase write ran out of time; %s",
                    self._store_name,
                    what,
                )
                raise MembaseWriteTimeout(f"Membase write ran out of time; {what}") from None
            # It ended as the budget ran out: the outcome is recorded, and it is this caller's to report.
        except asyncio.CancelledError:
            self._counters.add("write_cancellations")
            logger.info(
                "store=<%s>, reason=<cancelled> | the caller stopped waiting for a Membase write; "
                "it goes on in the background",
                self._store_name,
            )
            if own and not self._abandon(request, _CANCELLED) and request.error is not None:
                self._report_late(request, _CANCELLED)  # it failed just before: nobody else reports it
            raise
        except Exception:
            if own:
                raise
            return None
        if request.error is not None:
            raise request.error
        return request.result

    def _abandon(self, request: _Request, why: str) -> bool:
        """Hand the reporting of ``request``'s outcome to its thread; False if it has already ended."""
        with self._lock:
            if not request.ended:
                request.abandoned = why
            return not request.ended

    # --- The request's thread -------------------------------------------------------------------

    def _register(self, parts: list[Part], send: Send, abandoned: str | None = None) -> _Request:
        """A request for ``parts``, on record as running. Called with the lock held."""
        request = _Request(parts, send, abandoned)
        self._unsettled.add(request)
        for part in parts:
            self._entries[part.key] = _Entry(request, part.anchor, part.anchor_bytes)
        return request

    def _start(self, request: _Request) -> None:
        try:
            _background.submit(lambda: self._run(request), name=f"membase-write[{self._store_name}]", lane=self)
        except BaseException as error:  # noqa: BLE001 - recorded, then raised to the caller
            # Typically "can't start new thread", most likely while Membase hangs and threads pile up.
            logger.warning(
                "store=<%s>, reason=<%s> | could not start the write; nothing was sent and a retry sends it",
                self._store_name,
                self._redact(detail_of(error)),
            )
            self._finish(request, None, error)
            raise

    def _run(self, request: _Request) -> None:
        try:
            result = request.send(list(request.parts))
        except BaseException as error:  # noqa: BLE001 - recorded, and raised to whoever waits
            self._finish(request, None, error)
        else:
            self._finish(request, result, None)

    def _finish(self, request: _Request, result: Any, error: BaseException | None) -> None:
        """Record the outcome, report it if nobody waits for it any more, then settle the future."""
        try:
            with self._lock:
                request.ended, request.result, request.error = True, result, error
                self._saves += 1
                for part in request.parts:
                    entry = self._entries.get(part.key)
                    if entry is None or entry.request is not request:
                        continue  # a key the request holds twice, recorded already
                    if error is not None:
                        del self._entries[part.key]
                    else:
                        entry.request, entry.saved_at, entry.save = None, self._clock(), self._saves
                        entry.retry_expected = request.abandoned is not None
                        self._entries.move_to_end(part.key)
                self._evict()
            if error is None:
                self._counters.add("writes_saved", len(request.parts))
            if request.abandoned is not None:
                self._report_late(request, request.abandoned)
        finally:
            with self._lock:
                self._unsettled.discard(request)
            if error is None:
                request.future.set_result(result)
            else:
                request.future.set_exception(error)

    def _report_late(self, request: _Request, why: str) -> None:
        """Log and count the outcome of a request nobody waits for; keep a failed batch no retry will bring back."""
        error = request.error
        reason = {_RAN_OUT: "timeout", _CANCELLED: "cancelled"}.get(why, "sent again")
        _telemetry.late(_telemetry.WRITE_LATE, self._store_name, request.linked, "saved", error=error, reason=reason)
        if error is None:
            logger.info("store=<%s> | a write %s finished; it is saved", self._store_name, why)
            return
        self._counters.add("write_errors")
        self._counters.add(f"errors.{describe_failure(error).kind}")
        if why == _RAN_OUT and not self._closing:
            then = "the manager's retry sends it again"
        elif why == _SENT_AGAIN or _background.exiting() or request.size > self._max_bytes:
            self._counters.add("writes_lost", len(request.parts))
            then = "it is not saved, and nothing will send it again"
        else:
            self._keep(request)
            then = "no retry will come from the manager" + (
                " (the store is closed); it is sent again at interpreter exit"
                if self._closed
                else " (the store is closing); it is sent again before it closes"
                if self._closing
                else "; the store sends it again with its next write or when it closes"
            )
        detail = self._redact(detail_of(error))
        logger.warning("store=<%s>, reason=<%s> | a write %s failed; %s", self._store_name, detail, why, then)

    # --- Batches sent again ---------------------------------------------------------------------

    def _keep(self, request: _Request) -> None:
        """Keep a failed batch for sending again: the oldest kept ones make room within the byte bound, each
        dropped one logged and counted as lost."""
        with self._lock:
            self._kept.append(request)
            retained = sum(kept.size for kept in self._kept)
            dropped = []
            while retained > self._max_bytes:
                dropped.append(self._kept.pop(0))
                retained -= dropped[-1].size
            _background.finish_at_exit(self, hold=True)  # it must live to send them, store or not
        for lost in dropped:
            self._counters.add("writes_lost", len(lost.parts))
            logger.warning(
                "store=<%s>, parts=<%d> | a failed write kept for sending again was dropped to stay within %d bytes; "
                "it is not saved",
                self._store_name,
                len(lost.parts),
                self._max_bytes,
            )

    def _send_kept(self, without: Collection[Hashable] = ()) -> list[Future[Any]]:
        """Send each kept batch once more, in the background, leaving out parts on record or a caller is sending."""
        with self._lock:
            kept, self._kept = self._kept, []
            if kept:
                _background.finish_at_exit(self, hold=False)
            requests = []
            for old in kept:
                parts = [part for part in old.parts if part.key not in without and part.key not in self._entries]
                if parts:
                    requests.append(self._register(parts, old.send, abandoned=_SENT_AGAIN))
        for request in requests:
            self._counters.add("writes_sent_again", len(request.parts))
            with contextlib.suppress(Exception):  # it failed to start: logged, and counted as lost
                self._start(request)
        return [request.future for request in requests]

    # --- The record -----------------------------------------------------------------------------

    def _running(self, parts: Sequence[Part]) -> list[tuple[_Request, list[Hashable]]]:
        """The requests still running for any of ``parts``, each with those parts' keys. Called with the lock held."""
        running: dict[_Request, list[Hashable]] = {}
        for part in parts:
            entry = self._entries.get(part.key)
            if entry is not None and entry.request is not None:
                running.setdefault(entry.request, []).append(part.key)
        return list(running.items())

    def _retried(self, keys: list[Hashable]) -> None:
        """A retry got success for these saved writes: none is expected any more."""
        if keys:
            with self._lock:
                for key in keys:
                    entry = self._entries.get(key)
                    if entry is not None:
                        entry.retry_expected = False

    def _evict(self) -> None:
        """Forget saved writes past their time, then the oldest past the size and byte bounds. Lock held.

        Running writes are never forgotten. Those a retry is still expected for go last, and the newest of them
        stays whatever the bounds: the manager's retry of a batch whose write ran out of time is the duplicate
        this record exists to stop.
        """
        cutoff = self._clock() - self._seconds
        for key in [key for key, entry in self._entries.items() if entry.request is None and entry.saved_at < cutoff]:
            del self._entries[key]
        saved = [(key, entry) for key, entry in self._entries.items() if entry.request is None]
        excess = len(saved) - self._size
        excess_bytes = sum(entry.anchor_bytes for _, entry in saved) - self._max_bytes
        if excess <= 0 and excess_bytes <= 0:
            return
        newest_expected = max((entry.save for _, entry in saved if entry.retry_expected), default=None)
        for key, entry in sorted(saved, key=lambda item: item[1].retry_expected):  # stable: oldest first
            if excess <= 0 and excess_bytes <= 0:
                break
            if not (entry.retry_expected and entry.save == newest_expected):
                del self._entries[key]
                excess -= 1
                excess_bytes -= entry.anchor_bytes

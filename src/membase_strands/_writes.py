"""Captured writes: time-boxed, never sent twice for the same thing, and every outcome on record.

The manager retries a write that raised: ``add_messages`` gets the same batch again (plus any
newer messages), and on the extractor path every fact of a batch goes through ``add`` again when
one of them failed. A write that ran out of budget may still succeed in the background. So this
store keeps a record of its writes by identity:

- saved: a retry does not send it again and reports success;
- still running: a retry waits for that request (within the budget) instead of sending another;
- failed, or never started (no thread could be started): it is forgotten, so the retry sends it.

The thread that ran a request records its outcome before anyone waiting for it wakes. When the
caller stopped waiting (its budget ran out, or its task was cancelled, as a web server does when
its client disconnects), that thread also logs and counts the outcome, a failure under
``write_errors`` and ``errors.<kind>``. So once :meth:`WriteRecord.drain` returns, the outcome of
every write it waited for is in the logs and the counters. A write still running when the
interpreter exits gets up to its budget to finish, and a log line if it does not.

A message's identity is its sequence number in the manager's batch, the message object itself
(the manager hands the same content block objects on every retry of a batch, and a new agent run
brings new ones; the record keeps a reference to the block, so its ``id`` cannot be reused while
the record stands), and a hash of its text. A fact's identity is a hash of its text and target.

The record is bounded in entries, in time, and in the bytes of text its anchors keep alive: a
saved write keeps its identity but not Membase's answer or the words it sent, and past the bounds
the oldest saved writes are forgotten, those a retry is still expected for (their caller was told
they failed) last, and the newest of those never by a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, wait
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
"""The most message text (in bytes of ``str`` objects) that saved writes' anchors keep alive, per record."""


@dataclass(frozen=True)
class Part:
    """One thing to write: its identity, its text, and an object to keep alive while it is recorded.

    ``anchor_bytes`` is how much memory the anchor keeps alive (the text it holds), for the byte bound.
    """

    key: Hashable
    text: str
    anchor: object = None
    anchor_bytes: int = 0


def fingerprint(*fields: object) -> str:
    """A compact, stable digest of some fields, for identities that must not hold whole texts."""
    return hashlib.sha256(repr(fields).encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class _Late:
    """Why nobody waits for a request any more, in the words of the log line that reports its outcome."""

    which: str
    after_failure: str


_RAN_OUT = _Late("that ran out of time", "the manager's retry sends it again")
_CANCELLED = _Late("whose caller was cancelled", "it is not saved")
_AT_EXIT = "it is not saved, and no retry will send it: the interpreter is exiting"


class _Request:
    """One request this record started: its parts while it runs, then its outcome."""

    __slots__ = ("abandoned", "done", "error", "future", "linked", "parts", "result")

    def __init__(self, parts: list[Part]) -> None:
        # Settled by the thread only after the outcome is recorded (see WriteRecord._finish).
        self.future: Future[Any] = Future()
        self.parts: list[Part] | None = parts
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned: _Late | None = None  # set when its caller stopped waiting: the thread reports the outcome
        self.linked = _telemetry.link_here()  # the span of the write that started it, for a late outcome's span


@dataclass
class _Entry:
    request: _Request | None  # None once saved: a saved write keeps its identity, not the request or its answer
    anchor: object
    anchor_bytes: int
    saved_at: float | None = None
    save: int = 0  # which save, in order; the parts of one request share it
    retry_expected: bool = False  # saved after its caller was told it failed, and no retry has come yet


class WriteRecord:
    """Writes this store started, by identity; safe to share between threads and event loops."""

    def __init__(
        self,
        store_name: str,
        counters: Counters | None = None,
        redact: Callable[[str], str] = str,
        *,
        size: int = RECORD_SIZE,
        seconds: float = RECORD_SECONDS,
        max_bytes: int = RECORD_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create an empty record.

        Args:
            store_name: The store's name, for log lines and thread names.
            counters: Where to count writes saved, deduplicated, timed out, cancelled and failed late.
            redact: Masks secrets in the text of a late failure before it is logged.
            size: How many saved writes to remember at most (oldest forgotten first).
            seconds: How long to remember a saved write.
            max_bytes: How much text the anchors of saved writes may keep alive (oldest forgotten first).
            clock: The monotonic clock (a parameter so tests can move time).
        """
        self._store_name = store_name
        self._counters = counters if counters is not None else Counters()
        self._redact = redact
        self._size = size
        self._seconds = seconds
        self._max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._saves = 0
        self.exit_grace = _options.WAIT_WITHOUT_BUDGET  # how long interpreter exit waits for running writes
        _background.finish_at_exit(self)
        _background.reset_after_fork(self)

    def _after_fork_in_child(self) -> None:
        # The parent's running writes have no thread here: forget them, so a retry in the child sends them.
        self._lock = threading.Lock()
        for key in [key for key, entry in self._entries.items() if entry.request is not None]:
            del self._entries[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def retained_bytes(self) -> int:
        """The bytes of text the record keeps alive through the anchors of the writes it remembers."""
        with self._lock:
            return sum(entry.anchor_bytes for entry in self._entries.values())

    async def write(self, parts: Sequence[Part], send: Callable[[list[Part]], Any], budget: float | None) -> Any:
        """Send the parts not saved yet as one request, waiting at most ``budget`` seconds in all.

        Args:
            parts: What the caller wants saved.
            send: Makes the blocking request for the parts that still need it.
            budget: Seconds to wait, or ``None`` to wait as long as the request takes.

        Returns:
            What ``send`` returned, or ``None`` when every part was already saved.

        Raises:
            MembaseWriteTimeout: The budget ran out; the request goes on in the background.
            asyncio.CancelledError: The caller was cancelled; the request goes on in the background
                and its outcome is logged and counted when it ends.
            Exception: Whatever ``send`` raised, or the error that kept its thread from starting;
                those parts are forgotten so a retry sends them.
        """
        deadline = None if budget is None else self._clock() + budget
        saved_for_us: set[Hashable] = set()  # saved by an earlier call's request this call waited for
        while True:
            with self._lock:
                self._evict()
                running = self._running([part for part in parts if part.key not in saved_for_us])
                if not running:
                    saved = [part.key for part in parts if part.key in saved_for_us or part.key in self._entries]
                    todo = [part for part in parts if part.key not in saved_for_us and part.key not in self._entries]
                    request = _Request(todo) if todo else None
                    for part in todo:
                        self._entries[part.key] = _Entry(request, part.anchor, part.anchor_bytes)
                    break
            # The same thing is being saved by an earlier call: wait for that request instead of sending
            # another. If it fails, its parts count as new on the next pass and this call sends them.
            for earlier, keys in running:
                await self._wait(earlier, deadline, "an earlier write of the same content is still running")
                if earlier.error is None:
                    saved_for_us.update(keys)  # saved, even if a bound has forgotten it since
        _telemetry.annotate(
            sent=len(todo) if request is not None else 0,
            deduplicated=len(saved),
            waited_for_earlier=bool(saved_for_us),
            decision="send" if not saved else "partial" if request is not None else "already saved",
        )
        if saved:
            self._counters.add("writes_deduplicated", len(saved))
            logger.debug(
                "store=<%s>, already_saved=<%d> | not sending again what this store saved", self._store_name, len(saved)
            )
        if request is None:
            self._retried(saved)
            return None
        try:
            _background.submit(lambda: self._run(request, send), name=f"membase-write[{self._store_name}]")
        except BaseException as error:  # noqa: BLE001 - recorded, then raised to the caller
            # Typically "can't start new thread", most likely while Membase hangs and threads pile up.
            logger.warning(
                "store=<%s>, reason=<%s> | could not start the write; nothing was sent and a retry sends it",
                self._store_name,
                self._redact(detail_of(error)),
            )
            self._finish(request, None, error)
            raise
        what = "it goes on in the background and the manager keeps the batch"
        result = await self._wait(request, deadline, what, own=True)
        self._retried(saved)
        return result

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the writes still running; whether none is left.

        Each write waited for has its outcome recorded, logged and counted by the time this returns.
        """
        running = self._still_running()
        if not running:
            return True
        left = len(wait(running, timeout=timeout).not_done)
        return self._drained(left, timeout)

    async def drain_async(self, timeout: float) -> bool:
        """:meth:`drain` for async code: awaits the writes still running without blocking the event loop.

        Works from any event loop; cancelling it leaves the writes running.
        """
        running = self._still_running()
        if not running:
            return True
        deadline = time.monotonic() + timeout
        for future in running:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # A failure is the writing thread's to report; a timeout shows in the count below.
            with contextlib.suppress(Exception):
                await wait_for_future(future, remaining)
        return self._drained(sum(not future.done() for future in running), timeout)

    def running(self) -> list[Future[Any]]:
        """The futures of the writes still running; each settles once its outcome is on record."""
        with self._lock:
            return list({entry.request.future for entry in self._entries.values() if entry.request is not None})

    def _still_running(self) -> list[Future[Any]]:
        """:meth:`running`, logged as waited for."""
        running = self.running()
        if running:
            logger.info("store=<%s>, writes=<%d> | waiting for writes still running", self._store_name, len(running))
        return running

    def _drained(self, left: int, timeout: float) -> bool:
        if left:
            logger.warning(
                "store=<%s>, writes=<%d> | writes still running after %g s; their outcome is logged when they end",
                self._store_name,
                left,
                timeout,
            )
        return not left

    def _finish_at_exit(self, started: float) -> None:
        """At interpreter exit: wait until ``exit_grace`` after ``started`` for the writes still running, and log
        each one that did not end (never its text), so nothing is lost without a line saying so."""
        with self._lock:
            running = {entry.request for entry in self._entries.values() if entry.request is not None}
        if not running:
            return
        logger.info(
            "store=<%s>, writes=<%d> | the interpreter is exiting; waiting up to %g s for writes still running",
            self._store_name,
            len(running),
            self.exit_grace,
        )
        wait([request.future for request in running], timeout=max(0.0, started + self.exit_grace - time.monotonic()))
        for request in running:
            if not request.done:
                logger.warning(
                    "store=<%s>, parts=<%d>, reason=<interpreter exiting> | a write still running at exit did not "
                    "finish within %g s; it was not confirmed saved",
                    self._store_name,
                    len(request.parts or ()),
                    self.exit_grace,
                )

    # --- Waiting --------------------------------------------------------------------------------

    async def _wait(self, request: _Request, deadline: float | None, what: str, *, own: bool = False) -> Any:
        """Wait for ``request`` until ``deadline``.

        With ``own`` this caller started it: its failure is raised here, and if this caller stops
        waiting the request's thread reports the outcome. Otherwise its failure is not raised here.
        """
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
                self._report_late(_CANCELLED, request.error, request)  # it failed just before: nobody else reports it
            raise
        except Exception:
            if own:
                raise
            return None
        if request.error is not None:
            raise request.error
        return request.result

    def _abandon(self, request: _Request, why: _Late) -> bool:
        """Hand the reporting of ``request``'s outcome to its thread; False if it has already ended."""
        with self._lock:
            if request.done:
                return False
            request.abandoned = why
            return True

    # --- The request's thread -------------------------------------------------------------------

    def _run(self, request: _Request, send: Callable[[list[Part]], Any]) -> None:
        try:
            result = send(list(request.parts or ()))
        except BaseException as error:  # noqa: BLE001 - recorded, and raised to whoever waits
            self._finish(request, None, error)
        else:
            self._finish(request, result, None)

    def _finish(self, request: _Request, result: Any, error: BaseException | None) -> None:
        """Record the outcome, report it if nobody waits for it any more, then settle the future."""
        try:
            with self._lock:
                parts = request.parts or []
                request.parts = None
                request.done = True
                request.result, request.error = result, error
                abandoned = request.abandoned
                self._saves += 1
                now = self._clock()
                for part in parts:
                    entry = self._entries.get(part.key)
                    if entry is None or entry.request is not request:
                        continue
                    if error is not None:
                        del self._entries[part.key]
                    else:
                        entry.request = None
                        entry.saved_at = now
                        entry.save = self._saves
                        entry.retry_expected = abandoned is not None
                        self._entries.move_to_end(part.key)
                self._evict()
            if error is None:
                self._counters.add("writes_saved", len(parts))
            if abandoned is not None:
                self._report_late(abandoned, error, request)
        finally:
            if error is None:
                request.future.set_result(result)
            else:
                request.future.set_exception(error)

    def _report_late(self, why: _Late, error: BaseException | None, request: _Request) -> None:
        reason = "timeout" if why is _RAN_OUT else "cancelled"
        _telemetry.late(_telemetry.WRITE_LATE, self._store_name, request.linked, "saved", error=error, reason=reason)
        if error is None:
            logger.info("store=<%s> | a write %s finished; it is saved", self._store_name, why.which)
            return
        self._counters.add("write_errors")
        self._counters.add(f"errors.{describe_failure(error).kind}")
        logger.warning(
            "store=<%s>, reason=<%s> | a write %s failed; %s",
            self._store_name,
            self._redact(detail_of(error)),
            why.which,
            _AT_EXIT if _background.exiting() else why.after_failure,
        )

    # --- The record -----------------------------------------------------------------------------

    def _running(self, parts: Sequence[Part]) -> list[tuple[_Request, list[Hashable]]]:
        """The requests still running for any of ``parts``, each with those parts' keys. Called with the lock held."""
        running: dict[int, tuple[_Request, list[Hashable]]] = {}
        for part in parts:
            entry = self._entries.get(part.key)
            if entry is not None and entry.request is not None:
                running.setdefault(id(entry.request), (entry.request, []))[1].append(part.key)
        return list(running.values())

    def _retried(self, keys: list[Hashable]) -> None:
        """A retry got success for these saved writes: none is expected any more."""
        if keys:
            with self._lock:
                for key in keys:
                    entry = self._entries.get(key)
                    if entry is not None:
                        entry.retry_expected = False

    def _evict(self) -> None:
        """Forget saved writes past their time, then the oldest past the size and byte bounds.

        Called with the lock held, before each write and after each save, so the bounds hold at rest.
        Writes still running are never forgotten. Among saved ones, those a retry is still expected for
        go last, and the newest of them stays whatever the bounds: the manager's retry of a batch whose
        write ran out of time is the duplicate this record exists to stop.
        """
        cutoff = self._clock() - self._seconds
        for key, entry in list(self._entries.items()):
            if entry.saved_at is not None and entry.saved_at < cutoff:
                del self._entries[key]
        saved = [(key, entry) for key, entry in self._entries.items() if entry.saved_at is not None]
        excess = len(saved) - self._size
        excess_bytes = sum(entry.anchor_bytes for _, entry in saved) - self._max_bytes
        if excess <= 0 and excess_bytes <= 0:
            return
        newest_expected = max((entry.save for _, entry in saved if entry.retry_expected), default=None)
        for key, entry in sorted(saved, key=lambda item: item[1].retry_expected):  # stable: oldest first
            if excess <= 0 and excess_bytes <= 0:
                break
            if entry.retry_expected and entry.save == newest_expected:
                continue
            del self._entries[key]
            excess -= 1
            excess_bytes -= entry.anchor_bytes

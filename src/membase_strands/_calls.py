"""One way to call Membase: a :class:`Call` runs a blocking SDK call on a library thread while its caller waits within
a budget, and ends in one :class:`Outcome`. A call that outlives its caller's budget goes on (a waking memory, a write
Membase may be storing) on a daemon thread nothing joins (not ``asyncio.run``, not interpreter exit), bounded by
``request_timeout`` in its socket, and its late outcome is reported once. An idle thread takes the next call, else a new
one starts (as costly as a recall's work); one idle for :data:`IDLE_SECONDS` ends. After ``os.fork()``, what holds
calls or locks drops them (:func:`reset_in_forked_child`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import membase

from ._failures import Refused
from ._http import may_have_arrived

T = TypeVar("T")

IDLE_SECONDS = 2.0
IDLE_NAME = "membase-idle"

ANSWERED = "answered"
REFUSED = "refused"  # a 403: the error is a Refused, which says which of Membase's three
FAILED = "failed"  # Membase answered with an error, or the request never reached it: safe to send again
MAY_HAVE_ARRIVED = "may have arrived"  # the request went out and no answer of Membase's came back: never send again


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """How one call ended: its ``kind`` (:data:`ANSWERED`, :data:`REFUSED`, :data:`FAILED`, :data:`MAY_HAVE_ARRIVED`),
    and its ``value`` or its ``error``, masked (safe to log, raise and show)."""

    kind: str
    value: T | None = None
    error: BaseException | None = None

    def result(self) -> T:
        """The value; the error raised."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


def run(call: Callable[[], T], mask: Callable[[BaseException], BaseException]) -> Outcome[T]:
    """Run ``call`` on this thread (a tool: Strands runs it on a thread of its own) and say how it ended; ``mask``
    takes the key out of a Membase error (a server may echo it; the library's own errors never hold it)."""
    try:
        return Outcome(ANSWERED, call())
    except Exception as error:  # noqa: BLE001 - every failure becomes an outcome
        if not isinstance(error, membase.MembaseError):
            return Outcome(FAILED, error=error)  # nothing was sent (a Memory name that matches none, say)
        if isinstance(error, Refused):
            return Outcome(REFUSED, error=mask(error))
        return Outcome(MAY_HAVE_ARRIVED if may_have_arrived(error) else FAILED, error=mask(error))


OnEnd = Callable[[Outcome[Any]], None]
OnLateEnd = Callable[[Outcome[Any], str], None]


class Call(Generic[T]):
    """One call on a library thread named ``name``. ``on_end(outcome)`` runs on that thread when it ends, before
    anyone waiting hears of it; ``on_late_end(outcome, why)`` runs once if the owner stopped waiting first (``why``:
    ``"timeout"`` or ``"cancelled"``), so the late outcome is logged and counted once."""

    def __init__(
        self,
        call: Callable[[], T],
        *,
        name: str,
        mask: Callable[[BaseException], BaseException],
        on_end: OnEnd | None = None,
        on_late_end: OnLateEnd | None = None,
    ) -> None:
        self._call: Callable[[], T] | None = call
        self._name, self._mask, self._on_end, self._on_late_end = name, mask, on_end, on_late_end
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._outcome: Outcome[T] | None = None
        self._wake_waiters: list[Callable[[], None]] = []
        self._given_up: str | None = None

    def start(self) -> Call[T]:
        """Start the call on its thread; if no thread can start, it ends at once with that failure."""
        try:
            _threads.run(self._run, self._name)
        except RuntimeError as error:  # "can't start new thread": nothing was sent
            self._end(Outcome(FAILED, error=error))
        return self

    def done(self) -> bool:
        """Whether the call has ended, its outcome on record and reported."""
        return self._ended.is_set()

    @property
    def outcome(self) -> Outcome[T] | None:
        """How the call ended; ``None`` while it runs."""
        return self._outcome

    async def wait(self, budget: float | None, *, owner: bool) -> Outcome[T] | None:
        """The outcome, or ``None`` after ``budget`` seconds (``None``: no limit) with the call still running. The
        ``owner`` (who started it) stopping, timed out or cancelled, makes the call report its late end; others go."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()  # this loop's: made for this wait

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(_settle, ended)

        with self._lock:
            if self._ended.is_set():
                return self._outcome
            self._wake_waiters.append(wake)
        try:
            await asyncio.wait_for(ended, budget)
        except asyncio.TimeoutError:
            return self._give_up("timeout", owner)
        except asyncio.CancelledError:
            if (outcome := self._give_up("cancelled", owner)) is not None and owner and self._on_late_end:
                self._on_late_end(outcome, "cancelled")  # it ended just before: nobody else reports it
            raise
        return self._outcome

    def wait_blocking(self, budget: float | None, *, owner: bool) -> Outcome[T] | None:
        """:meth:`wait`, blocking this thread."""
        if not self._ended.wait(budget):
            return self._give_up("timeout", owner)
        return self._outcome

    def _give_up(self, why: str, owner: bool) -> Outcome[T] | None:
        """Stop waiting: the outcome if the call has just ended, else ``None`` (an owner's ``why``: for on_late_end)."""
        with self._lock:
            if self._outcome is None and owner:
                self._given_up = why
            return self._outcome

    def _run(self) -> None:
        call, self._call = self._call, None  # nothing of the call outlives it here: its closure can hold a store
        assert call is not None
        try:
            outcome = run(call, self._mask)
        except BaseException as error:  # noqa: BLE001 - the waiters must not wait forever
            outcome = Outcome(FAILED, error=error)
        self._end(outcome)

    def _end(self, outcome: Outcome[T]) -> None:
        try:
            if self._on_end is not None:  # first: whoever waits finds the outcome on record
                self._on_end(outcome)
        finally:  # come what may in a callback: the call ends, and its waiters wake
            with self._lock:
                self._outcome, given_up = outcome, self._given_up
            try:
                if given_up is not None and self._on_late_end is not None:
                    self._on_late_end(outcome, given_up)
            finally:  # done once its late end is reported too: a close that waits for it returns after that
                with self._lock:
                    wake_waiters, self._wake_waiters = self._wake_waiters, []
                    self._ended.set()
                for wake in wake_waiters:
                    wake()


def _settle(ended: asyncio.Future[None]) -> None:
    if not ended.done():  # not when its wait ran out, or was cancelled
        ended.set_result(None)


class _Threads:
    """The daemon threads calls run on: an idle one takes the next call, else a new one starts."""

    def __init__(self) -> None:
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], None], str]]] = []  # the parent's threads are not here
        self._lock = threading.Lock()

    def run(self, work: Callable[[], None], name: str) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        inbox.put((work, name))

    def _serve(self, inbox: queue.SimpleQueue[tuple[Callable[[], None], str]]) -> None:
        thread = threading.current_thread()
        while True:
            try:
                work, thread.name = inbox.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                continue  # a call was handed over as the wait ended: it is in the inbox
            work()
            del work  # nothing of a call outlives it here
            with self._lock:  # named idle once it can be handed the next call
                self._idle.append(inbox)
                thread.name = IDLE_NAME


_threads = _Threads()
_owners: weakref.WeakSet[Any] = weakref.WeakSet([_threads])


def reset_in_forked_child(owner: Any) -> None:
    """Call ``owner.reset_after_fork()`` in a forked child, while ``owner`` lives: it drops the calls and connections
    of the parent's threads and makes its locks anew (one a parent's thread held would stay held)."""
    _owners.add(owner)


def _reset_owners() -> None:
    for owner in list(_owners):
        owner.reset_after_fork()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_reset_owners)

"""Where the library's blocking work runs: daemon threads, the one fork hook, and the exit wait for writes.

Every Membase call the store makes on its own (recall, captured writes, the set-up check) runs on a thread
here while its caller waits for it within a budget:

- Daemon threads, not ``asyncio.to_thread``: a synchronous ``agent("...")`` runs on a fresh ``asyncio.run``
  loop, which joins the loop's default-executor threads before it returns, so a request that outlives its
  budget would hold the call anyway. Nobody joins a daemon thread.
- Not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so one hung request would hold
  the exit for a whole SDK attempt.

A thread starts when a call comes and every thread is busy, up to :data:`MAX_THREADS`, and retires after
:data:`IDLE_SECONDS` with nothing to do. At the cap a call waits its turn, first come first served, inside
its caller's budget: a recall still fails open on time, and one whose budget ran out before its turn is
never sent. Each store's calls wait in a lane of their own and the lanes take turns, so one store's burst does
not hold up another's recall. A thread carries the name of the call it runs (``membase-recall[store]``, ...).

A forked child has none of its parent's threads, and a lock that one of them held at the fork stays held in
the child. The one ``os.register_at_fork`` hook here starts the child with fresh threads, then calls
``_after_fork_in_child()`` on every object registered with :func:`reset_after_fork` (stores, pools, the
connection pools): each takes fresh locks and forgets what its parent's threads were doing.

At interpreter exit, the one ``atexit`` hook here calls ``_finish_at_exit(started)`` on every object
registered with :func:`finish_at_exit` (the write records), so a write still running gets its bounded chance
to finish, and a line in the log if it does not.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_THREADS = 32
"""The most threads the library runs at once; past it, calls wait their turn."""
IDLE_SECONDS = 2.0
"""How long a thread waits for a call before it retires."""
IDLE_NAME = "membase-worker[idle]"
"""The name of a thread waiting for a call."""


class _Threads:
    """Daemon threads that start when every one is busy, up to the cap, and retire when idle.

    Calls wait in lanes, one per store, taken in turn: one store's burst never makes another store's recall
    wait for more than the calls already running.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._lanes: dict[Hashable, deque[list[Any]]] = {}
        self._turns: deque[Hashable] = deque()  # the lanes with calls waiting, in the order they take them
        self._waiting = 0  # calls in a lane that no thread has taken yet
        self._idle = 0  # threads waiting for a call
        self.alive = 0

    def submit(self, fn: Callable[[], T], name: str, lane: Hashable) -> Future[T]:
        future: Future[T] = Future()
        call = [fn, contextvars.copy_context(), future, name]  # the caller's context: its tracing span goes along
        with self._lock:
            if lane not in self._lanes:
                self._lanes[lane] = deque()
                self._turns.append(lane)
            self._lanes[lane].append(call)
            self._waiting += 1
            self._ready.notify()
            start = self._idle < self._waiting and self.alive < MAX_THREADS
            if start:
                self.alive += 1
        if start:
            try:
                threading.Thread(target=self._work, name=IDLE_NAME, daemon=True).start()  # named per call it takes
            except BaseException as error:
                with self._lock:
                    self.alive -= 1
                    stranded = self.alive == 0
                if stranded:  # no thread will ever take the call: it fails now, so nobody waits for it forever
                    call[0] = None
                    with contextlib.suppress(InvalidStateError):
                        future.set_exception(error)
                    raise
        return future

    def _work(self) -> None:
        thread = threading.current_thread()
        while True:
            with self._lock:
                while not self._turns:
                    self._idle += 1
                    woken = self._ready.wait(IDLE_SECONDS)
                    self._idle -= 1
                    if not woken and not self._turns:
                        self.alive -= 1
                        return
                lane = self._turns.popleft()
                calls = self._lanes[lane]
                call = calls.popleft()
                if calls:
                    self._turns.append(lane)  # its next call waits for the other lanes' turns
                else:
                    del self._lanes[lane]
                self._waiting -= 1
            thread.name = call[3]
            _run(call)
            thread.name = IDLE_NAME


def _run(call: list[Any]) -> None:
    fn, context, future, _ = call
    call.clear()  # nothing of the call outlives it here: its closure can hold a store
    if fn is None or not future.set_running_or_notify_cancel():
        return  # failed to start, or cancelled while in line
    try:
        result = context.run(fn)
    except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the future
        del fn, context
        with contextlib.suppress(InvalidStateError):
            future.set_exception(error)
    else:
        del fn, context
        with contextlib.suppress(InvalidStateError):
            future.set_result(result)


_threads = _Threads()


def submit(fn: Callable[[], T], *, name: str, lane: Hashable = None) -> Future[T]:
    """Run ``fn`` on a daemon thread named ``name``, with the caller's context variables; a future for its outcome.

    ``lane``: whose call it is (a store's own object); at the thread cap, lanes take turns.

    Raises:
        RuntimeError: No thread could be started and none is alive to take the call; the future holds it too.
    """
    return _threads.submit(fn, name, lane)


def threads_alive() -> int:
    """How many of the library's threads are alive, busy or idle."""
    return _threads.alive


async def wait_for_future(future: Future[T], timeout: float | None) -> T:
    """Await a thread's future on the running loop, for at most ``timeout`` seconds; the call is not cancelled.

    Raises:
        asyncio.TimeoutError: The budget ran out; the call keeps running (or waiting for its turn).
    """
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        # The callback stays on the future until the call ends: it must not keep the waiter (and through its
        # exception's traceback, the caller's frames: an agent, a store) alive that long.
        box = [waiter]

        def wake(_: Future[T]) -> None:
            with contextlib.suppress(RuntimeError, IndexError):  # that loop has closed, or nobody waits any more
                loop.call_soon_threadsafe(_settle, box[0], None)

        future.add_done_callback(wake)
        # A timer on the waiter rather than asyncio.wait_for, which would cancel the wrapped call.
        timer = None if timeout is None else loop.call_later(timeout, _settle, waiter, asyncio.TimeoutError())
        try:
            await waiter
        finally:
            box.clear()
            if timer is not None:
                timer.cancel()
    return future.result()


def _settle(waiter: asyncio.Future[None], error: BaseException | None) -> None:
    if not waiter.done():
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)


# --- Forked children and interpreter exit ---------------------------------------------------------

_lock = threading.Lock()
_fork_members: weakref.WeakSet[Any] = weakref.WeakSet()
_exit_members: weakref.WeakSet[Any] = weakref.WeakSet()
_held: set[Any] = set()
_exiting = False


def reset_after_fork(member: Any) -> None:
    """Call ``member._after_fork_in_child()`` in every process forked from this one while ``member`` lives.

    Held weakly. It runs in the child's only thread, before anything else: it must take no lock of its own.
    """
    with _lock:
        _fork_members.add(member)


def finish_at_exit(member: Any, *, hold: bool | None = None) -> None:
    """Call ``member._finish_at_exit(started)`` at interpreter exit while ``member`` lives.

    Held weakly; with ``hold=True`` strongly too, until ``hold=False`` (a record with batches to send again must
    live to send them, even once its store is gone).
    """
    with _lock:
        _exit_members.add(member)
        if hold:
            _held.add(member)
        elif hold is False:
            _held.discard(member)


def exiting() -> bool:
    """Whether the interpreter is exiting: a write that fails now gets no retry from the manager."""
    return _exiting


def _after_fork_in_child() -> None:
    global _threads, _lock
    _threads = _Threads()
    _lock = threading.Lock()
    _exit_members.clear()  # the parent's writes have no thread here: exit neither waits for nor reports them
    _held.clear()
    for member in list(_fork_members):
        try:
            member._after_fork_in_child()
        except Exception as error:  # noqa: BLE001 - one member's failure must not keep the others from resetting
            logger.warning("reason=<%s> | could not reset after os.fork()", type(error).__name__)


def _at_exit() -> None:
    global _exiting
    _exiting = True
    started = time.monotonic()
    with _lock:
        members = list(_exit_members)
    for member in members:
        member._finish_at_exit(started)


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
# Registered after logging's own hook (imported above): atexit runs last-in first-out, so the log still works.
atexit.register(_at_exit)

"""Where the library's blocking work runs: daemon threads, the one fork hook, and the exit wait for writes.

Daemon threads, because nobody joins them: ``asyncio.to_thread``'s are joined when a synchronous ``agent("...")``'s
``asyncio.run`` loop ends, a ``ThreadPoolExecutor``'s at interpreter exit, so a request past its budget would hold
the turn or the exit anyway. At the :data:`MAX_THREADS` cap, calls wait in a lane per store, the lanes taking turns.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

MAX_THREADS = 32  # the most threads the library runs at once; past it, calls wait their turn
IDLE_SECONDS = 2.0  # how long a thread waits for a call before it retires
IDLE_NAME = "membase-worker[idle]"  # the name of a thread waiting for a call


class _Threads:
    """Daemon threads that start when every one is busy, up to the cap, and retire when idle. A call goes to an idle
    thread's own queue (the cheapest wake-up), or at the cap into its lane, which the threads take in turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[list[Any]]] = []  # the queues of threads waiting, the last idle last
        self._lanes: dict[Hashable, deque[list[Any]]] = {}  # calls waiting for a thread; the first lane goes next
        self.alive = 0

    def submit(self, fn: Callable[[], T], name: str, lane: Hashable) -> Future[T]:
        future: Future[T] = Future()
        call = [fn, contextvars.copy_context(), future, name]  # the caller's context: its tracing span goes along
        with self._lock:
            idle = self._idle.pop() if self._idle else None  # the most recently idle one: the others may retire
            if idle is None and self.alive >= MAX_THREADS:
                self._lanes.setdefault(lane, deque()).append(call)  # the first thread to be free takes it
                return future
            if idle is None:
                self.alive += 1
        if idle is not None:
            idle.put(call)
            return future
        try:
            threading.Thread(target=self._work, args=(call,), name=name, daemon=True).start()
        except BaseException:
            with self._lock:
                self.alive -= 1
                if not self.alive:
                    raise  # no thread would ever take the call: it fails now, so nobody waits for it forever
                idle = self._idle.pop() if self._idle else None  # one may have gone idle meanwhile: it takes it
                if idle is None:
                    self._lanes.setdefault(lane, deque()).append(call)  # a busy thread takes it when it is done
            if idle is not None:
                idle.put(call)
        return future

    def _work(self, call: list[Any]) -> None:
        """Run ``call``, then the calls in line, a lane at a time; retire after :data:`IDLE_SECONDS` with none."""
        thread, inbox = threading.current_thread(), queue.SimpleQueue[list[Any]]()
        while True:
            thread.name = call[3]
            _run(call)
            thread.name = IDLE_NAME
            with self._lock:
                if self._lanes:
                    lane = next(iter(self._lanes))
                    calls = self._lanes.pop(lane)
                    call = calls.popleft()
                    if calls:
                        self._lanes[lane] = calls  # its next call waits for the other lanes' turns
                    continue
                self._idle.append(inbox)
            try:
                call = inbox.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        self.alive -= 1
                        return
                call = inbox.get()  # a call took this thread just as its wait ended: it is on its way


def _run(call: list[Any]) -> None:
    fn, context, future, _ = call
    call.clear()  # nothing of the call outlives it here: its closure can hold a store
    if future.set_running_or_notify_cancel():  # else it was cancelled while in line
        try:
            result = context.run(fn)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the future
            del fn, context  # the error's traceback holds this frame
            future.set_exception(error)
        else:
            del fn, context
            future.set_result(result)


_threads = _Threads()


def submit(fn: Callable[[], T], *, name: str, lane: Hashable = None) -> Future[T]:
    """Run ``fn`` on a daemon thread named ``name``, in the caller's context; a future for its outcome. ``lane``:
    whose call it is (a store's own object). Raises ``RuntimeError`` if no thread can start and none is alive."""
    return _threads.submit(fn, name, lane)


def threads_alive() -> int:
    """How many of the library's threads are alive, busy or idle."""
    return _threads.alive


async def wait_for_future(future: Future[T], timeout: float | None) -> T:
    """Await a thread's future on the running loop for at most ``timeout`` seconds, else raise
    ``asyncio.TimeoutError``; the call is never cancelled (it keeps running, or waiting for its turn)."""
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()  # whether the call ended in time
        # Held weakly: the callback outlives the wait, and must not keep the caller's frames (a store) alive that long.
        waiting = weakref.ref(waiter)

        def wake(_: Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(_settle, waiting, True)

        future.add_done_callback(wake)
        # A timer on the waiter, not asyncio.wait or wait_for: cheaper, and it can cancel nothing but the wait.
        timer = None if timeout is None else loop.call_later(timeout, _settle, waiting, False)
        try:
            if not await waiter:
                raise asyncio.TimeoutError
        finally:
            if timer is not None:
                timer.cancel()
    return future.result()


def _settle(waiting: weakref.ref[asyncio.Future[bool]], ended: bool) -> None:
    if (waiter := waiting()) is not None and not waiter.done():
        waiter.set_result(ended)


_lock = threading.Lock()
_fork_members: weakref.WeakSet[Any] = weakref.WeakSet()
_exit_members: weakref.WeakSet[Any] = weakref.WeakSet()
_exiting = False


def reset_after_fork(member: Any) -> None:
    """Call ``member._after_fork_in_child()`` in every child forked while ``member`` lives (held weakly). It runs
    in the child's only thread, before anything else: it must take no lock of its own."""
    with _lock:
        _fork_members.add(member)


def finish_at_exit(member: Any) -> None:
    """Call ``member._finish_at_exit(started)`` at interpreter exit if ``member`` lives then (it is held weakly)."""
    with _lock:
        _exit_members.add(member)


def exiting() -> bool:
    """Whether the interpreter is exiting: a write that fails now gets no retry from the manager."""
    return _exiting


def _after_fork_in_child() -> None:
    """In a forked child (none of the parent's threads, their locks as they were): fresh threads and locks first."""
    global _threads, _lock
    _threads = _Threads()
    _lock = threading.Lock()
    for member in list(_fork_members):  # each forgets its parent's work: exit waits only for the child's own
        member._after_fork_in_child()


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
# Registered after logging's own hook (asyncio imports logging): atexit runs last-in first-out, so the log still works.
atexit.register(_at_exit)

"""Where the library's blocking work runs, and the one lock that guards its state.

- Daemon threads, because nobody joins them: ``asyncio.to_thread``'s are joined when a synchronous ``agent("...")``'s
  loop ends, a ``ThreadPoolExecutor``'s at interpreter exit, so a request past its budget would hold either.
- Three kinds of calls, each with threads of its own: recalls may always use :data:`RECALL_THREADS` threads, so
  hung writes or tool calls never keep a recall from being sent, and closes never queue behind other stores' calls.
  At a cap, a call waits in its lane (a store's, or a user's), and the lanes take turns. A thread retires after
  :data:`IDLE_SECONDS` without a call. (A fourth kind, of one thread, is ``_http``'s watchdog.)
- :data:`LOCK` guards every piece of the library's shared state, in short sections and never across I/O. It is
  held across ``fork()``, so a child never inherits it taken; the child starts with no threads, and state a parent
  started (requests, checks, engines) is told apart by the pid that started it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import os
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

LOCK = threading.RLock()
RECALL_THREADS = 16  # threads only recalls may take
WORK_THREADS = 24  # threads for writes, tool requests and set-up checks
CLOSE_THREADS = 16  # threads for closing stores, which wait for their writes: never behind other stores' calls
IDLE_SECONDS = 2.0
IDLE_NAME = "membase-worker[idle]"
_CAPS = {"recall": RECALL_THREADS, "work": WORK_THREADS, "close": CLOSE_THREADS, "watch": 1}


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]
    name: str
    kind: str
    context: contextvars.Context = field(default_factory=contextvars.copy_context)  # the caller's: its tracing span


class _Threads:
    """The daemon threads. A call goes to an idle thread's own queue, or a new thread below its kind's cap, or in
    line; a thread that ends a call takes the next in line whose kind has room."""

    def __init__(self) -> None:
        self.idle: list[queue.SimpleQueue[_Call]] = []  # the queues of waiting threads, the last idle last
        self.running = dict.fromkeys(_CAPS, 0)
        self.lanes: dict[str, dict[Hashable, deque[_Call]]] = {kind: {} for kind in _CAPS}

    def submit(self, call: _Call, lane: Hashable) -> None:
        with LOCK:
            if self.running[call.kind] >= _CAPS[call.kind]:
                self.lanes[call.kind].setdefault(lane, deque()).append(call)
                return
            self.running[call.kind] += 1
            inbox = self.idle.pop() if self.idle else None
        if inbox is not None:
            inbox.put(call)
            return
        try:
            threading.Thread(target=self._work, args=(call,), name=call.name, daemon=True).start()
        except BaseException as error:  # typically "can't start new thread": the call fails, nobody waits forever
            with LOCK:
                self.running[call.kind] -= 1
            call.future.set_exception(error)

    def _next(self) -> _Call | None:
        """The next call in line whose kind has room (lock held), counted as running."""
        for kind, lanes in self.lanes.items():
            if lanes and self.running[kind] < _CAPS[kind]:
                lane = next(iter(lanes))
                calls = lanes.pop(lane)
                call = calls.popleft()
                if calls:
                    lanes[lane] = calls  # its next call waits for the other lanes' turns
                self.running[kind] += 1
                return call
        return None

    def _work(self, call: _Call | None) -> None:
        thread, inbox = threading.current_thread(), queue.SimpleQueue[_Call]()
        _local.resources = {}
        try:
            while call is not None:
                thread.name = call.name
                _run(call)
                thread.name = IDLE_NAME
                with LOCK:
                    self.running[call.kind] -= 1
                    call = self._next()
                    if call is None:
                        self.idle.append(inbox)
                if call is None:  # wait for one to be handed to this idle thread, or retire
                    try:
                        call = inbox.get(timeout=IDLE_SECONDS)
                    except queue.Empty:
                        with LOCK:
                            if inbox in self.idle:
                                self.idle.remove(inbox)
                                return
                        call = inbox.get()  # a call took this thread just as its wait ended: it is on its way
        finally:
            for resource in _local.resources.values():
                with contextlib.suppress(Exception):
                    resource.close()


def _run(call: _Call) -> None:
    if call.future.set_running_or_notify_cancel():
        try:
            result = call.context.run(call.fn)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the future
            call.future.set_exception(error)
        else:
            call.future.set_result(result)
    del call.fn, call.context  # nothing of the call outlives it here: its closure can hold a store


_threads = _Threads()
_local = threading.local()


def submit(
    fn: Callable[[], T], *, name: str, kind: str = "work", lane: Hashable = None, future: Future[T] | None = None
) -> Future[T]:
    """Run ``fn`` on a daemon thread named ``name``, in the caller's context. ``kind``: ``"recall"``, ``"work"`` or
    ``"close"``; ``lane``: whose call it is, for taking turns at the cap. The future (``future``, if one was made
    earlier) fails if no thread can start.

    Never call it holding :data:`LOCK`: a thread's start waits for it to run, and a finalizer run by a garbage
    collection on the new thread may take LOCK. Make the future under LOCK and submit once it is released."""
    future = Future() if future is None else future
    _threads.submit(_Call(fn, future, name, kind), lane)
    return future


def worker_resources() -> dict[Hashable, Any] | None:
    """The current library thread's own resources (each closed when it retires); ``None`` on any other thread."""
    return getattr(_local, "resources", None)


async def wait_for_future(future: Future[T], timeout: float | None) -> T:
    """Await a thread's future for at most ``timeout`` seconds, else raise ``asyncio.TimeoutError``; the call is
    never cancelled. The waiting task is held by the call until it ends, so a task nobody else holds still wakes."""
    if not future.done():
        loop, ended = asyncio.get_running_loop(), asyncio.Event()  # the event is this loop's: made for this wait

        def wake(_: Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(ended.set)

        future.add_done_callback(wake)
        await asyncio.wait_for(ended.wait(), timeout)
    return future.result()


_exit_members: weakref.WeakSet[Any] = weakref.WeakSet()
_exiting = False


def finish_at_exit(member: Any) -> None:
    """Call ``member.at_exit()`` at interpreter exit if ``member`` still lives (it is held weakly)."""
    with LOCK:
        _exit_members.add(member)


def exiting() -> bool:
    """Whether the interpreter is exiting: no manager retry will come any more."""
    return _exiting


def _at_exit() -> None:
    global _exiting
    _exiting = True
    with LOCK:
        members = list(_exit_members)
    for member in members:
        member.at_exit()


def _after_fork_in_child() -> None:
    global _threads
    _threads = _Threads()  # the parent's threads are not here; calls in line were theirs
    LOCK.release()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(before=LOCK.acquire, after_in_parent=LOCK.release, after_in_child=_after_fork_in_child)
# Registered after logging's own hook (asyncio imports logging): atexit runs last-in first-out, so the log still works.
atexit.register(_at_exit)

"""What the library keeps per process: worker threads, locks, the exit wait, and the one reset of a forked child.

- A call its caller waits for within a budget (recall, a captured write, the set-up check, closing) runs on a daemon
  thread, because nothing joins one: ``asyncio.run`` joins executor threads, and interpreter exit a
  ``ThreadPoolExecutor``'s. Every call gets a thread at once (an idle one, or a new one); each attempt ends at
  ``request_timeout`` in its socket (``_http``), and an idle thread retires after :data:`IDLE_SECONDS`.
- Every lock is an object's own, made by :func:`new_lock`, and all are held across ``fork()``: a child never
  inherits one taken. They are reentrant (a finalizer run by a garbage collection may take one on the thread that
  holds it). A fork that finds one of them taken gives back what it took and tries again, so a thread that holds one
  while it waits for another (a finalizer, a lock made inside a locked section) never deadlocks with it.
- A forked child starts with no library threads and, in one reset, runs what objects registered with
  :func:`forget_in_child`: each drops what it started in the parent (requests, clients, engines).
- At interpreter exit, objects registered with :func:`finish_at_exit` get a last wait (write records).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import gc
import inspect
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

IDLE_SECONDS = 2.0
IDLE_NAME = "membase-worker[idle]"

_locks: weakref.WeakSet[Any] = weakref.WeakSet()  # every lock new_lock() made, while it lives
_registry = threading.Lock()  # guards the registries below (and is held across fork like the others)
# What a forked child calls: each live object's method (by the object, held weakly), and module functions.
_forget_methods: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()
_forget_functions: list[Callable[[], None]] = []
_exit_members: weakref.WeakSet[Any] = weakref.WeakSet()
_exiting = False


def new_lock() -> threading.RLock:
    """A lock of the caller's own, held across ``fork()`` like every lock made here."""
    lock = threading.RLock()
    with _registry:
        _locks.add(lock)
    return lock


class _Workers:
    """The daemon threads: a call goes to an idle thread, else to a new one; one idle for ``IDLE_SECONDS`` retires."""

    def __init__(self) -> None:
        self.lock = new_lock()
        self.idle: list[queue.SimpleQueue[tuple[Callable[[], Any], Future[Any], str, contextvars.Context]]] = []

    def submit(self, fn: Callable[[], T], future: Future[T], name: str) -> None:
        call = (fn, future, name, contextvars.copy_context())  # the caller's context: its tracing span
        with self.lock:
            inbox = self.idle.pop() if self.idle else None
        if inbox is not None:
            inbox.put(call)
            return
        inbox = queue.SimpleQueue[Any]()
        inbox.put(call)  # not in the thread's arguments, which it would keep while it lives
        try:
            threading.Thread(target=self._work, args=(inbox,), name=name, daemon=True).start()
        except BaseException as error:  # typically "can't start new thread": the call fails, nobody waits forever
            future.set_exception(error)

    def _work(self, inbox: queue.SimpleQueue[Any]) -> None:
        thread, call = threading.current_thread(), inbox.get()
        while call is not None:
            fn, future, thread.name, context = call
            del call  # nothing of a call outlives it here: its closure can hold a store
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(context.run(fn))
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the future
                    future.set_exception(error)
            del fn, future, context
            thread.name = IDLE_NAME
            with self.lock:
                self.idle.append(inbox)
            try:
                call = inbox.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self.lock:
                    if inbox in self.idle:
                        self.idle.remove(inbox)
                        return
                call = inbox.get()  # a call took this thread just as its wait ended: it is on its way


_workers = _Workers()


def submit(fn: Callable[[], T], *, name: str, future: Future[T] | None = None) -> Future[T]:
    """Run ``fn`` on a daemon thread named ``name``, in the caller's context; its future (``future``, if one was made
    earlier) fails if no thread can start. Never call it holding a lock: a garbage collection on the new thread may
    run a finalizer that takes the same one."""
    future = Future() if future is None else future
    _workers.submit(fn, future, name)
    return future


async def wait_for_future(future: Future[T], timeout: float | None) -> T:
    """Await a thread's future for at most ``timeout`` seconds, else raise ``asyncio.TimeoutError``; the call is
    never cancelled. The waiting task is held by the call until it ends, so a task nobody else holds still wakes."""
    if not future.done():
        loop = asyncio.get_running_loop()
        ended = loop.create_future()  # this loop's: made for this wait

        def wake(_: Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(_settle, ended)

        future.add_done_callback(wake)
        await asyncio.wait_for(ended, timeout)
    return future.result()


def _settle(ended: asyncio.Future[None]) -> None:
    if not ended.done():  # not when its wait ran out, or was cancelled
        ended.set_result(None)


def forget_in_child(callback: Callable[[], None]) -> None:
    """Call ``callback`` in a forked child (a bound method only while its object lives): it drops what was started in
    the parent."""
    with _registry:
        if inspect.ismethod(callback):
            _forget_methods[callback.__self__] = callback.__func__
        else:
            _forget_functions.append(callback)


def finish_at_exit(member: Any) -> None:
    """Call ``member.at_exit(started)`` at interpreter exit (``started``: when the exit's wait began) if ``member``
    still lives (it is held weakly)."""
    with _registry:
        _exit_members.add(member)


def exiting() -> bool:
    """Whether the interpreter is exiting: no manager retry will come any more."""
    return _exiting


def _at_exit() -> None:
    global _exiting
    _exiting = True
    with _registry:
        members = list(_exit_members)
    started = time.monotonic()  # one start for all: their waits overlap, they do not add up
    for member in members:
        member.at_exit(started)


_held: list[Any] = []  # the locks taken for a fork
_collecting = False  # whether garbage collection was on before the fork


def _take_locks() -> None:
    global _collecting
    while True:
        _registry.acquire()
        _collecting = gc.isenabled()
        gc.disable()  # a finalizer run by a collection could want a lock another thread holds
        _held[:] = []
        for lock in list(_locks):
            if not lock.acquire(timeout=0.01):
                break
            _held.append(lock)
        else:
            return
        _release_locks()  # its holder may be waiting for one taken here: let it finish, then try again
        time.sleep(0.001)


def _release_locks() -> None:
    for lock in _held:
        lock.release()
    _held.clear()
    _registry.release()
    if _collecting:
        gc.enable()


def _reset_child() -> None:
    global _workers
    _release_locks()
    _workers = _Workers()  # the parent's threads are not here
    for function in _forget_functions:
        function()
    for member, method in list(_forget_methods.items()):
        method(member)


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(before=_take_locks, after_in_parent=_release_locks, after_in_child=_reset_child)
# Registered after logging's own hook (asyncio imports logging): atexit runs last-in first-out, so the log still works.
atexit.register(_at_exit)

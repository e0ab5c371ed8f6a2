"""Blocking Membase calls on persistent daemon worker threads, awaited with a budget from any event loop.

What runs here: captured writes, the closing of clients, and the recall and set-up check of a store
that was given its client (``client=``) or runs the local engine. A store that builds its hosted
client from a key awaits its recall on the I/O loop instead (``_io_loop``), so a server with many
users mid-turn needs no thread per request.

Why daemon threads, not ``asyncio.to_thread``: a synchronous ``agent("...")`` runs on a fresh
``asyncio.run`` loop, and ``asyncio.run`` joins the loop's default-executor threads before it
returns. A Membase request that outlives its budget would then hold the user's call anyway. A daemon
thread is joined by nobody, so a late request finishes (or fails) in the background while the turn
goes on. Nothing here is bound to one event loop, since every synchronous agent call brings a new one.

Why not a ``ThreadPoolExecutor``: its workers are joined at interpreter exit, so one hung request
would hold the process's exit for a whole SDK attempt.

Why persistent workers, not a thread per call: starting a thread costs more than a warm loopback
request (its start, the caller's loop holding the GIL until the new thread blocks, and a first
request that runs slower on a fresh stack). A call goes to a worker that is waiting for work (the
one idle for the shortest time, so the others can retire), and only when every worker is busy, or
held by a hung request, does a new worker start. There is no cap: a hung request holds its worker
and never delays anyone else's call (the in-flight guard of recall and the write record bound how
many requests can hang). A worker idle for :data:`IDLE_SECONDS` retires, so no thread outlives a
stall or a burst by more than that.

A worker carries the name of the call it runs (``membase-recall[store]``, ``membase-write[store]``,
...) so log lines and thread listings say what it does, and is named :data:`IDLE_NAME` while it
waits for work. It keeps no reference to a call once that call has ended.

There is no lock here: the idle workers are a list whose ``pop``/``append``/``remove`` are atomic,
so handing out work never waits, and a garbage-collector callback that hands out work from inside
this module's own code (the pool closes an unused store's client that way) cannot deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_SECONDS = 2.0
"""How long a worker waits for work before it retires."""
IDLE_NAME = "membase-worker[idle]"
"""The name of a worker waiting for work."""

_Task = tuple[Callable[[], Any], contextvars.Context, Future[Any], str]
"""One call: the function, the caller's context, the future to settle, and the thread name while it runs."""


class _Worker:
    """One worker thread's inbox: whoever takes the worker from the idle list puts exactly one call in it."""

    __slots__ = ("__weakref__", "inbox")

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[_Task] = queue.SimpleQueue()


class WorkerPool:
    """Daemon worker threads that start when every worker is busy and retire when idle; safe from any thread."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS) -> None:
        """Create a pool with no threads yet.

        Args:
            idle_seconds: How long a worker waits for work before it retires; ``0``: it retires as soon as
                its call ends, so every call starts a thread of its own.
        """
        self._idle_seconds = idle_seconds
        self._idle: list[_Worker] = []  # waiting for work; the last one went idle most recently
        self._live: set[_Worker] = set()
        if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
            os.register_at_fork(after_in_child=_forget_threads_in_child(self))

    @property
    def threads(self) -> int:
        """How many worker threads are alive, busy or idle."""
        return len(self._live)

    @property
    def idle(self) -> int:
        """How many worker threads are waiting for work."""
        return len(self._idle)

    def submit(self, fn: Callable[[], T], *, name: str, future: Future[T] | None = None) -> Future[T]:
        """Run ``fn`` on a worker thread named ``name`` and return a future for its outcome.

        The caller's context variables (for example the current tracing span) go with the call.
        Pass ``future`` to settle a future the caller already made (and shared) instead of a new one.

        Raises:
            RuntimeError: Every worker was busy and no new thread could be started ("can't start new
                thread"); the future is then settled with that error, so whoever shares it stops waiting.
        """
        future = future if future is not None else Future()
        task: _Task = (fn, contextvars.copy_context(), future, name)
        try:
            worker = self._idle.pop()
        except IndexError:
            pass
        else:
            worker.inbox.put(task)
            return future
        worker = _Worker()
        # Through the inbox, not the thread's arguments: a Thread keeps those until it ends.
        worker.inbox.put(task)
        self._live.add(worker)
        try:
            threading.Thread(target=self._work, args=(worker,), name=name, daemon=True).start()
        except BaseException as error:
            self._live.discard(worker)
            # No thread, so nothing would ever settle the future: settle it with the reason, so nobody waits forever.
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)
            raise
        return future

    def _work(self, worker: _Worker) -> None:
        thread = threading.current_thread()
        task: _Task | None = worker.inbox.get()
        try:
            while task is not None:
                if thread.name != task[3]:
                    thread.name = task[3]
                # Nothing of the call may outlive it here: its closure can hold a store, a client or an answer.
                # _run takes the call out of the box, so its frame holds the only reference.
                box = [task]
                task = None
                _run(box)
                thread.name = IDLE_NAME
                task = self._next_task(worker)
        finally:
            self._live.discard(worker)

    def _next_task(self, worker: _Worker) -> _Task | None:
        """The next call for this worker, or ``None`` once it has waited ``idle_seconds`` for one in vain."""
        if self._idle_seconds <= 0:
            return None
        self._idle.append(worker)
        try:
            return worker.inbox.get(timeout=self._idle_seconds)
        except queue.Empty:
            pass
        try:
            self._idle.remove(worker)
        except ValueError:
            # A caller took this worker just as its wait ended, and puts the call in its inbox right after.
            return worker.inbox.get()
        return None


def _forget_threads_in_child(pool: WorkerPool) -> Callable[[], None]:
    """After ``os.fork()`` in the child: its workers' threads do not exist there, so nothing may be handed to them."""
    ref = weakref.ref(pool)

    def forget() -> None:
        alive = ref()
        if alive is not None:
            alive._idle = []
            alive._live = set()

    return forget


def _run(box: list[_Task]) -> None:
    fn, context, future, _ = box.pop()
    try:
        if not future.set_running_or_notify_cancel():
            return  # cancelled before it started
        try:
            result = context.run(fn)
        except BaseException as error:  # noqa: BLE001 - handed to whoever awaits the future
            del fn, context  # released before whoever waits wakes up (a closure can hold a store)
            future.set_exception(error)
        else:
            del fn, context
            future.set_result(result)
    except Exception as error:  # noqa: BLE001 - a future settled by someone else must not end the worker
        logger.warning("reason=<%s> | could not settle a background call's future", type(error).__name__)


_POOL = WorkerPool()


def start_daemon(fn: Callable[[], T], *, name: str, future: Future[T] | None = None) -> Future[T]:
    """Run ``fn`` on a daemon worker thread named ``name`` (see :meth:`WorkerPool.submit`); a future for its outcome.

    Raises:
        RuntimeError: No worker was free and no thread could be started; the future is settled with it.
    """
    return _POOL.submit(fn, name=name, future=future)


def worker_threads() -> int:
    """How many of the shared pool's worker threads are alive, busy or idle."""
    return _POOL.threads


async def wait_for_future(future: Future[T], timeout: float | None) -> T:
    """Await a worker's future on the running loop, for at most ``timeout`` seconds.

    Raises:
        asyncio.TimeoutError: The budget ran out; the call keeps running.
    """
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(_release, waiter)
            except RuntimeError:
                pass  # that loop has closed: nobody is waiting for this answer any more

        future.add_done_callback(wake)
        # A timer on the waiter rather than asyncio.wait_for, which costs a quarter of the whole hand-off.
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
    return future.result()


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())

"""One event loop on one daemon thread, where hosted stores send their automatic recall.

Why: the SDK blocks, so a recall on a worker thread holds that thread for the whole request. A web
server with 200 users mid-turn against a Membase answering in 20 ms needed up to 200 threads (and the
GIL hand-offs between them cost the loop a share of its time). Awaited on one loop, the same requests
need one thread (measured in ``benchmarks/``, section 4).

The loop serves every store in the process and every caller's loop (each synchronous ``agent(...)``
brings a new one), so a request that outlives its caller's time box runs on to the end here, as it
would on a worker thread. Calls come in from any thread through :func:`submit` and go back as
``concurrent.futures.Future``; the caller's context variables (the tracing span) go with them.

The thread is started by the first call (or the first connection a pool registers for sweeping) and
retires once it has had nothing to do for :data:`IDLE_SECONDS` (no call running, no pooled connection
left open), so it is never kept alive by an idle process. While it runs it sweeps the connection pools
registered with it (:meth:`IOLoop.register_sweep`, :meth:`IOLoop.watch`) every :data:`SWEEP_SECONDS`,
closing keep-alive connections whose expiry has passed: an idle store holds no socket for much longer
than its keep-alive expiry. A blocking pool is swept on a worker thread, so a pool lock that is never
released (a forked child's copy of one its parent held) cannot stop the loop.

Host names are looked up on the library's daemon workers rather than asyncio's default executor, whose
threads are joined at interpreter exit: a hung lookup must not hold the process open.

After ``os.fork()`` the child has no such thread: it starts its own on its first call, and clients
built for the parent's loop are built again (see ``_async_http``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol, TypeVar

import httpcore

from ._workers import start_daemon

logger = logging.getLogger(__name__)

T = TypeVar("T")

THREAD_NAME = "membase-io"
"""The name of the loop's thread."""
IDLE_SECONDS = 2.0
"""How long the loop has nothing to do (no call, no open pooled connection) before its thread retires."""
SWEEP_SECONDS = 1.0
"""How often the loop closes pooled connections whose keep-alive expiry has passed."""
BLOCKING_SWEEP_WAIT = 1.0
"""The longest the loop waits for a blocking pool's sweep on its worker; a pool that takes longer is skipped."""


class Sweepable(Protocol):
    """A client with a connection pool the loop keeps tidy."""

    @property
    def open_connections(self) -> int:
        """How many connections the pool holds now (safe from any thread)."""

    async def sweep(self) -> int:
        """Close the pooled connections whose keep-alive expiry has passed; how many stay open."""

    async def retire(self) -> None:
        """The loop is stopping: close the client (it holds no open connection by then)."""


class IOLoop:
    """A lazily started event loop on a daemon thread that retires when idle; safe to call from any thread."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS, sweep_seconds: float = SWEEP_SECONDS) -> None:
        """Create the loop's holder; no thread starts until the first call.

        Args:
            idle_seconds: How long the loop has nothing to do before its thread retires.
            sweep_seconds: How often expired keep-alive connections are closed.
        """
        self._idle_seconds = idle_seconds
        self._sweep_seconds = sweep_seconds
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id: int | None = None
        self._generation = 0
        self._calls = 0  # submitted and not finished; the loop retires only at zero (read and written under the lock)
        self._pending: set[Future[Any]] = set()  # their futures, failed if the loop ever dies under them
        # The current loop's pools: replaced (under the lock) whenever a loop starts or retires.
        self._clients: weakref.WeakSet[Sweepable] = weakref.WeakSet()
        if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
            os.register_at_fork(after_in_child=_forget_loop_in_child(self))

    @property
    def generation(self) -> int:
        """Which loop is current: grows each time a new loop starts (after retiring, or in a forked child)."""
        return self._generation

    @property
    def running(self) -> bool:
        """Whether the loop's thread is running now."""
        return self._loop is not None

    def on_loop_thread(self) -> bool:
        """Whether the caller is the loop's own thread (which must never wait for the loop)."""
        return threading.get_ident() == self._thread_id

    def submit(self, make: Callable[[], Coroutine[Any, Any, T]]) -> Future[T]:
        """Run the coroutine ``make()`` on the loop (starting it if need be); a future for its outcome.

        Raises:
            RuntimeError: The loop's thread could not be started ("can't start new thread").
        """
        future: Future[T] = Future()
        context = contextvars.copy_context()
        with self._lock:
            loop = self._loop if self._loop is not None else self._start()
            self._calls += 1
            self._pending.add(future)
            generation = self._generation

        def start() -> None:
            if not future.set_running_or_notify_cancel():
                self._finished(future, generation)
                return
            try:
                # A task copies the current context when it is made: made inside the caller's, it runs in a copy.
                task = context.run(loop.create_task, make())
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits, so nobody waits forever
                self._finished(future, generation)
                future.set_exception(error)
                return
            task.add_done_callback(lambda done: self._settle(future, done, generation))

        loop.call_soon_threadsafe(start)
        return future

    def register_sweep(self, client: Sweepable) -> None:
        """Sweep ``client``'s pool while the current loop runs, and retire it with that loop (held weakly).

        Call it from a coroutine running on the loop, for a client built there.
        """
        self._clients.add(client)

    def watch(self, client: Sweepable) -> None:
        """:meth:`register_sweep` from any thread, starting the loop if need be (for a blocking client's pool).

        Raises:
            RuntimeError: The loop's thread could not be started.
        """
        with self._lock:
            if self._loop is not None and client in self._clients:
                return

        async def register() -> None:
            self._clients.add(client)  # runs on the loop: the set is that loop's

        self.submit(register)

    def _start(self) -> asyncio.AbstractEventLoop:
        """Called with the lock held."""
        # A selector loop whatever the global policy (uvloop, say): the fork reset below relies on asyncio's own.
        loop = asyncio.SelectorEventLoop()
        loop.set_default_executor(_DaemonExecutor())
        clients: weakref.WeakSet[Sweepable] = weakref.WeakSet()  # a client is bound to the loop it was built on
        thread = threading.Thread(target=self._run, args=(loop, clients), name=THREAD_NAME, daemon=True)
        try:
            thread.start()
        except BaseException:
            loop.close()
            raise
        self._loop = loop
        self._generation += 1
        self._clients = clients
        return loop

    def _run(self, loop: asyncio.AbstractEventLoop, clients: weakref.WeakSet[Sweepable]) -> None:
        with self._lock:
            self._thread_id = threading.get_ident()
        asyncio.set_event_loop(loop)
        tending = loop.create_task(self._tend(loop, clients))  # held here: a loop keeps only weak references to tasks
        try:
            loop.run_forever()
        finally:
            del tending
            stranded: set[Future[Any]] = set()
            with self._lock:
                died = self._loop is loop  # stopped some other way than by retiring (a SystemExit out of a call)
                if died:
                    # Unreachable first, so a call from now on starts a new loop with a clean count.
                    self._loop = None
                    self._clients = weakref.WeakSet()
                    self._generation += 1
                    self._calls = 0
                    stranded, self._pending = self._pending, set()
                if self._thread_id == threading.get_ident():
                    self._thread_id = None
            if died:
                _cancel_remaining(loop)  # as asyncio.run() does; the callbacks settle the calls they carried
                for future in stranded:  # and every call the loop held ends with an error, not never
                    with contextlib.suppress(InvalidStateError):
                        future.set_exception(RuntimeError("the Membase I/O loop stopped before this call ended"))
            loop.close()

    async def _tend(self, loop: asyncio.AbstractEventLoop, clients: weakref.WeakSet[Sweepable]) -> None:
        """Sweep the pools now and then; stop the loop once it has been idle long enough."""
        idle_since: float | None = None
        while True:
            await asyncio.sleep(self._sweep_seconds)
            open_connections = await _sweep_all(clients)
            now = time.monotonic()
            busy = open_connections > 0 or self._calls > 0
            idle_since = None if busy else (idle_since if idle_since is not None else now)
            if idle_since is None or now - idle_since < self._idle_seconds:
                continue
            with self._lock:
                # Checked again under the lock: a call or a connection (whose pool is already registered, so
                # watch() would not register it again) may have come since the sweep.
                if self._calls or self._loop is not loop or _open_connections(clients):
                    idle_since = None
                    continue
                self._loop = None  # from here on a new call starts a new loop; none can reach this one
                self._clients = weakref.WeakSet()  # and a pool that connects again registers with that loop
            for client in _members(clients):
                with contextlib.suppress(Exception):
                    await client.retire()
            loop.stop()
            return

    def _settle(self, future: Future[T], task: asyncio.Task[T], generation: int) -> None:
        self._finished(future, generation)
        try:
            if task.cancelled():
                future.set_exception(RuntimeError("the Membase call was cancelled: its event loop stopped"))
            elif (error := task.exception()) is not None:
                future.set_exception(error)
            else:
                future.set_result(task.result())
        except InvalidStateError:
            pass  # settled by someone else; nothing is waiting on this outcome any more

    def _finished(self, future: Future[Any], generation: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._calls -= 1
                self._pending.discard(future)


def _cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks a dead loop left and let them end (their callbacks settle the calls they carried)."""
    remaining = asyncio.all_tasks(loop)
    for task in remaining:
        task.cancel()
    with contextlib.suppress(BaseException):
        loop.run_until_complete(asyncio.gather(*remaining, return_exceptions=True))


def _members(clients: weakref.WeakSet[Sweepable]) -> list[Sweepable]:
    """The pools in ``clients`` now. A pool collected on another thread can change the set mid-copy: copy again."""
    for _ in range(3):
        try:
            return list(clients)
        except RuntimeError:
            continue
    return []


def _open_connections(clients: weakref.WeakSet[Sweepable]) -> int:
    return sum(client.open_connections for client in _members(clients))


async def _sweep_all(clients: weakref.WeakSet[Sweepable]) -> int:
    """Sweep every pool; how many connections stay open (a pool that could not be swept counts as busy)."""
    total = 0
    for client in _members(clients):
        try:
            total += await client.sweep()
        except Exception as error:  # noqa: BLE001 - one client's pool must not stop the others' sweeps
            logger.debug("reason=<%s> | could not sweep a connection pool", type(error).__name__)
            total += 1
    return total


class PoolSweep:
    """Keeps one httpcore connection pool, blocking or async, free of connections past their keep-alive expiry."""

    __slots__ = ("__weakref__", "_pool", "_sweeping")

    def __init__(self, pool: httpcore.ConnectionPool | httpcore.AsyncConnectionPool) -> None:
        """Sweep ``pool``."""
        self._pool = pool
        self._sweeping: Future[int] | None = None  # a blocking sweep still on its worker

    @property
    def open_connections(self) -> int:
        """How many connections the pool holds."""
        return len(self._pool.connections)

    async def sweep(self) -> int:
        """Close the pool's expired connections; how many stay open.

        httpcore closes them only when the pool is next used: this runs the pool's own clean-up (private,
        so a pool without it, from an httpcore before 1.0.3, is left as it is and counted as empty). A
        blocking pool is swept on a worker thread, since it takes the pool's lock.
        """
        pool = self._pool
        if isinstance(pool, httpcore.AsyncConnectionPool):
            return await _tidy_async(pool)
        if self._sweeping is not None and not self._sweeping.done():
            return self.open_connections  # the last sweep still waits for the pool's lock: not a second one
        swept = self._sweeping = start_daemon(functools.partial(_tidy_blocking, pool), name="membase-sweep")
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(swept)), BLOCKING_SWEEP_WAIT)
        except asyncio.TimeoutError:
            return self.open_connections  # its lock is held: try again at a later sweep

    async def retire(self) -> None:
        """Nothing to do: the pool outlives the loop (it is empty by the time the loop retires)."""


def _take_expired(pool: Any) -> list[Any] | None:
    """Take the pool's expired connections out of it, under its lock (httpcore's own clean-up, run now); the
    connections to close, or ``None`` for a pool without that clean-up (httpcore before 1.0.3)."""
    tidy = getattr(pool, "_assign_requests_to_connections", None)
    lock = getattr(pool, "_optional_thread_lock", None)
    if tidy is None or lock is None or not hasattr(pool, "_close_connections"):
        return None
    with lock:
        closing: list[Any] = tidy()
    return closing


async def _tidy_async(pool: httpcore.AsyncConnectionPool) -> int:
    closing = _take_expired(pool)
    if closing is None:
        return 0
    await pool._close_connections(closing)
    return len(pool.connections)


def _tidy_blocking(pool: httpcore.ConnectionPool) -> int:
    closing = _take_expired(pool)
    if closing is None:
        return 0
    pool._close_connections(closing)
    return len(pool.connections)


class _DaemonExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor (asyncio looks host names up on it): the library's daemon workers.

    A ``ThreadPoolExecutor`` only because asyncio accepts nothing else; it never starts a thread of its own.
    """

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return start_daemon(functools.partial(fn, *args, **kwargs), name="membase-resolve")


def _forget_loop_in_child(io: IOLoop) -> Callable[[], None]:
    """After ``os.fork()`` in the child: the loop's thread does not exist there, so nothing may be handed to it."""
    ref = weakref.ref(io)

    def forget() -> None:
        alive = ref()
        if alive is not None:
            parents = alive._loop
            if parents is not None and hasattr(parents, "_closed"):
                # Make the parent's loop inert here (asyncio's private flag; closing it would unregister the
                # parent's sockets): the child shares its epoll instance with the parent, and a connection of
                # the parent's collected in the child would otherwise unregister the parent's socket from it.
                parents._closed = True
            alive._lock = threading.Lock()  # a thread of the parent may have held it at the fork
            alive._loop = None
            alive._thread_id = None
            alive._calls = 0
            alive._generation += 1
            alive._clients = weakref.WeakSet()

    return forget


IO = IOLoop()
"""The process's loop: every hosted store sends its automatic recall through it."""

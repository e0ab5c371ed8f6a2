"""Blocking Membase calls on daemon threads, awaited with a budget from any event loop.

Why not ``asyncio.to_thread``: a synchronous ``agent("...")`` runs on a fresh ``asyncio.run``
loop, and ``asyncio.run`` joins the loop's default-executor threads before it returns. A
Membase request that outlives its budget would then hold the user's call anyway. A daemon thread
is joined by nobody, so a late request finishes (or fails) in the background while the turn goes
on. Nothing here is bound to one event loop, since every synchronous agent call brings a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TypeVar

T = TypeVar("T")


def start_daemon(fn: Callable[[], T], *, name: str, future: Future[T] | None = None) -> Future[T]:
    """Run ``fn`` on a new daemon thread and return a future for its outcome.

    The caller's context variables (for example the current tracing span) go with the call.
    Pass ``future`` to settle a future the caller already made (and shared) instead of a new one.

    Raises:
        RuntimeError: No thread could be started ("can't start new thread"); the future is then
            settled with that error, so whoever shares it stops waiting.
    """
    future = future if future is not None else Future()
    context = contextvars.copy_context()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = context.run(fn)
        except BaseException as error:  # noqa: BLE001 - handed to whoever awaits the future
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except BaseException as error:
        # No thread, so nothing would ever settle the future: settle it with the reason, so nobody waits forever.
        with contextlib.suppress(InvalidStateError):
            future.set_exception(error)
        raise
    return future


async def wait_for_future(future: Future[T], timeout: float | None) -> T:
    """Await a thread's future on the running loop, for at most ``timeout`` seconds.

    Raises:
        asyncio.TimeoutError: The budget ran out; the thread keeps running.
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
        await asyncio.wait_for(waiter, timeout)
    return future.result()


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)

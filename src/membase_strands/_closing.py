"""Closing a store: once, by its first caller (later callers wait for it), and a store collected unclosed too.

Closing waits for the store's captured writes (:meth:`WriteRecord.drain`) up to its own bound, then lets go of its
local engine once no write uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from concurrent.futures import Future, wait

from . import _runtime
from ._gateway import MembaseGateway
from ._runtime import wait_for_future
from ._writes import WriteRecord

# The closings of stores collected unclosed, held weakly: each is held by its thread until it ends.
_dropped_closing: weakref.WeakSet[Future[None]] = weakref.WeakSet()
_dropped_lock = _runtime.new_lock()


class Closing:
    """One store's closing; a later caller waits for the first one's up to the close bound."""

    def __init__(self, store: object, writes: WriteRecord, gateway: MembaseGateway, name: str) -> None:
        self.closed, self._lock = False, _runtime.new_lock()
        self._writes, self._gateway, self._name = writes, gateway, name
        self._done: Future[None] = Future()  # settled once the first close() or aclose() has finished
        # Dropped unclosed (a pool let go of it), the store still finishes its writes and lets go of its local engine.
        weakref.finalize(store, self._close_dropped).atexit = False  # at exit, the exit wait does it

    def close(self) -> None:
        if self._begin():
            self._finish()
        else:
            wait([self._done], timeout=self._writes.close_bound)

    async def aclose(self) -> None:
        if not self._begin():
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for_future(self._done, self._writes.close_bound)
        elif self._writes.idle() and self._gateway.local is None:
            self._finish()  # nothing to wait for
        else:
            await wait_for_future(self._finish_in_background(), None)

    def _begin(self) -> bool:
        """Mark the store closed; whether this caller is the first (and so closes it)."""
        with self._lock:
            first, self.closed = not self.closed, True
            return first

    def _finish(self) -> None:
        """Wait for the writes, then let go of the local engine once none runs (blocking)."""
        try:
            self._writes.drain(time.monotonic() + self._writes.close_bound)
            running = self._writes.running()
            if self._gateway.local is not None and running:  # a write still uses the engine: close it after them

                def close_after_writes() -> None:
                    wait(running)
                    self._gateway.close()

                _runtime.submit(close_after_writes, name="membase-close")
            else:
                self._gateway.close()
        finally:
            self._done.set_result(None)

    def _finish_in_background(self) -> Future[None]:
        return _runtime.submit(self._finish, name=f"membase-close[{self._name}]")

    def _close_dropped(self) -> None:
        # Only with writes to wait for or an engine to let go of, and unless a close began before the store was dropped.
        if (not self._writes.idle() or self._gateway.local is not None) and self._begin():
            closing = self._finish_in_background()
            with _dropped_lock:
                _dropped_closing.add(closing)


def dropped_stores_closing() -> list[Future[None]]:
    """The closings still running of stores collected unclosed (a pool's close waits for them too)."""
    with _dropped_lock:
        return list(_dropped_closing)

"""Captured writes: time-boxed, and never sent twice for the same thing.

The manager retries a write that raised: ``add_messages`` gets the same batch again (plus any
newer messages), and on the extractor path every fact of a batch goes through ``add`` again when
one of them failed. A write that ran out of budget may still succeed in the background. So this
store keeps a record of its writes by identity:

- saved: a retry does not send it again and reports success;
- still running: a retry waits for that request (within the budget) instead of sending another;
- failed: it is forgotten, so the retry sends it.

A message's identity is its sequence number in the manager's batch, the message object itself
(the manager hands the same content block objects on every retry of a batch, and a new agent run
brings new ones; the record keeps a reference to the block, so its ``id`` cannot be reused while
the record stands), and a hash of its text. A fact's identity is a hash of its text and target.
The record is bounded in size and in time.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ._counters import Counters
from ._threads import start_daemon, wait_for_future
from .errors import MembaseWriteTimeout, detail_of

logger = logging.getLogger(__name__)

RECORD_SIZE = 4096
RECORD_SECONDS = 3600.0


class _State(Enum):
    NEW = "new"
    RUNNING = "running"
    SAVED = "saved"


@dataclass(frozen=True)
class Part:
    """One thing to write: its identity, its text, and an object to keep alive while it is recorded."""

    key: Hashable
    text: str
    anchor: object = None


def fingerprint(*fields: object) -> str:
    """A compact, stable digest of some fields, for identities that must not hold whole texts."""
    return hashlib.sha256(repr(fields).encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class _Entry:
    future: Future[Any]
    anchor: object
    saved_at: float | None = None


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create an empty record.

        Args:
            store_name: The store's name, for log lines and thread names.
            counters: Where to count writes saved, deduplicated and timed out.
            redact: Masks secrets in the text of a late failure before it is logged.
            size: How many saved writes to remember at most (oldest forgotten first).
            seconds: How long to remember a saved write.
            clock: The monotonic clock (a parameter so tests can move time).
        """
        self._store_name = store_name
        self._counters = counters if counters is not None else Counters()
        self._redact = redact
        self._size = size
        self._seconds = seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

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
            Exception: Whatever ``send`` raised; those parts are forgotten so a retry sends them.
        """
        deadline = None if budget is None else self._clock() + budget
        while True:
            with self._lock:
                self._evict()
                states = {part.key: self._state(part.key) for part in parts}
                running = [self._entries[key].future for key, state in states.items() if state is _State.RUNNING]
                if not running:
                    todo = [part for part in parts if states[part.key] is _State.NEW]
                    future: Future[Any] = Future()
                    for part in todo:
                        self._entries[part.key] = _Entry(future=future, anchor=part.anchor)
                    break
            # The same thing is being saved by an earlier call: wait for that request instead of sending
            # another. If it fails, its parts count as new on the next pass and this call sends them.
            for earlier in running:
                await self._wait(earlier, deadline, "an earlier write of the same content is still running", quiet=True)
        skipped = len(parts) - len(todo)
        if skipped:
            self._counters.add("writes_deduplicated", skipped)
            logger.debug(
                "store=<%s>, already_saved=<%d> | not sending again what this store saved", self._store_name, skipped
            )
        if not todo:
            return None
        future.add_done_callback(lambda done: self._settle(todo, done))
        start_daemon(lambda: send(todo), name=f"membase-write[{self._store_name}]", future=future)
        return await self._wait(future, deadline, "it goes on in the background and the manager keeps the batch")

    async def _wait(self, future: Future[Any], deadline: float | None, what: str, *, quiet: bool = False) -> Any:
        """Wait for ``future`` until ``deadline``; with ``quiet``, its failure is not raised here."""
        remaining = None if deadline is None else max(0.0, deadline - self._clock())
        try:
            return await wait_for_future(future, remaining)
        except asyncio.TimeoutError:
            if not quiet:
                future.add_done_callback(self._log_late)
            self._counters.add("write_timeouts")
            logger.warning(
                "store=<%s>, reason=<write ran out of time> | Membase write ran out of time; %s", self._store_name, what
            )
            raise MembaseWriteTimeout(f"Membase write ran out of time; {what}") from None
        except Exception:
            if not quiet:
                raise
            return None

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the writes still running; whether none is left."""
        with self._lock:
            running = {entry.future for entry in self._entries.values() if not entry.future.done()}
        if running:
            logger.info("store=<%s>, writes=<%d> | waiting for writes still running", self._store_name, len(running))
        return not wait(running, timeout=timeout).not_done

    def _log_late(self, done: Future[Any]) -> None:
        error = done.exception()
        if error is None:
            logger.info("store=<%s> | a write that ran out of time finished; it is saved", self._store_name)
        else:
            logger.warning(
                "store=<%s>, reason=<%s> | a write that ran out of time failed; the manager's retry sends it again",
                self._store_name,
                self._redact(detail_of(error)),
            )

    def _state(self, key: Hashable) -> _State:
        """Whether ``key`` is new, running or saved. Called with the lock held.

        Decided from the request's own future, not only from :meth:`_settle`: a future counts as
        done before its callbacks have run, and a write that failed must never pass for saved.
        """
        entry = self._entries.get(key)
        if entry is None:
            return _State.NEW
        if not entry.future.done():
            return _State.RUNNING
        if entry.future.exception() is not None:
            del self._entries[key]
            return _State.NEW
        return _State.SAVED

    def _settle(self, parts: list[Part], done: Future[Any]) -> None:
        failed = done.exception() is not None
        if not failed:
            self._counters.add("writes_saved", len(parts))
        now = self._clock()
        with self._lock:
            for part in parts:
                entry = self._entries.get(part.key)
                if entry is None or entry.future is not done:
                    continue
                if failed:
                    del self._entries[part.key]
                elif entry.saved_at is None:
                    entry.saved_at = now
                    self._entries.move_to_end(part.key)

    def _evict(self) -> None:
        """Forget saved writes past their time, then the oldest saved ones past the size bound."""
        cutoff = self._clock() - self._seconds
        saved = [key for key, entry in self._entries.items() if entry.saved_at is not None]
        excess = len(self._entries) - self._size
        for key in saved:
            entry = self._entries[key]
            if excess > 0 or (entry.saved_at is not None and entry.saved_at < cutoff):
                del self._entries[key]
                excess -= 1

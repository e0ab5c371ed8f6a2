"""Captured writes: time-boxed, stored at most once, never lost without a word (docs/writes.md: the resend rule).

A write runs as a ``Call`` while its caller waits at most ``write_timeout``; past it the write goes on in the
background, and the manager retries a write that raised. So the record keeps a store's writes by identity: a retry
of a part saved (or that may have arrived) sends nothing, of a part being sent waits for that request, of a part that
failed for sure sends it again. A write nobody waits for any more logs how it ended; closing and interpreter exit
wait up to ``close_timeout`` for the writes still running.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import membase
from strands.types.content import Message

from ._calls import ANSWERED, MAY_HAVE_ARRIVED, Call, Outcome, reset_in_forked_child
from ._failures import LEVEL, Refused
from ._gateway import MembaseGateway
from .errors import MembaseAccessError, MembaseWriteTimeout

RECORD_SIZE = 4096  # parts saved (or of unknown fate) remembered, at most
RECORD_SECONDS = 3600.0  # and for at most this long
RECORD_BYTES = 1024 * 1024  # the most message text (bytes of str objects) the record holds alive
RETRY_ONLY = "it is not saved, and only the manager's retry sends it again (if its agent lives on)"
UNKNOWN_FATE = (
    "Membase may or may not have saved it (no whole answer came back after it was sent); it is not sent again, so "
    "it is never saved twice"
)


@dataclass(frozen=True)
class Part:
    """One thing to write: its identity, its text, and for a message its first text block, held while the record
    remembers the part so that the ``id()`` in its key is not reused meanwhile (``block_bytes``: the text it holds)."""

    key: Hashable
    text: str
    block: object = None
    block_bytes: int = 0


Send = Callable[[list[Part]], Any]  # makes the blocking request for the parts that still need it


def fingerprint(*fields: object) -> str:
    """A compact, stable digest of some fields, for identities that must not hold whole texts."""
    return hashlib.sha256(repr(fields).encode("utf-8", "surrogatepass")).hexdigest()


def message_parts(messages: list[Message], sequence_numbers: list[int] | None, roles: tuple[str, ...]) -> list[Part]:
    """A batch's captured lines (each message of ``roles``, after its role if both are) keyed to survive retries."""
    numbers = sequence_numbers if sequence_numbers and len(sequence_numbers) == len(messages) else None
    parts = []
    for index, message in enumerate(messages):
        blocks = [block for block in message.get("content", []) if "text" in block]
        text = "\n".join(block["text"] for block in blocks).strip()
        role = message.get("role")
        if role not in roles or not text:
            continue
        # The same object on every retry of the batch, new in a new run; held by the record, so its id stays unique.
        block = blocks[0]
        key = fingerprint("message", numbers[index] if numbers else None, id(block), role, text)
        line = f"{role}: {text}" if len(roles) > 1 else text
        parts.append(Part(key=key, text=line, block=block, block_bytes=sys.getsizeof(block["text"])))
    return parts


@dataclass(frozen=True)
class _Saved:
    """What the record keeps of a part saved, or sent with an unknown fate: not the request or its answer."""

    block: object
    block_bytes: int
    at: float


_records: weakref.WeakSet[WriteRecord] = weakref.WeakSet()  # for the exit's wait


class WriteRecord:
    """The writes one store started, by identity; safe to share between threads and event loops. ``budget``: the
    seconds a write may hold its caller (``None``: one whole request)."""

    def __init__(self, gateway: MembaseGateway, budget: float | None, close_timeout: float) -> None:
        self._gateway, self._log, self._budget, self.close_timeout = gateway, gateway.log, budget, close_timeout
        self._lock = threading.Lock()
        self._saved: dict[Hashable, _Saved] = {}  # parts saved or of unknown fate, oldest first
        self._running: dict[Hashable, tuple[Part, Call[Any]]] = {}  # parts being sent, each with the call sending it
        self._started: weakref.WeakSet[Call[Any]] = weakref.WeakSet()  # for closing to wait for: each until done
        self._retry_expected: set[Hashable] = set()  # the newest late save's parts: the manager may retry them
        _records.add(self)
        reset_in_forked_child(self)

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's running writes are not this process's to wait for, and their fate is
        unknown here, so they are never sent again."""
        now = time.monotonic()
        for key, (part, _) in self._running.items():
            self._saved.setdefault(key, _Saved(part.block, part.block_bytes, now))
        self._lock, self._running, self._started = threading.Lock(), {}, weakref.WeakSet()

    async def write(self, parts: Sequence[Part], send: Send) -> Any:
        """Send the parts not sent yet as one request, within the budget; what ``send`` returned, or ``None`` when
        none needed sending. Raises ``MembaseWriteTimeout`` past the budget (the request goes on), or its failure."""
        keys = {part.key for part in parts}
        deadline = None if self._budget is None else time.monotonic() + self._budget
        while True:
            with self._lock:
                self._evict()
                earlier = next((self._running[key][1] for key in keys if key in self._running), None)
                if earlier is None:
                    self._retry_expected -= keys  # the retry has come
                    todo = [part for part in parts if part.key not in self._saved]
                    call = self._new_call(todo, send) if todo else None
                    break
            # An earlier call is sending some of them: wait for it; what it fails to send is new on the next pass.
            try:
                waited = await self._wait(earlier, deadline, owner=False)
            except asyncio.CancelledError:
                self._lost_unsent(parts)
                raise
            if waited is None:
                self._timed_out("an earlier write of the same content is still running")
        if deduplicated := len(parts) - len(todo):
            self._log.count("writes_deduplicated", amount=deduplicated)
            self._log.log(logging.DEBUG, "not sending again what this store saved (or may have saved) already")
        self._log.annotate(sent=len(todo), deduplicated=deduplicated)
        if call is None:
            return None
        call.start()
        outcome = await self._wait(call, deadline, owner=True)
        if outcome is None:
            self._timed_out("it goes on in the background")
        return self._result(outcome)

    def drain(self, deadline: float) -> None:
        """Wait for the running writes until the monotonic time ``deadline``, then say how many were still running."""
        announced: set[Call[Any]] = set()
        while running := self._running_calls():
            if (left := deadline - time.monotonic()) <= 0:
                message = (
                    f"writes still running when closing stopped waiting after {self.close_timeout:g} s: not confirmed "
                    "saved, and lost if the process ends now"
                )
                self._log.log(logging.WARNING, message, writes=len(running))
                return
            if new := running - announced:
                self._log.log(logging.INFO, "waiting for writes still running", writes=len(new))
                announced |= new
            next(iter(running)).wait_blocking(left, owner=False)

    def _running_calls(self) -> set[Call[Any]]:
        with self._lock:
            return {call for call in self._started if not call.done()}

    def _new_call(self, todo: list[Part], send: Send) -> Call[Any]:
        """The call that sends ``todo``, its parts marked as being sent (lock held; started outside it)."""
        call = self._gateway.new_call(
            lambda: send(todo),
            name=f"membase-write[{self._log.store_name}]",
            on_end=lambda outcome: self._ended(todo, outcome),
            on_late_end=lambda outcome, why: self._ended_late(todo, outcome, why),
        )
        for part in todo:
            self._running[part.key] = (part, call)
        self._started.add(call)
        return call

    async def _wait(self, call: Call[Any], deadline: float | None, *, owner: bool) -> Outcome[Any] | None:
        try:
            return await call.wait(None if deadline is None else max(0.0, deadline - time.monotonic()), owner=owner)
        except asyncio.CancelledError:  # the call goes on, and reports its end
            self._log.count("write_cancellations")
            self._log.log(logging.INFO, "the caller stopped waiting for a Membase write; it goes on in the background")
            raise

    def _lost_unsent(self, parts: Sequence[Part]) -> None:
        """Say so when a caller cancelled while it waited leaves words no request carries (no retry will come)."""
        with self._lock:
            unsent = [part for part in parts if part.key not in self._saved and part.key not in self._running]
        if unsent:
            self._log.count("writes_lost", amount=len(unsent))
            message = "a write whose caller was cancelled before it was sent: its words are not saved"
            self._log.log(logging.WARNING, message, parts=len(unsent))

    def _timed_out(self, what: str) -> NoReturn:
        message = f"Membase write ran out of time; {what}"
        self._log.count("write_timeouts")
        self._log.annotate(outcome="timeout")
        self._log.log(logging.INFO, message)
        raise MembaseWriteTimeout(message)

    def _result(self, outcome: Outcome[Any]) -> Any:
        """What the caller gets of a write it waited for: its answer, or its failure raised (counted)."""
        if outcome.kind == ANSWERED:
            self._log.annotate(outcome="saved")
            return outcome.value
        error = outcome.error
        assert error is not None
        self._log.annotate(outcome="error", error_kind=self._log.failed(error, "write_errors"))
        if isinstance(error, Refused):
            if error.refusal != LEVEL:  # the gateway says a refusal above the key's level, once
                self._log.log(logging.WARNING, "write refused by Membase", error=error)
            raise MembaseAccessError(error.message, error.refusal) from error
        if outcome.kind == MAY_HAVE_ARRIVED and isinstance(error, membase.MembaseError):
            self._log.count("writes_unknown")
            self._log.log(logging.WARNING, f"a captured write's fate is unknown: {UNKNOWN_FATE}", error=error)
            said = type(error)(f"{error.message}: {UNKNOWN_FATE}", status=error.status)  # what the manager shows
            raise said from error
        raise error

    def _ended(self, todo: list[Part], outcome: Outcome[Any]) -> None:
        """Put how a write ended on record (on its thread, before anyone waiting for it hears)."""
        with self._lock:
            now = time.monotonic()
            for part in todo:
                self._running.pop(part.key, None)
                if outcome.kind in (ANSWERED, MAY_HAVE_ARRIVED):  # kept past the bounds until the next write evicts
                    self._saved[part.key] = _Saved(part.block, part.block_bytes, now)
        if outcome.kind == ANSWERED:
            self._log.count("writes_saved", amount=len(todo))

    def _ended_late(self, todo: list[Part], outcome: Outcome[Any], why: str) -> None:
        """Log and count how a write ended that nobody waited for any more (``why``: ``"timeout"``, ``"cancelled"``)."""
        what = "a write that ran out of time" if why == "timeout" else "a write whose caller was cancelled"
        error = outcome.error
        if outcome.kind in (ANSWERED, MAY_HAVE_ARRIVED):
            with self._lock:  # spared by eviction: the manager's retry of them is the one to stop
                self._retry_expected = {part.key for part in todo}
                self._evict()
        if error is None:
            self._log.log(logging.INFO, f"{what} finished; it is saved", reason=why)
        elif outcome.kind == MAY_HAVE_ARRIVED:
            self._log.failed(error, "writes_unknown")
            self._log.log(logging.WARNING, f"{what} ended without an answer: {UNKNOWN_FATE}", error=error)
        elif why == "timeout":  # the manager keeps the batch for a retry, if its agent lives on; the store does not
            self._log.failed(error, "write_errors")
            self._log.log(logging.WARNING, f"{what} failed; {RETRY_ONLY}", error=error)
        else:  # cancelled: the manager counted the batch as handled, so nothing sends it again
            self._log.failed(error, "write_errors")
            self._log.count("writes_lost", amount=len(todo))  # by part, as writes_saved counts
            self._log.log(logging.WARNING, f"{what} failed; it is not saved, and nothing sends it again", error=error)

    def _evict(self) -> None:
        """Forget saved parts past their time, then the oldest past the bounds, but the newest late save's (locked)."""
        cutoff = time.monotonic() - RECORD_SECONDS
        excess = len(self._saved) - RECORD_SIZE
        excess_bytes = sum(saved.block_bytes for saved in self._saved.values()) - RECORD_BYTES
        for key, saved in list(self._saved.items()):
            if saved.at < cutoff or ((excess > 0 or excess_bytes > 0) and key not in self._retry_expected):
                del self._saved[key]
                excess -= 1
                excess_bytes -= saved.block_bytes


@atexit.register  # after logging's own hook (logging is imported first): atexit runs last in, first out
def _wait_at_exit() -> None:
    """Wait for every store's writes still running, each up to its ``close_timeout`` from one start (they overlap)."""
    started = time.monotonic()
    for record in list(_records):
        if record._running_calls():
            message = f"the interpreter is exiting; waiting up to {record.close_timeout:g} s for writes still running"
            record._log.log(logging.INFO, message)
            record.drain(started + record.close_timeout)

"""Captured writes: time-boxed, stored at most once, never lost without a word.

A write past its budget goes on in the background and may still succeed, and the manager retries a write that
raised, so the record keeps a store's writes by identity. A retry of a part saved sends nothing; of a part being
sent, waits for that request; of a part whose request failed for sure (Membase answered with an error, or no
connection could be made: ``_http.may_have_arrived``), sends it again. A part whose fate is unknown (its request may
have been read, then the connection broke or the time ran out) is never sent again: Membase may have saved it, and an
unkeyed note sent twice is stored twice. It is logged once as unknown, and retries of it send nothing.

A write nobody waits for any more (its caller's budget ran out, or it was cancelled) that then fails for sure is kept
and sent once more: with the store's next write, when it closes, or at interpreter exit. A manager retry of a kept part
takes its place, so the part is still sent once. Closing waits up to its own bound, and says how many writes were
still running when it stopped waiting.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
import time
from collections.abc import Callable, Collection, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from strands.types.content import Message

from . import _runtime, _telemetry
from ._http import may_have_arrived
from ._runtime import wait_for_future
from .errors import MembaseWriteTimeout

RECORD_SIZE = 4096  # parts saved (or of unknown fate) remembered, at most
RECORD_SECONDS = 3600.0  # and for at most this long
RECORD_BYTES = 1024 * 1024  # the most message text (bytes of str objects) remembered anchors and kept batches hold
_WHY = {
    "timeout": "that ran out of time",
    "cancelled": "whose caller was cancelled",
    "sent again": "the store sent again",
}
UNKNOWN_FATE = (
    "Membase may or may not have saved it (no whole answer came back after it was sent); it is not sent again, so "
    "it is never saved twice"
)


@dataclass(frozen=True)
class Part:
    """One thing to write: its identity, its text, and an anchor the record holds while it remembers the part (a
    message's content block, so the ``id`` in its key cannot be reused meanwhile) with the bytes of text it holds."""

    key: Hashable
    text: str
    anchor: object = None
    anchor_bytes: int = 0


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
        anchor = blocks[0]
        key = fingerprint("message", numbers[index] if numbers else None, id(anchor), role, text)
        line = f"{role}: {text}" if len(roles) > 1 else text
        parts.append(Part(key=key, text=line, anchor=anchor, anchor_bytes=sys.getsizeof(anchor["text"])))
    return parts


def _size(parts: list[Part]) -> int:
    return sum(part.anchor_bytes or len(part.text) for part in parts)


class _Request:
    """A request the record started: ``outcome`` is its thread's, ``settled`` is set once that is on record and
    reported. ``abandoned``: why no caller waits for its outcome any more (a key of ``_WHY``), so its thread reports
    it; ``None`` while a caller waits."""

    def __init__(self, parts: list[Part], send: Send, abandoned: str | None = None) -> None:
        self.parts, self.send, self.abandoned = parts, send, abandoned
        self.outcome: Future[Any] = Future()
        self.settled: Future[None] = Future()
        self.linked = _telemetry.link_here()  # the span of the write that started it, for a late outcome's span


@dataclass(frozen=True)
class _Sent:
    """What the record keeps of a part saved, or sent with an unknown fate: not the request or its answer."""

    anchor: object
    anchor_bytes: int
    at: float


class WriteRecord:
    """The writes one store started, by identity; safe to share between threads and event loops. ``budget``: the
    seconds a write may hold its caller (``None``: one whole request); ``close_bound``: how long closing waits."""

    def __init__(self, ledger: _telemetry.Ledger, budget: float | None, close_bound: float) -> None:
        self._ledger, self._budget, self.close_bound = ledger, budget, close_bound
        self._lock = _runtime.new_lock()
        self._sent: dict[Hashable, _Sent] = {}  # parts saved or of unknown fate, oldest first
        self._awaited: set[Hashable] = set()  # the newest late save's parts, whose manager retry may be on its way
        self._unsettled: set[_Request] = set()  # started, and not settled yet
        self._kept: list[_Request] = []  # failed for sure with nobody left to wait for them: sent again once
        self._resends = "with its next write or when it closes"  # when the store sends a kept batch again
        _runtime.finish_at_exit(self)
        _runtime.forget_in_child(self._forget_parent_requests)

    def _forget_parent_requests(self) -> None:
        self._unsettled, self._kept = set(), []  # a forked child: their threads are the parent's, which sends its own

    async def write(self, parts: Sequence[Part], send: Send) -> Any:
        """Send the parts not sent yet as one request, within the budget; what ``send`` returned, or ``None`` when
        every part was saved (or sent with an unknown fate) already. Raises ``MembaseWriteTimeout`` when the budget
        runs out (the request goes on in the background), or what ``send`` raised."""
        keys = {part.key for part in parts}
        self._send_kept(without=keys)  # a kept part written again is sent by this write
        deadline = None if self._budget is None else time.monotonic() + self._budget
        while True:
            with self._lock:
                self._evict()
                sending = self._sending()
                earlier = next((sending[key] for key in keys if key in sending), None)
                if earlier is None:
                    self._awaited -= keys  # the retry has come
                    todo = [part for part in parts if part.key not in self._sent]
                    request = _Request(todo, send) if todo else None
                    if request is not None:
                        self._unsettled.add(request)
                    break
            # An earlier call is sending some of them: wait for it; what it fails to send is new on the next pass.
            try:
                await self._wait(earlier, deadline, own=False)
            except asyncio.CancelledError:  # what is not sent by then is sent with the next write
                self._keep(_Request(list(parts), send))
                raise
        deduplicated = len(parts) - len(todo)
        if deduplicated:
            self._ledger.count("writes_deduplicated", amount=deduplicated)
            self._ledger.log(logging.DEBUG, "not sending again what this store saved (or may have saved) already")
        decision = "send" if not deduplicated else "partial" if todo else "already saved"
        _telemetry.mark(None, sent=len(todo), deduplicated=deduplicated, decision=decision)
        if request is None:
            return None
        self._start(request)
        await self._wait(request, deadline, own=True)
        if (error := request.outcome.exception()) is not None and may_have_arrived(error):
            self._ledger.count("writes_unknown")  # the error raised below is counted as such
            self._ledger.log(logging.WARNING, f"a captured write's fate is unknown: {UNKNOWN_FATE}", error=error)
        return request.outcome.result()  # raises what send raised

    def running(self) -> list[Future[None]]:
        """The writes not settled yet (each settles once its outcome is on record and reported)."""
        with self._lock:
            return [request.settled for request in self._unsettled]

    def idle(self) -> bool:
        """Whether no write is running or kept: closing has nothing to wait for."""
        with self._lock:
            return not self._unsettled and not self._kept

    def drain(self, deadline: float) -> None:
        """Close the record: wait for the running writes, then send the kept batches once and wait for those, until
        the monotonic time ``deadline``; then say how many were still running."""
        self._resends = "before it closes"
        self._wait_running(deadline)
        self._resends = "at interpreter exit"  # what fails for sure from now on
        self._send_kept()
        self._wait_running(deadline)
        if left := len(self.running()):
            message = (
                f"writes still running when closing stopped waiting after {self.close_bound:g} s: not confirmed "
                "saved, and lost if the process ends now"
            )
            self._ledger.log(logging.WARNING, message, writes=left)

    def at_exit(self, started: float) -> None:
        """The interpreter's last wait for this record's writes, from ``started`` (``_runtime`` calls it)."""
        if not self.idle():
            message = f"the interpreter is exiting; waiting up to {self.close_bound:g} s for writes still running"
            self._ledger.log(logging.INFO, message)
            self.drain(started + self.close_bound)

    def _wait_running(self, deadline: float) -> None:
        """Wait while writes run, until ``deadline``: a thread may start one meanwhile."""
        announced: set[Future[None]] = set()
        while (running := self.running()) and (left := deadline - time.monotonic()) > 0:
            if new := [future for future in running if future not in announced]:
                self._ledger.log(logging.INFO, "waiting for writes still running", writes=len(new))
                announced.update(new)
            wait(running, timeout=left, return_when=FIRST_COMPLETED)

    async def _wait(self, request: _Request, deadline: float | None, *, own: bool) -> None:
        """Wait for ``request`` until ``deadline``; if its ``own`` caller gives up, its thread reports the outcome."""
        try:
            await wait_for_future(request.settled, None if deadline is None else deadline - time.monotonic())
        except asyncio.TimeoutError:
            if own and not self._let_go(request, "timeout"):
                return  # it ended as the budget ran out: its caller takes the outcome
            what = "it goes on in the background" if own else "an earlier write of the same content is still running"
            message = f"Membase write ran out of time; {what}"
            self._ledger.count("write_timeouts")
            _telemetry.mark("timeout")
            self._ledger.log(logging.INFO, message)
            raise MembaseWriteTimeout(message) from None
        except asyncio.CancelledError:
            message = "the caller stopped waiting for a Membase write; it goes on in the background"
            self._ledger.count("write_cancellations")
            _telemetry.mark("cancelled")
            self._ledger.log(logging.INFO, message)
            if own and not self._let_go(request, "cancelled") and request.outcome.exception() is not None:
                self._report(request, "cancelled")  # it failed just before: nobody else reports it
            raise

    def _let_go(self, request: _Request, why: str) -> bool:
        """Leave the report of ``request``'s outcome to its thread; False if it has ended already."""
        with self._lock:  # its thread reads ``abandoned`` under it, once the outcome is set
            running = not request.outcome.done()
            if running:
                request.abandoned = why
            return running

    def _sending(self) -> dict[Hashable, _Request]:
        """The requests not settled yet, by the keys of their parts (lock held)."""
        return {part.key: request for request in self._unsettled for part in request.parts}

    def _start(self, request: _Request) -> None:
        """Send ``request`` on a library thread; if none can start, its outcome is that failure, at once."""
        request.outcome.add_done_callback(lambda _: self._ended(request))
        name = f"membase-write[{self._ledger.store_name}]"
        _runtime.submit(lambda: request.send(list(request.parts)), name=name, future=request.outcome)

    def _ended(self, request: _Request) -> None:
        """Put ``request``'s outcome on record, report it if nobody waits for it, then settle it."""
        error = request.outcome.exception()
        try:
            with self._lock:
                why = request.abandoned  # from now on, who reports it is settled
                if error is None or may_have_arrived(error):
                    now = time.monotonic()
                    for part in request.parts:
                        self._sent[part.key] = _Sent(part.anchor, part.anchor_bytes, now)
                    if why is not None:
                        self._awaited = {part.key for part in request.parts}
                    self._evict()
            if error is None:
                self._ledger.count("writes_saved", amount=len(request.parts))
            if why is not None:
                self._report(request, why)
        finally:
            with self._lock:
                self._unsettled.discard(request)
            request.settled.set_result(None)

    def _report(self, request: _Request, why: str) -> None:
        """Log, count and trace the outcome of a request nobody waits for; keep one that failed for sure."""
        error, what = request.outcome.exception(), f"a write {_WHY[why]}"
        counted: tuple[str, ...] = ("write_errors",)
        if error is None:
            message, counted = f"{what} finished; it is saved", ()
        elif may_have_arrived(error):
            message, counted = f"{what} ended without an answer: {UNKNOWN_FATE}", ("writes_unknown",)
        elif why == "sent again" or _runtime.exiting() or _size(request.parts) > RECORD_BYTES:
            self._ledger.count("writes_lost", amount=len(request.parts))
            message = f"{what} failed; it is not saved, and nothing will send it again"
        else:
            self._keep(request)
            message = f"{what} failed; the store sends it again {self._resends}"
        level = logging.INFO if error is None else logging.WARNING
        self._ledger.late(
            _telemetry.WRITE_LATE,
            request.linked,
            "saved",
            *counted,
            level=level,
            message=message,
            error=error,
            reason=why,
        )

    def _keep(self, request: _Request) -> None:
        """Keep a batch nobody will retry, to send it again; the oldest kept ones make room."""
        with self._lock:
            self._kept.append(request)
            dropped = []
            while sum(_size(each.parts) for each in self._kept) > RECORD_BYTES:
                dropped.append(self._kept.pop(0))
        for lost in dropped:
            message = f"a failed write kept for sending again was dropped to stay within {RECORD_BYTES} bytes"
            self._ledger.count("writes_lost", amount=len(lost.parts))
            self._ledger.log(logging.WARNING, message)

    def _send_kept(self, without: Collection[Hashable] = ()) -> None:
        """Send each kept batch once more in the background, but the parts sent, being sent, or in an earlier kept
        batch."""
        with self._lock:
            kept, self._kept = self._kept, []
            taken, requests = {*without, *self._sending()}, []  # and the sent ones
            for old in kept:
                if parts := [part for part in old.parts if part.key not in taken and part.key not in self._sent]:
                    requests.append(_Request(parts, old.send, "sent again"))
                    taken.update(part.key for part in parts)
            self._unsettled.update(requests)
        for request in requests:
            self._ledger.count("writes_sent_again", amount=len(request.parts))
            self._start(request)

    def _evict(self) -> None:
        """Forget sent parts past their time, then the oldest past the size and byte bounds, but not the newest late
        save's: the manager's retry of a batch whose write ran out of time is the one to stop (lock held)."""
        cutoff = time.monotonic() - RECORD_SECONDS
        excess = len(self._sent) - RECORD_SIZE
        excess_bytes = sum(sent.anchor_bytes for sent in self._sent.values()) - RECORD_BYTES
        for key, sent in list(self._sent.items()):
            if sent.at < cutoff or ((excess > 0 or excess_bytes > 0) and key not in self._awaited):
                del self._sent[key]
                excess -= 1
                excess_bytes -= sent.anchor_bytes

"""Captured writes: time-boxed, never sent twice for the same thing, never lost without a word.

A write past its budget goes on in the background and may still succeed, and the manager retries a write that
raised, so the record keeps a store's writes by identity: a retry of a saved part sends nothing, of a running one
waits for it, of a failed one sends it again. A write whose caller stopped waiting (its budget ran out, or it was
cancelled) and that then fails is kept, and the store sends it once more: with its next write, when it closes, or
at interpreter exit. A manager retry of a kept part takes its place, so the part is still sent once.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from strands.types.content import Message

from . import _background, _options, _telemetry
from ._background import LOCK, wait_for_future
from .errors import MembaseWriteTimeout

RECORD_SIZE = 4096  # saved parts remembered, at most
RECORD_SECONDS = 3600.0  # and for at most this long
RECORD_BYTES = 1024 * 1024  # the most message text (bytes of str objects) saved anchors and kept batches keep alive
_WHY = {
    "timeout": "that ran out of time",
    "cancelled": "whose caller was cancelled",
    "sent again": "the store sent again",
}


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


class _Request:
    """A request the record started: ``outcome`` is its thread's, ``settled`` is set once that is on record and
    reported."""

    def __init__(self, parts: list[Part], send: Send, *, again: bool = False) -> None:
        self.parts, self.send = parts, send
        self.size = sum(part.anchor_bytes or len(part.text) for part in parts)
        self.outcome: Future[Any] = Future()
        self.settled: Future[None] = Future()
        self.ended = False  # its outcome is on record (set under LOCK with the saved parts)
        # Why no caller waits for its outcome any more (a key of _WHY), which its thread then reports; None: a caller
        # waits; "sent again": a kept batch, sent a last time.
        self.abandoned: str | None = "sent again" if again else None
        self.linked = _telemetry.link_here()  # the span of the write that started it, for a late outcome's span


@dataclass
class _Saved:
    """What the record keeps of a saved part: not the request or its answer."""

    anchor: object
    anchor_bytes: int
    at: float
    late: int  # which late save, while its caller was told it failed and no retry has come yet (else 0)


class WriteRecord:
    """The writes one store started, by identity; safe to share between threads and event loops. ``budget``: the
    seconds a write may hold its caller (``None``: one whole request), and that closing waits for running writes."""

    def __init__(self, ledger: _telemetry.Ledger, budget: float | None) -> None:
        self._ledger, self._budget = ledger, budget
        self.wait_budget = budget or _options.WAIT_WITHOUT_BUDGET  # how long closing waits, each time
        self._saved: dict[Hashable, _Saved] = {}  # oldest save first
        self._late_saves = itertools.count(1)
        self._unsettled: set[_Request] = set()  # started, and not settled yet
        self._kept: list[_Request] = []  # failed with nobody left to wait for them: sent again once
        self._resends = "with its next write or when it closes"  # when the store sends a kept batch again
        self._pid = os.getpid()  # the process that started the requests above: a forked child forgets them
        _background.finish_at_exit(self)

    async def write(self, parts: Sequence[Part], send: Send) -> Any:
        """Send the parts not saved yet as one request, within the budget; what ``send`` returned, or ``None`` when
        every part was saved already. Raises ``MembaseWriteTimeout`` when the budget runs out (the request goes on
        in the background), or what ``send`` raised (those parts are forgotten, so a retry sends them)."""
        self._send_kept(without={part.key for part in parts})  # a kept part written again is sent by this write
        deadline = None if self._budget is None else time.monotonic() + self._budget
        while True:
            with LOCK:
                self._evict()
                sending = self._sending()
                earlier = next((sending[part.key] for part in parts if part.key in sending), None)
                if earlier is None:
                    todo = [part for part in parts if part.key not in self._saved]
                    request = _Request(todo, send) if todo else None
                    if request is not None:
                        self._unsettled.add(request)
                    break
            # An earlier call is sending some of them: wait for it; what it fails to save is new on the next pass.
            try:
                await self._wait(earlier, deadline, own=False)
            except asyncio.CancelledError:  # what is not saved by then is sent with the next write
                self._keep(_Request(list(parts), send))
                raise
        saved = len(parts) - len(todo)
        decision = "send" if not saved else "partial" if todo else "already saved"
        if saved:
            message = "not sending again what this store saved"
            self._ledger.record(None, "writes_deduplicated", amount=saved, level=logging.DEBUG, message=message)
        self._ledger.record(None, sent=len(todo), deduplicated=saved, decision=decision)
        result = None
        if request is not None:
            self._start(request)
            await self._wait(request, deadline, own=True)
            result = request.outcome.result()  # raises what send raised
        with LOCK:
            for part in parts:  # a retry got success for them: none is expected any more
                if part.key in self._saved:
                    self._saved[part.key].late = 0
        return result

    def running(self) -> list[Future[None]]:
        """This process's writes not settled yet (each settles once its outcome is on record and reported)."""
        with LOCK:
            return [request.settled for request in self._here()[0]]

    def idle(self) -> bool:
        """Whether no write of this process is running or kept: closing has nothing to wait for."""
        with LOCK:
            return not any(self._here())

    def drain(self, until: float | None = None) -> None:
        """Close the record: wait for the running writes, then send the kept batches once and wait for those, each up
        to the budget (or both until the monotonic time ``until``); every outcome waited for is logged on return."""
        with LOCK:
            self._resends = "before it closes"
        self._wait_running(until)
        with LOCK:
            self._resends = "at interpreter exit"  # what fails from now on
        if self._send_kept():
            self._wait_running(until)
        if left := len(self.running()):
            then = "they were not confirmed saved" if _background.exiting() else "their outcome is logged when they end"
            message = f"writes still running after {self.wait_budget:g} s; {then}"
            self._ledger.record(None, level=logging.WARNING, message=message, writes=left)

    def at_exit(self) -> None:
        """The interpreter's last wait for this record's writes (``_background`` calls it)."""
        if not self.idle():
            message = f"the interpreter is exiting; waiting up to {self.wait_budget:g} s for writes still running"
            self._ledger.record(None, level=logging.INFO, message=message)
            self.drain(until=time.monotonic() + self.wait_budget)

    def _here(self) -> tuple[set[_Request], list[_Request]]:
        """The running and kept requests, forgetting a parent's in a forked child (lock held)."""
        if self._pid != os.getpid():  # their threads are not here, and the parent sends its own
            self._unsettled, self._kept, self._pid = set(), [], os.getpid()
        return self._unsettled, self._kept

    def _wait_running(self, until: float | None) -> None:
        """Wait while writes run, up to the budget (or ``until``): a thread may start one meanwhile."""
        deadline = time.monotonic() + self.wait_budget if until is None else until
        announced: set[Future[None]] = set()
        while (running := self.running()) and (left := deadline - time.monotonic()) > 0:
            if new := [future for future in running if future not in announced]:
                message = "waiting for writes still running"
                self._ledger.record(None, level=logging.INFO, message=message, writes=len(new))
                announced.update(new)
            wait(running, timeout=left, return_when=FIRST_COMPLETED)

    async def _wait(self, request: _Request, deadline: float | None, *, own: bool) -> None:
        """Wait for ``request`` until ``deadline``; if its ``own`` caller gives up, its thread reports the outcome."""
        try:
            await wait_for_future(request.settled, None if deadline is None else deadline - time.monotonic())
        except asyncio.TimeoutError:
            if own and not self._let_go(request, "timeout"):
                return  # it ended as the budget ran out: the outcome is recorded, and it is this caller's to report
            what = "it goes on in the background" if own else "an earlier write of the same content is still running"
            message = f"Membase write ran out of time; {what}"
            self._ledger.record("timeout", "write_timeouts", level=logging.INFO, message=message)
            raise MembaseWriteTimeout(message) from None
        except asyncio.CancelledError:
            message = "the caller stopped waiting for a Membase write; it goes on in the background"
            self._ledger.record("cancelled", "write_cancellations", level=logging.INFO, message=message)
            if own and not self._let_go(request, "cancelled") and request.outcome.exception() is not None:
                self._report(request, "cancelled")  # it failed just before: nobody else reports it
            raise

    def _let_go(self, request: _Request, why: str) -> bool:
        """Leave the reporting of ``request``'s outcome to its thread; False if it has ended already."""
        with LOCK:
            if not request.ended:
                request.abandoned = why
            return not request.ended

    def _sending(self) -> dict[Hashable, _Request]:
        """This process's running requests, by the keys of their parts (lock held)."""
        return {p.key: r for r in self._here()[0] if not r.ended for p in r.parts}

    def _start(self, request: _Request) -> None:
        """Send ``request`` on a library thread; if none can start, its outcome is that failure, at once."""
        request.outcome.add_done_callback(lambda _: self._ended(request))
        name = f"membase-write[{self._ledger.store_name}]"
        _background.submit(lambda: request.send(list(request.parts)), name=name, lane=self, future=request.outcome)

    def _ended(self, request: _Request) -> None:
        """Put ``request``'s outcome on record, report it if nobody waits for it, then settle it."""
        error = request.outcome.exception()
        try:
            with LOCK:
                request.ended, why = True, request.abandoned  # from now on, who reports it is settled
                if error is None:
                    late = 0 if why is None else next(self._late_saves)
                    for part in request.parts:
                        self._saved[part.key] = _Saved(part.anchor, part.anchor_bytes, time.monotonic(), late)
                    self._evict()
            if error is None:
                self._ledger.record(None, "writes_saved", amount=len(request.parts))
            if why is not None:
                self._report(request, why)
        finally:
            with LOCK:
                self._unsettled.discard(request)
            request.settled.set_result(None)

    def _report(self, request: _Request, why: str) -> None:
        """Log, count and trace the outcome of a request nobody waits for; keep a failed one to send it again."""
        error, what = request.outcome.exception(), f"a write {_WHY[why]}"
        if error is None:
            message = f"{what} finished; it is saved"
        elif why == "sent again" or _background.exiting() or request.size > RECORD_BYTES:
            self._ledger.record(None, "writes_lost", amount=len(request.parts))
            message = f"{what} failed; it is not saved, and nothing will send it again"
        else:
            self._keep(request)
            message = f"{what} failed; the store sends it again {self._resends}"
        counted = () if error is None else ("write_errors",)
        late = {"level": logging.INFO if error is None else logging.WARNING, "message": message, "reason": why}
        self._ledger.late(_telemetry.WRITE_LATE, request.linked, "saved", *counted, error=error, **late)

    def _keep(self, request: _Request) -> None:
        """Keep a batch nobody will retry, to send it again; the oldest kept ones make room."""
        with LOCK:
            kept, dropped = self._here()[1], []
            kept.append(request)  # alone, it is within the bound
            while sum(each.size for each in kept) > RECORD_BYTES:
                dropped.append(kept.pop(0))
        for lost in dropped:
            message = f"a failed write kept for sending again was dropped to stay within {RECORD_BYTES} bytes"
            self._ledger.record(None, "writes_lost", amount=len(lost.parts), level=logging.WARNING, message=message)

    def _send_kept(self, without: Collection[Hashable] = ()) -> int:
        """Send each kept batch once more in the background, but the parts saved, being sent, or in an earlier kept
        batch; how many requests."""
        with LOCK:
            kept, self._kept = self._here()[1], []
            taken, requests = {*without, *self._sending()}, []  # and the saved ones
            for old in kept:
                if parts := [part for part in old.parts if part.key not in taken and part.key not in self._saved]:
                    requests.append(_Request(parts, old.send, again=True))
                    taken.update(part.key for part in parts)
            self._unsettled.update(requests)
        for request in requests:
            self._ledger.record(None, "writes_sent_again", amount=len(request.parts))
            self._start(request)
        return len(requests)

    def _evict(self) -> None:
        """Forget saved writes past their time, then the oldest past the size and byte bounds (lock held). Late saves
        go last and the newest never: the manager's retry of a batch whose write ran out of time is the one to stop."""
        cutoff = time.monotonic() - RECORD_SECONDS
        for key in [key for key, saved in self._saved.items() if saved.at < cutoff]:
            del self._saved[key]
        excess = len(self._saved) - RECORD_SIZE
        excess_bytes = sum(saved.anchor_bytes for saved in self._saved.values()) - RECORD_BYTES
        if excess <= 0 and excess_bytes <= 0:
            return
        newest_late = max(saved.late for saved in self._saved.values()) or None
        for key, saved in sorted(self._saved.items(), key=lambda item: item[1].late > 0):  # stable: oldest first
            if excess <= 0 and excess_bytes <= 0:
                break
            if saved.late != newest_late:
                del self._saved[key]
                excess -= 1
                excess_bytes -= saved.anchor_bytes

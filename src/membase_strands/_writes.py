"""Captured writes: time-boxed, never sent twice for the same thing, never lost without a word.

The manager retries a write that raised, and a write past its budget may still succeed in the background, so the
record keeps a store's writes by identity: a retry of a saved one sends nothing, of a running one waits for it, of a
failed one sends it again. A batch that fails when no retry will come (its caller was cancelled, so Strands counts
it as handled; or the store closed) is kept, and the store sends it again once.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from strands.types.content import Message

from . import _background, _options, _telemetry
from ._background import wait_for_future
from ._counters import Counters
from ._failures import describe_failure, detail_of
from .errors import MembaseWriteTimeout

logger = logging.getLogger(__name__)

RECORD_SIZE = 4096
RECORD_SECONDS = 3600.0
RECORD_BYTES = 1024 * 1024  # the most message text (bytes of str objects) saved anchors and kept batches keep alive

# Why nobody waits for a request any more (its late span's ``membase.reason``), in the words of its log line.
_WHY = {
    "timeout": "that ran out of time",
    "cancelled": "whose caller was cancelled",
    "sent again": "the store sent again",
}
# When a failed batch the record keeps is sent again, by the record's phase.
_KEPT = {
    "open": "no retry will come from the manager; the store sends it again with its next write or when it closes",
    "closing": "no retry will come from the manager (the store is closing); it is sent again before it closes",
    "closed": "no retry will come from the manager (the store is closed); it is sent again at interpreter exit",
}
_DROPPED = "store=<%s>, parts=<%d> | a failed write kept for sending again was dropped to stay within %d bytes; %s"

_keeping: set[WriteRecord] = set()  # records with kept batches: they must live to send them, store or not


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
    """A request the record started: its thread marks it ``ended`` (record's lock held), reports it if ``abandoned``,
    then settles ``future``."""

    def __init__(self, parts: list[Part], send: Send, abandoned: str | None = None) -> None:
        self.parts = parts
        self.send = send
        self.size = sum(part.anchor_bytes or len(part.text) for part in parts)
        self.future: Future[None] = Future()
        self.ended = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = abandoned
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

    def __init__(
        self,
        store_name: str,
        counters: Counters | None = None,
        redact: Callable[[str], str] = str,
        *,
        budget: float | None = _options.DEFAULT_WRITE_TIMEOUT,
        size: int = RECORD_SIZE,
        seconds: float = RECORD_SECONDS,
        max_bytes: int = RECORD_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store_name = store_name
        self._counters = counters or Counters()
        self._redact = redact
        self._budget = budget
        self._size, self._seconds, self._max_bytes = size, seconds, max_bytes  # the bounds of what it keeps
        self._clock = clock
        self._lock = threading.Lock()
        self._saved: OrderedDict[Hashable, _Saved] = OrderedDict()  # oldest save first
        self._late_saves = itertools.count(1)
        self._unsettled: set[_Request] = set()  # started, and their futures not settled yet
        self._kept: list[_Request] = []  # failed with nobody left to retry them: sent again once
        self._phase = "open"  # then "closing": no retry will come from the manager; then "closed"
        _background.reset_after_fork(self)
        _background.finish_at_exit(self)

    def _after_fork_in_child(self) -> None:
        # The parent's requests have no thread here (a retry sends them); its kept batches are the parent's to send.
        self._lock, self._unsettled, self._kept = threading.Lock(), set(), []
        _keeping.discard(self)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sending()) + len(self._saved)

    @property
    def retained_bytes(self) -> int:
        """The bytes of text the byte bound counts: saved writes' anchors, and kept batches."""
        with self._lock:
            kept = sum(request.size for request in self._kept)
            return kept + sum(saved.anchor_bytes for saved in self._saved.values())

    @property
    def _wait_budget(self) -> float:
        return self._budget or _options.WAIT_WITHOUT_BUDGET

    async def write(self, parts: Sequence[Part], send: Send) -> Any:
        """Send the parts not saved yet as one request, within the budget; what ``send`` returned, or ``None`` when
        every part was saved already. Raises ``MembaseWriteTimeout`` when the budget runs out (the request goes on
        in the background), or what ``send`` raised (those parts are forgotten, so a retry sends them)."""
        self._send_kept(without={part.key for part in parts})
        deadline = None if self._budget is None else self._clock() + self._budget
        waited = False  # for an earlier call's request that saved some of them
        while True:
            with self._lock:
                self._evict()
                sending = self._sending()
                earlier = next((sending[part.key] for part in parts if part.key in sending), None)
                if earlier is None:
                    saved = [part.key for part in parts if part.key in self._saved]
                    todo = [part for part in parts if part.key not in self._saved]
                    request = _Request(todo, send) if todo else None
                    if request is not None:
                        self._unsettled.add(request)
                    break
            # An earlier call is sending some of them: wait for it; what it fails to save is new on the next pass.
            try:
                await self._wait(earlier, deadline, "an earlier write of the same content is still running")
            except asyncio.CancelledError:  # no retry will come: what is not saved by then is sent with the next write
                self._keep(_Request(list(parts), send))
                raise
            waited = waited or earlier.error is None
        decision = "send" if not saved else "partial" if todo else "already saved"
        _telemetry.annotate(sent=len(todo), deduplicated=len(saved), waited_for_earlier=waited, decision=decision)
        if saved:
            self._counters.add("writes_deduplicated", len(saved))
            message = "store=<%s>, already_saved=<%d> | not sending again what this store saved"
            logger.debug(message, self._store_name, len(saved))
        if request is not None:
            self._start(request)
            what = "it goes on in the background and the manager keeps the batch"
            await self._wait(request, deadline, what, own=True)
            if request.error is not None:
                raise request.error
        with self._lock:
            for key in self._saved.keys() & set(saved):  # a retry got success for them: none is expected any more
                self._saved[key].late = 0
        return None if request is None else request.result

    def running(self) -> list[Future[None]]:
        """The futures of the writes not settled yet: each settles once its outcome is on record, logged and counted."""
        with self._lock:
            return [request.future for request in self._unsettled]

    def drain(self, until: float | None = None) -> None:
        """Close the record: wait for the running writes, then send the kept batches once and wait for those, each up
        to the budget (or both until the monotonic time ``until``); every outcome waited for is logged on return."""
        self._phase = "closing"
        waited = self._wait_running(until, set(), kept=len(self._kept))
        self._phase = "closed"
        self._wait_running(until, waited.union(self._send_kept()))  # announced above, as kept or as the write failing
        if left := len(self.running()):
            then = "they were not confirmed saved" if _background.exiting() else "their outcome is logged when they end"
            message = "store=<%s>, writes=<%d> | writes still running after %g s; %s"
            logger.warning(message, self._store_name, left, self._wait_budget, then)

    def _wait_running(self, until: float | None, waited: set[Future[None]], kept: int = 0) -> set[Future[None]]:
        """Wait while writes run, up to the budget (or ``until``), announcing those not ``waited`` for yet (and
        ``kept``) as they appear: a daemon thread may start one during the exit wait. Returns every write waited for."""
        deadline = time.monotonic() + self._wait_budget if until is None else until
        while True:
            running = self.running()
            new = [future for future in running if future not in waited]
            if new or kept:
                message = "store=<%s>, writes=<%d> | waiting for writes still running"
                logger.info(message, self._store_name, len(new) + kept)
                waited.update(new)
                kept = 0
            left = deadline - time.monotonic()
            if not running or left <= 0:
                return waited
            wait(running, timeout=left, return_when=FIRST_COMPLETED)

    def _finish_at_exit(self, started: float) -> None:
        """At interpreter exit: :meth:`drain` within the budget counted from ``started``."""
        if self.running() or self._kept:
            message = "store=<%s> | the interpreter is exiting; waiting up to %g s for writes still running"
            logger.info(message, self._store_name, self._wait_budget)
            self.drain(until=started + self._wait_budget)

    async def _wait(self, request: _Request, deadline: float | None, what: str, *, own: bool = False) -> None:
        """Wait for ``request`` until ``deadline``; if its ``own`` caller gives up, its thread reports the outcome."""
        try:
            await wait_for_future(request.future, None if deadline is None else deadline - self._clock())
        except asyncio.TimeoutError:
            if not own or self._abandon(request, "timeout"):
                self._counters.add("write_timeouts")
                message = "store=<%s>, reason=<write ran out of time> | Membase write ran out of time; %s"
                logger.warning(message, self._store_name, what)
                raise MembaseWriteTimeout(f"Membase write ran out of time; {what}") from None
            # It ended as the budget ran out: the outcome is recorded, and it is this caller's to report.
        except asyncio.CancelledError:
            self._counters.add("write_cancellations")
            message = "store=<%s>, reason=<cancelled> | the caller stopped waiting for a Membase write; %s"
            logger.info(message, self._store_name, "it goes on in the background")
            if own and not self._abandon(request, "cancelled") and request.error is not None:
                self._report_late(request, "cancelled")  # it failed just before: nobody else reports it
            raise

    def _abandon(self, request: _Request, why: str) -> bool:
        """Leave the reporting of ``request``'s outcome to its thread; False if it has already ended."""
        with self._lock:
            if not request.ended:
                request.abandoned = why
            return not request.ended

    def _sending(self) -> dict[Hashable, _Request]:
        """The running requests, by the keys of their parts (lock held)."""
        return {part.key: request for request in self._unsettled if not request.ended for part in request.parts}

    def _start(self, request: _Request) -> None:
        try:
            _background.submit(lambda: self._run(request), name=f"membase-write[{self._store_name}]", lane=self)
        except BaseException as error:  # noqa: BLE001 - typically "can't start new thread": raised to whoever waits
            if request.abandoned is None:  # a batch the store sends again gets no retry: it is reported lost
                message = "store=<%s>, reason=<%s> | could not start the write; nothing was sent and a retry sends it"
                logger.warning(message, self._store_name, self._redact(detail_of(error)))
            request.error = error
            self._finish(request)

    def _run(self, request: _Request) -> None:
        try:
            request.result = request.send(list(request.parts))
        except BaseException as error:  # noqa: BLE001 - recorded, and raised to whoever waits
            request.error = error
        self._finish(request)

    def _finish(self, request: _Request) -> None:
        """Put the outcome on record, report it if nobody waits for it any more, then settle the future."""
        try:
            with self._lock:
                request.ended = True
                if request.error is None:
                    late = next(self._late_saves) if request.abandoned else 0
                    for part in request.parts:
                        self._saved[part.key] = _Saved(part.anchor, part.anchor_bytes, self._clock(), late)
                    self._evict()
                    self._counters.add("writes_saved", len(request.parts))
            if request.abandoned is not None:
                self._report_late(request, request.abandoned)
        finally:
            with self._lock:
                self._unsettled.discard(request)
            request.future.set_result(None)

    def _report_late(self, request: _Request, why: str) -> None:
        """Log and count the outcome of a request nobody waits for; keep a failed batch no retry will bring back."""
        error = request.error
        _telemetry.late(_telemetry.WRITE_LATE, self._store_name, request.linked, "saved", error=error, reason=why)
        if error is None:
            logger.info("store=<%s> | a write %s finished; it is saved", self._store_name, _WHY[why])
            return
        self._counters.add("write_errors")
        self._counters.add(f"errors.{describe_failure(error).kind}")
        if why == "timeout" and self._phase == "open" and not _background.exiting():
            then = "the manager's retry sends it again"
        elif why == "sent again" or _background.exiting() or request.size > self._max_bytes:
            self._counters.add("writes_lost", len(request.parts))
            then = "it is not saved, and nothing will send it again"
        else:
            then = _KEPT[self._phase]
            self._keep(request)
        detail = self._redact(detail_of(error))
        logger.warning("store=<%s>, reason=<%s> | a write %s failed; %s", self._store_name, detail, _WHY[why], then)

    def _keep(self, request: _Request) -> None:
        """Keep a batch no retry will bring back, to send it again; the oldest kept ones make room."""
        with self._lock:
            self._kept.append(request)  # alone, it is within the bound
            dropped = []
            while sum(kept.size for kept in self._kept) > self._max_bytes:
                dropped.append(self._kept.pop(0))
            _keeping.add(self)
        for lost in dropped:
            self._counters.add("writes_lost", len(lost.parts))
            logger.warning(_DROPPED, self._store_name, len(lost.parts), self._max_bytes, "it is not saved")

    def _send_kept(self, without: Collection[Hashable] = ()) -> list[Future[None]]:
        """Send each kept batch once more, in the background, leaving out parts on record or a caller is sending."""
        with self._lock:
            kept, self._kept = self._kept, []
            _keeping.discard(self)
            known = (without, self._saved, self._sending())
            requests = []
            for old in kept:
                if parts := [part for part in old.parts if not any(part.key in keys for keys in known)]:
                    requests.append(_Request(parts, old.send, "sent again"))
            self._unsettled.update(requests)
        for request in requests:
            self._counters.add("writes_sent_again", len(request.parts))
            self._start(request)
        return [request.future for request in requests]

    def _evict(self) -> None:
        """Forget saved writes past their time, then the oldest past the size and byte bounds (lock held). Late saves
        go last and the newest never: the manager's retry of a batch whose write ran out of time is the one to stop."""
        cutoff = self._clock() - self._seconds
        for key in [key for key, saved in self._saved.items() if saved.at < cutoff]:
            del self._saved[key]
        excess = len(self._saved) - self._size
        excess_bytes = sum(saved.anchor_bytes for saved in self._saved.values()) - self._max_bytes
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

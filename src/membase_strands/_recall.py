"""Automatic recall: time-boxed, fail-open, and never piling up on a waking memory (docs/recall.md).

A recall's search runs as a ``Call`` while the turn waits at most ``recall_timeout``; past it (or cancelled) the search
goes on in the background, waking the memory, and until it ends (at most ``request_timeout``) later recalls are
skipped at once, at DEBUG only. With ``recall_profile``, the standing facts are read beside the search, within the same
budget, at most once per ``profile_ttl``: a profile that fails or is late costs no passage.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from strands.memory import MemoryEntry

from ._calls import Call, Outcome, reset_in_forked_child
from ._failures import Refused
from ._formatting import arrange, memory_entries, profile_entry, standing_facts
from ._gateway import RECALL, MembaseGateway
from .errors import MembaseAccessError, MembaseRecallTimeout


class Recall:
    """One store's automatic recall: the budget, the skip while a late search runs, the pause after a 403 and the
    standing facts read for it (``profile_ttl``: ``None`` for none)."""

    def __init__(
        self,
        gateway: MembaseGateway,
        *,
        container: str | None,
        budget: float | None,
        request_timeout: float,
        access_cooldown: float | None,
        min_score: float | None,
        max_chars: int | None,
        profile_ttl: float | None,
    ) -> None:
        self._gateway, self._log, self._container = gateway, gateway.log, container
        self._budget, self._request_timeout, self._access_cooldown = budget, request_timeout, access_cooldown
        self._min_score, self._max_chars, self._profile_ttl = min_score, max_chars, profile_ttl
        self._late_search: tuple[Call[Any], float] | None = None  # the latest search that ran late, and its start
        self._profile: tuple[float, list[str]] = (-math.inf, [])  # the standing facts: when read, what they are
        self._profile_read: Call[Any] | None = None  # the latest read of them
        self._thread_name = f"membase-recall[{self._log.store_name}]"
        reset_in_forked_child(self)

    def reset_after_fork(self) -> None:
        self._late_search = self._profile_read = None  # their threads are the parent's

    async def run(self, query: str, limit: int) -> list[MemoryEntry]:
        """The entries for ``query`` (standing facts, ``limit`` passages, notices), ``[]`` while recall is skipped.
        Raises ``MembaseRecallTimeout`` past the budget, or the search's failure (a 403 as ``MembaseAccessError``)."""
        if skip := self._skip_reason():
            self._log.count("recall_skipped")
            self._log.annotate(outcome="skipped")
            self._log.log(logging.DEBUG, "recall skipped", reason=skip)
            return []
        started, gateway, container, retry = time.monotonic(), self._gateway, self._container, self._budget is None
        search = gateway.new_call(
            lambda: gateway.search(query, limit, container, retry=retry),
            name=self._thread_name,
            on_late_end=lambda outcome, why: self._late_search_ended(outcome, started),
        ).start()
        profile = self._read_profile()
        try:
            outcome = await search.wait(self._budget, owner=True)
        except asyncio.CancelledError:
            self._late_search = (search, started)
            self._log.count("recall_cancelled")
            self._log.log(logging.INFO, "recall cancelled; the search goes on in the background")
            raise
        if outcome is None:
            self._late_search = (search, started)
            self._log.count("recall_timeouts")
            self._log.annotate(outcome="timeout")
            # INFO, not WARNING: the manager logs the exception below as one, and once is enough.
            message = (
                "recall ran out of time; the turn goes on without memory and the search finishes in the background"
            )
            self._log.log(logging.INFO, message, budget=self._budget)
            raise MembaseRecallTimeout(
                f"Membase recall ran out of time after {self._budget:g} s; it goes on in the background"
            )
        if outcome.error is not None:
            self._failed(outcome)
        if profile is not None:  # the standing facts, within what is left of the budget
            left = None if self._budget is None else max(0.0, started + self._budget - time.monotonic())
            if (read := await profile.wait(left, owner=False)) is None or read.error is not None:
                self._log.log(logging.DEBUG, "profile not read for recall", error=read.error if read else None)
        return self._entries(outcome.result(), limit)

    def _entries(self, answer: Any, limit: int) -> list[MemoryEntry]:
        standing = self._profile[1]
        head = [profile_entry(standing, self._max_chars)] if standing else []
        budget = None if self._max_chars is None else self._max_chars - sum(len(entry.content) for entry in head)
        # The manager keeps the first `limit` entries: room for the notices, so no Memory's failure is dropped silently.
        most = max(0, limit - len(answer.unsearched) - len(head))
        shown = arrange(answer, most, min_score=self._min_score, budget=budget, redact=self._gateway.redact)
        entries = head + memory_entries(shown)
        if shown.duplicates_merged:
            self._log.count("recall_duplicates_merged", amount=shown.duplicates_merged)
        if shown.below_min_score:
            self._log.count("recall_passages_below_min_score", amount=shown.below_min_score)
        self._log.count("recall_hits" if shown.passages else "recall_empty")
        self._log.annotate(
            outcome="hit" if shown.passages else "empty",
            passages=len(shown.passages),
            chars_injected=sum(len(entry.content) for entry in entries),
            unanswered=len(shown.unsearched) or None,
        )
        return entries

    def _failed(self, outcome: Outcome[Any]) -> None:
        """Count and raise a failed search for the manager: a 403 as ``MembaseAccessError``, pausing recall."""
        error = outcome.error
        assert error is not None
        kind = self._log.failed(error, "recall_errors")
        self._log.annotate(outcome="error", error_kind=kind)
        if not isinstance(error, Refused):
            raise error
        paused = ""
        if self._access_cooldown is not None:
            self._gateway.pause_recall(error)
            paused = f"; automatic recall paused for {self._access_cooldown:g} s"
        # INFO: the manager logs a failed recall as a warning, and once is enough.
        self._log.log(logging.INFO, f"recall refused by Membase{paused}", error=error)
        raise MembaseAccessError(error.message, error.refusal) from error

    def _skip_reason(self) -> str | None:
        if self._gateway.disabled(RECALL):  # paused after a 403
            return "key refused (403)"
        late = self._late_search
        if late is not None and not late[0].done() and late[1] > time.monotonic() - self._request_timeout:
            return "previous search still running"
        return None

    def _late_search_ended(self, outcome: Outcome[Any], started: float) -> None:
        """The late end of a search nobody waited for any more: logged and counted once."""
        elapsed = round(time.monotonic() - started, 1)
        if outcome.error is None:
            self._log.log(logging.INFO, "late recall finished; automatic recall resumes", elapsed_s=elapsed)
        else:
            self._log.failed(outcome.error)
            message = "late recall failed; automatic recall resumes"
            self._log.log(logging.WARNING, message, error=outcome.error, elapsed_s=elapsed)
        self._log.count("recall_late_completions")  # last: whoever sees it finds the outcome logged

    def _read_profile(self) -> Call[Any] | None:
        """The read of the standing facts this recall waits for, when none is fresh or running; ``None``: use what was
        read (a read that hangs costs one recall its wait, not every one)."""
        if self._profile_ttl is None or time.monotonic() - self._profile[0] < self._profile_ttl:
            return None
        if self._profile_read is not None and not self._profile_read.done():
            return None
        gateway = self._gateway

        def read() -> None:
            self._profile = (time.monotonic(), standing_facts(gateway.profile(None, retry=False)))

        self._profile_read = gateway.new_call(read, name=self._thread_name).start()
        return self._profile_read

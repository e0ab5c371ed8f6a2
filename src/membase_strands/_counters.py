"""Counters an operator can read: what recall, writes and tools did, since the store was built."""

from __future__ import annotations

import threading
from collections import Counter

from . import _background

# Always in a snapshot; ``errors.<kind>`` (describe_failure's kinds) and ``tool_calls.<tool>`` once they happen.
STANDARD = tuple(
    """recalls recall_hits recall_empty recall_timeouts recall_skipped recall_cancelled recall_late_completions
    recall_errors writes_saved writes_deduplicated writes_sent_again writes_lost write_timeouts write_cancellations
    write_errors""".split()
)


class Counters:
    """Thread-safe event counts. Incrementing takes one uncontended lock; reading copies the counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = Counter(dict.fromkeys(STANDARD, 0))
        _background.reset_after_fork(self)

    def add(self, name: str, amount: int = 1) -> None:
        """Count ``amount`` more of ``name`` (names like ``"recalls"`` or ``"errors.timeout"``)."""
        with self._lock:
            self._counts[name] += amount

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts, the standard names first (even at zero)."""
        with self._lock:
            return dict(self._counts)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # a metrics scrape in another thread may have held it at the fork

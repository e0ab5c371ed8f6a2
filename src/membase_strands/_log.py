"""What a store did, recorded once: counted (its ``counters()``) and logged in the Strands style. The library starts
no span of its own: :meth:`StoreLog.annotate` sets ``membase.*`` attributes on the span that is current (Strands'
``memory.*`` and tool spans), never the key (only its hint), an error's text or the user's words."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from ._calls import reset_in_forked_child
from ._failures import describe_failure, detail_of

logger = logging.getLogger("membase_strands")

# Always in a snapshot; ``errors.<kind>`` (describe_failure's kinds), ``tool_calls.<tool>`` and the passages recall
# left out once they happen.
STANDARD = tuple(
    """recalls recall_hits recall_empty recall_timeouts recall_skipped recall_cancelled recall_late_completions
    recall_errors writes_saved writes_deduplicated writes_unknown writes_lost writes_refused write_timeouts
    write_cancellations write_errors""".split()
)


class StoreLog:
    """One store's counters and log lines, safe from any thread; the key masked in every line."""

    def __init__(self, store_name: str, redact: Callable[[str], str] = str, key_hint: str = "") -> None:
        self.store_name, self.key_hint, self.redact = store_name, key_hint, redact
        self.totals: StoreLog | None = None  # a pool's, which counts what each store it built counts
        self._counts = Counter(dict.fromkeys(STANDARD, 0))
        self._lock = threading.Lock()
        reset_in_forked_child(self)

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()

    def count(self, *names: str, amount: int = 1) -> None:
        """Count ``amount`` more of each of ``names``, in :attr:`totals` too."""
        with self._lock:
            for name in names:
                self._counts[name] += amount
        if self.totals is not None:
            self.totals.count(*names, amount=amount)

    def failed(self, error: BaseException, *names: str) -> str:
        """Count a failure, as ``names`` and ``errors.<kind>``; its kind."""
        kind = describe_failure(error).kind
        self.count(*names, f"errors.{kind}")
        return kind

    def log(self, level: int, message: str, *, error: BaseException | None = None, **fields: Any) -> None:
        """Log ``store=<name>, key=<hint>, <fields>, reason=<the error's text> | message`` at ``level``."""
        if logger.isEnabledFor(level):
            named = {"store": self.store_name, "key": self.key_hint or None, **fields}
            if error is not None:
                named["reason"] = detail_of(error)
            line = ", ".join(f"{name}=<{value}>" for name, value in named.items() if value is not None)
            logger.log(level, "%s", self.redact(f"{line} | {message}"))

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts, the standard names first (even at zero)."""
        with self._lock:
            return dict(self._counts)

    def annotate(self, **attributes: Any) -> None:
        """Set ``membase.<name>`` attributes (not ``None`` ones), store and key hint too, on the current span."""
        span = trace.get_current_span()
        if span.is_recording():
            named = {"store": self.store_name, "key": self.key_hint or None, **attributes}
            span.set_attributes({f"membase.{name}": value for name, value in named.items() if value is not None})

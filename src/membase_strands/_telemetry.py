"""What a store did, recorded once: counted (its ``counters()``), set on the current span, and logged where the words
matter (:class:`Ledger`).

Spans go through ``opentelemetry-api``'s global tracer provider only, as children of the current span (under
Strands 1.46+, the manager's ``memory.*`` spans); a recall or write that ends after its caller stopped waiting gets
a root span linked to its own. No span attribute carries the key (only its hint), an error's text (only its kind)
or the user's words.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, Status, StatusCode

from . import _runtime
from ._failures import describe_failure, detail_of

logger = logging.getLogger("membase_strands")

RECALL = "membase.recall"
WRITE = "membase.write"
TOOL = "membase.tool"
RECALL_LATE = "membase.recall.late"
WRITE_LATE = "membase.write.late"

# Always in a snapshot; ``errors.<kind>`` (describe_failure's kinds) and ``tool_calls.<tool>`` once they happen.
STANDARD = tuple(
    """recalls recall_hits recall_empty recall_timeouts recall_skipped recall_cancelled recall_late_completions
    recall_errors writes_saved writes_deduplicated writes_sent_again writes_unknown writes_lost writes_refused
    write_timeouts write_cancellations write_errors""".split()
)

# A proxy until a tracer provider is set, then the real thing: a provider set after import still counts.
_tracer = trace.get_tracer(__name__)


class Ledger:
    """One store's record of what it did, safe from any thread: :meth:`count` and :meth:`failed` count, :func:`mark`
    sets the current span's outcome, :meth:`log` writes a line (and sets its fields on the span)."""

    def __init__(self, store_name: str, redact: Callable[[str], str] = str, key_hint: str = "") -> None:
        self.store_name, self.key_hint, self.redact = store_name, key_hint, redact
        self.counts = Counter(dict.fromkeys(STANDARD, 0))  # read under its lock
        self.lock = _runtime.new_lock()
        self.totals: Ledger | None = None  # a pool's, which counts what each store it built counts

    def count(self, *names: str, amount: int = 1) -> None:
        """Count ``amount`` more of each of ``names``, in :attr:`totals` too."""
        with self.lock:
            for name in names:
                self.counts[name] += amount
        if self.totals is not None:
            self.totals.count(*names, amount=amount)

    def failed(self, error: BaseException, *names: str) -> None:
        """Count a failure: ``names``, and ``errors.<kind>`` of ``error``, which the current span records too."""
        kind = describe_failure(error).kind
        self.count(*names, f"errors.{kind}")
        mark(None, error_kind=kind)

    def log(self, level: int, message: str, *, error: BaseException | None = None, **fields: Any) -> None:
        """Set ``fields`` on the current span and, at ``level``, log ``message`` in the Strands style: ``store=<name>,
        key=<hint>, <fields>, reason=<the error's text> | message``, the key masked in all of it."""
        mark(None, **fields)
        if logger.isEnabledFor(level):
            named = {"store": self.store_name, "key": self.key_hint or None, **fields}
            if error is not None:
                named["reason"] = detail_of(error)
            line = ", ".join(f"{name}=<{value}>" for name, value in named.items() if value is not None)
            logger.log(level, "%s", self.redact(f"{line} | {message}"))

    def late(
        self,
        span: str,
        linked: SpanContext | None,
        outcome: str,
        *counted: str,
        level: int,
        message: str,
        error: BaseException | None = None,
        **fields: Any,
    ) -> None:
        """Count, trace and log the late end of a recall or write, on a root span linked to its turn's (which has
        ended): ``outcome``, or ``error`` (counted by kind)."""
        with operation(span, self, [Link(linked)] if linked is not None else []):
            self.count(*counted)
            if error is not None:
                self.failed(error)
            mark(outcome if error is None else "error")
            self.log(level, message, error=error, **fields)

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts, the standard names first (even at zero)."""
        with self.lock:
            return dict(self.counts)


def mark(outcome: str | None, **attributes: Any) -> None:
    """Set the current span's outcome (unless ``None``) and ``membase.`` attributes (but ``None`` ones)."""
    _current.get(_NOWHERE).outcome(outcome, **attributes)


@dataclass
class Operation:
    """One span of the store's work; nothing is recorded on a span that is not recording, and text set on it is
    ``redact``-ed."""

    span: trace.Span
    redact: Callable[[str], str] = str
    outcome_set: str | None = None

    def outcome(self, outcome: str | None, *, error_kind: str | None = None, **attributes: Any) -> None:
        """Set the outcome (unless ``None``), a failure's kind and other ``membase.`` attributes (but ``None`` ones)."""
        if self.span.is_recording():
            self.outcome_set = outcome or self.outcome_set
            for name, value in {"outcome": outcome, "error.kind": error_kind, **attributes}.items():
                if value is not None:
                    self.span.set_attribute(f"membase.{name}", self.redact(value) if isinstance(value, str) else value)


# The operation running in this context: where there is none, one that records nothing.
_current: contextvars.ContextVar[Operation] = contextvars.ContextVar("membase_operation")
_NOWHERE = Operation(trace.INVALID_SPAN)


@contextmanager
def operation(name: str, ledger: Ledger, links: list[Link] | None = None, **attributes: Any) -> Iterator[Operation]:
    """A span ``name`` of ``ledger``'s store (``membase.<name>`` attributes, the store's name and key hint) for the
    block: a child of the current span or, given the ``links`` of a late outcome, a root span. Left by an exception
    with no outcome set, its outcome is ``cancelled``, ``timeout`` or ``error`` with ``membase.error.kind``; its status
    says the outcome, never the error's text."""
    span = _tracer.start_span(name, None if links is None else otel_context.Context(), links=links)
    traced = span.is_recording()  # if not (no tracer provider, or sampled out), nothing to record or make current
    ending = (
        trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False)
        if traced
        else None
    )
    with ending or nullcontext():
        made = Operation(span, ledger.redact)
        made.outcome(None, store=ledger.store_name, key=ledger.key_hint or None, **attributes)
        token = _current.set(made)
        try:
            yield made
        except asyncio.CancelledError:
            if made.outcome_set is None:
                made.outcome("cancelled")
            raise
        except BaseException as error:
            kind = describe_failure(error).kind
            if made.outcome_set is None:
                made.outcome("timeout" if kind == "timeout" else "error", error_kind=kind)
            raise
        finally:
            _current.reset(token)
            if made.outcome_set in ("error", "timeout"):
                span.set_status(Status(StatusCode.ERROR, made.outcome_set))


def link_here() -> SpanContext | None:
    """The span context of the current operation, to link a late outcome to it later; ``None`` if not traced."""
    span = _current.get(_NOWHERE).span
    return span.get_span_context() if span.is_recording() else None

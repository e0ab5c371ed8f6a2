"""OpenTelemetry spans and metrics of what the store did, through ``opentelemetry-api``'s global providers only:
with none set, nothing is recorded.

Spans are children of the current span (under Strands 1.46+, the manager's ``memory.*`` spans); a recall or write
that ends after its caller stopped waiting gets a root span linked to its own. No attribute carries the key or an
error's text (only its kind), nor the user's words unless named in the ``gen_ai_unredacted_attributes=`` token of
``OTEL_SEMCONV_STABILITY_OPT_IN`` as Strands reads it (``;``-separated, a trailing ``*`` a glob); unlike Strands,
without the token no text is recorded. Metrics are observable counters over each store's ``counters()``, read
only when a reader collects, from a registry that holds stores weakly.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Link, SpanContext, Status, StatusCode

from . import _background
from ._counters import STANDARD
from ._failures import describe_failure

RECALL = "membase.recall"
WRITE = "membase.write"
TOOL = "membase.tool"
RECALL_LATE = "membase.recall.late"
WRITE_LATE = "membase.write.late"

# Attributes that carry the user's words: recorded only when opted in (see the module docstring).
QUERY_TEXT = "membase.query"
PASSAGES_TEXT = "membase.passages.text"
NOTE_TEXT = "membase.note.text"

# A proxy until a tracer provider is set, then the real thing: a provider set after import still counts.
_tracer = trace.get_tracer(__name__)
_current: contextvars.ContextVar[Operation | None] = contextvars.ContextVar("membase_operation", default=None)


def content_allowed(attribute: str) -> bool:
    """Whether the user opted in to recording ``attribute`` (a text attribute) on spans."""
    tokens = [token.strip() for token in os.getenv("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")]
    value = next((token.partition("=")[2] for token in tokens if token.startswith("gen_ai_unredacted_attributes=")), "")
    names = [name.strip() for name in value.split(";") if name.strip()]
    return attribute in names or any(name.endswith("*") and attribute.startswith(name[:-1]) for name in names)


@dataclass
class Operation:
    """One span of the store's work; nothing is recorded on a span that is not recording."""

    span: trace.Span
    outcome_set: str | None = None

    def outcome(self, outcome: str | None, *, error_kind: str | None = None, **attributes: Any) -> None:
        """Set the outcome (unless ``None``), a failure's kind and other ``membase.`` attributes (but ``None`` ones)."""
        self.outcome_set = outcome or self.outcome_set
        if self.span.is_recording():
            for name, value in {"outcome": outcome, "error.kind": error_kind, **attributes}.items():
                if value is not None:
                    self.span.set_attribute(f"membase.{name}", value)

    def default_outcome(self, outcome: str, *, error_kind: str | None = None) -> None:
        """Set the outcome, unless the code that ran inside this operation already did."""
        if self.outcome_set is None:
            self.outcome(outcome, error_kind=error_kind)

    def text(self, attribute: str, value: str | Sequence[str]) -> None:
        """Record the user's words under ``attribute``, only if they opted in to it."""
        if self.span.is_recording() and content_allowed(attribute):
            self.span.set_attribute(attribute, value if isinstance(value, str) else list(value))


@contextmanager
def operation(name: str, store_name: str, **attributes: Any) -> Iterator[Operation]:
    """A span ``name`` (with ``membase.<name>`` attributes) as a child of the current span, for the block. Left by an
    exception with no outcome set, its outcome is ``cancelled``, ``timeout`` or ``error`` with ``membase.error.kind``;
    its status says the outcome, never the error's text (a server may echo what it was sent: the key, the user's words).
    """
    with _tracer.start_as_current_span(name, record_exception=False, set_status_on_exception=False) as span:
        made = Operation(span)
        made.outcome(None, store=store_name, **attributes)
        token = _current.set(made)
        try:
            yield made
        except asyncio.CancelledError:
            made.default_outcome("cancelled")
            raise
        except BaseException as error:
            kind = describe_failure(error).kind
            made.default_outcome("timeout" if kind == "timeout" else "error", error_kind=kind)
            raise
        finally:
            _current.reset(token)
            if made.outcome_set in ("error", "timeout") and span.is_recording():
                span.set_status(Status(StatusCode.ERROR, made.outcome_set))


def annotate(outcome: str | None = None, *, error_kind: str | None = None, **attributes: Any) -> None:
    """Set attributes (and optionally the outcome) on the current operation, if any."""
    if (current := _current.get()) is not None:
        current.outcome(outcome, error_kind=error_kind, **attributes)


def current_text(attribute: str, value: str | Sequence[str]) -> None:
    """Record the user's words on the current operation, only if they opted in to ``attribute``."""
    if (current := _current.get()) is not None:
        current.text(attribute, value)


def link_here() -> SpanContext | None:
    """The span context of the current operation, to link a late outcome to it later; ``None`` if not traced."""
    current = _current.get()
    return current.span.get_span_context() if current is not None and current.span.is_recording() else None


def late(
    name: str, store: str, linked: SpanContext | None, outcome: str, error: BaseException | None, **attributes: Any
) -> None:
    """Record the late end of a recall or write (on the thread it ran on) on a new root span, linked to ``linked``."""
    if error is not None:
        outcome, attributes["error_kind"] = "error", describe_failure(error).kind
    links = [Link(linked)] if linked is not None and linked.is_valid else None
    # A root span: the turn's span has ended, and the late outcome belongs to no turn now running.
    span = _tracer.start_span(name, context=otel_context.Context(), links=links)
    Operation(span).outcome(outcome, store=store, **attributes)
    if outcome == "error" and span.is_recording():
        span.set_status(Status(StatusCode.ERROR, "error"))
    span.end()


# --- Metrics ----------------------------------------------------------------------------------------

_stores: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def register_store(store: Any) -> None:
    """Expose ``store.counters()`` as metrics. Cheap; holds the store weakly, so it never keeps it alive."""
    with _lock:
        _stores.add(store)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


_background.reset_after_fork(sys.modules[__name__])


def _observe(name: str, by: str | None = None) -> Callable[[metrics.CallbackOptions], list[metrics.Observation]]:
    """The callback of each live store's counter ``name`` or, ``by`` an attribute, of its counters ``name.<value>``."""

    def observe(options: metrics.CallbackOptions) -> list[metrics.Observation]:
        with _lock:
            stores = list(_stores)
        return [
            metrics.Observation(value, {"membase.store": store.name, **({by: key.partition(".")[2]} if by else {})})
            for store in stores
            for key, value in store.counters().items()
            if (key.startswith(f"{name}.") if by else key == name)
        ]

    return observe


_meter = metrics.get_meter(__name__)  # a proxy until a meter provider is set; then the instruments become real
for _name in STANDARD:
    _meter.create_observable_counter(f"membase.store.{_name}", callbacks=[_observe(_name)], unit="1")
_meter.create_observable_counter(
    "membase.store.errors", [_observe("errors", by="membase.error.kind")], "1", "Membase failures, by kind."
)
_meter.create_observable_counter(
    "membase.store.tool_calls", [_observe("tool_calls", by="membase.tool")], "1", "Calls of the store's tools, by tool."
)

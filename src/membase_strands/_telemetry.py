"""OpenTelemetry traces and metrics of what the store did: recalls, writes, tool calls, late outcomes.

Uses only ``opentelemetry-api``, through the global providers: with none set (the default), every span is a
no-op and nothing is recorded. Spans are children of the current span, so under Strands 1.46+ a recall shows
inside the manager's ``memory.search`` span, a write inside ``memory.add`` or ``memory.extract``. A recall or
write that ends after its caller stopped waiting is recorded on a new root span (``membase.recall.late``,
``membase.write.late``) linked to the span of the turn that started it.

Attributes never carry the API key, nor any error text (only its kind). Query, passage and note text are
recorded only when named in the ``gen_ai_unredacted_attributes=`` token of ``OTEL_SEMCONV_STABILITY_OPT_IN``,
the token Strands reads for the same purpose (``;``-separated names, a trailing ``*`` as a glob, for example
``gen_ai_unredacted_attributes=membase.*``). Unlike Strands, text is left out when the token is absent.

Metrics: observable counters over each store's ``counters()``, read through the global meter provider only
when a reader collects; the registry holds stores weakly, so it never keeps one alive.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Link, SpanContext, Status, StatusCode

from . import _background
from ._counters import STANDARD
from ._failures import describe_failure

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Observation

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
    tokens = (token.strip() for token in os.getenv("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(","))
    prefix = "gen_ai_unredacted_attributes="
    allowed = next((token[len(prefix) :] for token in tokens if token.startswith(prefix)), None)
    entries = [entry.strip() for entry in (allowed or "").split(";")]
    return any(
        entry and (attribute == entry or (entry[-1] == "*" and attribute.startswith(entry[:-1]))) for entry in entries
    )


class Operation:
    """One span of the store's work; every method is a no-op when the span is not recording."""

    __slots__ = ("outcome_set", "span")

    def __init__(self, span: trace.Span) -> None:
        """Wrap a started span; see :func:`operation`."""
        self.span = span
        self.outcome_set: str | None = None

    def outcome(self, outcome: str, *, error_kind: str | None = None, **attributes: Any) -> None:
        """Set the outcome (and, for a failure, its kind) and any other ``membase.`` attributes."""
        self.outcome_set = outcome
        self.set(outcome=outcome, **{"error.kind": error_kind}, **attributes)

    def default_outcome(self, outcome: str, *, error_kind: str | None = None) -> None:
        """Set the outcome, unless the code that ran inside this operation already did."""
        if self.outcome_set is None:
            self.outcome(outcome, error_kind=error_kind)

    def set(self, **attributes: Any) -> None:
        """Set ``membase.<name>`` attributes; ``None`` values are left out."""
        if self.span.is_recording():
            for name, value in attributes.items():
                if value is not None:
                    self.span.set_attribute(f"membase.{name}", value)

    def text(self, attribute: str, value: str | Sequence[str]) -> None:
        """Record the user's words under ``attribute``, only if they opted in to it."""
        if self.span.is_recording() and content_allowed(attribute):
            self.span.set_attribute(attribute, value if isinstance(value, str) else list(value))


@contextmanager
def operation(name: str, store_name: str, **attributes: Any) -> Iterator[Operation]:
    """A span ``name`` (with ``membase.<name>`` attributes) as a child of the current span, for the block.

    Left by an exception with no outcome set, its outcome is ``cancelled``, ``timeout`` or ``error`` with
    ``membase.error.kind``; its status carries the kind, never the error's text (a server may echo what it was
    sent: the key, the user's words).
    """
    with _tracer.start_as_current_span(name, record_exception=False, set_status_on_exception=False) as span:
        made = Operation(span)
        made.set(store=store_name, **attributes)
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
    current = _current.get()
    if current is None:
        return
    if outcome is not None:
        current.outcome(outcome, error_kind=error_kind, **attributes)
    else:
        current.set(**{"error.kind": error_kind}, **attributes)


def current_text(attribute: str, value: str | Sequence[str]) -> None:
    """Record the user's words on the current operation, only if they opted in to ``attribute``."""
    current = _current.get()
    if current is not None:
        current.text(attribute, value)


def link_here() -> SpanContext | None:
    """The span context of the current operation, to link a late outcome to it later; ``None`` if not traced."""
    current = _current.get()
    return current.span.get_span_context() if current is not None and current.span.is_recording() else None


def late(
    name: str,
    store_name: str,
    linked: SpanContext | None,
    outcome: str,
    *,
    error: BaseException | None = None,
    **attributes: Any,
) -> None:
    """Record the late end of a recall or write on a new root span linked to the span that started it.

    Called from the thread the request ran on, after the span of the turn has ended.
    """
    links = [Link(linked)] if linked is not None and linked.is_valid else None
    # A root span: the turn's span has ended, and the late outcome belongs to no turn now running.
    span = _tracer.start_span(name, context=otel_context.Context(), links=links)
    if error is not None:
        outcome, attributes["error_kind"] = "error", describe_failure(error).kind
    Operation(span).outcome(outcome, store=store_name, **attributes)
    if outcome == "error" and span.is_recording():
        span.set_status(Status(StatusCode.ERROR, "error"))
    span.end()


# --- Metrics ----------------------------------------------------------------------------------------

_stores: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_instruments: list[Any] = []  # kept so the callbacks stay registered


def register_store(store: Any) -> None:
    """Expose ``store.counters()`` as metrics. Cheap; holds the store weakly, so it never keeps it alive."""
    with _lock:
        if not _instruments:
            _instruments.extend(_create_instruments())
        _stores.add(store)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


_background.reset_after_fork(sys.modules[__name__])


def _live_counts() -> list[tuple[str, dict[str, int]]]:
    with _lock:
        stores = list(_stores)
    return [(store.name, store.counters()) for store in stores]


def _create_instruments() -> list[Any]:
    # A proxy meter until a meter provider is set: then the instruments become real, callbacks and all.
    meter = metrics.get_meter(__name__)
    made: list[Any] = [
        meter.create_observable_counter(f"membase.store.{name}", callbacks=[_observe_count(name)], unit="1")
        for name in STANDARD
    ]
    made.append(
        meter.create_observable_counter(
            "membase.store.errors",
            callbacks=[_observe_prefixed("errors.", "membase.error.kind")],
            unit="1",
            description="Membase failures, by kind.",
        )
    )
    made.append(
        meter.create_observable_counter(
            "membase.store.tool_calls",
            callbacks=[_observe_prefixed("tool_calls.", "membase.tool")],
            unit="1",
            description="Calls of the store's tools, by tool.",
        )
    )
    return made


def _observe_count(name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        return [metrics.Observation(counts[name], {"membase.store": store}) for store, counts in _live_counts()]

    return observe


def _observe_prefixed(prefix: str, attribute: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        return [
            metrics.Observation(value, {"membase.store": store, attribute: name[len(prefix) :]})
            for store, counts in _live_counts()
            for name, value in counts.items()
            if name.startswith(prefix)
        ]

    return observe

"""OpenTelemetry traces and metrics of what the store did: recalls, writes, tool calls, late outcomes.

Uses only ``opentelemetry-api``, through the global providers: with none set (the default), every span
is a no-op and nothing is recorded. Spans are children of the current span, so under Strands 1.50+ a
recall shows inside the manager's ``memory.search`` span, a write inside ``memory.add`` or
``memory.extract``. A recall or write that ends after its caller stopped waiting is recorded on a new
root span (``membase.recall.late``, ``membase.write.late``) linked to the span of the turn that started it.

Attributes never carry the API key, nor any error text (only its kind). Query, passage and note text are
recorded only when named in the ``gen_ai_unredacted_attributes=`` token of ``OTEL_SEMCONV_STABILITY_OPT_IN``,
the token Strands reads for the same purpose (``;``-separated names, a trailing ``*`` as a glob, for example
``gen_ai_unredacted_attributes=membase.*``). Unlike Strands, text is left out when the token is absent.

Metrics: observable counters over each store's ``counters()``, read through the global meter provider
only when a reader collects; the registry holds stores weakly, so it never keeps one alive.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
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

_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"
_UNREDACTED = "gen_ai_unredacted_attributes="

_current: contextvars.ContextVar[Operation | None] = contextvars.ContextVar("membase_operation", default=None)
_tracer_cache: tuple[trace.TracerProvider, trace.Tracer] | None = None


def _tracer() -> trace.Tracer:
    """The tracer of the global provider as it is now (a provider may be set after the store was built)."""
    global _tracer_cache
    provider = trace.get_tracer_provider()
    cached = _tracer_cache
    if cached is not None and cached[0] is provider:
        return cached[1]
    tracer = trace.get_tracer(__name__, tracer_provider=provider)
    _tracer_cache = (provider, tracer)
    return tracer


def content_allowed(attribute: str) -> bool:
    """Whether the user opted in to recording ``attribute`` (a text attribute) on spans."""
    tokens = (token.strip() for token in os.getenv(_OPT_IN, "").split(","))
    allowed = next((token[len(_UNREDACTED) :] for token in tokens if token.startswith(_UNREDACTED)), None)
    if allowed is None:
        return False
    for entry in (entry.strip() for entry in allowed.split(";")):
        if entry and (attribute == entry or (entry.endswith("*") and attribute.startswith(entry[:-1]))):
            return True
    return False


class Operation:
    """One span of the store's work. A no-op when tracing is off; use as a (sync) context manager.

    On exit by an exception with no outcome set, the outcome is derived from it: ``cancelled``,
    ``timeout`` or ``error`` with ``membase.error.kind``. The span's status carries the kind, never the
    error's text (a server may echo what it was sent).
    """

    __slots__ = ("_outcome", "_scope", "_span", "_token")

    def __init__(self, span: trace.Span) -> None:
        """Wrap a started span; see :func:`operation`."""
        self._span = span
        self._outcome: str | None = None
        self._scope: Any = None
        self._token: contextvars.Token[Operation | None] | None = None

    @property
    def recording(self) -> bool:
        """Whether anything set on this operation is recorded (tracing is on and the span sampled)."""
        return self._span.is_recording()

    @property
    def span_context(self) -> SpanContext | None:
        """The span's context, to link a late outcome to; ``None`` when tracing is off."""
        return self._span.get_span_context() if self.recording else None

    def __enter__(self) -> Operation:
        if self.recording:
            # Never record the exception: its text may carry what a server echoed (the key, the user's words).
            self._scope = trace.use_span(
                self._span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            )
            self._scope.__enter__()
            self._token = _current.set(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if not self.recording:
            return
        try:
            if error is not None and self._outcome is None:
                if isinstance(error, asyncio.CancelledError):
                    self.outcome("cancelled")
                else:
                    failure = describe_failure(error)
                    self.outcome("timeout" if failure.kind == "timeout" else "error", error_kind=failure.kind)
            if self._outcome in ("error", "timeout"):
                self._span.set_status(Status(StatusCode.ERROR, self._outcome))
            self._span.end()
        finally:
            if self._token is not None:
                _current.reset(self._token)
            if self._scope is not None:
                self._scope.__exit__(kind, error, traceback)

    def outcome(self, outcome: str, *, error_kind: str | None = None, **attributes: Any) -> None:
        """Set the outcome (and, for a failure, its kind) and any other ``membase.`` attributes."""
        if not self.recording:
            return
        self._outcome = outcome
        self._span.set_attribute("membase.outcome", outcome)
        if error_kind is not None:
            self._span.set_attribute("membase.error.kind", error_kind)
        self.set(**attributes)

    def default_outcome(self, outcome: str) -> None:
        """Set the outcome, unless the code that ran inside this operation already did."""
        if self.recording and self._outcome is None:
            self.outcome(outcome)

    def set(self, **attributes: Any) -> None:
        """Set ``membase.<name>`` attributes; ``None`` values are left out."""
        if not self.recording:
            return
        for name, value in attributes.items():
            if value is not None:
                self._span.set_attribute(f"membase.{name}", value)

    def text(self, attribute: str, value: str | Sequence[str]) -> None:
        """Record the user's words under ``attribute``, only if they opted in to it."""
        if self.recording and content_allowed(attribute):
            self._span.set_attribute(attribute, value if isinstance(value, str) else list(value))


def operation(name: str, store_name: str, **attributes: Any) -> Operation:
    """Start the span ``name`` (with ``membase.<name>`` attributes) as a child of the current span."""
    span = _tracer().start_span(name)
    result = Operation(span)
    if result.recording:
        span.set_attribute("membase.store", store_name)
        result.set(**attributes)
    return result


def current() -> Operation | None:
    """The operation the calling code runs in (carried to worker threads with the context), if recording."""
    return _current.get()


def annotate(outcome: str | None = None, *, error_kind: str | None = None, **attributes: Any) -> None:
    """Set attributes (and optionally the outcome) on the current operation, if any."""
    operation = _current.get()
    if operation is None:
        return
    if outcome is not None:
        operation.outcome(outcome, error_kind=error_kind, **attributes)
    else:
        if error_kind is not None:
            attributes["error.kind"] = error_kind
        operation.set(**attributes)


def current_text(attribute: str, value: str | Sequence[str]) -> None:
    """Record the user's words on the current operation, only if they opted in to ``attribute``."""
    operation = _current.get()
    if operation is not None:
        operation.text(attribute, value)


def link_here() -> SpanContext | None:
    """The span context of the current operation, to link a late outcome to it later; ``None`` if not traced."""
    operation = _current.get()
    return operation.span_context if operation is not None else None


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
    tracer = _tracer()
    links = [Link(linked)] if linked is not None and linked.is_valid else None
    # A root span: the turn's span has ended, and the late outcome belongs to no turn now running.
    span = tracer.start_span(name, context=otel_context.Context(), links=links)
    if not span.is_recording():
        return
    span.set_attribute("membase.store", store_name)
    record = Operation(span)
    if error is not None:
        outcome, attributes["error_kind"] = "error", describe_failure(error).kind
    record.outcome(outcome, **attributes)
    if outcome == "error":
        span.set_status(Status(StatusCode.ERROR, "error"))
    span.end()


# --- Metrics ----------------------------------------------------------------------------------------

_stores: weakref.WeakSet[Any] = weakref.WeakSet()
_stores_lock = threading.Lock()
_instruments: list[Any] = []  # kept so the callbacks stay registered


def register_store(store: Any) -> None:
    """Expose ``store.counters()`` as metrics. Cheap; holds the store weakly, so it never keeps it alive."""
    with _stores_lock:
        if not _instruments:
            _instruments.extend(_create_instruments())
        _stores.add(store)


def _after_fork_in_child() -> None:
    global _stores_lock
    _stores_lock = threading.Lock()  # a thread building a store or reading the metrics may have held it at the fork


def _live_counts() -> list[tuple[str, dict[str, int]]]:
    with _stores_lock:
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


_background.reset_after_fork(sys.modules[__name__])

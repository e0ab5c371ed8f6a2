"""What a user reads of an error or a span, for the tests that no piece of an API key reaches anyone."""

from __future__ import annotations

import traceback

from opentelemetry.sdk.trace import ReadableSpan


def span_texts(span: ReadableSpan) -> list[str]:
    """Every text a span carries: name, status, attributes, events, links."""
    found = [span.name, span.status.description or ""]
    for attributes in [span.attributes, *(e.attributes for e in span.events), *(k.attributes for k in span.links)]:
        found += [f"{name}={value}" for name, value in (attributes or {}).items()]
    return found + [event.name for event in span.events]


def error_texts(error: BaseException) -> list[str]:
    """What a caller reads of an exception: its traceback as printed, and the str and repr of it and of every error
    chained to it as Python shows them (a cause, or a context not suppressed with ``raise ... from None``)."""
    texts = ["".join(traceback.format_exception(error))]
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts += [str(current), repr(current), repr(getattr(current, "message", ""))]
        shown_context = None if current.__suppress_context__ else current.__context__
        current = current.__cause__ or shown_context
    return texts

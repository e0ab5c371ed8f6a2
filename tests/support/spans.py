"""The spans the process ends, for the tests that read them: OpenTelemetry's tracer provider is set once per process,
so one switch on it keeps the spans that end while it is on (conftest's ``spans`` fixture turns it on for a test)."""

from __future__ import annotations

import functools

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class SpanSwitch(SimpleSpanProcessor):
    """Keeps the spans that end while it is on: the process's tracer provider is set once, for the whole session."""

    on = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.on:
            super().on_end(span)


@functools.cache
def span_switch() -> tuple[SpanSwitch, InMemorySpanExporter]:
    """A switch on the process's SDK tracer provider (set here unless set already): Strands' spans and the store's."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "another tracer provider was set for this process"
    switch = SpanSwitch(InMemorySpanExporter())
    provider.add_span_processor(switch)
    return switch, switch.span_exporter  # type: ignore[return-value]

"""Shared fixtures: an in-memory Membase, stores over it, gates that always open, and a key-leak check.

Helpers that tests import (``make_agent``, ``timed``, ``Clock``, ...) live in ``tests/support/``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from membase_strands import MembaseMemoryStore
from membase_strands.testing import API_KEY, InMemoryMembase
from tests.support.spans import span_switch
from tests.support.store_helpers import Gates


@pytest.fixture
def fake() -> InMemoryMembase:
    return InMemoryMembase()


@pytest.fixture
def make_store(fake: InMemoryMembase) -> Iterator[Callable[..., MembaseMemoryStore]]:
    """Build stores over the fake, from its key as in production unless a ``client`` is given; each is closed after
    the test."""
    made: list[MembaseMemoryStore] = []

    def build(**options: Any) -> MembaseMemoryStore:
        # Budgets a loaded machine cannot run out of, unless the test is about one and says so.
        options.setdefault("recall_timeout", 30.0)
        options.setdefault("write_timeout", 30.0)
        store = MembaseMemoryStore(**options) if "client" in options else fake.store(**options)
        made.append(store)
        return store

    yield build
    for store in made:
        store.close()


@pytest.fixture
def gates() -> Iterator[Gates]:
    """``threading.Event`` gates for hung responders; every one is opened when the test ends."""
    made = Gates()
    try:
        yield made
    finally:
        made.open_all()


@pytest.fixture
def no_key_in_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail the test if the API key shows up in any log record."""
    caplog.set_level(logging.DEBUG)
    yield
    for record in caplog.records:
        assert API_KEY not in record.getMessage()
        assert API_KEY not in str(record.exc_text or "")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans that end during the test."""
    switch, exporter = span_switch()
    exporter.clear()
    switch.on = True
    try:
        yield exporter
    finally:
        switch.on = False
        exporter.clear()

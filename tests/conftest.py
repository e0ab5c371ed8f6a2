"""Shared fixtures: an in-memory Membase, stores over it, gates that always open, and a key-leak check; for the
transport, a loopback Membase with stores built from the key for it, an environment without proxy or TLS settings, and
a certificate authority of the test's own.

Helpers that tests import (``make_agent``, ``timed``, ``Clock``, ...) live in ``tests/support/``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import membase.client
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from membase_strands import MembaseMemoryStore
from membase_strands.testing import API_KEY, InMemoryMembase
from tests.support.loopback import LoopbackMembase
from tests.support.proxy import Certificates
from tests.support.spans import span_switch
from tests.support.store_helpers import FACT, Gates


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


@pytest.fixture
def loopback() -> Iterator[LoopbackMembase]:
    """A real HTTP server on 127.0.0.1 answering as the in-memory Membase, whose memory holds ``FACT``."""
    with LoopbackMembase() as server:
        server.fake.remember(FACT)
        yield server


@pytest.fixture
def built(loopback: LoopbackMembase) -> Iterator[Callable[..., MembaseMemoryStore]]:
    """Build stores from the key (for the loopback server unless ``base_url`` says otherwise), as in production; each
    is closed after the test."""
    made: list[MembaseMemoryStore] = []

    def build(**options: Any) -> MembaseMemoryStore:
        made.append(MembaseMemoryStore(api_key=API_KEY, base_url=options.pop("base_url", loopback.url), **options))
        return made[-1]

    yield build
    for store in made:
        store.close()


@pytest.fixture
def instant_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's retry back-off made instant (it sleeps 0.25-1.5 s before retrying a timeout)."""
    monkeypatch.setattr(membase.client, "_backoff", lambda attempt, retry_after=None: 0.0)


@pytest.fixture
def clean_network_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No proxy and no TLS setting in the environment (either case), for the test to set its own."""
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "NO_PROXY", "ALL_PROXY", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


@pytest.fixture
def certificates(tmp_path: Path) -> Certificates:
    """A certificate authority of the test's own (its PEM in the test's directory) and server certificates it signs."""
    return Certificates(tmp_path / "ca.pem")

"""Shared fixtures: a fake Membase, real clients over it, and agents driven by a scripted model."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore
from tests.support.fake_membase import API_KEY, FakeMembase
from tests.support.scripted_model import ScriptedModel, ToolCall


@pytest.fixture
def fake() -> FakeMembase:
    return FakeMembase()


@pytest.fixture
def make_store(fake: FakeMembase) -> Iterator[Callable[..., MembaseMemoryStore]]:
    """Build stores over the fake; each is closed after the test."""
    made: list[MembaseMemoryStore] = []

    def build(**options: Any) -> MembaseMemoryStore:
        options.setdefault("client", fake.client())
        store = MembaseMemoryStore(**options)
        made.append(store)
        return store

    yield build
    for store in made:
        store.close()


def make_agent(
    store: MembaseMemoryStore, script: list[str | ToolCall] | None = None, **manager_options: Any
) -> tuple[Agent, ScriptedModel]:
    """A real Strands agent with a MemoryManager over ``store`` and a scripted model."""
    model = ScriptedModel(script)
    agent = Agent(model=model, memory_manager=MemoryManager(stores=[store], **manager_options), callback_handler=None)
    return agent, model


@pytest.fixture
def no_key_in_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail the test if the API key shows up in any log record."""
    caplog.set_level(logging.DEBUG)
    yield
    for record in caplog.records:
        assert API_KEY not in record.getMessage()
        assert API_KEY not in str(record.exc_text or "")

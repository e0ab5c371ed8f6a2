"""Fixtures for the real-engine tests: the stand-in LLM, and one fresh Membase per test in two forms.

``memory`` is parametrised: ``http`` runs ``membase --store DIR serve`` on loopback and builds stores
with ``api_key=``/``base_url=`` (as the hosted API is reached); ``in-process`` builds them with
``local=DIR``. Both use a fresh store directory per test, so no test sees another's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from membase_strands import MembaseMemoryStore
from membase_strands.testing import StandInLLM
from tests.support.local_engine import ServedEngine, configure_engine_env, engine_unavailable, restore_env

ENGINE_UNAVAILABLE = engine_unavailable()
HTTP_KEY = "local-test"
# Generous: the first call in a process (or a fresh `membase serve`) imports the engine (~1.5 s).
TEST_RECALL_TIMEOUT = 30.0


@pytest.fixture(scope="session")
def standin() -> Iterator[StandInLLM]:
    """One stand-in per test session at a stable port: the in-process engine caches its provider."""
    if ENGINE_UNAVAILABLE:
        pytest.skip(f"the real Membase engine cannot run here: {ENGINE_UNAVAILABLE}")
    llm = StandInLLM().start()
    yield llm
    llm.stop()


@pytest.fixture
def llm(standin: StandInLLM) -> Iterator[StandInLLM]:
    """The session's stand-in, up and healthy, with this test's requests only; no unknown prompt allowed.

    The engine's variables are set for the test and restored after it, so no other test sees them;
    the in-process engine keeps the provider it built the first time.
    """
    standin.start()
    standin.set_failing(None)
    standin.reset()
    previous = configure_engine_env(standin.url)
    try:
        yield standin
    finally:
        restore_env(previous)
        standin.start()
        standin.set_failing(None)
    unknown = list(standin.unknown_prompts)
    assert not unknown, f"the engine sent prompts the stand-in does not recognise: {[p[:200] for p in unknown]}"


@dataclass
class EngineMemory:
    """One person's Membase, backed by the real engine, reached in one of the two forms."""

    form: str
    root: Path
    base_url: str | None = None
    stores: list[MembaseMemoryStore] = field(default_factory=list)

    def store(self, **options: Any) -> MembaseMemoryStore:
        """A new store on this memory (in process: close the previous one first, as a user would)."""
        options.setdefault("recall_timeout", TEST_RECALL_TIMEOUT)
        if self.form == "http":
            built = MembaseMemoryStore(api_key=HTTP_KEY, base_url=self.base_url, **options)
        else:
            built = MembaseMemoryStore(local=str(self.root), **options)
        self.stores.append(built)
        return built

    def client(self) -> Any:
        """A raw ``membase.Membase`` client on this memory (the caller closes it)."""
        import membase

        if self.form == "http":
            return membase.Membase(api_key=HTTP_KEY, base_url=self.base_url)
        return membase.Membase(local=str(self.root))

    def seed(self, content: str, container: str | None = None) -> dict[str, Any]:
        """Save a note through the raw client, as if saved earlier."""
        with self.client() as client:
            answer: dict[str, Any] = client.memories.add(content, container=container)
        assert answer.get("memory_ids"), f"the engine learned nothing from {content!r}: {answer}"
        return answer


@pytest.fixture(params=["http", "in-process"])
def memory(request: pytest.FixtureRequest, llm: StandInLLM, tmp_path: Path) -> Iterator[EngineMemory]:
    root = tmp_path / "membase"
    if request.param == "http":
        server = ServedEngine(root, llm.url).start()
        engine = EngineMemory("http", root, base_url=server.base_url)
        try:
            yield engine
        finally:
            for store in engine.stores:
                store.close()
            server.stop()
    else:
        engine = EngineMemory("in-process", root)
        try:
            yield engine
        finally:
            for store in engine.stores:
                store.close()

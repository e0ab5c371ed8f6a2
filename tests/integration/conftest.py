"""Fixtures for the real-engine tests: the stand-in LLM, and one fresh Membase per test in two forms.

``memory`` is parametrised: ``http`` serves the memory over loopback HTTP with ``membase serve``'s server (on a
thread of this process, which has the engine loaded already) and builds stores with ``api_key=``/``base_url=``
(as the hosted API is reached); ``in-process`` builds them with ``local=DIR``. Both use a fresh store directory
per test, so no test sees another's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from membase_strands.testing import StandInLLM
from tests.support.local_engine import (
    EngineMemory,
    EngineServer,
    configure_engine_env,
    engine_unavailable,
    restore_env,
)

ENGINE_UNAVAILABLE = engine_unavailable()


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
    previous = configure_engine_env(standin)
    try:
        yield standin
    finally:
        restore_env(previous)
        standin.start()
        standin.set_failing(None)
    unknown = list(standin.unknown_prompts)
    assert not unknown, f"the engine sent prompts the stand-in does not recognise: {[p[:200] for p in unknown]}"


@pytest.fixture(params=["http", "in-process"])
def memory(request: pytest.FixtureRequest, llm: StandInLLM, tmp_path: Path) -> Iterator[EngineMemory]:
    root = tmp_path / "membase"
    if request.param == "http":
        server = EngineServer(root).start()
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

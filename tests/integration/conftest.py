"""Fixtures for the real-engine tests: the stand-in LLM, and one fresh Membase per test in two forms.

``memory`` is parametrised: ``http`` serves a fresh directory with ``membase serve``'s server on loopback (a thread
of this process, whose engine is loaded already) and builds stores with ``api_key=``/``base_url=``, as the hosted
API is reached; ``in-process`` builds them with ``local=DIR``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.standin_llm import StandInLLM
from tests.support.local_engine import EngineMemory, EngineServer, configure_engine_env, engine_unavailable, restore_env


@pytest.fixture(scope="session")
def standin() -> Iterator[StandInLLM]:
    """One stand-in per test session at a stable port: the in-process engine keeps the provider it built first."""
    if reason := engine_unavailable():
        pytest.skip(f"the real Membase engine cannot run here: {reason}")
    llm = StandInLLM().start()
    yield llm
    llm.stop()


@pytest.fixture
def llm(standin: StandInLLM) -> Iterator[StandInLLM]:
    """The session's stand-in, up and healthy, with this test's requests only and no unknown prompt; the engine's
    variables are set for the test and restored after it."""
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
    unknown = [prompt[:200] for prompt in standin.unknown_prompts]
    assert not unknown, f"the engine sent prompts the stand-in does not recognise: {unknown}"


@pytest.fixture(params=["http", "in-process"])
def memory(request: pytest.FixtureRequest, llm: StandInLLM, tmp_path: Path) -> Iterator[EngineMemory]:
    root = tmp_path / "membase"
    with contextlib.ExitStack() as stack:
        base_url = stack.enter_context(EngineServer(root)).base_url if request.param == "http" else None
        engine = EngineMemory(request.param, root, base_url=base_url)
        yield engine
        for store in engine.stores:
            store.close()

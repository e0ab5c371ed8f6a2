"""The README's quick start, run as a user would: ``python examples/quickstart.py``, offline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.local_engine import ServedEngine, engine_unavailable, offline_env
from tests.support.standin_llm import StandInLLM

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.py"
ENGINE_UNAVAILABLE = engine_unavailable()


@pytest.mark.skipif(ENGINE_UNAVAILABLE is not None, reason=f"offline quick start skipped: {ENGINE_UNAVAILABLE}")
def test_the_quick_start_runs_offline_and_recalls_the_fact_in_a_new_session(tmp_path: Path) -> None:
    # No MEMBASE_API_KEY and no LLM key: local Membase, the stand-in LLM, the scripted model.
    # The working directory is empty so no .env can point the engine elsewhere.
    done = subprocess.run(
        [sys.executable, str(QUICKSTART)],
        env=offline_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    out = done.stdout
    assert "Offline:     yes" in out
    assert "deterministic stand-in on http://127.0.0.1:" in out
    assert "Agent model: scripted" in out
    assert "membase_save -> Saved to Membase." in out
    assert "- from the Memory 'default': The launch codename for our team is Blue Heron." in out
    assert "Recalled: \"The launch codename for our team is Blue Heron.\" from the Memory 'default'" in out


@pytest.mark.skipif(ENGINE_UNAVAILABLE is not None, reason=f"offline quick start skipped: {ENGINE_UNAVAILABLE}")
def test_with_a_key_the_quick_start_uses_the_membase_api_at_the_base_url(llm: StandInLLM, tmp_path: Path) -> None:
    # `membase serve` answers the hosted API's routes, so the key path runs offline too.
    with ServedEngine(tmp_path / "membase", llm.url) as server:
        env = offline_env()
        env.update(MEMBASE_API_KEY="local-test", MEMBASE_BASE_URL=server.base_url)
        done = subprocess.run(
            [sys.executable, str(QUICKSTART)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )

    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert f"Memory:      Membase at {server.base_url}, with your key (MEMBASE_API_KEY)" in done.stdout
    assert "Offline:" not in done.stdout and "Engine LLM:" not in done.stdout
    assert "Recalled: \"The launch codename for our team is Blue Heron.\" from the Memory 'default'" in done.stdout
    assert "local-test" not in done.stdout + done.stderr  # the key is never printed


def test_without_a_key_on_python_before_3_12_the_quick_start_says_how_to_run_it(tmp_path: Path) -> None:
    if sys.version_info >= (3, 12):  # play an older Python: local mode checks the version first
        version = "3.11"
        command = [
            sys.executable,
            "-c",
            "import runpy, sys; sys.version_info = (3, 11, 9, 'final', 0); sys.argv = [sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')",
            str(QUICKSTART),
        ]
    else:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        command = [sys.executable, str(QUICKSTART)]
    done = subprocess.run(command, env=offline_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60)

    assert done.returncode == 1
    assert f"Local mode needs Python 3.12 or newer and this is Python {version}" in done.stderr
    assert "uv run --python 3.12 examples/quickstart.py" in done.stderr
    assert "MEMBASE_API_KEY" in done.stderr
    assert "Session 1" not in done.stdout

"""The examples, run as a user would (``python examples/...``), offline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from membase_strands.testing import StandInLLM
from tests.support.local_engine import EngineServer, engine_unavailable, offline_env

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENGINE_UNAVAILABLE = engine_unavailable()
needs_engine = pytest.mark.skipif(ENGINE_UNAVAILABLE is not None, reason=f"needs local Membase: {ENGINE_UNAVAILABLE}")

# Runs the quick start with a scripted model in place of Strands' default (a cloud model), no pause, and a recall
# budget a loaded machine cannot run out of (the store's default, 8 s, is not what this test is about).
QUICKSTART_WITH_SCRIPTED_MODEL = """
import functools, runpy, sys, time
import membase_strands, strands
from membase_strands.testing import ScriptedModel, ToolCall

models = iter([
    ScriptedModel([ToolCall("membase_save", {"content": "Our launch codename is Blue Heron."}), "Saved."]),
    ScriptedModel([lambda sent: "It is Blue Heron." if "Blue Heron" in sent else "I do not know."]),
])
real_init = strands.Agent.__init__

def init(self, *args, **kwargs):
    kwargs.setdefault("model", next(models))
    kwargs.setdefault("callback_handler", None)
    real_init(self, *args, **kwargs)
    self.__class__.last = self

strands.Agent.__init__ = init
time.sleep = lambda seconds: None
membase_strands.MembaseMemoryStore = functools.partial(membase_strands.MembaseMemoryStore, recall_timeout=30.0)
runpy.run_path(sys.argv[1], run_name="__main__")
agent = strands.Agent.last
print("tools:", sorted(agent.tool_names))
print("answer:", agent.messages[-1]["content"][0]["text"])
"""


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_engine
def test_the_demo_runs_offline_and_recalls_the_fact_in_a_new_session(tmp_path: Path) -> None:
    # No MEMBASE_API_KEY and no LLM key: local Membase, the stand-in LLM, the scripted model. The working
    # directory is empty so no .env can point the engine elsewhere.
    done = _run([sys.executable, str(EXAMPLES / "demo.py")], offline_env(), tmp_path)

    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "a deterministic stand-in on http://127.0.0.1:" in done.stdout
    assert "membase_save -> Saved to Membase." in done.stdout
    assert "[default] The launch codename for our team is Blue Heron." in done.stdout
    assert "agent: From your memory: The launch codename for our team is Blue Heron." in done.stdout


@needs_engine
def test_with_a_key_the_demo_uses_the_membase_api_at_the_base_url(llm: StandInLLM, tmp_path: Path) -> None:
    # `membase serve`'s server answers the hosted API's routes, so the key path runs offline too.
    with EngineServer(tmp_path / "membase") as server:
        env = {**offline_env(), "MEMBASE_API_KEY": "local-test", "MEMBASE_BASE_URL": server.base_url}
        done = _run([sys.executable, str(EXAMPLES / "demo.py")], env, tmp_path)

    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "Memory: your hosted Membase (MEMBASE_API_KEY)" in done.stdout
    assert "agent: From your memory: The launch codename for our team is Blue Heron." in done.stdout
    assert "local-test" not in done.stdout + done.stderr  # the key is never printed


@needs_engine
def test_the_quick_start_saves_in_one_session_and_recalls_in_the_next(llm: StandInLLM, tmp_path: Path) -> None:
    with EngineServer(tmp_path / "membase") as server:
        env = {**offline_env(), "MEMBASE_API_KEY": "local-test", "MEMBASE_BASE_URL": server.base_url}
        script = [sys.executable, "-c", QUICKSTART_WITH_SCRIPTED_MODEL, str(EXAMPLES / "quickstart.py")]
        done = _run(script, env, tmp_path)

    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "answer: It is Blue Heron." in done.stdout
    # The recommended manager: the model gets membase_search, not the manager's search_memory beside it.
    assert "tools: ['membase_profile', 'membase_save', 'membase_search']" in done.stdout


@needs_engine
def test_many_users_runs_offline_and_each_user_recalls_only_their_own(tmp_path: Path) -> None:
    done = _run([sys.executable, str(EXAMPLES / "many_users.py")], offline_env(), tmp_path)

    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    alice, bob = done.stdout.split("--- bob, turn 1")
    assert "Alice prefers green tea" in alice and "marathon" not in alice
    assert "Bob is training for a marathon" in bob.split("--- alice, turn 2")[0]
    assert "alice: 2 recalls, 2 with memory" in done.stdout


def test_without_a_key_on_python_before_3_12_the_demo_says_how_to_run_it(tmp_path: Path) -> None:
    if sys.version_info >= (3, 12):  # play an older Python: local mode checks the version first
        command = [
            sys.executable,
            "-c",
            "import runpy, sys; sys.version_info = (3, 11, 9, 'final', 0); sys.argv = [sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')",
            str(EXAMPLES / "demo.py"),
        ]
    else:
        command = [sys.executable, str(EXAMPLES / "demo.py")]
    done = _run(command, offline_env(), tmp_path)

    assert done.returncode == 1
    assert "Local mode needs Python 3.12 or newer" in done.stderr
    assert "uv run --python 3.12 examples/demo.py" in done.stderr
    assert "MEMBASE_API_KEY" in done.stderr
    assert "Session 1" not in done.stdout

"""The examples, run as a user would (``python examples/...``), offline, against the real engine.

Each new Python process pays seconds to import Strands and the engine, so every example run here (the demo with a key
against ``membase serve``'s server, offline with local Membase, and on a Python too old for local Membase; then
``many_users.py`` offline) shares one child process that imports them once and forks a process of its own for each
run: the engine keeps the LLM provider it built first for its process, so no run may inherit another's.
``examples/quickstart.py`` is the README's quick start, run by ``tests/test_docs.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.standin_llm import StandInLLM
from tests.support.local_engine import HTTP_KEY, EngineServer, engine_unavailable, offline_env

pytestmark = pytest.mark.integration
needs_engine = pytest.mark.skipif(
    engine_unavailable() is not None, reason=f"needs local Membase: {engine_unavailable()}"
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Imports what every example needs once, then runs each (example, environment, as Python 3.11) in turn, each in a forked
# process of its own, and prints what each did as JSON.
RUN_EACH = """
import contextlib, io, json, os, runpy, sys
import membase_core, strands, membase_strands.testing

done = []
for path, environment, old_python in json.loads(sys.argv[1]):
    reading, writing = os.pipe()
    if os.fork() == 0:
        os.close(reading)
        os.environ.update(environment)
        sys.path.insert(0, os.path.dirname(path))  # as `python examples/...` does: the stand-in is beside it
        if old_python:
            sys.version_info = (3, 11, 9, "final", 0)
        out, err, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as exit:
                code = exit.code
        with os.fdopen(writing, "w") as pipe:
            json.dump({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}, pipe)
        os._exit(0)
    os.close(writing)
    with os.fdopen(reading) as pipe:
        done.append(json.loads(pipe.read() or '{"code": "no report"}'))
    os.wait()
print(json.dumps(done))
"""


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # No MEMBASE_API_KEY and no LLM key; the working directory is empty, so no .env can point the engine elsewhere.
    return subprocess.run(command, env=offline_env(), cwd=cwd, capture_output=True, text=True, timeout=180)


@needs_engine
def test_the_demo_recalls_the_fact_in_a_new_session_with_a_key_and_offline_and_many_users_recall_their_own(
    llm: StandInLLM, tmp_path: Path
):
    """The demo with a key and offline, and what it says on a Python too old for local Membase; ``many_users.py``
    offline, where each user recalls only their own."""
    demo, many_users = str(EXAMPLES / "demo.py"), str(EXAMPLES / "many_users.py")
    with EngineServer(tmp_path / "membase") as server:  # the hosted API's routes, on this process's engine
        hosted = {"MEMBASE_API_KEY": HTTP_KEY, "MEMBASE_BASE_URL": server.base_url}
        runs = json.dumps([(demo, hosted, False), (demo, {}, False), (demo, {}, True), (many_users, {}, False)])
        done = _run([sys.executable, "-c", RUN_EACH, runs], tmp_path)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    with_key, offline, old_python, users = json.loads(done.stdout.splitlines()[-1])

    answer = "agent: From your memory: The launch codename for our team is Blue Heron."
    assert with_key["code"] == 0, with_key
    assert "Memory: your hosted Membase (MEMBASE_API_KEY)" in with_key["stdout"] and answer in with_key["stdout"]
    assert HTTP_KEY not in with_key["stdout"] + with_key["stderr"]  # the key is never printed
    assert offline["code"] == 0, offline
    assert "a deterministic stand-in on http://127.0.0.1:" in offline["stdout"]
    assert "membase_save -> Saved to Membase." in offline["stdout"] and answer in offline["stdout"]
    assert "[default] The launch codename for our team is Blue Heron." in offline["stdout"]
    assert old_python["code"] == 1 and "Session 1" not in old_python["stdout"]
    assert "Local mode needs Python 3.12 or newer" in old_python["stderr"]
    assert "uv run --python 3.12 examples/demo.py" in old_python["stderr"] and "MEMBASE_API_KEY" in old_python["stderr"]

    assert users["code"] == 0, users
    alice, bob = users["stdout"].split("--- bob, turn 1")
    assert "Alice prefers green tea" in alice and "marathon" not in alice
    assert "Bob is training for a marathon" in bob.split("--- alice, turn 2")[0]
    assert "alice: 2 recalls, 2 with memory" in users["stdout"]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="on Python 3.12+ the demo plays an older Python above")
def test_on_a_python_before_3_12_the_demo_says_how_to_run_it(tmp_path: Path):
    done = _run([sys.executable, str(EXAMPLES / "demo.py")], tmp_path)

    assert done.returncode == 1 and "Session 1" not in done.stdout
    assert "Local mode needs Python 3.12 or newer" in done.stderr and "MEMBASE_API_KEY" in done.stderr

"""Local Membase serves one process per directory, and the set-up check does a real save and search.

Two engines on one directory overwrite each other's search index, so a second process is refused at once, a
crashed one leaves no lock behind, and stores in one process share one engine. These run the real engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from membase_strands import MembaseMemoryStore
from membase_strands.check import main, run_check
from membase_strands.testing import StandInLLM
from tests.support.local_engine import engine_unavailable, offline_env
from tests.support.store_helpers import LONG

_REASON = engine_unavailable()
if _REASON:
    pytest.skip(f"real Membase engine tests skipped: {_REASON}", allow_module_level=True)

pytestmark = pytest.mark.integration

HOLD = """
import sys
from membase_strands import MembaseMemoryStore
store = MembaseMemoryStore(local=sys.argv[1])
print("holding", flush=True)
sys.stdin.read()  # until the test closes our stdin, or kills us
store.close()
"""


def hold(directory: Path) -> subprocess.Popen[str]:
    """Another process that opens ``directory`` and keeps it until its stdin closes."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=offline_env(),
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "holding"
    return child


def test_a_second_process_is_refused_and_a_killed_one_leaves_no_lock(tmp_path: Path) -> None:
    child = hold(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"in use by another process \(pid \d+\).*hosted Membase"):
            MembaseMemoryStore(local=tmp_path)
    finally:
        child.send_signal(signal.SIGKILL)  # a crash: it never lets go of the lock itself
        child.wait(timeout=60)
    MembaseMemoryStore(local=tmp_path).close()  # the operating system let go of it


def test_stores_in_one_process_share_the_directorys_engine_and_the_last_close_lets_go(
    tmp_path: Path, llm: StandInLLM
) -> None:
    first = MembaseMemoryStore(local=tmp_path, capture=True, write_timeout=LONG)
    second = MembaseMemoryStore(local=tmp_path, recall_timeout=LONG)
    asyncio.run(first.add("Our billing ledger runs on Postgres 16."))
    first.close()
    entries = asyncio.run(second.search("Which database does the billing ledger run on?"))
    assert any("Postgres 16" in entry.content for entry in entries)
    second.close()

    child = hold(tmp_path)  # nothing of this process holds it any more
    child.communicate("", timeout=60)
    assert child.returncode == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_store_built_before_a_fork_is_refused_in_the_child_while_the_parent_holds_the_directory(
    tmp_path: Path,
) -> None:
    store = MembaseMemoryStore(local=tmp_path)  # as under gunicorn --preload: built in the parent
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what using the store did, then leave without running the parent's cleanup
        os.close(reading)
        try:
            asyncio.run(store.search("anything"))
            said = "no error"
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            said = f"{type(error).__name__}: {error}"
        os.write(writing, said.encode())
        os._exit(0)
    os.close(writing)
    with os.fdopen(reading) as pipe:
        said = pipe.read()
    os.waitpid(pid, 0)
    store.close()
    assert said.startswith("RuntimeError: local Membase") and f"pid {os.getpid()}" in said


def test_check_local_refuses_a_file_and_names_the_missing_llm_without_leaving_anything_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    assert main(["check", "--local", str(a_file)]) == 1
    assert "is a file" in capsys.readouterr().out

    # Without an LLM provider (a process of its own: the engine caches its provider per process).
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    script = (
        "import json, sys\nfrom membase_strands.check import run_check\n"
        "print(json.dumps([run_check(local=d).to_dict() for d in sys.argv[1:]]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(empty), str(missing)],
        capture_output=True,
        text=True,
        env=offline_env(),
        timeout=120,
    )
    for report in json.loads(done.stdout):
        assert not report["ok"]
        engine = next(step for step in report["steps"] if step["name"] == "engine")
        assert not engine["ok"] and "LLM" in engine["detail"] and "OPENAI_API_KEY" in engine["detail"]
    assert not missing.exists()
    assert sorted(path.name for path in empty.iterdir()) == [".membase-strands.lock"]


def test_check_local_saves_and_finds_a_note_with_a_working_engine(tmp_path: Path, llm: StandInLLM) -> None:
    report = run_check(local=tmp_path)

    assert report.ok, report.to_text()
    assert "a note was saved and found again" in report.to_text()
    assert sorted(path.name for path in tmp_path.iterdir()) == [".membase-strands.lock"]  # nothing in its memory

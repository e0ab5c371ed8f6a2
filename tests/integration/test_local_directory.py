"""Local Membase serves one process per directory, and the set-up check does a real save and search.

Two engines on one directory overwrite each other's search index, so a second process is refused at once, a
crashed one leaves no lock behind, and stores in one process share one engine. These run the real engine; the
scenarios that need another process share one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from examples.standin_llm import StandInLLM
from membase_strands import MembaseMemoryStore
from membase_strands.check import main, run_check
from tests.support.local_engine import engine_unavailable, offline_env
from tests.support.served import WAIT, ServedApp
from tests.support.store_helpers import LONG, run_in_child

_REASON = engine_unavailable()
if _REASON:
    pytest.skip(f"real Membase engine tests skipped: {_REASON}", allow_module_level=True)

pytestmark = pytest.mark.integration

# Another process, without an LLM: it reports run_check() on the directories after the first, then opens the first
# and holds it until its stdin closes, or it is killed.
HOLD = """
import json, sys
from membase_strands import MembaseMemoryStore
from membase_strands.check import run_check
print(json.dumps([run_check(local=directory).to_dict() for directory in sys.argv[2:]]), flush=True)
store = MembaseMemoryStore(local=sys.argv[1])
print("holding", flush=True)
sys.stdin.read()
store.close()
"""


def test_one_process_shares_a_directorys_engine_and_another_is_refused_until_the_last_close_or_its_crash(
    tmp_path: Path, llm: StandInLLM
) -> None:
    """Stores in one process share its engine, and once the last is closed another process may open the directory;
    while that one holds it this process is refused at once, and once it is killed (it never lets go of its lock
    itself) the directory is free again. That process has no LLM provider (the engine caches one per process): its
    ``run_check`` names the missing LLM and leaves nothing behind."""
    shared, empty, missing = tmp_path / "shared", tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    first = MembaseMemoryStore(local=shared, capture=True, write_timeout=LONG)
    second = MembaseMemoryStore(local=shared, recall_timeout=LONG)
    asyncio.run(first.add("Our billing ledger runs on Postgres 16."))
    first.close()
    entries = asyncio.run(second.search("Which database does the billing ledger run on?"))
    assert any("Postgres 16" in entry.content for entry in entries)
    second.close()

    command = [sys.executable, "-c", HOLD, str(shared), str(empty), str(missing)]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=offline_env())
    try:
        assert child.stdout is not None
        reports = json.loads(child.stdout.readline())
        assert child.stdout.readline().strip() == "holding"  # nothing of this process holds it any more
        with pytest.raises(RuntimeError, match=r"in use by another process \(pid \d+\).*hosted Membase"):
            MembaseMemoryStore(local=shared)
    finally:
        child.send_signal(signal.SIGKILL)  # a crash: it never lets go of the lock itself
        child.wait(timeout=60)
    MembaseMemoryStore(local=shared).close()  # the operating system let go of it

    for report in reports:
        assert not report["ok"]
        engine = next(step for step in report["steps"] if step["name"] == "engine")
        assert not engine["ok"] and "LLM" in engine["detail"] and "OPENAI_API_KEY" in engine["detail"]
    assert not missing.exists()
    assert sorted(path.name for path in empty.iterdir()) == [".membase-strands.lock"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_store_built_before_a_fork_is_refused_in_the_child_while_the_parent_holds_the_directory(
    tmp_path: Path,
) -> None:
    store = MembaseMemoryStore(local=tmp_path)  # as under gunicorn --preload: built in the parent

    def use_in_child() -> str:
        try:
            asyncio.run(store.search("anything"))
            return "no error"
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            return f"{type(error).__name__}: {error}"

    said = run_in_child(use_in_child)
    store.close()
    assert said.startswith("RuntimeError: local Membase") and f"pid {os.getpid()}" in said


def test_check_local_refuses_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    assert main(["check", "--local", str(a_file)]) == 1
    assert "is a file" in capsys.readouterr().out


def test_check_local_saves_and_finds_a_note_with_a_working_engine(tmp_path: Path, llm: StandInLLM) -> None:
    report = run_check(local=tmp_path)

    assert report.ok, report.to_text()
    assert "a note was saved and found again" in report.to_text()
    assert sorted(path.name for path in tmp_path.iterdir()) == [".membase-strands.lock"]  # nothing in its memory


def test_two_uvicorn_workers_on_one_directory_answer_200_or_503_never_500(tmp_path: Path, llm: StandInLLM) -> None:
    """``examples/server.py`` under ``uvicorn --workers 2`` with one user's local directory: the worker that opened it
    first answers that user's turns; the other answers 503 with its reason (``store_for()`` raises RuntimeError),
    never a bare 500."""
    pytest.importorskip("uvicorn", reason="the served example needs the dev dependencies (fastapi, uvicorn)")
    env = {**llm.engine_env(), "MEMBASE_LOCAL_alice": str(tmp_path / "alice"), "MEMBASE_EXAMPLE_SCRIPTED": "1"}

    async def turns(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, headers={"X-User-Id": "alice"}, timeout=WAIT) as http:
            said = [http.post("/chat", json={"text": f"Please remember note {n} about the ledger."}) for n in range(20)]
            return list(await asyncio.gather(*said))

    with ServedApp.uvicorn("server:app", env, "--workers", "2") as app:
        app.wait_until_ready(processes=2)
        answers = asyncio.run(turns(app.url))
        stranger = httpx.post(f"{app.url}/chat", json={"text": "Hi."}, headers={"X-User-Id": "mallory"}, timeout=WAIT)
    statuses = Counter(answer.status_code for answer in answers)
    print(f"\n20 turns at once on two workers: {dict(statuses)}")
    assert set(statuses) <= {200, 503} and statuses[200] > 0, [answer.text for answer in answers]
    unavailable = {"error": {"code": "memory_unavailable", "message": "this user's memory cannot be served here now"}}
    assert all(a.json() == unavailable for a in answers if a.status_code == 503)
    assert stranger.status_code == 403 and stranger.json()["error"]["code"] == "no_key"
    assert "Traceback" not in app.output, app.output

"""The served example, ``examples/server.py``, under real uvicorn and gunicorn: SIGTERM with requests in flight.

The server runs as a user starts it (``uvicorn server:app --app-dir examples``; ``gunicorn -k
uvicorn.workers.UvicornWorker -w 2``) with a scripted model and each user's key in ``MEMBASE_KEY_<user>``; Membase is
:class:`LoopbackMembase`, one account per key. Fifty concurrent clients, one user each, send turns whose words are
unique to their user: two while Membase saves at once, then two while it is slow to save (``SLOW_WRITE`` for each
first one; each second one held until the lifespan shutdown begins, then ``HELD_PAST_SHUTDOWN`` more), so each 200
goes out after ``write_timeout`` with its write running. Once half the second writes are in, the server gets SIGTERM
mid-load. A slow write is saved only if its client is still connected (as a local engine's dies with its process),
and from SIGTERM on every server process collects garbage every 0.1 s (``tests/support/collect_garbage``). Then:

- every turn answered 200 had its words saved exactly once, in its own user's account; no words were sent twice;
- no account was sent another user's words, and no reply shows another user's words;
- the shutdown ended within its bound: ``pool.aclose()`` finished in every process ("Application shutdown
  complete.", never "shutdown failed" or "Task was destroyed"), no write was left running (the store warns of any
  left after its ``write_timeout``), and the process exited: the bound is shown by counting writes, not the clock.

Each run prints requests, p50/p95 latency and notes saved (``pytest -s``). It needs only the dev dependencies.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from membase_strands.testing import InMemoryMembase
from tests.support.loopback import LoopbackMembase, _Handler, as_usual
from tests.support.served import ServedApp, free_port

pytest.importorskip("fastapi", reason="the served example needs the dev dependencies (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="the served example needs the dev dependencies (fastapi, uvicorn)")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
COLLECT_GARBAGE = ROOT / "tests" / "support" / "collect_garbage"
CLIENTS = 50
FAST_TURNS = 2  # per client, while Membase saves at once
SLOW_TURNS = 2  # per client, then, while Membase is slow to save
WRITE_TIMEOUT = 1.0  # the store's write budget: each slow turn's 200 leaves its write running
SLOW_WRITE = 1.5  # a first slow write takes this long (more than WRITE_TIMEOUT): it ends long before the shutdown
HELD_PAST_SHUTDOWN = 0.2  # a second one ends this long after the lifespan's close began, well within its wait
SIGTERM_AT = CLIENTS + CLIENTS // 2  # slow writes in: every first one, and half the second ones (in flight for sure)
WAIT = 60.0  # the longest any wait here lasts (for an answer, for a process to exit), but for a server to start:
START_WAIT = 120.0  # importing Strands and FastAPI took up to 46 s beside three busy processes on 2 loaded cores
USERS = [f"u{number:02d}" for number in range(CLIENTS)]
TOKEN = re.compile(r"\bu\d\dn\d\d\b")  # the words only one user ever says: u07n03 is user u07's turn 3
MEMORIES = ("POST", "/v1/memories")
SHUTTING_DOWN = "Waiting for application shutdown."


def user_key(user: str) -> str:
    return f"mb_key_of_{user}"


class Membase:
    """One in-memory account per user's key behind a :class:`LoopbackMembase`. Once :attr:`slow` is set, a user's
    first write takes ``SLOW_WRITE``, later ones wait for :attr:`release` (then ``HELD_PAST_SHUTDOWN``), each saved only
    if its client is still connected; :attr:`sigterm_due` is set once ``SIGTERM_AT`` slow writes are in."""

    def __init__(self) -> None:
        self.fake = InMemoryMembase()
        self.slow, self.dropped, self.slow_writes = False, 0, Counter[str]()
        self.release, self.sigterm_due = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        for user in USERS:
            self.fake.account(user_key(user)).always(*MEMORIES, self._later_when_slow)
        self.server = LoopbackMembase(self.fake)
        self.server.always(*MEMORIES, self._answer_slowly)

    def _later_when_slow(self, request: httpx.Request) -> httpx.Response:
        account = self.fake.account(request.headers["authorization"].removeprefix("Bearer "))
        with self._lock:
            if not self.slow:
                return account.answer(request)
            self.slow_writes[account.key] += 1
            first = self.slow_writes[account.key] == 1
            if self.slow_writes.total() >= SIGTERM_AT:
                self.sigterm_due.set()
        return httpx.Response(202 if first else 203, request=request)  # saved by _answer_slowly(), if its client stays

    def _answer_slowly(self, handler: _Handler) -> None:
        if handler.answer.status_code not in (202, 203):
            as_usual(handler)
            return
        if handler.answer.status_code == 203:
            self.release.wait(WAIT)
        time.sleep(SLOW_WRITE if handler.answer.status_code == 202 else HELD_PAST_SHUTDOWN)  # the fault: slow to save
        if _hung_up(handler.connection):
            with self._lock:
                self.dropped += 1
            handler.close_connection = True
            return
        request = handler.answer.request
        answer = self.fake.account(handler.seen.key).answer(request)
        handler.write_answer(answer.status_code, answer.read(), dict(answer.headers))

    def arrived(self) -> list[tuple[str, str]]:  # every write that reached Membase, saved or not: (key, words)
        return [(r.key, r.body["content"]) for r in self.fake.requests if (r.method, r.path) == MEMORIES]

    def saved(self, user: str) -> list[str]:
        return self.fake.account(user_key(user)).saved()

    def queries(self, user: str) -> list[str]:
        return [str(r.body.get("q", "")) for r in self.fake.account(user_key(user)).sent("POST", "/v1/search")]


def _hung_up(connection: socket.socket) -> bool:
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Server(ServedApp):
    """``examples/server.py`` in a subprocess, as a user starts it; once it prints ``SHUTTING_DOWN``, Membase's held
    writes are released."""

    def __init__(self, command: list[str], membase: Membase, port: int, collect_after: Path) -> None:
        env = {f"MEMBASE_KEY_{user}": user_key(user) for user in USERS}
        env.update(MEMBASE_BASE_URL=membase.server.url, MEMBASE_EXAMPLE_SCRIPTED="1")
        env.update(MEMBASE_WRITE_TIMEOUT=str(WRITE_TIMEOUT), MEMBASE_TEST_COLLECT_AFTER=str(collect_after))
        env["PYTHONPATH"] = os.pathsep.join([str(COLLECT_GARBAGE), *filter(None, [os.environ.get("PYTHONPATH")])])
        self._release, self._collect_after = membase.release, collect_after
        super().__init__(command, env, port, on_line=self._line)

    def _line(self, line: str) -> None:
        if SHUTTING_DOWN in line:
            self._release.set()

    def stop(self) -> float:  # SIGTERM, then wait for the exit (at most ``WAIT`` s); the seconds in between
        started = time.monotonic()
        self._collect_after.touch()  # from now on, garbage collections in the server (see the module docstring)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(WAIT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server was still running {WAIT} s after SIGTERM:\n{self.output}")
        self._reader.join(WAIT)
        return time.monotonic() - started

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # our own child, by its handle
            self.process.wait(WAIT)


COMMANDS = {  # as docs/servers.md starts them (in examples/)
    "uvicorn": "uvicorn server:app --app-dir . --port {port} --host 127.0.0.1 --no-access-log",
    "gunicorn -w 2": "gunicorn -k uvicorn.workers.UvicornWorker -w 2 --graceful-timeout 30 -b 127.0.0.1:{port} "
    "--chdir . server:app",
}


# --- The clients ---------------------------------------------------------------------------------


@dataclass
class Turn:
    """One request, whether Membase was slow to save it, and its answer (``status`` ``None``: the server had closed)."""

    user: str
    words: str
    slow: bool
    status: int | None = None
    reply: str = ""
    after_sigterm: bool = False
    seconds: float = 0.0  # from sending the request to its answer


async def drive(server: Server, membase: Membase) -> tuple[list[Turn], float]:
    """All clients at once, each sending its ``FAST_TURNS`` then (once all are done with those) its ``SLOW_TURNS``
    with Membase slow to save; SIGTERM once ``SIGTERM_AT`` slow writes are in; a client stops at its first request
    not answered. Returns the turns and the seconds from SIGTERM to the exit."""
    turns: list[Turn] = []
    loop = asyncio.get_running_loop()
    slow_from_now, sigterm_sent = asyncio.Event(), False
    done_fast = 0

    def done_with_fast_turns() -> None:
        nonlocal done_fast
        done_fast += 1
        if done_fast == len(USERS):
            membase.slow = True
            slow_from_now.set()

    async def client(user: str) -> None:
        fast_turns_done = False
        async with httpx.AsyncClient(base_url=server.url, headers={"X-User-Id": user}, timeout=WAIT) as http:
            for number in range(FAST_TURNS + SLOW_TURNS):
                if number == FAST_TURNS:  # every client waits here until all are done with their fast turns
                    fast_turns_done = True
                    done_with_fast_turns()
                    await asyncio.wait_for(slow_from_now.wait(), FAST_TURNS * WAIT)
                turn = Turn(user, f"Please remember note {user}n{number:02d} for me.", slow=number >= FAST_TURNS)
                turns.append(turn)
                sent = time.monotonic()
                try:
                    answer = await http.post("/chat", json={"text": turn.words})
                except httpx.TransportError:  # the server has closed its port, or this connection
                    break
                turn.status, turn.after_sigterm, turn.seconds = (
                    answer.status_code,
                    sigterm_sent,
                    time.monotonic() - sent,
                )
                turn.reply = answer.json().get("reply", "") if answer.status_code == 200 else answer.text
                if answer.status_code != 200:
                    break
        if not fast_turns_done:
            done_with_fast_turns()  # it stopped early (the check says why): the others need not wait for it

    async def sigterm_when_due() -> float:
        nonlocal sigterm_sent
        due = await loop.run_in_executor(None, membase.sigterm_due.wait, (FAST_TURNS + SLOW_TURNS) * WAIT)
        assert due, f"only {membase.slow_writes.total()} slow writes came in"
        sigterm_sent = True
        return await loop.run_in_executor(None, server.stop)  # SIGTERM, then wait for the exit

    stopping = asyncio.ensure_future(sigterm_when_due())
    await asyncio.gather(*(client(user) for user in USERS))
    return turns, await stopping


# --- The runs ------------------------------------------------------------------------------------


def owners(text: str) -> set[str]:  # the users whose words ``text`` shows
    return {token.split("n")[0] for token in TOKEN.findall(text)}


@pytest.mark.parametrize("name", COMMANDS)
def test_a_server_keeps_every_answered_turn_through_sigterm(name: str, tmp_path: Path) -> None:
    processes = 1 if name == "uvicorn" else 2
    if processes == 2:
        pytest.importorskip("gunicorn", reason="gunicorn is a dev dependency (not on Windows)")
    membase, port = Membase(), free_port()
    command = [sys.executable, "-m", *COMMANDS[name].format(port=port).split()]
    with membase.server:
        server = Server(command, membase, port, collect_after=tmp_path / "sigterm-sent")
        try:
            server.wait_until_ready(processes)
            turns, shutdown_seconds = asyncio.run(drive(server, membase))
        finally:
            server.kill()
        # The server has exited: Membase's last slow writes end now (each saved, or dropped as its client left).
        assert membase.server.wait_for(lambda: membase.server.in_flight == 0, WAIT)
    answered = [turn for turn in turns if turn.status == 200]
    saved = {user: membase.saved(user) for user in USERS}
    output = server.output
    p50, p95 = (statistics.quantiles([t.seconds for t in answered], n=20)[i] for i in (9, 18))
    print(
        f"\n[{name}] {len(turns)} requests, {len(answered)} answered 200 ({sum(t.after_sigterm for t in answered)} "
        f"after SIGTERM), p50 {p50:.2f} s, p95 {p95:.2f} s; {sum(map(len, saved.values()))} notes saved of "
        f"{len(membase.arrived())} writes arrived ({membase.dropped} dropped as the client had left); SIGTERM to exit "
        f"{shutdown_seconds:.2f} s"
    )

    # Every answer was a 200 or none at all (the port had closed); SIGTERM came with requests in flight.
    assert {turn.status for turn in turns} <= {200, None}, [t for t in turns if t.status not in (200, None)]
    # The turns whose slow writes had come in were in flight at SIGTERM: a graceful shutdown answered each of them.
    assert sum(turn.slow and turn.after_sigterm for turn in answered) >= SIGTERM_AT - CLIENTS

    # Every turn answered 200 had its words saved exactly once, in its own user's account; none was sent twice.
    not_once = [(t.words, saved[t.user].count(t.words)) for t in answered if saved[t.user].count(t.words) != 1]
    assert not_once == [], f"{len(not_once)} turns answered 200 not saved exactly once: {not_once}\n{output}"
    assert [write for write, times in Counter(membase.arrived()).items() if times > 1] == []

    # Each user's account was sent only that user's words, and each reply shows only the user's own notes.
    for user in USERS:
        assert owners(" ".join(saved[user] + membase.queries(user))) <= {user}
    assert all(owners(turn.reply) <= {turn.user} for turn in answered), [(t.user, t.reply) for t in answered]
    assert any(owners(turn.reply) for turn in answered), "no reply showed a recalled note: the check above saw nothing"

    # The lifespan's close ended in every process, with no write left running and nothing destroyed under it.
    assert server.count("Application shutdown complete.") == processes, output
    for failure in ("Application shutdown failed", "Task was destroyed but it is pending", "Traceback", "SIGKILL"):
        assert failure not in output, output
    # The store's words for a write it could not wait for, or that failed with nothing left to send it again.
    unsaved = ("writes still running after", "not confirmed saved", "not saved", "lost")
    store_lines = [line for line in output.splitlines() if "store=<" in line]
    assert [line for line in store_lines if any(words in line for words in unsaved)] == [], output
    # Uvicorn shut down gracefully, then raised SIGTERM again: the process ended by that signal, so no atexit ran.
    # Gunicorn: no worker the arbiter reaped was killed (a worker still closing at graceful_timeout would be), and
    # the arbiter exited 0.
    assert server.process.returncode == (0 if processes == 2 else -signal.SIGTERM), output


def test_every_error_is_json_in_one_shape_never_a_bare_500() -> None:
    """A ``MEMBASE_CONTAINER`` that names no Memory of the user's key: 503, each time, never a bare 500; a body over
    64 KiB: 413 before the agent runs; malformed JSON: 422; no key: 403. Each ``{"error": {"code", "message"}}``."""
    fake = InMemoryMembase()
    fake.account(user_key("alice"))
    env = {"MEMBASE_KEY_alice": user_key("alice"), "MEMBASE_EXAMPLE_SCRIPTED": "1", "MEMBASE_WRITE_TIMEOUT": "30"}

    def error_of(answer: httpx.Response, status: int, code: str) -> None:
        assert answer.status_code == status and answer.headers["content-type"] == "application/json", answer.text
        assert answer.json() == {"error": {"code": code, "message": answer.json()["error"]["message"]}}
        assert isinstance(answer.json()["error"]["message"], str)

    with LoopbackMembase(fake) as membase:
        env["MEMBASE_BASE_URL"] = membase.url
        with ServedApp.uvicorn("server:app", {**env, "MEMBASE_CONTAINER": "No such Memory"}) as app:
            app.wait_until_ready()
            with httpx.Client(base_url=app.url, headers={"X-User-Id": "alice"}, timeout=WAIT) as http:
                for _ in range(2):  # the set-up check is tried again for the next agent: refused again, the same way
                    error_of(http.post("/chat", json={"text": "I like green tea."}), 503, "memory_unavailable")
        assert "Traceback" not in app.output and "No such Memory" in app.output, app.output  # said in the log

        with ServedApp.uvicorn("server:app", env) as app:
            app.wait_until_ready()
            with httpx.Client(base_url=app.url, headers={"X-User-Id": "alice"}, timeout=WAIT) as http:
                before = len(fake.requests)
                error_of(http.post("/chat", json={"text": "I like " + "green " * 40_000}), 413, "too_large")
                error_of(
                    http.post("/chat", content=b"{", headers={"Content-Type": "application/json"}), 422, "malformed"
                )
                error_of(http.post("/chat", json={"text": "Hi."}, headers={"X-User-Id": "mallory"}), 403, "no_key")
                assert len(fake.requests) == before  # none of them reached Membase: no agent ran
                assert http.post("/chat", json={"text": "I like green tea."}).status_code == 200
        assert "Traceback" not in app.output, app.output
    assert fake.account(user_key("alice")).saved() == ["I like green tea."]

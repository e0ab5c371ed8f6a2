"""The served example, ``examples/server.py``, under real uvicorn and gunicorn: SIGTERM with requests in flight.

The server runs in a subprocess started as a user starts it (``uvicorn server:app --app-dir examples``, and
``gunicorn -k uvicorn.workers.UvicornWorker -w 2``), with a scripted model (``MEMBASE_EXAMPLE_SCRIPTED=1``) and
each user's own key in ``MEMBASE_KEY_<user>``. Membase is :class:`LoopbackMembase` on 127.0.0.1, with one in-memory
account per key. Twenty clients, one user each, send turns whose words are unique to their user:

1. eight turns each while Membase saves at once (160 turns, each recalling the user's earlier ones);
2. then two turns each while Membase takes ``SLOW_WRITE`` (1.5 s) to save, past the store's ``write_timeout`` (1 s):
   each 200 goes out while its write still runs. Once half the clients' second slow writes have reached Membase, the
   server gets SIGTERM, with those turns in flight and about thirty writes running; a client whose next request
   finds the port closed stops.

A slow write is saved only if the client is still connected when Membase answers it (as a local engine's write
dies with its process), so a server that exits without waiting for its writes loses those notes, and the test sees
it. From SIGTERM on, every server process runs a full garbage collection every 0.1 s
(``tests/support/collect_garbage``), as a busy process may at any moment: a close awaited by a task that nothing
references is then destroyed every time, not once in a while. Then:

- every turn answered 200 had its words saved exactly once, in its own user's account; no words were sent twice;
- no account was sent another user's words (notes or searches), and no reply shows another user's words;
- the shutdown ended within its bound: the lifespan's ``pool.aclose()`` finished in every process (uvicorn logged
  "Application shutdown complete.", never "Application shutdown failed" or "Task was destroyed but it is pending"),
  no write was still running when it did (the store warns of any left after its 2 x ``write_timeout``), and the
  process exited, waited for generously: the bound is shown by counting writes, not by the clock.

Each run prints its figures (``pytest -s`` shows them). One server start per run: importing Strands takes most of
it. Not marked ``integration``: it needs no local engine, only the dev dependencies (fastapi, uvicorn, gunicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from membase_strands.testing import API_KEY, InMemoryMembase
from tests.support.loopback import LoopbackMembase, _Handler, as_usual
from tests.support.store_helpers import wait_until

pytest.importorskip("fastapi", reason="the served example needs the dev dependencies (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="the served example needs the dev dependencies (fastapi, uvicorn)")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
COLLECT_GARBAGE = ROOT / "tests" / "support" / "collect_garbage"
CLIENTS = 20
FAST_TURNS = 8  # per client, while Membase saves at once
SLOW_TURNS = 2  # per client, then, while Membase takes SLOW_WRITE to save
SLOW_WRITE = 1.5
WRITE_TIMEOUT = 1.0  # the store's write budget: below SLOW_WRITE, so each slow turn's 200 leaves its write running
SIGTERM_AT = CLIENTS + CLIENTS // 2  # slow writes in: every first one, and half the second ones (in flight for sure)
WAIT = 60.0  # the longest any wait here lasts (for an answer, for a process to exit), but for a server to start:
START_WAIT = 120.0  # importing Strands and FastAPI took up to 46 s beside three busy processes on 2 loaded cores
USERS = [f"u{number:02d}" for number in range(CLIENTS)]
TOKEN = re.compile(r"\bu\d\dn\d\d\b")  # the words only one user ever says: u07n03 is user u07's turn 3
MEMORIES = "/v1/memories"


# --- Membase: one account per key, over real sockets ---------------------------------------------


class Accounts:
    """One :class:`InMemoryMembase` per key, behind one :class:`LoopbackMembase` (which calls :meth:`handle`).

    A request is answered from the account of the key in its ``Authorization: Bearer`` header. ``arrived`` lists
    every captured write that reached the server as (key, words), saved or not. With ``slow_writes`` on, a captured
    write is saved by :meth:`save_when_answered`, ``SLOW_WRITE`` seconds later, if its client is still there, and
    ``sigterm_due`` is set once ``SIGTERM_AT`` such writes have come in.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accounts: dict[str, InMemoryMembase] = {}
        self.arrived: list[tuple[str, str]] = []
        self.slow_writes = False
        self.slow_arrived = 0
        self.sigterm_due = threading.Event()
        self.dropped = 0  # slow writes whose client had hung up before the answer: not saved
        self.slow_saved_at: list[float] = []  # when each slow write was saved (time.monotonic())

    def account(self, key: str) -> InMemoryMembase:
        with self._lock:
            return self._accounts.setdefault(key, InMemoryMembase())

    def handle(self, request: httpx.Request) -> httpx.Response:
        key = _key_of(request)
        if request.method == "POST" and request.url.path == MEMORIES:
            words = httpx.Response(200, content=request.read()).json().get("content", "")
            with self._lock:
                self.arrived.append((key, words))
                if self.slow_writes:
                    self.slow_arrived += 1
                    if self.slow_arrived >= SIGTERM_AT:
                        self.sigterm_due.set()
            if self.slow_writes:
                return httpx.Response(202, request=request)  # answered later by save_when_answered()
        return self._answer(request)

    def save_when_answered(self, handler: _Handler) -> None:
        """The raw action for every ``POST /v1/memories``: a write :meth:`handle` left for later (202, which the
        fake never answers) takes ``SLOW_WRITE`` seconds and is saved only if its client is still connected."""
        if handler.answer.status_code != 202:
            as_usual(handler)
            return
        request = handler.answer.request
        time.sleep(SLOW_WRITE)  # the fault: a Membase this slow to save
        if _hung_up(handler.connection):
            with self._lock:
                self.dropped += 1
            handler.close_connection = True
            return
        answer = self._answer(request)
        with self._lock:
            self.slow_saved_at.append(time.monotonic())
        handler.write_answer(answer.status_code, answer.read(), dict(answer.headers))

    def _answer(self, request: httpx.Request) -> httpx.Response:
        account = self.account(_key_of(request))
        # Each key's fake answers as for its own key (API_KEY), whether or not the kit keeps a memory per key.
        request.headers["authorization"] = f"Bearer {API_KEY}"
        return account.handle(request)

    def saved(self, key: str) -> list[str]:
        return self.account(key).saved()

    def queries(self, key: str) -> list[str]:
        return [str(r.body.get("q", "")) for r in self.account(key).sent("POST", "/v1/search")]


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _key_of(request: httpx.Request) -> str:
    return request.headers.get("authorization", "").removeprefix("Bearer ")


def _hung_up(connection: socket.socket) -> bool:
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def user_key(user: str) -> str:
    return f"mb_key_of_{user}"


# --- The server process ------------------------------------------------------------------------


class Server:
    """The example in a subprocess, its output (stdout and stderr) read line by line as it comes."""

    def __init__(self, command: list[str], env: dict[str, str], port: int, collect_after: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self._collect_after = collect_after
        self._changed = threading.Condition()
        path = os.pathsep.join([str(COLLECT_GARBAGE), *filter(None, [env.get("PYTHONPATH")])])
        env = {**env, "MEMBASE_TEST_COLLECT_AFTER": str(collect_after), "PYTHONPATH": path}
        self.process = subprocess.Popen(
            command, env=env, cwd=EXAMPLES, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._reader = threading.Thread(target=self._read, name="served-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()  # the output ended: nobody waits for a line any more

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def count(self, text: str) -> int:
        with self._changed:
            return self._printed(text)

    def _printed(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def wait_for_line(self, text: str, times: int = 1) -> None:
        """Wait until ``text`` has been printed ``times`` times (at most ``START_WAIT`` s) or the output ended."""
        with self._changed:
            self._changed.wait_for(lambda: self._printed(text) >= times or not self._reader.is_alive(), START_WAIT)
        assert self.count(text) >= times, f"the server never printed {text!r} {times} times:\n{self.output}"

    def wait_until_ready(self) -> None:
        """Poll ``/health`` until it answers 200 (at most ``START_WAIT`` seconds)."""
        deadline = time.monotonic() + START_WAIT
        with httpx.Client(base_url=self.url, timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline and self.process.poll() is None:
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        return
                time.sleep(0.05)  # polling the port: there is no event to wait on before it listens
        pytest.fail(f"the server did not answer /health within {START_WAIT} s:\n{self.output}")

    def stop(self) -> float:
        """SIGTERM, then wait for the exit (at most ``WAIT`` seconds); the seconds in between."""
        started = time.monotonic()
        self._collect_after.touch()  # from now on, garbage collections in the server (see the module docstring)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(WAIT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the server was still running {WAIT} s after SIGTERM:\n{self.output}")
        self._reader.join(WAIT)
        return time.monotonic() - started

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(WAIT)


def uvicorn_command(port: int) -> list[str]:
    app = ["server:app", "--app-dir", str(EXAMPLES)]  # as docs/servers.md starts it
    return [sys.executable, "-m", "uvicorn", *app, "--host", "127.0.0.1", "--port", str(port), "--no-access-log"]


def gunicorn_command(port: int) -> list[str]:
    workers = ["-k", "uvicorn.workers.UvicornWorker", "-w", "2", "--graceful-timeout", "30"]
    app = ["--chdir", str(EXAMPLES), "server:app"]  # as docs/servers.md starts it
    return [sys.executable, "-m", "gunicorn", *workers, "-b", f"127.0.0.1:{port}", *app]


@contextlib.contextmanager
def served(
    command: list[str], port: int, accounts: Accounts, scratch: Path
) -> Iterator[tuple[LoopbackMembase, Server]]:
    with LoopbackMembase(accounts) as membase:  # type: ignore[arg-type] - it only calls handle()
        membase.always("POST", MEMORIES, accounts.save_when_answered)
        env = {name: value for name, value in os.environ.items() if not name.startswith(("MEMBASE_", "OTEL_"))}
        env.update({f"MEMBASE_KEY_{user}": user_key(user) for user in USERS})
        env.update(MEMBASE_BASE_URL=membase.url, MEMBASE_EXAMPLE_SCRIPTED="1", MEMBASE_WRITE_TIMEOUT=str(WRITE_TIMEOUT))
        env.update(PYTHONUNBUFFERED="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        server = Server(command, env, port, collect_after=scratch / "sigterm-sent")
        try:
            yield membase, server
        finally:
            server.kill()


# --- The clients ---------------------------------------------------------------------------------


@dataclass
class Turn:
    """One request: its user and words, whether Membase was slow to save, the answer's status (``None``: no
    answer, the server had closed), the reply, and how long it took."""

    user: str
    words: str
    slow: bool
    status: int | None = None
    reply: str = ""
    seconds: float = 0.0
    answered_at: float = 0.0  # time.monotonic()
    answered_after_sigterm: bool = False


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    ready_seconds: float = 0.0
    sigterm_at: float = 0.0  # time.monotonic()
    in_flight_at_sigterm: int = 0
    writes_running_at_sigterm: int = 0
    shutdown_seconds: float = 0.0


async def drive(server: Server, accounts: Accounts) -> Run:
    """Each user's client sends its turns one after another, all clients at once: ``FAST_TURNS``, then (once every
    client is done with those) ``SLOW_TURNS`` with Membase slow to save. Once ``SIGTERM_AT`` slow writes have come
    in, the server gets SIGTERM; each client stops at its first request that is not answered."""
    run = Run()
    loop = asyncio.get_running_loop()
    slow_from_now = asyncio.Event()
    sigterm_sent = False
    done_fast = started = finished = 0

    def done_with_fast_turns() -> None:
        nonlocal done_fast
        done_fast += 1
        if done_fast == len(USERS):
            accounts.slow_writes = True
            slow_from_now.set()

    async def client(user: str) -> None:
        nonlocal started, finished
        fast_turns_done = False
        headers = {"X-User-Id": user}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=WAIT, trust_env=False) as http:
            for number in range(FAST_TURNS + SLOW_TURNS):
                if number == FAST_TURNS:  # every client waits here until all are done with their fast turns
                    fast_turns_done = True
                    done_with_fast_turns()
                    await asyncio.wait_for(slow_from_now.wait(), FAST_TURNS * WAIT)  # each turn's answer: WAIT
                turn = Turn(user, f"Please remember note {user}n{number:02d} for me.", slow=number >= FAST_TURNS)
                run.turns.append(turn)
                began = time.monotonic()
                started += 1
                try:
                    answer = await http.post("/chat", json={"text": turn.words})
                except httpx.TransportError:  # the server has closed its port, or this connection
                    break
                finally:
                    finished += 1
                    turn.seconds = time.monotonic() - began
                turn.status, turn.answered_at = answer.status_code, time.monotonic()
                turn.answered_after_sigterm = sigterm_sent
                turn.reply = answer.json().get("reply", "") if answer.status_code == 200 else answer.text
                if answer.status_code != 200:
                    break
        if not fast_turns_done:
            done_with_fast_turns()  # it stopped early (the check says why): the others need not wait for it

    async def sigterm_when_due() -> float:
        nonlocal sigterm_sent
        due = await loop.run_in_executor(None, accounts.sigterm_due.wait, (FAST_TURNS + SLOW_TURNS) * WAIT)
        assert due, f"only {accounts.slow_arrived} slow writes came in"
        run.in_flight_at_sigterm = started - finished
        run.writes_running_at_sigterm = len(accounts.arrived) - sum(len(accounts.saved(user_key(u))) for u in USERS)
        sigterm_sent, run.sigterm_at = True, time.monotonic()
        return await loop.run_in_executor(None, server.stop)  # SIGTERM, then wait for the exit

    stopping = asyncio.ensure_future(sigterm_when_due())
    await asyncio.gather(*(client(user) for user in USERS))
    run.shutdown_seconds = await stopping
    return run


# --- What must hold after each run ---------------------------------------------------------------


def owners(text: str) -> set[str]:
    """The users whose words ``text`` shows."""
    return {token.split("n")[0] for token in TOKEN.findall(text)}


def report(name: str, run: Run, accounts: Accounts) -> None:
    answered = [turn for turn in run.turns if turn.status == 200]
    fast = sorted(turn.seconds for turn in answered if not turn.slow)
    slow = sorted(turn.seconds for turn in answered if turn.slow)
    saved = sum(len(accounts.saved(user_key(user))) for user in USERS)
    last_answer = max((turn.answered_at for turn in answered), default=0.0)  # the close ran after it
    print(
        f"\n[{name}] ready in {run.ready_seconds:.1f} s; requests: {len(run.turns)} sent, {len(answered)} answered 200 "
        f"({sum(t.answered_after_sigterm for t in answered)} after SIGTERM), "
        f"{sum(t.status is None for t in run.turns)} not answered (port closed); "
        f"latency p50/p95: fast writes {_quantile(fast, 0.5):.3f}/{_quantile(fast, 0.95):.3f} s, "
        f"slow writes {_quantile(slow, 0.5):.3f}/{_quantile(slow, 0.95):.3f} s; "
        f"at SIGTERM: {run.in_flight_at_sigterm} requests in flight, {run.writes_running_at_sigterm} writes running; "
        f"notes saved: {saved} (writes arrived {len(accounts.arrived)}, dropped as the client had left "
        f"{accounts.dropped}; saved after SIGTERM {sum(t > run.sigterm_at for t in accounts.slow_saved_at)}, "
        f"after the last 200 {sum(t > last_answer for t in accounts.slow_saved_at)}); "
        f"SIGTERM to exit {run.shutdown_seconds:.2f} s"
    )


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def check(run: Run, accounts: Accounts, server: Server, processes: int) -> None:
    answered = [turn for turn in run.turns if turn.status == 200]
    saved = {user: accounts.saved(user_key(user)) for user in USERS}
    output = server.output

    # Every answer was a 200 or none at all (the port had closed); SIGTERM came with requests in flight.
    assert {turn.status for turn in run.turns} <= {200, None}, [t for t in run.turns if t.status not in (200, None)]
    # The turns whose slow writes had come in were in flight at SIGTERM: a graceful shutdown answered each of them.
    assert sum(turn.slow and turn.answered_after_sigterm for turn in answered) >= SIGTERM_AT - CLIENTS

    # Every turn answered 200 had its words saved exactly once, in its own user's account; none was sent twice.
    not_once = [(t.words, saved[t.user].count(t.words)) for t in answered if saved[t.user].count(t.words) != 1]
    assert not_once == [], f"{len(not_once)} turns answered 200 not saved exactly once: {not_once}\n{output}"
    assert [write for write, times in Counter(accounts.arrived).items() if times > 1] == []

    # Each user's account was sent only that user's words, and each reply shows only the user's own notes.
    for user in USERS:
        assert owners(" ".join(saved[user] + accounts.queries(user_key(user)))) <= {user}
    assert all(owners(turn.reply) <= {turn.user} for turn in answered), [(t.user, t.reply) for t in answered]
    assert any(owners(turn.reply) for turn in answered), "no reply showed a recalled note: the check above saw nothing"

    # The lifespan's close ended in every process, with no write left running and nothing destroyed under it.
    assert server.count("Application shutdown complete.") == processes, output
    for failure in ("Application shutdown failed", "Task was destroyed but it is pending", "Traceback"):
        assert failure not in output, output
    # The store's words for a write it could not wait for, or that failed with nothing left to send it again.
    unsaved = ("writes still running after", "not confirmed saved", "not saved", "lost")
    store_lines = [line for line in output.splitlines() if "store=<" in line]
    assert [line for line in store_lines if any(words in line for words in unsaved)] == [], output


# --- The runs ------------------------------------------------------------------------------------


def serve_and_stop(name: str, command: Callable[[int], list[str]], processes: int, scratch: Path) -> Server:
    accounts = Accounts()
    port = free_port()
    with served(command(port), port, accounts, scratch) as (membase, server):
        started = time.monotonic()
        server.wait_until_ready()
        server.wait_for_line("Application startup complete.", times=processes)
        ready_seconds = time.monotonic() - started
        run = asyncio.run(drive(server, accounts))
        run.ready_seconds = ready_seconds
        # The server has exited: Membase's last slow writes end now (each saved, or dropped as its client left).
        assert wait_until(lambda: membase.in_flight == 0, timeout=WAIT)
        report(name, run, accounts)
        check(run, accounts, server, processes)
    return server


def test_uvicorn_keeps_every_answered_turn_through_sigterm(tmp_path: Path) -> None:
    server = serve_and_stop("uvicorn", uvicorn_command, processes=1, scratch=tmp_path)

    # Uvicorn shut down gracefully, then raised SIGTERM again: the process ended by that signal, so no atexit ran.
    assert server.process.returncode == -signal.SIGTERM, server.output


@pytest.mark.skipif(sys.platform == "win32", reason="gunicorn runs on Unix only")
def test_gunicorn_with_uvicorn_workers_keeps_every_answered_turn_through_sigterm(tmp_path: Path) -> None:
    pytest.importorskip("gunicorn", reason="gunicorn is a dev dependency (not on Windows)")
    server = serve_and_stop("gunicorn -w 2", gunicorn_command, processes=2, scratch=tmp_path)

    # Each worker's lifespan close ended (checked above: a worker still closing at graceful_timeout is killed before
    # it can say so), no worker the arbiter reaped was killed, and the arbiter exited 0.
    assert "SIGKILL" not in server.output
    assert server.process.returncode == 0, server.output

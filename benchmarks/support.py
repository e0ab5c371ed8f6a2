"""What the scenarios share: the run's plan, statistics, CPU load, waits, offline clients and agents.

Everything here is offline. A client is the real ``membase.Membase`` over ``httpx.MockTransport``, or
over real sockets to the loopback server (``_server.py``) in a child process; an agent is the real
``strands.Agent`` with the testing kit's scripted model. Every wait is bounded.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import membase
from _server import search_answer
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore
from membase_strands.testing import API_KEY, ScriptedModel
from membase_strands.testing._membase import BASE_URL

BENCHMARKS = Path(__file__).resolve().parent

QUESTION = "Which database did we choose for the ledger?"
FACT = "We chose Postgres for the ledger."
SEARCH_BODY = search_answer(QUESTION, FACT)
"""The fixed three-passage search answer of the zero-latency client."""

RECALL_THREAD = "membase-recall["
WRITE_THREAD = "membase-write["
BUSY_SHARE = 0.10
"""Other processes using this share of the CPU make a section's timings unreliable."""

DEFAULT_WRITE_TIMEOUT: float = inspect.signature(MembaseMemoryStore).parameters["write_timeout"].default


# --- The plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How much each section does: the full run, or a quick smoke run under a minute."""

    quick: bool
    recall_trials: int
    recall_calls: int
    turn_trials: int
    turns: int
    stall_trials: int
    stall_turns: int
    users: int
    user_turns: int
    concurrency: int
    rss_count: int
    rss_trials: int
    idle_users: int
    idle_s: float
    capture: tuple[tuple[float | None, float, int], ...]  # (write_timeout, simulated attempt s, runs)
    before: str | None = None  # a commit whose library section 4's server pattern is compared with, or None


BEFORE_PERFORMANCE_WORK = "f9dee63"
"""The last commit before the performance work (issue 13): a thread per recall, the tools decorated per store."""


FULL = Plan(
    quick=False,
    recall_trials=7,
    recall_calls=1000,
    turn_trials=5,
    turns=40,
    stall_trials=3,
    stall_turns=20,
    users=200,
    user_turns=5,
    concurrency=20,
    rss_count=1000,
    rss_trials=2,
    idle_users=1000,
    idle_s=10.0,
    capture=((1.0, 10.0, 2), (DEFAULT_WRITE_TIMEOUT, 10.0, 1), (None, 10.0, 1)),
    before=BEFORE_PERFORMANCE_WORK,
)
QUICK = Plan(
    quick=True,
    recall_trials=3,
    recall_calls=200,
    turn_trials=2,
    turns=10,
    stall_trials=1,
    stall_turns=8,
    users=20,
    user_turns=2,
    concurrency=10,
    rss_count=100,
    rss_trials=1,
    idle_users=100,
    idle_s=6.0,
    capture=((0.3, 1.0, 1), (None, 1.0, 1)),
)


# --- Statistics ---------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) by nearest rank; enough for small samples."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return float(ordered[index])


def time_calls_us(call: Callable[[], object], count: int) -> list[float]:
    """Per-call wall times of ``count`` synchronous calls, in microseconds."""
    times = []
    for _ in range(count):
        started = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - started) / 1000)
    return times


# --- Other load on the machine ------------------------------------------------------------------


@dataclass
class CpuSample:
    """The wall clock and CPU time used so far, by the whole machine and by this process."""

    wall: float
    machine_busy: float  # CPU-seconds all processes spent, from /proc/stat
    own: float  # CPU-seconds this process and its waited-for children spent


def cpu_sample() -> CpuSample:
    """Sample the clocks now; the machine's share is NaN where /proc/stat cannot be read."""
    busy = float("nan")
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(v) for v in fields]
        # user nice system idle iowait irq softirq steal ...: busy is everything but idle and iowait
        busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    return CpuSample(time.perf_counter(), busy, own)


def others_share(start: CpuSample, end: CpuSample) -> float:
    """The share (0-1) of the machine's CPU that other processes used between two samples."""
    cores = os.cpu_count() or 1
    wall = end.wall - start.wall
    others = (end.machine_busy - start.machine_busy) - (end.own - start.own)
    return max(0.0, others / (wall * cores)) if wall > 0 else 0.0


@contextmanager
def busy_processes(count: int = 2, limit_s: float = 600.0) -> Iterator[None]:
    """``count`` processes spinning on the CPU while inside (each ends by itself after ``limit_s``), stopped by pid."""
    spinners = [
        subprocess.Popen(
            [sys.executable, "-c", f"import time\nend = time.time() + {limit_s}\nwhile time.time() < end: pass"]
        )
        for _ in range(count)
    ]
    try:
        time.sleep(0.2)  # let them reach the CPU before the measurement starts
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(10)


# --- Waits --------------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, step: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def membase_threads(prefix: str = "membase-") -> list[threading.Thread]:
    """The live threads the library started whose names start with ``prefix``."""
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def no_library_threads(timeout: float = 15.0) -> bool:
    """Wait (bounded) until none of the library's threads is alive, idle workers included (they retire when idle),
    so the next measurement starts from the same place whatever ran before it."""
    return wait_until(lambda: not any(t.name.startswith("membase-") for t in threading.enumerate()), timeout=timeout)


def wait_for_threads(prefix: str, at_most: int = 0, timeout: float = 15.0) -> bool:
    """Wait (polling every millisecond, bounded) until at most ``at_most`` threads named ``prefix...`` live."""
    return wait_until(lambda: len(membase_threads(prefix)) <= at_most, timeout=timeout, step=0.001)


# --- The loopback server and threads ------------------------------------------------------------


class ServerProcess:
    """The loopback server (``_server.py``) in a child process, with its connection counters."""

    def __init__(self, latency_ms: float) -> None:
        self._process = subprocess.Popen(
            [sys.executable, str(BENCHMARKS / "_server.py"), str(latency_ms)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline().split()
        if len(line) != 2 or line[0] != "PORT":
            self.stop()
            raise RuntimeError(f"the loopback server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{line[1]}"

    def _control(self, method: str, path: str) -> dict[str, int]:
        request = urllib.request.Request(self.url + path, method=method, headers={"Connection": "close"}, data=b"")
        if method == "GET":
            request.data = None
        with urllib.request.urlopen(request, timeout=10) as answer:
            result: dict[str, int] = json.loads(answer.read())
            return result

    def stats(self) -> dict[str, int]:
        """Connections accepted and requests answered since the last reset."""
        return self._control("GET", "/_stats")

    def reset(self) -> None:
        """Zero the counters."""
        self._control("POST", "/_reset")

    def stop(self) -> None:
        """Close the server's stdin (it serves until then) and wait for it, killing it if it lingers."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)


@contextmanager
def thread_peak() -> Iterator[dict[str, int]]:
    """Samples the process's threads every millisecond while inside: all of them (the sampler included) and the
    library's own (named ``membase-...``, at work or waiting for work), at their peaks."""
    seen = {"baseline": threading.active_count(), "peak": 0, "library_peak": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen["peak"] = max(seen["peak"], threading.active_count())
            library = sum(1 for t in threading.enumerate() if t.name.startswith("membase-"))
            seen["library_peak"] = max(seen["library_peak"], library)
            done.wait(0.001)

    sampler = threading.Thread(target=sample, name="bench-sampler", daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join(5)


# --- Clients and agents -------------------------------------------------------------------------


def fixed_answer(request: httpx.Request) -> httpx.Response:
    """Answers every request with :data:`SEARCH_BODY`, at once."""
    return httpx.Response(200, content=SEARCH_BODY, headers={"content-type": "application/json"})


@contextmanager
def mock_client(answer: Callable[[httpx.Request], httpx.Response]) -> Iterator[membase.Membase]:
    """A real ``membase.Membase`` whose requests ``answer`` handles in this process; its HTTP client closes after.

    The SDK never closes an ``httpx.Client`` it was given, nor does a store close a client it was given.
    """
    with httpx.Client(base_url=BASE_URL, transport=httpx.MockTransport(answer)) as http:
        yield membase.Membase(api_key=API_KEY, base_url=BASE_URL, http_client=http)


def make_agent(store: MembaseMemoryStore | None) -> tuple[Agent, ScriptedModel]:
    """A real Strands agent with a scripted model; with ``store``, a MemoryManager over it, else none."""
    model = ScriptedModel()
    if store is None:
        return Agent(model=model, callback_handler=None), model
    return Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None), model


def sync_turn_ms(agent: Agent, model: ScriptedModel, prompt: str = QUESTION) -> float:
    """One synchronous ``agent(prompt)`` on an empty history, in ms."""
    agent.messages.clear()
    model.calls.clear()
    started = time.perf_counter()
    agent(prompt)
    return (time.perf_counter() - started) * 1000


async def async_turns_ms(agent: Agent, model: ScriptedModel, count: int) -> list[float]:
    """``count`` turns of ``await agent.invoke_async(QUESTION)``, each on an empty history, in ms."""
    times = []
    for _ in range(count):
        agent.messages.clear()
        model.calls.clear()
        started = time.perf_counter()
        await agent.invoke_async(QUESTION)
        times.append((time.perf_counter() - started) * 1000)
    return times

"""Section 4, many users over real HTTP: a fresh store per turn against one store per user.

A loopback server in a child process (``benchmarks/_server.py``) answers the Membase routes after a
few milliseconds and counts the TCP connections it accepts. Many users' turns run through
``strands.Agent`` on one event loop, a bounded number of users at a time.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from report import Section, fmt
from strands import Agent
from strands.memory import MemoryManager
from support import BENCHMARKS, QUESTION, Plan

from membase_strands import MembaseMemoryStore, MembaseStorePool
from membase_strands.testing import ScriptedModel

NUMBER = 4
SERVER_LATENCY_MS = 3.0


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
    """Samples ``threading.active_count()`` every millisecond (the sampler included) while inside."""
    seen = {"baseline": threading.active_count(), "peak": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen["peak"] = max(seen["peak"], threading.active_count())
            done.wait(0.001)

    sampler = threading.Thread(target=sample, name="bench-sampler", daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join(5)


async def _users(plan: Plan, url: str, reuse: bool) -> dict[str, float]:
    """Every user's turns, at most ``plan.concurrency`` users at a time; counts and blocking build times."""
    gate = asyncio.Semaphore(plan.concurrency)
    counts = {"turns": 0.0, "injected": 0.0, "store_build_s": 0.0, "agent_build_s": 0.0}
    pool = MembaseStorePool(lambda user_id: user_id, base_url=url) if reuse else None

    async def user(number: int) -> None:
        async with gate:
            for _ in range(plan.user_turns):
                started = time.perf_counter()
                if pool is not None:
                    store = pool.store_for(f"user-{number}")  # the user's id is its key here
                else:
                    store = MembaseMemoryStore(api_key=f"user-{number}", base_url=url)
                built = time.perf_counter()
                counts["store_build_s"] += built - started
                model = ScriptedModel()
                agent = Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None)
                counts["agent_build_s"] += time.perf_counter() - built
                try:
                    await agent.invoke_async(QUESTION)
                finally:
                    if pool is None:
                        store.close()
                counts["turns"] += 1
                counts["injected"] += model.memory_block() is not None

    try:
        await asyncio.gather(*(user(n) for n in range(plan.users)))
    finally:
        if pool is not None:
            pool.close()
    return counts


def run(plan: Plan) -> Section:
    """Run every user's turns twice, with a fresh store per turn and with one store per user."""
    total = plan.users * plan.user_turns
    section = Section(
        NUMBER,
        "Many users over real HTTP",
        f"A loopback server in a child process (stdlib `ThreadingHTTPServer`, HTTP/1.1 keep-alive, "
        f"Content-Length, TCP_NODELAY) answers `POST /v1/search` and `GET /v1/containers` after a "
        f"{SERVER_LATENCY_MS:g} ms sleep. {plan.users} users x {plan.user_turns} turns each, through "
        f"`strands.Agent` (scripted model, `invoke_async`), at most {plan.concurrency} users at a time "
        "on one event loop; each user's turns run one after another, and each turn builds its `Agent`. "
        'Either a fresh store per turn (`MembaseMemoryStore(api_key=f"user-{i}", base_url=...)`, closed after '
        "the turn) or one store per user reused for all that user's turns, handed out by the library's "
        "`MembaseStorePool(credential_for, base_url=...)` (all closed at the end). "
        "Connections are counted where the server accepts them.",
        [
            "mode",
            "wall (s)",
            "turns/s",
            "TCP connections",
            "per user",
            "search requests",
            "peak threads",
            "injected",
            "building stores (s)",
            "building Agents (s)",
        ],
    )
    server = ServerProcess(SERVER_LATENCY_MS)
    try:
        results = {}
        for mode, reuse in (("fresh store per turn", False), ("store reused per user (`MembaseStorePool`)", True)):
            server.reset()
            gc.collect()
            with thread_peak() as threads:
                started = time.perf_counter()
                counts = asyncio.run(_users(plan, server.url, reuse))
                wall = time.perf_counter() - started
            stats = server.stats()
            results[reuse] = (wall, stats, counts)
            section.row(
                mode,
                fmt(wall),
                fmt(counts["turns"] / wall),
                stats["connections"],
                fmt(stats["connections"] / plan.users),
                stats["requests"],
                f"{threads['peak']} (baseline {threads['baseline']})",
                f"{counts['injected']:.0f}/{total}",
                fmt(counts["store_build_s"]),
                fmt(counts["agent_build_s"]),
            )
            key = "reused" if reuse else "fresh"
            name = "store reused per user" if reuse else mode
            section.figure(f"{key}_wall_s", f"{plan.users}x{plan.user_turns} turns, {name}", wall, "s", floor=0.5)
            section.figure(f"{key}_connections", f"TCP connections, {name}", stats["connections"], "connections")
            section.figure(f"{key}_peak_threads", f"peak threads, {name}", threads["peak"], "threads", floor=4)
    finally:
        server.stop()
    wall_fresh, fresh_stats, fresh_counts = results[False]
    wall_reused, reused_stats, reused_counts = results[True]
    section.target(
        "reused per-user stores open one connection per user, not one per turn",
        reused_stats["connections"] <= plan.users,
        f"{reused_stats['connections']} connections for {plan.users} users and {total} turns "
        f"(fresh stores: {fresh_stats['connections']})",
    )
    section.target(
        "every turn recalled and injected memory",
        reused_counts["injected"] == total and fresh_counts["injected"] == total,
        f"{fresh_counts['injected']:.0f} and {reused_counts['injected']:.0f} of {total}",
    )
    requests = max(fresh_stats["requests"], reused_stats["requests"])
    section.notes.append(_where_the_time_goes(plan, requests, wall_fresh, wall_reused, fresh_counts, reused_counts))
    section.notes.append(
        "Peak threads count the whole client process: the main thread, the sampler, Strands' per-Agent "
        "initialisation thread and one `membase-recall` daemon thread per recall in flight (at most one per "
        "concurrent user). The server's threads are in its own process."
    )
    return section


def _where_the_time_goes(
    plan: Plan, requests: int, wall_fresh: float, wall_reused: float, fresh: dict[str, float], reused: dict[str, float]
) -> str:
    """The note comparing both modes, every claim in it computed from this run's figures."""
    ratio = wall_fresh / wall_reused
    faster = f"x{ratio:.1f} faster" if ratio >= 1 else f"x{1 / ratio:.1f} slower"
    saved = wall_fresh - wall_reused
    building = fresh["store_build_s"] - reused["store_build_s"]
    share = f", {building / saved * 100:.0f} % of the {fmt(saved)} s it saved" if saved > 0 and building > 0 else ""
    waiting = requests * SERVER_LATENCY_MS / 1000 / plan.concurrency  # the server sleeps per request, users overlap
    return (
        f"Reusing each user's store was {faster} in this run. Building the stores blocked the event loop for "
        f"{fmt(fresh['store_build_s'])} s with a fresh store per turn against {fmt(reused['store_build_s'])} s "
        f"with one per user{share}; section 5 measures what building one store costs. Building a `strands.Agent` "
        f"per turn (the same in both modes) blocked it for {fmt(fresh['agent_build_s'])} s and "
        f"{fmt(reused['agent_build_s'])} s, while the server's {SERVER_LATENCY_MS:g} ms for each of {requests} "
        f"requests comes to about {fmt(waiting)} s of waiting with {plan.concurrency} users at a time."
    )

"""Section 4, many users over real HTTP: a fresh store per turn against one store per user, then a server.

A loopback server in a child process (``benchmarks/_server.py``) answers the Membase routes after a
few milliseconds and counts the TCP connections it accepts. Many users' turns run through
``strands.Agent`` on one event loop, a bounded number of users at a time. Then the server pattern:
every user at once on one loop, each with its pooled store, with an agent kept per user or built per turn.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from report import ROOT, Section, fmt, spread
from strands import Agent
from strands.memory import MemoryManager
from support import QUESTION, Plan, ServerProcess, median, no_library_threads, thread_peak

from membase_strands import MembaseMemoryStore, MembaseStorePool
from membase_strands.testing import ScriptedModel

NUMBER = 4
SERVER_LATENCY_MS = 3.0
PATTERN_LATENCY_MS = 20.0
PATTERN_THREADS_TARGET = 8
SPEEDUP_TARGET = 1.2
BEFORE_ROUNDS = 3
PROBE = Path(__file__).resolve().parent.parent / "_pattern_probe.py"


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
                        await store.aclose()
                counts["turns"] += 1
                counts["injected"] += model.memory_block() is not None

    try:
        await asyncio.gather(*(user(n) for n in range(plan.users)))
    finally:
        if pool is not None:
            await pool.aclose()
    return counts


async def _server_pattern(plan: Plan, url: str, agent_per_turn: bool) -> dict[str, float]:
    """Every user at once on this loop, each with its pooled store; an Agent kept per user or built per turn."""
    counts = {"turns": 0.0, "injected": 0.0, "store_build_s": 0.0, "agent_build_s": 0.0}
    pool = MembaseStorePool(lambda user_id: user_id, base_url=url)

    async def user(number: int) -> None:
        agent, model = None, ScriptedModel()
        for _ in range(plan.user_turns):
            started = time.perf_counter()
            store = pool.store_for(f"user-{number}")  # per request, as an app serving many users does
            built = time.perf_counter()
            counts["store_build_s"] += built - started
            if agent is None or agent_per_turn:
                model = ScriptedModel()
                agent = Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None)
                counts["agent_build_s"] += time.perf_counter() - built
            agent.messages.clear()
            model.calls.clear()
            await agent.invoke_async(QUESTION)
            counts["turns"] += 1
            counts["injected"] += model.memory_block() is not None

    try:
        await asyncio.gather(*(user(n) for n in range(plan.users)))
    finally:
        if hasattr(pool, "aclose"):
            await pool.aclose()
        else:  # the library before it had aclose() (the before-and-after probe runs it too)
            pool.close()
    return counts


def _threads_cell(threads: dict[str, int]) -> str:
    return f"{threads['peak']} (library {threads['library_peak']}, baseline {threads['baseline']})"


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
            gc.collect()  # first: collecting the previous mode's stores closes their clients on library threads
            no_library_threads()
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
                _threads_cell(threads),
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
    pattern = _run_server_pattern(plan, section)
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
        "initialisation thread and the library's own ('library' counts them at their peak): the I/O loop's "
        "`membase-io`, where every store built from a key awaits its recall, and worker threads for anything "
        "else (writes, closing), each kept a few seconds for the next call. The server's threads are in its "
        "own process."
    )
    _pattern_targets(plan, section, pattern)
    _before_and_after(plan, section)
    return section


@dataclass(frozen=True)
class PatternRun:
    """One mode of the server pattern: its wall time, the server's counts, the turns' counts, threads at peak."""

    wall: float
    stats: dict[str, int]
    counts: dict[str, float]
    threads: dict[str, int]

    @property
    def turns_per_s(self) -> float:
        return self.counts["turns"] / self.wall


def _run_server_pattern(plan: Plan, section: Section) -> dict[bool, PatternRun]:
    """The server pattern's two modes (Agent per user, Agent per turn) on a slower server; rows and figures."""
    server = ServerProcess(PATTERN_LATENCY_MS)
    runs = {}
    try:
        for agent_per_turn in (False, True):
            server.reset()
            gc.collect()  # first: collecting the previous mode's stores closes their clients on library threads
            no_library_threads()
            with thread_peak() as threads:
                started = time.perf_counter()
                counts = asyncio.run(_server_pattern(plan, server.url, agent_per_turn))
                wall = time.perf_counter() - started
            run = runs[agent_per_turn] = PatternRun(wall, server.stats(), counts, threads)
            how = "a new `Agent` per turn" if agent_per_turn else "one `Agent` per user"
            section.row(
                f"server pattern: all {plan.users} users at once, {PATTERN_LATENCY_MS:g} ms server, {how}",
                fmt(wall),
                fmt(run.turns_per_s),
                run.stats["connections"],
                fmt(run.stats["connections"] / plan.users),
                run.stats["requests"],
                _threads_cell(threads),
                f"{counts['injected']:.0f}/{counts['turns']:.0f}",
                fmt(counts["store_build_s"]),
                fmt(counts["agent_build_s"]),
            )
            key = "pattern_per_turn" if agent_per_turn else "pattern"
            name = f"server pattern, {'Agent per turn' if agent_per_turn else 'Agent per user'}"
            section.figure(f"{key}_turns_s", f"turns/s, {name}", run.turns_per_s, "turns/s", better="higher", floor=20)
            section.figure(f"{key}_peak_threads", f"peak threads, {name}", threads["peak"], "threads", floor=4)
            section.figure(
                f"{key}_library_threads", f"peak library threads, {name}", threads["library_peak"], "threads", floor=4
            )
    finally:
        server.stop()
    return runs


def _pattern_targets(plan: Plan, section: Section, runs: dict[bool, PatternRun]) -> None:
    for agent_per_turn, run in runs.items():
        how = "a new Agent per turn" if agent_per_turn else "one Agent per user"
        section.target(
            f"server pattern with {how}: at most {PATTERN_THREADS_TARGET} threads at peak",
            run.threads["peak"] <= PATTERN_THREADS_TARGET,
            f"{run.threads['peak']} at peak, {run.threads['library_peak']} of them the library's "
            f"({run.turns_per_s:.0f} turns/s)",
        )
        section.target(
            f"server pattern with {how}: one connection per user, every turn injected",
            run.stats["connections"] <= plan.users and run.counts["injected"] == run.counts["turns"],
            f"{run.stats['connections']} connections for {plan.users} users; "
            f"{run.counts['injected']:.0f}/{run.counts['turns']:.0f} injected",
        )


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


def _before_and_after(plan: Plan, section: Section) -> None:
    """The server pattern on the library at ``plan.before`` and as it is now, one process each, interleaved."""
    if not plan.before:
        return
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", plan.before, "src"], capture_output=True, check=True
        )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        sources = {plan.before: Path(tmp) / "src", "now": ROOT / "src"}
        server = ServerProcess(PATTERN_LATENCY_MS)
        try:
            for agent_per_turn in (False, True):
                runs = _interleaved_probes(plan, server, sources, agent_per_turn)
                _before_and_after_rows(plan, section, runs, agent_per_turn)
        finally:
            server.stop()


def _interleaved_probes(
    plan: Plan, server: ServerProcess, sources: dict[str, Path], agent_per_turn: bool
) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in sources}
    labels = list(sources)
    for round_ in range(BEFORE_ROUNDS):
        for label in labels if round_ % 2 == 0 else labels[::-1]:
            server.reset()
            command = [sys.executable, str(PROBE), str(sources[label]), server.url, str(plan.users)]
            command += [str(plan.user_turns), "1" if agent_per_turn else "0"]
            probe = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
            result = json.loads(probe.stdout.strip().splitlines()[-1])
            if Path(result["src"]).resolve() != sources[label].resolve():
                raise RuntimeError(f"the probe loaded membase_strands from {result['src']}, not {sources[label]}")
            result.update(server.stats())
            runs[label].append(result)
    return runs


def _before_and_after_rows(
    plan: Plan, section: Section, runs: dict[str, list[dict[str, float]]], agent_per_turn: bool
) -> None:
    how = "a new `Agent` per turn" if agent_per_turn else "one `Agent` per user"
    before, now = (median_of(runs[label], "turns_s") for label in runs)
    for label, results in runs.items():
        name = f"the library at {label}" if label != "now" else "the library now"
        section.row(
            f"server pattern, {how}, {name} ({BEFORE_ROUNDS} runs, one process each, interleaved)",
            "",
            f"{fmt(median_of(results, 'turns_s'))} ({spread([r['turns_s'] for r in results])})",
            f"{median_of(results, 'connections'):.0f}",
            fmt(median_of(results, "connections") / plan.users),
            f"{median_of(results, 'requests'):.0f}",
            f"{median_of(results, 'peak_threads'):.0f} (library {median_of(results, 'library_threads'):.0f})",
            f"{median_of(results, 'injected'):.0f}/{median_of(results, 'turns'):.0f}",
            "",
            "",
        )
    key = "pattern_per_turn" if agent_per_turn else "pattern"
    section.figure(f"{key}_speedup", f"turns/s now over {plan.before}, {how}", now / before, "x", better="higher")
    section.target(
        f"server pattern with {how}: at least {SPEEDUP_TARGET:g} x the turns per second of {plan.before} "
        "(before the performance work)",
        now >= SPEEDUP_TARGET * before,
        f"x{now / before:.2f}: {fmt(now)} turns/s against {fmt(before)} (medians of {BEFORE_ROUNDS} interleaved runs)",
    )


def median_of(results: list[dict[str, float]], key: str) -> float:
    return median([float(result[key]) for result in results])

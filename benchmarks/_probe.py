"""One measurement in a fresh process, on one candidate::

    python benchmarks/_probe.py MODE CANDIDATE URL JSON_OPTIONS

``CANDIDATE`` is ``now`` (the library: this checkout's ``src``, put first on ``sys.path``) or ``reference`` (the
reference adapter, ``reference.py``); Strands, the SDK and httpx are the same for both. A probe uses only the
library's public API: ``MembaseMemoryStore(api_key=..., base_url=...)``, ``MembaseStorePool``, ``store.search``
and the testing kit (``ScriptedModel``, ``InMemoryMembase``). ``URL`` is the loopback server (``_server.py``).
Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
QUESTION = "Which database did we choose for the ledger?"
SLOW_US = 2000.0
NOW, REFERENCE = "now", "reference"


def library_threads() -> int:
    """The library's live threads: those whose names start with ``membase-``."""
    return sum(t.name.startswith("membase-") for t in threading.enumerate())


@contextmanager
def peak_threads() -> Iterator[dict[str, int]]:
    """The library's threads and all threads at their peaks while inside, sampled every millisecond."""
    seen = {"library": 0, "all": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            seen["library"] = max(seen["library"], library_threads())
            seen["all"] = max(seen["all"], threading.active_count())

    sampler = threading.Thread(target=sample, name="bench-sampler", daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join(5)


def store_of(candidate: str, key: str, url: str, **options: Any) -> Any:
    """A store of ``candidate`` built from ``key``; ``options`` go to the library's store only (the reference has
    none: no time box)."""
    key = f"mb_bench_key_{key}"  # as long as a key must be (13 characters or more)
    if candidate == NOW:
        from membase_strands import MembaseMemoryStore

        return MembaseMemoryStore(api_key=key, base_url=url, **options)
    from reference import ReferenceMembaseStore

    return ReferenceMembaseStore(api_key=key, base_url=url)


def pool_of(candidate: str, url: str) -> Any:
    """Per-user stores, the user's id as its key: the library's ``MembaseStorePool``, or the reference's dict."""
    if candidate == NOW:
        from membase_strands import MembaseStorePool

        return MembaseStorePool(lambda user_id: f"mb_bench_key_{user_id}", base_url=url)
    from reference import ReferenceStores

    return ReferenceStores(url)


def alternate(raw: Any, store: Any, calls: int) -> dict[str, Any]:
    """``calls`` raw ``client.search(q, limit=5)`` and ``await store.search(q)``, one of each in turn (the order
    alternating) after a warm-up of a quarter as many: the medians, and the share of calls over 2 ms."""
    warmup = calls // 4
    times: dict[str, list[float]] = {"raw": [], "store": []}
    hits = 0

    async def measure() -> None:
        nonlocal hits
        for index in range(warmup + calls):
            for which in ("raw", "store") if index % 2 else ("store", "raw"):
                started = time.perf_counter_ns()
                if which == "raw":
                    raw.search(QUESTION, limit=5)
                else:
                    hits += bool(await store.search(QUESTION)) and index >= warmup
                if index >= warmup:
                    times[which].append((time.perf_counter_ns() - started) / 1000)

    gc.collect()
    asyncio.run(measure())
    out: dict[str, Any] = {"hits": hits, "calls": calls}
    for which, values in times.items():
        out[f"{which}_us"] = statistics.median(values)
        out[f"{which}_slow"] = sum(v > SLOW_US for v in values) / len(values)
    return out


def recall(url: str, candidate: str, calls: int, mock: bool = True) -> dict[str, Any]:
    """The floor (the raw SDK call) and the candidate's recall over the loopback server; then, with ``mock``, the
    same over the testing kit's ``httpx.MockTransport`` instead of sockets (its figures prefixed ``mock_``)."""
    import membase

    raw = membase.Membase(api_key="user-raw", base_url=url)
    store = store_of(candidate, "user-store", url)
    try:
        out = alternate(raw, store, calls)
    finally:
        store.close()
        raw.close()
    if mock:
        out.update({f"mock_{key}": value for key, value in mock_recall(candidate, calls).items()})
    return out


def mock_recall(candidate: str, calls: int) -> dict[str, Any]:
    """:func:`alternate` over an ``InMemoryMembase`` that answers every search with the loopback server's body."""
    import httpx
    from _server import SEARCH_ANSWER
    from common import kit_client

    from membase_strands.testing import InMemoryMembase

    fake = InMemoryMembase()
    json_type = {"content-type": "application/json"}
    fake.always("POST", "/v1/search", lambda request: httpx.Response(200, content=SEARCH_ANSWER, headers=json_type))
    raw = kit_client(fake)
    if candidate == NOW:
        store: Any = fake.store()  # built from the kit's key, as in production
    else:
        from reference import ReferenceMembaseStore

        store = ReferenceMembaseStore(client=kit_client(fake))
    try:
        return alternate(raw, store, calls)
    finally:
        store.close()
        raw.close()


def pattern(url: str, candidate: str, users: int, turns: int, idle_s: float) -> dict[str, Any]:
    """The server pattern: every user at once on one loop, a new Agent per turn over the user's pooled store;
    then ``idle_s`` idle with the pool open, as a server between requests. ``building_s``: the time the loop spent
    building stores (on the loop, as a handler would)."""
    from strands import Agent
    from strands.memory import MemoryManager

    from membase_strands.testing import ScriptedModel

    counts = {"turns": 0, "injected": 0}
    building = 0.0

    async def run() -> tuple[float, dict[str, int], int]:
        pool = pool_of(candidate, url)

        async def user(number: int) -> None:
            nonlocal building
            for _ in range(turns):
                model = ScriptedModel()
                started = time.perf_counter()
                store = pool.store_for(f"user-{number}")
                building += time.perf_counter() - started
                agent = Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None)
                await agent.invoke_async(QUESTION)
                counts["turns"] += 1
                counts["injected"] += model.memory_block() is not None

        with peak_threads() as peak:
            started = time.perf_counter()
            await asyncio.gather(*(user(n) for n in range(users)))
            wall = time.perf_counter() - started
        if candidate == NOW:  # the reference starts no thread of its own: nothing to wait for
            await asyncio.sleep(idle_s)
        idle = library_threads()
        await pool.aclose()
        return wall, peak, idle

    wall, peak, idle = asyncio.run(run())
    return {
        **counts,
        "turns_s": counts["turns"] / wall,
        "building_s": building,
        "peak_library": peak["library"],
        "peak_all": peak["all"],
        "idle_library": idle,
    }


def burst(url: str, candidate: str, recalls: int, others: int, budget: float) -> dict[str, Any]:
    """``recalls`` recalls at once on one store; meanwhile a second user's store recalls ``others`` times in a row.
    ``budget`` is the library's ``recall_timeout`` (the reference has no time box)."""
    crowded = store_of(candidate, "user-crowded", url, recall_timeout=budget)
    other = store_of(candidate, "user-other", url, recall_timeout=budget)

    async def timed(store: Any) -> tuple[bool, float]:
        started = time.perf_counter()
        try:
            hit = bool(await store.search(QUESTION))
        except Exception:  # noqa: BLE001 - a recall that ran out of budget returned no memory
            hit = False
        return hit, time.perf_counter() - started

    async def in_a_row() -> list[tuple[bool, float]]:
        return [await timed(other) for _ in range(others)]

    async def run() -> tuple[list[tuple[bool, float]], list[tuple[bool, float]], dict[str, int]]:
        await timed(crowded)  # each user's first connection opens outside the figures
        await timed(other)
        with peak_threads() as peak:
            # The burst's recalls are started first, so the other user's first recall comes in behind all of them.
            crowd, row = await asyncio.gather(asyncio.gather(*(timed(crowded) for _ in range(recalls))), in_a_row())
        return crowd, row, peak

    try:
        crowd, row, peak = asyncio.run(run())
    finally:
        crowded.close()
        other.close()
    returned = [seconds for hit, seconds in crowd if hit]
    return {
        "recalls": recalls,
        "returned": len(returned),
        "median_s": statistics.median(returned) if returned else float("nan"),
        "worst_s": max(returned, default=float("nan")),
        "other_returned": sum(hit for hit, _ in row),
        "other_worst_s": max(seconds for _, seconds in row),
        "peak_library": peak["library"],
        "peak_all": peak["all"],
    }


def sockets(url: str, candidate: str, users: int, at_once: int, idle_s: float) -> dict[str, Any]:
    """One turn per pooled user, ``at_once`` at a time, then ``idle_s`` idle with the pool open; the sockets open
    to the server counted from both ends, right after the turns, each second while idle and after ``pool.close()``.
    The library only (``candidate`` must be ``now``).
    """
    if candidate != NOW:
        raise ValueError("the sockets probe measures the library only")
    from strands import Agent
    from strands.memory import MemoryManager

    from membase_strands import MembaseStorePool
    from membase_strands.testing import ScriptedModel

    port = int(url.rsplit(":", 1)[1])
    counts: list[dict[str, float]] = []
    injected = 0

    def count(since: float) -> None:
        here = own_sockets_to(port)  # first: asking the server opens (and closes) a socket of its own
        with urllib.request.urlopen(url + "/_stats", timeout=10) as answer:
            there = json.loads(answer.read())["open_now"]
        counts.append({"at_s": round(time.monotonic() - since, 1), "here": here, "there": there})

    async def run() -> None:
        nonlocal injected
        gate = asyncio.Semaphore(at_once)
        pool = MembaseStorePool(lambda user_id: f"mb_bench_key_{user_id}", base_url=url, max_stores=users)

        async def user(number: int) -> None:
            nonlocal injected
            async with gate:
                model = ScriptedModel()
                store = pool.store_for(f"user-{number}")
                agent = Agent(model=model, memory_manager=MemoryManager(stores=[store]), callback_handler=None)
                await agent.invoke_async(QUESTION)
                injected += model.memory_block() is not None

        await asyncio.gather(*(user(n) for n in range(users)))
        ended = time.monotonic()
        count(ended)
        for second in range(1, int(idle_s) + 1):
            await asyncio.sleep(max(0.0, ended + second - time.monotonic()))
            count(ended)
        await pool.aclose()
        await asyncio.sleep(0.5)  # the server sees a closed connection a moment after the client closes it
        count(ended)

    asyncio.run(run())
    return {"users": users, "injected": injected, "counts": counts}


def own_sockets_to(port: int) -> int:
    """This process's open TCP sockets whose remote port is ``port``: its socket descriptors (``/proc/self/fd``)
    matched with the TCP tables of its network namespace (which also list the server's ends). Linux only."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
        found += sum(int(r.split()[2].rsplit(":", 1)[1], 16) == port and r.split()[9] in inodes for r in rows)
    return found


def rss(url: str, candidate: str, count: int) -> dict[str, Any]:
    """Resident memory per idle store built from a key (no request), after ``gc.collect()``."""

    def resident_kib() -> int:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0])

    warm = [store_of(candidate, f"warm-{i}", url) for i in range(2)]  # one-time caches, imports
    gc.collect()
    before = resident_kib()
    started = time.perf_counter()
    stores = [store_of(candidate, f"user-{i}", url) for i in range(count)]
    build_s = time.perf_counter() - started
    gc.collect()
    kib = (resident_kib() - before) / len(stores)
    return {"kib_per_store": kib, "build_ms": build_s / count * 1000, "stores": len(stores) + len(warm)}


MODES: dict[str, Callable[..., dict[str, Any]]] = {
    "recall": recall,
    "pattern": pattern,
    "burst": burst,
    "sockets": sockets,
    "rss": rss,
}


def main() -> None:
    mode, candidate, url, options = sys.argv[1:5]
    if candidate not in (NOW, REFERENCE):
        raise SystemExit(f"unknown candidate {candidate!r}: {NOW} or {REFERENCE}")
    sys.path.insert(0, str(BENCHMARKS.parent / "src"))  # the library now is this checkout's src, whatever is installed
    logging.disable(logging.CRITICAL)  # recalls that run out of time and the like are expected here
    import membase_strands

    result = MODES[mode](url, candidate, **json.loads(options))
    result["src"] = str(Path(membase_strands.__file__).resolve().parents[1])
    print(json.dumps(result))


if __name__ == "__main__":
    main()

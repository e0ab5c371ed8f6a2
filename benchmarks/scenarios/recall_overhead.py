"""Section 1, recall overhead: what ``await store.search(q)`` adds to the ``client.search(q, limit=5)`` it wraps.

First on a zero-latency ``httpx.MockTransport`` answering a fixed three-passage body, with a store given
that client (so its recall runs on a worker thread): the store's time covers its hand-off to the worker
and back, the parse and the ``MemoryEntry``s. The same trials
then time the recall step by step (the bare hand-off, the request on the store's workers and on a
fresh thread per call, the parse), and a missed target adds cProfile tables. Then over real sockets:
the loopback server (``_server.py``) in a child process, with keep-alive, calls interleaved one by one,
quiet and beside two busy processes, for a store built from a key (its recall awaited on the I/O loop)
and for a store given a client (on a worker). Last, the store's own code on a 50 x 1 MB answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import json
import pstats
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import membase
from report import Section, fmt, spread, this_machine
from strands.memory import MemoryEntry
from support import (
    QUESTION,
    SEARCH_BODY,
    Plan,
    ServerProcess,
    busy_processes,
    fixed_answer,
    median,
    mock_client,
    time_calls_us,
)

from membase_strands import MembaseMemoryStore
from membase_strands.testing import API_KEY

NUMBER = 1
OVERHEAD_TARGET_US = 150.0
LOOPBACK_TARGET_US = 200.0
SLOW_CALL_US = 2000.0
SLOW_SHARE_TARGET = 0.05
BIG_PASSAGES = 50
BIG_PASSAGE_CHARS = 1024 * 1024
BIG_ANSWER_TARGET_MS = 15.0

T = TypeVar("T")


@dataclass(frozen=True)
class RecallSteps:
    """The pieces one recall is made of, to time them one at a time."""

    request: Callable[[], Any]
    """The store's blocking recall on the calling thread: one attempt, the request and the parse."""
    entries: Callable[[Any], list[MemoryEntry]]
    """A parsed answer -> the entries the manager injects."""
    parse: Callable[[Any], Any]
    """A decoded search answer -> a parsed one."""
    shown: Callable[[Any, int], list[MemoryEntry]]
    """A decoded search answer and a limit -> the entries the store injects: everything the store does with an
    answer (parse, order and fold, cut to the limit and the recall budget, entries)."""
    submit: Callable[[Callable[[], object], str], Future[object]]
    """The store's hand-off: run a function on its worker threads (the name is the worker's while it runs)."""
    wait: Callable[[Future[object], float | None], Awaitable[object]]
    """Await such a call's future on the running loop, within a budget."""


def recall_steps(client: membase.Membase) -> RecallSteps:
    """The store's own pieces of one recall of :data:`QUESTION` with a limit of 5, through the library's
    internal door to Membase (the gateway) over ``client``: the one place the benchmarks use private modules."""
    from dataclasses import replace

    from membase_strands._formatting import arrange, fit_to_budget, memory_entries, parse_search
    from membase_strands._gateway import MembaseGateway
    from membase_strands._options import DEFAULT_RECALL_CHARS
    from membase_strands._workers import start_daemon, wait_for_future

    def shown(body: Any, limit: int) -> list[MemoryEntry]:
        # What store.search does with an answer once the request is back (see MembaseMemoryStore.search),
        # with the store's defaults: no floor, the default recall budget.
        answer = arrange(parse_search(body))
        answer = replace(answer, passages=answer.passages[: max(0, limit - len(answer.unsearched))])
        return memory_entries(fit_to_budget(answer, DEFAULT_RECALL_CHARS))

    gateway = MembaseGateway(client=client)
    return RecallSteps(
        request=lambda: gateway.search(QUESTION, 5, None, retry=False),
        entries=memory_entries,
        parse=parse_search,
        shown=shown,
        submit=lambda fn, name: start_daemon(fn, name=name),
        wait=wait_for_future,
    )


def fresh_thread(fn: Callable[[], T]) -> Future[T]:
    """Run ``fn`` on a new daemon thread of its own: how the store ran each recall before it had workers."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as error:  # noqa: BLE001 - handed to the waiter
            future.set_exception(error)

    threading.Thread(target=run, name="bench-fresh", daemon=True).start()
    return future


async def _store_calls_us(store: MembaseMemoryStore, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter_ns()
        await store.search(QUESTION)
        times.append((time.perf_counter_ns() - started) / 1000)
    return times


async def _future_calls_us(steps: RecallSteps, start: Callable[[], Future[Any]], count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter_ns()
        await steps.wait(start(), 8.0)
        times.append((time.perf_counter_ns() - started) / 1000)
    return times


def _on_caller(steps: RecallSteps) -> None:
    """What ``store.search`` does, minus the thread: the request, the parse and the entries."""
    steps.entries(steps.request())


def _decomposition_trial(steps: RecallSteps, client: membase.Membase, count: int) -> dict[str, float]:
    """Where a recall's time goes, step by step (per-call medians in µs)."""
    inside_worker: list[float] = []
    inside_fresh: list[float] = []

    def timed(into: list[float]) -> Callable[[], object]:
        def request() -> object:
            started = time.perf_counter_ns()
            answer = client.search(QUESTION, limit=5)
            into.append((time.perf_counter_ns() - started) / 1000)
            return answer

        return request

    def via_worker(fn: Callable[[], object], name: str) -> Callable[[], Future[object]]:
        return lambda: steps.submit(fn, name)

    return {
        "caller": median(time_calls_us(lambda: _on_caller(steps), count)),
        "noop": median(asyncio.run(_future_calls_us(steps, via_worker(lambda: None, "membase-bench[noop]"), count))),
        "worker": median(
            asyncio.run(_future_calls_us(steps, via_worker(timed(inside_worker), "membase-bench[request]"), count))
        ),
        "fresh": median(asyncio.run(_future_calls_us(steps, lambda: fresh_thread(timed(inside_fresh)), count))),
        "inside_worker": median(inside_worker),
        "inside_fresh": median(inside_fresh),
    }


def _profile_table(title: str, profiler: cProfile.Profile, calls: int, top: int = 10) -> list[str]:
    """The top functions by own time, per recall, as a markdown table."""
    stats = pstats.Stats(profiler)
    entries = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # type: ignore[attr-defined]
    lines = [title, "", "| function | own µs per recall | calls per recall |", "| --- | --- | --- |"]
    for (file, line, name), (_, ncalls, own, _, _) in entries:
        where = f"{Path(file).name}:{line}({name})" if line else name
        lines.append(f"| `{where}` | {own / calls * 1e6:.1f} | {ncalls / calls:g} |")
    return [*lines, ""]


def _slower(delta_us: float) -> str:
    return f"{fmt(abs(delta_us))} µs {'slower' if delta_us >= 0 else 'faster'}"


def run(plan: Plan) -> Section:
    """Time the store's recall against the raw SDK call, then step by step."""
    section = Section(
        NUMBER,
        "Recall overhead",
        "`await store.search(q)` against the raw `client.search(q, limit=5)` it wraps, on a zero-latency "
        "`httpx.MockTransport` that answers a fixed three-passage JSON body (no word matching). "
        f"{plan.recall_trials} trials x {plan.recall_calls} calls each, after a warm-up; each figure is the "
        "median over trials of the per-trial median per call. The store is given its client (`client=`), so "
        "its recall runs on a worker thread: its time includes the hand-off to the worker and back, the parse "
        "and the `MemoryEntry` formatting. (A store built from a key awaits its recall on the I/O loop "
        "instead: timed below, over real sockets.)",
        ["path", "median µs/call", "per-trial medians"],
    )
    with mock_client(fixed_answer) as client:
        store = MembaseMemoryStore(client=client)  # default recall_timeout=8.0
        unboxed = MembaseMemoryStore(client=client, recall_timeout=None)
        try:
            _measure(plan, section, client, store, unboxed)
        finally:
            store.close()
            unboxed.close()
    _loopback(plan, section)
    _big_answer(plan, section)
    return section


def _measure(
    plan: Plan,
    section: Section,
    client: membase.Membase,
    store: MembaseMemoryStore,
    unboxed: MembaseMemoryStore,
) -> None:
    def raw_call() -> object:
        return client.search(QUESTION, limit=5)

    steps = recall_steps(client)
    time_calls_us(raw_call, 200)  # warm-up
    asyncio.run(_store_calls_us(store, 200))
    asyncio.run(_store_calls_us(unboxed, 200))
    raw, boxed, none = [], [], []
    trials: list[dict[str, float]] = []
    for _ in range(plan.recall_trials):
        gc.collect()
        raw.append(median(time_calls_us(raw_call, plan.recall_calls)))
        boxed.append(median(asyncio.run(_store_calls_us(store, plan.recall_calls))))
        none.append(median(asyncio.run(_store_calls_us(unboxed, plan.recall_calls))))
        trials.append(_decomposition_trial(steps, client, max(100, plan.recall_calls // 2)))
    raw_us, store_us, none_us = median(raw), median(boxed), median(none)
    added = store_us - raw_us
    section.row("raw `client.search(q, limit=5)`", fmt(raw_us), spread(raw))
    section.row("`await store.search(q)` (recall_timeout=8.0)", fmt(store_us), spread(boxed))
    section.row("`await store.search(q)` (recall_timeout=None)", fmt(none_us), spread(none))
    section.row(
        "**store adds** (median difference)",
        f"**{fmt(added)}**",
        spread([b - r for b, r in zip(boxed, raw, strict=True)]),
    )
    section.row("ratio store / raw", f"x{store_us / raw_us:.2f}", "")
    section.figure("raw_us", "raw client.search", raw_us, "µs", better="info", floor=10)
    section.figure("store_us", "store.search", store_us, "µs", floor=15, reference="1.raw_us")
    section.figure("added_us", "store adds over raw", added, "µs", floor=15)
    section.figure("none_us", "store.search, recall_timeout=None", none_us, "µs", floor=15, reference="1.raw_us")

    # Where the time goes: the same request, step by step, measured in the same trials.
    step = {key: median([t[key] for t in trials]) for key in trials[0]}

    def row(label: str, key: str) -> None:
        section.row(label, fmt(step[key]), spread([t[key] for t in trials]))

    handoff = step["noop"]
    on_worker = step["inside_worker"] - raw_us
    parse = step["caller"] - raw_us
    rest = added - handoff - on_worker - parse
    section.row("*where the time goes (same trials):*", "", "")
    row("store code on the caller's thread, no hand-off (request, parse, entries)", "caller")
    row("hand-off of a no-op to the store's workers (`start_daemon` + `wait_for_future`)", "noop")
    row("raw request through the store's workers", "worker")
    row("... the request's own time on the worker", "inside_worker")
    row("raw request on a fresh thread per call (the store before it had workers)", "fresh")
    row("... the request's own time on that fresh thread", "inside_fresh")
    section.figure("handoff_us", "hand-off of a no-op to a worker", handoff, "µs", floor=15)
    section.figure("parse_us", "parse and MemoryEntry formatting", parse, "µs", floor=10)
    section.figure("fresh_thread_us", "raw request on a fresh thread per call", step["fresh"], "µs", better="info")
    machine = this_machine()
    section.notes.append(
        f"Attribution of the {fmt(added)} µs the store adds: handing the call to a waiting worker and waking the "
        f"loop {fmt(handoff)} µs; the same SDK request runs {_slower(on_worker)} on the worker than on the "
        f"caller's thread; parsing the answer and building the `MemoryEntry`s {fmt(parse)} µs; the rest "
        f"({fmt(rest)} µs): the parse also runs on the worker, the context copy, the guard's lock, the limit "
        "check, and noise."
    )
    section.notes.append(
        f"A raw request costs {fmt(step['worker'])} µs through the store's workers against {fmt(step['fresh'])} µs "
        f"on a fresh thread per call (what the store did before it had workers), on {machine}."
    )
    why = f"adds {fmt(added)} µs (x{store_us / raw_us:.2f} the raw call)"
    if added > OVERHEAD_TARGET_US:
        # The reason, written beside the miss: the time box itself needs the request off the event loop.
        why += (
            f". Left so: the recall must run off the event loop (the time box), and handing it to a worker and "
            f"back costs {fmt(handoff)} µs on {machine}, with the SDK call {_slower(on_worker)} on the worker; "
            f"the store's own code adds {fmt(parse)} µs"
        )
    met = section.target(
        f"the store adds at most {OVERHEAD_TARGET_US:.0f} µs median per recall, thread hand-off included",
        added <= OVERHEAD_TARGET_US,
        why,
    )
    if not met:
        section.extra += _profiles(plan, store, steps)


# --- Over real sockets ----------------------------------------------------------------------------


async def _interleaved_us(
    raw: membase.Membase, stores: dict[str, MembaseMemoryStore], count: int
) -> dict[str, list[float]]:
    """``count`` raw calls, awaited raw requests and recalls of each store, one of each in turn (the order
    rotates), in µs. The awaited raw request is the I/O loop's own client awaited right here, with no hand-off:
    what the store's awaited path costs before it changes threads."""
    # The client the I/O loop builds for a store (private: how the store sends, with no store around it).
    from membase_strands._client import new_async_http_client

    awaited = new_async_http_client(str(raw.base_url))
    headers = {"Authorization": f"Bearer {API_KEY}", "Accept": "application/json"}

    async def awaited_raw() -> None:
        (await awaited.post("/v1/search", json={"q": QUESTION, "limit": 5}, headers=headers)).json()

    await awaited_raw()  # its connection opens outside the timings
    times: dict[str, list[float]] = {"raw": [], "awaited_raw": [], **{name: [] for name in stores}}
    order = list(times)
    try:
        for index in range(count):
            shift = index % len(order)
            for which in order[shift:] + order[:shift]:
                started = time.perf_counter_ns()
                if which == "raw":
                    raw.search(QUESTION, limit=5)
                elif which == "awaited_raw":
                    await awaited_raw()
                else:
                    await stores[which].search(QUESTION)
                times[which].append((time.perf_counter_ns() - started) / 1000)
    finally:
        await awaited.aclose()
    return times


def _loopback_trials(
    raw: membase.Membase, stores: dict[str, MembaseMemoryStore], trials: int, count: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-trial medians and every call's time, each by path (``raw`` and each store's name)."""
    medians: dict[str, list[float]] = {}
    every: dict[str, list[float]] = {}
    for _ in range(trials):
        gc.collect()
        for which, times in asyncio.run(_interleaved_us(raw, stores, count)).items():
            medians.setdefault(which, []).append(median(times))
            every.setdefault(which, []).extend(times)
    return medians, every


def _over(times: list[float], limit_us: float = SLOW_CALL_US) -> float:
    return sum(t > limit_us for t in times) / len(times) if times else float("nan")


LOOPBACK_PATHS = {
    "loop": "`await store.search(q)`, store built from a key (its recall awaited on the I/O loop)",
    "worker": "`await store.search(q)`, store given a `client=` (its recall on a worker thread)",
}


def _loopback(plan: Plan, section: Section) -> None:
    """The same comparison over real sockets with keep-alive, quiet and beside two busy processes."""
    count = max(100, plan.recall_calls // 2)
    server = ServerProcess(0.0)
    raw = membase.Membase(api_key=API_KEY, base_url=server.url)  # the SDK's own httpx.Client, keep-alive
    given = membase.Membase(api_key=API_KEY, base_url=server.url)
    stores = {
        "loop": MembaseMemoryStore(api_key=API_KEY, base_url=server.url),
        "worker": MembaseMemoryStore(client=given),
    }
    try:
        asyncio.run(_interleaved_us(raw, stores, 200))  # warm-up: connections open, workers and loop waiting
        medians, every = _loopback_trials(raw, stores, plan.recall_trials, count)
        with busy_processes(2):
            busy_medians, busy_every = _loopback_trials(raw, stores, max(2, plan.recall_trials // 2), count)
    finally:
        for store in stores.values():
            store.close()
        given.close()
        raw.close()
        server.stop()
    raw_us = median(medians["raw"])
    added = {which: [s - r for s, r in zip(medians[which], medians["raw"], strict=True)] for which in LOOPBACK_PATHS}
    slow = {which: _over(busy_every[which]) for which in busy_every}
    section.row(
        f"*over real sockets (loopback server, keep-alive), {count} interleaved calls per path per trial:*", "", ""
    )
    section.row("raw `client.search(q, limit=5)`", fmt(raw_us), spread(medians["raw"]))
    section.row(
        "the same request awaited on the I/O loop's own `httpx.AsyncClient`, here, no hand-off",
        fmt(median(medians["awaited_raw"])),
        spread(medians["awaited_raw"]),
    )
    for which, label in LOOPBACK_PATHS.items():
        section.row(label, fmt(median(medians[which])), spread(medians[which]))
        section.row(
            "... **store adds** (median of per-trial differences)",
            f"**{fmt(median(added[which]))}**",
            spread(added[which]),
        )
    section.row(
        f"calls over {SLOW_CALL_US / 1000:g} ms, quiet: raw / I/O loop / worker",
        " / ".join(f"{_over(every[which]) * 100:.1f} %" for which in ("raw", "loop", "worker")),
        "",
    )
    section.row(
        f"calls over {SLOW_CALL_US / 1000:g} ms beside two busy processes: raw / I/O loop / worker",
        " / ".join(f"{slow[which] * 100:.1f} %" for which in ("raw", "loop", "worker")),
        "medians " + " / ".join(fmt(median(busy_medians[which])) for which in ("raw", "loop", "worker")) + " µs",
    )
    loop_added, worker_added = median(added["loop"]), median(added["worker"])
    section.figure("loopback_raw_us", "raw client.search over loopback", raw_us, "µs", better="info", floor=50)
    section.figure(
        "loopback_store_us",
        "store.search over loopback (I/O loop)",
        median(medians["loop"]),
        "µs",
        floor=50,
        reference="1.loopback_raw_us",
    )
    section.figure("loopback_added_us", "store adds over raw, loopback (I/O loop)", loop_added, "µs", floor=30)
    section.figure("loopback_worker_added_us", "store adds over raw, loopback (worker)", worker_added, "µs", floor=30)
    section.figure(
        "loopback_busy_slow_pct",
        "recalls over 2 ms beside two busy processes (I/O loop)",
        slow["loop"] * 100,
        "%",
        floor=2,
    )
    section.figure(
        "loopback_worker_busy_slow_pct",
        "recalls over 2 ms beside two busy processes (worker)",
        slow["worker"] * 100,
        "%",
        floor=2,
    )
    awaited_raw = median(medians["awaited_raw"])
    section.figure("loopback_awaited_raw_us", "awaited raw request over loopback", awaited_raw, "µs", better="info")
    section.notes.append(
        f"Over loopback, of the {fmt(loop_added)} µs a store built from a key adds, {fmt(awaited_raw - raw_us)} µs is "
        f"httpx's async client itself: the same request awaited on it, with no change of thread, takes "
        f"{fmt(awaited_raw)} µs against {fmt(raw_us)} µs on the blocking client. The rest, "
        f"{fmt(loop_added - (awaited_raw - raw_us))} µs, is handing the recall to the I/O loop's thread and back, "
        "and the store's own code. The worker path keeps the blocking client, and a thread per request in flight; "
        "the I/O loop trades this for one thread however many requests are in flight (section 4)."
    )
    section.target(
        f"over loopback the store adds at most {LOOPBACK_TARGET_US:.0f} µs median per recall",
        loop_added <= LOOPBACK_TARGET_US,
        f"adds {fmt(loop_added)} µs on the I/O loop (a store built from a key) and {fmt(worker_added)} µs on a "
        f"worker (a store given a client) to a raw call of {fmt(raw_us)} µs",
    )
    section.target(
        f"beside two busy processes at most {SLOW_SHARE_TARGET * 100:.0f} % of recalls take over "
        f"{SLOW_CALL_US / 1000:g} ms",
        slow["loop"] <= SLOW_SHARE_TARGET,
        f"{slow['loop'] * 100:.1f} % on the I/O loop, {slow['worker'] * 100:.1f} % on a worker "
        f"(raw calls: {slow['raw'] * 100:.1f} %)",
    )


# --- A large answer -------------------------------------------------------------------------------


def big_answer() -> bytes:
    """50 passages of 1 MB each (plain text with line breaks, each its own), as Membase would send them."""
    line = "We chose Postgres for the ledger after weighing replication, backups and cost.\n"
    text = line * (BIG_PASSAGE_CHARS // len(line) + 1)
    results = [
        {"content": f"Passage {i}: {text}"[:BIG_PASSAGE_CHARS], "container": "ctr_main", "container_name": "Main"}
        for i in range(BIG_PASSAGES)
    ]
    return json.dumps({"results": results, "containers": [{"id": "ctr_main", "name": "Main"}]}).encode()


def _big_answer(plan: Plan, section: Section) -> None:
    """The store's own code on a 50 x 1 MB answer under the default recall budget, against the JSON parse."""
    body = big_answer()
    megabytes = len(body) / (1024 * 1024)
    with mock_client(fixed_answer) as client:
        store = MembaseMemoryStore(client=client)  # the default max_recall_chars
        steps = recall_steps(client)
        with contextlib.closing(store):
            decoded = json.loads(body)
            steps.shown(decoded, BIG_PASSAGES)  # warm-up
            repeats = 3 if plan.quick else 7
            store_ms, json_ms = [], []
            for _ in range(repeats):
                gc.collect()
                started = time.perf_counter()
                decoded = json.loads(body)  # what the SDK does with the answer (httpx's response.json())
                parsed = time.perf_counter()
                entries = steps.shown(decoded, BIG_PASSAGES)
                json_ms.append((parsed - started) * 1000)
                store_ms.append((time.perf_counter() - parsed) * 1000)
    shown_chars = sum(len(entry.content) for entry in entries)
    own, parse = median(store_ms), median(json_ms)
    section.row(
        f"*a {BIG_PASSAGES} x 1 MB answer ({megabytes:.0f} MB), default recall budget, {repeats} runs:*", "", ""
    )
    section.row("the SDK's JSON parse of the answer (ms)", fmt(parse), spread(json_ms))
    section.row("the store's own code on the parsed answer (ms)", fmt(own), spread(store_ms))
    section.row(
        "... per MB of answer: store / JSON parse (µs)",
        f"{fmt(own / megabytes * 1000)} / {fmt(parse / megabytes * 1000)}",
        "",
    )
    section.figure("big_answer_ms", f"store's own code on a {BIG_PASSAGES} x 1 MB answer", own, "ms", floor=2)
    section.figure("big_answer_json_ms", f"JSON parse of a {BIG_PASSAGES} x 1 MB answer", parse, "ms", better="info")
    section.target(
        f"a {BIG_PASSAGES} x 1 MB answer costs at most {BIG_ANSWER_TARGET_MS:g} ms in the store's own code, and "
        "less per MB than parsing its JSON",
        own <= BIG_ANSWER_TARGET_MS and own <= parse,
        f"{fmt(own)} ms ({fmt(own / megabytes * 1000)} µs per MB) against {fmt(parse)} ms to parse the JSON; "
        f"{len(entries)} entry of {shown_chars:,} characters shown",
    )


def _profiles(plan: Plan, store: MembaseMemoryStore, steps: RecallSteps) -> list[str]:
    """cProfile tables of the recall, of the store's code without the hand-off, and of its formatting alone."""
    profiler = cProfile.Profile()
    profiler.enable()
    asyncio.run(_store_calls_us(store, plan.recall_calls))
    profiler.disable()
    threads_seen = (
        "On Python 3.12+ cProfile is built on `sys.monitoring` and records every thread, so this covers "
        "the event loop and the worker thread; `lock.acquire` is mostly the worker waiting for its next call."
        if sys.version_info >= (3, 12)
        else "Before Python 3.12 cProfile records only the event-loop thread."
    )
    tables = _profile_table(
        f"cProfile of {plan.recall_calls} x `await store.search(q)`, top functions by own time. {threads_seen}",
        profiler,
        plan.recall_calls,
    )

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(plan.recall_calls):
        _on_caller(steps)
    profiler.disable()
    tables += _profile_table(
        "cProfile of the store's code on one thread, without the hand-off (SDK request, parse, entries):",
        profiler,
        plan.recall_calls,
    )

    body = json.loads(SEARCH_BODY)
    parse_only = median(time_calls_us(lambda: steps.entries(steps.parse(body)), plan.recall_calls))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(plan.recall_calls):
        steps.entries(steps.parse(body))
    profiler.disable()
    tables += _profile_table(
        f"cProfile of the store's own formatting alone (`parse_search` + `memory_entries` on the decoded "
        f"three-passage answer; {fmt(parse_only)} µs per recall unprofiled):",
        profiler,
        plan.recall_calls,
        top=8,
    )
    return tables

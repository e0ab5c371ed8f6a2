"""Sections 1-5: each figure taken in fresh processes (``_probe.py``), most of them on the library now and at
a3a13fd in turn, over the loopback server (``_server.py``) in a child process."""

from __future__ import annotations

from typing import Any

from common import (
    BEFORE,
    NOW,
    Plan,
    Section,
    ServerProcess,
    busy_processes,
    fmt,
    interleaved,
    median,
    of,
    probe,
    spread,
)
from in_process import mock_overhead

ADDED_RATIO_TARGET = 0.6
TURNS_RATIO_TARGET = 0.9
PEAK_THREADS_TARGET = 40
PATTERN_LATENCY_MS = 20.0
BURST_BUDGET_S = 3.0
OTHER_WORST_TARGET_S = 0.5
OTHER_RECALLS = 5
SOCKETS_TARGET = 50
AT_ONCE = 50


def recall_overhead(plan: Plan) -> Section:
    section = Section(
        1,
        "Recall overhead",
        "What `await store.search(q)` on a store built from a key adds to the raw SDK call it wraps "
        "(`membase.Membase(api_key=..., base_url=...).search(q, limit=5)`), over real sockets: the loopback server "
        f"answering a three-passage body at once, keep-alive. Each probe makes {plan.recall_calls} raw calls and "
        "recalls, one of each in turn after a warm-up; 'adds' is the probe's median recall minus its median raw "
        f"call. {plan.rounds} round(s), each a fresh process per library, the order alternating; medians. Then "
        f"one probe per library beside two busy processes ({plan.busy_calls} calls each): the share of calls "
        "over 2 ms. The rows 'store given client=' time a store given a ready client, interleaved the same way: at "
        f"{BEFORE} that store's recall ran on a worker thread, as every recall does now, so they show what the "
        "hand-off to a thread and back costs on this machine; the row 'no store' awaits the raw call on a thread of "
        "asyncio's default executor (`run_in_executor`): the least any hand-off costs.",
        [
            "library",
            "raw call µs",
            "recall µs",
            "store adds µs",
            "adds per round",
            "over 2 ms beside 2 busy: raw / recall",
        ],
    )
    with ServerProcess(0) as server:
        quiet = interleaved(plan.rounds, "recall", server.url, calls=plan.recall_calls)
        given = interleaved(plan.rounds, "recall", server.url, calls=plan.recall_calls, kind="given")
        on_thread = {"calls": plan.recall_calls, "kind": "thread"}
        threaded = [probe("recall", NOW, server.url, **on_thread) for _ in range(plan.rounds)]
        busy: dict[str, list[dict[str, Any]]] = {NOW: [], BEFORE: []}
        if plan.busy_calls:
            with busy_processes(2):
                busy = interleaved(1, "recall", server.url, calls=plan.busy_calls)
    added = {label: [r["store_us"] - r["raw_us"] for r in results] for label, results in quiet.items()}
    for label, results in quiet.items():
        slow = " / ".join(f"{r[key] * 100:.1f} %" for r in busy[label] for key in ("raw_slow", "store_slow"))
        raw, store = median(of(results, "raw_us")), median(of(results, "store_us"))
        section.row(label, fmt(raw), fmt(store), f"**{fmt(median(added[label]))}**", spread(added[label]), slow)
    for label, results in given.items():  # each library's recall on a thread: what a hand-off costs on this machine
        adds = [r["store_us"] - r["raw_us"] for r in results]
        raw, store = median(of(results, "raw_us")), median(of(results, "store_us"))
        section.row(f"{label}, store given client=", fmt(raw), fmt(store), fmt(median(adds)), spread(adds), "")
    adds = [r["store_us"] - r["raw_us"] for r in threaded]
    raw, thread = median(of(threaded, "raw_us")), median(of(threaded, "store_us"))
    section.row("no store: the raw call on a thread", fmt(raw), fmt(thread), fmt(median(adds)), spread(adds), "")
    raw_us, store_us = mock_overhead(plan.recall_calls)
    section.row("now, testing kit (MockTransport)", fmt(raw_us), fmt(store_us), fmt(store_us - raw_us))
    now, before = median(added[NOW]), median(added[BEFORE])
    section.target(
        f"a store built from a key adds at most {ADDED_RATIO_TARGET:g} x what {BEFORE}'s adds over loopback",
        now <= ADDED_RATIO_TARGET * before,
        f"x{now / before:.2f}: {fmt(now)} µs against {fmt(before)} µs (medians of {plan.rounds} round(s))",
    )
    missing = sum(r["calls"] - r["hits"] for results in quiet.values() for r in results)
    section.target("every recall measured returned memory", missing == 0, f"{missing} returned none")
    return section


def server_pattern(plan: Plan) -> Section:
    rounds = min(plan.rounds, 3)
    section = Section(
        2,
        "The server pattern",
        f"{plan.users} users at once on one event loop, {plan.user_turns} turns each; each turn builds a new "
        "`strands.Agent` (scripted model, `invoke_async`) over the user's store from one `MembaseStorePool` "
        f"(built from the user's key). The loopback server answers after {PATTERN_LATENCY_MS:g} ms. Library "
        "threads are those named `membase-...`, sampled every millisecond during the turns, and counted again "
        f"after {plan.idle_s:g} s idle with the pool open. {rounds} round(s), each a fresh process per library, "
        "the order alternating; medians over rounds (threads: the most in any round).",
        [
            "library",
            "turns/s",
            "per round",
            "peak library threads",
            f"library threads after {plan.idle_s:g} s idle",
            "turns with memory",
        ],
    )
    with ServerProcess(PATTERN_LATENCY_MS) as server:
        runs = interleaved(rounds, "pattern", server.url, users=plan.users, turns=plan.user_turns, idle_s=plan.idle_s)
    for label, results in runs.items():
        turns = of(results, "turns_s")
        injected = f"{sum(of(results, 'injected')):.0f}/{sum(of(results, 'turns')):.0f}"
        section.row(
            label,
            f"**{fmt(median(turns))}**",
            spread(turns),
            f"{max(of(results, 'peak_library')):.0f}",
            f"{max(of(results, 'idle_library')):.0f}",
            injected,
        )
    now, before = (median(of(runs[label], "turns_s")) for label in (NOW, BEFORE))
    section.target(
        f"at least {TURNS_RATIO_TARGET:g} x {BEFORE}'s turns per second",
        now >= TURNS_RATIO_TARGET * before,
        f"x{now / before:.2f}: {fmt(now)} turns/s against {fmt(before)}",
    )
    peak, idle = max(of(runs[NOW], "peak_library")), max(of(runs[NOW], "idle_library"))
    section.target(
        f"at most {PEAK_THREADS_TARGET} library threads at the peak", peak <= PEAK_THREADS_TARGET, f"{peak:.0f}"
    )
    section.target(f"no library thread after {plan.idle_s:g} s idle", idle == 0, f"{idle:.0f}")
    lost = sum(r["turns"] - r["injected"] for r in runs[NOW])
    section.target("every turn had memory injected", lost == 0, f"{lost} turn(s) without")
    return section


def burst(plan: Plan) -> Section:
    rounds = min(plan.rounds, 3)
    section = Section(
        3,
        f"{plan.burst} recalls at once on one store",
        f"One store built from a key (`recall_timeout={BURST_BUDGET_S:g}`) is asked for {plan.burst} recalls at "
        f"once on one event loop (several agents sharing it); a second user's store, on the same loop and server, "
        f"then recalls {OTHER_RECALLS} times in a row, its first recall started behind the whole burst. The "
        f"loopback server answers after {PATTERN_LATENCY_MS:g} ms. {rounds} round(s), each a fresh process per "
        "library, the order alternating; the worst round for counts and worst latencies, medians otherwise.",
        ["library", "returned memory", "median s", "worst s", "other user's worst s", "peak library threads"],
    )
    with ServerProcess(PATTERN_LATENCY_MS) as server:
        runs = interleaved(rounds, "burst", server.url, recalls=plan.burst, others=OTHER_RECALLS, budget=BURST_BUDGET_S)
    for label, results in runs.items():
        section.row(
            label,
            f"{min(of(results, 'returned')):.0f}/{plan.burst}",
            fmt(median(of(results, "median_s"))),
            fmt(max(of(results, "worst_s"))),
            fmt(max(of(results, "other_worst_s"))),
            f"{max(of(results, 'peak_library')):.0f}",
        )
    returned, other = min(of(runs[NOW], "returned")), max(of(runs[NOW], "other_worst_s"))
    section.target(
        f"all {plan.burst} recalls return memory within {BURST_BUDGET_S:g} s",
        returned == plan.burst,
        f"{returned:.0f} of {plan.burst} in the worst round",
    )
    section.target(
        f"the other user's recalls stay under {OTHER_WORST_TARGET_S:g} s",
        other < OTHER_WORST_TARGET_S,
        f"worst {fmt(other)} s",
    )
    return section


def idle_sockets(plan: Plan) -> Section:
    section = Section(
        4,
        "Idle sockets",
        f"{plan.socket_users:,} users, each with its store from one `MembaseStorePool` big enough to keep them all, "
        f"take one turn each (`strands.Agent`, scripted model), {AT_ONCE} at a time on one event loop, against the "
        "loopback server (3 ms). Then the loop idles with the pool open, and the sockets open to the server are "
        "counted from both ends: this process's TCP sockets to the server's port (`/proc/self/fd` matched with "
        "`/proc/self/net/tcp`, Linux only) and the connections the server holds open. The library now only.",
        ["when", "seconds after the turns", "open in the client", "open at the server"],
    )
    with ServerProcess(3.0) as server:
        result = probe("sockets", NOW, server.url, users=plan.socket_users, at_once=AT_ONCE, idle_s=plan.idle_s)
        accepted = server.stats()["connections"]
    *during, idle, closed = result["counts"]
    for when, count in (
        ("right after the turns", during[0]),
        ("idle, the pool open", idle),
        ("after `pool.aclose()`", closed),
    ):
        section.row(when, count["at_s"], count["here"], count["there"])
    section.notes.append(
        f"{accepted} connections accepted in all. While idle: "
        + ", ".join(f"{c['at_s']:g} s: {c['here']}/{c['there']}" for c in during)
    )
    if during[-1]["here"] >= during[0]["here"] > 0:
        section.notes.append(
            "The count did not fall while idle: httpx closes an expired idle connection only when its pool next "
            "sends, so what bounds it here is the shared pool's limit on idle connections kept for reuse."
        )
    if closed["here"]:
        section.notes.append(
            "`pool.aclose()` left them open: stores built from a key send through the process's shared connection "
            "pool for their base URL, which closing a store or a pool does not close."
        )
    most = max(idle["here"], idle["there"])
    section.target(
        f"at most {SOCKETS_TARGET} open sockets after {plan.idle_s:g} s idle",
        most <= SOCKETS_TARGET,
        f"{idle['here']} in the client, {idle['there']} at the server",
    )
    section.target(
        "every turn had memory injected",
        result["injected"] == plan.socket_users,
        f"{result['injected']} of {plan.socket_users}",
    )
    return section


def idle_memory(plan: Plan) -> Section:
    rounds = min(plan.rounds, 3)
    section = Section(
        5,
        "Memory per idle store",
        f"Resident memory (VmRSS after `gc.collect()`) of {plan.rss_stores:,} idle stores built from keys "
        "(`MembaseMemoryStore(api_key=..., base_url=...)`, no request), minus the RSS before building them. "
        f"{rounds} round(s), each a fresh process per library, the order alternating; medians.",
        ["library", "MiB per 1,000 stores", "per round", "build ms per store"],
    )
    runs = interleaved(rounds, "rss", "http://127.0.0.1:9", count=plan.rss_stores)  # never contacted
    for label, results in runs.items():
        mib = [kib * 1000 / 1024 for kib in of(results, "kib_per_store")]
        section.row(label, f"**{fmt(median(mib))}**", spread(mib), fmt(median(of(results, "build_ms"))))
    now, before = (median(of(runs[label], "kib_per_store")) for label in (NOW, BEFORE))
    section.target(
        f"no more memory per idle store than {BEFORE}",
        now <= before,
        f"{fmt(now)} KiB against {fmt(before)} KiB per store",
    )
    return section


SECTIONS = (recall_overhead, server_pattern, burst, idle_sockets, idle_memory)

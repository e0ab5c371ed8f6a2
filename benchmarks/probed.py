"""Sections 1-5: each figure taken in fresh processes (``_probe.py``), most of them on the library now and on
the reference adapter (``reference.py``) in turn, over the loopback server (``_server.py``) in a child process."""

from __future__ import annotations

from typing import Any

from common import (
    CANDIDATES,
    NOW,
    REFERENCE,
    Plan,
    Section,
    ServerProcess,
    busy_processes,
    fmt,
    interleaved,
    median,
    of,
    probe,
    ratio,
    spread,
)

ADDED_OF_RAW_TARGET = 0.4  # over loopback, the library adds at most this share of the raw SDK call's own time
TURNS_RATIO_TARGET = 2.0
PEAK_THREADS_TARGET = 120  # a thread per call in flight (there is no cap): about one per user at once, and a few more
PATTERN_LATENCY_MS = 20.0
BURST_BUDGET_S = 3.0
OTHER_WORST_TARGET_S = 0.5
OTHER_RECALLS = 5
SOCKETS_TARGET = 50
AT_ONCE = 50
REFERENCE_IS = "the reference adapter (`benchmarks/reference.py`: `asyncio.to_thread(client.search)`, no time box)"


def recall_overhead(plan: Plan) -> Section:
    section = Section(
        1,
        "Recall overhead",
        "What `await store.search(q)` adds to the floor, the raw SDK call it wraps "
        "(`membase.Membase(api_key=..., base_url=...).search(q, limit=5)`, the same client the reference holds), "
        f"for the library (a store built from a key) and for {REFERENCE_IS}. First over real sockets: the "
        "loopback server answering a three-passage body at once, keep-alive; then over the testing kit's "
        "`httpx.MockTransport` (the library's store from `InMemoryMembase().store()`, the reference given a client "
        f"on the same transport). Each probe makes {plan.recall_calls} raw calls and recalls, one of each in turn "
        "after a warm-up, over loopback and then over the kit in the same process; 'adds' is the probe's median "
        "recall minus its median raw call. "
        f"{plan.rounds} round(s), each a fresh process per candidate, the order alternating; medians. Then, over "
        f"loopback, one probe per candidate beside two busy processes ({plan.busy_calls} calls each): the share of "
        "calls over 2 ms.",
        [
            "candidate",
            "raw call µs",
            "recall µs",
            "store adds µs",
            "adds per round",
            "over 2 ms beside 2 busy: raw / recall",
        ],
    )
    with ServerProcess(0) as server:
        runs = interleaved(plan.rounds, "recall", server.url, calls=plan.recall_calls)
        busy: dict[str, list[dict[str, Any]]] = {candidate: [] for candidate in CANDIDATES}
        if plan.busy_calls:
            with busy_processes(2):
                busy = interleaved(1, "recall", server.url, calls=plan.busy_calls, mock=False)
    added: dict[str, dict[str, list[float]]] = {}
    for transport, prefix in (("loopback", ""), ("MockTransport", "mock_")):
        added[transport] = {}
        for label, results in runs.items():
            slow = ""
            if transport == "loopback":
                slow = " / ".join(f"{r[key] * 100:.1f} %" for r in busy[label] for key in ("raw_slow", "store_slow"))
            raw_us, store_us = of(results, f"{prefix}raw_us"), of(results, f"{prefix}store_us")
            adds = added[transport][label] = [store - raw for raw, store in zip(raw_us, store_us, strict=True)]
            row = (fmt(median(raw_us)), fmt(median(store_us)), f"**{fmt(median(adds))}**", spread(adds), slow)
            section.row(f"{label}, {transport}", *row)
    raw = median(of(runs[NOW], "raw_us"))
    now, reference = median(added["loopback"][NOW]), median(added["loopback"][REFERENCE])
    section.target(
        f"over loopback, the library adds at most {ADDED_OF_RAW_TARGET:g} x the raw SDK call's own time",
        now <= ADDED_OF_RAW_TARGET * raw,
        f"x{now / raw:.2f}: {fmt(now)} µs on a {fmt(raw)} µs call (the reference adds {fmt(reference)} µs, "
        f"x{reference / raw:.2f}; medians of {plan.rounds} round(s))",
    )
    missing = sum(2 * r["calls"] - r["hits"] - r["mock_hits"] for results in runs.values() for r in results)
    section.target("every recall measured returned memory", missing == 0, f"{missing} returned none")
    return section


def server_pattern(plan: Plan) -> Section:
    rounds = min(plan.rounds, 3)
    section = Section(
        2,
        "The server pattern",
        f"{plan.users} users at once on one event loop, {plan.user_turns} turns each; each turn builds a new "
        "`strands.Agent` (scripted model, `invoke_async`) over the user's store: for the library from one "
        f"`MembaseStorePool` (built from the user's key), for {REFERENCE_IS} from a dict of one store per user, "
        "built on first use. Both build a user's store on the loop inside the figures ('building stores': the "
        "loop's seconds in it; 'building excluded': the turns over the wall minus those seconds, to show how much "
        f"of the difference building makes). The loopback server answers after {PATTERN_LATENCY_MS:g} ms. "
        "Library threads are those named `membase-...`, sampled every millisecond during the turns, and counted "
        f"again after {plan.idle_s:g} s idle with the pool open (the library only: the reference has none). {rounds} "
        "round(s), each a fresh process per candidate, the order alternating; medians over rounds (threads: the "
        "most in any round).",
        [
            "candidate",
            "turns/s",
            "per round",
            "building stores s",
            "turns/s, building excluded",
            "peak library threads",
            "peak threads, all",
            f"library threads after {plan.idle_s:g} s idle",
            "turns with memory",
        ],
    )
    with ServerProcess(PATTERN_LATENCY_MS) as server:
        runs = interleaved(rounds, "pattern", server.url, users=plan.users, turns=plan.user_turns, idle_s=plan.idle_s)
    for label, results in runs.items():
        turns = of(results, "turns_s")
        unbuilt = [r["turns"] / (r["turns"] / r["turns_s"] - r["building_s"]) for r in results]
        section.row(
            label,
            f"**{fmt(median(turns))}**",
            spread(turns),
            fmt(median(of(results, "building_s"))),
            fmt(median(unbuilt)),
            f"{max(of(results, 'peak_library')):.0f}",
            f"{max(of(results, 'peak_all')):.0f}",
            f"{max(of(results, 'idle_library')):.0f}" if label == NOW else "n/a",
            f"{sum(of(results, 'injected')):.0f}/{sum(of(results, 'turns')):.0f}",
        )
    now, reference = (median(of(runs[label], "turns_s")) for label in (NOW, REFERENCE))
    section.target(
        f"at least {TURNS_RATIO_TARGET:g} x the reference's turns per second",
        now >= TURNS_RATIO_TARGET * reference,
        f"{ratio(now, reference)}: {fmt(now)} turns/s against {fmt(reference)}",
    )
    peak, idle = max(of(runs[NOW], "peak_library")), max(of(runs[NOW], "idle_library"))
    section.target(
        f"at most {PEAK_THREADS_TARGET} library threads at the peak", peak <= PEAK_THREADS_TARGET, f"{peak:.0f}"
    )
    section.target(f"no library thread after {plan.idle_s:g} s idle", idle == 0, f"{idle:.0f}")
    lost = {label: sum(r["turns"] - r["injected"] for r in results) for label, results in runs.items()}
    section.target(
        "every turn had memory injected (both candidates: else the comparison is void)",
        not any(lost.values()),
        ", ".join(f"{label}: {count} turn(s) without" for label, count in lost.items()),
    )
    return section


def burst(plan: Plan) -> Section:
    rounds = min(plan.rounds, 3)
    section = Section(
        3,
        f"{plan.burst} recalls at once on one store",
        f"One store built from a key (`recall_timeout={BURST_BUDGET_S:g}`) is asked for {plan.burst} recalls at "
        f"once on one event loop (several agents sharing it); a second user's store, on the same loop and server, "
        f"then recalls {OTHER_RECALLS} times in a row, its first recall started behind the whole burst. The "
        f"loopback server answers after {PATTERN_LATENCY_MS:g} ms. The same for {REFERENCE_IS}. {rounds} round(s), "
        "each a fresh process per candidate, the order alternating; the worst round for counts and worst "
        "latencies, medians otherwise. The targets are the library's.",
        [
            "candidate",
            "returned memory",
            "median s",
            "worst s",
            "other user's worst s",
            "peak library threads",
            "peak threads, all",
        ],
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
            f"{max(of(results, 'peak_all')):.0f}",
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
        "`/proc/self/net/tcp`, Linux only) and the connections the server holds open. The library only.",
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
        f"The same for {REFERENCE_IS}: one `membase.Membase` client each. {rounds} round(s), each a fresh process "
        "per candidate, the order alternating; medians.",
        ["candidate", "MiB per 1,000 stores", "per round", "build ms per store"],
    )
    runs = interleaved(rounds, "rss", "http://127.0.0.1:9", count=plan.rss_stores)  # never contacted
    for label, results in runs.items():
        mib = [kib * 1000 / 1024 for kib in of(results, "kib_per_store")]
        section.row(label, f"**{fmt(median(mib))}**", spread(mib), fmt(median(of(results, "build_ms"))))
    now, reference = (median(of(runs[label], "kib_per_store")) for label in (NOW, REFERENCE))
    section.target(
        "no more memory per idle store than the reference",
        now <= reference,
        f"{ratio(now, reference)}: {fmt(now)} KiB against {fmt(reference)} KiB per store",
    )
    return section


SECTIONS = (recall_overhead, server_pattern, burst, idle_sockets, idle_memory)

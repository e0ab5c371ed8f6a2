"""Section 5, memory per idle store: resident memory and build time of stores that never make a request.

Each trial builds the objects in a fresh child process (``benchmarks/_rss_probe.py``), so nothing
the run did before can skew it; compared with the bare SDK client and with SDK clients that share
one SSL context.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from typing import Any

from report import Section, fmt, spread
from support import BENCHMARKS, Plan, median

from membase_strands import MembaseStorePool

NUMBER = 5


def _rss(kind: str, count: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "_rss_probe.py"), kind, str(count)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(plan: Plan) -> Section:
    """Measure idle stores, bare SDK clients and clients sharing one SSL context, each in fresh processes."""
    section = Section(
        NUMBER,
        "Memory per idle store",
        f"Resident memory (VmRSS, after `gc.collect()`) of {plan.rss_count} idle stores built with `api_key` and "
        "`base_url` (no request), each trial in a fresh child process, minus the RSS before building them; "
        f"scaled to 1,000. {plan.rss_trials} trial(s) for the store and for clients sharing one SSL context, one for "
        "the bare client; medians.",
        ["objects", "MiB per 1,000", "KiB each", "build ms each", "per-trial MiB per 1,000"],
    )
    kinds = (
        ("store", "`MembaseMemoryStore(api_key=..., base_url=...)`", plan.rss_trials),
        ("client", "a bare `membase.Membase(api_key=..., base_url=...)`", 1),
        ("shared-ssl", "`membase.Membase` over an `httpx.Client` sharing one SSL context", plan.rss_trials),
    )
    per_kind = {}
    for kind, label, trials in kinds:
        runs = [_rss(kind, plan.rss_count) for _ in range(trials)]
        per_1000 = [(r["after_kib"] - r["before_kib"]) / r["count"] * 1000 / 1024 for r in runs]
        build_ms = [r["s"] / r["count"] * 1000 for r in runs]
        mib, ms = median(per_1000), median(build_ms)
        per_kind[kind] = (mib, ms)
        section.row(label, fmt(mib), fmt(mib * 1024 / 1000), fmt(ms), spread(per_1000))
    store_mib, store_ms = per_kind["store"]
    section.figure("store_mib_per_1000", "RSS per 1,000 idle stores", store_mib, "MiB", floor=2)
    section.figure("store_build_ms", "build time per store", store_ms, "ms", floor=1)
    client_mib, client_ms = per_kind["client"]
    shared_mib, shared_ms = per_kind["shared-ssl"]
    section.notes.append(
        f"A bare `membase.Membase` builds its own `httpx.Client`, whose default `verify=True` makes a new "
        f"`ssl.SSLContext` and loads the CA bundle: {fmt(client_mib)} MiB per 1,000 idle clients and "
        f"{fmt(client_ms)} ms each to build. Sharing one SSL context brings 1,000 idle clients to "
        f"{fmt(shared_mib)} MiB and {fmt(shared_ms)} ms each; 1,000 idle stores take {fmt(store_mib)} MiB and "
        f"{fmt(store_ms)} ms each."
    )
    pool_default = inspect.signature(MembaseStorePool).parameters["max_stores"].default
    if isinstance(pool_default, int):
        section.notes.append(
            f"`MembaseStorePool` keeps up to `max_stores={pool_default}` stores by default: about "
            f"{fmt(store_mib * pool_default / 1000)} MiB of idle stores once it is full, against "
            f"{fmt(client_mib * pool_default / 1000)} MiB for as many bare SDK clients."
        )
    return section

"""Resident memory of N idle objects, measured in a fresh process so earlier work cannot skew it.

    python benchmarks/_rss_probe.py KIND COUNT

KIND is ``store`` (``MembaseMemoryStore(api_key=..., base_url=...)``), ``client`` (a bare
``membase.Membase(api_key=..., base_url=...)``, which builds its own ``httpx.Client``) or
``shared-ssl`` (a ``membase.Membase`` over an ``httpx.Client`` that shares one SSL context). Prints
one json line: RSS before and after (KiB, after ``gc.collect()``) and the build time. The section
that runs it is ``scenarios/idle_memory.py``.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

BASE_URL = "http://127.0.0.1:9"  # never contacted: idle objects make no request


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def build(kind: str, count: int) -> list[Any]:
    import httpx
    import membase

    from membase_strands import MembaseMemoryStore

    if kind == "store":
        return [MembaseMemoryStore(api_key=f"user-{i}", base_url=BASE_URL) for i in range(count)]
    if kind == "client":
        return [membase.Membase(api_key=f"user-{i}", base_url=BASE_URL) for i in range(count)]
    if kind == "shared-ssl":
        context = httpx.create_ssl_context()
        return [
            membase.Membase(
                api_key=f"user-{i}",
                base_url=BASE_URL,
                http_client=httpx.Client(base_url=BASE_URL, timeout=90.0, verify=context),
            )
            for i in range(count)
        ]
    raise SystemExit(f"unknown kind {kind!r}")


def main() -> None:
    kind, count = sys.argv[1], int(sys.argv[2])
    build(kind, 2)  # imports and one-time caches are not per-object costs
    gc.collect()
    before = rss_kib()
    started = time.perf_counter()
    objects = build(kind, count)
    seconds = time.perf_counter() - started
    gc.collect()
    after = rss_kib()
    print(json.dumps({"kind": kind, "count": len(objects), "before_kib": before, "after_kib": after, "s": seconds}))


if __name__ == "__main__":
    main()

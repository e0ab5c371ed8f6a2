"""The server pattern of section 4 in a fresh process, on the library from a given ``src`` directory.

Run by ``scenarios/many_users.py`` to compare the library as it is with an earlier commit's, one process
each, interleaved::

    python benchmarks/_pattern_probe.py SRC URL USERS TURNS AGENT_PER_TURN

``SRC`` goes first on ``sys.path``, so ``membase_strands`` is imported from it (the benchmark's own code
and Strands are the same for both). Prints one JSON line: turns per second, threads at peak, turns and
turns that had memory injected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path


def main() -> None:
    src, url, users, turns, per_turn = sys.argv[1:6]
    sys.path.insert(0, src)
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    from scenarios.many_users import _server_pattern
    from support import FULL, thread_peak

    import membase_strands  # from SRC, as the scenario above imported it: SRC is first on sys.path

    plan = dataclasses.replace(FULL, users=int(users), user_turns=int(turns))
    with thread_peak() as threads:
        started = time.perf_counter()
        counts = asyncio.run(_server_pattern(plan, url, per_turn == "1"))
        wall = time.perf_counter() - started
    loaded_from = str(Path(membase_strands.__file__).resolve().parents[1])
    print(
        json.dumps(
            {
                "turns_s": counts["turns"] / wall,
                "peak_threads": threads["peak"],
                "library_threads": threads["library_peak"],
                "turns": counts["turns"],
                "injected": counts["injected"],
                "src": loaded_from,
            }
        )
    )


if __name__ == "__main__":
    main()

"""The store's own work on one large search answer, shape by shape (issue 19).

For each shape, a search answer body is built once as JSON bytes. Each trial decodes it (what the SDK
does with the response: the reference) and then times the store's path on the fresh body, as the store
and the ``membase_search`` tool run it: ``parse_search -> arrange -> memory_entries`` (recall) and
``parse_search -> arrange -> search_text`` (the tool), with the default recall budget of 20,000
characters and a limit of 50. The figures are medians over the trials. No network, no Membase::

    uv run --python 3.12 python benchmarks/large_answers.py [--trials N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from membase_strands._formatting import arrange, memory_entries, parse_search, search_text
from membase_strands._options import DEFAULT_RECALL_CHARS

MB = 1024 * 1024
LIMIT = 50
MEMORIES = [{"id": f"ctr_{name.lower()}", "name": name} for name in ("Work", "Home", "Notes")]


def words(seed: int, size: int, vocabulary: list[str]) -> str:
    rnd = random.Random(seed)
    parts: list[str] = []
    length = 0
    while length < size:
        parts.append(rnd.choice(vocabulary))
        length += len(parts[-1]) + 1
    return " ".join(parts)[:size]


ASCII = ["ledger", "Postgres", "Frankfurt", "backup", "nightly", "we", "chose", "the", "for", "a", "and"]
NON_ASCII = ["台帳", "データベース", "naïve", "Ünïcödé", "🎉", "🧾", "Ελληνικά", "עברית", "café", "日本語"]
HOSTILE = ["ledger\x00", "\x1b[31mred", "\ud800", "ok\udfff", "\x9b2J", "\r\n", "bell\x07", "\x7f", "tea"]


def hit(i: int, content: str, scored: bool = True) -> dict[str, Any]:
    memory = MEMORIES[i % len(MEMORIES)]
    row: dict[str, Any] = {"content": content, "container": memory["id"], "container_name": memory["name"]}
    if scored:
        row["score"] = round(1 - i / 1000, 4)
    row.update(source="episode", title=f"note {i}")
    return row


def megabytes(make: Callable[[int], str], scored: bool = True) -> dict[str, Any]:
    return {"results": [hit(i, make(i)[:MB], scored) for i in range(50)], "containers": MEMORIES}


def shapes() -> dict[str, dict[str, Any]]:
    base = words(0, MB, ASCII)
    header = words(1, 19_000, ASCII)
    return {
        "50 x 1 MB, distinct, scored": megabytes(lambda i: f"Passage {i}: {base}"),
        "50 x 1 MB, distinct, no scores": megabytes(lambda i: f"Passage {i}: {base}", scored=False),
        "50 x 1 MB, the same passage": megabytes(lambda i: base),
        "50 x 1 MB, the same, spaced apart": megabytes(lambda i: base.replace(" ", " " * (1 + i % 3))),
        "50 x 1 MB, differ only late": megabytes(lambda i: base[: MB - 20] + f" tail {i}"),
        "50 x 1 MB, differ after 9,000 chars": megabytes(lambda i: f"{header[:9_000]} part {i}: {base}"),
        "50 x 1 MB, differ after 19,000 chars": megabytes(lambda i: f"{header} part {i}: {base}"),
        "50 x 1 MB, non-ASCII": megabytes(lambda i: f"{i}: " + words(i, MB, NON_ASCII)),
        "50 x 1 MB, surrogates and controls": megabytes(lambda i: f"{i}: " + words(i, MB, HOSTILE)),
        "50 x 1 MB, whitespace only": megabytes(lambda i: " \n\t" * (MB // 3)),
        "500,000 small hits": {
            "results": [hit(i, f"Note {i}: we chose Postgres for ledger {i}.") for i in range(500_000)],
            "containers": MEMORIES,
        },
    }


def recall(body: Any) -> object:
    answer = parse_search(body, LIMIT)
    most = max(0, LIMIT - len(answer.unsearched))
    return memory_entries(arrange(answer, most, budget=DEFAULT_RECALL_CHARS))


def tool(body: Any) -> object:
    return search_text("ledger", arrange(parse_search(body, LIMIT), LIMIT, budget=DEFAULT_RECALL_CHARS))


def measure(raw: bytes, trials: int) -> tuple[float, float, float]:
    """Median ms of: the JSON decode, the recall path, the tool path (each on a freshly decoded body)."""
    decode, recalled, tooled = [], [], []
    for _ in range(trials):
        started = time.perf_counter()
        body = json.loads(raw)
        decode.append(time.perf_counter() - started)
        started = time.perf_counter()
        recall(body)
        recalled.append(time.perf_counter() - started)
        body = json.loads(raw)  # a fresh body: nothing the recall path touched is warm
        started = time.perf_counter()
        tool(body)
        tooled.append(time.perf_counter() - started)
    return tuple(statistics.median(values) * 1000 for values in (decode, recalled, tooled))  # type: ignore[return-value]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=7)
    trials = parser.parse_args().trials
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}")
    print(f"limit={LIMIT}, max_recall_chars={DEFAULT_RECALL_CHARS}, median of {trials} trials\n")
    print("| answer | body | JSON decode (ms) | store, recall (ms) | store, tool (ms) | load avg |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, body in shapes().items():
        raw = json.dumps(body).encode()
        decode, recalled, tooled = measure(raw, trials)
        load = os.getloadavg()[0]  # other processes share this machine: the figures are only as good as this
        print(f"| {name} | {len(raw) / MB:.0f} MB | {decode:.0f} | {recalled:.2f} | {tooled:.2f} | {load:.1f} |")


if __name__ == "__main__":
    main()

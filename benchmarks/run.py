"""Benchmarks for membase-strands: the library against the raw SDK call and a reference adapter, interleaved.

    uv run --python 3.12 python benchmarks/run.py --write      # the full run (about 10 min), for a release
    uv run --python 3.12 python benchmarks/run.py              # the full run, printed only
    uv run --python 3.12 python benchmarks/run.py --quick      # smoke run (under a minute): targets not judged
    uv run --python 3.12 python benchmarks/run.py --sections 1,3

Everything runs offline and needs no git history. See benchmarks/README.md for what each section measures.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attempts
import in_process
import probed
from common import FULL, QUICK, ROOT, Plan, Section, machine, mark

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
KEPT = ("<!-- recall-quality: start", "<!-- recall-quality: end -->")
"""RESULTS.md's recall-quality part, written by ``python -m benchmarks.recall_quality --write``, is kept."""
SECTIONS: tuple[Callable[[Plan], Section], ...] = probed.SECTIONS + in_process.SECTIONS + attempts.SECTIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: every section, a little, targets not judged")
    parser.add_argument(
        "--write", action="store_true", help="write benchmarks/RESULTS.md (a full run of every section; for a release)"
    )
    parser.add_argument("--no-write", action="store_true", help=argparse.SUPPRESS)  # the default; kept for old CI lines
    parser.add_argument("--sections", default="", help="comma-separated section numbers, e.g. 1,3")
    args = parser.parse_args(argv)
    chosen = [int(n) for n in args.sections.split(",") if n.strip()] or list(range(1, len(SECTIONS) + 1))
    if not set(chosen) <= set(range(1, len(SECTIONS) + 1)):
        parser.error(f"sections are numbered 1 to {len(SECTIONS)}")
    if args.write and (args.quick or args.sections):
        parser.error("--write needs the full run of every section (no --quick, no --sections)")
    plan, judged = (QUICK, False) if args.quick else (FULL, True)

    logging.disable(logging.CRITICAL)  # recalls that run out of time and failed writes are expected here
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # section 4 holds a socket per user (probe, server)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    info = machine()
    print(f"membase-strands benchmarks, {'quick' if args.quick else 'full'}: {info['CPU']}, {info['Cores']}")
    if not judged:
        print("smoke run: targets not judged (it checks that every section runs; an error fails it)")
    started, sections = time.perf_counter(), []
    for number in chosen:
        before = cpu_sample()
        section = SECTIONS[number - 1](plan)
        section.seconds, section.others = others_share(before, cpu_sample())
        print(section.console(judged), flush=True)
        sections.append(section)
    total = time.perf_counter() - started
    missed = [(s.number, t.text) for s in sections for t in s.targets if not t.met]
    if not judged:
        print(f"== done in {total:.0f} s; smoke run: targets not judged")
        return 0
    print(f"== done in {total:.0f} s; {len(missed)} target(s) missed" + "".join(f"\n  {n}: {t}" for n, t in missed))
    if args.write:
        RESULTS.write_text(render(sections, info, total, " ".join(sys.argv[1:])) + kept(), encoding="utf-8")
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 1 if missed else 0


def render(sections: list[Section], info: dict[str, str], total: float, arguments: str) -> str:
    lines = [
        "# membase-strands benchmarks",
        "",
        f"Produced by `python benchmarks/run.py {arguments}` in {total:.0f} s, for a release. What each section "
        "measures: [README.md](README.md). `now` is the library (this checkout's `src`); `reference` is the "
        "reference adapter in [reference.py](reference.py), the straightforward `MemoryStore` over the SDK, which "
        "stands in for a published adapter; the floor is the raw SDK call `client.search(q, limit=5)`. Compared "
        "candidates run in fresh processes, the order alternating round by round.",
        "",
        "| machine | |",
        "| --- | --- |",
        *(f"| {key} | {value} |" for key, value in info.items()),
        "| Other load | other processes' share of the CPU per section: "
        + ", ".join(f"{s.number}: {s.others * 100:.0f} %" for s in sections)
        + " |",
        "",
        "| section | target | result | figures |",
        "| --- | --- | --- | --- |",
        *(f"| {s.number} | {t.text} | {mark(t, True)} | {t.detail} |" for s in sections for t in s.targets),
        "",
    ]
    return "\n".join(lines + [s.markdown(True) for s in sections])


def kept() -> str:
    old = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
    start, end = old.find(KEPT[0]), old.find(KEPT[1])
    return "\n" + old[start : end + len(KEPT[1])] + "\n" if 0 <= start < end else ""


# --- The CPU other processes use -------------------------------------------------------------------


def cpu_sample() -> tuple[float, float, float]:
    """(wall, CPU-seconds the whole machine spent, CPU-seconds this process and its waited-for children spent)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = os.times()
    return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system


def others_share(start: tuple[float, float, float], end: tuple[float, float, float]) -> tuple[float, float]:
    """The seconds between two samples, and the share of the machine's CPU other processes used meanwhile."""
    wall = end[0] - start[0]
    others = (end[1] - start[1]) - (end[2] - start[2])
    return wall, max(0.0, others / (wall * (os.cpu_count() or 1)))


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks for membase-strands: recall overhead, agent turns, stalls, many users, memory, capture, idle sockets.

    uv run python benchmarks/run.py            # the full run; writes benchmarks/RESULTS.md
    uv run python benchmarks/run.py --quick    # a few iterations, under a minute (CI's smoke run)
    uv run python benchmarks/run.py --no-write # print only

Everything runs offline: httpx.MockTransport, or a loopback HTTP server in a child process. Every
loop is bounded and every hung responder ends by itself. See benchmarks/README.md for what each
figure means and which module measures it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Callable

from report import RESULTS, ROOT, Section, machine, previous_figures, render
from scenarios import (
    hung_capture,
    idle_memory,
    idle_sockets,
    injected_turn,
    many_users,
    recall_overhead,
    regression,
    stalled_memory,
)
from support import BEFORE_PERFORMANCE_WORK, BUSY_SHARE, FULL, QUICK, Plan, cpu_sample, others_share

SECTIONS: dict[int, Callable[[Plan], Section]] = {
    recall_overhead.NUMBER: recall_overhead.run,
    injected_turn.NUMBER: injected_turn.run,
    stalled_memory.NUMBER: stalled_memory.run,
    many_users.NUMBER: many_users.run,
    idle_memory.NUMBER: idle_memory.run,
    hung_capture.NUMBER: hung_capture.run,
    idle_sockets.NUMBER: idle_sockets.run,
}
"""The measuring sections by number; the comparison with the previous run (section 7) always follows them."""


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, print each, compare with the previous RESULTS.md, and write it (full runs)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few iterations, under a minute (CI's smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument(
        "--sections", default="", help="comma-separated section numbers to run (implies --no-write), e.g. 1,3"
    )
    parser.add_argument(
        "--reason",
        action="append",
        default=[],
        metavar="KEY=TEXT",
        help="why figure KEY regressed (repeatable); recorded in RESULTS.md",
    )
    parser.add_argument(
        "--before",
        default=None,
        metavar="REV",
        help="compare section 4's server pattern with the library at this commit ('' for none; full runs default "
        f"to {BEFORE_PERFORMANCE_WORK}, the last commit before the performance work)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.before is not None:
        plan = dataclasses.replace(plan, before=args.before or None)
    mode = "quick" if args.quick else "full"
    chosen = [int(n) for n in args.sections.split(",") if n.strip()] or list(SECTIONS)
    write = not args.no_write and not args.sections
    reasons = dict(item.split("=", 1) for item in args.reason if "=" in item)
    command = " ".join(["uv run python benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])])

    # The library's and Strands' warnings (recall ran out of time, store search failed) are expected here.
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger().setLevel(logging.ERROR)
    logging.lastResort = None

    before, before_info = previous_figures()
    info = machine()
    print(f"membase-strands benchmarks, {mode} mode: {info['CPU']}, {info['Cores']}, {info['Python']}", flush=True)
    started = time.perf_counter()
    sections = []
    run_start = cpu_sample()
    for number in chosen:
        section_start = cpu_sample()
        section = SECTIONS[number](plan)
        section_end = cpu_sample()
        section.seconds = section_end.wall - section_start.wall
        section.others = others_share(section_start, section_end)
        print(section.console(), flush=True)
        sections.append(section)
    info["Other load"] = (
        f"other processes used {others_share(run_start, cpu_sample()) * 100:.0f} % of the machine's CPU during "
        f"the run (per section below; sections where it reached {BUSY_SHARE * 100:.0f} % have unreliable timings)"
    )
    figures = [f for s in sections for f in s.figures]
    busy = {str(s.number): s.others for s in sections}
    sections.append(regression.run(figures, before, before_info, reasons, mode, busy))
    print(sections[-1].console())
    total = time.perf_counter() - started

    missed = [(s.number, t) for s in sections for t in s.targets if not t.met]
    print(
        f"== done in {total:.1f} s; {len(missed)} target(s) missed" + "".join(f"\n  {n}: {t.text}" for n, t in missed)
    )
    if write:
        report = render(sections, info, command, total, mode, busy)
        RESULTS.write_text(report + _other_reports(), encoding="utf-8")
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


def _other_reports() -> str:
    """Sections other benchmarks wrote into RESULTS.md between their own markers (the recall-quality one)."""
    old = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
    start = old.find("<!-- recall-quality: start")
    end = old.find("<!-- recall-quality: end -->")
    return "\n" + old[start : end + len("<!-- recall-quality: end -->")] + "\n" if 0 <= start < end else ""


if __name__ == "__main__":
    sys.exit(main())

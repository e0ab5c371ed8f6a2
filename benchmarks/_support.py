"""Shared pieces of the benchmark run: statistics, the machine, figures, targets and the report.

Each section of ``run.py`` returns a :class:`Section`: a table for RESULTS.md, the targets it checks
and the figures that the next run compares against (stored in a fenced json block at the end of
RESULTS.md).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
FIGURES_MARKER = "<!-- figures: machine-readable, read by the next run -->"
REGRESSION_LIMIT = 1.20  # a figure may grow by at most 20 % without a reason
BUSY_SHARE = 0.10  # other processes using this share of the CPU make a section's timings unreliable
PACKAGES = ("membase-strands", "strands-agents", "unibaseio-membase", "httpx", "httpcore")


# --- Statistics ---------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) by nearest rank; enough for small samples."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return float(ordered[index])


def spread(values: Sequence[float]) -> str:
    """``min-max`` of per-trial figures, for the tables."""
    if not values:
        return "n/a"
    return f"{fmt(min(values))}-{fmt(max(values))}"


def fmt(value: float, digits: int = 3) -> str:
    """A number with about ``digits`` significant digits, no exponent for everyday sizes."""
    if value != value:  # NaN
        return "n/a"
    if float(value).is_integer():
        return f"{int(value):,}"
    magnitude = abs(value)
    if magnitude >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    decimals = digits - 1 - int(f"{magnitude:e}".split("e")[1])
    return f"{value:.{max(0, decimals)}f}"


# --- Figures, targets, sections -----------------------------------------------------------------


@dataclass
class Figure:
    """One number the next run compares against.

    ``floor`` is the smallest absolute change that counts: below it a difference is noise (a few
    microseconds on a call, a millisecond on a turn). ``reference`` names a figure that measures
    the machine rather than the library (the raw SDK call, a turn without memory); when both moved
    by the same factor the change is the machine's, not the library's.
    """

    key: str
    label: str
    value: float
    unit: str
    better: str = "lower"  # "lower", "higher" or "info" (never a regression)
    floor: float = 0.0
    reference: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label, "value": self.value, "unit": self.unit, "better": self.better}
        if self.floor:
            out["floor"] = self.floor
        if self.reference:
            out["reference"] = self.reference
        return out


@dataclass
class Target:
    """A stated target and whether this run met it, with the reason."""

    text: str
    met: bool
    detail: str

    @property
    def mark(self) -> str:
        return "met" if self.met else "**missed**"


@dataclass
class Section:
    """One section of RESULTS.md."""

    number: int
    title: str
    setup: str
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # raw markdown lines after the notes (e.g. profiles)
    seconds: float = 0.0
    others: float = 0.0  # share of the machine's CPU other processes used while this section ran

    def row(self, *cells: object) -> None:
        texts = [str(c) for c in cells]
        self.rows.append(texts + [""] * (len(self.headers) - len(texts)))

    def figure(self, key: str, label: str, value: float, unit: str, **options: Any) -> float:
        self.figures.append(Figure(f"{self.number}.{key}", label, value, unit, **options))
        return value

    def target(self, text: str, met: bool, detail: str) -> bool:
        self.targets.append(Target(text, met, detail))
        return met

    def markdown(self) -> str:
        lines = [f"## {self.number}. {self.title}", "", self.setup, ""]
        if self.headers:
            lines.append("| " + " | ".join(self.headers) + " |")
            lines.append("| " + " | ".join("---" for _ in self.headers) + " |")
            lines += ["| " + " | ".join(row) + " |" for row in self.rows]
            lines.append("")
        if self.targets:
            lines += ["| target | result | why |", "| --- | --- | --- |"]
            lines += [f"| {t.text} | {t.mark} | {t.detail} |" for t in self.targets]
            lines.append("")
        if self.notes:
            lines += [*(f"- {note}" for note in self.notes), ""]
        if self.extra:
            lines += [*self.extra, ""]
        lines.append(
            f"_Section time: {self.seconds:.1f} s; other processes used {self.others * 100:.0f} % of the "
            "machine's CPU meanwhile._"
        )
        lines.append("")
        return "\n".join(lines)

    def console(self) -> str:
        out = [f"== {self.number}. {self.title} ({self.seconds:.1f} s, other processes {self.others * 100:.0f} % CPU)"]
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) for i, h in enumerate(self.headers)] if self.rows else []
        if self.headers:
            out.append("  " + "  ".join(h.ljust(w) for h, w in zip(self.headers, widths, strict=True)))
            out += [
                "  " + "  ".join(c.replace("**", "").ljust(w) for c, w in zip(row, widths, strict=True))
                for row in self.rows
            ]
        out += [f"  [{t.mark.replace('*', '')}] {t.text}: {t.detail}" for t in self.targets]
        out += [f"  note: {n}" for n in self.notes]
        out += [f"  {line}" for line in self.extra]
        return "\n".join(out)


# --- Timing helpers -----------------------------------------------------------------------------


def time_calls_us(call: Callable[[], object], count: int) -> list[float]:
    """Per-call wall times of ``count`` synchronous calls, in microseconds."""
    from time import perf_counter_ns

    times = []
    for _ in range(count):
        started = perf_counter_ns()
        call()
        times.append((perf_counter_ns() - started) / 1000)
    return times


# --- Other load on the machine ------------------------------------------------------------------


@dataclass
class CpuSample:
    wall: float
    machine_busy: float  # CPU-seconds all processes spent, from /proc/stat
    own: float  # CPU-seconds this process and its waited-for children spent


def cpu_sample() -> CpuSample:
    import time

    busy = float("nan")
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(v) for v in fields]
        # user nice system idle iowait irq softirq steal ...: busy is everything but idle and iowait
        busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    times = os.times()
    return CpuSample(time.perf_counter(), busy, times.user + times.system + times.children_user + times.children_system)


def others_share(start: CpuSample, end: CpuSample) -> float:
    """The share (0-1) of the machine's CPU that other processes used between two samples."""
    cores = os.cpu_count() or 1
    wall = end.wall - start.wall
    others = (end.machine_busy - start.machine_busy) - (end.own - start.own)
    return max(0.0, others / (wall * cores)) if wall > 0 else 0.0


# --- The machine --------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """CPU model, cores, RAM, OS, Python, package versions, date and commit."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    virtual = ""
    try:
        if "hypervisor" in Path("/proc/cpuinfo").read_text():
            virtual = " (virtual machine)"
    except OSError:
        pass
    return {
        "CPU": f"{cpu}{virtual}",
        "Cores": f"{os.cpu_count()} logical, {usable} usable by this process",
        "RAM": ram,
        "OS": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "Python": f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
        "Packages": ", ".join(versions),
        "Date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "Commit": _commit(),
    }


def _commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' with uncommitted changes' if dirty else ''}"


# --- Comparison with the previous RESULTS.md ----------------------------------------------------


def previous_figures(path: Path = RESULTS) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The figures (and run info) stored in the json block of a previous RESULTS.md, if any."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}, {}
    at = text.rfind(FIGURES_MARKER)
    match = re.search(r"```json\n(.*?)\n```", text[at:] if at >= 0 else "", re.S)
    if match is None:
        return {}, {}
    try:
        block = json.loads(match.group(1))
    except ValueError:
        return {}, {}
    figures = block.get("figures") if isinstance(block, dict) else None
    return (figures if isinstance(figures, dict) else {}), {k: v for k, v in block.items() if k != "figures"}


@dataclass
class Change:
    key: str
    label: str
    unit: str
    before: float
    after: float
    regressed: bool
    reason: str

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before else float("inf") if self.after else 1.0


def compare(
    figures: Sequence[Figure],
    before: dict[str, dict[str, Any]],
    reasons: dict[str, str],
    busy: dict[str, float] | None = None,
) -> tuple[list[Change], list[str]]:
    """Each figure against the previous run: regressed when it grew more than 20 % past its noise floor.

    A regression gets a reason when one is known: one given with ``--reason KEY=TEXT``, the
    figure's machine reference moved by the same factor, or other processes took a noticeable share
    of the CPU while its section ran (``busy``: section number -> share). Returns the changes and the keys that
    were in the previous run but not in this one.
    """
    now = {f.key: f for f in figures}
    changes = []
    for figure in figures:
        old = before.get(figure.key)
        if not isinstance(old, dict) or not isinstance(old.get("value"), (int, float)):
            continue
        was = float(old["value"])
        grew = _worse(figure, was, figure.value)
        reason = reasons.get(figure.key, "")
        if grew and not reason and figure.reference:
            ref_now, ref_old = now.get(figure.reference), before.get(figure.reference, {}).get("value")
            if ref_now is not None and isinstance(ref_old, (int, float)) and ref_old > 0 and was > 0:
                own = (figure.value / was) / (ref_now.value / ref_old)
                if own <= REGRESSION_LIMIT:
                    reason = (
                        f"the machine reference {figure.reference} moved by x{ref_now.value / ref_old:.2f}; "
                        f"relative to it this figure moved x{own:.2f}"
                    )
        if grew and not reason and figure.better == "info":
            reason = "reference figure (measures the machine or the SDK, not this library)"
        load = (busy or {}).get(figure.key.split(".")[0], 0.0)
        if grew and not reason and load >= BUSY_SHARE:
            reason = f"other processes used {load * 100:.0f} % of the machine's CPU during this section"
        changes.append(Change(figure.key, figure.label, figure.unit, was, figure.value, grew, reason))
    missing = [key for key in before if key not in now]
    return changes, missing


def _worse(figure: Figure, before: float, after: float) -> bool:
    if figure.better == "higher":
        return after * REGRESSION_LIMIT < before and (before - after) > figure.floor
    return after > before * REGRESSION_LIMIT and (after - before) > figure.floor


def figures_block(figures: Sequence[Figure], info: dict[str, Any]) -> str:
    body = {**info, "figures": {f.key: f.as_json() for f in figures}}
    return f"{FIGURES_MARKER}\n\n```json\n{json.dumps(body, indent=1, ensure_ascii=False)}\n```\n"

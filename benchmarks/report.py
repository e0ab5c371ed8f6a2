"""The report: each section's tables, targets and figures, the machine it ran on, and RESULTS.md.

Each scenario fills a :class:`Section`: a table, the targets it checks (met or missed, with the
reason) and the figures that the next run compares against. :func:`render` writes RESULTS.md from
them: the machine (measured, never assumed), the command, a targets summary, one part per section
and, at the end, a fenced json block of figures that :func:`previous_figures` reads back next time.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
FIGURES_MARKER = "<!-- figures: machine-readable, read by the next run -->"
PACKAGES = ("membase-strands", "strands-agents", "unibaseio-membase", "httpx", "httpcore")


# --- Numbers in tables --------------------------------------------------------------------------


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


def spread(values: Sequence[float]) -> str:
    """``min-max`` of per-trial figures, for the tables."""
    if not values:
        return "n/a"
    return f"{fmt(min(values))}-{fmt(max(values))}"


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
        """The figure as stored in the json block."""
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
        """``met`` or a bold ``missed``."""
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
        """Add a table row (missing cells are left empty)."""
        texts = [str(c) for c in cells]
        self.rows.append(texts + [""] * (len(self.headers) - len(texts)))

    def figure(self, key: str, label: str, value: float, unit: str, **options: Any) -> float:
        """Record a figure under ``<section number>.<key>``; returns ``value``."""
        self.figures.append(Figure(f"{self.number}.{key}", label, value, unit, **options))
        return value

    def target(self, text: str, met: bool, detail: str) -> bool:
        """Record a target and whether it was met; returns ``met``."""
        self.targets.append(Target(text, met, detail))
        return met

    def markdown(self) -> str:
        """The section as it appears in RESULTS.md."""
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
        """The section as the run prints it."""
        out = [f"== {self.number}. {self.title} ({self.seconds:.1f} s, other processes {self.others * 100:.0f} % CPU)"]
        widths = [max([len(h), *(len(r[i]) for r in self.rows)]) for i, h in enumerate(self.headers)]
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


# --- The machine --------------------------------------------------------------------------------


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 0


def _virtual() -> bool:
    return "hypervisor" in _cpuinfo()


def cpu_model() -> str:
    """The CPU's model name, marked ``(virtual machine)`` under a hypervisor."""
    cpu = platform.processor() or "unknown"
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}{' (virtual machine)' if _virtual() else ''}"


def cores() -> str:
    """The logical CPUs, and how many of them this process may use."""
    return f"{os.cpu_count()} logical, {_usable_cpus()} usable by this process"


def os_name() -> str:
    """The operating system, its release and the architecture."""
    return f"{platform.system()} {platform.release()} ({platform.machine()})"


def package_versions(names: Sequence[str] = PACKAGES) -> str:
    """``name version`` of each package, or ``name (not installed)``, comma-separated."""
    versions = []
    for name in names:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return ", ".join(versions)


def machine() -> dict[str, str]:
    """CPU model, cores, RAM, OS, Python, package versions, date and commit, as measured now."""
    ram = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    return {
        "CPU": cpu_model(),
        "Cores": cores(),
        "RAM": ram,
        "OS": os_name(),
        "Python": f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
        "Packages": package_versions(),
        "Date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "Commit": checkout(),
    }


def this_machine() -> str:
    """The machine the run is on, for prose: ``"this 2-CPU virtual machine"``, measured."""
    cpus = _usable_cpus()
    return f"this {cpus}-CPU {'virtual machine' if _virtual() else 'machine'}"


def checkout() -> str:
    """The commit the run measured, and whether the checkout had uncommitted changes."""
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


# --- RESULTS.md ---------------------------------------------------------------------------------


def render(
    sections: Sequence[Section],
    info: dict[str, str],
    command: str,
    total_s: float,
    mode: str,
    cpu_shares: dict[str, float],
) -> str:
    """RESULTS.md for this run.

    Args:
        sections: Every section, in the order run, the comparison with the previous run last.
        info: The machine, from :func:`machine` (plus the run's other load).
        command: The command that produced the run.
        total_s: How long the run took.
        mode: ``"full"`` or ``"quick"``.
        cpu_shares: Section number -> the share of the CPU other processes used while it ran.
    """
    figures = [f for s in sections for f in s.figures]
    lines = [
        "# membase-strands benchmarks",
        "",
        f"Produced by `{command}` ({mode} mode) in {total_s:.0f} s. What each figure means and how to run it: "
        "[README.md](README.md). Regenerate rather than edit: the next run reads the json block at the end.",
        "",
        "## Machine",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {key} | {value} |" for key, value in info.items()),
        "",
        "## Targets",
        "",
        "| section | target | result | why |",
        "| --- | --- | --- | --- |",
    ]
    for section in sections:
        lines += [f"| {section.number} | {t.text} | {t.mark} | {t.detail} |" for t in section.targets]
    lines.append("")
    for section in sections:
        lines.append(section.markdown())
    block_info = {
        "date": info["Date"],
        "mode": mode,
        "command": command,
        "commit": info["Commit"],
        "others_cpu_share": {number: round(share, 3) for number, share in cpu_shares.items()},
    }
    lines.append(figures_block(figures, block_info))
    return "\n".join(lines)


def figures_block(figures: Sequence[Figure], info: dict[str, Any]) -> str:
    """The json block at the end of RESULTS.md: the run's info and every figure by key."""
    body = {**info, "figures": {f.key: f.as_json() for f in figures}}
    return f"{FIGURES_MARKER}\n\n```json\n{json.dumps(body, indent=1, ensure_ascii=False)}\n```\n"


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

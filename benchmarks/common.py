"""What the sections share: the plan (full or quick), numbers, a section of the report, the loopback server,
busy processes, and the probes that measure one candidate (the library now, or the reference adapter) in a fresh
process. Nothing here needs the repository's git history."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
NOW = "now"
"""The library as it is: this checkout's ``src``."""
REFERENCE = "reference"
"""The reference adapter, ``benchmarks/reference.py``: the straightforward ``MemoryStore`` over the SDK."""
CANDIDATES = (NOW, REFERENCE)
PACKAGES = ("membase-strands", "strands-agents", "unibaseio-membase", "httpx", "httpcore")


@dataclass(frozen=True)
class Plan:
    """How much each section does. Every size is a count of calls, turns, users or processes."""

    quick: bool
    rounds: int  # rounds of a comparison: one fresh process per candidate each
    recall_calls: int
    busy_calls: int  # 0: no calls beside busy processes
    users: int
    user_turns: int
    idle_s: float
    burst: int
    socket_users: int
    rss_stores: int
    stall_trials: int
    stall_turns: int
    capture: tuple[tuple[float | None, float, int], ...]  # (write_timeout, stand-in attempt s, runs)
    passages: int  # of 1 MB each, in the large answers
    small_answer_mb: int
    answer_trials: int


FULL = Plan(
    quick=False,
    rounds=5,
    recall_calls=1500,
    busy_calls=1000,
    users=100,
    user_turns=5,
    idle_s=10.0,
    burst=300,
    socket_users=1000,
    rss_stores=300,  # a reference store builds an SSL context for its own client: tens of ms each
    stall_trials=3,
    stall_turns=20,
    capture=((1.0, 6.0, 2), (5.0, 6.0, 1), (None, 6.0, 1)),
    passages=50,
    small_answer_mb=50,
    answer_trials=5,
)
QUICK = Plan(
    quick=True,
    rounds=1,
    recall_calls=100,
    busy_calls=0,  # no busy processes in a smoke run
    users=20,
    user_turns=2,
    idle_s=1.0,
    burst=100,
    socket_users=100,
    rss_stores=30,
    stall_trials=1,
    stall_turns=5,
    capture=((0.3, 1.0, 1), (None, 1.0, 1)),
    passages=4,
    small_answer_mb=4,
    answer_trials=1,
)


# --- Numbers ------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def fmt(value: float, digits: int = 3) -> str:
    """About ``digits`` significant digits, no exponent."""
    if value != value:
        return "n/a"
    if float(value).is_integer():
        return f"{int(value):,}"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{max(0, digits - 1 - int(f'{abs(value):e}'.split('e')[1]))}f}"


def spread(values: Sequence[float]) -> str:
    return f"{fmt(min(values))}-{fmt(max(values))}" if values else "n/a"


# --- The machine ---------------------------------------------------------------------------------


def machine(packages: Sequence[str] = PACKAGES) -> dict[str, str]:
    """CPU model, cores, RAM, OS, Python, package versions, date and commit (if this is a git checkout)."""

    def first(path: str, prefix: str) -> str:
        lines = Path(path).read_text().splitlines() if Path(path).exists() else []
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(prefix)), "unknown")

    virtual = " (virtual machine)" if "hypervisor" in first("/proc/cpuinfo", "flags") else ""
    ram = first("/proc/meminfo", "MemTotal")

    def git(*arguments: str) -> str:  # only to name the checkout measured: a shallow clone, or none, is fine
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *arguments], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")

    def version(name: str) -> str:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            return f"{name} (not installed)"

    return {
        "CPU": first("/proc/cpuinfo", "model name") + virtual,
        "Cores": f"{os.cpu_count()} logical, {len(os.sched_getaffinity(0))} usable",
        "RAM": f"{int(ram.split()[0]) / 1024**2:.1f} GiB" if ram != "unknown" else ram,
        "OS": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "Packages": ", ".join(version(name) for name in packages),
        "Date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "Commit": (commit or "unknown (not a git checkout)") + (" with uncommitted changes" if dirty else ""),
    }


# --- A section of the report --------------------------------------------------------------------


@dataclass
class Target:
    text: str
    met: bool
    detail: str


@dataclass
class Section:
    """One section: what it did, a table, targets (met or missed, with the figures), notes."""

    number: int
    title: str
    setup: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    others: float = 0.0  # the share of the machine's CPU other processes used meanwhile

    def row(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells] + [""] * (len(self.headers) - len(cells)))

    def target(self, text: str, met: bool, detail: str) -> None:
        self.targets.append(Target(text, met, detail))

    def markdown(self, judged: bool) -> str:
        lines = [f"## {self.number}. {self.title}", "", self.setup, ""]
        lines += ["| " + " | ".join(self.headers) + " |", "|" + " --- |" * len(self.headers)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.targets:
            lines += ["", "| target | result | figures |", "| --- | --- | --- |"]
            lines += [f"| {t.text} | {mark(t, judged)} | {t.detail} |" for t in self.targets]
        lines += ["", *(f"- {note}" for note in self.notes), ""] if self.notes else [""]
        lines += [f"_{self.seconds:.0f} s; other processes used {self.others * 100:.0f} % of the CPU meanwhile._", ""]
        return "\n".join(lines)

    def console(self, judged: bool) -> str:
        out = [f"== {self.number}. {self.title} ({self.seconds:.1f} s, other processes {self.others * 100:.0f} % CPU)"]
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) for i, h in enumerate(self.headers)]
        for row in [self.headers, *self.rows]:
            out.append("  " + "  ".join(c.replace("`", "").ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        out += [f"  [{mark(t, judged).strip('*')}] {t.text}: {t.detail}" for t in self.targets]
        return "\n".join(out + [f"  note: {n}" for n in self.notes])


def mark(target: Target, judged: bool) -> str:
    return "not judged" if not judged else "met" if target.met else "**missed**"


# --- The loopback server, busy processes ---------------------------------------------------------


class ServerProcess:
    """The loopback server (``_server.py``) in a child process; use as a context manager."""

    def __init__(self, latency_ms: float) -> None:
        command = [sys.executable, str(BENCHMARKS / "_server.py"), str(latency_ms)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        line = self._process.stdout.readline().split()
        if line[:1] != ["PORT"]:
            self.__exit__()
            raise RuntimeError(f"the loopback server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{line[1]}"

    def stats(self, reset: bool = False) -> dict[str, int]:
        """Connections accepted, open now, and requests answered (``reset``: zero them instead)."""
        request = urllib.request.Request(self.url + ("/_reset" if reset else "/_stats"), data=b"" if reset else None)
        with urllib.request.urlopen(request, timeout=10) as answer:
            result: dict[str, int] = json.loads(answer.read())
            return result

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()  # it serves until its stdin closes
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)


@contextmanager
def busy_processes(count: int = 2, limit_s: float = 300.0) -> Iterator[None]:
    """``count`` processes spinning on the CPU while inside (each ends by itself after ``limit_s``), stopped by pid."""
    spin = f"import time\nend = time.time() + {limit_s}\nwhile time.time() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        time.sleep(0.2)  # let them reach the CPU first
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(10)


# --- The candidates compared, and the probes -----------------------------------------------------------


def probe(mode: str, candidate: str, url: str, **options: Any) -> dict[str, Any]:
    """Run ``_probe.py`` in a fresh process on ``candidate`` (:data:`NOW` or :data:`REFERENCE`); its JSON result."""
    command = [sys.executable, str(BENCHMARKS / "_probe.py"), mode, candidate, url, json.dumps(options)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"probe {mode} on {candidate} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["src"]) != (ROOT / "src").resolve():
        raise RuntimeError(f"probe {mode} loaded membase_strands from {result['src']}, not this checkout's src")
    return result


def interleaved(
    rounds: int, mode: str, url: str, candidates: Sequence[str] = CANDIDATES, **options: Any
) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` rounds of one probe per candidate, each in a fresh process, the order reversed every other round."""
    results: dict[str, list[dict[str, Any]]] = {candidate: [] for candidate in candidates}
    for number in range(rounds):
        for candidate in candidates if number % 2 == 0 else tuple(reversed(candidates)):
            results[candidate].append(probe(mode, candidate, url, **options))
    return results


def kit_client(fake: Any, **options: Any) -> Any:
    """A raw ``membase.Membase`` client on the testing kit's ``InMemoryMembase`` ``fake``, over its
    ``httpx.MockTransport`` (built from ``fake.handle``, so it works whichever way the kit routes its own stores)."""
    import httpx
    import membase

    from membase_strands.testing import API_KEY

    http = httpx.Client(base_url=fake.base_url, transport=httpx.MockTransport(fake.handle))
    return membase.Membase(api_key=API_KEY, base_url=fake.base_url, http_client=http, **options)


def of(results: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in results]


def ratio(now: float, reference: float) -> str:
    return f"x{fmt(now / reference)}" if reference else "n/a"  # three significant digits: x1.94, x0.00109

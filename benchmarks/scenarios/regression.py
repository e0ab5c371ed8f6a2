"""Section 7, against the previous RESULTS.md: every figure of this run next to the previous run's value.

A figure that grew by more than 20 % and by more than its noise floor is a regression unless it has
a reason: one given with ``--reason KEY=TEXT``, its machine reference (the raw SDK call, a turn
without memory) having moved by the same factor, or other processes having used a noticeable share
of the CPU while its section ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from report import Figure, Section, fmt
from support import BUSY_SHARE

NUMBER = 7
REGRESSION_LIMIT = 1.20
"""A figure may grow by at most 20 % without a reason."""


@dataclass
class Change:
    """One figure against its value in the previous run."""

    key: str
    label: str
    unit: str
    before: float
    after: float
    regressed: bool
    reason: str

    @property
    def ratio(self) -> float:
        """Now over before."""
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


def run(
    figures: list[Figure],
    before: dict[str, dict[str, Any]],
    before_info: dict[str, Any],
    reasons: dict[str, str],
    mode: str,
    busy: dict[str, float],
) -> Section:
    """Compare this run's figures with the previous run's.

    Args:
        figures: Every figure of this run.
        before: The previous run's figures by key (empty when there is none).
        before_info: The previous run's date, mode and command.
        reasons: Figure key -> why it regressed, from ``--reason``.
        mode: This run's mode, ``"full"`` or ``"quick"``.
        busy: Section number -> the share of the CPU other processes used while it ran.
    """
    limit = f"{(REGRESSION_LIMIT - 1) * 100:.0f} %"
    section = Section(
        NUMBER,
        "Against the previous RESULTS.md",
        f"Each figure against the one stored in the previous RESULTS.md (run of {before_info.get('date', 'unknown')}, "
        f"{before_info.get('mode', 'unknown')} mode). A regression is a figure that grew by more than "
        f"{limit} and by more than its noise floor. A reason comes from "
        "`--reason KEY=TEXT`, from the figure's machine reference having moved by the same factor, or from "
        f"other processes having used at least {BUSY_SHARE * 100:.0f} % of the CPU while its section ran.",
        ["figure", "key", "previous", "now", "change", "regression"],
    )
    target = f"no figure regresses by more than {limit} against the previous RESULTS.md without a reason"
    if not before:
        section.setup = "No previous RESULTS.md with figures: this run is the baseline."
        section.headers = []
        section.target(target, True, "no previous figures: this run is the baseline")
        return section
    changes, missing = compare(figures, before, reasons, busy)
    for change in changes:
        verdict = "no"
        if change.regressed:
            verdict = f"yes: {change.reason}" if change.reason else "**yes, no reason**"
        section.row(
            change.label,
            f"`{change.key}`",
            f"{fmt(change.before)} {change.unit}",
            f"{fmt(change.after)} {change.unit}",
            f"x{change.ratio:.2f}",
            verdict,
        )
    unexplained = [c for c in changes if c.regressed and not c.reason]
    section.target(
        target,
        not unexplained,
        ", ".join(f"{c.key} x{c.ratio:.2f}" for c in unexplained) or f"{len(changes)} figures compared",
    )
    if before_info.get("mode") != mode:
        section.notes.append("The previous run was made in another mode; its figures compare only roughly.")
    ran = {f.key.split(".")[0] for f in figures}
    missing = [key for key in missing if key.split(".")[0] in ran]
    if missing:
        section.notes.append(f"In the previous run but not in this one: {', '.join(missing)}.")
    return section

"""Text hygiene in one place: what can be sent (:func:`sendable`), what the model may read of a passage
(:func:`clean_text`: no control characters but newline and tab, no unpaired surrogates), and one-line clips for
names, reasons and log text (:func:`clip`: every control character folds to a space)."""

from __future__ import annotations

import re

# C0 controls but newline and tab, DEL, and the C1 controls (terminal escapes such as CSI U+009B).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]+")  # a regex: str.translate takes ten times as long
_NEEDS_CLEANING = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def sendable(text: str) -> str:
    """``text`` that can be sent as UTF-8 JSON: an unpaired surrogate becomes ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def clean_text(text: str) -> str:
    """Text without control characters (newlines and tabs stay) or unpaired surrogates."""
    if not _NEEDS_CLEANING.search(text):  # the common case, on the recall hot path
        return text
    return _CONTROL.sub("", sendable(text))


def clip(text: str, limit: int) -> str:
    """Fold ``text`` onto one line without control characters or unpaired surrogates, cut to ``limit`` characters."""
    one_line = " ".join(_CONTROL.sub(" ", sendable(text)).split())  # split() takes newlines and tabs too
    return one_line if len(one_line) <= limit else one_line[: limit - 1].rstrip() + "…"

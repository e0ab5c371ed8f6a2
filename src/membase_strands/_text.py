"""Text hygiene shared by what the model reads and what is sent or logged."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def sendable(text: str) -> str:
    """``text`` that can be sent as UTF-8 JSON: an unpaired surrogate becomes ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def clip(text: str, limit: int) -> str:
    """Fold ``text`` onto one line without control characters or unpaired surrogates, cut to ``limit`` characters."""
    folded = " ".join(_CONTROL.sub(" ", sendable(text)).split())
    return folded if len(folded) <= limit else folded[: limit - 1].rstrip() + "…"

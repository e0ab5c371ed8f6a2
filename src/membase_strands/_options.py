"""The store's options: their defaults, their bounds, and the checks that name a bad one."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

DEFAULT_SEARCH_RESULTS = 5
MAX_SEARCH_RESULTS = 50
MAX_QUERY_CHARS = 2000
MIN_RECALL_CHARS = 200
DEFAULT_RECALL_CHARS = 20_000
DEFAULT_WRITE_TIMEOUT = 5.0
WAIT_WITHOUT_BUDGET = 8.0  # how long the set-up check and close() wait when the matching option says None
TOOL_NAMES = ("search", "save", "profile")
ROLES = ("user", "assistant")

_DEFAULT_DESCRIPTION = (
    "Long-term memory from Membase: what the user's Memories hold from earlier conversations, notes and documents."
)


def query_text(query: str) -> str:
    """What is sent for a query: the text without surrounding whitespace, cut to ``MAX_QUERY_CHARS``."""
    return query.strip()[:MAX_QUERY_CHARS]


def describe(container: str | None) -> str:
    if container is None:
        return _DEFAULT_DESCRIPTION
    name = " ".join(container.split())[:80]
    return f"Long-term memory from the user's Membase Memory '{name}': earlier conversations, notes and documents."


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-blank string, got {name!r}")
    return name


def check_container(container: Any) -> str | None:
    if container is not None and (not isinstance(container, str) or not container.strip()):
        raise ValueError(f"container must be a Memory name or id, got {container!r}")
    return container


def passages_wanted(value: Any, option: str, default: int = DEFAULT_SEARCH_RESULTS) -> int:
    """How many passages to ask Membase for: one rule wherever the number comes from.

    The store's ``max_search_results``, the manager's ``max_entries`` and a tool's ``limit`` are all
    a whole number of at least 1; ``None`` means ``default``; above Membase's maximum of 50 it asks
    for 50 (the most Membase returns), rather than failing every turn.

    Raises:
        ValueError: ``value`` is not a whole number of at least 1 (the message names ``option``).
    """
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option} must be a whole number from 1 to {MAX_SEARCH_RESULTS}, got {value!r}")
    return min(value, MAX_SEARCH_RESULTS)


def check_recall_chars(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_RECALL_CHARS:
        raise ValueError(
            f"max_recall_chars must be a whole number of at least {MIN_RECALL_CHARS}, or None; got {value!r}"
        )
    return value


def check_min_score(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"min_score must be a finite number (a score Membase gives passages) or None, got {value!r}")
    return float(value)


def check_timeout(option: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{option} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def check_roles(roles: Iterable[str] | str) -> tuple[str, ...]:
    chosen = (roles,) if isinstance(roles, str) else tuple(roles)
    unknown = [role for role in chosen if role not in ROLES]
    if unknown or not chosen:
        raise ValueError(f"capture_roles must name 'user' and/or 'assistant', got {chosen!r}")
    return tuple(dict.fromkeys(chosen))


def check_tools(tools: Iterable[str]) -> tuple[str, ...]:
    if isinstance(tools, str):
        raise ValueError(f"tools must be a list of tool names such as ('search', 'save'), got {tools!r}")
    chosen = tuple(tools)
    unknown = [tool for tool in chosen if tool not in TOOL_NAMES]
    if unknown:
        raise ValueError(f"tools: unknown tool name(s) {unknown!r}; choose from {', '.join(TOOL_NAMES)}")
    return tuple(dict.fromkeys(chosen))


def write_flags(metadata: dict[str, Any] | None) -> tuple[str, bool]:
    if metadata is None:
        return "", False
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    title = metadata.get("title", "")
    static = metadata.get("static", False)
    if not isinstance(title, str):
        raise ValueError(f"metadata['title'] must be a string, got {type(title).__name__}")
    if not isinstance(static, bool):
        raise ValueError(f"metadata['static'] must be True or False, got {static!r}")
    return title, static

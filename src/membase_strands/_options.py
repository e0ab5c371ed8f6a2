"""The store's options: their defaults, their bounds, and the checks that name a bad one."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeGuard

DEFAULT_SEARCH_RESULTS = 5
MAX_SEARCH_RESULTS = 50
MAX_QUERY_CHARS = 2000
MIN_RECALL_CHARS = 200
DEFAULT_RECALL_CHARS = 20_000
DEFAULT_WRITE_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 90.0  # the SDK's own timeout
DEFAULT_RESPONSE_BYTES = 16 * 1024 * 1024
DEFAULT_PROFILE_TTL = 300.0
WAIT_WITHOUT_BUDGET = 8.0  # how long the set-up check and close() wait when the matching option says None
TOOL_NAMES = ("search", "save", "profile")  # the default set; "forget" is opt-in
ALL_TOOL_NAMES = (*TOOL_NAMES, "forget")


def query_text(query: str) -> str:
    return query.strip()[:MAX_QUERY_CHARS]


def describe(container: str | None) -> str:
    if container is not None:
        name = " ".join(container.split())[:80]
        return f"Long-term memory from the user's Membase Memory '{name}': earlier conversations, notes and documents."
    return (
        "Long-term memory from Membase: what the user's Memories hold from earlier conversations, notes and documents."
    )


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-blank string, got {name!r}")
    return name


def check_container(container: Any) -> str | None:
    if container is not None and (not isinstance(container, str) or not container.strip()):
        raise ValueError(f"container must be a Memory name or id, got {container!r}")
    return container


def passages_wanted(value: Any, option: str, default: int = DEFAULT_SEARCH_RESULTS) -> int:
    """How many passages to ask for (``None``: ``default``), past Membase's maximum the maximum, not an error."""
    if value is None or whole(value, 1):
        return default if value is None else min(value, MAX_SEARCH_RESULTS)
    raise ValueError(f"{option} must be a whole number from 1 to {MAX_SEARCH_RESULTS}, got {value!r}")


def check_recall_chars(value: Any) -> int | None:
    if value is None or whole(value, MIN_RECALL_CHARS):
        return value
    raise ValueError(f"max_recall_chars must be a whole number of at least {MIN_RECALL_CHARS}, or None; got {value!r}")


def check_min_score(value: Any) -> float | None:
    if value is None or finite(value):
        return None if value is None else float(value)
    raise ValueError(f"min_score must be a finite number (a score Membase gives passages) or None, got {value!r}")


def check_timeout(option: str, value: Any, *, none: bool = True) -> float | None:
    if (value is None and none) or (finite(value) and value > 0):
        return None if value is None else float(value)
    raise ValueError(f"{option} must be a positive number of seconds{' or None' if none else ''}, got {value!r}")


def check_flag(option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{option} must be True or False, got {value!r}")
    return value


def check_bytes(option: str, value: Any) -> int:
    if whole(value, 1024):
        return value
    raise ValueError(f"{option} must be a whole number of bytes, at least 1024, got {value!r}")


def check_capture(capture: Any, extraction: Any) -> bool:
    if check_flag("capture", capture) is False and extraction not in (None, False):
        raise ValueError("extraction needs capture=True: without capture the store accepts no writes")
    return bool(capture)


def check_roles(roles: Iterable[str] | str) -> tuple[str, ...]:
    chosen = (roles,) if isinstance(roles, str) else tuple(roles)
    if not chosen or any(role not in ("user", "assistant") for role in chosen):
        raise ValueError(f"capture_roles must name 'user' and/or 'assistant', got {chosen!r}")
    return tuple(dict.fromkeys(chosen))


def check_tools(tools: Iterable[str]) -> tuple[str, ...]:
    if isinstance(tools, str):
        raise ValueError(f"tools must be a list of tool names such as ('search', 'save'), got {tools!r}")
    chosen = tuple(tools)
    if unknown := [tool for tool in chosen if tool not in ALL_TOOL_NAMES]:
        raise ValueError(f"tools: unknown tool name(s) {unknown!r}; choose from {', '.join(ALL_TOOL_NAMES)}")
    return tuple(dict.fromkeys(chosen))


def write_flags(metadata: dict[str, Any] | None) -> tuple[str, bool]:
    if not isinstance(metadata, dict | None):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    title, static = (metadata or {}).get("title", ""), (metadata or {}).get("static", False)
    if not isinstance(title, str):
        raise ValueError(f"metadata['title'] must be a string, got {type(title).__name__}")
    if not isinstance(static, bool):
        raise ValueError(f"metadata['static'] must be True or False, got {static!r}")
    return title, static


def whole(value: Any, least: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))

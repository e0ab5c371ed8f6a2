"""The store's options: their defaults, their bounds, and the checks that name a bad one."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
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
DEFAULT_CLOSE_TIMEOUT = 20.0  # within a server's grace period (gunicorn: 30 s), with room for the turns in flight
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


def is_whole_number(value: Any, least: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


def _is_seconds(value: Any) -> bool:
    return is_finite_number(value) and value > 0


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _or_none(allowed: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or allowed(value)


_SECONDS = "a positive number of seconds"
# What each option must be, and the words its error says it in: "<option> must be <words>, got <value>".
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (_is_text, "a non-blank string"),
    "container": (_or_none(_is_text), "a Memory name or id"),
    "max_recall_chars": (
        _or_none(lambda value: is_whole_number(value, MIN_RECALL_CHARS)),
        f"a whole number of at least {MIN_RECALL_CHARS}, or None",
    ),
    "min_score": (_or_none(is_finite_number), "a finite number (a score Membase gives passages) or None"),
    "max_response_bytes": (lambda value: is_whole_number(value, 1024), "a whole number of bytes, at least 1024"),
    **dict.fromkeys(
        ("recall_timeout", "write_timeout", "access_cooldown"), (_or_none(_is_seconds), f"{_SECONDS} or None")
    ),
    **dict.fromkeys(("request_timeout", "close_timeout", "profile_ttl"), (_is_seconds, _SECONDS)),
    **dict.fromkeys(("capture", "recall_profile"), (lambda value: isinstance(value, bool), "True or False")),
}


def check(arguments: dict[str, Any]) -> None:
    """Raise a ``ValueError`` naming the first of the store's ``arguments`` that its rule refuses."""
    for option, (allowed, words) in _RULES.items():
        if option in arguments and not allowed(arguments[option]):
            raise ValueError(f"{option} must be {words}, got {arguments[option]!r}")


def passages_wanted(value: Any, option: str, default: int = DEFAULT_SEARCH_RESULTS) -> int:
    """How many passages to ask for (``None``: ``default``), past Membase's maximum the maximum, not an error."""
    if value is not None and not is_whole_number(value, 1):
        raise ValueError(f"{option} must be a whole number from 1 to {MAX_SEARCH_RESULTS}, got {value!r}")
    return default if value is None else min(value, MAX_SEARCH_RESULTS)


def check_capture(capture: Any, extraction: Any) -> bool:
    if not capture and extraction not in (None, False):
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


def unknown_option(name: str, known: Iterable[str]) -> str:
    """The error for an option that is not one of ``known``: the one meant, if one is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    meant = f"did you mean {close[0]!r}?" if close else f"the options are {', '.join(known)}"
    return f"unknown option {name!r}: {meant}"

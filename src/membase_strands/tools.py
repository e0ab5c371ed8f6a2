"""The model's Membase tools: ``membase_search``, ``membase_save`` and ``membase_profile``.

Each tool answers in sentences. A Membase failure never raises out of a tool: it becomes a
sentence the model can relay (a 403, a timeout, a busy memory, ...) in a result whose status is
``"error"``, so Strands and any tracing see the failure while the model still reads why. There
is deliberately no tool to delete or forget anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import membase
from strands import tool
from strands.types.tools import AgentTool

from ._containers import Container, names_in_reach
from ._formatting import SearchAnswer, arrange, fit_to_budget, memory_label, profile_text, search_text
from ._options import query_text
from .errors import Failure, describe_failure

logger = logging.getLogger(__name__)

SEARCH_DESCRIPTION = (
    "Search the user's Membase memory: their Memories of earlier conversations, notes and documents. "
    "Use it when the answer may depend on something the user said or saved before. Results come best first "
    "and name the Memory (or Memories) each passage came from; Memories listed under 'Not searched' could not "
    "answer, so a missing result from them is not evidence that the fact is unknown."
)
SAVE_DESCRIPTION = (
    "Save a note to the user's Membase memory. Only save when the user asked you to remember something, "
    "and save it in the user's own words. Set standing_fact=true for a lasting fact about the user (it goes "
    "to their profile). If several Memories are in reach and none is named, the tool lists them so you can "
    "ask the user which one."
)
CLOSED_SENTENCE = "Membase is not available: this memory store was closed by the application."
PROFILE_DESCRIPTION = (
    "Read the user's Membase profile: standing facts about them, their recently changed facts and, with a "
    "topic, what their memory holds on it."
)


@dataclass(frozen=True)
class ToolBackend:
    """What the tools need from their store: its settings, and its Membase calls as plain callables.

    The store builds one in ``get_tools()``; the tools never reach into the store itself.
    """

    store_name: str
    container: str | None
    max_recall_chars: int | None
    is_closed: Callable[[], bool]
    count: Callable[[str], None]
    redact: Callable[[str], str]
    resolve_limit: Callable[[Any, str], int]
    search: Callable[[str, int, str | None], SearchAnswer]
    """Waits for the SDK's full timeout and retries, so a cold start still gets an answer."""
    save: Callable[[str, str | None, bool], Any]
    """One attempt: a save that timed out may already be stored, so it is never resent blindly."""
    container_id: Callable[[str], str]
    profile: Callable[[str | None], Any]
    memories_in_reach: Callable[[], list[Container]]
    min_score: float | None = None
    """The relevance floor: passages scored below it are left out (the tool says how many)."""


def build_tools(backend: ToolBackend, names: tuple[str, ...]) -> list[AgentTool]:
    """Build the chosen tools for one store.

    The tools' schemas and input validators are built once for the process (see :class:`_Tools`); a
    store's tools are those bound to its backend, which costs a few microseconds.

    Args:
        backend: The store's settings and Membase calls.
        names: Which of ``"search"``, ``"save"`` and ``"profile"`` to build, in order.

    Returns:
        The Strands tools, ready for ``get_tools()``.
    """
    bound = _Tools(backend)
    tools: list[AgentTool] = [getattr(bound, f"membase_{name}") for name in names]
    return tools


class _Tools:
    """The three tools as methods, decorated once: each instance is one store's tools.

    Strands turns a ``@tool`` method into a tool bound to the instance it is read from, reusing the
    schema and the input validator it built from the signature and docstring (the costly part,
    milliseconds per tool) instead of building them again for every store.
    """

    def __init__(self, backend: ToolBackend) -> None:
        self._backend = backend

    @tool(name="membase_search", description=SEARCH_DESCRIPTION)
    def membase_search(self, query: str, container: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """Search the user's Membase memory.

        Args:
            query: What to look for, in plain words.
            container: The name of one Memory to search. Omit to search every Memory in reach.
            limit: How many passages to return, 1 to 50.
        """
        return _guarded(self._backend, "membase_search", lambda: _search(self._backend, query, container, limit))

    @tool(name="membase_save", description=SAVE_DESCRIPTION)
    def membase_save(self, content: str, container: str | None = None, standing_fact: bool = False) -> dict[str, Any]:
        """Save a note the user asked you to remember.

        Args:
            content: What to remember, in the user's own words.
            container: The name of the Memory to save to. Omit when only one Memory is in reach.
            standing_fact: True for a lasting fact about the user, kept in their profile.
        """
        return _guarded(self._backend, "membase_save", lambda: _save(self._backend, content, container, standing_fact))

    @tool(name="membase_profile", description=PROFILE_DESCRIPTION)
    def membase_profile(self, topic: str | None = None) -> dict[str, Any]:
        """Read the user's Membase profile.

        Args:
            topic: Optionally, a topic to look up in the user's memory as well.
        """
        return _guarded(self._backend, "membase_profile", lambda: _profile(self._backend, topic))


def _guarded(backend: ToolBackend, tool_name: str, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Count the call, and answer plainly once the store is closed."""
    backend.count(f"tool_calls.{tool_name}")
    if backend.is_closed():
        return _error(CLOSED_SENTENCE)
    return call()


def _search(backend: ToolBackend, query: str, container: str | None, limit: int | None) -> dict[str, Any]:
    if not query.strip():
        return _error("Nothing was searched: the query was empty.")
    try:
        count = backend.resolve_limit(limit, "limit")
    except ValueError as error:
        return _error(f"Nothing was searched: {error}.")
    target = container or backend.container
    text = query_text(query)
    try:
        answer = backend.search(text, count, target)
    except ValueError as error:
        return _error(f"Nothing was searched: {error}.")
    except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
        return _failed(backend, "membase_search", error, container_named=target is not None)
    reply = search_text(text, fit_to_budget(arrange(answer, backend.min_score), backend.max_recall_chars))
    # When no Memory could answer, the search did not really happen: say so with an error status.
    return _error(reply) if answer.none_answered else _ok(reply)


def _save(backend: ToolBackend, content: str, container: str | None, standing_fact: bool) -> dict[str, Any]:
    if not content.strip():
        return _error("Nothing was saved: the content was empty.")
    target = None if standing_fact else (container or backend.container)
    if target is not None:
        # Find the Memory first, so a failure here is known to have saved nothing.
        try:
            backend.container_id(target)
        except ValueError as error:
            return _error(f"Nothing was saved: {error}.")
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            return _failed(backend, "membase_save", error, container_named=True)
    try:
        backend.save(content, target, standing_fact)
    except ValueError as error:
        return _error(f"Nothing was saved: {error}.")
    except membase.BadRequestError as error:
        several = _several_memories(backend) if target is None and not standing_fact else None
        if several:
            return _error(
                f"Nothing was saved: several Memories are in reach ({several}). Ask the user which one, "
                "then call membase_save again with container set to its name."
            )
        return _failed(backend, "membase_save", error, container_named=target is not None)
    except membase.APITimeoutError as error:
        _note_failure(backend, "membase_save", error)
        return _error(
            "Membase did not answer in time, so the note may or may not have been saved; try again in a minute, "
            "after checking with membase_search that it is not already there."
        )
    except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
        return _failed(backend, "membase_save", error, container_named=target is not None)
    if standing_fact:
        return _ok("Saved as a standing fact in the user's Membase profile.")
    where = f"the Memory '{memory_label(target)}'" if target else "Membase"
    return _ok(f"Saved to {where}.")


def _profile(backend: ToolBackend, topic: str | None) -> dict[str, Any]:
    wanted = query_text(topic) if topic and topic.strip() else None
    try:
        return _ok(profile_text(backend.profile(wanted), wanted, backend.max_recall_chars))
    except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
        return _failed(backend, "membase_profile", error)


def _several_memories(backend: ToolBackend) -> str | None:
    try:
        containers = backend.memories_in_reach()
    except Exception:  # noqa: BLE001 - only a better sentence is at stake
        return None
    return names_in_reach(containers) if len(containers) > 1 else None


def _note_failure(
    backend: ToolBackend, tool_name: str, error: BaseException, *, container_named: bool = False
) -> Failure:
    """Count and log a failed Membase call; the caller decides what the model reads."""
    failure = describe_failure(error, container_named=container_named)
    backend.count(f"errors.{failure.kind}")
    logger.warning(
        "store=<%s>, tool=<%s>, reason=<%s> | Membase call failed; the model was told",
        backend.store_name,
        tool_name,
        failure.kind,
    )
    return failure


def _failed(
    backend: ToolBackend, tool_name: str, error: BaseException, *, container_named: bool = False
) -> dict[str, Any]:
    failure = _note_failure(backend, tool_name, error, container_named=container_named)
    return _error(backend.redact(failure.sentence))


def _ok(text: str) -> dict[str, Any]:
    return {"status": "success", "content": [{"text": text}]}


def _error(text: str) -> dict[str, Any]:
    return {"status": "error", "content": [{"text": text}]}

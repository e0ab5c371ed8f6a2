"""The model's Membase tools: ``membase_search``, ``membase_save`` and ``membase_profile``.

Each tool answers in sentences. A Membase failure never raises out of a tool: it becomes a
sentence the model can relay (a 403, a timeout, a busy memory, ...) in a result whose status is
``"error"``, so Strands and any tracing see the failure while the model still reads why. There
is deliberately no tool to delete or forget anything.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import membase
from strands.tools.decorator import DecoratedFunctionTool, FunctionToolMetadata
from strands.types.tools import AgentTool, ToolSpec

from . import _telemetry
from ._containers import names_in_reach
from ._counters import Counters
from ._failures import Failure, describe_failure
from ._formatting import arrange, memory_label, profile_text, search_text
from ._gateway import MembaseGateway
from ._options import passages_wanted, query_text

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
class ToolContext:
    """What the tools need from their store: its settings, its counters, and the door to Membase.

    The store builds one in ``get_tools()``; the tools never reach into the store itself.
    """

    gateway: MembaseGateway
    counters: Counters
    store_name: str
    container: str | None
    default_limit: int
    max_recall_chars: int | None
    min_score: float | None
    is_closed: Callable[[], bool]


def build_tools(context: ToolContext, names: tuple[str, ...]) -> list[AgentTool]:
    """Build the chosen tools for one store.

    Args:
        context: The store's settings, counters and gateway.
        names: Which of ``"search"``, ``"save"`` and ``"profile"`` to build, in order.

    Returns:
        The Strands tools, ready for ``get_tools()``.
    """
    makers = {"search": _search_tool, "save": _save_tool, "profile": _profile_tool}
    return [makers[name](context) for name in names]


def _search_tool(context: ToolContext) -> AgentTool:
    def membase_search(query: str, container: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """Search the user's Membase memory.

        Args:
            query: What to look for, in plain words.
            container: The name of one Memory to search. Omit to search every Memory in reach.
            limit: How many passages to return, 1 to 50.
        """
        if not query.strip():
            return _error("Nothing was searched: the query was empty.")
        try:
            count = passages_wanted(limit, "limit", context.default_limit)
        except ValueError as error:
            return _error(f"Nothing was searched: {error}.")
        target = container or context.container
        text = query_text(query)
        try:
            answer = context.gateway.search(text, count, target, retry=True)  # a cold start still gets an answer
        except ValueError as error:
            return _error(f"Nothing was searched: {error}.")
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            return _failed(context, "membase_search", error, container_named=target is not None)
        shown = arrange(answer, count, min_score=context.min_score, budget=context.max_recall_chars)
        reply = search_text(text, shown)
        _telemetry.annotate(
            "hit" if shown.passages else "empty",
            passages=len(shown.passages),
            unanswered=len(answer.unsearched),
            chars_returned=len(reply),
        )
        # When no Memory could answer, the search did not really happen: say so with an error status.
        return _error(reply) if answer.none_answered else _ok(reply)

    return _as_tool(context, membase_search, SEARCH_DESCRIPTION)


def _save_tool(context: ToolContext) -> AgentTool:
    def membase_save(content: str, container: str | None = None, standing_fact: bool = False) -> dict[str, Any]:
        """Save a note the user asked you to remember.

        Args:
            content: What to remember, in the user's own words.
            container: The name of the Memory to save to. Omit when only one Memory is in reach.
            standing_fact: True for a lasting fact about the user, kept in their profile.
        """
        if not content.strip():
            return _error("Nothing was saved: the content was empty.")
        target = None if standing_fact else (container or context.container)
        if target is not None:
            # Find the Memory first, so a failure here is known to have saved nothing.
            try:
                context.gateway.container_id(target)
            except ValueError as error:
                return _error(f"Nothing was saved: {error}.")
            except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
                return _failed(context, "membase_save", error, container_named=True)
        try:
            context.gateway.save(content, target, static=standing_fact)
        except ValueError as error:
            return _error(f"Nothing was saved: {error}.")
        except membase.BadRequestError as error:
            several = _several_memories(context) if target is None and not standing_fact else None
            if several:
                return _error(
                    f"Nothing was saved: several Memories are in reach ({several}). Ask the user which one, "
                    "then call membase_save again with container set to its name."
                )
            return _failed(context, "membase_save", error, container_named=target is not None)
        except membase.APITimeoutError as error:
            _note_failure(context, "membase_save", error)
            return _error(
                "Membase did not answer in time, so the note may or may not have been saved; try again in a minute, "
                "after checking with membase_search that it is not already there."
            )
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            return _failed(context, "membase_save", error, container_named=target is not None)
        if standing_fact:
            return _ok("Saved as a standing fact in the user's Membase profile.")
        where = f"the Memory '{memory_label(target)}'" if target else "Membase"
        return _ok(f"Saved to {where}.")

    return _as_tool(context, membase_save, SAVE_DESCRIPTION)


def _profile_tool(context: ToolContext) -> AgentTool:
    def membase_profile(topic: str | None = None) -> dict[str, Any]:
        """Read the user's Membase profile.

        Args:
            topic: Optionally, a topic to look up in the user's memory as well.
        """
        wanted = query_text(topic) if topic and topic.strip() else None
        try:
            return _ok(profile_text(context.gateway.profile(wanted), wanted, context.max_recall_chars))
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            return _failed(context, "membase_profile", error)

    return _as_tool(context, membase_profile, PROFILE_DESCRIPTION)


def _as_tool(context: ToolContext, function: Callable[..., dict[str, Any]], description: str) -> AgentTool:
    """Make ``function`` a Strands tool that is counted, and answers plainly once the store is closed."""

    @functools.wraps(function)  # keeps the signature and docstring Strands builds the tool's schema from
    def counted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        context.counters.add(f"tool_calls.{function.__name__}")
        with _telemetry.operation(_telemetry.TOOL, context.store_name, tool=function.__name__) as operation:
            if context.is_closed():
                operation.outcome("error", error_kind="closed")
                return _error(CLOSED_SENTENCE)
            result = function(*args, **kwargs)
            operation.default_outcome("ok" if result.get("status") == "success" else "error")
            return result

    spec, metadata = _template(function, description)
    # The spec is the store's own copy: nothing one agent's registry does to it can reach another store's tools.
    return DecoratedFunctionTool(function.__name__, copy.deepcopy(spec), counted, metadata)


_TEMPLATES: dict[str, tuple[ToolSpec, FunctionToolMetadata]] = {}


def _template(function: Callable[..., dict[str, Any]], description: str) -> tuple[ToolSpec, FunctionToolMetadata]:
    """The tool's spec and argument model, made once per process, as ``strands.tool`` makes them.

    Strands builds a pydantic model from a tool's signature (milliseconds), and every store's tool has the same
    signature: a server that builds a store per user pays it once, not per user. The template is made from a
    stand-in with the function's signature and docstring, so it holds no store.
    """
    template = _TEMPLATES.get(function.__name__)
    if template is None:
        metadata = FunctionToolMetadata(_stand_in(function))
        spec = metadata.extract_metadata()
        spec["name"], spec["description"] = function.__name__, description
        template = _TEMPLATES.setdefault(function.__name__, (spec, metadata))  # atomic: the first one made wins
    return template


def _stand_in(function: Callable[..., Any]) -> Callable[..., Any]:
    """A function with ``function``'s name, docstring and signature that holds nothing of it and is never called."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a tool template is never called")

    stand_in.__name__ = stand_in.__qualname__ = function.__name__
    stand_in.__doc__ = function.__doc__
    stand_in.__annotations__ = dict(function.__annotations__)
    stand_in.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
    return stand_in


def _several_memories(context: ToolContext) -> str | None:
    try:
        containers = context.gateway.memories_in_reach()
    except Exception:  # noqa: BLE001 - only a better sentence is at stake
        return None
    return names_in_reach(containers) if len(containers) > 1 else None


def _note_failure(
    context: ToolContext, tool_name: str, error: BaseException, *, container_named: bool = False
) -> Failure:
    """Count and log a failed Membase call; the caller decides what the model reads."""
    failure = describe_failure(error, container_named=container_named)
    context.counters.add(f"errors.{failure.kind}")
    _telemetry.annotate("error", error_kind=failure.kind)
    logger.warning(
        "store=<%s>, tool=<%s>, reason=<%s> | Membase call failed; the model was told",
        context.store_name,
        tool_name,
        failure.kind,
    )
    return failure


def _failed(
    context: ToolContext, tool_name: str, error: BaseException, *, container_named: bool = False
) -> dict[str, Any]:
    failure = _note_failure(context, tool_name, error, container_named=container_named)
    return _error(context.gateway.redact(failure.sentence))


def _ok(text: str) -> dict[str, Any]:
    return {"status": "success", "content": [{"text": text}]}


def _error(text: str) -> dict[str, Any]:
    return {"status": "error", "content": [{"text": text}]}

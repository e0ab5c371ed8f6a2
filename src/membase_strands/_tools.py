"""The model's Membase tools: ``membase_search``, ``membase_save``, ``membase_profile`` and, opt-in,
``membase_forget``.

A Membase failure never raises out of a tool: the model reads a sentence it can relay, with status ``"error"``.
``membase_forget`` never forgets on the model's word: it asks Membase what would be forgotten, then raises a Strands
interrupt for the application to ask the user (naming the passage as ``membase_search`` showed it, and Membase's own
``how``), and forgets only when the answer to it is ``True``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import membase
from strands import tool
from strands.tools.decorator import DecoratedFunctionTool
from strands.types.tools import AgentTool
from strands.types.tools import ToolContext as StrandsToolContext

from . import _telemetry
from ._containers import names_in_reach
from ._failures import LEVEL, Refused, describe_failure
from ._formatting import Passage, arrange, memory_label, passage_id, profile_text, search_text
from ._gateway import SAVE, MembaseGateway
from ._http import may_have_arrived
from ._options import passages_wanted, query_text
from ._text import clip

CLOSED_SENTENCE = "Membase is not available: this memory store was closed by the application."
_TIMED_OUT = "Membase did not answer in time"
_BROKE_OFF = "The connection to Membase broke off after the note was sent"
_MAYBE_SAVED = (
    "so the note may or may not have been saved; try again in a minute, after checking with membase_search that it "
    "is not already there."
)
_DECLINED = "The user did not approve forgetting it, so nothing was forgotten."
_QUEUED = " Membase learns it in the background, so a search right away may not find it yet."
_UNSHOWN = (
    "Nothing was forgotten: membase_search has not shown a passage with the id '{}', and Membase did not say what it "
    "holds, so the user cannot be asked to approve it. Search for it and use the id shown; or the user can remove it "
    "themselves in the Membase app, on its Memory's page."
)
_SHOWN_IDS = 256  # the passages (by id) a store's tools remember as membase_search showed them, the newest


def build_tools(context: ToolContext, names: tuple[str, ...]) -> list[AgentTool]:
    """One store's tools, of ``"search"``, ``"save"``, ``"profile"`` and ``"forget"``, in the order named."""
    tools = [getattr(context, f"membase_{name}") for name in names]  # each bound to this store's context
    for bound in tools:  # a spec of its own: nothing one agent's registry does to it can reach another store's tools
        bound.tool_spec = copy.deepcopy(bound.tool_spec)
    return tools


def _tool(method: Callable[..., dict[str, Any]]) -> DecoratedFunctionTool[..., dict[str, Any]]:
    """Make a method a tool that is counted and traced, and answers plainly once the store is closed."""

    @functools.wraps(method)  # keeps the signature and docstring Strands builds the tool's schema from
    def run(self: ToolContext, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with _telemetry.operation(_telemetry.TOOL, self.ledger, tool=method.__name__) as operation:
            self.ledger.count(f"tool_calls.{method.__name__}")
            if self.is_closed():
                operation.outcome("error", error_kind="closed")
                return _reply(CLOSED_SENTENCE, ok=False)
            result = method(self, *args, **kwargs)
            if operation.outcome_set is None:
                operation.outcome("ok" if result["status"] == "success" else "error")
            return result

    made = tool(context=method.__name__ == "membase_forget")(run)  # Strands leaves out `self`
    made.tool_spec["description"] = " ".join(made.tool_spec["description"].split())  # the docstring's, on one line
    return made


@dataclass(frozen=True)
class ToolContext:
    """One store's tools, over what they need from it (they never reach into the store itself)."""

    gateway: MembaseGateway
    ledger: _telemetry.Ledger
    container: str | None
    default_limit: Callable[[], int]
    max_recall_chars: int | None
    min_score: float | None
    is_closed: Callable[[], bool]
    ids: bool  # whether membase_search shows each passage's id (for membase_forget)
    shown: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (Memory, text) as membase_search showed

    @_tool
    def membase_search(self, query: str, container: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """Search the user's Membase memory: their Memories of earlier conversations, notes and documents. Use it
        when the answer may depend on something the user said or saved before. Results come best first and name the
        Memory (or Memories) each passage came from; Memories listed under 'Not searched' could not answer, so a
        missing result from them is not evidence that the fact is unknown.

        Args:
            query: What to look for, in plain words.
            container: The name of one Memory to search. Omit to search every Memory in reach.
            limit: How many passages to return, 1 to 50.
        """
        if not query.strip():
            return _reply("Nothing was searched: the query was empty.", ok=False)
        target, text = container or self.container, query_text(query)
        try:
            count = passages_wanted(limit, "limit", self.default_limit())
            answer = self.gateway.search(text, count, target, retry=True)  # a cold start still gets an answer
        except ValueError as error:
            return _reply(f"Nothing was searched: {error}.", ok=False)
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            return self._failed("membase_search", error, container_named=target is not None)
        shown = arrange(answer, count, min_score=self.min_score, budget=self.max_recall_chars)
        reply = search_text(text, shown, ids=self.ids)
        if self.ids:
            self._remember(shown.passages)
        outcome, unanswered = "hit" if shown.passages else "empty", len(answer.unsearched)
        _telemetry.mark(outcome, passages=len(shown.passages), unanswered=unanswered, chars_returned=len(reply))
        return _reply(reply, ok=not answer.none_answered)  # when no Memory could answer, nothing was searched

    @_tool
    def membase_save(self, content: str, container: str | None = None, standing_fact: bool = False) -> dict[str, Any]:
        """Save a note to the user's Membase memory. Only save when the user asked you to remember something, and
        save it in the user's own words. Set standing_fact=true for a lasting fact about the user (it goes to their
        profile). If several Memories are in reach and none is named, the tool lists them so you can ask the user
        which one.

        Args:
            content: What to remember, in the user's own words.
            container: The name of the Memory to save to. Omit when only one Memory is in reach.
            standing_fact: True for a lasting fact about the user, kept in their profile.
        """
        if not content or content.isspace():  # not strip(): a note too large to send must not be copied
            return _reply("Nothing was saved: the content was empty.", ok=False)
        target, posted = None if standing_fact else (container or self.container), False
        try:
            if (refused := self.gateway.off(SAVE)) is not None:  # not even the Memory is looked up
                raise refused
            if target is not None:  # found first, so a lookup that timed out is known to have saved nothing
                self.gateway.container_id(target)
            posted = True
            answer = self.gateway.save(content, target, static=standing_fact)
        except ValueError as error:
            return _reply(f"Nothing was saved: {error}.", ok=False)
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            if isinstance(error, membase.BadRequestError) and target is None and not standing_fact:
                with contextlib.suppress(Exception):  # only a better sentence is at stake
                    if len(in_reach := self.gateway.memories_in_reach()) > 1:
                        return _reply(
                            f"Nothing was saved: several Memories are in reach ({names_in_reach(in_reach)}). Ask the "
                            "user which one, then call membase_save again with container set to its name.",
                            ok=False,
                        )
            failed = self._failed("membase_save", error, container_named=target is not None)
            if posted and may_have_arrived(error):
                lead = _BROKE_OFF
                if isinstance(error, membase.APITimeoutError):
                    lead = _TIMED_OUT
                elif isinstance(error, membase.APIStatusError):  # a gateway in front of Membase gave up waiting
                    lead = f"A gateway in front of Membase answered {error.status} after the note was sent"
                return _reply(f"{lead}, {_MAYBE_SAVED}", ok=False)
            return failed
        if standing_fact:
            return _reply("Saved as a standing fact in the user's Membase profile.")
        queued = isinstance(answer, dict) and answer.get("status") == "queued"  # hosted: accepted, learned later
        saved = f"Saved to the Memory '{memory_label(target)}'." if target else "Saved to Membase."
        return _reply(saved + (_QUEUED if queued else ""))

    @_tool
    def membase_profile(self, topic: str | None = None) -> dict[str, Any]:
        """Read the user's Membase profile: standing facts about them, their recently changed facts and, with a
        topic, what their memory holds on it.

        Args:
            topic: Optionally, a topic to look up in the user's memory as well.
        """
        wanted = query_text(topic) if topic and topic.strip() else None
        try:
            body = self.gateway.profile(wanted)
            return _reply(profile_text(body, wanted, self.max_recall_chars, self.gateway.redact))
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            return self._failed("membase_profile", error)

    @_tool
    def membase_forget(self, memory_id: str, tool_context: StrandsToolContext) -> dict[str, Any]:
        """Forget one passage of the user's Membase memory, by the id membase_search shows for it: only when the user
        asks to forget something, or to correct it (then save the corrected fact with membase_save). The user is
        asked to approve first; nothing is forgotten without their yes.

        Args:
            memory_id: The passage's id, exactly as membase_search shows it.
        """
        wanted = memory_id.strip()
        if not wanted:
            return _reply("Nothing was forgotten: no id was given.", ok=False)
        shown = self.shown.get(wanted)
        try:
            preview = self.gateway.forget(wanted, confirm=False)  # what would be forgotten; nothing is yet
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            guessed = shown is None and isinstance(error, membase.NotFoundError)  # an id the model made up
            return self._failed("membase_forget", error, level=logging.INFO if guessed else logging.WARNING)
        if preview.get("status") != "confirmation_required":
            status = clip(str(preview.get("status")), 40)
            return _reply(f"Nothing was forgotten: Membase answered '{status}' instead of asking to confirm.", ok=False)
        # The question asked, kept in the agent's state (which a session manager keeps): resumed in a later request,
        # by another worker or store, the tool finds what the person approved even where search never showed it.
        asked = f"membase_forget:{tool_context.tool_use['toolUseId']}"
        reason = tool_context.agent.state.get(asked)
        if reason is None:
            said = self.gateway.redact(clip(str(preview.get("content") or preview.get("title") or ""), 2000))
            memory, content = shown or ("", said)  # hosted Membase says nothing of the content: what search showed
            if not content:
                self.ledger.log(logging.INFO, "forget not asked for: an id search never showed", tool="membase_forget")
                return _reply(_UNSHOWN.format(clip(wanted, 120)), ok=False)
            how = self.gateway.redact(clip(str(preview.get("how") or ""), 500))  # Membase's sentence for the person
            reason = {"memory_id": wanted, "content": content, "memory": memory or self._memory_of(wanted), "how": how}
            tool_context.agent.state.set(asked, reason)
        approved = tool_context.interrupt("membase_forget", reason=reason) is True  # the application asked the user
        tool_context.agent.state.delete(asked)
        if not approved:
            _telemetry.mark("declined")
            return _reply(_DECLINED)
        try:
            self.gateway.forget(wanted, confirm=True)
        except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the model
            return self._failed("membase_forget", error)
        self.shown.pop(wanted, None)
        return _reply(f"Forgotten, with the user's approval: {clip(reason['content'], 200)}")

    def _remember(self, passages: list[Passage]) -> None:
        """Keep what membase_search showed of each passage with an id, for membase_forget to name it; the newest
        (each step one dict operation: safe from any thread)."""
        for passage in passages:
            if known := passage_id(passage.metadata):
                self.shown.pop(known, None)
                self.shown[known] = (passage.memory, clip(passage.text, 2000))
        for oldest in list(self.shown)[:-_SHOWN_IDS]:
            self.shown.pop(oldest, None)

    def _memory_of(self, passage_id: str) -> str:
        """The name of the Memory a passage id names, or the id's own prefix when it cannot be looked up."""
        if passage_id.startswith("document:"):
            return "a document"
        container = passage_id.rpartition(":")[0]
        with contextlib.suppress(Exception):  # only the reason's wording is at stake
            return next(c.name for c in self.gateway.memories_in_reach() if c.id == container)
        return container or "Membase"

    def _failed(
        self, tool: str, error: BaseException, *, container_named: bool = False, level: int = logging.WARNING
    ) -> dict[str, Any]:
        """Count and log a failed Membase call, and tell the model why (a refusal above the key's level at DEBUG: the
        gateway says it once)."""
        failure = describe_failure(error, container_named=container_named, redact=self.gateway.redact)
        said_once = isinstance(error, Refused) and error.refusal == LEVEL
        self.ledger.failed(error)
        self.ledger.log(
            logging.DEBUG if said_once else level, "Membase call failed; the model was told", error=error, tool=tool
        )
        return _reply(failure.sentence, ok=False)


def _reply(text: str, *, ok: bool = True) -> dict[str, Any]:
    return {"status": "success" if ok else "error", "content": [{"text": text}]}

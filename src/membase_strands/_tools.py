"""The model's Membase tools: ``membase_search``, ``membase_save``, ``membase_profile`` and, opt-in, ``membase_forget``.

A Membase failure never raises out of a tool: the model reads a sentence it can relay, with status ``"error"``.
``membase_forget`` forgets only after a Strands interrupt, for the application to ask the user, is answered ``True``.
"""

from __future__ import annotations

import copy
import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import membase
from strands import tool
from strands.tools.decorator import DecoratedFunctionTool
from strands.types.tools import AgentTool, ToolContext

from ._calls import MAY_HAVE_ARRIVED, Outcome
from ._containers import names_in_reach
from ._failures import LEVEL, Refused, describe_failure
from ._formatting import Passage, arrange, memory_label, passage_id, profile_text, search_text
from ._gateway import SAVE, MembaseGateway
from ._log import StoreLog
from ._options import passages_wanted, query_text
from ._text import clip

CLOSED_SENTENCE = "Membase is not available: this memory store was closed by the application."
_MAYBE_SAVED = (
    "No answer came back from Membase after the note was sent, so the note may or may not have been saved; try again "
    "in a minute, after checking with membase_search that it is not already there."
)
_DECLINED = "The user did not approve forgetting it, so nothing was forgotten."
_QUEUED = " Membase learns it in the background, so a search right away may not find it yet."
_UNSHOWN = (
    "Nothing was forgotten: membase_search has not shown a passage with the id '{}', and Membase did not say what it "
    "holds, so the user cannot be asked to approve it. Search for it and use the id shown; or the user can remove it "
    "themselves in the Membase app, on its Memory's page."
)
# What the person reads when Membase's own sentence about a forget is addressed to a developer ("pass confirm=true").
_FORGET_HOW = "Forgetting removes this passage from the Memory for good."
_FOR_DEVELOPERS = re.compile(r"confirm\s*=|\bpass\b", re.IGNORECASE)
_SHOWN_IDS = 256  # the passages (by id) a store's tools remember as membase_search showed them, the newest


def build_tools(store_tools: StoreTools, names: tuple[str, ...]) -> list[AgentTool]:
    """One store's tools, of ``"search"``, ``"save"``, ``"profile"`` and ``"forget"``, in the order named."""
    tools = [getattr(store_tools, f"membase_{name}") for name in names]  # each bound to this store's tools
    for bound in tools:  # a spec of its own: nothing one agent's registry does to it can reach another store's tools
        bound.tool_spec = copy.deepcopy(bound.tool_spec)
    return tools


def _tool(method: Callable[..., dict[str, Any]]) -> DecoratedFunctionTool[..., dict[str, Any]]:
    """Make a method a tool that is counted, and answers plainly once the store is closed."""

    @functools.wraps(method)  # keeps the signature and docstring Strands builds the tool's schema from
    def run(self: StoreTools, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.log.count(f"tool_calls.{method.__name__}")
        if self.is_closed():
            self.log.count("errors.closed")
            return _reply(CLOSED_SENTENCE, ok=False)
        return method(self, *args, **kwargs)

    made = tool(context=method.__name__ == "membase_forget")(run)  # Strands leaves out `self`
    made.tool_spec["description"] = " ".join(made.tool_spec["description"].split())  # the docstring's, on one line
    return made


@dataclass(frozen=True)
class StoreTools:
    """One store's tools, over what they need from it (they never reach into the store itself). Each Membase call
    runs on Strands' own thread for the tool, as one ``Outcome`` (``gateway.run``)."""

    gateway: MembaseGateway
    log: StoreLog
    container: str | None
    default_limit: Callable[[], int]
    max_recall_chars: int | None
    min_score: float | None
    is_closed: Callable[[], bool]
    ids: bool  # whether membase_search shows each passage's id (for membase_forget)
    shown: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (Memory, text) as membase_search showed

    @_tool
    def membase_search(self, query: str, container: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """Search the user's Membase memory (earlier conversations, notes, documents) when the answer may depend on
        something the user said or saved before. Results come best first, each naming its Memory (or Memories); Memories
        under 'Not searched' could not answer, so a missing result from them is not evidence the fact is unknown.

        Args:
            query: What to look for, in plain words.
            container: The name of one Memory to search. Omit to search every Memory in reach.
            limit: How many passages to return, 1 to 50.
        """
        if not query.strip():
            return _reply("Nothing was searched: the query was empty.", ok=False)
        target, text, gateway = container or self.container, query_text(query), self.gateway
        try:
            count = passages_wanted(limit, "limit", self.default_limit())
        except ValueError as error:
            return _reply(f"Nothing was searched: {error}.", ok=False)
        searched = gateway.run(lambda: gateway.search(text, count, target, retry=True))  # a cold start waits
        if isinstance(searched.error, ValueError):
            return _reply(f"Nothing was searched: {searched.error}.", ok=False)
        if searched.error is not None:
            return self._failed("membase_search", searched.error, container_named=target is not None)
        answer = searched.result()
        shown = arrange(answer, count, min_score=self.min_score, budget=self.max_recall_chars, redact=gateway.redact)
        reply = search_text(text, shown, ids=self.ids)
        if self.ids:
            self._remember(shown.passages)
        self.log.annotate(
            outcome="hit" if shown.passages else "empty", passages=len(shown.passages), chars_returned=len(reply)
        )
        return _reply(reply, ok=not answer.none_answered)  # when no Memory could answer, nothing was searched

    @_tool
    def membase_save(self, content: str, container: str | None = None, standing_fact: bool = False) -> dict[str, Any]:
        """Save a note to the user's Membase memory. Only save when the user asked you to remember something, and
        save it in the user's own words. Set standing_fact=true for a lasting fact about the user (kept in their
        profile). If several Memories are in reach and none is named, the tool lists them so you can ask which one.

        Args:
            content: What to remember, in the user's own words.
            container: The name of the Memory to save to. Omit when only one Memory is in reach.
            standing_fact: True for a lasting fact about the user, kept in their profile.
        """
        if not content or content.isspace():  # not strip(): a note too large to send must not be copied
            return _reply("Nothing was saved: the content was empty.", ok=False)
        target, gateway = None if standing_fact else (container or self.container), self.gateway
        if (refused := gateway.disabled(SAVE)) is not None:  # not even the Memory is looked up
            return self._failed("membase_save", refused)
        if target is not None:  # found first, so a lookup that failed is known to have saved nothing
            looked_up = gateway.run(lambda: gateway.container_id(target))
            if looked_up.error is not None:
                return self._not_saved(looked_up, target)
        saved = gateway.run(lambda: gateway.save(content, target, static=standing_fact))
        if saved.error is not None:
            return self._not_saved(saved, target, sent=True, standing=standing_fact)
        answer = saved.result()
        if standing_fact:
            return _reply("Saved as a standing fact in the user's Membase profile.")
        queued = isinstance(answer, dict) and answer.get("status") == "queued"  # hosted: accepted, learned later
        where = f"Saved to the Memory '{memory_label(target)}'." if target else "Saved to Membase."
        return _reply(where + (_QUEUED if queued else ""))

    @_tool
    def membase_profile(self, topic: str | None = None) -> dict[str, Any]:
        """Read the user's Membase profile: standing facts about them, their recently changed facts and, with a
        topic, what their memory holds on it.

        Args:
            topic: Optionally, a topic to look up in the user's memory as well.
        """
        wanted, gateway = query_text(topic) if topic and topic.strip() else None, self.gateway
        read = gateway.run(lambda: gateway.profile(wanted))
        if read.error is not None:
            return self._failed("membase_profile", read.error)
        return _reply(profile_text(read.result(), wanted, self.max_recall_chars, gateway.redact))

    @_tool
    def membase_forget(self, memory_id: str, tool_context: ToolContext) -> dict[str, Any]:
        """Forget one passage of the user's Membase memory, by the id membase_search shows for it: only when the user
        asks to forget something, or to correct it (then save the corrected fact with membase_save). The user is
        asked to approve first; nothing is forgotten without their yes.

        Args:
            memory_id: The passage's id, exactly as membase_search shows it.
        """
        wanted = memory_id.strip()
        if not wanted:
            return _reply("Nothing was forgotten: no id was given.", ok=False)
        shown, gateway = self.shown.get(wanted), self.gateway
        asked = gateway.run(lambda: gateway.forget(wanted, confirm=False))  # what would be forgotten; nothing is yet
        if asked.error is not None:
            guessed = shown is None and isinstance(asked.error, membase.NotFoundError)  # an id the model made up
            return self._failed("membase_forget", asked.error, level=logging.INFO if guessed else logging.WARNING)
        preview = asked.result()
        if preview.get("status") != "confirmation_required":
            status = clip(str(preview.get("status")), 40)
            return _reply(f"Nothing was forgotten: Membase answered '{status}' instead of asking to confirm.", ok=False)
        # The question asked, kept in the agent's state (which a session manager keeps): resumed in a later request,
        # by another worker or store, the tool finds what the person approved even where search never showed it.
        question = f"membase_forget:{tool_context.tool_use['toolUseId']}"
        reason = tool_context.agent.state.get(question)
        if reason is None:
            said = self.gateway.redact(clip(str(preview.get("content") or preview.get("title") or ""), 2000))
            memory, content = shown or ("", said)  # hosted Membase says nothing of the content: what search showed
            if not content:
                self.log.log(logging.INFO, "forget not asked for: an id search never showed", tool="membase_forget")
                return _reply(_UNSHOWN.format(clip(wanted, 120)), ok=False)
            how = self.gateway.redact(clip(str(preview.get("how") or ""), 500))  # Membase's sentence for the person
            if not how or _FOR_DEVELOPERS.search(how):  # one for the developer is not shown to the person
                how = _FORGET_HOW
            reason = {"memory_id": wanted, "content": content, "memory": memory or self._memory_of(wanted), "how": how}
            tool_context.agent.state.set(question, reason)
        approved = tool_context.interrupt("membase_forget", reason=reason) is True  # the application asked the user
        tool_context.agent.state.delete(question)
        if not approved:
            self.log.annotate(outcome="declined")
            return _reply(_DECLINED)
        forgotten = gateway.run(lambda: gateway.forget(wanted, confirm=True))
        if forgotten.error is not None:
            return self._failed("membase_forget", forgotten.error)
        self.shown.pop(wanted, None)
        return _reply(f"Forgotten, with the user's approval: {clip(reason['content'], 200)}")

    def _remember(self, passages: list[Passage]) -> None:
        """Keep the newest passages membase_search showed with an id (each step one dict operation: thread-safe)."""
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
        container, gateway = passage_id.rpartition(":")[0], self.gateway
        listed = gateway.run(gateway.memories_in_reach)  # only the reason's wording is at stake
        return next((c.name for c in listed.value or [] if c.id == container), container or "Membase")

    def _not_saved(
        self, outcome: Outcome[Any], target: str | None, *, sent: bool = False, standing: bool = False
    ) -> dict[str, Any]:
        """What the model is told of a note not saved, or maybe saved (``sent``: the note itself went out)."""
        error = outcome.error
        assert error is not None
        if isinstance(error, ValueError):
            return _reply(f"Nothing was saved: {error}.", ok=False)
        if isinstance(error, membase.BadRequestError) and target is None and not standing:
            in_reach = self.gateway.run(self.gateway.memories_in_reach).value or []  # only the sentence is at stake
            if len(in_reach) > 1:
                return _reply(
                    f"Nothing was saved: several Memories are in reach ({names_in_reach(in_reach)}). Ask the user "
                    "which one, then call membase_save again with container set to its name.",
                    ok=False,
                )
        failed = self._failed("membase_save", error, container_named=target is not None)
        return _reply(_MAYBE_SAVED, ok=False) if sent and outcome.kind == MAY_HAVE_ARRIVED else failed

    def _failed(
        self, tool: str, error: BaseException, *, container_named: bool = False, level: int = logging.WARNING
    ) -> dict[str, Any]:
        """Count and log a failed Membase call, and tell the model why (a refusal above the key's level at DEBUG: the
        gateway says it once)."""
        failure = describe_failure(error, container_named=container_named, redact=self.gateway.redact)
        said_once = isinstance(error, Refused) and error.refusal == LEVEL
        self.log.annotate(outcome="error", error_kind=self.log.failed(error))
        self.log.log(
            logging.DEBUG if said_once else level, "Membase call failed; the model was told", error=error, tool=tool
        )
        return _reply(failure.sentence, ok=False)


def _reply(text: str, *, ok: bool = True) -> dict[str, Any]:
    return {"status": "success" if ok else "error", "content": [{"text": text}]}

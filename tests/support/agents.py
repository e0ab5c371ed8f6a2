"""What the model was shown, turn by turn, through a real ``strands.Agent`` over a store (tests of group A)."""

from __future__ import annotations

import html
import logging
import re
from typing import Any

import pytest
from strands.agent import AgentResult

from membase_strands import MembaseMemoryStore
from membase_strands.testing import ScriptedModel, ToolCall
from tests.support.store_helpers import make_agent

ALL_TOOLS = ("search", "save", "profile", "forget")
_ENTRY = re.compile(r"<entry[^>]*>(.*?)</entry>", re.S)


def entries(block: str | None) -> list[str]:
    """The text of each ``<entry>`` of a ``<memory>`` block, unescaped; ``[]`` when nothing was injected."""
    return [html.unescape(entry) for entry in _ENTRY.findall(block or "")]


def recall_turn(store: MembaseMemoryStore, question: str, **manager: Any) -> tuple[list[str], ScriptedModel]:
    """One user turn through a real Agent; the entries the model was shown, and the model."""
    agent, model = make_agent(store, ["ok"], **manager)
    agent(question)
    return entries(model.memory_block()), model


def tool_turn(store: MembaseMemoryStore, *calls: ToolCall, prompt: str = "go", **manager: Any) -> ScriptedModel:
    """One turn in which the model makes ``calls``, then answers ``"done"``; without recall unless asked."""
    manager.setdefault("injection", False)
    agent, model = make_agent(store, [*calls, "done"], **manager)
    assert str(agent(prompt)).strip() == "done"  # a tool never breaks the turn
    return model


def tool_texts(model: ScriptedModel) -> list[tuple[str, str]]:
    """Each tool result the model read: (status, text)."""
    return [
        (r["status"], "\n".join(item["text"] for item in r["content"] if "text" in item)) for r in model.tool_results()
    ]


def resume(agent: Any, result: AgentResult, response: Any) -> AgentResult:
    """Answer every interrupt of ``result`` with ``response``, as an application does once it asked the user."""
    return agent([{"interruptResponse": {"interruptId": i.id, "response": response}} for i in result.interrupts])


def logged(caplog: pytest.LogCaptureFixture, store: str, level: int = logging.DEBUG) -> list[str]:
    """Messages at ``level`` or above from every logger, except what other tests' stores log from the library's
    threads (a late request of an earlier test may end during this one)."""
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= level
        and (not r.threadName.startswith("membase-") or f"store=<{store}>" in r.getMessage() or store in r.threadName)
    ]

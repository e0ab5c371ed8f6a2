"""Forgetting with the user's approval against the real Membase engine, over HTTP and in process: the id
``membase_search`` shows is one the engine forgets, and only after the application resumes the agent with ``True``."""

from __future__ import annotations

import re

import pytest

from examples.standin_llm import StandInLLM
from membase_strands.testing import ToolCall
from tests.support.agents import ALL_TOOLS, resume
from tests.support.local_engine import EngineMemory, engine_unavailable
from tests.support.store_helpers import make_agent

if _REASON := engine_unavailable():
    pytest.skip(f"real Membase engine tests skipped: {_REASON}", allow_module_level=True)

pytestmark = pytest.mark.integration

MAY = "The product launch is planned for May."
VENUE = "The launch party needs a venue near the river."


def test_save_search_forget_with_approval_then_search_again_finds_it_gone(memory: EngineMemory, llm: StandInLLM):
    with memory.store(tools=ALL_TOOLS) as store:
        saves = [ToolCall("membase_save", {"content": note}) for note in (MAY, VENUE)]
        agent, model = make_agent(store, [*saves, "Saved both."])
        agent(f"Please remember: {MAY} {VENUE}")

    with memory.store(tools=ALL_TOOLS) as store:
        shown = r"launch is planned for May\. \(id: ([^)]+)\)"  # the model forgets by the id the search showed
        forget = lambda sent: ToolCall("membase_forget", {"memory_id": re.search(shown, model.tool_result_text())[1]})  # noqa: E731
        search = ToolCall("membase_search", {"query": "product launch May"})
        agent, model = make_agent(store, [search, forget, "Forgotten.", search, "Only the venue is left."])

        result = agent("Forget when the launch is planned.")
        assert result.stop_reason == "interrupt"  # nothing forgotten yet: the application asks the user
        [interrupt] = result.interrupts
        assert interrupt.name == "membase_forget" and interrupt.reason["content"] == MAY

        result = resume(agent, result, True)
        assert model.tool_result_text() == f"Forgotten, with the user's approval: {MAY}"

        agent("What is left about the launch?")  # recalled, and searched again
        recalled = model.memory_block(-2) or ""  # the invocation's first call: the search, then the answer
        assert MAY not in recalled and VENUE in recalled
        found = model.tool_result_text()
        assert MAY not in found and VENUE in found

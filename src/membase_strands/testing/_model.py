"""A Strands model that replays a script and records what it was sent, for testing agents offline."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from strands.models import Model


@dataclass
class ToolCall:
    """A scripted model turn that calls one tool, optionally saying ``text`` first."""

    name: str
    input: dict[str, Any] = field(default_factory=dict)
    text: str = ""


Step = str | ToolCall | Callable[[str], "str | ToolCall"]
"""One scripted turn: a final answer, a tool call, or a function of the text the model was sent."""


class ScriptedModel(Model):
    """Replays scripted turns: a string is a final text answer, a :class:`ToolCall` calls a tool.

    A callable step is given all the text the model was sent in that call (the memory block
    included) and returns the answer or tool call, so a turn can depend on what was recalled.
    Every call's messages are recorded (deep-copied) in :attr:`calls`. When the script runs out
    the model answers ``"ok"``.

    Example:
        ```python
        model = ScriptedModel([ToolCall("membase_save", {"content": "I like green tea."}), "Saved."])
        agent = Agent(model=model, memory_manager=MemoryManager(stores=[store]))
        agent("Remember that I like green tea.")
        assert "green tea" in model.tool_result_text()
        ```
    """

    def __init__(self, script: list[Step] | None = None) -> None:
        self.script = list(script or [])
        self.calls: list[dict[str, Any]] = []
        self._config: dict[str, Any] = {"model_id": "scripted"}

    def update_config(self, **model_config: Any) -> None:
        self._config.update(model_config)

    def get_config(self) -> Any:
        return self._config

    def structured_output(self, output_model: Any, prompt: Any, system_prompt: Any = None, **kwargs: Any) -> Any:
        raise NotImplementedError("the scripted model has no structured output")

    # Model.stream gains keyword arguments from one Strands release to the next; this takes them all.
    async def stream(  # type: ignore[override]
        self, messages: Any, tool_specs: Any = None, system_prompt: Any = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(
            {
                "messages": copy.deepcopy(messages),
                "tool_names": [spec["name"] for spec in tool_specs or []],
                "system_prompt": system_prompt,
            }
        )
        step = self.script.pop(0) if self.script else "ok"
        if callable(step):
            step = step(self.sent_text())
        yield {"messageStart": {"role": "assistant"}}
        if isinstance(step, ToolCall):
            if step.text:
                yield {"contentBlockStart": {"start": {}}}
                yield {"contentBlockDelta": {"delta": {"text": step.text}}}
                yield {"contentBlockStop": {}}
            tool_use_id = f"call-{len(self.calls)}"
            yield {"contentBlockStart": {"start": {"toolUse": {"toolUseId": tool_use_id, "name": step.name}}}}
            yield {"contentBlockDelta": {"delta": {"toolUse": {"input": json.dumps(step.input)}}}}
            yield {"contentBlockStop": {}}
            yield {"messageStop": {"stopReason": "tool_use"}}
        else:
            yield {"contentBlockStart": {"start": {}}}
            yield {"contentBlockDelta": {"delta": {"text": step}}}
            yield {"contentBlockStop": {}}
            yield {"messageStop": {"stopReason": "end_turn"}}

    # --- What the model saw --------------------------------------------------------------------

    def sent_text(self, call: int = -1) -> str:
        """All text the model was sent in one call, joined."""
        return "\n".join(
            block["text"] for message in self.calls[call]["messages"] for block in message["content"] if "text" in block
        )

    def memory_block(self, call: int = -1) -> str | None:
        """The manager's ``<memory>`` block in one call, or ``None`` when nothing was injected."""
        text = self.sent_text(call)
        start = text.find("<memory>")
        if start < 0:
            return None
        end = text.find("</memory>", start)
        return text[start : end + len("</memory>")]

    def tool_results(self, call: int = -1) -> list[dict[str, Any]]:
        """The tool results the model was sent in one call (the latest by default)."""
        return [
            block["toolResult"]
            for message in self.calls[call]["messages"]
            for block in message["content"]
            if "toolResult" in block
        ]

    def tool_result_text(self, call: int = -1) -> str:
        """The text of the last tool result the model was sent."""
        result = self.tool_results(call)[-1]
        return "\n".join(item["text"] for item in result["content"] if "text" in item)

"""A Strands model that replays a script and records what it was sent, for testing agents offline."""

import copy
import json
import re
import uuid
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
"""One scripted turn: a final answer, a tool call, or a function of the text the model was sent (see
:meth:`ScriptedModel.sent_text`: tool results included, the latest last)."""


class ScriptedModel(Model):
    """Replays scripted turns (see :data:`Step`) and records each call's messages, deep-copied, in :attr:`calls`.

    A function step can depend on what was recalled, or on the id ``membase_search`` just returned. Past the
    script's end it answers ``"ok"``."""

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
        tools = [spec["name"] for spec in tool_specs or []]
        self.calls.append({"messages": copy.deepcopy(messages), "tool_names": tools, "system_prompt": system_prompt})
        step = self.script.pop(0) if self.script else "ok"
        if callable(step):
            step = step(self.sent_text())
        text, tool_call = (step.text, step) if isinstance(step, ToolCall) else (step, None)
        yield {"messageStart": {"role": "assistant"}}
        if text or tool_call is None:
            yield {"contentBlockStart": {"start": {}}}
            yield {"contentBlockDelta": {"delta": {"text": text}}}
            yield {"contentBlockStop": {}}
        if tool_call is not None:
            # Unique, as a real model's are: an interrupt's id is made from it (its answer must not fit a later one).
            tool_use = {"toolUseId": f"call-{uuid.uuid4().hex[:16]}", "name": tool_call.name}
            yield {"contentBlockStart": {"start": {"toolUse": tool_use}}}
            yield {"contentBlockDelta": {"delta": {"toolUse": {"input": json.dumps(tool_call.input)}}}}
            yield {"contentBlockStop": {}}
        yield {"messageStop": {"stopReason": "end_turn" if tool_call is None else "tool_use"}}

    def sent_text(self, call: int = -1) -> str:
        """All text the model was sent in one call (``calls[call]``, the latest by default), in order, one block per
        line: the messages' text (the memory block too) and the text of tool results."""
        parts = [part for block in self._blocks(call) for part in block.get("toolResult", {}).get("content", [block])]
        return "\n".join(part["text"] for part in parts if "text" in part)

    def memory_block(self, call: int = -1) -> str | None:
        """The manager's ``<memory>`` block in one call, or ``None`` when nothing was injected."""
        found = re.search(r"<memory>.*?</memory>", self.sent_text(call), re.S)
        return found.group() if found else None

    def tool_results(self, call: int = -1) -> list[dict[str, Any]]:
        """The tool results the model was sent in one call."""
        return [block["toolResult"] for block in self._blocks(call) if "toolResult" in block]

    def tool_result_text(self, call: int = -1) -> str:
        """The text of the last tool result the model was sent in one call."""
        return "\n".join(item["text"] for item in self.tool_results(call)[-1]["content"] if "text" in item)

    def _blocks(self, call: int) -> list[dict[str, Any]]:
        return [block for message in self.calls[call]["messages"] for block in message["content"]]

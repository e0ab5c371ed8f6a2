"""membase-strands demo: one agent is told something, a new agent recalls it in a new session.

    uv run --python 3.12 examples/demo.py

Session 1: an agent with a Membase store is told a fact and saves it with the ``membase_save`` tool.
Session 2: a NEW agent with a NEW store on the same memory is asked about it; the store recalls the
fact before the model answers, and the demo prints the memory block the model was sent.

The memory is real Membase: with MEMBASE_API_KEY set, your hosted Membase (MEMBASE_BASE_URL and
MEMBASE_CONTAINER are honoured; the demo note is saved there). Otherwise local Membase in a fresh
temporary directory (Python 3.12+ and ``pip install "membase-strands[local]"``), whose engine talks to a
deterministic stand-in LLM on 127.0.0.1 unless OPENAI_API_KEY or MEMBASE_LLM_PROVIDER is set. The
agent's turns are scripted (``membase_strands.testing.ScriptedModel``), so no model key is needed and,
without MEMBASE_API_KEY, nothing leaves this machine. examples/quickstart.py is the same with a real model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
import time
from typing import Any

from standin_llm import StandInLLM
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore, injection_config
from membase_strands.testing import ScriptedModel, ToolCall

FACT = "The launch codename for our team is Blue Heron."
ASK = "What is the launch codename for our team?"


def main() -> int:
    with contextlib.ExitStack() as stack:
        new_store = _memory(stack)
        if new_store is None:
            return 1

        print("Session 1: a first agent is told something and saves it")
        model = ScriptedModel([ToolCall("membase_save", {"content": FACT}), "Saved: I will remember that."])
        with new_store() as store:
            _agent(model, store)(f"Please remember this for later: {FACT}")
        print(f"  membase_save -> {model.tool_result_text(-1)}")
        if "Saved" not in model.tool_result_text(-1):
            return 1

        print("\nSession 2: later, a NEW agent with a NEW store on the same memory")
        model = ScriptedModel([_answer_from_memory])
        with new_store() as store:
            for _ in range(40):  # hosted Membase learns a note in the background; local learns at once
                answer = str(_agent(model, store)(ASK)).strip()
                if "Blue Heron" in answer or "MEMBASE_API_KEY" not in os.environ:
                    break
                model.script.append(_answer_from_memory)
                time.sleep(3.0)
        print("  the model was sent this memory before it answered:")
        print("    " + (model.memory_block() or "(nothing)").replace("\n", "\n    "))
        print(f"  agent: {answer}")
        return 0 if "Blue Heron" in answer else 1


def _agent(model: ScriptedModel, store: MembaseMemoryStore) -> Agent:
    # The README's recommended manager: one search tool, recalled text framed as data.
    manager = MemoryManager(stores=[store], search_tool_config=False, injection=injection_config())
    return Agent(model=model, memory_manager=manager, callback_handler=None)


def _answer_from_memory(sent: str) -> str:
    """Session 2's scripted answer: the recalled line that mentions the codename, if any."""
    recalled = [line.split("]", 1)[1] for line in sent.splitlines() if "codename" in line and "]" in line]
    return f"From your memory: {recalled[0].removesuffix('</entry>').strip()}" if recalled else "I do not know yet."


def _memory(stack: contextlib.ExitStack) -> Any:
    """A function that opens a new store on the demo's memory, or ``None`` (with a reason) when none can run."""
    if os.environ.get("MEMBASE_API_KEY", "").strip():
        container = os.environ.get("MEMBASE_CONTAINER") or None
        print("Memory: your hosted Membase (MEMBASE_API_KEY); the demo note is saved there.\n")
        # A generous recall budget: the first search after a quiet spell may wake the memory.
        return lambda: MembaseMemoryStore(container=container, recall_timeout=60.0)
    if sys.version_info < (3, 12):
        print(
            "Local mode needs Python 3.12 or newer: run `uv run --python 3.12 examples/demo.py`, "
            "or set MEMBASE_API_KEY to use hosted Membase (Python 3.10+).",
            file=sys.stderr,
        )
        return None
    if importlib.util.find_spec("membase_core") is None:
        print(
            'Local mode needs the Membase engine: `pip install "membase-strands[local]"` (in this repository, '
            "`uv sync`), or set MEMBASE_API_KEY to use hosted Membase.",
            file=sys.stderr,
        )
        return None
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="membase-demo-"))
    engine_llm = "your provider (OPENAI_API_KEY / MEMBASE_LLM_PROVIDER)"
    if not (os.environ.get("MEMBASE_LLM_PROVIDER") or os.environ.get("OPENAI_API_KEY")):
        llm = stack.enter_context(StandInLLM())
        os.environ.update(llm.engine_env())  # before the engine's first call: it caches its provider
        engine_llm = f"a deterministic stand-in on {llm.url}"
    print(f"Memory: local Membase in {directory} (no MEMBASE_API_KEY); its LLM: {engine_llm}.\n")
    return lambda: MembaseMemoryStore(local=directory, recall_timeout=60.0)


if __name__ == "__main__":
    sys.exit(main())

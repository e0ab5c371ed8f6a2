"""membase-strands quick start: one agent is told something, a new agent recalls it later.

    uv run --python 3.12 examples/quickstart.py

Session one: an agent with a Membase store is told a fact and saves it with the `membase_save` tool.
Session two: a NEW agent with a NEW store on the same memory is asked about it; the store recalls the
fact from Membase before the model answers, and the demo prints what was recalled and from which Memory.

What it runs against (it prints which when it starts):

- Memory: with MEMBASE_API_KEY set, your hosted Membase (MEMBASE_BASE_URL and MEMBASE_CONTAINER are
  honoured; the demo note is saved there). Otherwise local Membase in a fresh temporary directory,
  which needs Python 3.12+ and the engine (`pip install "membase-strands[local]"`). The local engine
  needs an LLM too: your provider when OPENAI_API_KEY or MEMBASE_LLM_PROVIDER is set, otherwise a
  deterministic stand-in on 127.0.0.1 (tests/support/standin_llm.py).
- Agent model: OPENAI_API_KEY with the `openai` package -> OpenAI (QUICKSTART_MODEL, default
  gpt-4o-mini); ANTHROPIC_API_KEY with the `anthropic` package -> Anthropic (QUICKSTART_MODEL, default
  claude-sonnet-4-5); AWS credentials -> Amazon Bedrock (Strands' default model). With none of these
  it replays a scripted model (tests/support/scripted_model.py): the agent's turns are canned, while
  Strands, the store and Membase are real.

With no keys at all it runs fully offline, on loopback only, in a few seconds.
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import os
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from membase_strands import MembaseMemoryStore

REPO = Path(__file__).resolve().parents[1]
HOSTED_URL = "https://api.app.membase.com"  # the store's default host
FACT = "The launch codename for our team is Blue Heron."
TELL = f"Please remember this for later: {FACT}"
ASK = "What is the launch codename for our team?"
SYSTEM_PROMPT = (
    "You are a helpful assistant with long-term memory in Membase. When the user asks you to remember "
    "something, call membase_save with their words. Answer questions from the memory you are given; "
    "say which Memory it came from."
)


def main() -> int:
    hosted = bool(os.environ.get("MEMBASE_API_KEY", "").strip())
    if not hosted:
        reason = _local_unavailable()
        if reason:
            print(reason, file=sys.stderr)
            return 1

    print("membase-strands quick start\n")
    model_factory, model_note = _choose_model()
    offline = not hosted and model_factory is None and not _engine_has_own_llm()
    with contextlib.ExitStack() as stack:
        open_store, lines, wait_until_learned = _open_memory(stack, hosted)
        lines.append(f"Agent model: {model_note}")
        if offline:
            lines.append("Offline:     yes; everything runs on this machine, on 127.0.0.1 only, with no keys.")
        print("\n".join(lines) + "\n")
        if not _session_one(open_store, model_factory):
            return 1
        wait_until_learned()
        return 0 if _session_two(open_store, model_factory) else 1


# --- The two sessions ---------------------------------------------------------------------------


def _session_one(open_store: Callable[[], Any], model_factory: Callable[[], Any] | None) -> bool:
    print("Session 1: a first agent is told something and saves it")
    print(f"  user:  {TELL}")
    if model_factory is None:
        model = _scripted([_tool_call("membase_save", {"content": FACT}), "Saved: I will remember that."])
    else:
        model = model_factory()
    with open_store() as store:
        agent = _agent(model, store)
        answer = str(agent(TELL)).strip()
        saves = _tool_results(agent.messages, "membase_save")
    for outcome in saves:
        print(f"  tool:  membase_save -> {outcome}")
    print(f"  agent: {answer}\n")
    if not any(outcome.startswith("Saved") for outcome in saves):
        print(
            "The agent did not save the note, so there is nothing for session 2 to recall. "
            + ("With several Memories in reach, set MEMBASE_CONTAINER to the one to use." if saves else ""),
            file=sys.stderr,
        )
        return False
    return True


def _agent(model: Any, store: Any) -> Any:
    """A Strands agent whose MemoryManager holds just this store."""
    from strands import Agent
    from strands.memory import MemoryManager

    return Agent(
        model=model, system_prompt=SYSTEM_PROMPT, memory_manager=MemoryManager(stores=[store]), callback_handler=None
    )


def _session_two(open_store: Callable[[], Any], model_factory: Callable[[], Any] | None) -> bool:
    print("Session 2: later, a NEW agent with a NEW store on the same memory")
    print(f"  user:  {ASK}")
    model = _recalling_scripted() if model_factory is None else model_factory()
    with open_store() as store:
        agent = _agent(model, store)
        answer = str(agent(ASK)).strip()
        recalled = list(store.recalled)
    print("  recalled from Membase before the model answered:")
    for memory, text in recalled or [("", "")]:
        print(f"    - from the Memory '{memory}': {text}" if memory else "    (nothing)")
    print(f"  agent: {answer}\n")
    found = [(memory, text) for memory, text in recalled if "Blue Heron" in text]
    if found:
        memory, text = found[0]
        print(f"Recalled: \"{text}\" from the Memory '{memory}', in a new session, by a new agent.")
        return True
    print("Session 2 did not recall the note from Membase.", file=sys.stderr)
    return False


# --- Memory: hosted, or local in a temporary directory --------------------------------------------


def _open_memory(stack: contextlib.ExitStack, hosted: bool) -> tuple[Callable[[], Any], list[str], Callable[[], None]]:
    """A function that builds a new store on the demo's memory, lines saying what it is, and a wait."""
    if hosted:
        container = os.environ.get("MEMBASE_CONTAINER") or None
        url = os.environ.get("MEMBASE_BASE_URL") or HOSTED_URL
        where = f", the Memory '{container}'" if container else ""

        def open_hosted() -> Any:
            # A generous recall budget: the first search after a quiet spell may wake the memory.
            return _RecallShowingStore(container=container, recall_timeout=60.0)

        lines = [f"Memory:      Membase at {url}{where}, with your key (MEMBASE_API_KEY); the demo note is saved there"]
        return open_hosted, lines, lambda: _wait_hosted(url)

    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="membase-quickstart-"))
    if _engine_has_own_llm():
        engine_llm = "your provider (OPENAI_API_KEY / MEMBASE_LLM_PROVIDER)"
    else:
        engine_llm = _start_standin(stack)

    def open_local() -> Any:
        return _RecallShowingStore(local=directory, recall_timeout=60.0)

    lines = [
        f"Memory:      local Membase (no MEMBASE_API_KEY) in a fresh temporary directory, {directory}",
        f"Engine LLM:  {engine_llm}",
    ]
    return open_local, lines, lambda: None


def _start_standin(stack: contextlib.ExitStack) -> str:
    _repo_support()
    from tests.support.local_engine import configure_engine_env, restore_env
    from tests.support.standin_llm import StandInLLM

    llm = stack.enter_context(StandInLLM())
    previous = configure_engine_env(llm.url)  # before the engine's first call: it caches its provider
    stack.callback(restore_env, previous)
    return f"a deterministic stand-in on {llm.url} (no OPENAI_API_KEY or MEMBASE_LLM_PROVIDER)"


def _wait_hosted(url: str) -> None:
    """Hosted Membase learns a note in the background: wait until a search finds it."""
    import membase

    print("Waiting for Membase to learn the note", end="", flush=True)
    deadline = time.monotonic() + 120.0
    with membase.Membase(base_url=url) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(membase.MembaseError):
                hits = client.search("launch codename Blue Heron", limit=5).get("results", [])
                if any("Blue Heron" in str(hit.get("content")) for hit in hits):
                    print(" - learned.\n")
                    return
            print(".", end="", flush=True)
            time.sleep(3.0)
    print(" - not searchable yet; session 2 may not find it.\n")


class _RecallShowingStore(MembaseMemoryStore):
    """The real store; it also keeps what it recalled, only so this demo can print it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.recalled: list[tuple[str, str]] = []

    async def search(self, query: str, options: Any = None) -> Any:
        entries = await super().search(query, options)
        for entry in entries:
            memory = str((entry.metadata or {}).get("memory", ""))
            self.recalled.append((memory, entry.content.removeprefix(f"[{memory}] ")))
        return entries


# --- Models ---------------------------------------------------------------------------------------


def _choose_model() -> tuple[Callable[[], Any] | None, str]:
    """The real model a configured provider gives, or ``None`` (scripted) with the reason."""
    skipped = []
    if os.environ.get("OPENAI_API_KEY"):
        if _importable("openai"):
            model_id = os.environ.get("QUICKSTART_MODEL", "gpt-4o-mini")

            def openai_model() -> Any:
                from strands.models.openai import OpenAIModel

                return OpenAIModel(model_id=model_id)

            return openai_model, f"OpenAI {model_id} (OPENAI_API_KEY)"
        skipped.append("OPENAI_API_KEY is set but the openai package is not installed")
    if os.environ.get("ANTHROPIC_API_KEY"):
        if _importable("anthropic"):
            model_id = os.environ.get("QUICKSTART_MODEL", "claude-sonnet-4-5")

            def anthropic_model() -> Any:
                from strands.models.anthropic import AnthropicModel

                return AnthropicModel(model_id=model_id, max_tokens=1024)

            return anthropic_model, f"Anthropic {model_id} (ANTHROPIC_API_KEY)"
        skipped.append("ANTHROPIC_API_KEY is set but the anthropic package is not installed")
    if any(os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_BEARER_TOKEN_BEDROCK")):

        def bedrock_model() -> Any:
            from strands.models import BedrockModel

            return BedrockModel()

        return bedrock_model, "Amazon Bedrock, Strands' default model (AWS credentials)"
    why = "; ".join(skipped) if skipped else "no OPENAI_API_KEY, ANTHROPIC_API_KEY or AWS credentials"
    return None, f"scripted ({why}): the agent's turns are replayed; Strands, the store and Membase are real"


def _repo_support() -> None:
    """Make the repository's test support (the stand-in LLM, the scripted model) importable."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def _scripted(script: list[Any]) -> Any:
    _repo_support()
    from tests.support.scripted_model import ScriptedModel

    return ScriptedModel(script)


def _tool_call(name: str, tool_input: dict[str, Any]) -> Any:
    _repo_support()
    from tests.support.scripted_model import ToolCall

    return ToolCall(name, tool_input)


def _recalling_scripted() -> Any:
    """A scripted model for session 2 whose answer is built from the memory block it was sent."""
    _repo_support()
    from tests.support.scripted_model import ScriptedModel

    class AnswersFromMemory(ScriptedModel):
        async def stream(
            self, messages: Any, tool_specs: Any = None, system_prompt: Any = None, **kwargs: Any
        ) -> AsyncIterator[Any]:
            if not self.script:
                sent = "\n".join(b["text"] for m in messages for b in m.get("content", []) if "text" in b)
                entries = [html.unescape(e) for e in re.findall(r"<entry[^>]*>(.*?)</entry>", sent, re.S)]
                self.script = [
                    f"From your memory: {entries[0]}" if entries else "I find nothing on that in your memory."
                ]
            async for event in super().stream(messages, tool_specs, system_prompt, **kwargs):
                yield event

    return AnswersFromMemory()


# --- Helpers --------------------------------------------------------------------------------------


def _tool_results(messages: list[Any], tool_name: str) -> list[str]:
    """The text of each result of ``tool_name`` in a conversation."""
    names = {
        block["toolUse"]["toolUseId"]: block["toolUse"]["name"]
        for message in messages
        for block in message.get("content", [])
        if "toolUse" in block
    }
    return [
        " ".join(item.get("text", "") for item in block["toolResult"].get("content", [])).strip()
        for message in messages
        for block in message.get("content", [])
        if "toolResult" in block and names.get(block["toolResult"].get("toolUseId")) == tool_name
    ]


def _local_unavailable() -> str | None:
    """Why local mode cannot run here, as a sentence with what to do, or ``None``."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if sys.version_info < (3, 12):
        return (
            f"Local mode needs Python 3.12 or newer and this is Python {version}: run "
            "`uv run --python 3.12 examples/quickstart.py`, or set MEMBASE_API_KEY to use hosted Membase "
            "(Python 3.10+)."
        )
    if not _importable("membase_core"):
        return (
            'Local mode needs the Membase engine, which is not installed: `pip install "membase-strands[local]"` '
            "(in this repository `uv sync`), or set MEMBASE_API_KEY to use hosted Membase."
        )
    return None


def _engine_has_own_llm() -> bool:
    return bool(os.environ.get("MEMBASE_LLM_PROVIDER") or os.environ.get("OPENAI_API_KEY"))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())

"""A testing kit for agents that use Membase memory: everything offline, nothing mocked in the library.

- :class:`InMemoryMembase`: the Membase REST API in memory, for the real ``membase.Membase`` client over
  ``httpx.MockTransport``, with faults per route (:func:`status`, :func:`hang`, :func:`refuse_connection`).
- :class:`ScriptedModel`: a Strands model that replays turns (text or :class:`ToolCall`) and records what it was sent.
- :class:`StandInLLM`: an OpenAI-compatible server on 127.0.0.1 that the real local Membase engine can learn with.

Example:
    ```python
    from strands import Agent
    from strands.memory import MemoryManager
    from membase_strands.testing import InMemoryMembase, ScriptedModel

    membase = InMemoryMembase()
    membase.remember("We chose Postgres for the ledger.")
    model = ScriptedModel(["Postgres."])
    agent = Agent(model=model, memory_manager=MemoryManager(stores=[membase.store()]))
    agent("Which database did we choose for the ledger?")
    assert "Postgres" in model.memory_block()
    ```
"""

from ._membase import API_KEY, InMemoryMembase, Note, Recorded, Responder, hang, refuse_connection, status
from ._model import ScriptedModel, Step, ToolCall
from ._standin_llm import StandInLLM

__all__ = [
    "API_KEY",
    "InMemoryMembase",
    "Note",
    "Recorded",
    "Responder",
    "ScriptedModel",
    "StandInLLM",
    "Step",
    "ToolCall",
    "hang",
    "refuse_connection",
    "status",
]

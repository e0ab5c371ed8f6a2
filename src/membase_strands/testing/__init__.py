"""A testing kit for agents that use Membase memory: everything offline, nothing mocked in the library.

- :class:`InMemoryMembase`: the Membase REST API in memory. The real ``membase.Membase`` client talks
  to it over ``httpx.MockTransport``; it searches by shared words, saves notes and standing facts,
  answers the profile, holds several Memories (one of which can be made unable to answer), records
  every request, and injects faults per route (:func:`status`, :func:`hang`,
  :func:`refuse_connection`, or any ``httpx.Request -> httpx.Response`` function).
- :class:`ScriptedModel` and :class:`ToolCall`: a Strands model that replays turns and records what
  it was sent, so a test asserts on what the model saw (the ``<memory>`` block, tool results).
- :class:`StandInLLM`: a deterministic OpenAI-compatible server on 127.0.0.1 for the real local
  Membase engine (``Membase(local=DIR)``, Python 3.12+), which needs an LLM for embeddings and
  learning; point the engine at it with ``os.environ.update(llm.engine_env())`` before its first call.

Example:
    ```python
    from strands import Agent
    from strands.memory import MemoryManager
    from membase_strands.testing import InMemoryMembase, ScriptedModel

    def test_the_agent_recalls_the_ledger_database():
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

"""A testing kit for agents that use Membase memory: everything offline, nothing mocked in the library.

- :class:`InMemoryMembase`: the Membase REST API in memory; its ``store()`` is built from a key as in production and
  reaches it over ``httpx.MockTransport``; faults per route (:func:`status`, :func:`hang`, :func:`refuse_connection`,
  :func:`rate_limited`); key levels, the profile tick and hosted answers (``InMemoryMembase(level=..., hosted=True)``).
- :class:`ScriptedModel`: a Strands model that replays turns (text or :class:`ToolCall`) and records what it was sent.

README.md's "Testing your own agent" shows them at work."""

from ._membase import API_KEY, InMemoryMembase, Note, Recorded, Responder, hang, rate_limited, refuse_connection, status
from ._model import ScriptedModel, Step, ToolCall

__all__ = [
    "API_KEY",
    "InMemoryMembase",
    "Note",
    "Recorded",
    "Responder",
    "ScriptedModel",
    "Step",
    "ToolCall",
    "hang",
    "rate_limited",
    "refuse_connection",
    "status",
]

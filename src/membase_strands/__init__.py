"""Long-term memory from Membase for Strands Agents.

``MembaseMemoryStore`` implements the ``strands.memory.MemoryStore`` protocol: put it into
``MemoryManager(stores=[...])`` and the agent recalls from Membase before each user turn, with
a time box so a slow memory never holds the turn, and gets the ``membase_search``,
``membase_save`` and ``membase_profile`` tools. ``injection_config()`` gives the manager a memory
block that tells the model recalled passages are data, not instructions.
"""

from ._version import __version__
from .errors import MembaseAccessError, MembaseRecallTimeout, MembaseWriteTimeout
from .injection import injection_config
from .pool import MembaseStorePool
from .store import MembaseMemoryStore

__all__ = [
    "MembaseAccessError",
    "MembaseMemoryStore",
    "MembaseRecallTimeout",
    "MembaseStorePool",
    "MembaseWriteTimeout",
    "__version__",
    "injection_config",
]

"""Long-term memory from Membase for Strands Agents.

``MembaseMemoryStore`` is a ``strands.memory.MemoryStore``: in a ``MemoryManager`` the agent recalls before each user
turn, within a time budget, and gets the ``membase_search``, ``membase_save`` and ``membase_profile`` tools.
``injection_config()`` frames what is recalled as data; ``MembaseStorePool`` gives each user a store of their own.
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

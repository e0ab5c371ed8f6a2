"""THE REFERENCE ADAPTER: a benchmark baseline, not part of the library.

The straightforward way to write a Strands ``MemoryStore`` over the Membase SDK, shaped like Strands' own Bedrock
knowledge-base store: one ``membase.Membase`` client per store, ``search()`` awaits the SDK call on a thread of
asyncio's default executor (``asyncio.to_thread``) with no time box, and the answer is mapped to
``MemoryEntry``. It reads memory only (no tools, no writes). The benchmarks compare the library with it; it stands
in for a published adapter, which this project does not install or read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import membase
from strands.memory import MemoryEntry, MemoryStore, SearchOptions

DEFAULT_LIMIT = 5  # the request the floor (``client.search(q, limit=5)``) and the library's recall send


class ReferenceMembaseStore(MemoryStore):
    """A read-only Strands memory store over one ``membase.Membase`` client."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        client: membase.Membase | None = None,
        name: str = "membase",
        description: str | None = "The user's long-term memory in Membase.",
        max_search_results: int | None = None,
    ) -> None:
        self.name = name
        self.description = description
        self.max_search_results = max_search_results
        self.writable = False
        self.extraction = None
        self._client = client or membase.Membase(api_key=api_key, base_url=base_url)

    async def search(self, query: str, options: SearchOptions | None = None) -> list[MemoryEntry]:
        """Passages on ``query``, most relevant first."""
        limit = (options or {}).get("max_search_results") or self.max_search_results or DEFAULT_LIMIT
        answer: dict[str, Any] = await asyncio.to_thread(self._client.search, query, limit=limit)
        return [
            MemoryEntry(
                content=hit.get("content") or "",
                metadata={key: hit[key] for key in ("container", "container_name", "score") if key in hit},
            )
            for hit in answer.get("results") or []
        ]

    def close(self) -> None:
        self._client.close()


class ReferenceStores:
    """The straightforward per-user pool: one reference store per user, built on first use and kept."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.by_user: dict[str, ReferenceMembaseStore] = {}

    def store_for(self, user_id: str) -> ReferenceMembaseStore:
        if user_id not in self.by_user:  # the user's id is its key in the benchmarks
            self.by_user[user_id] = ReferenceMembaseStore(api_key=user_id, base_url=self.base_url)
        return self.by_user[user_id]

    async def aclose(self) -> None:
        for each in self.by_user.values():
            each.close()

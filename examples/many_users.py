"""Many users, one Membase memory each, with ``MembaseStorePool``.

One Membase key is one person's memory. The pool hands out each user's store, built from that
user's own key, and keeps it (with its warm connections) for the user's next turns. Each turn
builds a fresh agent around ``pool.store_for(user_id)``.

Give it your users' keys (in a real app they come from your own user database or vault):

    MEMBASE_USER_KEYS="alice=mb_...,bob=mb_..." uv run python examples/many_users.py

The agent's model here is a stand-in that answers with the memory it was shown, so no LLM key is
needed; in your app, pass your own model to ``Agent(model=...)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from typing import Any

from strands import Agent
from strands.memory import MemoryManager
from strands.models import Model

from membase_strands import MembaseStorePool


def answer_turn(pool: MembaseStorePool, user_id: str, question: str) -> str:
    """One user turn: an agent over this user's own store (and only theirs)."""
    agent = Agent(
        model=ShowMemory(),
        memory_manager=MemoryManager(stores=[pool.store_for(user_id)]),
        callback_handler=None,
    )
    return str(agent(question)).strip()


def main(user_keys: str | None = None, question: str = "What do you remember about me?") -> int:
    keys = parse_keys(os.environ.get("MEMBASE_USER_KEYS", "") if user_keys is None else user_keys)
    if not keys:
        print(
            "Set MEMBASE_USER_KEYS to your users' Membase keys to run this example, for example "
            'MEMBASE_USER_KEYS="alice=mb_...,bob=mb_..." (Membase app: Connect > Developer keys).'
        )
        return 0

    def key_for(user_id: str) -> str:  # your vault or user database; never a shared key
        return keys[user_id]

    with MembaseStorePool(key_for, max_stores=100, recall_timeout=8.0) as pool:
        for round_number in (1, 2):  # turns from different users, interleaved; round 2 reuses each store
            for user_id in keys:
                print(f"--- {user_id}, turn {round_number}")
                print(answer_turn(pool, user_id, question))
        for user_id in keys:
            counts = pool.store_for(user_id).counters()
            print(f"{user_id}: {counts['recalls']} recalls, {counts['recall_hits']} with memory")
    return 0


def parse_keys(text: str) -> dict[str, str]:
    """``"alice=key1,bob=key2"`` as ``{"alice": "key1", "bob": "key2"}``."""
    pairs = (item.split("=", 1) for item in text.split(",") if "=" in item)
    return {user.strip(): key.strip() for user, key in pairs if user.strip() and key.strip()}


class ShowMemory(Model):
    """A stand-in model that answers with the ``<memory>`` block the memory manager showed it."""

    def __init__(self) -> None:
        self.config: dict[str, Any] = {"model_id": "show-memory"}

    def update_config(self, **model_config: Any) -> None:
        self.config.update(model_config)

    def get_config(self) -> Any:
        return self.config

    def structured_output(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def stream(self, messages: Any, *args: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        text = "\n".join(block.get("text", "") for block in messages[-1]["content"])
        start = text.find("<memory>")
        reply = text[start:] if start >= 0 else "(nothing recalled from this user's Membase)"
        yield {"messageStart": {"role": "assistant"}}
        yield {"contentBlockDelta": {"delta": {"text": reply}}}
        yield {"contentBlockStop": {}}
        yield {"messageStop": {"stopReason": "end_turn"}}


if __name__ == "__main__":
    sys.exit(main())

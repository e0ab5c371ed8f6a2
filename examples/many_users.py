"""Many users, one Membase memory each, with ``MembaseStorePool``.

One Membase key is one person's memory. The pool hands out each user's store, built from that
user's own credential, and keeps it (with its warm connections) for the user's next turns. Each turn
builds a fresh agent around ``pool.store_for(user_id)``.

    uv run --python 3.12 examples/many_users.py

With MEMBASE_USER_KEYS="alice=mb_...,bob=mb_..." it uses your users' hosted keys. Without it, it runs
offline: each user gets local Membase in a temporary directory (Python 3.12+ and the local extra),
seeded with one note of their own, and the engine talks to a stand-in LLM on 127.0.0.1. The agent's model
is scripted to answer with the memory it was shown, so you can see that each user recalls only their own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import membase
from standin_llm import StandInLLM
from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseStorePool
from membase_strands.pool import Credential
from membase_strands.testing import ScriptedModel

QUESTION = "What do you remember about me?"


def answer_turn(pool: MembaseStorePool, user_id: str, question: str) -> str:
    """One user turn: a new agent over this user's own store (and only theirs)."""
    model = ScriptedModel([lambda sent: _memory_shown(sent) or "(nothing recalled from this user's Membase)"])
    agent = Agent(
        model=model,
        memory_manager=MemoryManager(stores=[pool.store_for(user_id)], search_tool_config=False),
        callback_handler=None,
    )
    return str(agent(question)).strip()


def main() -> int:
    with contextlib.ExitStack() as stack:
        credentials = _hosted_keys() or _offline_users(stack)
        if not credentials:
            return 1

        def credential_for(user_id: str) -> Credential:  # your vault or user database; never a shared key
            return credentials[user_id]

        with MembaseStorePool(credential_for, max_stores=100, recall_timeout=30.0) as pool:
            for round_number in (1, 2):  # turns from different users, interleaved; round 2 reuses each store
                for user_id in credentials:
                    print(f"--- {user_id}, turn {round_number}")
                    print(answer_turn(pool, user_id, QUESTION))
            for user_id in credentials:
                counts = pool.store_for(user_id).counters()
                print(f"{user_id}: {counts['recalls']} recalls, {counts['recall_hits']} with memory")
    return 0


def _hosted_keys() -> dict[str, Credential]:
    """``MEMBASE_USER_KEYS="alice=key1,bob=key2"`` as ``{"alice": "key1", "bob": "key2"}``."""
    pairs = (item.split("=", 1) for item in os.environ.get("MEMBASE_USER_KEYS", "").split(","))
    return {user.strip(): key.strip() for user, key in (p for p in pairs if len(p) == 2) if user.strip() and key}


def _offline_users(stack: contextlib.ExitStack) -> dict[str, Credential]:
    """Two users, each with local Membase in a temporary directory holding one note of their own."""
    if sys.version_info < (3, 12):
        print("Offline, this example needs Python 3.12+ (local Membase), or set MEMBASE_USER_KEYS.", file=sys.stderr)
        return {}
    llm = stack.enter_context(StandInLLM())
    os.environ.update(llm.engine_env())  # before the engine's first call: it caches its provider
    notes = {"alice": "Alice prefers green tea and works on the ledger.", "bob": "Bob is training for a marathon."}
    users: dict[str, Credential] = {}
    for user_id, note in notes.items():
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"membase-{user_id}-")))
        with membase.Membase(local=directory) as client:
            client.memories.add(note)
        users[user_id] = directory  # a path is a local directory; a str is a hosted key
    print(f"Offline: local Membase per user, the engine's LLM a stand-in on {llm.url}.")
    return users


def _memory_shown(sent: str) -> str:
    start = sent.find("<memory>")
    return sent[start:] if start >= 0 else ""


if __name__ == "__main__":
    sys.exit(main())

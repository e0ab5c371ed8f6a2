"""Quick start: a Strands agent that remembers across sessions, with Membase.

    pip install membase-strands
    export MEMBASE_API_KEY=...  # Membase app: Connect > Developer keys
    python quickstart.py        # the model is Strands' default (Amazon Bedrock): AWS credentials needed

No keys at hand? `uv run --python 3.12 examples/demo.py` runs the same two sessions offline.
"""

import time

from strands import Agent
from strands.memory import MemoryManager

from membase_strands import MembaseMemoryStore, injection_config


def new_agent(store: MembaseMemoryStore) -> Agent:
    # One search tool: membase_search waits for a waking memory and says which Memories could not answer.
    # injection_config(): recalled text is framed as reference data, never as instructions.
    memory = MemoryManager(stores=[store], search_tool_config=False, injection=injection_config())
    return Agent(
        system_prompt="When the user asks you to remember something, save it with membase_save.",
        memory_manager=memory,
    )


# Session 1: the user tells the agent something worth keeping.
with MembaseMemoryStore() as store:  # reads MEMBASE_API_KEY
    new_agent(store)("Please remember that our launch codename is Blue Heron.")

time.sleep(20)  # Membase learns from a note in the background

# Session 2, later: a new agent; the store recalls from Membase before the model answers.
with MembaseMemoryStore() as store:
    new_agent(store)("What is our launch codename?")

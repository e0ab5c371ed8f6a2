"""The stand-in LLM now ships in the public testing kit; this name stays for the tests."""

from membase_strands.testing._standin_llm import *  # noqa: F403
from membase_strands.testing._standin_llm import DIMENSIONS, StandInLLM, embed, words  # noqa: F401

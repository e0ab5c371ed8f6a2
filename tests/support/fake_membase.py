"""The in-memory Membase now ships in the public testing kit; this name stays for the tests."""

from membase_strands.testing._membase import *  # noqa: F403
from membase_strands.testing._membase import InMemoryMembase

FakeMembase = InMemoryMembase

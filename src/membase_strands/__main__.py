"""``python -m membase_strands check``: the setup check (the same as the ``membase-strands`` command)."""

import sys

from .check import main

sys.exit(main(prog="python -m membase_strands"))

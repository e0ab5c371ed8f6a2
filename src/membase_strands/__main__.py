"""``python -m membase_strands check``: the setup check."""

import sys

from .check import main

sys.exit(main())

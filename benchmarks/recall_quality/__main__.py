"""``python -m benchmarks.recall_quality``: see :mod:`benchmarks.recall_quality.bench`."""

import sys

from benchmarks.recall_quality.bench import main

sys.exit(main())

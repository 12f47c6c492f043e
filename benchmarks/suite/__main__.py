"""``python -m benchmarks.suite``: see benchmarks/suite/__init__.py."""

import sys

from benchmarks.suite.runner import main

sys.exit(main())

"""``python -m demo``: see demo/run.py."""

from demo.run import main

raise SystemExit(main())

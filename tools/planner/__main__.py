"""``python -m tools.planner``: the layout planner (same as ``python -m parallel_dims plan``)."""

import sys

from tools.planner.cli import main

sys.exit(main())

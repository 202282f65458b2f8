"""``python -m tools.planner``: the layout planner (tools/planner/cli.py; the old form
``python -m parallel_dims plan`` forwards here)."""

import sys

from tools.planner.cli import main

sys.exit(main())

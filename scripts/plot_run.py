"""Plot one or more runs' loss, validation loss, learning rate and throughput per step into one
PNG: ``python scripts/plot_run.py DUMP_FOLDER [OTHER ...] [--out PNG]``. The command is
:mod:`tools.plot_run`."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.plot_run import main

if __name__ == "__main__":
    sys.exit(main())

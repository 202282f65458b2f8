"""Tokenize a corpus once into token shards that training reads by address; ``--help`` for the
usage. The command is :mod:`tools.tokenize.cli`."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.tokenize.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Regenerate assets/tokenizer/tokenizer.json offline and deterministically; ``--help`` for the
usage. The command is :mod:`tools.tokenize.shipped_tokenizer`."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.tokenize.shipped_tokenizer import main

if __name__ == "__main__":
    raise SystemExit(main())

"""Every test carries the marker of its tier (its folder), so lanes select by marker:
``pytest -m unit`` (one process, seconds), ``-m distributed`` (gloo, 2-8 ranks), ``-m e2e``
(train.py through torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "distributed", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))

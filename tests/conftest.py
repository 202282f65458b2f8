"""Every test carries the marker of its tier (its folder), so lanes select by marker:
``pytest -m unit`` (one process, seconds), ``-m distributed`` (gloo, 2-8 ranks), ``-m e2e``
(train.py through torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.suite_budget"]  # the per-test cost table printed after every run

TIERS = ("unit", "distributed", "e2e")


# Run order: the slow tiers first (stable within a tier). `make test` runs the files on two
# pytest-xdist workers (--dist loadfile --no-loadscope-reorder), which hand out files in this
# order: the e2e files, minutes each, start first and the seconds-long unit files fill in at
# the end, instead of one long e2e file starting last and running alone.
RUN_ORDER = ("e2e", "distributed", "unit")


def _tier(item) -> str:
    return Path(str(item.fspath)).parent.name


def _fake_backend_refusal() -> str | None:
    """Why this torch cannot run ``comm.mode = "fake_backend"`` (the trainer's own config check),
    or None."""
    import torch

    from trainer.config.validate import _fake_backend_torch

    ok, message = _fake_backend_torch(torch.__version__)
    return None if ok else message


def pytest_collection_modifyitems(config, items):
    refusal = _fake_backend_refusal() if any(item.get_closest_marker("fake_backend") for item in items) else None
    for item in items:
        tier = _tier(item)
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if refusal and item.get_closest_marker("fake_backend"):
            item.add_marker(pytest.mark.skip(reason=refusal))
    items.sort(key=lambda item: RUN_ORDER.index(_tier(item)) if _tier(item) in RUN_ORDER else len(RUN_ORDER))

"""`make bench` section memory_options (benchmarks/memory_options.py): its census's event log
recomputes the peak without the storages an offload keeps on the host, exactly; the section is
registered and its committed results are what docs/memory.md's table shows (the benchmark
itself is not run here: ``make bench`` runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import memory_options, report, run

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_peak_without_host_storages_is_exact():
    """a (4 KiB) and b (8 KiB, allocated under ``host``) alive together, then a freed, then c
    (2 KiB) and a view of c: peak 12 KiB with b, 4 KiB without it (a alone, then c); a view
    adds nothing; negative control: leaving out nothing gives the all-storage peak."""
    census = memory_options.EventCensus()
    with census:
        a = torch.zeros(1024)
        census.host = True
        b = torch.zeros(2048)
        census.host = False
        del a
        c = torch.zeros(512)
        view = c[:10]
    assert census.peak_without(census.host_tokens) == 4096
    assert census.peak_without(set()) == 12288
    assert census.token_of(view) == census.token_of(c) and census.token_of(b) in census.host_tokens
    del b, c, view
    assert sum(delta for _, delta in census.events) == 0  # every storage's release was logged


def test_section_registered_and_the_docs_table_is_the_committed_run():
    assert "memory_options" in run.SECTIONS and "memory_options" in report.SECTION_IDS
    data = json.loads((ROOT / "bench_results" / "memory_options.json").read_text())["memory_options"]
    names = [r["option"] for r in data["rows"]]
    assert names == [name for name, *_ in memory_options.OPTIONS]
    doc = (ROOT / "docs" / "memory.md").read_text()
    for r in data["rows"]:
        assert f"| {r['option']} | {r['peak_MiB']:,.1f} |" in doc, r["option"]

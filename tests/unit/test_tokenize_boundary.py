"""The offline tokenizer (tools/tokenize/) stays out of the runtime: importing the trainer does
not import it, and importing either changes no environment variable. The one variable the
tokenizer sets, TOKENIZERS_PARALLELISM=false (one core per worker process), is set only while
it tokenizes and restored afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.tokenize.encode import PARALLELISM_ENV, encoded_units, one_thread_per_process
from tools.tokenize.inputs import iter_units, resolve_input
from tools.tokenize.writer import tokenize_to_shards

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, os, sys
def imported(names):
    before = dict(os.environ)
    for name in names:
        __import__(name)
    changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
    return {"changed": changed, "tokenize": sorted(m for m in sys.modules if m.startswith("tools.tokenize"))}
print(json.dumps([imported(sys.argv[1:4]), imported(sys.argv[4:7]), imported(sys.argv[7:])]))
"""
RUNTIME = ["trainer.trainer", "trainer.data.loader", "trainer.validation"]
OFFLINE = ["tools.tokenize.writer", "tools.tokenize.cli", "tools.tokenize.shipped_tokenizer"]


def test_the_runtime_imports_no_offline_tokenizer_and_neither_sets_the_environment(tmp_path):
    """One fresh interpreter: the runtime first (no tools.tokenize module, no variable changed),
    then the offline tokenizer (its modules are now imported; still no variable), then a module
    that does set one at import (control: the probe sees it)."""
    (tmp_path / "sets_env_at_import.py").write_text("import os\nos.environ['MESHTRAIN_PROBE_CONTROL'] = '1'\n")
    env = {k: v for k, v in os.environ.items() if k not in (PARALLELISM_ENV, "MESHTRAIN_PROBE_CONTROL")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, *RUNTIME, *OFFLINE, "sets_env_at_import"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    runtime, offline, control = json.loads(res.stdout.strip().splitlines()[-1])
    assert runtime == {"changed": [], "tokenize": []}
    assert offline["changed"] == [] and set(OFFLINE) <= set(offline["tokenize"])
    assert control["changed"] == ["MESHTRAIN_PROBE_CONTROL"]


@pytest.fixture
def no_parallelism_env(monkeypatch):
    monkeypatch.delenv(PARALLELISM_ENV, raising=False)


def test_one_thread_per_process_is_scoped_and_keeps_a_callers_choice(no_parallelism_env, monkeypatch):
    with one_thread_per_process():
        assert os.environ[PARALLELISM_ENV] == "false"
    assert PARALLELISM_ENV not in os.environ
    monkeypatch.setenv(PARALLELISM_ENV, "true")
    with one_thread_per_process():
        assert os.environ[PARALLELISM_ENV] == "true"
    assert os.environ[PARALLELISM_ENV] == "true"


@pytest.mark.parametrize("workers", [1, 2])
def test_tokenizing_sets_it_while_it_runs_and_restores_it(no_parallelism_env, tmp_path, workers):
    units = iter_units([resolve_input("synthetic:0:20")])
    seen = set()
    for _ in encoded_units(units, "", "uint16", workers, chunk_bytes=200):
        seen.add(os.environ.get(PARALLELISM_ENV))  # the pool was started inside the same scope
    assert seen == {"false"} and PARALLELISM_ENV not in os.environ
    tokenize_to_shards(["synthetic:0:20"], str(tmp_path / "tok"), workers=workers, log=None)
    assert PARALLELISM_ENV not in os.environ

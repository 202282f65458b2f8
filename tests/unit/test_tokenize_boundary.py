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
before = dict(os.environ)
for name in sys.argv[1:]:
    __import__(name)
after = dict(os.environ)
changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
print(json.dumps({"changed": changed, "tokenize": sorted(m for m in sys.modules if m.startswith("tools.tokenize"))}))
"""


def _import_in_fresh_process(*modules: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != PARALLELISM_ENV}
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_runtime_imports_no_offline_tokenizer_and_sets_no_environment():
    got = _import_in_fresh_process("trainer.train", "trainer.data.loader", "trainer.validation")
    assert got == {"changed": [], "tokenize": []}


def test_importing_the_offline_tokenizer_sets_no_environment_either():
    modules = ["tools.tokenize.writer", "tools.tokenize.cli", "tools.tokenize.shipped_tokenizer"]
    got = _import_in_fresh_process(*modules)
    assert got["changed"] == [] and set(modules) <= set(got["tokenize"])  # control: they were imported


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

"""``python tests/distributed/run_json.py MODULE:FUNCTION ARGS_JSON``: ``FUNCTION(*args, **kwargs)``
of ``ARGS_JSON = [args, kwargs]``, its result as one JSON line on stdout.

For tests that need a function run on a process of its own (a fake-backend process group,
DTensor caches that start empty) without paying a new interpreter's imports:
:func:`run_on_own_process` runs this file on a process forked from tools/launcher.py's server,
which imported torch and the trainer once and ran no torch op."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_on_own_process(target: str, *args, timeout: float = 300, threads: int = 1, **kwargs):
    """``target`` (``"module:function"``) called with ``args``/``kwargs`` (JSON-able) on one
    process forked from tools/launcher.py's server, with ``threads`` intra-op threads; its
    JSON-able result. Raises RuntimeError with the process's stderr when it fails."""
    from tools.launcher import run_train

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    argv = [target, json.dumps([list(args), kwargs])]
    out = run_train(1, argv, env=env, cwd=ROOT, timeout=timeout, script=Path(__file__))
    if out.returncode != 0:
        raise RuntimeError(f"{target} failed (exit {out.returncode}): {out.stderr.strip()[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    module, _, function = sys.argv[1].partition(":")
    args, kwargs = json.loads(sys.argv[2])
    print(json.dumps(getattr(importlib.import_module(module), function)(*args, **kwargs)))

"""``python tests/distributed/run_json.py MODULE:FUNCTION ARGS_JSON``: ``FUNCTION(*args, **kwargs)``
of ``ARGS_JSON = [args, kwargs]``, its result as one JSON line on stdout.
``python tests/distributed/run_json.py -m MODULE ARGS...``: what ``python -m MODULE ARGS...`` runs.

For tests that need a function or a command-line module run on a process of its own (a
fake-backend process group, DTensor caches that start empty, an exit code) without paying a new
interpreter's imports: :func:`run_on_own_process` and :func:`run_module_on_own_process` run this
file on a process forked from tools/forkserver.py's server, which imported torch and the trainer
once and ran no torch op. Not for what a new interpreter itself does (import-time output, start-up
hooks): those tests start one."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_on_own_process(target: str, *args, timeout: float = 300, threads: int = 1, **kwargs):
    """``target`` (``"module:function"``) called with ``args``/``kwargs`` (JSON-able) on one
    process forked from tools/forkserver.py's server, with ``threads`` intra-op threads; its
    JSON-able result. Raises RuntimeError with the process's stderr when it fails."""
    from tools.forkserver import run_train

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    argv = [target, json.dumps([list(args), kwargs])]
    out = run_train(1, argv, env=env, cwd=ROOT, timeout=timeout, script=Path(__file__))
    if out.returncode != 0:
        raise RuntimeError(f"{target} failed (exit {out.returncode}): {out.stderr.strip()[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_module_on_own_process(module: str, *args: str, timeout: float = 300, threads: int = 1):
    """``python -m module args...`` on one process forked from tools/forkserver.py's server, from
    the repository root, with ``threads`` intra-op threads: a ``subprocess.CompletedProcess``
    with its exit code, stdout and stderr (text)."""
    from tools.forkserver import run_train

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return run_train(1, ["-m", module, *args], env=env, cwd=ROOT, timeout=timeout, script=Path(__file__))


if __name__ == "__main__":
    if sys.argv[1] == "-m":
        import runpy

        sys.argv = [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        sys.exit(0)
    module, _, function = sys.argv[1].partition(":")
    args, kwargs = json.loads(sys.argv[2])
    print(json.dumps(getattr(importlib.import_module(module), function)(*args, **kwargs)))

"""The two commands that used to live in ``python -m parallel_dims`` and now live where their code
is, forwarded for the users and scripts that still type the old form:

    python -m parallel_dims plan ...        ->  python -m tools.planner ...
    python -m parallel_dims --config X ...  ->  python -m trainer.plan_report --config X ...

Each prints one ``note:`` line on stderr naming the new command, then runs it in this process
(same output, same exit code). This module is the one place where ``parallel_dims`` imports
from above itself (tools/, trainer/), and only their command entry points, inside the functions
below: ``import parallel_dims`` never reaches them, and tests/unit/test_imports.py checks that no
other ``parallel_dims`` module does.

Why an import and not ``os.exec`` of the new module: an in-process ``main(argv)`` call (tests,
scripts) keeps its process, the exit code and the error lines are the new command's own, and the
dependency stays visible to the import check instead of hiding in a string.
"""

from __future__ import annotations

import argparse
import sys

from .axes import AXES

__all__ = ["JOB_PLAN", "LAYOUT_PLANNER", "job_plan", "layout_planner", "note"]

LAYOUT_PLANNER = "python -m tools.planner"
JOB_PLAN = "python -m trainer.plan_report"


def note(old: str, new: str) -> None:
    """The one line the old form prints before it runs the new one."""
    print(f"note: `{old}` is now `{new}` (same options); running it", file=sys.stderr, flush=True)


def layout_planner(argv: list[str]) -> int:
    """``python -m parallel_dims plan ARGS``: ``python -m tools.planner ARGS``."""
    note("python -m parallel_dims plan", LAYOUT_PLANNER)
    from tools.planner.cli import main

    return main(argv)


def job_plan_argv(args: argparse.Namespace) -> list[str]:
    """The new command's arguments for an old ``--config`` command line (parsed by
    parallel_dims' own parser; ``--gpus-per-node``, which the job plan never used, is dropped)."""
    argv = ["--config", args.config, "--world-size", str(args.world_size)]
    for axis in AXES:
        if getattr(args, axis.name) is not None:
            argv += [axis.cli_flag, str(getattr(args, axis.name))]
    argv += ["--rank", str(args.rank)]
    return argv + (["--json"] if args.json else [])


def job_plan(args: argparse.Namespace) -> int:
    """``python -m parallel_dims --config X ...``: ``python -m trainer.plan_report --config X ...``."""
    note("python -m parallel_dims --config", f"{JOB_PLAN} --config")
    from trainer.plan_report import main

    return main(job_plan_argv(args))

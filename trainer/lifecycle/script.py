"""What the entry points beside train.py share (scripts/generate.py, scripts/eval.py): their own
flags next to config arguments (``--config``, ``--section.key``) and torchrun's flags, the
launcher when torchrun's flags are given (the same script on every worker, the script's own
check before any worker starts), and on a rank one line and exit code 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from trainer.lifecycle.launch import launcher_argv
from trainer.lifecycle.launch import run as launch
from trainer.lifecycle.shutdown import run_and_exit
from trainer.lifecycle.start_signals import hand_over
from trainer.runtime.cli_errors import EXIT_BAD_INPUT, error_line, user_error
from trainer.runtime.console import say_once

__all__ = ["UsageError", "rank", "rank_exit_code", "run_script", "script_parser", "split_argv"]


class UsageError(ValueError):
    """A flag of the script that cannot be used."""


def script_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An argument parser whose errors are :class:`UsageError` naming ``prog --help``."""
    p = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)

    def fail(message: str):
        raise UsageError(f"{message} ({prog} --help)")

    p.error = fail  # type: ignore[method-assign]
    return p


def split_argv(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(the script's own flags, the rest: config arguments and torchrun's flags); ``--config``
    and ``--help`` stay in the rest (the config's; help is added back by :func:`run_script`)."""
    actions = parser._option_string_actions
    own, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in actions and name not in ("--config", "-h", "--help"):
            own.append(token)
            if "=" not in token and actions[name].nargs != 0 and i + 1 < len(argv):
                own.append(argv[i + 1])
                i += 1
        else:
            rest.append(token)
        i += 1
    return own, rest


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def rank_exit_code(work: Callable[[], int]) -> int:
    """``work()``'s exit code on this rank; bad input (trainer/runtime/cli_errors.py
    ``user_error``): one line, said by rank 0, exit code 2. The process group is destroyed."""
    try:
        return work()
    except BaseException as exc:
        err = user_error(exc)
        if err is None:
            raise
        say_once(error_line(err), rank())
        return EXIT_BAD_INPUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_script(
    argv: list[str],
    parser: argparse.ArgumentParser,
    *,
    script: str,
    check_flags: Callable[[Any], object],
    check_job: Callable[[Any, Any, int], None],
    run: Callable[[Any, list[str]], int],
) -> int:
    """The script's exit code. Its flags parsed (``check_flags(ns)`` raises :class:`UsageError`);
    with torchrun's flags the launcher starts ``script`` with the same arguments on every worker
    after ``check_job(ns, cfg, world_size)``; without, this process is a rank and runs
    ``run(ns, config_args)`` under :func:`rank_exit_code`."""
    try:
        own, rest = split_argv(argv, parser)
        if "-h" in rest or "--help" in rest:
            own.append("--help")
        ns = parser.parse_args(own)
        split = launcher_argv(rest)
        config_args = rest if split is None else split[1]
        stray = [a for a in config_args if a.startswith("-") and "." not in a.split("=")[0] and a != "--config"]
        if stray:
            raise UsageError(
                f"unknown option {stray[0]}: this script's options are in {parser.prog} --help, "
                "config keys are --section.key, launcher flags torchrun's"
            )
        check_flags(ns)
    except UsageError as exc:
        print(error_line(exc), file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if split is not None:  # torchrun's flags: start the workers (this script, the same arguments)
        return launch(
            split[0], config_args, script=script, script_args=own, check=lambda cfg, world: check_job(ns, cfg, world)
        )
    hand_over()  # from here a Ctrl-C is this process's (one line)
    run_and_exit(lambda: rank_exit_code(lambda: run(ns, config_args)))
    return 0

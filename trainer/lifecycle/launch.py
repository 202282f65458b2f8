"""``python train.py --nproc_per_node N [torchrun's other flags] --config X [overrides]``: the
launcher, torchrun's job without its noise. ``scripts/generate.py`` launches its workers through
the same :func:`run` (its script, its own flags, its pre-start check).

It takes torchrun's own flags (its parser: ``--nproc_per_node``, ``--nnodes``, ``--node_rank``,
``--rdzv_*``, ``--master_*``, ``--max_restarts``, ...; every flag without a dot is a launcher
flag, every ``--section.key`` a config key) and then:

1. checks before any worker starts what can be checked without one, with the workers' own
   start-up functions (trainer/startup.py ``preflight``): the config, the layout against the
   world size (``nnodes x nproc_per_node``; an elastic node range ``MIN:MAX`` at every node
   count, trainer/lifecycle/elastic.py, the data at its smallest),
   the tokenizer, the Hugging Face folder to start from, and the training and validation
   loaders as batch rank 0 builds them (every dataset kind, mixtures, striped rows). Most user
   errors end here: one ``error:`` line, exit code 2, no worker started;
2. runs torch's elastic agent in this process (what torchrun runs), the workers being
   ``train.py`` with the config arguments only;
3. ends as the job ended, in one line at most: a worker's user error was already printed by
   the rank that met it (exit code 2; ranks whose collectives then failed on the gone peer end
   quietly with exit code 4, and the launcher reports the cause, not them); a run stopped by SIGINT / SIGTERM printed its stop line (exit code
   128 + the signal, trainer/runtime/stop.py); a worker that crashed or was killed gets one line naming
   the rank, its exit code or signal, and that its output is above. Under ``--max_restarts K``
   a failed worker makes the agent restart every worker (they resume from the newest complete
   checkpoint), one line each time, and the job ends only when K restarts are spent (``gave up
   after K restarts: ...``); bad input and a stop signal are never restarted
   (trainer/lifecycle/restarts.py).

What torchrun adds and this leaves out: the OMP_NUM_THREADS banner (the variable is still set
to 1 for several workers when unset), the agent's warnings, the ``ChildFailedError``
traceback. A signal to the launcher (a terminal's Ctrl-C, ``scancel``) reaches the workers
through the agent, which waits ``--shutdown_timeout`` (default here: the checkpoint save's
bound, ``comm.init_timeout_seconds``, plus 60 s) for them to save and exit; on a second
Ctrl-C the agent shuts down again with SIGTERM, and the workers stop at once. The workers
start with SIGINT and SIGTERM blocked until train.py's first line (trainer/lifecycle/start_signals.py), so
a Ctrl-C while they start is one line too. A launcher SIGKILLed takes its workers with it
(trainer/lifecycle/parent_death.py: they are SIGKILLed as their parent ends).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable
from typing import Any

from trainer.runtime.cli_errors import EXIT_BAD_INPUT, report_user_error, user_error

__all__ = ["launcher_argv", "main"]

TRAIN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train.py")


def _torchrun_parser():
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def _takes_value(action) -> bool:
    return action.nargs != 0


def launcher_argv(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """``(launcher flags, config arguments)`` when ``argv`` holds any of torchrun's flags, else
    None (a plain ``python train.py`` run). A torchrun flag never has a dot; a config key always
    has one (``--training.steps``), and ``--config`` / ``--help`` are the trainer's."""
    if not any(a.startswith("--") and "." not in a.split("=")[0] for a in argv if a not in ("--config", "--help")):
        return None
    actions = _torchrun_parser()._option_string_actions
    launch, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name.startswith("--") and "." not in name and name not in ("--config", "--help") and name in actions:
            launch.append(token)
            if "=" not in token and _takes_value(actions[name]) and i + 1 < len(argv):
                launch.append(argv[i + 1])
                i += 1
        else:
            rest.append(token)
        i += 1
    return (launch, rest) if launch else None


class LaunchError(ValueError):
    """A launcher flag the job cannot start with."""


def _parse_launch(launch: list[str]):
    """torchrun's parser on the launcher flags, its usage errors as one line."""
    parser = _torchrun_parser()
    parser.prog = "python train.py"

    def fail(message: str):
        raise LaunchError(f"{message} (torchrun's flags: python -m torch.distributed.run --help)")

    parser.error = fail  # type: ignore[method-assign]
    args = parser.parse_args([*launch, TRAIN_PY])
    from torch.distributed.run import parse_min_max_nnodes as parse_nnodes

    try:
        min_nodes, _max_nodes = parse_nnodes(args.nnodes)
    except Exception:
        fail(f"--nnodes must be N or MIN:MAX, got {args.nnodes!r}")
    from torch.distributed.run import determine_local_world_size

    try:  # a number, or torchrun's gpu / cpu / auto (every GPU of the node, ...)
        nproc = determine_local_world_size(str(args.nproc_per_node))
    except ValueError as exc:
        fail(f"--nproc_per_node must be a number of processes, gpu, cpu or auto, got {args.nproc_per_node!r} ({exc})")
    if nproc < 1:
        fail(f"--nproc_per_node must be >= 1, got {nproc}")
    args.nproc_per_node = str(nproc)  # resolved once (gpu / cpu / auto)
    return args, min_nodes * nproc


def _quiet_agent() -> None:
    """The elastic agent's own warnings (closing signals, restarts; its "failed (exitcode: 2)"
    report too: the launcher says what a failure means, once) are not the user's news. torch
    gives each of its elastic modules a logger with a level of its own (LOGLEVEL, default
    WARNING), so each is set, not only their parent."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _forward_to_children(signum: int) -> int:
    """Send ``signum`` to this process's children (the workers), found in /proc (Linux); how
    many there were."""
    me, sent = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            try:
                os.kill(int(entry), signum)
                sent += 1
            except ProcessLookupError:
                pass
    return sent


def _wait_for_children(timeout: float) -> None:
    """Reap this process's children (the workers) as they exit; SIGKILL what is left after
    ``timeout`` seconds. A signal meanwhile is sent on to them."""
    import time

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: _forward_to_children(signum))
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            if time.monotonic() > deadline:
                _forward_to_children(signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)


def _failure_line(exc, cfg=None, max_restarts: int = 0, restarts: int = 0, offset: int = 0) -> tuple[str | None, int]:
    """What to print for a failed job (None: the workers said it) and the exit code. Under
    ``--max_restarts K`` > 0 a failure the agent restarts on ends the job only once the K
    restarts are spent: ``gave up after K restarts: ...``, naming the failure of the last start
    (``restarts``: those made; the last start's rows of metrics.jsonl after byte ``offset``;
    trainer/lifecycle/restarts.py)."""
    from trainer.lifecycle.restarts import cause, describe, restartable, where

    rank, failure = cause(exc.failures)
    code = failure.exitcode
    if max_restarts > 0 and restartable(exc.failures):
        return (
            f"gave up after {restarts} restart{'s' if restarts != 1 else ''}: {describe(rank, failure)} "
            f"{where(cfg, restarts, offset, gave_up=True)} (its output is above)",
            128 - code if code < 0 else code,
        )
    if code < 0:  # killed by a signal
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        return (
            f"error: rank {rank} (pid {failure.pid}) was ended by {name}; the job stopped (its output is above)",
            128 - code,
        )
    if code in (EXIT_BAD_INPUT, 128 + signal.SIGINT, 128 + signal.SIGTERM):
        return None, code  # the one error line, or the stop line, was printed by the workers
    return f"rank {rank} (pid {failure.pid}) exited with code {code}; the job stopped (its output is above)", code


def _check_elastic(cfg, args) -> None:
    """``--nnodes MIN:MAX``: the layout re-planned at every node count (the smallest was
    checked whole by ``preflight``), and the rendezvous setting a range needs
    (trainer/lifecycle/elastic.py)."""
    from torch.distributed.run import parse_min_max_nnodes

    from trainer.lifecycle.elastic import check_node_range, share_no_store
    from trainer.startup import plan_startup

    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if max_nodes > min_nodes:
        from parallel_dims import default_device_type

        device_type = default_device_type()
        check_node_range(
            cfg, min_nodes, max_nodes, int(args.nproc_per_node), lambda c, w: plan_startup(c, w, device_type)
        )
        share_no_store(min_nodes, max_nodes)


def run(
    launch: list[str],
    rest: list[str],
    *,
    script: str = TRAIN_PY,
    script_args: list[str] | None = None,
    check: Callable[[Any, int], None] | None = None,
) -> int:
    """Launch ``script`` (default train.py) on every worker with the config arguments ``rest``
    and then ``script_args`` (another entry point's own flags, e.g. scripts/generate.py's);
    ``check(cfg, world_size)`` is the pre-start check (default: training's ``preflight``)."""
    from trainer.config import load_config
    from trainer.lifecycle.restarts import restarting
    from trainer.lifecycle.start_signals import hand_over, workers_start_blocked
    from trainer.startup import preflight

    hand_over()  # a Ctrl-C from here is this function's (one line)
    try:
        args, world_size = _parse_launch(launch)
        cfg = load_config(rest)
        _check_elastic(cfg, args)  # a node range: every node count's layout, the lost node's worded
        (check or preflight)(cfg, world_size)
    except KeyboardInterrupt:
        print("interrupted (SIGINT) before the workers started: nothing to save", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except BaseException as exc:
        err = user_error(exc)
        if err is None:
            raise
        return report_user_error(err)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_min_max_nnodes

    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None):
        if args.standalone or parse_min_max_nnodes(args.nnodes)[1] == 1:  # torchrun's single-node rendezvous
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if hasattr(args, "shutdown_timeout") and "--shutdown_timeout" not in " ".join(launch).replace("-", "_"):
        args.shutdown_timeout = cfg.comm.init_timeout_seconds + 60  # the workers' stop-and-save bound
    if int(args.nproc_per_node) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does, without its banner
    args.training_script, args.training_script_args = script, [*rest, *(script_args or [])]
    from trainer.lifecycle.parent_death import LAUNCHER_PID

    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers end with this process (parent_death.py)
    _quiet_agent()
    config, cmd, cmd_args = config_from_args(args)
    try:
        # a signal to a starting worker waits for its first line; a failure is restarted with one
        # line, up to --max_restarts times, bad input never (trainer/lifecycle/restarts.py)
        with workers_start_blocked(), restarting(cfg) as agent:
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except KeyboardInterrupt:
        # before the agent took SIGINT over (its rendezvous, the workers' start) or after it gave
        # it back: the workers that exist stop with their own line; with none, this is the line
        if not _forward_to_children(signal.SIGINT):
            print("interrupted (SIGINT) before the workers started: nothing to save", file=sys.stderr, flush=True)
        _wait_for_children(getattr(args, "shutdown_timeout", 30))
        return 128 + signal.SIGINT
    except ChildFailedError as exc:
        line, code = _failure_line(exc, cfg, config.max_restarts, agent.restarts, agent.offset)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        # the agent sent the signal on to the workers and waited for them to save and exit. A
        # second signal while it waited makes it shut down again with SIGTERM, which stops the
        # workers at once (trainer/runtime/stop.py); any worker still running gets the signal too and
        # is waited for
        _forward_to_children(int(exc.sigval))
        _wait_for_children(getattr(args, "shutdown_timeout", 30))
        return 128 + int(exc.sigval)
    return 0


def main(argv: list[str]) -> int:
    """The launcher's exit code; ``argv`` holds torchrun's flags and the config arguments
    (trainer/lifecycle/main.py sends only such an ``argv`` here)."""
    split = launcher_argv(argv)
    if split is None:
        raise ValueError(f"no launcher flag (torchrun's --nproc_per_node, --nnodes, ...) in {argv}")
    return run(*split)

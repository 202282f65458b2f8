"""Plain ``torchrun --nnodes MIN:MAX ... train.py``: the launcher's node-range checks, made by
the workers (docs/long_runs.md, "Losing a node").

``python train.py --nnodes MIN:MAX ...`` (trainer/lifecycle/launch.py) checks the range before
any worker starts and sets the rendezvous setting a range needs. torchrun does neither, and
its workers are told neither MIN nor MAX (the agent gives them ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE``, the world of this start only). So a worker of torchrun reads the node
range from its agent's command line (its parent, ``/proc/PPID/cmdline``, parsed with torchrun's
own parser) and, at every start of the workers, refuses in one line (exit code 2, every rank
alike):

* **the shared rendezvous store** (``TORCHELASTIC_USE_AGENT_STORE=True``: the agents share the
  rendezvous' TCPStore with the workers, torch's default): on torch 2.13 a node that joins the
  running job (one that comes back) then ends the whole job. The rank-0 agent reuses its first
  round's store address and never writes the new round's ``MASTER_ADDR``, which the joining
  agent waits for; every agent fails after 60 s with a traceback, once the workers already
  stopped (measured with two torchruns of ``--nnodes 1:2``: both exit 1). Nothing in a worker can
  change the agents' setting, and by the time a node joins the workers are gone, so the line
  comes at the start and names the fix: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in every
  node's environment, or ``python train.py`` as the launcher (which sets it). A lost node alone
  does not meet it (measured: the survivor of two regroups with the shared store too); the
  refusal is for the node that comes back, which a node range is for;
* **a range the layout cannot follow**: what the launcher checks
  (:func:`trainer.lifecycle.elastic.check_node_range`: ``dp_shard = -1``, a set global batch, a
  valid plan and, when a device's memory is known, a fit at every node count). Without it a
  fixed ``dp_shard`` or a smaller world without a valid layout runs until a node is lost and
  then fails the same way at every restart torchrun makes.

torchrun restarts a failed start whatever its exit code (``--max_restarts K``): such a job ends
after K + 1 starts with the same one line each, then torchrun's own report. Every start checks
(a restarted start that skipped it would train: the refusal must hold through the restarts). A
worker of our launcher (``MESHTRAIN_LAUNCHER_PID`` set) has nothing to check here: the launcher
did.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from trainer.config import ConfigError, JobConfig
from trainer.lifecycle.elastic_fit import MemoryEstimator
from trainer.lifecycle.parent_death import LAUNCHER_PID

__all__ = ["check_torchrun_range", "parent_cmdline", "torchrun_node_range"]

SHARE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_TORCHRUN_NAMES = ("torchrun", "torch.distributed.run")


def parent_cmdline(pid: int | None = None) -> list[str] | None:
    """The command line of process ``pid`` (default: this process's parent), None if unreadable."""
    try:
        with open(f"/proc/{os.getppid() if pid is None else pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part] or None


def _torchrun_args(cmdline: list[str]):
    """torchrun's parsed flags from its command line (``torchrun ...``, ``python -m
    torch.distributed.run ...``); None for any other program or flags its parser refuses."""
    start = next(
        (
            i + 1
            for i, part in enumerate(cmdline)
            if os.path.basename(part) in _TORCHRUN_NAMES or part in _TORCHRUN_NAMES
        ),
        None,
    )
    if start is None:
        return None
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def fail(message: str):
        raise ValueError(message)

    parser.error = fail  # type: ignore[method-assign]
    try:
        return parser.parse_args(cmdline[start:])
    except (ValueError, SystemExit):
        return None


def torchrun_node_range(environ: Mapping[str, str], cmdline: list[str] | None) -> tuple[int, int, int] | None:
    """``(MIN, MAX, nproc_per_node)`` for a worker of plain torchrun launched with a node range
    (``cmdline``: its agent's command line); None for anything else (no elastic agent, our
    launcher's worker, a fixed node count, a command line that is not torchrun's)."""
    if "TORCHELASTIC_RUN_ID" not in environ or LAUNCHER_PID in environ or not cmdline:
        return None
    args = _torchrun_args(cmdline)
    if args is None:
        return None
    from torch.distributed.run import parse_min_max_nnodes

    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
        nproc = int(environ.get("LOCAL_WORLD_SIZE", "0"))
    except (ValueError, RuntimeError):
        return None
    return (min_nodes, max_nodes, nproc) if max_nodes > min_nodes and nproc > 0 else None


def _shared_store_error(min_nodes: int, max_nodes: int) -> ConfigError:
    import torch

    return ConfigError(
        f"torchrun --nnodes {min_nodes}:{max_nodes} shares its rendezvous store with the workers, and on torch "
        f"{torch.__version__.split('+')[0]} a node that joins the running job (one that comes back) then ends the "
        f"whole job (every agent times out after 60 s waiting for the round's MASTER_ADDR); set {SHARE_VAR}=1 in "
        f"every node's environment before torchrun, or launch with python train.py and the same flags (it sets it)"
    )


def check_torchrun_range(
    cfg: JobConfig,
    environ: Mapping[str, str] | None = None,
    cmdline: list[str] | None = None,
    estimator: MemoryEstimator | None = None,
    device_type: str | None = None,
) -> None:
    """In a worker of plain torchrun with ``--nnodes MIN:MAX``, at every start: refuse
    (one line, a :class:`ConfigError` or the plan's ValueError) the shared rendezvous store and
    a range the layout or one device's memory cannot follow (module docstring). ``environ``
    and ``cmdline`` default to this process's environment and its parent's command line;
    ``estimator``: train.py's planner pricing (None: the fit is not priced)."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ or LAUNCHER_PID in environ:
        return  # not torchrun's worker (the parent's command line is not even read)
    found = torchrun_node_range(environ, parent_cmdline() if cmdline is None else cmdline)
    if found is None:
        return
    min_nodes, max_nodes, nproc = found
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise _shared_store_error(min_nodes, max_nodes)
    from trainer.lifecycle.elastic import check_node_range
    from trainer.lifecycle.elastic_fit import device_memory
    from trainer.startup import plan_startup

    if device_type is None:
        from parallel_dims import default_device_type

        device_type = default_device_type()
    check_node_range(
        cfg, min_nodes, max_nodes, nproc, lambda c, w: plan_startup(c, w, device_type),
        memory=device_memory(cfg), estimator=estimator,
    )  # fmt: skip

"""Does the model fit the device at every node count of ``--nnodes MIN:MAX``? (docs/long_runs.md,
"Losing a node").

A smaller world holds the same model on fewer ranks: ``dp_shard`` shrinks, so every rank keeps a
bigger shard of the parameters, gradients and optimizer state (and, with a set global batch, the
same micro-batch). Where that no longer fits in device memory, the restarted workers would die
out of memory until ``--max_restarts`` is spent. The launcher checks it before any worker starts:
at every node count it prices the busiest rank's device memory with a :data:`MemoryEstimator`
and compares it with one device's memory: ``job.device_memory_gib`` when set, else the smallest
GPU of the launcher's host (``torch.cuda.get_device_properties``). A host without an accelerator
has no device memory limit: nothing is checked there unless ``job.device_memory_gib`` states one.

The estimator is handed in by the entry point: the trainer does not import the tools
(tools -> trainer -> models, docs/design.md). ``train.py`` passes the layout planner's memory
model (:func:`tools.planner.from_config.peak_bytes`: ``memory_for_rank`` of the first and the
last pipeline stage, as ``python -m tools.planner`` prices the layout, with the memory options
the config turns on priced as ``--fit`` prices them) through trainer/lifecycle/main.py and
launch.py to :func:`trainer.lifecycle.elastic.check_node_range`. Without one (the launcher
called otherwise than through ``train.py``), and for a config the estimator cannot price, one
note line says the fit was not checked, and the job goes on.

The planner's figure is an estimate; the check refuses only a world whose estimate exceeds the
device's whole memory (the planner's own ``fits`` also keeps a 6 GiB reserve free).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from trainer.config import ConfigError
from trainer.config.long_run_checks import nodes_text

__all__ = ["MemoryEstimator", "check_node_memory", "device_memory"]

GIB = 2**30

MemoryEstimator = Callable[[Any, int], float | None]
"""``estimator(plan, gpus_per_node) -> bytes``: the device memory the busiest rank of ``plan``
needs (a ``trainer.plan.JobPlan`` of one world size, as the workers will plan it;
``gpus_per_node`` is ``--nproc_per_node``). It raises, or returns None, for a config it cannot
price."""
FIT_FIELDS = "training.cpu_offload, activation_checkpoint.offload, training.loss_chunk_tokens, optimizer.state_dtype"


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def device_memory(cfg) -> tuple[float, str] | None:
    """One device's memory in bytes and how to name it: ``job.device_memory_gib`` when set, else
    the smallest GPU of this host; None on a host without an accelerator (no limit to check)."""
    if cfg.job.device_memory_gib > 0:
        return cfg.job.device_memory_gib * GIB, "set by job.device_memory_gib"
    import torch

    if not torch.cuda.is_available():
        return None
    props = min(
        (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())), key=lambda p: p.total_memory
    )
    return props.total_memory, f"of one {props.name}"


def _note(flag: str, why: str) -> None:
    print(f"note: {flag}: {why}; whether the job fits every node count is not checked", file=sys.stderr, flush=True)


def check_node_memory(
    flag: str, worlds, max_nodes: int, nproc_per_node: int, memory, estimator: MemoryEstimator | None
) -> None:
    """Refuse (a :class:`ConfigError`, one line) the smallest node count of ``worlds`` (``(nodes,
    world size, plan)``, smallest first) whose ``estimator`` figure per rank exceeds ``memory``
    (:func:`device_memory`; None: nothing to check). No estimator, or a plan it cannot price:
    one note line on stderr, and no check."""
    if memory is None:
        return
    if estimator is None:
        return _note(flag, "no device memory estimator was given to the launcher (train.py gives the planner's)")
    limit, where = memory
    peaks = []
    for nodes, world, plan in worlds:
        try:
            need, why = estimator(plan, nproc_per_node), "no estimate for this config"
        except Exception as exc:  # a model or option the planner does not price: say so, go on
            first = (str(exc).strip().splitlines() or [""])[0]
            need, why = None, f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        if need is None:
            at = f"{nodes_text(nodes)} ({world} ranks)"
            return _note(flag, f"could not estimate the device memory per rank on {at} with the planner ({why})")
        peaks.append((nodes, world, need))
    over = [(n, w, b) for n, w, b in peaks if b > limit]
    if not over:
        return
    nodes, world, need = over[0]
    fits = [n for n, _, b in peaks if b <= limit and n > over[-1][0]]
    who = "which a lost node would run on" if nodes < max_nodes else "the full job"
    fix = (
        f"start with --nnodes {fits[0]}:{max_nodes} (the fewest nodes it fits) or make it fit"
        if fits
        else "make it fit"
    )
    raise ConfigError(
        f"{flag}: on {nodes_text(nodes)} ({world} ranks), {who}, the job needs about {_size(need)} per rank "
        f"(planner estimate), more than the {_size(limit)} {where}; {fix} with the memory options ({FIT_FIELDS}; "
        f"python -m tools.planner --fit --world-size {world} prices them)"
    )

"""Does the model fit the device at every node count of ``--nnodes MIN:MAX``? (docs/long_runs.md,
"Losing a node").

A smaller world holds the same model on fewer ranks: ``dp_shard`` shrinks, so every rank keeps a
bigger shard of the parameters, gradients and optimizer state (and, with a set global batch, the
same micro-batch). Where that no longer fits in device memory, the restarted workers would die
out of memory until ``--max_restarts`` is spent. The launcher checks it before any worker starts:
at every node count it prices the busiest rank's device memory with the layout planner's own
memory model (:func:`tools.planner.estimate.memory_for_rank` of the first and the last pipeline
stage, as ``python -m tools.planner`` does, with the memory options the config turns on priced as
``--fit`` prices them: :func:`tools.planner.fit.option_memory`) and compares it with one device's
memory: ``job.device_memory_gib`` when set, else the smallest GPU of the launcher's host
(``torch.cuda.get_device_properties``). A host without an accelerator has no device memory limit:
nothing is checked there unless ``job.device_memory_gib`` states one.

The planner's figure is an estimate; the check refuses only a world whose estimate exceeds the
device's whole memory (the planner's own ``fits`` also keeps a 6 GiB reserve free). A config the
planner cannot price is said in one note line and goes on unchecked.
"""

from __future__ import annotations

import sys

from trainer.config import ConfigError
from trainer.config.long_run_checks import nodes_text

__all__ = ["check_node_memory", "config_options", "device_memory", "peak_bytes"]

GIB = 2**30
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


def config_options(cfg) -> tuple[str, ...]:
    """The planner's ``--fit`` options (tools/planner/fit.py ``OPTIONS``) the config turns on."""
    on = {
        "loss_chunk_tokens": cfg.training.loss_chunk_tokens > 0,
        "state_dtype": cfg.optimizer.state_dtype == "bfloat16",
        "activation_offload": cfg.activation_checkpoint.offload,
        "cpu_offload": cfg.training.cpu_offload,
    }
    return tuple(name for name, is_on in on.items() if is_on)


def peak_bytes(plan, gpus_per_node: int) -> float:
    """The planner's device memory of the busiest rank of a trainer job plan, in bytes."""
    from tools.planner.fit import option_memory
    from tools.planner.from_config import job_from_plan
    from tools.planner.hardware import load_hardware

    cfg = plan.config
    job, d, choice = job_from_plan(plan, load_hardware("h100"), gpus_per_node=gpus_per_node)
    ranks = sorted({0, (d.pp - 1) * (d.world_size // d.pp)})  # first and last stage, as estimate()
    options, chunk = config_options(cfg), cfg.training.loss_chunk_tokens
    return max(option_memory(job, d, choice, r, options, chunk)["total"] for r in ranks)


def check_node_memory(flag: str, worlds, max_nodes: int, nproc_per_node: int, memory) -> None:
    """Refuse (a :class:`ConfigError`, one line) the smallest node count of ``worlds`` (``(nodes,
    world size, plan)``, smallest first) whose planner estimate per rank exceeds ``memory``
    (:func:`device_memory`; None: nothing to check). A plan the planner cannot price: one note
    line on stderr, and no check."""
    if memory is None:
        return
    limit, where = memory
    peaks = []
    for nodes, world, plan in worlds:
        try:
            peaks.append((nodes, world, peak_bytes(plan, nproc_per_node)))
        except Exception as exc:  # a model or option the planner does not price: say so, go on
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(
                f"note: {flag}: could not estimate the device memory per rank on {nodes_text(nodes)} ({world} ranks) "
                f"with the planner ({type(exc).__name__}: {why}); whether the job fits every node count is not checked",
                file=sys.stderr,
                flush=True,
            )
            return
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

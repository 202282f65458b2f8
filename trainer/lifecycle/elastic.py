"""Elastic world size: ``--nnodes MIN:MAX`` (docs/long_runs.md, "Losing a node").

A job launched with a node range runs on whatever number of nodes the c10d rendezvous gathered
(at least MIN). When a node is lost, the survivors' elastic agent restarts them (under
``--max_restarts K``) with the smaller world, and every worker plans its layout for the world it
finds, as any run does: nothing is carried over from the bigger world but the checkpoint, which
resumes on another layout with the same data order (docs/checkpoints.md).

**The rule** (which degree absorbs a change of world): ``parallelism.data_parallel_shard_degree
= -1`` (the default), the degree inferred from the world size; every other degree is fixed, set
in the config as it is. So a node range needs:

* ``dp_shard = -1``: a fixed ``dp_shard`` makes the product of the degrees a fixed number of
  ranks, which only one node count can give;
* an explicit ``training.global_batch_size``: ``-1`` means local batch x batch degree, a global
  batch that shrinks with the world; with it set, a smaller world runs more micro-batches per
  rank (gradient accumulation grows) and the global batch, the learning-rate schedule and the
  data order stay the run's;
* a valid plan (degrees, batch, model vs layout) at every node count from MIN to MAX, each
  checked with the workers' own ``plan_job`` before any worker starts (a config wrong on
  every world gets its own error, as without a range; one wrong on some names the node count);
* a model that fits one device at every node count, by the layout planner's memory estimate
  (trainer/lifecycle/elastic_fit.py, the estimate handed in by train.py; on a host without an
  accelerator only when ``job.device_memory_gib`` states the device's memory).

:func:`check_node_range` is the launcher's check; :func:`share_no_store` the rendezvous setting
a node range needs on torch 2.13.
"""

from __future__ import annotations

import os

from trainer.config import ConfigError, JobConfig
from trainer.config.long_run_checks import check_node_range_config, nodes_text
from trainer.lifecycle.elastic_fit import MemoryEstimator, check_node_memory

__all__ = ["check_node_range", "node_worlds", "share_no_store"]


def node_worlds(min_nodes: int, max_nodes: int, nproc_per_node: int) -> list[tuple[int, int]]:
    """``(nodes, world size)`` for every node count the job may run on, smallest first."""
    return [(n, n * nproc_per_node) for n in range(min_nodes, max_nodes + 1)]


def check_node_range(
    cfg: JobConfig, min_nodes: int, max_nodes: int, nproc_per_node: int, plan, memory=None,
    estimator: MemoryEstimator | None = None,
) -> None:  # fmt: skip
    """Refuse, in one line (a :class:`ConfigError`), a job that cannot run on every node count
    of ``--nnodes MIN:MAX``; ``plan(cfg, world_size)`` is the workers' planner (raises the
    ValueError of the first world that has no valid plan; returns a ``JobPlan`` or a
    ``Startup``). ``memory``: one device's ``(bytes, name)``
    (:func:`trainer.lifecycle.elastic_fit.device_memory`; None: no limit), which ``estimator``'s
    figure per rank (:data:`~trainer.lifecycle.elastic_fit.MemoryEstimator`, train.py's: the
    planner's) at every node count must not exceed. Nothing to check for a fixed count."""
    if max_nodes <= min_nodes:
        return
    flag = f"--nnodes {min_nodes}:{max_nodes}"
    check_node_range_config(cfg, min_nodes, max_nodes, nproc_per_node)  # dp_shard = -1, a set global batch
    failed, planned = [], []
    for nodes, world in node_worlds(min_nodes, max_nodes, nproc_per_node):
        try:
            result = plan(cfg, world)
        except ValueError as exc:
            failed.append((nodes, world, exc))
        else:
            planned.append((nodes, world, getattr(result, "plan", result)))
    if len(failed) == max_nodes - min_nodes + 1:
        raise failed[0][2]  # wrong on every world: its own error, as without a range
    if failed:
        nodes, world, exc = failed[0]
        why = "; ".join(line.strip(" -") for line in str(exc).splitlines() if line.strip())
        who = "a lost node" if nodes < max_nodes else "the full job"
        raise ConfigError(
            f"{flag}: no valid layout on {nodes_text(nodes)} ({world} ranks), which {who} would run on: {why}"
        )
    check_node_memory(flag, planned, max_nodes, nproc_per_node, memory, estimator)  # the model fits every world


def share_no_store(min_nodes: int, max_nodes: int) -> None:
    """Under a node range, the agents do not share the rendezvous' TCPStore with the workers
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): the workers of each start host a store of their
    own (rank 0's, on a free port the rank-0 agent picks), as torchrun did before torch 2.4.

    Why: on torch 2.13 a node joining a running job deadlocks the next round with a shared
    store. The rank-0 agent reuses its first round's store address (``_bootstrap_store_info``
    is built once) while the joining agent waits for that round's ``MASTER_ADDR`` key, which
    nobody writes; the rank-0 agent waits for the joiner's ``role_info`` and both time out
    (seen with two launchers of ``--nnodes 1:2``: ``wait timeout after 60000ms, keys:
    /torch.rendezvous.ID.1/MASTER_ADDR``). A user's own setting is kept."""
    if max_nodes > min_nodes:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

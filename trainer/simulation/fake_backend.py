"""``[comm] mode = "fake_backend"``: one rank of any layout, measured on one device.

``python train.py --config X.toml --comm.mode fake_backend --comm.fake_world_size 64
--comm.fake_rank 17`` runs rank 17 of a 64-rank job in this one process: the default process
group is torch's ``fake`` backend with that rank and world size, so ``ParallelDims`` builds the
same meshes, the model is split and parallelized exactly as on the cluster, the data loader
reads that rank's slice of the global batch, and every tensor the rank holds has its real shape,
dtype and storage. Every collective returns at once without moving data (name taken from
torchtitan's ``comm.mode``; torchtitan reads the world size and rank from ``NGPU``/``RANK``, we
read them from the config).

What the fake collectives leave in their outputs (torch 2.13, ``FakeProcessGroup``):

* all-reduce, broadcast: the local input unchanged (the loss is this rank's partial sum, the
  gradient norm this rank's share);
* all-gather: the local input copied into every rank's slot; reduce-scatter: this rank's chunk
  of the input;
* all-to-all without split sizes: the input copied (given split sizes, torch fills every slot
  with the input's first chunk). EP's token-count exchange (a functional all-to-all with equal
  split sizes) takes the counts it sent as its result on this backend
  (``models/parallel/expert_parallel.py``), so each rank "receives" the counts it sends, and
  the uneven token all-to-all that follows receives exactly
  as many rows as it sends, filled from its own rows: **balanced routing**, each rank's experts
  process as many tokens as the rank routes, with the local routing's per-expert spread;
* send/recv: nothing is written to the receive buffer. Pipeline stages
  (``models/parallel/pipeline/schedule.py``) therefore answer torch's first-step warm-up vote
  themselves (their stage metadata is static; the vote's zero-filled receive would otherwise
  switch torch to exchanging shapes as objects and read garbage sizes) and zero their receive
  buffers once, so a stage computes on zero activations and gradients from its neighbours.

So shapes, memory and compute are those of the real rank (for MoE under the balanced-routing
assumption) and the values are not: **loss and gradient norm are meaningless**. The divergence
check (non-finite loss or norm stops the run) is off, the metrics record carries
``comm_mode = "fake_backend"``, and the loss-comparison tool refuses such records. Checkpoint
reading and writing are off (no weights worth keeping; DCP's cross-rank planning needs real
collectives), and the run writes to ``<job.dump_folder>/fake_backend/world<W>_rank<R>/`` so a
real run's folder is never touched.

Per step it reports this rank's compute time (the training step's wall time, synchronized on
GPU; with no-op collectives that is compute plus local overhead), the CPU time the process
spent in the step (all its threads; on a CPU host shared with other work this is the steadier
measure of the rank's compute) and peak memory (GPU: peak allocated bytes of the step; CPU:
peak resident set size of the process during the step), in the console, in ``metrics.jsonl``
(``fake_step_time_s``, ``fake_cpu_time_s``, ``fake_peak_memory_gib``, ``fake_memory_kind``) and in ``fake_backend_report.json`` with the rank's parameter, gradient
and optimizer-state bytes (the meter: ``trainer/instruments/fake_meter.py``).
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["FAKE_NOTE", "init_fake_process_group", "is_fake_backend", "prepare_fake_config"]

FAKE_NOTE = (
    "comm.mode = fake_backend: collectives are no-ops, so loss and grad_norm are meaningless and the "
    "divergence check is off; step time = this rank's compute time, peak memory = this rank's"
)


def init_fake_process_group(world_size: int, rank: int) -> None:
    """The default process group on torch's ``fake`` backend: this process is ``rank`` of
    ``world_size``."""
    from parallel_dims.process_groups import register_fake_backend

    register_fake_backend()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def is_fake_backend() -> bool:
    """Whether this process's default group is the fake backend (a fake-backend run)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def prepare_fake_config(cfg) -> list[str]:
    """Point the run at its own folder and turn off checkpoint I/O (in place); return the notes
    to log. Idempotent."""
    c = cfg.comm
    notes = [FAKE_NOTE]
    sub = os.path.join("fake_backend", f"world{c.fake_world_size}_rank{c.fake_rank}")
    if not os.path.normpath(cfg.job.dump_folder).endswith(os.path.normpath(sub)):
        cfg.job.dump_folder = os.path.join(cfg.job.dump_folder, sub)
    notes.append(f"comm.mode = fake_backend: this run writes to {cfg.job.dump_folder}")
    ck = cfg.checkpoint
    off = []
    if ck.enable:
        ck.enable = False
        off.append("checkpoint.enable")
    if ck.initial_load_path:
        ck.initial_load_path = ""
        off.append("checkpoint.initial_load_path")
    if ck.last_save_in_hf:
        ck.last_save_in_hf = False
        off.append("checkpoint.last_save_in_hf")
    if ck.save_in_hf_every:
        ck.save_in_hf_every = 0
        off.append("checkpoint.save_in_hf_every")
    if off:
        notes.append(
            f"comm.mode = fake_backend: checkpoint reading and writing are off ({', '.join(off)} ignored): "
            f"the run starts from the seed's initial weights and keeps nothing"
        )
    return notes

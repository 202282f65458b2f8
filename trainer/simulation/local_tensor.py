"""``[comm] mode = "local_tensor"``: every rank of a layout in ONE process, with real values.

``python train.py --config X.toml --comm.mode local_tensor --comm.fake_world_size 8
--parallelism.tp 2`` trains all 8 ranks of the job in this process (torchtitan's ``comm.mode``
name). The default process group is torch's ``fake`` backend of that world size, as for
``fake_backend``, but inside torch's ``LocalTensorMode`` (``torch.distributed._local_tensor``):
every tensor created while it is active is a ``LocalTensor`` that holds one tensor per simulated
rank, each op runs once per rank, and a collective does on those per-rank tensors what the real
collective would do across processes. So the loss, the gradient norm and every weight are the
real job's (for a layout whose reductions run in the same order, bitwise: tests/e2e/
test_local_tensor.py), in one debugger, without torchrun.

What is rank-dependent on the host is handled here, explicitly:

* **Mesh and plan**: built once, as rank 0 sees them (the fake group's rank), with the mode
  off (torch 2.15 answers ``dist.get_rank()`` per simulated rank inside it); torch patches
  ``DeviceMesh.get_coordinate`` / ``get_local_rank`` inside the mode so DTensor, FSDP2 and our
  parallel styles slice per simulated rank.
* **Initial weights**: each full parameter is drawn on the host with the mode off
  (``parallel_dims.torch_compat.host_side``; models/common/init.py) and then cut per rank by
  ``distribute_tensor`` under the mode. FSDP2 cuts every rank's shard as rank 0's (its shard
  index is the fake group's rank), so the per-rank write after sharding is what makes each
  rank's piece right. A seed checkpoint (``checkpoint.initial_load_path``) is read the same way:
  full tensors on the host, then cut (trainer/checkpoint/local_tensor.py
  :func:`~trainer.checkpoint.local_tensor.load_full_weights`).
* **Data**: :class:`PerRankLoader` reads every batch coordinate's slice of the global batch from
  the real loader and hands the step a LocalTensor of them.
* **Host reads**: the step's loss and gradient norm are reduced over every rank before they are
  read, so all ranks hold the same value and ``.tolist()`` returns it; rank 0's view
  (:func:`rank0_view`) is what start-up statistics print, as rank 0 of a real job would.
* **Logging**: this process is rank 0 of the fake group, so rank-0-only output prints once.
* **Checkpoints**: step checkpoints are written in full by this one process and read back in
  full (trainer/checkpoint/local_tensor.py), in the format real runs save and read, so a run
  resumes across the modes both ways.
* **Context parallelism**: the cp rank is one int per simulated rank; what depends on it (the
  batch's load-balanced chunks, RoPE positions, chunk masks, and the chunk attention, whose key
  prefixes and kernel differ per rank) runs once per simulated rank through
  ``parallel_dims.torch_compat.per_rank`` / ``per_rank_autograd``, so each rank runs its own
  kernels as in the real job.

Not simulated (refused with one line, exit 2, by the config check): pipeline parallelism (each
rank holds other stage modules, which one SPMD program cannot express) and ``torch.compile``.
Background checkpoint writes and the Hugging Face / consolidated exports are off with a start-up
note (:func:`prepare_local_tensor_config`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from parallel_dims.torch_compat import install_local_tensor_fsdp_storage, simulating_ranks

__all__ = [
    "LOCAL_TENSOR_NOTE",
    "PerRankLoader",
    "PlainTensorInLocalMode",
    "check_all_local",
    "enter_local_tensor_mode",
    "prepare_local_tensor_config",
    "rank0_view",
]

LOCAL_TENSOR_NOTE = (
    "comm.mode = local_tensor: all {w} ranks of the layout run in this one process (torch's "
    "LocalTensorMode): each op runs once per rank, collectives move the simulated ranks' real values"
)


class PlainTensorInLocalMode(RuntimeError):
    """A parameter, gradient or optimizer state is a plain tensor in local_tensor mode: it would
    hold one value for every rank and silently break the simulated update."""


def enter_local_tensor_mode(world_size: int):
    """The fake default group of ``world_size`` ranks (this process is rank 0) and torch's
    LocalTensorMode over all of them, entered for the rest of the process; returns the mode."""
    from torch.distributed._local_tensor import LocalTensorMode

    from trainer.simulation.fake_backend import init_fake_process_group

    init_fake_process_group(world_size, 0)
    install_local_tensor_fsdp_storage()
    simulating_ranks(start=True)
    mode = LocalTensorMode(world_size)
    mode.__enter__()
    return mode


def prepare_local_tensor_config(cfg) -> list[str]:
    """Turn off what a local_tensor run cannot do (in place): background checkpoint writes and
    the Hugging Face and consolidated exports; return the notes to log. Idempotent. Step
    checkpoints are saved and resumed (trainer/checkpoint/local_tensor.py); the run writes its
    metrics to job.dump_folder like a real run: its values are the real job's."""
    notes = [LOCAL_TENSOR_NOTE.format(w=cfg.comm.fake_world_size)]
    ck = cfg.checkpoint
    off = [
        key
        for key, on in (
            ("checkpoint.async_mode", ck.async_mode != "disabled"),
            ("checkpoint.last_save_in_hf", ck.last_save_in_hf),
            ("checkpoint.save_in_hf_every", bool(ck.save_in_hf_every)),
            ("checkpoint.last_save_model_only", ck.last_save_model_only),
        )
        if on
    ]
    ck.async_mode, ck.last_save_in_hf, ck.save_in_hf_every, ck.last_save_model_only = "disabled", False, 0, False
    if off:
        notes.append(
            f"comm.mode = local_tensor: {', '.join(off)} ignored: step checkpoints are written in full by "
            f"this one process, synchronously (the exports and the background writer plan across processes)"
        )
    return notes


def rank0_view(t: Any) -> Any:
    """Rank 0's tensor of a LocalTensor (what rank 0 of the real job would print); anything else
    unchanged."""
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[0] if isinstance(t, LocalTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def check_all_local(model_parts: list[nn.Module], optimizer=None) -> int:
    """Raise :class:`PlainTensorInLocalMode` naming the first parameter, gradient or optimizer
    state that is not a LocalTensor (or a DTensor over one); return how many were checked."""
    from torch.distributed._local_tensor import LocalTensor

    checked = 0

    def check(what: str, t: Any) -> None:
        nonlocal checked
        if not isinstance(t, torch.Tensor) or (t.dim() == 0 and not isinstance(t, (LocalTensor, DTensor))):
            return  # a scalar step count of the optimizer is the same on every rank
        if not isinstance(_local(t), LocalTensor):
            raise PlainTensorInLocalMode(
                f"comm.mode = local_tensor: {what} is a plain {type(_local(t)).__name__}, not a LocalTensor: it "
                f"was created outside the simulation (with LocalTensorMode off) and would apply one value "
                f"to every simulated rank; create it inside the mode"
            )
        checked += 1

    for i, part in enumerate(model_parts):
        for name, p in part.named_parameters():
            check(f"parameter {name} (part {i})", p)
            if p.grad is not None:
                check(f"the gradient of {name} (part {i})", p.grad)
    if optimizer is not None:
        names = {id(p): n for part in model_parts for n, p in part.named_parameters()}
        states = [opt.state for opt in getattr(optimizer, "optimizers", [optimizer])]
        for p, state in (item for s in states for item in s.items()):
            for key, value in state.items():
                check(f"optimizer state {key!r} of {names.get(id(p), '?')}", value)
    return checked


class PerRankLoader:
    """The loader interface of :class:`~trainer.data.batching.PackedDataLoader` over every
    simulated rank: one real loader per batch coordinate (ranks that share one, e.g. TP peers,
    read the same slice), and each micro-batch a LocalTensor holding every rank's slice."""

    def __init__(self, build, parallel_dims, world_size: int):
        self.coordinate = {r: parallel_dims.coordinate("batch", r) for r in range(world_size)}
        self.loaders = {c: build(c) for c in sorted(set(self.coordinate.values()))}
        self.first = self.loaders[min(self.loaders)]

    def __getattr__(self, name: str) -> Any:  # grad_accum_steps, tokens_per_step, ...
        if name in ("first", "loaders", "coordinate"):
            raise AttributeError(name)
        return getattr(self.first, name)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from torch.distributed._local_tensor import LocalTensor

        steps = {c: loader.next_step() for c, loader in self.loaders.items()}
        return [
            tuple(LocalTensor({r: steps[c][i][j] for r, c in self.coordinate.items()}) for j in range(2))
            for i in range(len(steps[self.first.batch_rank]))
        ]

    @property
    def step_sources(self):
        """Each simulated rank's ``step_sources`` of the last step, as one LocalTensor (None: one source)."""
        from torch.distributed._local_tensor import LocalTensor

        if self.first.step_sources is None:
            return None
        return LocalTensor({r: self.loaders[c].step_sources for r, c in self.coordinate.items()})

    def state_dict(self) -> dict[str, Any]:
        from trainer.data.striped import merge_states

        states = [loader.state_dict() for loader in self.loaders.values()]
        if "slot_range" in states[0]:  # rows read in stripes: each loader knows its own
            return merge_states(states)
        return states[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for loader in self.loaders.values():
            loader.load_state_dict(state)

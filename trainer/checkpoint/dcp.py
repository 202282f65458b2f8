"""Crash-safe, layout-independent checkpoints with torch.distributed.checkpoint (DCP).

Layout on disk::

    <folder>/step-N/        complete checkpoint (has DCP's .metadata)
    <folder>/step-N.tmp/    a save in progress, or one that crashed (ignored, purged later)

A save writes ``step-N.tmp`` and, after every rank finished writing, rank 0 renames it
to ``step-N``; a crash at any point therefore leaves the previous ``step-N`` as the latest
complete checkpoint, never a half-written one under a final name.

State dict (flattened by DCP into keys like ``model.layers.0.attention.wq.weight``):

    model      FQN -> tensor/DTensor, plain FQNs (no FSDP/compile/AC wrapper prefixes),
               sharded; DCP reshards on load, so a checkpoint saved with one parallel
               layout loads into another (FSDP/TP/PP/EP degree changes).
    optimizer  flat FQN-keyed AdamW state (``state.<fqn>.exp_avg`` ...), reshardable too.
    train_state  one blob written by rank 0 only: ``extra`` (step, ...), lr-scheduler
               position, data-loader position (layout-independent by design) and rank 0's
               RNG states. Per-rank RNG cannot be resharded when the world size changes,
               so only rank 0's is kept and every rank restores it on load; the trainer's
               per-rank seeding (if any) must not rely on RNG continuity across resumes.

All ranks must call save/load (they are collective). The folder must be on a file system
shared by all ranks. When to save, what to resume from and the final exports are the trainer's
policy: :class:`trainer.checkpoint.manager.CheckpointManager`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from trainer.checkpoint.async_save import DrillWriter
from trainer.checkpoint.drill import drill_point
from trainer.checkpoint.errors import CheckpointError, read_failure
from trainer.checkpoint.folders import publish_folder
from trainer.checkpoint.state import (
    barrier,
    checkpoint_keys,
    checkpoint_state_dict,
    distributed,
    from_blob,
    is_complete,
    load_model_parts,
    rank,
    rng_state,
    run_dcp,
    set_rng_state,
    stored_optimizer_keys,
    to_blob,
)
from trainer.data.striped import complete_state

__all__ = ["EXCLUDABLE", "CheckpointFolder", "load_checkpoint", "save_seed_checkpoint"]

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_STALE_RE = re.compile(r"^step-\d+\.(tmp|old)$")
EXCLUDABLE = ("optimizer", "lr_scheduler", "dataloader", "rng")


def load_checkpoint(
    path: str,
    model_parts: Sequence[nn.Module],
    optimizer=None,
    lr_scheduler=None,
    dataloader=None,
    *,
    exclude: Iterable[str] = (),
    process_group=None,
    select: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Restore whatever ``path`` holds into the given objects (None = not restored) and
    return the saved ``extra`` dict (empty for model-only checkpoints such as seeds).
    ``select``: only the model keys it accepts are restored (a LoRA run: its adapters from a
    step checkpoint, its base from ``initial_load_path``)."""
    exclude = set(exclude)
    unknown = exclude - set(EXCLUDABLE)
    if unknown:
        raise ValueError(f"cannot exclude {sorted(unknown)} from loading; choose from {EXCLUDABLE}")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata)")
    try:
        stored = checkpoint_keys(path)
    except Exception as exc:
        reason = read_failure(exc, ".metadata")
        if reason is None:
            raise
        raise CheckpointError(f"checkpoint {path} is unreadable ({reason})") from exc

    model_sd = checkpoint_state_dict(model_parts, select)
    missing = [k for k in model_sd if f"model.{k}" not in stored]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} model weights, e.g. {missing[:3]}; it was saved "
            f"from a different model/flavor (stored model keys look like "
            f"{sorted(k for k in stored if k.startswith('model.'))[:3]})"
        )
    state: dict[str, Any] = {"model": model_sd}
    has_optimizer = any(k.startswith("optimizer.") for k in stored)
    load_optimizer = optimizer is not None and has_optimizer and "optimizer" not in exclude
    if load_optimizer:
        state["optimizer"] = stored_optimizer_keys(optimizer.state_dict(), stored)  # also materialises empty state
    if "train_state" in stored:
        state["train_state"] = b""
    try:
        run_dcp(dcp.load, state, checkpoint_id=path, process_group=process_group)
    except BaseException as exc:  # CheckpointException is a BaseException
        reason = read_failure(exc, "shard file")
        if reason is None:
            raise
        raise CheckpointError(f"checkpoint {path} is unreadable ({reason})") from exc

    load_model_parts(model_parts, state["model"], select)
    if load_optimizer:
        optimizer.load_state_dict(state["optimizer"])
    elif optimizer is not None and "optimizer" not in exclude:
        logger.warning("checkpoint %s has no optimizer state; optimizer starts fresh", path)
    if "train_state" not in state:
        return {}
    train_state = from_blob(state["train_state"])
    if lr_scheduler is not None and "lr_scheduler" not in exclude and train_state.get("lr_scheduler"):
        lr_scheduler.load_state_dict(train_state["lr_scheduler"])
    if dataloader is not None and "dataloader" not in exclude and train_state.get("dataloader"):
        dataloader.load_state_dict(train_state["dataloader"])
    if "rng" not in exclude and train_state.get("rng"):
        set_rng_state(train_state["rng"])
    return dict(train_state.get("extra") or {})


def train_state_blob(
    step: int, lr_scheduler=None, data_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
) -> bytes:
    """The ``train_state`` entry of a step-N checkpoint: step and extra, the lr schedule, the
    data position (``data_state``: the loader's whole position, :func:`data_position`) and the
    RNG state (rank 0's; the same on every rank)."""
    return to_blob(
        {
            "extra": {"step": step, **(extra or {})},
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "dataloader": data_state,
            "rng": rng_state(),
        }
    )


def data_position(dataloader, process_group=None) -> dict[str, Any] | None:
    """The loader's position as a checkpoint holds it; collective (every rank calls it): a
    loader reading rows in stripes knows only its own stripes' positions, merged here over the
    ranks (trainer/data/striped.py)."""
    if dataloader is None:
        return None
    return complete_state(dataloader.state_dict(), process_group)


class CheckpointFolder:
    """A run's checkpoint folder: saves to ``<folder>/step-N``, retention of the newest K
    (``keep_latest_k``, 0 keeps all), and loading a step back."""

    def __init__(self, folder: str, keep_latest_k: int = 0, *, process_group=None):
        if keep_latest_k < 0:
            raise ValueError(f"keep_latest_k must be >= 0 (0 keeps all); got {keep_latest_k}")
        self.folder, self.keep_latest_k = folder, keep_latest_k
        self.process_group = process_group
        # the model keys a step checkpoint holds (None: all; a LoRA run: its adapters)
        self.select: Callable[[str], bool] | None = None

    def step_dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def list_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        if not os.path.isdir(self.folder):
            return []
        try:
            names = os.listdir(self.folder)
        except PermissionError:
            raise CheckpointError(
                f"checkpoint folder {self.folder} is not readable (permission denied): fix its "
                f"permissions, or set job.dump_folder (or checkpoint.folder) to another folder"
            ) from None
        steps = []
        for name in names:
            m = _STEP_RE.match(name)
            if m and is_complete(os.path.join(self.folder, name)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.list_steps()
        return steps[-1] if steps else None

    def state(
        self,
        step: int,
        model_parts: Sequence[nn.Module],
        optimizer=None,
        lr_scheduler=None,
        dataloader=None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """What a resumable step-N checkpoint holds (the live, sharded objects: a synchronous
        save writes them, an asynchronous one copies them first)."""
        state: dict[str, Any] = {"model": checkpoint_state_dict(model_parts, self.select)}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        data_state = data_position(dataloader, self.process_group)  # collective
        if rank(self.process_group) == 0:  # identical on all ranks, or rank 0's by definition
            state["train_state"] = train_state_blob(step, lr_scheduler, data_state, extra)
        return state

    def save(
        self,
        step: int,
        model_parts: Sequence[nn.Module],
        optimizer=None,
        lr_scheduler=None,
        dataloader=None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        return self.save_state(step, self.state(step, model_parts, optimizer, lr_scheduler, dataloader, extra))

    def save_state(self, step: int, state: dict[str, Any]) -> str:
        """Write an arbitrary DCP state dict as step-N with the tmp-then-rename protocol."""
        pg = self.process_group
        tmp = self.begin(step)
        writer = DrillWriter(tmp, step=step, rank=rank(pg))
        run_dcp(dcp.save, state, checkpoint_id=tmp, storage_writer=writer, process_group=pg)
        return self.publish(step)

    def begin(self, step: int) -> str:
        """Collective: an empty ``step-N.tmp`` exists for every rank to write into; returns it."""
        pg = self.process_group
        tmp = self.step_dir(step) + ".tmp"
        if rank(pg) == 0:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # left over from a crashed save of this step
            os.makedirs(tmp)
        barrier(pg)
        return tmp

    def publish(self, step: int) -> str:
        """Collective, once every rank's write of ``step-N.tmp`` returned (DCP returns on every
        rank only after all shards and the ``.metadata`` are written): rank 0 renames it to
        ``step-N`` and purges what ``keep_latest_k`` no longer keeps."""
        pg = self.process_group
        final = self.step_dir(step)
        barrier(pg)  # every rank's shards are on disk before the rename publishes them
        if rank(pg) == 0:
            drill_point("publish", step, 0)
            publish_folder(final + ".tmp", final)  # re-saving a step keeps the old one until the new one is in place
            self._purge()
        barrier(pg)
        logger.info("saved checkpoint %s", final)
        return final

    def _purge(self) -> None:
        for name in os.listdir(self.folder):
            if _STALE_RE.match(name):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in self.list_steps()[: -self.keep_latest_k]:
                # renamed first: a purge cut short leaves a stale ``.old`` folder, never a
                # half-deleted one under a complete checkpoint's name
                doomed = self.step_dir(step) + ".old"
                os.replace(self.step_dir(step), doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def load(
        self,
        model_parts: Sequence[nn.Module],
        optimizer=None,
        lr_scheduler=None,
        dataloader=None,
        *,
        step: int = -1,
        exclude: Iterable[str] = (),
    ) -> dict[str, Any] | None:
        """Resume from ``step`` (-1 = latest). Returns the saved extra dict (always with
        'step'), or None when step=-1 and the folder has no complete checkpoint."""
        steps = self.list_steps()
        if step == -1:
            if not steps:
                return None
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.folder}; available steps: "
                f"{steps or 'none'} (set checkpoint.load_step = -1 for the latest)"
            )
        try:
            extra = self.read(self.step_dir(step), model_parts, optimizer, lr_scheduler, dataloader, exclude=exclude)
        except CheckpointError as exc:
            others = [s for s in steps if s != step]
            fix = (
                f"delete it, or set checkpoint.load_step to one of {', '.join(map(str, others))}"
                if others
                else "delete it (or the whole folder) to start from scratch"
            )
            raise CheckpointError(f"{exc}: {fix}") from exc.__cause__
        extra.setdefault("step", step)
        logger.info("loaded checkpoint %s", self.step_dir(step))
        return extra

    def read(self, path: str, model_parts, optimizer, lr_scheduler, dataloader, *, exclude: Iterable[str]) -> dict:
        """Restore the checkpoint folder ``path`` (:func:`load_checkpoint` over this folder's
        process group); the saved extra dict."""
        return load_checkpoint(
            path,
            model_parts,
            optimizer,
            lr_scheduler,
            dataloader,
            exclude=exclude,
            process_group=self.process_group,
            select=self.select,
        )


def save_seed_checkpoint(model: nn.Module, folder: str) -> str:
    """Write the freshly initialised model as ``<folder>/step-0`` (model only), from a
    single process, so that every later layout starts from identical weights."""
    if distributed() and dist.get_world_size() > 1:
        raise RuntimeError(
            "create the seed checkpoint with one process (e.g. torchrun --nproc_per_node=1 ... "
            "--checkpoint.create_seed_checkpoint --parallelism.dp_shard 1)"
        )
    return CheckpointFolder(folder).save_state(0, {"model": checkpoint_state_dict([model])})

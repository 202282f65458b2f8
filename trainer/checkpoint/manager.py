"""The trainer's checkpoint policy, in one place (config section ``[checkpoint]``).

* before anything is built, :func:`check_initial_load` checks a Hugging Face folder to start
  from (``initial_load_path`` with ``initial_load_in_hf``): config.json against the flavor and
  overrides, every tensor's shape from the headers;
* :meth:`CheckpointManager.resume`: the run's own latest (or ``load_step``) checkpoint, else
  the initial weights (a Hugging Face folder, or a DCP folder, model only or the whole train
  state);
* :meth:`CheckpointManager.maybe_save` after each step: a resumable ``step-N`` every
  ``interval`` steps and at the last step, where ``last_save_model_only`` makes it a
  consolidated ``model-step-N.pt`` instead and ``last_save_in_hf`` adds ``step-N-hf``.

Every rank calls ``resume`` and ``maybe_save`` (they are collective).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from models import registry
from trainer.checkpoint.dcp import CheckpointFolder, load_checkpoint
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.export import export_consolidated
from trainer.checkpoint.hf_load import load_hf_into_model
from trainer.checkpoint.hf_reader import HFCheckpoint, validate_hf_checkpoint
from trainer.checkpoint.hf_write import export_dcp_to_hf
from trainer.checkpoint.state import model_state_dict

__all__ = ["CheckpointManager", "check_initial_load"]

logger = logging.getLogger(__name__)

_HF_INITIAL = "checkpoint.initial_load_path (initial_load_in_hf = true)"


def _hf_context(cfg) -> str:
    return f"model {cfg.model.name}/{cfg.model.flavor} (with this run's overrides)"


def check_initial_load(cfg, model_args) -> HFCheckpoint | None:
    """The checked Hugging Face folder the run will start from, or None (no such folder is
    configured, or the run resumes from its own checkpoint and does not use it). Headers and
    config.json only: call it before the model is built, so a wrong folder fails in seconds."""
    c = cfg.checkpoint
    if not (c.initial_load_in_hf and c.initial_load_path):
        return None
    if c.enable and CheckpointFolder(cfg.resolve_path(c.folder)).list_steps():
        return None  # the run resumes from its own checkpoint; initial_load_path is unused
    adapter = registry.get_hf_adapter(cfg.model.name, model_args)
    try:
        return validate_hf_checkpoint(c.initial_load_path, adapter, _hf_context(cfg))
    except CheckpointError as exc:
        raise CheckpointError(f"{_HF_INITIAL}: {exc}") from None


class CheckpointManager:
    """Resume, periodic saves and the final exports of one run.

    ``cfg`` is the job config (reads ``checkpoint``, ``model.name`` / ``model.flavor`` and
    ``resolve_path``); ``model_parts``, ``optimizer``, ``lr_scheduler`` and ``dataloader`` (any
    object with ``state_dict`` / ``load_state_dict``) are what a checkpoint saves and restores;
    ``model_args`` the built model's args (the Hugging Face adapter's shapes); ``initial_hf``
    what :func:`check_initial_load` returned; ``log`` prints a line for the user (rank 0)."""

    def __init__(
        self,
        cfg,
        *,
        model_parts: Sequence[nn.Module],
        optimizer,
        lr_scheduler,
        dataloader,
        model_args,
        initial_hf: HFCheckpoint | None = None,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.config = cfg.checkpoint
        self.model_parts = list(model_parts)
        self.optimizer, self.lr_scheduler, self.dataloader = optimizer, lr_scheduler, dataloader
        self.model_args = model_args
        self.initial_hf = initial_hf
        self.log = log
        self.folder = cfg.resolve_path(self.config.folder)
        self.steps = CheckpointFolder(self.folder, self.config.keep_latest_k)

    # ---------------------------------------------------------------- resume
    def resume(self) -> int | None:
        """Restore the run's own checkpoint or the initial weights; returns the step the run
        continues after, or None when no step was restored (the run starts at its step)."""
        c = self.config
        extra = None
        if c.enable:
            extra = self.steps.load(
                self.model_parts,
                self.optimizer,
                self.lr_scheduler,
                self.dataloader,
                step=c.load_step,
                exclude=c.exclude_from_loading,
            )
        if extra:
            step = int(extra["step"])
            self.log(f"resumed from {self.folder} at step {step}")
            return step
        if c.initial_load_path and c.initial_load_in_hf:
            self._load_initial_hf(c.initial_load_path)
        elif c.initial_load_path:
            return self._load_initial_dcp(c.initial_load_path)
        return None

    def _load_initial_hf(self, path: str) -> None:
        try:
            stats = load_hf_into_model(
                self.model_parts,
                path,
                self.cfg.model.name,
                self.model_args,
                context=_hf_context(self.cfg),
                checkpoint=self.initial_hf,
            )
        except CheckpointError as exc:
            raise CheckpointError(f"{_HF_INITIAL}: {exc}") from None
        self.log(
            f"loaded initial weights from Hugging Face folder {path} ({stats.tensors} tensors; rank 0 read "
            f"{stats.elements_read:,} elements for its {stats.local_elements:,})"
        )

    def _load_initial_dcp(self, path: str) -> int | None:
        step = None
        try:
            if self.config.initial_load_model_only:
                load_checkpoint(path, self.model_parts)
            else:
                extra = load_checkpoint(path, self.model_parts, self.optimizer, self.lr_scheduler, self.dataloader)
                step = int(extra.get("step", 0))
        except CheckpointError as exc:
            hf = os.path.isfile(os.path.join(path, "config.json"))
            raise CheckpointError(
                f"checkpoint.initial_load_path: {exc}; point it at a complete checkpoint "
                f"folder (a step-N folder with a .metadata file), or unset it"
                + ("; it looks like a Hugging Face folder: set checkpoint.initial_load_in_hf = true" if hf else "")
            ) from exc.__cause__
        self.log(f"loaded initial weights from {path}")
        return step

    # ---------------------------------------------------------------- saving
    def should_save(self, step: int, last: bool = False) -> bool:
        """A step-N checkpoint is due (``checkpoint.enable``, every ``interval`` steps and the last)."""
        return self.config.enable and (last or step % self.config.interval == 0)

    def maybe_save(
        self,
        step: int,
        *,
        last: bool,
        phase: Callable[[str], AbstractContextManager[Any]] = lambda _what: nullcontext(),
    ) -> None:
        """After ``step``: the checkpoint save when one is due, and at the ``last`` step the
        Hugging Face export (``last_save_in_hf``). Each runs inside ``phase(description)``
        (the trainer's watchdog phase and timer reset)."""
        saved = None
        if self.should_save(step, last):
            with phase(f"checkpoint save at step {step}"):
                saved = self._save(step, last)
        if last and self.config.last_save_in_hf:
            with phase(f"Hugging Face export at step {step}"):
                self._save_hf(step, saved)

    def _save(self, step: int, last: bool) -> str | None:
        """Returns the resumable step-N folder written, or None for a consolidated export."""
        c = self.config
        if last and c.last_save_model_only and c.last_save_in_hf:
            return None  # the Hugging Face folder replaces the consolidated export
        if last and c.last_save_model_only:
            path = os.path.join(self.folder, f"model-step-{step}.pt")
            export_consolidated(self.model_parts, path, c.export_dtype)
            self.log(f"exported consolidated weights to {path}")
            return None
        path = self.steps.save(
            step, self.model_parts, self.optimizer, self.lr_scheduler, self.dataloader, extra={"step": step}
        )
        self.log(f"saved checkpoint {path}")
        return path

    def _save_hf(self, step: int, dcp_step_dir: str | None) -> str:
        """The final weights as a Hugging Face folder ``<checkpoint.folder>/step-N-hf``,
        converted from the step-N checkpoint just written or, without one, from a temporary
        DCP save (every rank writes its shards; the conversion is spread over the ranks)."""
        c = self.config
        out = os.path.join(self.folder, f"step-{step}-hf")
        tmp_dcp = None
        if dcp_step_dir is None:
            tmp_dcp = self.steps.step_dir(step) + "-hf.dcp.tmp"
            if dist.get_rank() == 0:
                os.makedirs(self.folder, exist_ok=True)
                if os.path.exists(tmp_dcp):
                    shutil.rmtree(tmp_dcp)
            dist.barrier()
            dcp.save({"model": model_state_dict(self.model_parts)}, checkpoint_id=tmp_dcp)
            dist.barrier()
            dcp_step_dir = tmp_dcp
        export_dcp_to_hf(
            dcp_step_dir,
            out,
            self.cfg.model.name,
            self.model_args,
            dtype=c.export_dtype,
            progress=lambda msg: logger.info("hf export: %s", msg),
        )
        if tmp_dcp is not None and dist.get_rank() == 0:
            shutil.rmtree(tmp_dcp, ignore_errors=True)
        self.log(f"wrote Hugging Face folder {out} ({c.export_dtype})")
        return out

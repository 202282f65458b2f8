"""The trainer's checkpoint policy, in one place (config section ``[checkpoint]``).

* before anything is built, :func:`check_initial_load` checks a Hugging Face folder to start
  from (``initial_load_path`` with ``initial_load_in_hf``): config.json against the flavor and
  overrides, every tensor's shape from the headers;
* :meth:`CheckpointManager.resume`: the run's own latest (or ``load_step``) checkpoint, else
  the initial weights (a Hugging Face folder, or a DCP folder, model only or the whole train
  state);
* :meth:`CheckpointManager.after_step` after each step: notices a background save that
  finished (publishes it) or failed (stops the run); a resumable ``step-N`` every ``interval``
  steps and at the last step (written in the background with ``async_mode``, see
  trainer/checkpoint/async_save.py), where ``last_save_model_only`` makes it a consolidated
  ``model-step-N.pt`` instead; a Hugging Face ``step-N-hf`` at the last step
  (``last_save_in_hf``) and every ``save_in_hf_every`` steps, written from the live model;
* :meth:`CheckpointManager.close` at the end: waits for the save in flight.

Every rank calls ``resume``, ``after_step`` and ``close`` (they are collective).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn

from models import registry
from models.parallel.lora import LORA_CONVERTERS, LoRAOptions, is_adapter_key
from trainer.checkpoint.async_save import DISABLED, BackgroundSaver, CheckpointWriteFailed, SaveDone, failure_line
from trainer.checkpoint.dcp import CheckpointFolder, load_checkpoint
from trainer.checkpoint.drill import drill_point
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.export import export_consolidated
from trainer.checkpoint.hf_extras import peft_base_name, record_for_run
from trainer.checkpoint.hf_live import export_model_to_hf
from trainer.checkpoint.hf_load import load_hf_into_model
from trainer.checkpoint.hf_reader import HFCheckpoint, validate_hf_checkpoint
from trainer.checkpoint.lora_base import base_identity
from trainer.checkpoint.state import rank

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
    lora = any(name in LORA_CONVERTERS for name in cfg.model.converters)
    if c.enable and not lora and CheckpointFolder(cfg.resolve_path(c.folder)).list_steps():
        return None  # the run resumes from its own checkpoint; initial_load_path is unused (LoRA: the base)
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
        folder_cls: type[CheckpointFolder] = CheckpointFolder,
        lora: LoRAOptions | None = None,
    ):
        self.cfg = cfg
        self.config = cfg.checkpoint
        self.model_parts = list(model_parts)
        self.optimizer, self.lr_scheduler, self.dataloader = optimizer, lr_scheduler, dataloader
        self.model_args = model_args
        self.initial_hf = initial_hf
        # what the exports are written from (source folder's config.json and generation_config.json,
        # the tokenizer), also stored in every step checkpoint for scripts/convert_hf.py
        self.record = record_for_run(cfg, model_args)
        self.log = log
        self.folder = cfg.resolve_path(self.config.folder)
        # the run's step-N folders (local_tensor mode: trainer/checkpoint/local_tensor.py)
        self.steps = folder_cls(self.folder, self.config.keep_latest_k)
        # LoRA (models/parallel/lora.py): step checkpoints hold the adapters (and their optimizer
        # state) and the base's identity; the base always comes from initial_load_path
        self.lora = lora
        self.base = None
        if lora is not None:
            self.steps.select = is_adapter_key
            self.base = base_identity(cfg)
        # asynchronous saves: built by every rank (it creates process groups)
        self.saver: BackgroundSaver | None = None
        if self.config.enable and self.config.async_mode != DISABLED:
            self.saver = BackgroundSaver(self.config.async_mode, timeout_s=cfg.comm.init_timeout_seconds)

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
            if self.lora is not None:
                self._check_base(extra, step)
                self._load_base()
            self.log(f"resumed from {self.folder} at step {step}")
            return step
        if self.lora is not None:
            self._load_base()
            return None
        if c.initial_load_path and c.initial_load_in_hf:
            self._load_initial_hf(c.initial_load_path)
        elif c.initial_load_path:
            return self._load_initial_dcp(c.initial_load_path)
        return None

    def _check_base(self, extra: dict, step: int) -> None:
        """A LoRA resume: the step checkpoint's adapters were trained on this run's base."""
        stored = extra.get("lora_base")
        path = self.steps.step_dir(step)
        if stored is None:
            raise CheckpointError(
                f"{path} holds no LoRA base identity (saved by a run without model.converters = ['lora']): "
                "start the LoRA run in another job.dump_folder"
            )
        if stored["fingerprint"] != self.base["fingerprint"]:
            was = f"{stored['path'] or 'the seeded init'} (fingerprint {stored['fingerprint'][:12]})"
            raise CheckpointError(
                f"{path} holds LoRA adapters trained on the base {was}, but this run's base is {self.base.line()}: "
                "set checkpoint.initial_load_path to the base they were trained on, or start over in another "
                "job.dump_folder"
            )

    def _load_base(self) -> None:
        """A LoRA run's frozen base: initial_load_path (a Hugging Face or DCP folder, weights
        only), or the seeded init already in place."""
        c = self.config
        if not c.initial_load_path:
            return
        if c.initial_load_in_hf:
            self._load_initial_hf(c.initial_load_path)
            return
        try:
            load_checkpoint(c.initial_load_path, self.model_parts, select=lambda k: not is_adapter_key(k))
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint.initial_load_path (the LoRA base): {exc}") from exc.__cause__
        self.log(f"loaded the LoRA base from {c.initial_load_path}")

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

    def should_export_hf(self, step: int, last: bool = False) -> bool:
        """A Hugging Face folder is due: ``last_save_in_hf`` at the last step (and at a step the
        run stops at, SIGINT/SIGTERM: ``last`` then), and every ``save_in_hf_every`` steps."""
        every = self.config.save_in_hf_every
        return (last and self.config.last_save_in_hf) or (every > 0 and step % every == 0)

    def after_step(
        self,
        step: int,
        *,
        last: bool,
        phase: Callable[[str], AbstractContextManager[Any]] = lambda _what: nullcontext(),
        stopping: bool = False,
    ) -> dict[str, float]:
        """Everything checkpointing does after ``step`` (collective): notice a background save
        that finished (publish it) or failed (:class:`CheckpointWriteFailed`, exit 1); the save
        when one is due (``stopping``: the run stops after this step, a save is due whenever
        checkpointing is on; trainer/runtime/stop.py); the Hugging Face export when one is due. Each save or export runs
        inside ``phase(description)`` (the trainer's watchdog phase, left out of the step
        time). Returns the metrics of what happened at this step (empty when nothing did):
        ``checkpoint_stall_s`` (seconds this save held training when it started: for a
        background save the copy and the launch, otherwise the whole save),
        ``checkpoint_write_s`` (seconds from the start of a save to its last byte; for a
        background save, reported at the step it was noticed finished),
        ``checkpoint_poll_stall_s`` (seconds a background save held training after it started:
        completion checks, the publish, and any wait for it by the next save or the end of
        training), ``hf_export_s``. Each second is counted once: stall + poll stall of a save is
        all the time it held training."""
        out: dict[str, float] = {}
        if self.saver is not None and self.saver.in_flight is not None:
            out.update(self._finish(self.saver.poll()))
        if self.should_save(step, last) or (stopping and self.config.enable):
            drill_point("begin", step, rank())  # tests only (trainer/checkpoint/drill.py)
            with phase(f"checkpoint save at step {step}"):
                if self.saver is not None and self.saver.in_flight is not None:
                    # at most one in flight: the wait is the previous save's (its poll stall)
                    out.update(self._finish(self.saver.poll(block=True)))
                t0 = time.monotonic()
                background = self._save(step, last)
                out["checkpoint_stall_s"] = time.monotonic() - t0
                if not background:
                    out["checkpoint_write_s"] = out["checkpoint_stall_s"]
        if self.should_export_hf(step, last or stopping):
            with phase(f"Hugging Face export at step {step}"):
                t0 = time.monotonic()
                self._save_hf(step)
                out["hf_export_s"] = time.monotonic() - t0
        return out

    def maybe_save(
        self,
        step: int,
        *,
        last: bool,
        phase: Callable[[str], AbstractContextManager[Any]] = lambda _what: nullcontext(),
    ) -> dict[str, float]:
        """:meth:`after_step`, and at the ``last`` step also :meth:`close` (waits for the save)."""
        out = self.after_step(step, last=last, phase=phase)
        if last:
            out.update(self.close(phase=phase))
        return out

    def wait_for_staging(self) -> None:
        """Before the optimizer changes the weights: the in-flight save's copy of them is
        complete (only ``async_with_pinned_mem`` copies in the background)."""
        if self.saver is not None:
            self.saver.wait_for_staging()

    def close(
        self, *, phase: Callable[[str], AbstractContextManager[Any]] = lambda _what: nullcontext()
    ) -> dict[str, float]:
        """The end of training (collective): wait for the save in flight, publish it, release
        the staging buffers. Returns its metrics (empty when nothing was in flight)."""
        out: dict[str, float] = {}
        if self.saver is None:
            return out
        if self.saver.in_flight is not None:
            with phase(f"waiting for the checkpoint of step {self.saver.in_flight}"):
                out = self._finish(self.saver.poll(block=True))
        self.saver.close()
        return out

    def _finish(self, done: SaveDone | None) -> dict[str, float]:
        """Publish a background save every rank finished; its metrics."""
        if done is None:
            return {}
        t0 = time.monotonic()
        path = self.steps.publish(done.step)
        stall = done.poll_stall_s + time.monotonic() - t0
        self.log(f"saved checkpoint {path} (written in the background in {done.write_s:.2f}s)")
        return {"checkpoint_write_s": done.write_s, "checkpoint_poll_stall_s": stall}

    def _save(self, step: int, last: bool) -> bool:
        """The save due at ``step``; True when it goes on in the background."""
        c = self.config
        if last and c.last_save_model_only and c.last_save_in_hf:
            return False  # the Hugging Face folder replaces the consolidated export
        if last and c.last_save_model_only:
            path = os.path.join(self.folder, f"model-step-{step}.pt")
            export_consolidated(self.model_parts, path, c.export_dtype)
            self.log(f"exported consolidated weights to {path}")
            return False
        extra = {"step": step, "model": self.record.to_dict()}
        if self.lora is not None:  # what scripts/convert_hf.py lora-peft / lora-merge read back
            extra["lora_base"] = dict(self.base)
            extra["lora"] = dataclasses.asdict(self.lora)
        state = self.steps.state(
            step, self.model_parts, self.optimizer, self.lr_scheduler, self.dataloader, extra=extra
        )
        if self.saver is not None:
            tmp = self.steps.begin(step)
            self.saver.start(step, state, tmp)
            self.log(f"checkpoint of step {step}: writing {tmp} in the background ({c.async_mode})")
            return True
        try:
            path = self.steps.save_state(step, state)
        except BaseException as exc:  # DCP raises a CheckpointException (a BaseException) on every rank
            line = failure_line(exc, step)
            if line is None:
                raise
            raise CheckpointWriteFailed(line) from exc
        self.log(f"saved checkpoint {path}")
        return False

    def reload_newest(self) -> int | None:
        """Load the newest complete checkpoint of this run whole (a rollback:
        trainer/bad_steps.py; collective): a background save in flight is finished and published
        first. Returns its step, or None when the run has none."""
        if self.saver is not None and self.saver.in_flight is not None:
            self._finish(self.saver.poll(block=True))
        if not self.config.enable or self.steps.latest_step() is None:
            return None
        extra = self.steps.load(
            self.model_parts, self.optimizer, self.lr_scheduler, self.dataloader, step=-1, exclude=[]
        )
        return int(extra["step"])

    def newest(self) -> str:
        """The newest complete checkpoint, in words (``step-N in FOLDER``, or that there is none)."""
        step = self.steps.latest_step() if self.config.enable else None
        return f"step-{step} in {self.folder}" if step is not None else "none"

    def stopped_message(self, exc: CheckpointWriteFailed) -> str:
        """The one line printed when a save failed: what failed and what is still on disk."""
        newest = self.steps.latest_step()
        kept = (
            f"its newest complete checkpoint, step-{newest}, is intact"
            if newest is not None
            else "it has no complete checkpoint"
        )
        return (
            f"{exc}; training stopped. {self.folder}: {kept}. Fix the folder (free space, permissions) "
            f"and run the same command again to resume"
        )

    def export_missing(self, step: int) -> str | None:
        """A finished run started again with ``last_save_in_hf``: write ``step-N-hf`` (and the
        PEFT folder of a LoRA run) from the resumed weights when it is not there yet (collective).
        Returns its path, or None when nothing was due."""
        out = os.path.join(self.folder, f"step-{step}-hf")
        if not self.config.last_save_in_hf or os.path.isdir(out):
            return None
        return self._save_hf(step)

    def _save_hf(self, step: int) -> str:
        """The weights as a Hugging Face folder ``<checkpoint.folder>/step-N-hf``, written from
        the live sharded model (every rank writes the files it is given; no temporary DCP)."""
        c = self.config
        out = os.path.join(self.folder, f"step-{step}-hf")
        if self.lora is not None:
            return self._save_lora_exports(step, out)
        export_model_to_hf(
            self.model_parts,
            out,
            self.cfg.model.name,
            self.model_args,
            dtype=c.export_dtype,
            progress=lambda msg: logger.info("hf export: %s", msg),
            record=self.record,
        )
        self.log(f"wrote Hugging Face folder {out} ({c.export_dtype})")
        return out

    def _save_lora_exports(self, step: int, out: str) -> str:
        """A LoRA run's Hugging Face exports: the merged model as ``step-N-hf`` and the adapters
        as a PEFT folder ``step-N-peft`` (trainer/checkpoint/lora_export.py)."""
        from trainer.checkpoint.lora_export import export_merged_from_live, export_peft_from_live, peft_refusal

        c = self.config
        args = (self.model_parts,)
        kw = dict(
            model_name=self.cfg.model.name,
            model_args=self.model_args,
            opts=self.lora,
            dtype=c.export_dtype,
            record=self.record,
        )
        export_merged_from_live(*args, out_dir=out, **kw)
        keys = [k for part in self.model_parts for k, _ in part.named_parameters() if is_adapter_key(k)]
        why = peft_refusal(keys, self.model_args)
        if why is not None:  # e.g. per-expert adapters (transformers' experts are fused modules)
            self.log(f"wrote the merged Hugging Face folder {out} ({c.export_dtype}); no PEFT folder: {why}")
            return out
        peft = os.path.join(self.folder, f"step-{step}-peft")
        export_peft_from_live(*args, out_dir=peft, base_model=peft_base_name(self.record, self.base["path"]), **kw)
        self.log(f"wrote the merged Hugging Face folder {out} and the PEFT adapter folder {peft} ({c.export_dtype})")
        return out

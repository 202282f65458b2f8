"""Weights & Biases: rank 0's metrics rows in a W&B run (``metrics.enable_wandb``).

:class:`~trainer.reporting.metrics.MetricsLogger` hands every record it writes to metrics.jsonl (training
steps, validation, checkpoint timings, and whatever fields a row carries) to :class:`WandbRun`,
which logs it at its training step with ``wandb.log(row, step=step)``: the records of one step
(the step's line, then its validation and checkpoint records) become one W&B history row. The
``time`` field is left out (W&B stamps every row itself, ``_timestamp``). The resolved config
(``JobConfig.to_dict()``, the config.toml of the run folder) is the run's W&B config.

Where the run goes: ``metrics.wandb_project`` / ``wandb_entity`` / ``wandb_run_name``, each
falling back to ``WANDB_PROJECT`` / ``WANDB_ENTITY`` / ``WANDB_NAME``, then to ``meshtrain``, the
user's default entity, and the name of ``job.dump_folder``. W&B's files go to ``WANDB_DIR`` when
it is set, else to ``<job.dump_folder>/wandb``. ``WANDB_MODE=offline`` writes the run there
with no network (``wandb sync <dir>`` uploads it later).

Resume: a new run's id is written to ``<checkpoint folder>/wandb_run_id`` (with checkpointing
on) once the run is committed to going on (:meth:`WandbRun.commit`, after the first step). A run that resumed from a checkpoint and finds that file logs to the same W&B run
(``resume="allow"``: it continues the run, or creates it under that id when it was never
uploaded); a run that starts at step 0 starts a new W&B run and replaces the file.
``WANDB_RUN_ID``, when set, names the run in every case.

The ``wandb`` package is optional (``pip install 'meshtrain[wandb]'``) and imported only here,
only when enabled: runs without it start as fast as before. Asking for it without it installed
is a config error (trainer/config/validate.py). W&B is a side channel: an error inside wandb
after the run started (its service process killed, say by a scheduler's signal to every process
of the job) prints one warning line and stops W&B logging; training, metrics.jsonl and
checkpoints go on. :meth:`WandbRun.finish` ends the run and shuts W&B's service process down
(``wandb.teardown``), so no wandb process outlives the trainer; the metrics logger's context
manager calls it on every way out of the training loop (the end, a stop signal, an exception).
"""

from __future__ import annotations

import os
import secrets
import string
import sys
from typing import Any

from trainer.config.errors import ConfigError

__all__ = [
    "RUN_ID_FILE",
    "WandbRun",
    "agree_on_start",
    "choose_run_id",
    "new_run_id",
    "start_wandb_run",
    "store_run_id",
]

RUN_ID_FILE = "wandb_run_id"
DEFAULT_PROJECT = "meshtrain"
_ID_CHARS = string.ascii_lowercase + string.digits


def new_run_id() -> str:
    """A random 8-character base-36 run id (W&B's own format)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(8))


def choose_run_id(id_folder: str | None, resumed: bool) -> tuple[str, bool, str | None]:
    """(run id, whether to resume it, where to store it once the run is committed). ``WANDB_RUN_ID``
    wins; a resumed trainer takes the id stored in ``id_folder``; otherwise a new id, to be stored
    there by :func:`store_run_id` (``id_folder`` None: nowhere). Nothing is written here: a run
    that fails before its first step leaves the folder it resumed as it was."""
    path = os.path.join(id_folder, RUN_ID_FILE) if id_folder else None
    env_id = os.environ.get("WANDB_RUN_ID", "").strip()
    if env_id:
        return env_id, True, None
    if resumed and path and os.path.isfile(path):
        with open(path) as f:
            stored = f.read().strip()
        if stored:
            return stored, True, None
    return new_run_id(), False, path


def store_run_id(path: str, run_id: str) -> None:
    """Write ``run_id`` to ``path`` (atomically: a temporary file renamed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(run_id + "\n")
    os.replace(path + ".tmp", path)


def start_wandb_run(mcfg: Any, run_folder: str, job: Any | None, resumed: bool) -> WandbRun:
    """The W&B run of a job (``job``: its JobConfig, or None when only ``[metrics]`` is known):
    the resolved config logged, the id kept in the checkpoint folder. W&B refusing to start
    (no API key in online mode, a bad entity...) is bad input: a ConfigError naming the fixes."""
    check_wandb_mode()
    config = job.to_dict() if job is not None else None
    id_folder = job.resolve_path(job.checkpoint.folder) if job is not None and job.checkpoint.enable else None
    try:
        return WandbRun(mcfg, run_folder, config=config, id_folder=id_folder, resumed=resumed)
    except Exception as exc:
        errors = sys.modules.get("wandb.errors")
        if errors is None or not isinstance(exc, errors.Error):
            raise
        _teardown_quietly()
        message = " ".join(str(exc).split())
        raise ConfigError(
            f"metrics.enable_wandb: W&B could not start the run ({message}); log in (wandb login, or "
            f"WANDB_API_KEY), or run offline with WANDB_MODE=offline (wandb sync uploads it later), or set "
            f"metrics.enable_wandb = false"
        ) from None


def wandb_modes() -> tuple[str, ...]:
    """The values W&B accepts for its ``mode`` setting (``WANDB_MODE``), read from the installed
    wandb's settings model."""
    import typing

    from wandb.sdk.wandb_settings import Settings

    return typing.get_args(Settings.model_fields["mode"].annotation)


def check_wandb_mode() -> None:
    """``WANDB_MODE``, when set, must be one of :func:`wandb_modes` (W&B itself reports a bad
    one as a several-line pydantic validation error)."""
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        return
    modes = wandb_modes()
    if modes and mode not in modes:
        raise ConfigError(
            f"environment variable WANDB_MODE={mode!r} is not a W&B mode; set it to one of {', '.join(modes)} "
            "(offline: no account needed) or unset it"
        )


def agree_on_start(error: BaseException | None, device: Any, peers: bool) -> None:
    """Every rank's answer to "did rank 0's W&B run start?" (a collective when ``peers``: one
    int, max over the default group, on ``device``): ``error`` is re-raised where it happened,
    and the other ranks stop with a ConfigError too, so a refusal ends the job as bad input
    (rank 0's line, exit 2) instead of leaving the others waiting in the first step."""
    failed = error is not None
    if peers:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise ConfigError("metrics.enable_wandb: rank 0 could not start the W&B run (rank 0 says why)")


def _teardown_quietly() -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        try:
            wandb.teardown()
        except Exception:
            pass


class WandbRun:
    """One W&B run of rank 0 (build it on rank 0 only).

    ``mcfg``: the ``[metrics]`` section; ``run_folder``: job.dump_folder; ``config``: the
    resolved config as a dict (None: none logged); ``id_folder``: where the run id is kept
    (the checkpoint folder, None without checkpoints); ``resumed``: the trainer continues from
    a checkpoint."""

    def __init__(
        self,
        mcfg: Any,
        run_folder: str,
        *,
        config: dict[str, Any] | None = None,
        id_folder: str | None = None,
        resumed: bool = False,
    ):
        import wandb  # the optional extra: imported only for a run that asks for it

        self._wandb = wandb
        run_id, resume, self._id_path = choose_run_id(id_folder, resumed)
        name = mcfg.wandb_run_name or os.environ.get("WANDB_NAME") or os.path.basename(os.path.abspath(run_folder))
        self.run = wandb.init(
            project=mcfg.wandb_project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            entity=mcfg.wandb_entity or os.environ.get("WANDB_ENTITY") or None,
            name=name,
            id=run_id,
            resume="allow" if resume else None,
            dir=os.environ.get("WANDB_DIR") or run_folder,
            config=config,
        )
        self.run_id = run_id
        self.resumed = resume
        self._failed = False

    @property
    def active(self) -> bool:
        return self.run is not None

    def commit(self) -> None:
        """The trainer goes on (its first step is done): a new run's id is stored in the
        checkpoint folder, where a resume finds it. Before, a run that fails (W&B refusing to
        start, bad data in the first step) leaves no id behind."""
        if self._id_path is not None:
            store_run_id(self._id_path, self.run_id)
            self._id_path = None

    def log(self, step: int, record: dict[str, Any]) -> None:
        """One metrics record at its training step (merged with the step's other records)."""
        if self.run is None:
            return
        row = {k: v for k, v in record.items() if k not in ("step", "time")}
        try:
            self.run.log(row, step=step)
        except Exception as exc:
            self._fail("logging", exc)

    def finish(self, exit_code: int = 0) -> None:
        """End the run (its last row is written) and shut W&B's service process down."""
        run, self.run = self.run, None
        if run is not None and not self._failed:
            try:
                run.finish(exit_code=exit_code)
            except Exception as exc:
                self._fail("finishing the run", exc)
        try:
            self._wandb.teardown(exit_code=exit_code)
        except Exception as exc:
            if not self._failed:
                self._fail("shutting its service down", exc)

    def _fail(self, what: str, exc: BaseException) -> None:
        self._failed = True
        self.run = None
        detail = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"warning: W&B failed while {what} ({type(exc).__name__}: {detail}); W&B logging stopped, "
            f"training and metrics.jsonl go on",
            file=sys.stderr,
            flush=True,
        )

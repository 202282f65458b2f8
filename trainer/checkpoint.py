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

All ranks must call save/load/export (they are collective). The folder must be on a
file system shared by all ranks.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import shutil
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_STALE_RE = re.compile(r"^step-\d+\.(tmp|old)$")
EXCLUDABLE = ("optimizer", "lr_scheduler", "dataloader", "rng")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint the user pointed at (or the run folder holds) that cannot be used:
    missing, incomplete, from another model, unreadable or corrupt. The message names the
    path, the problem and the fix; the trainer prints it as one line and exits with code 2."""


def _read_failure(exc: BaseException, reading: str) -> str | None:
    """What an exception raised while reading ``reading`` (".metadata" or "shard file") of a
    checkpoint says about the files, or None when it is not about the files (a bug, which
    keeps its traceback)."""
    if isinstance(exc, CheckpointException):  # DCP wraps each rank's failure
        reasons = [_read_failure(inner, reading) for inner, _ in exc.failures.values()]
        return next((r for r in reasons if r), None)
    if isinstance(exc, PermissionError):
        return f"permission denied reading {exc.filename or 'a file'}"
    if isinstance(exc, FileNotFoundError):
        return f"missing file {exc.filename}"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc} ({exc.filename})"
    if isinstance(exc, (pickle.UnpicklingError, EOFError)) or (
        isinstance(exc, RuntimeError) and ("PytorchStreamReader" in str(exc) or "zip archive" in str(exc))
    ):
        return f"truncated or corrupt {reading}"
    return None


# ------------------------------------------------------------------ process helpers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(pg=None) -> int:
    return dist.get_rank(pg) if _distributed() else 0


def _barrier(pg=None) -> None:
    if _distributed():
        dist.barrier(group=pg)


def _fsync_dir(path: str) -> None:
    """Make a rename durable: without it a power loss can undo the rename of step-N."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes | str) -> None:
    """Write ``data`` to a temporary name next to ``path``, fsync, rename it over ``path`` and
    fsync the folder: readers see the old file or the whole new one, never a partial file (the
    temporary file is removed if the write fails)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


# -------------------------------------------------------------------- state builders


def model_state_dict(model_parts: Sequence[nn.Module]) -> dict[str, Any]:
    """Sharded (DTensor-aware) state of all parts, merged under their plain FQNs."""
    merged: dict[str, Any] = {}
    for part in model_parts:
        sd = get_model_state_dict(part)
        dup = merged.keys() & sd.keys()
        if dup:
            raise ValueError(f"model parts share parameter names {sorted(dup)[:5]}; each FQN must live in one part")
        merged.update(sd)
    return merged


def _load_model_parts(model_parts: Sequence[nn.Module], state: dict[str, Any]) -> None:
    for part in model_parts:
        keys = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: state[k] for k in keys}, options=StateDictOptions(strict=True))


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_blob(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def checkpoint_keys(path: str) -> set[str]:
    """Flattened keys stored in a DCP checkpoint (e.g. 'model.tok_embeddings.weight')."""
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys())


def _dcp(fn, state: dict[str, Any], **kwargs) -> Any:
    """dcp.save/load; single-process use (seed checkpoints, offline export) is intended
    here, so DCP's "assuming single process" warning is noise."""
    if _distributed():
        return fn(state, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(state, no_dist=True, **kwargs)


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


# ---------------------------------------------------------------------- load / save


def load_checkpoint(
    path: str,
    model_parts: Sequence[nn.Module],
    optimizer=None,
    lr_scheduler=None,
    dataloader=None,
    *,
    exclude: Iterable[str] = (),
    process_group=None,
) -> dict[str, Any]:
    """Restore whatever ``path`` holds into the given objects (None = not restored) and
    return the saved ``extra`` dict (empty for model-only checkpoints such as seeds)."""
    exclude = set(exclude)
    unknown = exclude - set(EXCLUDABLE)
    if unknown:
        raise ValueError(f"cannot exclude {sorted(unknown)} from loading; choose from {EXCLUDABLE}")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not _is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata)")
    try:
        stored = checkpoint_keys(path)
    except Exception as exc:
        reason = _read_failure(exc, ".metadata")
        if reason is None:
            raise
        raise CheckpointError(f"checkpoint {path} is unreadable ({reason})") from exc

    model_sd = model_state_dict(model_parts)
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
        state["optimizer"] = optimizer.state_dict()  # also materialises empty Adam state
    if "train_state" in stored:
        state["train_state"] = b""
    try:
        _dcp(dcp.load, state, checkpoint_id=path, process_group=process_group)
    except BaseException as exc:  # CheckpointException is a BaseException
        reason = _read_failure(exc, "shard file")
        if reason is None:
            raise
        raise CheckpointError(f"checkpoint {path} is unreadable ({reason})") from exc

    _load_model_parts(model_parts, state["model"])
    if load_optimizer:
        optimizer.load_state_dict(state["optimizer"])
    elif optimizer is not None and "optimizer" not in exclude:
        logger.warning("checkpoint %s has no optimizer state; optimizer starts fresh", path)
    if "train_state" not in state:
        return {}
    train_state = _from_blob(state["train_state"])
    if lr_scheduler is not None and "lr_scheduler" not in exclude and train_state.get("lr_scheduler"):
        lr_scheduler.load_state_dict(train_state["lr_scheduler"])
    if dataloader is not None and "dataloader" not in exclude and train_state.get("dataloader"):
        dataloader.load_state_dict(train_state["dataloader"])
    if "rng" not in exclude and train_state.get("rng"):
        _set_rng_state(train_state["rng"])
    return dict(train_state.get("extra") or {})


class CheckpointManager:
    """Periodic saves to ``<folder>/step-N``, retention of the newest K, and resume."""

    def __init__(self, folder: str, keep_latest_k: int = 0, interval: int = 1, *, process_group=None):
        if keep_latest_k < 0 or interval <= 0:
            raise ValueError(
                f"keep_latest_k must be >= 0 (0 keeps all) and interval > 0; got {keep_latest_k}, {interval}"
            )
        self.folder, self.keep_latest_k, self.interval = folder, keep_latest_k, interval
        self.process_group = process_group

    @classmethod
    def from_config(cls, cfg, process_group=None) -> CheckpointManager:
        c = cfg.checkpoint
        return cls(cfg.resolve_path(c.folder), c.keep_latest_k, c.interval, process_group=process_group)

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
            if m and _is_complete(os.path.join(self.folder, name)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.list_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int, last_step: bool = False) -> bool:
        return last_step or step % self.interval == 0

    def save(
        self,
        step: int,
        model_parts: Sequence[nn.Module],
        optimizer=None,
        lr_scheduler=None,
        dataloader=None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        state: dict[str, Any] = {"model": model_state_dict(model_parts)}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if _rank(self.process_group) == 0:  # identical on all ranks, or rank 0's by definition
            state["train_state"] = _to_blob(
                {
                    "extra": {"step": step, **(extra or {})},
                    "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                    "dataloader": dataloader.state_dict() if dataloader is not None else None,
                    "rng": _rng_state(),
                }
            )
        return self.save_state(step, state)

    def save_state(self, step: int, state: dict[str, Any]) -> str:
        """Write an arbitrary DCP state dict as step-N with the tmp-then-rename protocol."""
        pg = self.process_group
        final = self.step_dir(step)
        tmp = final + ".tmp"
        rank = _rank(pg)
        if rank == 0:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # left over from a crashed save of this step
            os.makedirs(tmp)
        _barrier(pg)
        _dcp(dcp.save, state, checkpoint_id=tmp, process_group=pg)
        _barrier(pg)  # every rank's shards are on disk before the rename publishes them

        if rank == 0:
            old = final + ".old"
            if os.path.exists(final):  # re-saving a step: keep it until the new one is in place
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(self.folder)
            if os.path.exists(old):
                shutil.rmtree(old)
            self._purge()
        _barrier(pg)
        logger.info("saved checkpoint %s", final)
        return final

    def _purge(self) -> None:
        for name in os.listdir(self.folder):
            if _STALE_RE.match(name):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in self.list_steps()[: -self.keep_latest_k]:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)

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
            extra = load_checkpoint(
                self.step_dir(step),
                model_parts,
                optimizer,
                lr_scheduler,
                dataloader,
                exclude=exclude,
                process_group=self.process_group,
            )
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


def save_seed_checkpoint(model: nn.Module, folder: str) -> str:
    """Write the freshly initialised model as ``<folder>/step-0`` (model only), from a
    single process, so that every later layout starts from identical weights."""
    if _distributed() and dist.get_world_size() > 1:
        raise RuntimeError(
            "create the seed checkpoint with one process (e.g. torchrun --nproc_per_node=1 ... "
            "--checkpoint.create_seed_checkpoint --parallelism.dp_shard 1)"
        )
    return CheckpointManager(folder).save_state(0, {"model": model_state_dict([model])})


# ------------------------------------------------------------------------- export


def _write_consolidated(state: dict[str, torch.Tensor], path: str, dtype: str) -> str:
    target = _DTYPES.get(dtype)
    if target is None:
        raise ValueError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    state = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise RuntimeError(
                f"cannot write {path}: safetensors is not installed; export to a .pt path instead"
            ) from None
        save_file(state, tmp)
    else:
        torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def export_checkpoint(checkpoint_dir: str, path: str, dtype: str = "float32") -> str:
    """Single process: consolidate the model weights of a DCP checkpoint into one file."""
    if not _is_complete(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a complete checkpoint (no .metadata)")
    meta = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"{checkpoint_dir} holds no model weights")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)
    return _write_consolidated({k[len("model.") :]: v for k, v in state.items()}, path, dtype)


def export_consolidated(
    model_parts: Sequence[nn.Module], path: str, dtype: str = "float32", *, process_group=None
) -> str:
    """Write the full weights as one ``.pt`` (or ``.safetensors``) file from rank 0.

    Collective. Without pipeline parallelism rank 0 holds every FQN and the weights are
    gathered with ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``. With
    pipeline stages on other ranks, rank 0 cannot gather their weights that way, so the
    parts are written to a temporary sharded DCP checkpoint and rank 0 consolidates it.
    """
    pg = process_group
    rank = _rank(pg)
    own = sorted(k for part in model_parts for k in get_model_state_dict(part).keys())
    all_keys: list[Any] = [own]
    if _distributed() and dist.get_world_size(pg) > 1:
        all_keys = [None] * dist.get_world_size(pg)
        dist.all_gather_object(all_keys, own, group=pg)
    if all(set(keys) <= set(all_keys[0]) for keys in all_keys):
        full: dict[str, torch.Tensor] = {}
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        for part in model_parts:
            full.update(get_model_state_dict(part, options=opts))
        if rank == 0:
            _write_consolidated(full, path, dtype)
        _barrier(pg)
        return path
    tmp = path + ".dcp.tmp"
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    _barrier(pg)
    dcp.save({"model": model_state_dict(model_parts)}, checkpoint_id=tmp, process_group=pg)
    _barrier(pg)
    if rank == 0:
        export_checkpoint(tmp, path, dtype)
        shutil.rmtree(tmp)
    _barrier(pg)
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Consolidate a DCP checkpoint's model weights into one file.")
    parser.add_argument("checkpoint_dir", help="e.g. outputs/checkpoint/step-50")
    parser.add_argument("output", help="output .pt or .safetensors path")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    args = parser.parse_args()
    try:
        print(export_checkpoint(args.checkpoint_dir, args.output, args.dtype))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

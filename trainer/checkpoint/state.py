"""What a checkpoint holds, built from and restored into the live objects: the model parts'
sharded state under plain FQNs, rank 0's RNG state, the pickled train-state blob, and the
process helpers every save/load shares (collective when torch.distributed is initialized,
single-process otherwise)."""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from models.parallel.float8 import plain_state_dict
from models.parallel.pipeline.tied import EMBEDDING_KEY, checkpoint_key
from trainer.optim.groups import GROUPING_KEY

__all__ = [
    "EXPORT_DTYPES",
    "checkpoint_keys",
    "checkpoint_state_dict",
    "export_dtype",
    "is_complete",
    "load_model_parts",
    "model_state_dict",
    "stored_optimizer_keys",
]

# the dtypes a weights export (consolidated file or Hugging Face folder) may be written in
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """An export dtype by name (``checkpoint.export_dtype``) or as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    return EXPORT_DTYPES[dtype]


# ------------------------------------------------------------------ process helpers


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(pg=None) -> int:
    return dist.get_rank(pg) if distributed() else 0


def barrier(pg=None) -> None:
    if distributed():
        dist.barrier(group=pg)


def run_dcp(fn, state: dict[str, Any], **kwargs) -> Any:
    """dcp.save/load; single-process use (seed checkpoints, offline export) is intended
    here, so DCP's "assuming single process" warning is noise."""
    if distributed():
        return fn(state, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(state, no_dist=True, **kwargs)


# -------------------------------------------------------------------- state builders


def model_state_dict(model_parts: Sequence[nn.Module], select: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Sharded (DTensor-aware) state of all parts, merged under their plain FQNs; with
    ``select``, only the keys it accepts (a LoRA run's adapters, or its base)."""
    merged: dict[str, Any] = {}
    for part in model_parts:
        sd = plain_state_dict(get_model_state_dict(part))
        if select is not None:
            sd = {k: v for k, v in sd.items() if select(k)}
        dup = merged.keys() & sd.keys()
        if dup:
            raise ValueError(f"model parts share parameter names {sorted(dup)[:5]}; each FQN must live in one part")
        merged.update(sd)
    return merged


def checkpoint_state_dict(
    model_parts: Sequence[nn.Module], select: Callable[[str], bool] | None = None
) -> dict[str, Any]:
    """:func:`model_state_dict` as a step checkpoint stores it: a tied embedding/head weight
    once, as ``tok_embeddings.weight`` (models/parallel/pipeline/tied.py). On a pipeline's last
    stage that entry is the head's copy (equal to the first stage's, which DCP writes once), so
    every layout saves and loads the same keys. ``select``: only the keys (our FQNs) it accepts
    (a LoRA run's adapters)."""
    merged: dict[str, Any] = {}
    for part in model_parts:
        own: dict[str, Any] = {}
        for k, v in plain_state_dict(get_model_state_dict(part)).items():
            if select is not None and not select(k):
                continue
            key = checkpoint_key(part, k)
            if key == EMBEDDING_KEY and key != k and (key in own or key in merged):
                continue  # the other name (or copy) of a tied weight this rank already holds
            own[key] = v
        dup = merged.keys() & own.keys()
        if dup and dup != {EMBEDDING_KEY}:
            raise ValueError(f"model parts share parameter names {sorted(dup)[:5]}; each FQN must live in one part")
        for k, v in own.items():
            merged.setdefault(k, v)  # a V schedule's last stage: its copy equals the embedding
    return merged


def load_model_parts(
    model_parts: Sequence[nn.Module], state: dict[str, Any], select: Callable[[str], bool] | None = None
) -> None:
    """Restore each part from ``state`` (checkpoint names: a tied head reads the embedding);
    with ``select``, only the keys it accepts (the rest of the part left as it is)."""
    for part in model_parts:
        keys = [k for k in get_model_state_dict(part) if select is None or select(k)]
        values = {k: state[checkpoint_key(part, k)] for k in keys}
        set_model_state_dict(part, values, options=StateDictOptions(strict=select is None))


def rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def to_blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_blob(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


# ---------------------------------------------------------------------- on disk


def checkpoint_keys(path: str) -> set[str]:
    """Flattened keys stored in a DCP checkpoint (e.g. 'model.tok_embeddings.weight')."""
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys())


def is_complete(path: str) -> bool:
    """A DCP folder is complete once its ``.metadata`` exists (DCP writes it last)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def stored_optimizer_keys(optim_state: dict[str, Any], stored: set[str]) -> dict[str, Any]:
    """The optimizer state to load from a checkpoint holding ``stored`` keys: all of it, except
    the parameter grouping (trainer/optim/groups.py ``GROUPING_KEY``) when a checkpoint written
    before groups existed lacks it (the optimizer then compares against plain AdamW's), and the
    step counts a checkpoint lacks (:func:`_muon_step`)."""
    keep = {k for k in optim_state if k != GROUPING_KEY and not _muon_step(k, stored)}
    return {k: v for k, v in optim_state.items() if k in keep or f"optimizer.{k}" in stored}


def _muon_step(key: str, stored: set[str]) -> bool:
    """A Muon parameter's step count: it exists only with bf16 momentum (it salts the stochastic
    rounding, trainer/optim/low_precision.py), so a float32-state checkpoint (which has the
    parameter's ``momentum_buffer``) lacks it, and a resume into bf16 state restarts the count."""
    return key.startswith("state.") and key.endswith(".step") and f"optimizer.{key[:-4]}momentum_buffer" in stored

"""Writing Hugging Face folders: from a DCP checkpoint (:func:`export_dcp_to_hf`, for
``scripts/convert_hf.py to-hf``) and the plan and folder frame it shares with the export from
the live model (:mod:`trainer.checkpoint.hf_live`): :class:`HFExportPlan`, :func:`write_hf_folder`.

``to_hf`` per group of tensors (a layer), shards of at most ``max_shard_bytes`` named
``model-0000i-of-0000N.safetensors`` (or one ``model.safetensors``), the index with
``metadata.total_size`` and ``weight_map``, ``config.json`` from ``adapter.hf_config(dtype)``
with the source folder's fields, a ``generation_config.json`` and the tokenizer files
(:mod:`trainer.checkpoint.hf_extras`, from the run's :class:`ModelRecord`). Everything is written into ``<out>.tmp`` (each file through
:mod:`trainer.runtime.files`) and renamed to ``<out>`` last (:func:`~trainer.checkpoint.folders.publish_folder`),
so an interrupted save never leaves a folder under the final name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from models import registry
from models.parallel.pipeline.tied import EMBEDDING_KEY, HEAD_KEY
from trainer.checkpoint.errors import CheckpointError, read_failure
from trainer.checkpoint.folders import publish_folder
from trainer.checkpoint.hf_extras import ModelRecord, carry_config, tokenizer_ids, write_extras
from trainer.checkpoint.hf_format import CONFIG_FILE, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE
from trainer.checkpoint.state import EXPORT_DTYPES, export_dtype
from trainer.runtime.cli_errors import unwrap_dcp
from trainer.runtime.files import atomic_path, atomic_write, fsync_dir

__all__ = [
    "HFExportPlan",
    "HFFolderWriter",
    "dcp_model_meta",
    "export_dcp_to_hf",
    "layer_groups",
    "plan_hf_export",
    "plan_shards",
    "prepare_tensor",
    "shard_names",
    "stored_dtype",
    "write_hf_folder",
]

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Pack ``(key, nbytes)`` in order into files of at most ``max_shard_bytes`` (a tensor
    larger than that gets a file of its own)."""
    files: list[list[str]] = []
    current: list[str] = []
    used = 0
    for key, nbytes in sizes:
        if current and used + nbytes > max_shard_bytes:
            files.append(current)
            current, used = [], 0
        current.append(key)
        used += nbytes
    if current:
        files.append(current)
    return files


def shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in EXPORT_DTYPES.items()}[dtype]


def stored_dtype(t: Tensor, dtype: torch.dtype, keep_fp32: bool) -> torch.dtype:
    if not t.is_floating_point():
        return t.dtype
    return torch.float32 if keep_fp32 else dtype


def prepare_tensor(t: Tensor, dtype: torch.dtype) -> Tensor:
    t = t.detach().to("cpu").to(dtype).contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # a view of a larger tensor: safetensors wants owned storage
    return t


class HFFolderWriter:
    """Write shards into ``<final>.tmp``; :meth:`commit` adds the index and config files and
    renames to ``<final>`` (an existing ``<final>`` is replaced only then)."""

    def __init__(self, final: str):
        self.final = os.path.abspath(final)
        self.tmp = self.final + ".tmp"

    def start(self) -> None:
        if os.path.exists(self.tmp):
            shutil.rmtree(self.tmp)  # left by a crashed save
        os.makedirs(self.tmp)

    def write_file(self, name: str, tensors: Mapping[str, Tensor]) -> None:
        from safetensors.torch import save_file

        with atomic_path(os.path.join(self.tmp, name)) as path:
            save_file(dict(tensors), path, metadata={"format": "pt"})

    def commit(
        self,
        config: Mapping[str, Any],
        files: Sequence[Sequence[str]],
        total_size: int,
        record: ModelRecord | None = None,
        ids: Mapping[str, Any] | None = None,
    ) -> str:
        """``record``: the tokenizer files and generation_config.json to add
        (trainer/checkpoint/hf_extras.py); ``ids`` the tokenizer's bos/eos/pad."""
        names = shard_names(len(files))
        if len(files) > 1:
            index = {
                "metadata": {"total_size": int(total_size)},
                "weight_map": {k: name for name, keys in zip(names, files) for k in sorted(keys)},
            }
            self._write_json(INDEX_FILE, index)
        write_extras(self.tmp, record, config, ids)
        self._write_json(CONFIG_FILE, dict(config))
        fsync_dir(self.tmp)
        return publish_folder(self.tmp, self.final)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _write_json(self, name: str, obj: Any) -> None:
        atomic_write(os.path.join(self.tmp, name), json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _group_of(key: str) -> str:
    m = _LAYER_RE.match(key)
    return f"layers.{m.group(1)}" if m else key.split(".")[0]


def layer_groups(keys: Iterable[str]) -> list[tuple[str, list[str]]]:
    """Our keys grouped by layer (``layers.N``) or top-level module, first appearance order."""
    out: dict[str, list[str]] = {}
    for k in keys:
        out.setdefault(_group_of(k), []).append(k)
    return list(out.items())


def dcp_model_meta(dcp_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isdir(dcp_dir):
        raise CheckpointError(f"checkpoint {dcp_dir} does not exist: point it at a step-N folder of a run")
    if not os.path.isfile(os.path.join(dcp_dir, ".metadata")):
        raise CheckpointError(
            f"{dcp_dir} is not a complete checkpoint (no .metadata): point it at a step-N folder of a run "
            f"(checkpoint.folder) or a folder written by convert_hf.py to-dcp"
        )
    try:
        meta = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    except Exception as exc:  # a truncated or foreign .metadata
        raise CheckpointError(f"checkpoint {dcp_dir} is unreadable (truncated or corrupt .metadata: {exc})") from None
    out = {
        k[len("model.") :]: (tuple(m.size), m.properties.dtype)
        for k, m in meta.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not out:
        raise CheckpointError(f"checkpoint {dcp_dir} holds no model weights")
    return out


def _dcp_read(dcp_dir: str, keys: Sequence[str], meta) -> dict[str, Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {k: torch.empty(meta[k][0], dtype=meta[k][1]) for k in keys}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=dcp_dir, no_dist=True)
    except BaseException as exc:  # DCP wraps what failed in a CheckpointException (a BaseException)
        reason = read_failure(exc, "shard file")
        if reason is None:
            inner = unwrap_dcp(exc)
            if inner is exc:
                raise
            raise inner from None
        raise CheckpointError(
            f"checkpoint {dcp_dir} is unreadable ({reason}): point it at another step-N folder, or write this one "
            f"again (save it again, or rerun convert_hf.py to-dcp)"
        ) from None
    return state


def _hf_of_group(adapter, group_state: Mapping[str, Tensor], placeholders: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``to_hf`` of a subset of our keys: the adapter converts full state dicts, so the other
    keys are meta placeholders (no memory, no compute) and only the subset's outputs are kept."""
    full = dict(placeholders)
    full.update(group_state)
    hf = adapter.to_hf(full)
    wanted = [h for k in group_state for h in adapter.hf_keys_for(k)]
    return {h: hf[h] for h in wanted}


@dataclass
class HFExportPlan:
    """What a Hugging Face folder of one model holds, from shapes only: which of our keys make
    each layer group, which Hugging Face keys each shard file holds (and their stored dtypes).
    Shared by the DCP converter (:func:`export_dcp_to_hf`) and the live export
    (:func:`trainer.checkpoint.hf_live.export_model_to_hf`), so both write the same folder."""

    adapter: Any
    dtype: torch.dtype  # the export dtype
    placeholders: dict[str, Tensor]  # our key -> meta tensor
    group_keys: dict[str, list[str]]  # layer group -> our keys, in order
    files: list[list[str]]  # shard file -> its Hugging Face keys
    group_of: dict[str, str]  # Hugging Face key -> layer group
    dtypes: dict[str, torch.dtype]  # Hugging Face key -> stored dtype
    total_size: int
    record: ModelRecord | None = None  # the run's source folder and tokenizer (hf_extras.py)

    @property
    def names(self) -> list[str]:
        return shard_names(len(self.files))

    def file_groups(self, i: int) -> list[str]:
        """The layer groups shard file ``i`` needs, in order."""
        return list(dict.fromkeys(self.group_of[h] for h in self.files[i]))

    def to_hf(self, group_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Full tensors of one group (our keys) -> its Hugging Face tensors."""
        return _hf_of_group(self.adapter, group_state, self.placeholders)

    def file_tensors(self, i: int, hf_groups: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
        """Shard file ``i``'s tensors, in their stored dtypes, from its groups' Hugging Face tensors."""
        return {h: prepare_tensor(hf_groups[self.group_of[h]][h], self.dtypes[h]) for h in self.files[i]}

    def tokenizer_ids(self) -> dict[str, Any]:
        return tokenizer_ids(self.record.tokenizer) if self.record is not None else {}

    def config(self, ids: Mapping[str, Any] | None = None) -> dict:
        """config.json: the adapter's, with the source folder's fields the run did not change."""
        return carry_config(self.adapter.hf_config(_dtype_name(self.dtype)), self.record, ids)


def plan_hf_export(
    adapter,
    meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    dtype: str | torch.dtype,
    max_shard_bytes: int,
    record: ModelRecord | None = None,
) -> HFExportPlan:
    """The plan of the folder for our full tensors of shapes and dtypes ``meta`` (every key of
    ``adapter.our_keys()``, checked by the caller)."""
    target = export_dtype(dtype)
    ours = adapter.our_keys()
    # to_hf on meta tensors gives every Hugging Face key and shape
    placeholders = {k: torch.empty(s, dtype=meta[k][1], device="meta") for k, s in ours.items()}
    groups = layer_groups(ours)
    hf_meta: list[tuple[str, str, Tensor]] = []  # (group, hf key, meta tensor)
    for gname, keys in groups:
        for h, t in _hf_of_group(adapter, {k: placeholders[k] for k in keys}, placeholders).items():
            hf_meta.append((gname, h, t))
    expected = adapter.hf_keys()
    produced = {h: tuple(t.shape) for _, h, t in hf_meta}
    if produced != {k: tuple(v) for k, v in expected.items()}:
        raise RuntimeError(f"{type(adapter).__name__}.to_hf does not produce exactly hf_keys()")
    dtypes = {h: stored_dtype(t, target, adapter.keep_in_fp32(h)) for _, h, t in hf_meta}
    sizes = [(h, t.numel() * dtypes[h].itemsize) for _, h, t in hf_meta]
    return HFExportPlan(
        adapter=adapter,
        dtype=target,
        placeholders=placeholders,
        group_keys=dict(groups),
        files=plan_shards(sizes, max_shard_bytes),
        group_of={h: g for g, h, _ in hf_meta},
        dtypes=dtypes,
        total_size=sum(n for _, n in sizes),
        record=record,
    )


def write_hf_folder(
    plan: HFExportPlan, out_dir: str, write_shards: Callable[[HFFolderWriter], None], process_group=None
) -> str:
    """The frame of a (collective) folder write: rank 0 starts ``<out>.tmp``, every rank runs
    ``write_shards(writer)`` (its part of the shard files), then rank 0 writes the index and
    config files and publishes the folder."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    writer = HFFolderWriter(out_dir)
    if rank == 0:
        writer.start()
    if distributed:
        dist.barrier(group=process_group)
    try:
        write_shards(writer)
    except BaseException:
        if not distributed:
            writer.abort()
        raise
    if distributed:
        dist.barrier(group=process_group)
    if rank == 0:
        ids = plan.tokenizer_ids()
        writer.commit(plan.config(ids), plan.files, plan.total_size, plan.record, ids)
    if distributed:
        dist.barrier(group=process_group)
    return os.path.abspath(out_dir)


def export_dcp_to_hf(
    dcp_dir: str,
    out_dir: str,
    model_name: str,
    args,
    *,
    dtype: str | torch.dtype = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
    process_group=None,
    record: ModelRecord | None = None,
) -> str:
    """Write the model weights of a DCP checkpoint (``model.<fqn>`` keys: a run's step-N or a
    convert_hf.py to-dcp folder) as a Hugging Face folder.

    Collective when torch.distributed is initialized (every rank of ``process_group`` calls
    it): shard file i is converted and written by rank ``i % world``, so the work and memory are
    spread; rank 0 writes the index and config files and publishes the folder. One process
    holds at most the layer groups of the file it is writing (ours and Hugging Face's) plus that
    file's tensors."""
    say = progress or (lambda _m: None)
    export_dtype(dtype)  # a bad dtype fails before the checkpoint is read
    adapter = registry.get_hf_adapter(model_name, args)
    meta = dcp_model_meta(dcp_dir)
    stored = set(meta)
    if getattr(args, "tie_word_embeddings", False) and HEAD_KEY not in meta and EMBEDDING_KEY in meta:
        meta[HEAD_KEY] = meta[EMBEDDING_KEY]  # the tied head is the embedding, stored once
    ours = adapter.our_keys()
    missing = [k for k in ours if k not in meta]
    if missing:
        raise CheckpointError(
            f"checkpoint {dcp_dir} lacks {len(missing)} weights of {model_name} with these args, e.g. {missing[:3]}: "
            f"it was saved from another model or flavor (pass the --model/--flavor it was trained with)"
        )
    wrong = [(k, meta[k][0], s) for k, s in ours.items() if tuple(meta[k][0]) != tuple(s)]
    if wrong:
        k, got, want = wrong[0]
        raise CheckpointError(
            f"checkpoint {dcp_dir}: {k} has shape {list(got)}, expected {list(want)} for {model_name} with these args: "
            f"pick the flavor (and model.n_layers / vocab_size) it was trained with"
        )
    plan = plan_hf_export(adapter, meta, dtype, max_shard_bytes, record)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    world = dist.get_world_size(process_group) if distributed else 1

    def write_mine(writer: HFFolderWriter) -> None:
        names = plan.names
        cache: dict[str, dict[str, Tensor]] = {}  # group -> its Hugging Face tensors
        for i in range(rank, len(plan.files), world):
            needed = plan.file_groups(i)
            for g in list(cache):
                if g not in needed:
                    del cache[g]
            for g in needed:
                if g not in cache:
                    keys = [k for k in plan.group_keys[g] if k in stored]
                    cache[g] = plan.to_hf(_dcp_read(dcp_dir, keys, meta))
            writer.write_file(names[i], plan.file_tensors(i, cache))
            say(f"wrote {names[i]} ({len(plan.files[i])} tensors) [{i + 1}/{len(plan.files)}]")
        cache.clear()

    return write_hf_folder(plan, out_dir, write_mine, process_group)

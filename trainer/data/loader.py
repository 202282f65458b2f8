"""The loaders the trainer uses, built from the config and the job plan's batch: the training
loader (:func:`build_dataloader`), the ``[validation]`` loader and the prefetch wrapper.
"""

from __future__ import annotations

import torch

from trainer.config import JobConfig
from trainer.data.batching import PackedDataLoader
from trainer.data.prefetch import BackgroundLoader, SyncLoader
from trainer.data.sources import DocumentSource, FileSource, SyntheticSource
from trainer.data.token_shards import TokenDataset


def build_source(cfg: JobConfig, *, log_epochs: bool = True) -> DocumentSource | TokenDataset:
    """The training data's document source; ``log_epochs``: whether a file source says when it
    starts over (the trainer's rank 0 only)."""
    t = cfg.training
    if t.dataset == "synthetic":
        return SyntheticSource(t.seed)
    if t.dataset == "tokens":
        return TokenDataset(t.dataset_path)
    return FileSource(t.dataset_path, t.dataset, documents=t.text_documents, log_epochs=log_epochs)


def build_validation_dataloader(cfg: JobConfig, tokenizer, batch_rank: int, batch_degree: int) -> PackedDataLoader:
    """The ``[validation]`` loader: its own dataset, global batch ``validation.global_batch_size``
    (-1: ``validation.local_batch_size`` x batch degree), each rank reading its contiguous slice
    in micro-batches of ``validation.local_batch_size``, like training. The synthetic corpus is drawn from another seed than training's, so it is
    held out."""
    v = cfg.validation
    if v.dataset == "synthetic":
        source: DocumentSource | TokenDataset = SyntheticSource(f"validation:{cfg.training.seed}")
    elif v.dataset == "tokens":
        source = TokenDataset(v.dataset_path, option="validation.dataset_path")
    else:
        # every evaluation reads the same stretch again from its start: no "starting over" each time
        source = FileSource(
            v.dataset_path, v.dataset, option="validation.dataset_path", documents=v.text_documents, log_epochs=False
        )
    return PackedDataLoader(
        source,
        tokenizer,
        seq_len=v.seq_len,
        global_batch_size=v.global_batch_size,
        local_batch_size=v.local_batch_size,
        batch_rank=batch_rank,
        batch_degree=batch_degree,
    )


def wrap_loader(loader: PackedDataLoader, prefetch: bool, device: torch.device | str | None = None):
    """The trainer's loader: :class:`BackgroundLoader` (``training.prefetch``) or
    :class:`SyncLoader`; both report the time each step waited for data (``wait_s``)."""
    return BackgroundLoader(loader, device) if prefetch else SyncLoader(loader)


def build_dataloader(
    cfg: JobConfig, tokenizer, batch_rank: int, batch_degree: int | None = None, *, batch=None, log_epochs: bool = True
) -> PackedDataLoader:
    """``batch_rank``: this rank's coordinate in the batch (data-parallel: dp_replicate x
    dp_shard) dimension of the device mesh. ``batch``: the job plan's
    :class:`~trainer.plan.BatchPlan` (what the trainer passes: the batch is resolved once, by
    the plan); without it, ``batch_degree`` and the config's batch keys."""
    t = cfg.training
    if batch is not None:
        global_batch_size, local_batch_size = batch.global_batch_size, batch.local_batch_size
        batch_degree, seq_len = batch.batch_degree, batch.seq_len
    elif batch_degree is None:
        raise TypeError("build_dataloader needs the job plan's batch plan or a batch_degree")
    else:
        global_batch_size, local_batch_size, seq_len = t.global_batch_size, t.local_batch_size, t.seq_len
    return PackedDataLoader(
        build_source(cfg, log_epochs=log_epochs),
        tokenizer,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        batch_rank=batch_rank,
        batch_degree=batch_degree,
    )

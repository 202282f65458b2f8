"""The loaders the trainer uses, built from the config and the job plan's batch: the training
loader (:func:`build_dataloader`), the ``[validation]`` loader and the prefetch wrapper.
"""

from __future__ import annotations

import torch

from trainer.config import ConfigError, JobConfig, resolve_global_batch_size
from trainer.data.batching import PackedDataLoader
from trainer.data.chat import ChatSource, ChatStream
from trainer.data.mixture import MixtureSchedule, MixtureStream
from trainer.data.packing import PackedStream
from trainer.data.preference import PreferenceSource, PreferenceStream
from trainer.data.prefetch import BackgroundLoader, SyncLoader
from trainer.data.sources import DocumentSource, FileSource, RowTextSource, SyntheticSource
from trainer.data.striped import StripedStream, Stripes
from trainer.data.token_shards import TokenDataset
from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH


def build_source(cfg: JobConfig, *, log_epochs: bool = True) -> DocumentSource | TokenDataset:
    """The training data's document source; ``log_epochs``: whether a file source says when it
    starts over (the trainer's rank 0 only)."""
    t = cfg.training
    if t.dataset == "synthetic":
        return SyntheticSource(t.seed)
    if t.dataset == "tokens":
        return TokenDataset(t.dataset_path)
    if t.dataset == "hf":
        return RowTextSource(t.dataset_path, log_epochs=log_epochs)
    return FileSource(t.dataset_path, t.dataset, documents=t.text_documents, log_epochs=log_epochs)


def chat_stream(
    cfg: JobConfig, path: str, tokenizer, seq_len: int, option: str, log_epochs: bool = True
) -> tuple[ChatSource, ChatStream]:
    """A 'chat' dataset's source and its windows (training.chat_packing, chat_too_long)."""
    source = ChatSource(path, tokenizer, DEFAULT_TOKENIZER_PATH, option=option, log_epochs=log_epochs)
    t = cfg.training
    return source, ChatStream(source, seq_len, packing=t.chat_packing, too_long=t.chat_too_long)


def preference_stream(
    cfg: JobConfig, path: str, tokenizer, seq_len: int, option: str, log_epochs: bool = True
) -> tuple[PreferenceSource, PreferenceStream]:
    """A 'preference' dataset's source and its pairs of windows (training.chat_too_long)."""
    source = PreferenceSource(path, tokenizer, DEFAULT_TOKENIZER_PATH, option=option, log_epochs=log_epochs)
    return source, PreferenceStream(source, seq_len, too_long=cfg.training.chat_too_long)


MASKED = ("chat", "preference")  # kinds whose labels hold IGNORE_INDEX


def _source_stream(cfg: JobConfig, entry: dict, tokenizer, seq_len: int, log_epochs: bool):
    """One ``[[training.sources]]`` entry's stream of windows, as that kind would be alone."""
    kind, path, option = entry["kind"], entry["path"], f"training.sources '{entry['name']}' path"
    if kind == "chat":
        return chat_stream(cfg, path, tokenizer, seq_len, option, log_epochs)[1]
    if kind == "preference":
        return preference_stream(cfg, path, tokenizer, seq_len, option, log_epochs)[1]
    if kind == "tokens":
        tokens = TokenDataset(path, option=option)
        tokens.check_tokenizer(tokenizer)
        return tokens.stream(seq_len)
    if kind == "synthetic":
        source: DocumentSource = SyntheticSource(cfg.training.seed)
    elif kind == "hf":
        source = RowTextSource(path, option=option, log_epochs=log_epochs)
    else:
        source = FileSource(path, kind, option=option, documents=cfg.training.text_documents, log_epochs=log_epochs)
    return PackedStream(source, tokenizer, seq_len)


def _mixture_description(entries: list[dict], shares: list[float]) -> str:
    return "mixture of " + "; ".join(
        f"{e['name']} ({e['kind']}{', ' + e['path'] if e['path'] else ''}): weight {e['weight']:g}, "
        f"{p:.1%} of the samples and tokens expected"
        for e, p in zip(entries, shares)
    )


def mixture_stream(cfg: JobConfig, tokenizer, seq_len: int, log_epochs: bool = True) -> MixtureStream:
    """``training.sources``: the sources' streams under the seeded schedule (trainer/data/mixture.py)."""
    entries = cfg.training.sources
    streams = [_source_stream(cfg, e, tokenizer, seq_len, log_epochs) for e in entries]
    mix = MixtureStream(
        streams,
        [e["name"] for e in entries],
        [e["weight"] for e in entries],
        cfg.training.seed,
        masked=any(e["kind"] in MASKED for e in entries),
    )
    mix.name = "mixture"
    mix.description = _mixture_description(entries, mix.shares)
    return mix


def _stripes(cfg: JobConfig, kind: str, path: str, option: str, tokenizer, seq_len: int, slots: int, log_epochs: bool):
    """A ``hf``, ``chat`` or ``preference`` dataset read in ``slots`` stripes (trainer/data/striped.py;
    preference: ``slots / 2``, one per pair of slots), or the reason it is not: (Stripes, None) or
    (None, why)."""
    if kind not in ("hf", "chat", "preference"):
        return None, f"'{kind}' data is read as one stream"
    t = cfg.training
    unit = 2 if kind == "preference" else 1
    if kind == "preference":
        base = PreferenceSource(path, tokenizer, DEFAULT_TOKENIZER_PATH, option=option, log_epochs=False)

        def make(i: int):
            rows = base.rows.stripe(i, slots // 2, log_epochs=log_epochs and i == 0)
            return PreferenceStream(base.with_rows(rows), seq_len, too_long=t.chat_too_long)
    elif kind == "chat":
        base = ChatSource(path, tokenizer, DEFAULT_TOKENIZER_PATH, option=option, log_epochs=False)

        def make(i: int):
            rows = base.rows.stripe(i, slots, log_epochs=log_epochs and i == 0)
            return ChatStream(base.with_rows(rows), seq_len, packing=t.chat_packing, too_long=t.chat_too_long)
    else:
        base = RowTextSource(path, option=option, log_epochs=False)

        def make(i: int):
            return PackedStream(
                base.with_rows(base.rows.stripe(i, slots, log_epochs=log_epochs and i == 0)), tokenizer, seq_len
            )

    if not base.rows.addressable:
        return None, f"{path} holds .jsonl rows, which are not counted ahead"
    n_rows, stripes = base.rows.n_rows, slots // unit
    per = "pair of samples" if unit == 2 else "sample"
    if n_rows < stripes:
        if t.row_reading == "striped":
            raise ConfigError(
                f"training.row_reading = 'striped': {path} has {n_rows} rows, fewer than the {stripes} stripes (one per "
                f"{per} of the global batch); lower training.global_batch_size or set training.row_reading = 'auto'"
            )
        return None, (
            f"{path} has {n_rows} rows, fewer than the {stripes} stripes (one per {per} of the global batch); "
            "lower training.global_batch_size or set training.row_reading = 'sequential'"
        )
    return Stripes(make, base.description, base.rows, stripes, unit=unit), None


def striped_stream(
    cfg: JobConfig,
    tokenizer,
    seq_len: int,
    global_batch_size: int,
    batch_rank: int,
    batch_degree: int,
    log_epochs: bool,
) -> StripedStream | None:
    """The training data read in stripes (``training.row_reading``: 'auto' where the rows allow
    it; 'striped': every parquet / save_to_disk hf or chat source, an error where one has fewer
    rows than stripes or no source can be), or None (one stream, every rank reads every row)."""
    t = cfg.training
    if t.row_reading == "sequential":
        return None
    entries = t.sources or [{"kind": t.dataset, "path": t.dataset_path, "name": t.dataset, "weight": 1.0}]
    option = "training.dataset_path" if not t.sources else None
    sources, reasons = [], []
    for e in entries:
        where = option or f"training.sources '{e['name']}' path"
        stripes, why = _stripes(cfg, e["kind"], e["path"], where, tokenizer, seq_len, global_batch_size, log_epochs)
        sources.append(stripes if stripes is not None else e)
        if why is not None:
            reasons.append(why)
    if not any(isinstance(s, Stripes) for s in sources):
        if t.row_reading == "striped":
            raise ConfigError(
                f"training.row_reading = 'striped' needs parquet or save_to_disk rows of 'hf', 'chat' or 'preference' data: "
                f"{'; '.join(reasons)}; set training.row_reading = 'auto' or 'sequential'"
            )
        return None
    per_rank = global_batch_size // batch_degree
    owned = range(batch_rank * per_rank, (batch_rank + 1) * per_rank)
    pairs = any(isinstance(s, Stripes) and s.unit == 2 for s in sources)  # preference: one stripe per pair
    stripes_note = (
        f"read in {global_batch_size // 2} stripes of rows, one per pair of samples of the global batch "
        "(training.row_reading)"
        if pairs
        else f"read in {global_batch_size} stripes of rows, one per sample of the global batch (training.row_reading)"
    )
    if not t.sources:
        base = sources[0]
        return StripedStream(
            [base], [t.dataset], slots=global_batch_size, owned=owned, window=seq_len + 1, masked=t.dataset in MASKED,
            name=t.dataset, description=f"{base.description}; {stripes_note}",
        )  # fmt: skip
    streams = [
        s if isinstance(s, Stripes) else _source_stream(cfg, e, tokenizer, seq_len, log_epochs)
        for s, e in zip(sources, entries)
    ]
    schedule = MixtureSchedule(
        [e["weight"] for e in entries], t.seed, unit=2 if entries[0]["kind"] == "preference" else 1
    )
    striped = ", ".join(e["name"] for s, e in zip(sources, entries) if isinstance(s, Stripes))
    return StripedStream(
        streams, [e["name"] for e in entries], slots=global_batch_size, owned=owned, window=seq_len + 1,
        masked=any(e["kind"] in MASKED for e in entries), name="mixture", schedule=schedule,
        description=f"{_mixture_description(entries, schedule.shares)}; {striped} {stripes_note}",
    )  # fmt: skip


def document_separator(cfg: JobConfig, tokenizer) -> int | None:
    """The token that ends each packed document (the model's ``eos_id`` for block-causal
    masking): the tokenizer's EOS, or for chat data the conversations' separator
    (:func:`trainer.data.chat.chat_separator`)."""
    t = cfg.training
    if t.sources:
        chat = [(e, f"training.sources '{e['name']}' path") for e in t.sources if e["kind"] in MASKED]
    else:
        chat = [({"kind": t.dataset, "path": t.dataset_path}, "training.dataset_path")] if t.dataset in MASKED else []
    if chat:
        entry, option = chat[0]
        kind = ChatSource if entry["kind"] == "chat" else PreferenceSource
        return kind(entry["path"], tokenizer, DEFAULT_TOKENIZER_PATH, option=option).separator
    return tokenizer.eos_id


def build_validation_dataloader(cfg: JobConfig, tokenizer, batch_rank: int, batch_degree: int) -> PackedDataLoader:
    """The ``[validation]`` loader: its own dataset, global batch ``validation.global_batch_size``
    (-1: ``validation.local_batch_size`` x batch degree), each rank reading its contiguous slice
    in micro-batches of ``validation.local_batch_size``, like training. The synthetic corpus is drawn from another seed than training's, so it is
    held out."""
    v = cfg.validation
    stream = None
    if v.dataset == "chat":
        source, stream = chat_stream(cfg, v.dataset_path, tokenizer, v.seq_len, "validation.dataset_path", False)
    elif v.dataset == "preference":
        source, stream = preference_stream(cfg, v.dataset_path, tokenizer, v.seq_len, "validation.dataset_path", False)
    elif v.dataset == "hf":
        source = RowTextSource(v.dataset_path, option="validation.dataset_path", log_epochs=False)
    elif v.dataset == "synthetic":
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
        stream=stream,
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
    stream = striped_stream(
        cfg, tokenizer, seq_len, resolve_global_batch_size(global_batch_size, local_batch_size, batch_degree),
        batch_rank, batch_degree, log_epochs,
    )  # fmt: skip
    if stream is not None:
        source = stream
    elif t.sources:
        source = stream = mixture_stream(cfg, tokenizer, seq_len, log_epochs)
    elif t.dataset == "chat":
        source, stream = chat_stream(cfg, t.dataset_path, tokenizer, seq_len, "training.dataset_path", log_epochs)
    elif t.dataset == "preference":
        source, stream = preference_stream(cfg, t.dataset_path, tokenizer, seq_len, "training.dataset_path", log_epochs)
    else:
        source = build_source(cfg, log_epochs=log_epochs)
    loader = PackedDataLoader(
        source,
        tokenizer,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        batch_rank=batch_rank,
        batch_degree=batch_degree,
        stream=stream,
    )
    from trainer.config.long_run_specs import parse_skip_samples

    loader.skip_ranges = parse_skip_samples(t.skip_samples)
    return loader

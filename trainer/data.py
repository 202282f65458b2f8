"""Packed token streams with layout-invariant global batches and exact resumption.

Documents are tokenized, each followed by eos, concatenated, and cut into consecutive
windows of ``seq_len + 1`` tokens (inputs = window[:-1], labels = window[1:]). Window k
is "global sample k". Optimizer step s consumes global samples ``[s*G, (s+1)*G)``; the rank
with batch coordinate b of batch degree D owns the contiguous slice
``[s*G + b*G/D, s*G + (b+1)*G/D)`` and yields it as micro-batches of local_batch_size.

Consequently every parallel layout (any D, any local batch size) trains on exactly the
same global batch at every step, which is what makes loss curves comparable across
layouts and lets a run resume on a different number of GPUs. The price is that every
rank tokenizes the whole stream (and discards other ranks' samples); tokenization is
cheap next to a training step, and the alternative (sharding documents per rank) makes
the data order depend on the layout.

The resume state is the position of the next unconsumed step in the stream (sample index
plus a document cursor and token offset), identical on all ranks and independent of D.

``training.dataset = "tokens"`` reads the same stream from token shards written once by
``scripts/tokenize_dataset.py`` (:mod:`trainer.token_dataset`): window k is addressed
directly, so a rank reads only its own samples (O(its tokens), independent of D); the
step -> samples arithmetic and the resume state (a sample index and token position) are
the same.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from trainer.config import ConfigError, JobConfig, gradient_accumulation_steps, resolve_global_batch_size
from trainer.token_dataset import TokenDataset

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # unused by packing (no padding); exported for loss functions

# ----------------------------------------------------------------- synthetic corpus
#
# Small closed vocabularies and rigid templates give the corpus low conditional entropy
# (bigram structure, copyable key/value pairs, arithmetic, counting, cyclic sequences), so
# a debug-size model can drive its loss well below the unigram entropy in a few hundred
# steps - a quick end-to-end signal that training actually learns.

NAMES = [
    "alice",
    "bob",
    "carol",
    "dave",
    "erin",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "mallory",
    "oscar",
    "peggy",
    "trent",
    "victor",
    "wendy",
]
NOUNS = [
    "apple",
    "river",
    "stone",
    "window",
    "garden",
    "letter",
    "candle",
    "bridge",
    "forest",
    "mirror",
    "basket",
    "hammer",
    "ladder",
    "pencil",
    "rocket",
    "violin",
    "castle",
    "island",
    "lantern",
    "meadow",
    "engine",
    "feather",
    "jacket",
    "kettle",
]
ADJS = [
    "red",
    "small",
    "quiet",
    "bright",
    "old",
    "heavy",
    "green",
    "tiny",
    "warm",
    "broken",
    "golden",
    "silent",
    "strange",
    "gentle",
    "sharp",
    "round",
]
VERBS = [
    "found",
    "carried",
    "painted",
    "opened",
    "lost",
    "cleaned",
    "watched",
    "built",
    "moved",
    "dropped",
    "counted",
    "named",
]
PLACES = ["kitchen", "market", "harbor", "library", "village", "tower", "school", "station", "cellar", "valley"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "goat", "crow"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def _story(rng: random.Random) -> str:
    name, animal = rng.choice(NAMES), rng.choice(ANIMALS)
    templates = [
        lambda: f"{name} {rng.choice(VERBS)} the {rng.choice(ADJS)} {rng.choice(NOUNS)} in the {rng.choice(PLACES)} .",
        lambda: f"the {rng.choice(NOUNS)} was {rng.choice(ADJS)} and {rng.choice(ADJS)} .",
        lambda: f"{name} went to the {rng.choice(PLACES)} with the {animal} .",
        lambda: f"the {animal} {rng.choice(VERBS)} a {rng.choice(NOUNS)} .",
        lambda: f"then {name} saw {rng.randint(2, 9)} {rng.choice(NOUNS)}s near the {rng.choice(PLACES)} .",
    ]
    return "story : " + " ".join(rng.choice(templates)() for _ in range(rng.randint(3, 7)))


def _arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(5, 12)):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if rng.random() < 0.5:
            facts.append(f"{a} + {b} = {a + b} .")
        else:
            a, b = max(a, b), min(a, b)
            facts.append(f"{a} - {b} = {a - b} .")
    return "math : " + " ".join(facts)


def _lookup(rng: random.Random) -> str:
    keys = rng.sample(NOUNS, rng.randint(3, 6))
    table = {k: rng.randint(10, 99) for k in keys}
    defs = " ; ".join(f"{k} = {v}" for k, v in table.items())
    queries = " ; ".join(f"{k} = {table[k]}" for k in rng.sample(keys, len(keys)))
    return f"lookup : {defs} ? {queries} ."


def _count(rng: random.Random) -> str:
    start, n = rng.randint(0, 80), rng.randint(8, 16)
    return "count : " + " ".join(str(i) for i in range(start, start + n)) + " ."


def _echo(rng: random.Random) -> str:
    phrase = " ".join(rng.choice(NOUNS + ADJS + ANIMALS) for _ in range(rng.randint(3, 6)))
    return "echo : " + " | ".join([phrase] * rng.randint(2, 4)) + " ."


def _cycle(rng: random.Random) -> str:
    name, seq = rng.choice([("days", DAYS), ("months", MONTHS), ("letters", LETTERS)])
    start, n = rng.randrange(len(seq)), rng.randint(6, 14)
    return f"{name} : " + " ".join(seq[(start + i) % len(seq)] for i in range(n)) + " ."


_GENERATORS = [(_story, 0.3), (_arithmetic, 0.15), (_lookup, 0.2), (_count, 0.1), (_echo, 0.15), (_cycle, 0.1)]


def synthetic_document(seed: int, index: int) -> str:
    """Document ``index`` of the corpus for ``seed``; random access, so a resume or a rank
    can jump anywhere without generating the prefix (str seeds hash via SHA-512, stable
    across processes regardless of PYTHONHASHSEED)."""
    rng = random.Random(f"synthetic:{seed}:{index}")
    gens, weights = zip(*_GENERATORS)
    return rng.choices(gens, weights=weights)[0](rng)


def unigram_entropy(tokens: Iterable[int]) -> float:
    """Entropy (nats, like cross-entropy loss) of the token frequency distribution: the
    loss of the best context-free predictor, the bar a learning model must go below."""
    counts = Counter(tokens)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def bigram_conditional_entropy(tokens: Iterable[int]) -> float:
    """H(x_t | x_{t-1}) in nats: what a model using only the previous token can reach."""
    toks = list(tokens)
    pairs = Counter(zip(toks, toks[1:]))
    prev = Counter(toks[:-1])
    total = len(toks) - 1
    return -sum(c / total * math.log(c / prev[a]) for (a, _), c in pairs.items())


# ------------------------------------------------------------------ document sources


class DocumentSource(Protocol):
    """A document stream addressed by JSON-able cursors, so a position can be checkpointed.

    ``read(cursor)`` returns (text, ends_document, next_cursor); a long document may be
    returned as several pieces, only the last of which ends it.
    """

    name: str

    def start(self) -> list[int]: ...

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]: ...


class SyntheticSource:
    name = "synthetic"

    def __init__(self, seed: int):
        self.seed = seed

    def start(self) -> list[int]:
        return [0]

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]:
        return synthetic_document(self.seed, cursor[0]), True, [cursor[0] + 1]


class FileSource:
    """``.txt`` files (one document per file, streamed in ~1 MiB line-aligned pieces) or
    ``.jsonl`` files (one document per line, field ``text``). Files are visited in sorted
    path order and the stream wraps around (next epoch) when they are exhausted.

    Cursor: [epoch, file_index, byte_offset].
    """

    CHUNK_BYTES = 1 << 20

    def __init__(self, path: str, kind: str, *, option: str = "training.dataset_path"):
        if kind not in ("text", "jsonl"):
            raise ValueError(f"FileSource kind must be 'text' or 'jsonl', got {kind!r}")
        self.name, self.kind, self.path = kind, kind, path
        suffix = ".txt" if kind == "text" else ".jsonl"
        if not os.path.exists(path):
            raise ConfigError(f"{option} '{path}' does not exist; point it at a {suffix} file or a folder of them")

        def unreadable(err: OSError):
            raise ConfigError(
                f"{option}: cannot read '{err.filename}' ({err.strerror}); fix its permissions or point {option} elsewhere"
            )

        if os.path.isdir(path):
            files = sorted(
                os.path.join(root, f)
                for root, _, names in os.walk(path, onerror=unreadable)
                for f in names
                if f.endswith(suffix)
            )
        else:
            files = [path]
        for f in files:
            if not os.access(f, os.R_OK):
                unreadable(PermissionError(13, "Permission denied", f))
        self.files = [f for f in files if os.path.getsize(f) > 0]
        if not self.files:
            raise ConfigError(f"{option} '{path}' has no non-empty {suffix} files for dataset '{kind}'")
        self._fh = None
        self._fh_index = -1

    def start(self) -> list[int]:
        return [0, 0, 0]

    def _open(self, index: int):
        if self._fh_index != index:
            if self._fh is not None:
                self._fh.close()
            self._fh = open(self.files[index], "rb")
            self._fh_index = index
        return self._fh

    def _advance_file(self, epoch: int, index: int) -> list[int]:
        if index + 1 < len(self.files):
            return [epoch, index + 1, 0]
        logger.warning("dataset '%s' exhausted after epoch %d; starting over", self.path, epoch)
        return [epoch + 1, 0, 0]

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]:
        epoch, index, offset = cursor
        while True:
            fh = self._open(index)
            fh.seek(offset)
            if self.kind == "jsonl":
                line = fh.readline()
                end = fh.tell()
                if not line:
                    epoch, index, offset = self._advance_file(epoch, index)
                    continue
                nxt = [epoch, index, end]
                if not line.strip():
                    offset = end
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.files[index]} (byte {offset}): invalid JSON line: {e}") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(
                        f"{self.files[index]} (byte {offset}): each jsonl line needs a string field "
                        f"'text'; got keys {sorted(record) if isinstance(record, dict) else type(record).__name__}"
                    )
                return text, True, nxt
            data = fh.read(self.CHUNK_BYTES)
            if not data:  # offset at EOF: only reachable from a cursor saved at a file end
                epoch, index, offset = self._advance_file(epoch, index)
                continue
            if not data.endswith(b"\n"):
                data += fh.readline(self.CHUNK_BYTES)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                if e.start < len(data) - 3:
                    raise ValueError(f"{self.files[index]} (byte {offset + e.start}): not valid UTF-8") from None
                data = data[: e.start]  # a multi-byte character cut by the chunk limit
                text = data.decode("utf-8")
            end = offset + len(data)
            at_eof = end >= os.path.getsize(self.files[index])
            return text, at_eof, (self._advance_file(epoch, index) if at_eof else [epoch, index, end])


# ---------------------------------------------------------------------- packed stream


class PackedStream:
    """Sequential reader of global samples (windows of ``seq_len + 1`` tokens)."""

    def __init__(self, source: DocumentSource, tokenizer, seq_len: int):
        self.source, self.tokenizer, self.window = source, tokenizer, seq_len + 1
        self.eos_id = tokenizer.eos_id
        self.sample_index = 0
        self._cursor = source.start()
        self._tokens: np.ndarray | None = None
        self._pos = 0
        self._next_cursor: list[int] | None = None

    def _load(self) -> None:
        text, ends_doc, self._next_cursor = self.source.read(self._cursor)
        ids = self.tokenizer.encode(text)
        if ends_doc:
            ids.append(self.eos_id)
        self._tokens = np.asarray(ids, dtype=np.int64)

    def _current(self) -> np.ndarray:
        if self._tokens is None:
            self._load()
        while self._pos >= len(self._tokens):
            self._pos -= len(self._tokens)
            self._cursor = self._next_cursor
            self._load()
        return self._tokens

    def _advance(self, n_tokens: int, out: np.ndarray | None) -> None:
        filled = 0
        while filled < n_tokens:
            toks = self._current()
            n = min(n_tokens - filled, len(toks) - self._pos)
            if out is not None:
                out[filled : filled + n] = toks[self._pos : self._pos + n]
            self._pos += n
            filled += n

    def take(self, n_samples: int) -> torch.Tensor:
        out = np.empty(n_samples * self.window, dtype=np.int64)
        self._advance(len(out), out)
        self.sample_index += n_samples
        return torch.from_numpy(out.reshape(n_samples, self.window))

    def skip(self, n_samples: int) -> None:
        self._advance(n_samples * self.window, None)
        self.sample_index += n_samples

    def state(self) -> dict[str, Any]:
        self._current()  # normalise so the cursor points at the piece holding the next token
        return {"sample_index": self.sample_index, "cursor": list(self._cursor), "token_offset": int(self._pos)}

    def restore(self, state: dict[str, Any]) -> None:
        self.sample_index = int(state["sample_index"])
        self._cursor = list(state["cursor"])
        self._pos = int(state["token_offset"])
        self._tokens = None


# ------------------------------------------------------------------------ data loader


class PackedDataLoader:
    """Infinite iterator of (inputs, labels) micro-batches, each a CPU LongTensor of shape
    [local_batch_size, seq_len]; ``grad_accum_steps`` consecutive micro-batches form one
    rank's share of a global step."""

    def __init__(
        self,
        source: DocumentSource | TokenDataset,
        tokenizer,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        batch_rank: int,
        batch_degree: int,
    ):
        if seq_len <= 0 or local_batch_size <= 0:
            raise ConfigError(f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) must be > 0")
        if not 0 <= batch_rank < batch_degree:
            raise ConfigError(f"batch rank {batch_rank} must be in [0, batch degree {batch_degree})")
        self.grad_accum_steps = gradient_accumulation_steps(global_batch_size, local_batch_size, batch_degree)
        self.global_batch_size = resolve_global_batch_size(global_batch_size, local_batch_size, batch_degree)
        self.local_batch_size, self.seq_len = local_batch_size, seq_len
        self.batch_rank, self.batch_degree = batch_rank, batch_degree
        self.rank_samples = self.global_batch_size // batch_degree
        self.tokens_per_step = self.global_batch_size * seq_len  # global, for throughput
        self.source_name = source.name
        if isinstance(source, TokenDataset):  # pre-tokenized: read by address
            source.check_tokenizer(tokenizer)
            self._stream = source.stream(seq_len)
        else:
            self._stream = PackedStream(source, tokenizer, seq_len)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._step_start: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._pending:
            self._prepare_step()
        return self._pending.pop(0)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All grad_accum_steps micro-batches of the next step (must be at a step boundary)."""
        if self._pending:
            raise RuntimeError("next_step() called with micro-batches of the current step still unconsumed")
        self._prepare_step()
        batches, self._pending = self._pending, []
        return batches

    def _prepare_step(self) -> None:
        s = self._stream
        self._step_start = s.state()
        s.skip(self.batch_rank * self.rank_samples)
        windows = s.take(self.rank_samples)
        s.skip((self.batch_degree - 1 - self.batch_rank) * self.rank_samples)
        inputs, labels = windows[:, :-1], windows[:, 1:]
        b = self.local_batch_size
        self._pending = [
            (inputs[i : i + b].contiguous(), labels[i : i + b].contiguous()) for i in range(0, self.rank_samples, b)
        ]

    def state_dict(self) -> dict[str, Any]:
        """Position of the first step not fully consumed (a half-consumed step is replayed
        on resume, matching a model that has not taken that optimizer step)."""
        state = dict(self._step_start) if self._pending else self._stream.state()
        state.update(dataset=self.source_name, seq_len=self.seq_len)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dataset") != self.source_name:
            raise ValueError(
                f"data loader state is for dataset '{state.get('dataset')}' but this run uses "
                f"'{self.source_name}'; to start the new dataset from its beginning set "
                f'checkpoint.exclude_from_loading = ["dataloader"]'
            )
        if state.get("seq_len") != self.seq_len:
            logger.warning(
                "resuming data with seq_len %s (checkpoint had %s): the token position is kept, "
                "sample indices continue from %s",
                self.seq_len,
                state.get("seq_len"),
                state["sample_index"],
            )
        self._stream.restore(state)
        self._pending = []
        self._step_start = None


# ----------------------------------------------------------------- background loading


class BackgroundLoader:
    """Prepares the next step's micro-batches of a :class:`PackedDataLoader` on one background
    thread while the training thread runs the current step.

    The samples and their order are the wrapped loader's, unchanged: the thread calls its
    ``next_step()`` one step ahead, nothing else. ``state_dict()`` is the position of the next
    step the *trainer* will consume (the wrapped loader is one step further once a step is
    prefetched), so a checkpoint resumes exactly where the trainer stopped, prefetching or not.
    An exception raised while preparing a step (a dataset error) is raised again, unchanged, by
    the ``next_step()`` call that would have returned that step.

    On CUDA the thread also pins the micro-batches and copies them to ``device`` with
    non-blocking copies on a side stream; ``next_step()`` makes the caller's stream wait for
    them. Elsewhere the tensors stay on the CPU (the trainer moves them).

    ``wait_s``: seconds the last ``next_step()`` call blocked waiting for its data.
    """

    def __init__(self, loader: PackedDataLoader, device: torch.device | str | None = None):
        self.loader = loader
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._executor: ThreadPoolExecutor | None = None  # started by the first next_step()
        self._future: Future | None = None
        self._state: dict[str, Any] | None = None  # the trainer's position while a step is prefetched
        self.wait_s = 0.0

    def __getattr__(self, name: str) -> Any:  # grad_accum_steps, tokens_per_step, ...
        if name == "loader":  # not yet set (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _produce(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any], Any]:
        batches = self.loader.next_step()
        state = self.loader.state_dict()  # where the step after this one starts
        event = None
        if self._cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
                batches = [
                    (
                        x.pin_memory().to(self.device, non_blocking=True),
                        y.pin_memory().to(self.device, non_blocking=True),
                    )
                    for x, y in batches
                ]
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        return batches, state, event

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        start = time.perf_counter()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-prefetch")
        future = self._future if self._future is not None else self._executor.submit(self._produce)
        self._future = None
        batches, state, event = future.result()  # re-raises the thread's exception, if any
        self._state = state
        self._future = self._executor.submit(self._produce)
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for x, y in batches:  # allocated on the copy stream, used on this one
                x.record_stream(stream)
                y.record_stream(stream)
        self.wait_s = time.perf_counter() - start
        return batches

    def _drop(self) -> None:
        """Wait for the step in flight and discard it (its exception too)."""
        if self._future is not None:
            concurrent.futures.wait([self._future])
            self._future = None

    def state_dict(self) -> dict[str, Any]:
        if self._state is not None:
            return dict(self._state)
        return self.loader.state_dict()  # nothing consumed or prefetched yet (or a failed step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drop()  # the prefetched step came from the old position
        self._state = None
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Stop the thread once the step in flight, if any, is ready; that step is kept for the
        next ``next_step()`` (which starts a new thread), so nothing is skipped."""
        if self._future is not None:
            concurrent.futures.wait([self._future])
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> BackgroundLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncLoader:
    """The same interface without a thread (``training.prefetch = false``): every step is
    prepared on the training thread; ``wait_s`` is the time that took."""

    def __init__(self, loader: PackedDataLoader):
        self.loader = loader
        self.wait_s = 0.0

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        start = time.perf_counter()
        batches = self.loader.next_step()
        self.wait_s = time.perf_counter() - start
        return batches

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        pass

    def __enter__(self) -> SyncLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_source(cfg: JobConfig) -> DocumentSource | TokenDataset:
    t = cfg.training
    if t.dataset == "synthetic":
        return SyntheticSource(t.seed)
    if t.dataset == "tokens":
        return TokenDataset(t.dataset_path)
    return FileSource(t.dataset_path, t.dataset)


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
        source = FileSource(v.dataset_path, v.dataset, option="validation.dataset_path")
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
    cfg: JobConfig, tokenizer, batch_rank: int, batch_degree: int | None = None, *, batch=None
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
        build_source(cfg),
        tokenizer,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        batch_rank=batch_rank,
        batch_degree=batch_degree,
    )

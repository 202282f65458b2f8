"""The tokenizer's inputs: resolving each INPUT argument (files, folders, Hugging Face datasets,
``synthetic:SEED:DOCS``) and enumerating its units - (text, ends_document, cursor) - in order,
restartable from a cursor.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tools.tokenize.errors import BadInput
from trainer.config import ConfigError
from trainer.data import sources
from trainer.data.synthetic import synthetic_document

HF_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}
_SYNTHETIC = re.compile(r"^synthetic:(\d+):(\d+)$")


@dataclass
class InputSpec:
    spec: str  # as given
    kind: str  # text | jsonl | hf | synthetic
    path: str = ""
    files: list[str] = field(default_factory=list)
    builder: str = ""  # hf: parquet | arrow | json | "" (save_to_disk folder)
    seed: int = 0
    n_docs: int = 0
    documents: str = "file"  # text: what one document of a .txt file is (training.text_documents)

    def identity(self) -> dict[str, Any]:
        """What a resumed run must find unchanged."""
        if self.kind == "synthetic":
            return {"kind": "synthetic", "seed": self.seed, "docs": self.n_docs}
        out = {
            "kind": self.kind,
            "path": os.path.abspath(self.path),
            "files": [
                [os.path.relpath(f, self.path) if f != self.path else "", os.path.getsize(f)] for f in self.files
            ],
        }
        if self.kind == "text" and self.documents != "file":  # folders written before the choice stay valid
            out["documents"] = self.documents
        return out


def _walk(path: str) -> list[str]:
    def unreadable(err: OSError):
        raise BadInput(f"input '{path}': cannot read '{err.filename}' ({err.strerror})")

    return sorted(os.path.join(root, f) for root, _, names in os.walk(path, onerror=unreadable) for f in names)


def resolve_input(spec: str, kind: str = "auto", documents: str = "file") -> InputSpec:
    """``documents``: what one document of a ``.txt`` input is (as training.text_documents)."""
    m = _SYNTHETIC.match(spec)
    if m and not os.path.exists(spec):
        if kind not in ("auto", "synthetic"):
            raise BadInput(f"input '{spec}' is the synthetic corpus but --kind is {kind}")
        return InputSpec(spec, "synthetic", seed=int(m.group(1)), n_docs=int(m.group(2)))
    if not os.path.exists(spec):
        raise BadInput(
            f"input '{spec}' does not exist (expected a .txt/.jsonl/.parquet/.arrow/.json file, a folder of "
            f"them, a Hugging Face save_to_disk folder, or synthetic:SEED:DOCS)"
        )
    if os.path.isdir(spec):
        if any(os.path.isfile(os.path.join(spec, n)) for n in ("state.json", "dataset_dict.json")) and kind in (
            "auto",
            "hf",
        ):
            return InputSpec(spec, "hf", spec, files=[f for f in _walk(spec) if os.path.isfile(f)])
        files = _walk(spec)
        by_kind: dict[str, list[str]] = {"text": [], "jsonl": [], "hf": []}
        for f in files:
            ext = os.path.splitext(f)[1]
            k = {".txt": "text", ".jsonl": "jsonl"}.get(ext) or ("hf" if ext in HF_SUFFIXES else None)
            if k:
                by_kind[k].append(f)
        if kind == "auto":
            found = [k for k, fs in by_kind.items() if fs]
            if not found:
                raise BadInput(f"input folder '{spec}' has no .txt, .jsonl, .parquet, .arrow or .json files")
            if len(found) > 1:
                raise BadInput(
                    f"input folder '{spec}' holds {' and '.join(found)} files; choose which with --kind {'|'.join(found)}"
                )
            kind = found[0]
        chosen = by_kind.get(kind)
        if not chosen:
            raise BadInput(f"input folder '{spec}' has no files for --kind {kind}")
    else:
        ext = os.path.splitext(spec)[1]
        if kind == "auto":
            kind = {".txt": "text", ".jsonl": "jsonl"}.get(ext) or ("hf" if ext in HF_SUFFIXES else "")
            if not kind:
                raise BadInput(
                    f"input '{spec}': unknown file type '{ext}' (expected .txt, .jsonl, .parquet, .arrow, .json); "
                    f"or name the reader with --kind text|jsonl|hf"
                )
        chosen = [spec]
    for f in chosen:
        if not os.access(f, os.R_OK):
            raise BadInput(f"input '{spec}': cannot read '{f}' (permission denied)")
    out = InputSpec(spec, kind, spec, files=chosen, documents=documents)
    if kind == "hf":
        builders = {HF_SUFFIXES.get(os.path.splitext(f)[1]) for f in chosen} - {None}
        if len(builders) != 1:
            raise BadInput(f"input '{spec}': mixes {', '.join(sorted(builders))} files; give them as separate inputs")
        out.builder = builders.pop()
    elif kind not in ("text", "jsonl"):
        raise BadInput(f"--kind must be auto, text, jsonl, hf or synthetic, got {kind!r}")
    return out


def _units_filesource(spec: InputSpec, start: list[int] | None) -> Iterator[tuple[str, bool, Any]]:
    """The streaming path's own reader, for one epoch."""
    try:
        src = sources.FileSource(spec.path, spec.kind, documents=spec.documents, log_epochs=False)
    except ConfigError as exc:  # e.g. every file empty
        raise BadInput(f"input '{spec.spec}': {str(exc).replace('training.dataset_path ', '')}") from None
    cursor = list(start) if start else src.start()
    while True:
        try:
            text, ends_doc, nxt = src.read(cursor)
        except ConfigError as exc:  # files of blank lines only: nothing to read
            raise BadInput(f"input '{spec.spec}': {str(exc).replace('training.dataset_path ', '')}") from None
        # a jsonl (or line / blank_line text) read that ran past the last file returns a
        # document of the next epoch
        if nxt[0] > cursor[0] and (spec.kind == "jsonl" or spec.documents != "file"):
            return
        yield text, ends_doc, cursor
        if nxt[0] > 0:
            return
        cursor = nxt


def _hf_dataset(spec: InputSpec, split: str):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise BadInput(
            f"input '{spec.spec}' is a Hugging Face dataset but the `datasets` package is not installed; "
            f"pip install datasets"
        ) from None
    try:
        if not spec.builder:
            ds = datasets.load_from_disk(spec.path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise BadInput(
                        f"input '{spec.spec}' has splits {sorted(ds)}, not '{split}'; choose one with --split"
                    )
                ds = ds[split]
            return ds
        return datasets.load_dataset(spec.builder, data_files=list(spec.files), split="train", streaming=True)
    except BadInput:
        raise
    except Exception as exc:  # datasets raises many types for unreadable input
        raise BadInput(
            f"input '{spec.spec}': the datasets library cannot read it ({type(exc).__name__}: {exc})"
        ) from None


def _units_hf(spec: InputSpec, start: list[int] | None, text_field: str, split: str) -> Iterator[tuple[str, bool, Any]]:
    ds = _hf_dataset(spec, split)
    row = start[0] if start else 0
    names = ds.column_names
    if names is not None and text_field not in names:
        raise BadInput(
            f"input '{spec.spec}' has no column '{text_field}' (columns: {names}); choose one with --text-field"
        )
    if row:
        ds = ds.skip(row)
    for record in ds:
        text = record.get(text_field)
        if not isinstance(text, str):
            raise BadInput(
                f"input '{spec.spec}' row {row}: column '{text_field}' is {type(text).__name__}, not a string"
            )
        yield text, True, [row]
        row += 1


def _units_synthetic(spec: InputSpec, start: list[int] | None) -> Iterator[tuple[str, bool, Any]]:
    for i in range(start[0] if start else 0, spec.n_docs):
        yield synthetic_document(spec.seed, i), True, [i]


def iter_units(
    specs: list[InputSpec], start: list | None = None, *, text_field: str = "text", split: str = "train"
) -> Iterator[tuple[str, bool, list]]:
    """(text, ends_document, cursor) for every unit of every input in order; ``cursor`` =
    [input index, inner cursor] restarts the enumeration at that unit."""
    first = start[0] if start else 0
    for i in range(first, len(specs)):
        spec, inner = specs[i], (start[1] if start and i == first else None)
        if spec.kind in ("text", "jsonl"):
            units = _units_filesource(spec, inner)
        elif spec.kind == "hf":
            units = _units_hf(spec, inner, text_field, split)
        else:
            units = _units_synthetic(spec, inner)
        for text, ends, cursor in units:
            yield text, ends, [i, cursor]

"""What a Hugging Face export holds besides the weights, so that transformers, PEFT and vLLM
open it with nothing else: the tokenizer files and chat template, ``generation_config.json``,
and the ``config.json`` fields of the folder the run started from.

Every export (``step-N-hf`` of ``checkpoint.last_save_in_hf`` / ``save_in_hf_every``, the merged
LoRA folder, the PEFT folder, and ``scripts/convert_hf.py``'s) is written from a
:class:`ModelRecord`: the model's name and args, the Hugging Face folder the run started from
or was sized by (its path, its ``config.json`` and ``generation_config.json`` as read at the
start) and the run's tokenizer path. A run stores its record in every step checkpoint
(``extra["model"]``), so a conversion afterwards needs no ``--flavor`` and still finds the
source's fields even where the source folder has moved (the tokenizer files are read from
the recorded path).

* ``config.json`` (:func:`carry_config`): ours (the adapter's ``hf_config`` of the run's args),
  then every field of the source's ``config.json`` the run did not change: a field the run
  did not change writes the same value for the source's own args and for the run's (the ids,
  including eos lists like Llama 3.1 Instruct's ``[128001, 128008, 128009]``; the sliding-window
  fields; the rope parameters, as one group, in the source's spelling); a field we do not write
  (``layer_types``, ...) is kept as is unless it lists one entry per layer and the run changed
  the depth. ``max_position_embeddings`` is the source's, or the run's ``training.seq_len`` when
  that is longer. ``torch_dtype``/``dtype`` are the export's.
* ``generation_config.json``: the source folder's, carried as is (sampling defaults included);
  else derived from the tokenizer: ``bos``/``pad`` and, as ``eos_token_id``, the token that ends
  an assistant turn in the chat template (plus the tokenizer's eos when it differs).
* tokenizer files: for a ``tokenizer.json`` the file and its folder's ``tokenizer_config.json``,
  ``special_tokens_map.json``, ``chat_template.jinja`` (and the other files transformers reads);
  a folder without ``tokenizer_config.json`` (the shipped tokenizer) gets one naming the
  bos/eos/pad tokens and the chat template (the built-in one for the shipped tokenizer). A
  tiktoken ``tokenizer.model`` is copied with the Hugging Face files of its folder when there
  are any; the byte tokenizer has no Hugging Face form.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models import registry
from models.common.hf_config import same_value

__all__ = [
    "GENERATION_CONFIG_FILE",
    "TOKENIZER_FILES",
    "ModelRecord",
    "abs_tokenizer",
    "carry_config",
    "peft_base_name",
    "record_for_folder",
    "record_for_run",
    "tokenizer_ids",
    "write_extras",
]

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# the tokenizer files transformers' AutoTokenizer reads from a folder
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_ROPE = ("rope_theta", "rope_scaling", "rope_parameters")
# the export's own, or what describes files and code it does not hold
_NOT_CARRIED = frozenset(
    {
        "torch_dtype", "dtype", "transformers_version", "_name_or_path", "architectures", "model_type", "auto_map",
        "quantization_config",
    }
)  # fmt: skip


@dataclass
class ModelRecord:
    """What a run's exports are written from (stored in its step checkpoints as a dict)."""

    model: str
    args: dict[str, Any]  # dataclasses.asdict of the model's args
    flavor: str = ""
    source: str = ""  # the Hugging Face folder the run started from or was sized by ('' none)
    source_config: dict[str, Any] | None = None  # its config.json
    source_generation: dict[str, Any] | None = None  # its generation_config.json
    # model.tokenizer_path, absolute ('' the shipped tokenizer, 'bytes'); None: no tokenizer files
    tokenizer: str | None = ""
    seq_len: int = 0  # training.seq_len: the longest sequence the run trained on

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def model_args(self):
        """The model's args, rebuilt from the record."""
        spec = registry.get_model_spec(self.model, registry.flavor_names(self.model)[0])
        cls = type(spec.args)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in self.args.items() if k in known})


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def abs_tokenizer(path: str | None) -> str | None:
    """A tokenizer path as recorded: absolute, except '' (the shipped one), 'bytes' and None."""
    return path if path in (None, "", "bytes") else os.path.abspath(path)


def record_for_folder(model: str, args, folder: str, tokenizer: str | None) -> ModelRecord:
    """The record of a model sized by the Hugging Face ``folder`` (or its config.json)."""
    folder = os.path.abspath(folder if os.path.isdir(folder) else os.path.dirname(folder))
    return ModelRecord(
        model=model,
        args=dataclasses.asdict(args),
        flavor=registry.HF_FLAVOR,
        source=folder,
        source_config=_read_json(os.path.join(folder, "config.json")),
        source_generation=_read_json(os.path.join(folder, GENERATION_CONFIG_FILE)),
        tokenizer=abs_tokenizer(tokenizer),
    )


def record_for_run(cfg, model_args, source: str = "") -> ModelRecord:
    """The record of a run with config ``cfg`` building ``model_args``; ``source`` the Hugging
    Face folder it started from or was sized by (default: ``checkpoint.initial_load_path`` with
    ``initial_load_in_hf``, else ``model.hf_config``)."""
    c = cfg.checkpoint
    if not source:
        source = c.initial_load_path if (c.initial_load_in_hf and c.initial_load_path) else cfg.model.hf_config
    folder = ""
    if source:
        folder = source if os.path.isdir(source) else os.path.dirname(source)
        folder = os.path.abspath(folder)
    config = _read_json(os.path.join(folder, "config.json")) if folder else None
    generation = _read_json(os.path.join(folder, GENERATION_CONFIG_FILE)) if folder else None
    return ModelRecord(
        model=cfg.model.name,
        args=dataclasses.asdict(model_args) if dataclasses.is_dataclass(model_args) else {},
        flavor=cfg.model.flavor,
        source=folder if config is not None else "",
        source_config=config,
        source_generation=generation,
        tokenizer=abs_tokenizer(cfg.model.tokenizer_path),
        seq_len=int(cfg.training.seq_len),
    )


# ------------------------------------------------------------------------------ config.json


def _source_ours(record: ModelRecord, dtype: str) -> dict[str, Any] | None:
    """Our ``hf_config`` for the source's own args (what the fields are when the run changes
    nothing); None when the source config does not derive args here."""
    try:
        spec = registry.get_model_spec(record.model, registry.HF_FLAVOR, record.source_config)
        return registry.get_hf_adapter(record.model, spec.args).hf_config(dtype)
    except (ValueError, KeyError, TypeError):
        return None


def carry_config(ours: Mapping[str, Any], record: ModelRecord | None, ids: Mapping[str, Any] | None = None) -> dict:
    """``config.json`` of an export: ``ours`` (the adapter's) with the source's fields the run
    did not change (module docstring) and, for ids the source does not set, ``ids`` (from the
    tokenizer)."""
    out = dict(ours)
    source = record.source_config if record is not None else None
    if source:
        base = _source_ours(record, str(ours.get("torch_dtype", "bfloat16")))
        depth_changed = base is None or not same_value(ours.get("num_hidden_layers"), base.get("num_hidden_layers"))
        for k, v in source.items():
            if k in _NOT_CARRIED or k in _ROPE or k == "max_position_embeddings":
                continue
            if k not in ours:
                per_layer = isinstance(v, list) and len(v) == source.get("num_hidden_layers")
                if not (per_layer and depth_changed):
                    out[k] = v
            elif base is not None and k in base and _same(ours[k], base[k]):
                out[k] = v
        if base is not None and all(_same(ours.get(k), base.get(k)) for k in _ROPE):
            for k in _ROPE:
                out.pop(k, None)
            out.update({k: source[k] for k in _ROPE if k in source})
        mpe = source.get("max_position_embeddings")
        if isinstance(mpe, int) and not isinstance(mpe, bool):
            out["max_position_embeddings"] = max(mpe, int(record.seq_len or 0))
    for k in _IDS:
        if (not source or source.get(k) is None) and ids and ids.get(k) is not None:
            out[k] = ids[k]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return same_value(a, b)


# ------------------------------------------------------------------------------ tokenizer


def _tokenizer_file(path: str | None) -> str | None:
    """The file ``load_tokenizer`` reads for ``path`` ('' = the shipped one); None for bytes."""
    from trainer.data.tokenizer import _FOLDER_CANDIDATES, DEFAULT_TOKENIZER_PATH

    if path is None or path == "bytes":
        return None
    resolved = path or DEFAULT_TOKENIZER_PATH
    if os.path.isdir(resolved):
        found = [os.path.join(resolved, c) for c in _FOLDER_CANDIDATES if os.path.isfile(os.path.join(resolved, c))]
        resolved = found[0] if found else ""
    return resolved if resolved and os.path.isfile(resolved) else None


def tokenizer_ids(path: str | None) -> dict[str, Any]:
    """bos/eos/pad ids of the tokenizer at ``path`` for ``generation_config.json``: eos is the
    token that ends an assistant turn of its chat template (and the tokenizer's eos when it
    differs), else the tokenizer's eos. Empty when it cannot be read."""
    from trainer.config import ConfigError
    from trainer.data.chat_template import load_chat_template
    from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

    if path is None or path == "bytes":
        return {}
    try:
        tok = load_tokenizer(path)
    except (ConfigError, ValueError, OSError):
        return {}
    eos: list[int] = []
    try:
        template = load_chat_template(tok, DEFAULT_TOKENIZER_PATH)
        ids, mask = template.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
        last = max(i for i, m in enumerate(mask) if m)
        if tok.token_text(ids[last]) in set(tok.special_token_texts()):
            eos.append(int(ids[last]))
    except (ConfigError, ValueError, ImportError, AttributeError):
        pass  # no chat template (or a tiktoken tokenizer): the tokenizer's eos ends generation
    if tok.eos_id not in eos:
        eos.append(int(tok.eos_id))
    out: dict[str, Any] = {"bos_token_id": int(tok.bos_id), "eos_token_id": eos[0] if len(eos) == 1 else eos}
    if tok.pad_id is not None:
        out["pad_token_id"] = int(tok.pad_id)
    return out


def _tokenizer_config(path: str) -> dict[str, Any] | None:
    """A ``tokenizer_config.json`` for a tokenizer.json whose folder has none: its special
    tokens and chat template (the built-in one for the shipped tokenizer)."""
    from trainer.config import ConfigError
    from trainer.data.chat_template import load_chat_template
    from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH, HFTokenizer

    try:
        tok = HFTokenizer(path)
    except (ConfigError, ValueError, OSError):
        return None
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name in ("bos", "eos", "pad"):
        text = tok.token_text(getattr(tok, f"{name}_id"))
        if text is not None:
            config[f"{name}_token"] = text
    try:
        config["chat_template"] = load_chat_template(tok, DEFAULT_TOKENIZER_PATH).source
    except ConfigError:
        pass
    return config


def _copy_tokenizer(path: str | None, out_dir: str) -> list[str]:
    """Copy the tokenizer at ``path`` into ``out_dir``; the names written."""
    file = _tokenizer_file(path)
    if file is None:
        return []
    folder = os.path.dirname(file)
    if not file.endswith(".json") and os.path.basename(folder) == "original":
        folder = os.path.dirname(folder)  # a Hugging Face repo keeps Meta's tokenizer.model under original/
    written = []
    if file.endswith(".json") or _is_json(file):
        shutil.copyfile(file, os.path.join(out_dir, "tokenizer.json"))
        written.append("tokenizer.json")
    for name in TOKENIZER_FILES:
        src = os.path.join(folder, name)
        if name not in written and os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
            written.append(name)
    if "tokenizer.json" in written and "tokenizer_config.json" not in written:
        config = _tokenizer_config(file)
        if config is not None:
            _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
            written.append("tokenizer_config.json")
    if "tokenizer.json" not in written:
        logger.warning("tokenizer %s has no Hugging Face tokenizer.json: the export holds no tokenizer", file)
    return written


def _is_json(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(64).lstrip().startswith(b"{")
    except OSError:
        return False


def _write_json(path: str, obj: Any) -> None:
    from trainer.runtime.files import atomic_write

    atomic_write(path, json.dumps(obj, indent=2) + "\n")


def write_extras(
    out_dir: str, record: ModelRecord | None, config: Mapping[str, Any] | None, ids: Mapping[str, Any] | None = None
) -> list[str]:
    """The tokenizer files and ``generation_config.json`` into ``out_dir`` (a folder being
    written); ``config`` the export's config.json (None for a PEFT folder), ``ids`` the
    tokenizer's (:func:`tokenizer_ids`). Returns the names."""
    if record is None:
        written = []
    else:
        written = _copy_tokenizer(record.tokenizer, out_dir)
    if config is None:
        return written
    if record is not None and record.source_generation is not None:
        generation = dict(record.source_generation)
    else:
        generation = {k: config[k] for k in _IDS if config.get(k) is not None}
        generation.update(ids or {})
    if generation:
        _write_json(os.path.join(out_dir, GENERATION_CONFIG_FILE), generation)
        written.append(GENERATION_CONFIG_FILE)
    return written


def peft_base_name(record: ModelRecord | None, base_path: str) -> str | None:
    """A portable ``base_model_name_or_path`` for a PEFT folder: the source config's
    ``_name_or_path`` when it is a name (not a path of some host), else the base folder's name
    (resolved by PEFT against the working directory, as a Hub id would be); None for a base that
    is the run's seeded init."""
    config = record.source_config if record is not None else None
    name = (config or {}).get("_name_or_path")
    if isinstance(name, str) and name and not os.path.isabs(name) and not name.startswith("."):
        return name
    if not base_path:
        return None
    return os.path.basename(os.path.normpath(base_path))

"""Keys whose default depends on other keys, resolved once, by :func:`validate_config`:

* ``model.attn_mask_type = 'auto'`` (the default): block-causal masking when the training data
  holds packed chat conversations (each conversation one document, as packing them needs),
  causal attention otherwise. :func:`attn_mask_type` answers it for every reader; the config
  keeps ``'auto'`` (what the user asked for, written back as such);
* ``model.hf_path = FOLDER``: start from a Hugging Face model folder in one option. The folder's
  config.json picks the family (``model.name``, from its ``architectures``) and every size
  (``model.flavor = 'hf'``), its weights are the starting point
  (``checkpoint.initial_load_path`` + ``initial_load_in_hf``) and its tokenizer the run's
  (``model.tokenizer_path``, unless set). :func:`apply_hf_path` writes those keys, so every
  reader of the config sees one model; a key that names something else is refused in one line.
"""

from __future__ import annotations

import json
import os

from models.registry import HF_FLAVOR, model_for_hf_config
from trainer.config.errors import ConfigError
from trainer.config.fields import TOKENIZER_FILES

__all__ = ["apply_hf_path", "attn_mask_type", "packed_chat"]


def packed_chat(cfg) -> bool:
    """Whether the training data packs several chat conversations into a window."""
    t = cfg.training
    chat = t.dataset == "chat" or any(src.get("kind") == "chat" for src in t.sources)
    return chat and t.chat_packing == "packed"


def attn_mask_type(cfg) -> str:
    """``model.attn_mask_type`` with ``'auto'`` resolved: ``'block_causal'`` for packed chat
    data, else ``'causal'``."""
    mask = cfg.model.attn_mask_type
    if mask != "auto":
        return mask
    return "block_causal" if packed_chat(cfg) else "causal"


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _read_config_json(folder: str) -> dict:
    file = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise ConfigError(
            f"model.hf_path: {folder} is not a folder; point it at a Hugging Face model folder (config.json, "
            "*.safetensors, tokenizer files)"
        )
    if not os.path.isfile(file):
        raise ConfigError(f"model.hf_path: {folder} holds no config.json; point it at a Hugging Face model folder")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"model.hf_path: {file} cannot be read as JSON ({exc}); restore the model's config.json"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.hf_path: {file} is not a JSON object; restore the model's config.json")
    return config


def apply_hf_path(cfg) -> None:
    """Resolve ``model.hf_path`` (module docstring); nothing when it is empty. Idempotent."""
    folder = cfg.model.hf_path
    if not folder:
        return
    config = _read_config_json(folder)
    try:
        name = model_for_hf_config(config)
    except ValueError as exc:
        raise ConfigError(f"model.hf_path: {os.path.join(folder, 'config.json')}: {exc}") from None
    c, m = cfg.checkpoint, cfg.model
    if c.initial_load_path and not _same_path(c.initial_load_path, folder):
        raise ConfigError(
            f"model.hf_path starts from {folder}, and checkpoint.initial_load_path names another starting point "
            f"({c.initial_load_path}); unset one of them"
        )
    sized_by = os.path.dirname(m.hf_config) or "." if m.hf_config.endswith(".json") else m.hf_config
    if m.hf_config and not _same_path(sized_by, folder):
        raise ConfigError(
            f"model.hf_path takes every size from {folder}/config.json, and model.hf_config names another "
            f"({m.hf_config}); unset model.hf_config"
        )
    if not m.tokenizer_path:
        if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
            raise ConfigError(
                f"model.hf_path: {folder} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the model's "
                "tokenizer files there, or set model.tokenizer_path (the shipped one: assets/tokenizer/tokenizer.json)"
            )
        m.tokenizer_path = folder
    m.name, m.flavor, m.hf_config = name, HF_FLAVOR, ""
    c.initial_load_path, c.initial_load_in_hf = folder, True

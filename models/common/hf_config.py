"""``config.json`` helpers shared by the Hugging Face adapters (``models/*/hf_adapter.py``).

* :class:`ConfigField`, :func:`rope_config`, :func:`same_value`: reading and comparing fields;
* :data:`IGNORED_FIELDS`: fields of every ``config.json`` that do not change the model's math
  (ids, dtype, versions, the generation cache, init ranges, the context length written for
  inference), skipped by the unknown-field check;
* the supported architectures (``architectures`` entry -> our model name), filled by
  ``models.registry.register_model`` from each adapter's ``hf_architectures``, so a refusal of
  an unsupported architecture names every one that loads (:func:`architecture_refusal`).

Each adapter lists the fields it reads (``config_fields_read``); a field that is neither read
nor in :data:`IGNORED_FIELDS` is refused by name (:func:`unknown_fields`): an unknown field may
change the math, and training a model that silently differs from its checkpoint is worse than
a one-line refusal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from models.common.args import DecoderArgs

__all__ = [
    "IGNORED_FIELDS",
    "ConfigField",
    "HFConfigCheck",
    "HFConfigMismatch",
    "architecture_refusal",
    "need",
    "register_architectures",
    "rope_config",
    "same_value",
    "supported_architectures",
    "unknown_fields",
]

# Fields that never change the forward or the loss of the models we load.
IGNORED_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "auto_map",
        "_name_or_path",
        "tokenizer_class",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        # the inference context length: our RoPE table is as long as the training sequence
        # (models that derive a rope setting from it read it themselves)
        "max_position_embeddings",
        # transformers < 5 split Llama-style matmuls into this many slices: same product
        "pretraining_tp",
    }
)


class HFConfigMismatch(ValueError):
    """A ``config.json`` that does not describe the chosen model/flavor. ``mismatches`` holds
    ``(field, config.json value, our value)`` for every field that differs; the message names
    them all on one line, with the fix."""

    def __init__(self, message: str, mismatches: list[tuple[str, Any, Any]] | None = None) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches or [])


@dataclass(frozen=True)
class ConfigField:
    """One compared ``config.json`` field: its name there, its value there, ours, the name of
    our field (for the message) and whether it is a shape (what :meth:`infer_flavor` uses)."""

    field: str
    theirs: Any
    ours: Any
    our_name: str
    shape: bool = True


def rope_config(config: Mapping[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from a ``config.json`` in either format: transformers < 5
    (``rope_theta`` + ``rope_scaling``) or >= 5 (``rope_parameters`` with ``rope_theta`` and
    ``rope_type`` inside). ``scaling`` is None for plain RoPE, else a dict with ``rope_type``."""
    params = config.get("rope_parameters")
    theta = config.get("rope_theta")
    scaling = config.get("rope_scaling")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        legacy = scaling if isinstance(scaling, Mapping) else {}
        # a scaling in rope_scaling beside default rope_parameters still scales (never dropped)
        if params.get("rope_type", params.get("type", "default")) == "default" and legacy.get(
            "rope_type", legacy.get("type", "default")
        ) not in (None, "default"):
            scaling = dict(legacy)
        else:
            scaling = dict(params)
    if not isinstance(scaling, Mapping):
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    return theta, scaling


def same_value(a: Any, b: Any) -> bool:
    """Equality for config values: floats compare with a relative 1e-9 (JSON round trips of
    decimal literals are exact, but a value may come in as int or float)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def unknown_fields(config: Mapping[str, Any], read: Iterable[str]) -> list[str]:
    """The fields of ``config`` that the adapter does not read and that are not harmless."""
    known = IGNORED_FIELDS | frozenset(read)
    return sorted(k for k in config if k not in known)


# ---------------------------------------------------------------------------------------------
# supported architectures

_ARCHITECTURES: dict[str, str] = {}  # HF architecture -> our model name
_MODEL_TYPES: dict[str, str] = {}  # HF model_type -> our model name


def register_architectures(model_name: str, architectures: Iterable[str], model_types: Iterable[str]) -> None:
    """Record that ``model_name`` loads ``architectures`` / ``model_types`` (called by
    ``register_model``)."""
    for arch in architectures:
        _ARCHITECTURES[arch] = model_name
    for model_type in model_types:
        _MODEL_TYPES[model_type] = model_name


def supported_architectures() -> dict[str, str]:
    """Every Hugging Face architecture some registered model loads -> that model's name."""
    return dict(_ARCHITECTURES)


def _listing() -> str:
    by_model: dict[str, list[str]] = {}
    for arch, model in sorted(_ARCHITECTURES.items()):
        by_model.setdefault(model, []).append(arch)
    return "; ".join(f"{', '.join(archs)} (model {model!r})" for model, archs in sorted(by_model.items()))


def architecture_refusal(config: Mapping[str, Any], model_name: str, loads: Iterable[str]) -> str:
    """Why model ``model_name`` (which loads ``loads``) cannot take ``config``: the model that
    does, or, when none does, every architecture that loads here."""
    archs = list(config.get("architectures") or [])
    what = f"config.json is a {'/'.join(archs) or '?'} checkpoint (model_type {config.get('model_type')!r})"
    other = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if other is None and not archs:
        other = _MODEL_TYPES.get(config.get("model_type"))
    if other is not None and other != model_name:
        return f"{what}; model {model_name!r} loads {'/'.join(loads)}: use model {other!r}, which loads it."
    if other is None:
        return f"{what}, an architecture no model here implements; supported Hugging Face architectures: {_listing()}."
    return f"{what}; model {model_name!r} with these args loads {'/'.join(loads)}. Pick the args matching it."


# ---------------------------------------------------------------------------------------------
# the config.json half of an adapter


class HFConfigCheck:
    """The ``config.json`` half of :class:`~models.common.hf_adapter.HFStateDictAdapter`: the
    config check, flavor inference and args derived from a ``config.json``. A model adapter sets
    the class attributes below and supplies :meth:`hf_config`, :meth:`_config_fields`,
    :meth:`_derive_args` (and, for extra rules, :meth:`_config_problems`)."""

    hf_architecture: str = ""
    model_type: str = ""
    model_name: str = ""
    # every architecture / model_type this model loads (pairwise), whatever the args
    hf_architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    # the config.json fields the model reads and checks; the rest is refused unless harmless
    # (IGNORED_FIELDS). None: not declared, no field is refused for being unknown.
    config_fields_read: frozenset[str] | None = None
    # (field, value when absent, the only value implemented): refused by name otherwise
    required_values: tuple[tuple[str, Any, Any], ...] = ()

    def __init__(self, args: DecoderArgs) -> None:
        self.args = args

    # ------------------------------------------------------------------ what a model supplies
    def hf_config(self, dtype: str = "bfloat16") -> dict:
        raise NotImplementedError

    def _config_fields(self, config: Mapping[str, Any]) -> list[ConfigField]:
        """Fields compared one to one (shapes and the rest)."""
        raise NotImplementedError

    def _config_problems(self, config: Mapping[str, Any]) -> list[tuple[str, Any, Any, str]]:
        """Extra non-shape problems: ``(field, config.json value, ours, explanation)``."""
        return []

    # ------------------------------------------------------------------ config.json
    def _unsupported(self) -> str | None:
        """Why these args have no Hugging Face equivalent (None if they have one)."""
        return None

    def _architecture_problem(self, config: Mapping[str, Any]) -> str | None:
        archs = config.get("architectures") or []
        model_type = config.get("model_type")
        if model_type == self.model_type and (not archs or self.hf_architecture in archs):
            return None
        return architecture_refusal(
            config, self.model_name, [f"{self.hf_architecture} (model_type {self.model_type!r})"]
        )

    @classmethod
    def unsupported_fields(cls, config: Mapping[str, Any]) -> list[tuple[str, Any, Any, str]]:
        """What no args of this model can express: ``(field, config.json value, the value we
        implement or None, why)`` for every field that is neither read nor harmless (it may
        change the math) and every read field set to what we do not implement."""
        out = []
        if cls.config_fields_read is not None:
            read = cls.config_fields_read | {f for f, _, _ in cls.required_values} | {"quantization_config"}
            out = [
                (f, config[f], None, "not modeled here; it may change the math") for f in unknown_fields(config, read)
            ]
        for field in ("rope_scaling", "rope_parameters"):
            value = config.get(field)
            if value is not None and not isinstance(value, Mapping):
                out.append(
                    (
                        field,
                        value,
                        None,
                        'not a rope setting: it must be an object with a "rope_type" (and its factors) of a scaling '
                        f"our {cls.model_name} implements, or null",
                    )
                )
        for field, default, want in cls.required_values:
            value = config.get(field, default)
            if not same_value(value, want):
                out.append((field, value, want, f"our {cls.model_name} implements only {want!r}"))
        if config.get("quantization_config"):
            out.append(("quantization_config", "present", None, "quantized weights: dequantize the checkpoint first"))
        return out

    @classmethod
    def _refuse_unsupported(cls, config: Mapping[str, Any]) -> None:
        bad = cls.unsupported_fields(config)
        if bad:
            parts = [f"{f}={v!r} in config.json" + (f" vs {w!r} here" if w is not None else "") + f" ({why})"
                     for f, v, w, why in bad]  # fmt: skip
            raise HFConfigMismatch(
                f"config.json sets what our {cls.model_name} does not implement: {'; '.join(parts)}. This checkpoint "
                "cannot be loaded here.",
                [(f, v, w) for f, v, w, _ in bad],
            )

    @classmethod
    def args_from_hf_config(cls, config: Mapping[str, Any]) -> DecoderArgs:
        """The args ``config`` (a parsed ``config.json``) describes, whatever its sizes: every
        field the model reads is taken from it and checked back (:meth:`check_hf_config` on
        the result), every field it does not model is refused by name, harmless ones are
        ignored. Raises :class:`HFConfigMismatch` (one line) otherwise."""
        archs = list(config.get("architectures") or [])
        if not (
            set(archs) & set(cls.hf_architectures) or (not archs and config.get("model_type") in cls.hf_model_types)
        ):
            loads = [f"{a} (model_type {t!r})" for a, t in zip(cls.hf_architectures, cls.hf_model_types)]
            raise HFConfigMismatch(
                architecture_refusal(config, cls.model_name, loads), [("model_type", config.get("model_type"), None)]
            )
        cls._refuse_unsupported(config)
        try:
            args = cls._derive_args(config)
            args.validate()
        except (KeyError, TypeError, ValueError) as exc:
            raise HFConfigMismatch(f"config.json does not describe a {cls.model_name} model: {exc}") from None
        cls(args).check_hf_config(config)
        return args

    @classmethod
    def _derive_args(cls, config: Mapping[str, Any]) -> DecoderArgs:
        """The model's args from ``config`` (after the architecture and unsupported-field checks)."""
        raise NotImplementedError

    def _mismatches(self, config: Mapping[str, Any], shapes_only: bool = False) -> list[tuple[str, Any, Any, str]]:
        out = []
        for f in self._config_fields(config):
            if shapes_only and not f.shape:
                continue
            if not same_value(f.theirs, f.ours):
                out.append((f.field, f.theirs, f.ours, f.our_name))
        if not shapes_only:
            out.extend(self._config_problems(config))
        return out

    def check_hf_config(self, config: Mapping[str, Any]) -> None:
        """Raise :class:`HFConfigMismatch` naming every field of ``config`` (a parsed
        ``config.json``) that differs from these args, with both values and the fix."""
        problem = self._unsupported()
        if problem:
            raise HFConfigMismatch(problem)
        problem = self._architecture_problem(config)
        if problem:
            raise HFConfigMismatch(
                problem,
                [("model_type", config.get("model_type"), self.model_type)],
            )
        self._refuse_unsupported(config)
        mismatches = self._mismatches(config)
        if mismatches:
            parts = [
                f"{field}={theirs!r} in config.json vs {ours!r} here ({why})" for field, theirs, ours, why in mismatches
            ]
            raise HFConfigMismatch(
                f"config.json does not match this {self.model_name} flavor: {'; '.join(parts)}. Pick the flavor "
                "(and overrides) matching the checkpoint, or omit it to take every size from config.json (no "
                "--flavor in convert_hf.py; model.flavor = 'hf' in training).",
                [(f, t, o) for f, t, o, _ in mismatches],
            )

    @classmethod
    def infer_flavor(cls, config: Mapping[str, Any], flavors: Mapping[str, DecoderArgs]) -> str | None:
        """The flavor whose shapes match ``config`` (vocab_size ignored when no flavor matches
        it, since callers override it from the tokenizer); None if none or several match.
        Only shapes are compared: rope, eps and routing details are check_hf_config's."""
        matches: list[tuple[str, bool]] = []
        for name, args in flavors.items():
            try:
                adapter = cls(args)
            except ValueError:
                continue
            if adapter._architecture_problem(config) is not None:
                continue
            mism = adapter._mismatches(config, shapes_only=True)
            rest = [m for m in mism if m[0] != "vocab_size"]
            if not rest:
                matches.append((name, not mism))
        exact = [n for n, vocab_ok in matches if vocab_ok]
        if len(exact) == 1:
            return exact[0]
        if not exact and len(matches) == 1:
            return matches[0][0]
        return None


def need(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, or a ValueError naming the missing field (for ``_derive_args``)."""
    if config.get(key) is None:
        raise ValueError(f"it has no {key!r}, which sets the model's shape")
    return config[key]

"""The model registry: name -> everything the trainer, the config check and the parallelism
code need to know about a model, so they refer to models by string and never by type or by
probing attributes.

A model is a package under ``models/`` (args + flavors, a :class:`~models.common.decoder.Decoder`
subclass, its blocks) plus one :func:`register_model` line at the bottom of this file; see
``docs/adding_a_model.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from models.common.args import DecoderArgs
from models.common.decoder import Decoder
from models.common.hf_adapter import HFStateDictAdapter
from models.common.hf_config import architecture_refusal, register_architectures, supported_architectures
from models.deepseek_v3 import DeepSeekV3, deepseek_v3_flavors
from models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from models.llama3 import Llama3, llama3_flavors
from models.llama3.hf_adapter import Llama3HFAdapter
from models.parallelize import parallelize_model
from models.qwen3 import Qwen3, qwen3_flavors
from models.qwen3.hf_adapter import Qwen3HFAdapter
from parallel_dims.model_rules import ModelRules

__all__ = [
    "HF_FLAVOR",
    "ModelEntry",
    "ModelSpec",
    "build_model",
    "flavor_names",
    "get_hf_adapter",
    "get_model_spec",
    "has_experts",
    "model_for_hf_config",
    "model_names",
    "model_rules",
    "register_model",
]


@dataclass(frozen=True)
class ModelEntry:
    """One registered model family."""

    name: str
    model_cls: type[Decoder]
    # flavor name -> args, in the order flavors are listed to users
    flavors: Mapping[str, DecoderArgs]
    # ``fn(model_or_stage, parallel_dims, ParallelizeOptions) -> model``; every model so far
    # shares models/parallelize.py, whose appliers read what the model declares.
    parallelize_fn: Callable[..., nn.Module] = parallelize_model
    # Converts between this model's state dict and a Hugging Face checkpoint's; None until one
    # is written.
    hf_state_dict_adapter: Any = None


@dataclass(frozen=True)
class ModelSpec:
    """One flavor of one model: the contract every caller goes through.

    ``args`` is a private copy (callers may mutate it). The model-dependent answers come from
    the model itself, so there is one definition of each: :attr:`has_experts` from the args
    (``DecoderArgs.num_experts``), :meth:`moe_layers` and :meth:`flops_per_token` from the
    :class:`~models.common.decoder.Decoder`."""

    name: str
    flavor: str
    args: DecoderArgs
    model_cls: type[Decoder]
    flavors: Mapping[str, DecoderArgs] = field(default_factory=dict)
    parallelize_fn: Callable[..., nn.Module] = parallelize_model
    hf_state_dict_adapter: Any = None

    @property
    def has_experts(self) -> bool:
        return self.args.has_experts

    @staticmethod
    def moe_layers(model: nn.Module) -> list[nn.Module]:
        """The MoE modules of ``model`` (a whole model or one pipeline stage)."""
        return model.moe_layers()

    @staticmethod
    def flops_per_token(model: nn.Module, seq_len: int) -> float:
        """Training FLOPs per token of ``model`` (whole, unsharded; meta is fine)."""
        return model.flops_per_token(seq_len)


_MODELS: dict[str, ModelEntry] = {}

# The flavor name meaning "every size from a Hugging Face config.json" (get_model_spec's
# hf_config): any size of a supported architecture, not a preset.
HF_FLAVOR = "hf"


def register_model(
    name: str,
    model_cls: type[Decoder],
    flavors: Mapping[str, DecoderArgs],
    *,
    parallelize_fn: Callable[..., nn.Module] = parallelize_model,
    hf_state_dict_adapter: Any = None,
) -> ModelEntry:
    """Make ``name`` known to the trainer, the config check and :func:`build_model`."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"Model name must be a non-empty string without surrounding spaces, got {name!r}.")
    if name in _MODELS:
        raise ValueError(f"Model {name!r} is already registered ({_MODELS[name].model_cls.__name__}).")
    if not (isinstance(model_cls, type) and issubclass(model_cls, Decoder)):
        raise TypeError(f"Model {name!r}: {model_cls!r} is not a subclass of models.common.decoder.Decoder.")
    if not flavors:
        raise ValueError(f"Model {name!r} needs at least one flavor.")
    for flavor, args in flavors.items():
        if not (isinstance(args, DecoderArgs) and dataclasses.is_dataclass(args)):
            raise TypeError(
                f"Model {name!r} flavor {flavor!r}: args must be a dataclass subclassing "
                f"models.common.args.DecoderArgs, got {type(args).__name__}."
            )
    if HF_FLAVOR in flavors:
        raise ValueError(f"Model {name!r}: the flavor name {HF_FLAVOR!r} is reserved (sizes from a config.json).")
    entry = ModelEntry(name, model_cls, MappingProxyType(dict(flavors)), parallelize_fn, hf_state_dict_adapter)
    _MODELS[name] = entry
    if hf_state_dict_adapter is not None:
        register_architectures(name, hf_state_dict_adapter.hf_architectures, hf_state_dict_adapter.hf_model_types)
    return entry


def model_names() -> list[str]:
    return sorted(_MODELS)


def flavor_names(name: str) -> list[str]:
    return list(_lookup_model(name).flavors)


def has_experts(name: str, flavor: str | None = None) -> bool:
    """Whether ``name``/``flavor`` has MoE layers (so expert parallelism applies); without a
    flavor, whether any flavor of ``name`` has."""
    entry = _lookup_model(name)
    if flavor is None:
        return any(args.has_experts for args in entry.flavors.values())
    return get_model_spec(name, flavor).has_experts


def _lookup_model(name: str) -> ModelEntry:
    if name not in _MODELS:
        raise ValueError(f"Unknown model {name!r}; valid models: {', '.join(model_names())}.")
    return _MODELS[name]


def get_model_spec(name: str, flavor: str, hf_config: Mapping[str, Any] | None = None) -> ModelSpec:
    """Spec with a private copy of the flavor's args (callers may mutate it freely). Flavor
    :data:`HF_FLAVOR` takes every size from ``hf_config`` (a parsed ``config.json``) through
    the model's Hugging Face adapter (``args_from_hf_config``: HFConfigMismatch, a ValueError
    naming the field, when the config is not one this model implements)."""
    entry = _lookup_model(name)
    if flavor == HF_FLAVOR:
        if hf_config is None:
            raise ValueError(
                f"flavor {HF_FLAVOR!r} of model {name!r} takes its sizes from a Hugging Face config.json, and none "
                "was given."
            )
        if entry.hf_state_dict_adapter is None:
            raise ValueError(f"Model {name!r} has no Hugging Face adapter, so flavor {HF_FLAVOR!r} is not available.")
        args = entry.hf_state_dict_adapter.args_from_hf_config(hf_config)
    elif flavor not in entry.flavors:
        raise ValueError(f"Unknown flavor {flavor!r} for model {name!r}; valid flavors: {', '.join(entry.flavors)}.")
    else:
        args = dataclasses.replace(entry.flavors[flavor])
    return ModelSpec(
        name,
        flavor,
        args,
        entry.model_cls,
        entry.flavors,
        entry.parallelize_fn,
        entry.hf_state_dict_adapter,
    )


def model_for_hf_config(config: Mapping[str, Any]) -> str:
    """The registered model that loads the architecture of ``config`` (a parsed config.json);
    ValueError naming every supported architecture when none does."""
    archs = supported_architectures()
    for arch in config.get("architectures") or []:
        if arch in archs:
            return archs[arch]
    if not config.get("architectures"):
        for name in model_names():
            cls = _MODELS[name].hf_state_dict_adapter
            if cls is not None and config.get("model_type") in cls.hf_model_types:
                return name
    raise ValueError(architecture_refusal(config, "", ()))


def model_rules(args: DecoderArgs, seq_len: int | None = None, sequence_parallel: bool = True) -> ModelRules:
    """What the layout rules need to know about a model with ``args`` (a flavor's args after
    overrides) trained on ``seq_len``: heads, the KV heads tp must divide, routed experts (0 for
    a dense model), layers. Check them with ``parallel_dims.check_model_layout(degrees, rules)``."""
    return ModelRules(
        n_heads=args.n_heads,
        n_kv_heads=args.tp_kv_heads,
        n_experts=args.num_experts,
        n_layers=args.n_layers,
        seq_len=seq_len,
        sequence_parallel=sequence_parallel,
        vocab_size=args.vocab_size,
        tied_embeddings=args.tie_word_embeddings,
    )


def get_hf_adapter(model_name: str, args: DecoderArgs) -> HFStateDictAdapter:
    """The registered Hugging Face state-dict adapter of ``model_name`` for ``args`` (the
    flavor's args after overrides). ValueError if the model has none."""
    cls = _lookup_model(model_name).hf_state_dict_adapter
    if cls is None:
        raise ValueError(
            f"Model {model_name!r} has no Hugging Face state-dict adapter, so it cannot load or save Hugging Face "
            "checkpoints; register one with register_model(..., hf_state_dict_adapter=...) (see "
            "models/common/hf_adapter.py)."
        )
    return cls(args)


def build_model(
    name: str,
    flavor: str,
    device: torch.device | str = "meta",
    *,
    hf_config: Mapping[str, Any] | None = None,
    **arg_overrides: Any,
) -> Decoder:
    """Construct ``name``/``flavor`` with ``arg_overrides`` applied (e.g. ``vocab_size`` to
    match a tokenizer, ``max_seq_len`` to match the training sequence length) on ``device``.
    The default meta device allocates nothing; follow with ``to_empty`` + ``init_weights``.
    ``hf_config``: the config.json of flavor :data:`HF_FLAVOR`."""
    spec = get_model_spec(name, flavor, hf_config)
    valid = [f.name for f in dataclasses.fields(spec.args)]
    unknown = sorted(set(arg_overrides) - set(valid))
    if unknown:
        raise ValueError(f"Unknown override(s) {unknown} for model {name!r}; valid keys: {', '.join(valid)}.")
    args = dataclasses.replace(spec.args, **arg_overrides)
    args.validate()
    with torch.device(device):
        return spec.model_cls(args)


# One line per model.
register_model("llama3", Llama3, llama3_flavors, hf_state_dict_adapter=Llama3HFAdapter)
register_model("deepseek_v3", DeepSeekV3, deepseek_v3_flavors, hf_state_dict_adapter=DeepSeekV3HFAdapter)
register_model("qwen3", Qwen3, qwen3_flavors, hf_state_dict_adapter=Qwen3HFAdapter)

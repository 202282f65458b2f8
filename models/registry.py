"""Name -> (config, model class, parallelize function) lookup, so trainers and configs refer to
models by string."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from models.deepseek_v3 import DeepSeekV3, DeepSeekV3Args, deepseek_v3_flavors
from models.llama3 import Llama3, Llama3Args, llama3_flavors
from models.parallelize import parallelize_model

_MODELS: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    "llama3": (Llama3, llama3_flavors),
    "deepseek_v3": (DeepSeekV3, deepseek_v3_flavors),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavor: str
    args: Llama3Args | DeepSeekV3Args
    model_cls: type[nn.Module]
    # Both models share one plan (models/parallelize.py); the appliers key on module names
    # that both follow.
    parallelize_fn: Callable[..., nn.Module] = parallelize_model


def model_names() -> list[str]:
    return sorted(_MODELS)


def flavor_names(name: str) -> list[str]:
    return list(_lookup_model(name)[1])


def _lookup_model(name: str) -> tuple[type[nn.Module], dict[str, Any]]:
    if name not in _MODELS:
        raise ValueError(f"Unknown model {name!r}; valid models: {', '.join(model_names())}.")
    return _MODELS[name]


def get_model_spec(name: str, flavor: str) -> ModelSpec:
    """Spec with a private copy of the flavor's args (callers may mutate it freely)."""
    model_cls, flavors = _lookup_model(name)
    if flavor not in flavors:
        raise ValueError(
            f"Unknown flavor {flavor!r} for model {name!r}; valid flavors: {', '.join(flavors)}."
        )
    return ModelSpec(name, flavor, dataclasses.replace(flavors[flavor]), model_cls)


def build_model(
    name: str, flavor: str, device: torch.device | str = "meta", **arg_overrides: Any
) -> nn.Module:
    """Construct ``name``/``flavor`` with ``arg_overrides`` applied (e.g. ``vocab_size`` to
    match a tokenizer, ``max_seq_len`` to match the training sequence length) on ``device``.
    The default meta device allocates nothing; follow with ``to_empty`` + ``init_weights``."""
    spec = get_model_spec(name, flavor)
    valid = [f.name for f in dataclasses.fields(spec.args)]
    unknown = sorted(set(arg_overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"Unknown override(s) {unknown} for model {name!r}; valid keys: {', '.join(valid)}."
        )
    args = dataclasses.replace(spec.args, **arg_overrides)
    args.validate()
    with torch.device(device):
        return spec.model_cls(args)

"""LoRA (low-rank adapters) as a model converter: ``model.converters = ["lora"]``, the ``[lora]``
section.

Each targeted linear layer (any ``nn.Linear``, torchao's ``Float8Linear`` included) keeps its
module, its name and its ``weight`` (frozen), and gains two trainable parameters on the same
module: ``lora_a`` ``[rank, in_features]`` and ``lora_b`` ``[out_features, rank]``. A forward hook
adds ``scale * (dropout(x) @ lora_a.T) @ lora_b.T`` to the layer's output, ``scale = alpha / rank``
(PEFT's ``LoraLayer`` with ``use_rslora = False``). Because nothing is swapped, the parameter
names of the base stay what they were (checkpoints, Hugging Face adapters, FQN-seeded init), and
the hook runs inside whatever the other converters and appliers made of the layer: float8
GEMMs on the frozen base, TP's DTensor input and output, activation checkpointing, compile.

The converter runs before any parallelism (``models/parallelize.py``), like float8:

* every parameter that is not an adapter gets ``requires_grad = False``: no gradient, so no
  optimizer state (``trainer/optim/optimizers.py`` takes ``requires_grad`` parameters only) and nothing of
  it in FSDP2's reduce-scatter or any gradient all-reduce (FSDP2 reduces the parameters that
  have a gradient); frozen and trainable parameters share one FSDP unit;
* under TP (:func:`shard_adapters_like_base`, right after the TP and EP appliers) the adapters
  are sharded to match their base layer: a column-wise base (``weight`` ``Shard(0)``, output
  features split) gets ``lora_b`` ``Shard(0)`` and ``lora_a`` replicated; a row-wise base
  (``Shard(1)``, input features split) gets ``lora_a`` ``Shard(1)`` and ``lora_b`` replicated.
  The column-wise adapter's output is then sharded like the base's output, the row-wise one's
  is a partial sum reduced together with the base's; the replicated factor's gradient comes out
  partial and DTensor sums it over tp. The same pass freezes again what the TP and EP appliers
  re-created as new parameters;
* the adapters are initialized like PEFT's defaults, from the run's FQN-seeded init
  (``models/common/init.py``): ``lora_a`` a normal of PEFT's Kaiming-uniform variance
  (``1 / (3 * in_features)``), ``lora_b`` zeros, so step 0 is the base model.

Routed experts (``lora.experts = true``, DeepSeek-V3): one adapter pair per expert on each of
``w1``/``w2``/``w3`` (``models/parallel/lora_experts.py``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from models.common.init import InitRule, ParamInit, canonical_fqn
from models.parallel.lora_experts import add_expert_adapters, new_param, redistribute_param, shard_expert_adapters

__all__ = [
    "ADAPTER_NAMES",
    "DEFAULT_TARGETS",
    "LORA_CONVERTERS",
    "LoRAOptions",
    "LoRAReport",
    "adapter_param_names",
    "check_lora",
    "convert_to_lora",
    "is_adapter_key",
    "lora_decisions",
    "lora_modules",
    "lora_startup_line",
    "shard_adapters_like_base",
    "store_frozen_in",
]

LORA_CONVERTERS = ("lora",)
# the attention and feed-forward projections of every model (DeepSeek-V3's shared experts are a
# feed-forward too); fnmatch patterns over module FQNs, matched on a suffix of dotted parts
DEFAULT_TARGETS = ("attention.*", "feed_forward.*", "shared_experts.*")
ADAPTER_NAMES = ("lora_a", "lora_b")
# never adapted: the vocabulary-sized head and the MoE routers (a top-k over their scores)
_NEVER = {"output": "the output projection", "router.gate": "a MoE router"}


@dataclass(frozen=True)
class LoRAOptions:
    """What the job plan carries for LoRA (``trainer.plan.parallelize_options``)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    experts: bool = False  # routed experts too: one adapter pair per expert
    frozen_dtype: str = "float32"  # "bfloat16": the frozen base stored in the compute dtype

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def describe(self) -> str:
        parts = [f"rank {self.rank}, alpha {self.alpha:g} (scale {self.scale:g})"]
        if self.dropout:
            parts.append(f"dropout {self.dropout:g}")
        parts.append("targets " + ", ".join(self.target_modules))
        if self.experts:
            parts.append("routed experts: one adapter pair per expert")
        if self.frozen_dtype != "float32":
            parts.append(f"frozen base stored in {self.frozen_dtype}")
        return "; ".join(parts)


@dataclass
class LoRAReport:
    adapted: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    trainable: int = 0  # adapter elements (full tensors)
    frozen: int = 0

    def summary(self) -> str:
        share = self.trainable / max(self.trainable + self.frozen, 1)
        out = f"{len(self.adapted)} linear layers adapted"
        if self.experts:
            out += f", {len(self.experts)} routed-expert modules (one pair per expert)"
        return out + f"; {self.trainable:,} trainable of {self.trainable + self.frozen:,} parameters ({share:.4%})"


def is_adapter_key(key: str) -> bool:
    """Whether a parameter / state-dict key is a LoRA adapter (``....lora_a``, ``....lora_b``,
    the experts' ``....w1_lora_a`` ...)."""
    last = key.rsplit(".", 1)[-1]
    return last in ADAPTER_NAMES or last.endswith(("_lora_a", "_lora_b"))


def _matches(fqn: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(fqn, p) or fnmatch.fnmatchcase(fqn, "*." + p) for p in patterns)


def lora_decisions(model: nn.Module, opts: LoRAOptions) -> dict[str, str | None]:
    """Every ``nn.Linear`` of ``model`` -> None (adapted) or why not. The one rule; the planner
    and the converter both use it."""
    out: dict[str, str | None] = {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        never = next((why for suffix, why in _NEVER.items() if fqn == suffix or fqn.endswith("." + suffix)), None)
        if never is not None:
            out[fqn] = never
        elif not _matches(fqn, opts.target_modules):
            out[fqn] = "not in lora.target_modules"
        else:
            out[fqn] = None
    return out


def _lora_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """output + scale * B(A(dropout(x))): runs after the base layer's forward and before any
    TP output hook, on the same (possibly DTensor) input the base layer saw."""
    x = args[0]
    if module.lora_dropout > 0:
        x = F.dropout(x, module.lora_dropout, module.training)
    return output + F.linear(F.linear(x, module.lora_a), module.lora_b) * module.lora_scale


def lora_rule(base: InitRule) -> InitRule:
    """``base`` for the model's own parameters; PEFT's default init for the adapters."""

    def rule(fqn: str, module: nn.Module, param_name: str) -> ParamInit:
        if param_name.endswith("lora_b"):
            return ParamInit.constant(0.0)
        if param_name.endswith("lora_a"):
            # PEFT: kaiming_uniform_(a=sqrt(5)) = U(+-1/sqrt(in)), variance 1 / (3 * in)
            in_features = getattr(module, param_name).shape[-1]
            return ParamInit.normal((3 * in_features) ** -0.5)
        return base(fqn, module, param_name)

    return rule


def convert_to_lora(model: nn.Module, opts: LoRAOptions) -> LoRAReport:
    """Before any parallelism: add adapters to the targeted linears of ``model`` in place and
    freeze everything else (see the module docstring). Works on meta-device models."""
    report = LoRAReport()
    modules = dict(model.named_modules())
    for fqn, why in lora_decisions(model, opts).items():
        if why is not None:
            continue
        mod = modules[fqn]
        mod.lora_a = new_param((opts.rank, mod.in_features), mod.weight)
        mod.lora_b = new_param((mod.out_features, opts.rank), mod.weight)
        mod.lora_scale = opts.scale
        mod.lora_dropout = opts.dropout
        mod.register_forward_hook(_lora_hook)
        report.adapted.append(fqn)
    if opts.experts:
        report.experts = add_expert_adapters(model, opts)
    base_rule = model.init_rule
    model.init_rule = lambda: lora_rule(base_rule())
    freeze_base(model)
    if opts.frozen_dtype != "float32":
        store_frozen_in(model, getattr(torch, opts.frozen_dtype))
    for name, p in model.named_parameters():
        if is_adapter_key(name):
            report.trainable += p.numel()
        else:
            report.frozen += p.numel()
    model._lora_report = report
    model._lora_options = opts
    return report


def freeze_base(model: nn.Module) -> None:
    """requires_grad on the adapters only."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Every frozen floating-point parameter re-created in ``dtype`` (before any weight is
    materialized: the init and the base loads write into it, converting). FSDP2 requires one
    dtype for the trainable parameters of a unit only, so the adapters stay float32 masters."""
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                setattr(mod, name, nn.Parameter(p.detach().to(dtype), requires_grad=False))
    if hasattr(model, "_retie"):  # a tied head shares the embedding's (new) parameter
        model._retie()


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The adapted linear modules of ``model`` (plain FQN without wrapper parts)."""
    return [(canonical_fqn(n), m) for n, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "weight")]


def adapter_param_names(model: nn.Module) -> list[str]:
    return [canonical_fqn(n) for n, _ in model.named_parameters() if is_adapter_key(n)]


def _adapter_placements(weight_placements) -> tuple[list, list]:
    """(lora_a, lora_b) placements of an adapter whose base weight has ``weight_placements``."""
    a, b = [], []
    for p in weight_placements:
        if isinstance(p, Shard) and p.dim == 0:  # column-wise: output features split
            a.append(Replicate())
            b.append(Shard(0))
        elif isinstance(p, Shard) and p.dim == 1:  # row-wise: input features split
            a.append(Shard(1))
            b.append(Replicate())
        else:
            a.append(Replicate())
            b.append(Replicate())
    return a, b


def shard_adapters_like_base(model: nn.Module) -> None:
    """After the TP and EP appliers: shard each adapter pair to match its base layer (see the
    module docstring), and freeze again every parameter that is not an adapter (the appliers
    re-create parameters)."""
    for _, mod in lora_modules(model):
        w = mod.weight
        if isinstance(w, DTensor):
            a, b = _adapter_placements(w.placements)
            redistribute_param(mod, "lora_a", w.device_mesh, a)
            redistribute_param(mod, "lora_b", w.device_mesh, b)
    if getattr(model, "_lora_options", None) is not None and model._lora_options.experts:
        shard_expert_adapters(model)
    freeze_base(model)


def check_lora(model_cls, args, opts: LoRAOptions) -> None:
    """The plan's check (a meta build: shapes only): the targets match some linear, expert
    adapters have experts to adapt (ValueError, one line). Expert adapters are split over ep and
    etp like their weights (models/parallel/lora_experts.py)."""
    with torch.device("meta"):
        model = model_cls(args)
    report = convert_to_lora(model, opts)
    if opts.experts and not report.experts:
        raise ValueError(
            f"lora.experts = true, but {model_cls.__name__} has no routed experts; set lora.experts = false"
        )
    if not report.adapted and not report.experts:
        raise ValueError(
            f"lora.target_modules {list(opts.target_modules)} matches no linear layer of {model_cls.__name__}"
            " (patterns match module names such as 'layers.0.attention.wq'); use e.g. ['attention.*', "
            "'feed_forward.*']"
        )


def lora_startup_line(model_parts: list[nn.Module], opts: LoRAOptions) -> str:
    """What the trainer prints at start-up: the options and what this rank's parts adapted."""
    total = LoRAReport()
    for part in model_parts:
        r = getattr(part, "_lora_report", None)
        if r is not None:
            total.adapted += r.adapted
            total.experts += r.experts
            total.trainable += r.trainable
            total.frozen += r.frozen
    return f"lora: {opts.describe()}; {total.summary()}"

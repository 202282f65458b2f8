"""The ``[lora]`` section (``model.converters = ["lora"]``; models/parallel/lora.py, docs/lora.md),
apart from trainer/config/schema.py so the schema stays one page; it registers the section there."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.parallel.lora import DEFAULT_TARGETS


def _opt(default, help: str, choices: tuple | None = None):
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help, "choices": choices})
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Lora:
    rank: int = _opt(8, "LoRA rank r (model.converters = ['lora']): adapters A [r, in] and B [out, r] per layer.")
    alpha: float = _opt(16.0, "LoRA alpha: the adapter's output is scaled by alpha / rank (PEFT's lora_alpha).")
    dropout: float = _opt(
        0.0,
        "Dropout on the adapter's input (PEFT's lora_dropout); 0 keeps runs comparable across layouts "
        "(dropout masks are drawn per rank).",
    )
    target_modules: list[str] = _opt(
        list(DEFAULT_TARGETS),
        "Linear layers that get adapters: fnmatch patterns over module names, matched on a suffix of "
        "dotted parts (e.g. 'attention.wq', 'feed_forward.*'); the default is every attention and "
        "feed-forward projection (DeepSeek-V3's shared experts included). The output head and MoE routers never.",
    )
    experts: bool = _opt(
        False,
        "Also adapt the MoE routed experts' grouped weights w1/w2/w3: one adapter pair per expert "
        "(split over ep and etp like the weights).",
    )
    frozen_dtype: str = _opt(
        "float32",
        "Storage dtype of the frozen base weights: bfloat16 halves their memory (they are never updated); "
        "needs parallelism.mixed_precision_param = 'bfloat16' (the compute dtype). The adapters and their "
        "optimizer state stay float32.",
        choices=("float32", "bfloat16"),
    )

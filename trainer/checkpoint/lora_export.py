"""Exports of a LoRA run (models/parallel/lora.py): (a) a PEFT adapter folder that
``peft.PeftModel.from_pretrained`` loads onto the ``transformers`` model of the base, (b) the base
with the adapters merged (``W + scale * B @ A``) as a plain Hugging Face folder.

PEFT folder: ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules`` the list of the adapted modules' names, or a regular expression of their full
Hugging Face names where a list would adapt more, ``base_model_name_or_path`` a portable name of
the base, not a path of the training host), the tokenizer files of the run and ``adapter_model.safetensors`` with ``base_model.model.<hf module>.lora_A.weight``
(``[r, in]``) and ``.lora_B.weight`` (``[out, r]``). Names come from the model's Hugging Face
adapter (``models/*/hf_adapter.py``): the base weight ``X.weight`` is stored as ``H.weight`` and
its adapters become ``H.lora_A`` / ``H.lora_B``. Where the adapter permutes the base's rows
(Llama's q/k rotary layout, :class:`~models.common.hf_adapter.RopeRows`), ``lora_B``'s rows are
permuted the same way (``perm(W + s B A) = perm(W) + s perm(B) A``); ``lora_A`` is unchanged.
Per-expert adapters have no PEFT form (transformers' MoE experts are fused modules), and on an
MoE model PEFT 0.21 moves feed-forward adapters (dense or shared experts, named like expert
projections) onto the fused routed experts: both are refused (:func:`peft_refusal`), the merged
export carries them.

Both are written from the live, sharded model (collective; every rank calls them) and from
step checkpoints through ``scripts/convert_hf.py`` (trainer/checkpoint/lora_offline.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from models import registry
from models.common.hf_adapter import Plain, RopeRows, interleaved_to_half_split
from models.parallel.lora import LoRAOptions, is_adapter_key
from trainer.checkpoint.folders import publish_folder
from trainer.checkpoint.hf_extras import ModelRecord, write_extras
from trainer.runtime.files import atomic_path, atomic_write, fsync_dir

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_base_keys",
    "export_merged_from_live",
    "export_peft_from_live",
    "hf_weight_modules",
    "merge_adapters",
    "peft_config",
    "peft_refusal",
    "peft_tensors",
    "target_modules",
    "write_peft_folder",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _base_key(adapter_key: str) -> tuple[str, str]:
    """(base weight key, 'a' or 'b') of an adapter key: ``X.lora_a`` -> ``X.weight``,
    ``E.w1_lora_b`` -> ``E.w1``."""
    owner, last = adapter_key.rsplit(".", 1)
    if last in ("lora_a", "lora_b"):
        return f"{owner}.weight", last[-1]
    weight, ab = last.rsplit("_lora_", 1)
    return f"{owner}.{weight}", ab


def adapter_base_keys(keys: Sequence[str]) -> dict[str, tuple[str, str]]:
    """base weight key -> (A key, B key) for every adapter pair in ``keys``."""
    pairs: dict[str, dict[str, str]] = {}
    for k in keys:
        if is_adapter_key(k):
            base, ab = _base_key(k)
            pairs.setdefault(base, {})[ab] = k
    return {base: (p["a"], p["b"]) for base, p in pairs.items()}


@torch.no_grad()
def merge_adapters(state: Mapping[str, Tensor], scale: float) -> dict[str, Tensor]:
    """``state`` (full tensors, base weights and adapters) with every adapted weight replaced by
    ``W + scale * B @ A`` (computed in float32, stored in W's dtype) and the adapters dropped.
    A pair whose base weight is not in ``state`` is an error."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for base, (ka, kb) in adapter_base_keys(list(state)).items():
        if base not in out:
            raise KeyError(f"adapters {ka}, {kb} without their base weight {base}")
        w = out[base]
        delta = torch.matmul(state[kb].float(), state[ka].float()) * scale
        out[base] = (w.float() + delta).to(w.dtype)
    return out


# PEFT (0.21) on transformers 5 rewrites, for MoE model types, every target named like an expert
# projection onto the fused experts' parameters (peft/utils/transformers_weight_conversion.py
# _convert_peft_config_moe): adapters of a dense MLP or of the shared experts would load onto the
# routed experts instead
_MOE_REMAPPED = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def peft_refusal(adapter_keys: Sequence[str], model_args) -> str | None:
    """Why the adapters ``adapter_keys`` of a model with ``model_args`` have no PEFT folder that
    loads correctly, or None."""
    if any(_base_key(k)[0].endswith(("w1", "w2", "w3")) and "_lora_" in k for k in adapter_keys):
        return "per-expert adapters (lora.experts) have no PEFT form (transformers' MoE experts are fused modules)"
    if getattr(model_args, "has_experts", False):
        mlp = sorted({k for k in adapter_keys if ".feed_forward." in k or ".shared_experts." in k})
        if mlp:
            return (
                f"PEFT loads the feed-forward adapters of an MoE model ({mlp[0]}, ...) onto its fused routed experts "
                "(it renames gate_proj/up_proj/down_proj targets for transformers 5 MoE models); set "
                "lora.target_modules = ['attention.*'] for a PEFT folder"
            )
    return None


def peft_tensors(adapters: Mapping[str, Tensor], hf_adapter) -> dict[str, Tensor]:
    """Our full adapter tensors -> PEFT's keys and layouts (see the module docstring); ValueError
    for adapters PEFT cannot load correctly (:func:`peft_refusal`)."""
    why = peft_refusal(list(adapters), hf_adapter.args)
    if why is not None:
        raise ValueError(f"no PEFT form: {why}; export the merged model instead")
    out: dict[str, Tensor] = {}
    for base, (ka, kb) in adapter_base_keys(list(adapters)).items():
        entry = hf_adapter._entry(base)
        if not isinstance(entry, (Plain, RopeRows)) or not entry.hf.endswith(".weight"):
            raise ValueError(
                f"{base} has no PEFT form (its Hugging Face layout is {type(entry).__name__}: per-expert adapters "
                "on transformers' fused experts); export the merged model instead"
            )
        module = entry.hf[: -len(".weight")]
        b = adapters[kb]
        if isinstance(entry, RopeRows):
            b = interleaved_to_half_split(b, entry.n_heads)
        out[f"{_PREFIX}{module}.lora_A.weight"] = adapters[ka].contiguous()
        out[f"{_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    return out


def target_modules(hf_modules: Sequence[str], all_modules: Sequence[str] | None = None) -> list[str] | str:
    """PEFT's ``target_modules`` for exactly the adapted modules ``hf_modules``: the list of their
    module names (``["k_proj", "q_proj", ...]``, PEFT's usual form: a name matches every module
    whose dotted name ends with it) when that list adapts nothing else among ``all_modules``
    (every module of the base with a weight), else a regular expression of the full names."""
    names = sorted({m.rsplit(".", 1)[-1] for m in hf_modules})
    if all_modules is not None:
        matched = {m for m in all_modules if m.rsplit(".", 1)[-1] in names}
        if matched == set(hf_modules):
            return names
    return "^(" + "|".join(re.escape(m) for m in sorted(hf_modules)) + ")$"


def hf_weight_modules(hf_adapter) -> list[str]:
    """Every module of the Hugging Face model with a ``.weight`` (from the adapter's keys)."""
    return [k[: -len(".weight")] for k in hf_adapter.hf_keys() if k.endswith(".weight")]


def peft_config(
    opts: LoRAOptions, hf_modules: Sequence[str], base_model: str | None = "", all_modules: Sequence[str] | None = None
) -> dict:
    """``adapter_config.json`` for the adapted Hugging Face modules ``hf_modules``
    (``all_modules``: every module of the base with a weight, see :func:`target_modules`);
    ``base_model``: a portable name of the base (trainer/checkpoint/hf_extras.py
    ``peft_base_name``)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": opts.rank,
        "lora_alpha": opts.alpha,
        "lora_dropout": opts.dropout,
        "target_modules": target_modules(hf_modules, all_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def write_peft_folder(
    out_dir: str, tensors: Mapping[str, Tensor], config: Mapping, dtype: torch.dtype, record: ModelRecord | None = None
) -> str:
    """Write the folder under ``<out>.tmp`` (with the tokenizer files of ``record``) and publish
    it as ``out_dir``."""
    from safetensors.torch import save_file

    final = os.path.abspath(out_dir)
    tmp = final + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    with atomic_path(os.path.join(tmp, ADAPTER_WEIGHTS)) as path:
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    atomic_write(os.path.join(tmp, ADAPTER_CONFIG), json.dumps(dict(config), indent=2) + "\n")
    write_extras(tmp, record, None)
    fsync_dir(tmp)
    return publish_folder(tmp, final)


def _hf_modules(tensors: Mapping[str, Tensor]) -> list[str]:
    return sorted({k[len(_PREFIX) : -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")})


def export_peft_from_live(
    model_parts: Sequence[nn.Module],
    out_dir: str,
    model_name: str,
    model_args,
    opts: LoRAOptions,
    *,
    dtype: str | torch.dtype = "float32",
    base_model: str | None = "",
    process_group=None,
    record: ModelRecord | None = None,
) -> str:
    """The PEFT folder of the live, sharded model (collective): every adapter gathered whole on
    rank 0, which writes the folder. Returns its path."""
    import torch.distributed as dist

    from trainer.checkpoint.live import LiveModel
    from trainer.checkpoint.state import export_dtype

    target = export_dtype(dtype)
    live = LiveModel(model_parts, process_group)
    keys = [k for k in live.order if is_adapter_key(k)]
    full = live.fetch(keys, 0)
    if live.rank == 0:
        hf_adapter = registry.get_hf_adapter(model_name, model_args)
        tensors = peft_tensors(full, hf_adapter)
        config = peft_config(opts, _hf_modules(tensors), base_model, hf_weight_modules(hf_adapter))
        write_peft_folder(out_dir, tensors, config, target, record)
    if live.distributed:
        dist.barrier(group=process_group)
    return os.path.abspath(out_dir)


def export_merged_from_live(
    model_parts: Sequence[nn.Module],
    out_dir: str,
    model_name: str,
    model_args,
    opts: LoRAOptions,
    *,
    dtype: str | torch.dtype = "float32",
    process_group=None,
    record: ModelRecord | None = None,
) -> str:
    """The base with the adapters merged, as a plain Hugging Face folder, from the live model
    (collective; the same plan and writer as the plain live export, each layer group fetched
    with its adapters and merged before ``to_hf``)."""
    from trainer.checkpoint.hf_live import export_model_to_hf

    def with_adapters(keys: Sequence[str], all_keys: Sequence[str]) -> list[str]:
        wanted = set(keys)
        return [k for k in all_keys if is_adapter_key(k) and _base_key(k)[0] in wanted]

    return export_model_to_hf(
        model_parts,
        out_dir,
        model_name,
        model_args,
        dtype=dtype,
        process_group=process_group,
        extra_keys=with_adapters,
        transform=lambda state: merge_adapters(state, opts.scale),
        record=record,
    )

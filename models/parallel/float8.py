"""Float8 training of the dense linear layers through torchao (``model.converters = ["float8"]``,
the ``[float8]`` section).

The converter swaps ``nn.Linear`` modules for torchao's ``Float8Linear`` before any other
parallelism is applied, so the TP, FSDP, activation-checkpointing and compile appliers see the
float8 modules. A ``Float8Linear`` keeps its weight (and the optimizer state) in the master
dtype; only the three GEMMs of each linear (output, grad input, grad weight) run as
``torch._scaled_mm`` on float8 operands with dynamic scales computed from the operands' amax:

* ``tensorwise``: one scale per operand tensor. Under TP and FSDP the weight is a DTensor (or
  all-gathered first), and torchao computes the amax of a DTensor as the max over every shard
  (an all-reduce), so the weight's scale does not depend on how it is sharded. With
  ``enable_fsdp_float8_all_gather`` FSDP2 all-gathers the weight already cast to float8 (one
  byte per element instead of two in bf16), with the amax all-reduced over the FSDP mesh
  only: under tp x fsdp each tp rank then scales its slice of the weight by that slice's amax,
  unless ``precompute_float8_dynamic_scale_for_fsdp`` (an amax over both meshes) is on (the
  plan turns it on under tp with the float8 all-gather, and the trainer precomputes before a
  run's first step too). The
  activation and output-gradient scales are the amax of the tensor a rank holds: the single
  process's under dp (same local batch) and tp, not under cp (half of each sequence) or pp
  (smaller micro-batches). tests/distributed/test_float8_layouts.py and
  tests/e2e/test_float8_compare.py measure both.
* ``rowwise`` / ``rowwise_with_gw_hp``: one scale per row of each operand. The forward and
  grad-input GEMMs scale the activations per token, which token sharding cannot change; the
  grad-weight GEMM contracts over tokens and scales along them, so cp and pp micro-batches do
  change its scales. torchao's rowwise GEMM returns bf16 for a float32 output, so a TP
  row-wise projection rounds each rank's partial product to bf16 before the sum.

What stays in high precision: the output projection (the logits are sensitive and vocab-sized),
the MoE routers (a top-k over their scores), any module named in ``float8.filter_fqns``
(substring match, torchtitan's rule) and any linear with a dimension that is not a multiple of
16 (``torch._scaled_mm``'s requirement).

The routed experts are grouped GEMMs, not linears: ``model.converters = ["float8_experts"]``
(torchtitan 0.2.2's ``"quantize.grouped_mm.float8"``) marks the ``GroupedExperts`` modules whose
FQN contains a string of ``float8.moe_fqns`` (default ``["experts"]``), and they run their three
GEMMs with torchao's rowwise float8 grouped recipe (``models/common/float8_grouped.py``:
torchao's ``torch._scaled_grouped_mm`` path on CUDA sm90+, one rowwise ``torch._scaled_mm`` per
expert elsewhere, CPU included). Their weights stay plain tensors in the master dtype (the cast
happens inside the GEMM), so FSDP, EP/ETP and checkpoints see nothing new. Either converter can
be used alone.

On a CPU the float8 GEMMs are numerics, not speed, and torch's own CPU ``_scaled_mm`` is a
float32 emulation everywhere but on hosts with AMX-INT8 (Intel Xeon), where it hands
tensorwise-scaled GEMMs to oneDNN at seconds per small GEMM. ``float8.cpu_gemm = "emulated"``
(the default) therefore runs every CPU ``_scaled_mm`` of the process as torch's emulation
(``parallel_dims.torch_compat.emulated_scaled_mm``: the same quantization, scales, float32
accumulation and output dtype, bitwise torch's kernel where torch emulates), eager and
compiled alike; ``"scaled_mm"`` keeps torch's kernel. CUDA runs are not affected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from models.common.cpu_info import has_amx_int8
from parallel_dims.torch_compat import emulate_cpu_scaled_mm

__all__ = [
    "CPU_GEMMS",
    "FLOAT8_CONVERTERS",
    "FLOAT8_EXPERT_CONVERTERS",
    "FLOAT8_RECIPES",
    "Float8Options",
    "Float8Report",
    "check_float8_experts",
    "check_float8_support",
    "convert_to_float8",
    "cpu_gemm_note",
    "float8_decisions",
    "float8_expert_decisions",
    "float8_startup_line",
    "import_torchao_float8",
    "plain_state_dict",
    "precompute_float8_scales",
    "set_cpu_gemm",
]

# model.converters names: ours (torchtitan before 0.2) and torchtitan 0.2.2's, same meaning
FLOAT8_CONVERTERS = ("float8", "quantize.linear.float8")  # the linear layers
FLOAT8_EXPERT_CONVERTERS = ("float8_experts", "quantize.grouped_mm.float8")  # the routed experts
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
CPU_GEMMS = ("emulated", "scaled_mm")  # float8.cpu_gemm: how CPU tensors run torch._scaled_mm
TORCHAO_MIN = (0, 16)  # Float8LinearConfig.from_recipe_name with all three recipes, CPU _scaled_mm

# always high precision, whatever filter_fqns says (module FQN suffixes)
_KEEP = {"output": "the output projection", "router.gate": "a MoE router"}


@dataclass(frozen=True)
class Float8Options:
    """What the job plan carries for float8 (``trainer.plan.parallelize_options``)."""

    recipe: str = "tensorwise"
    fsdp_float8_all_gather: bool = False  # applied only where FSDP really shards (mesh > 1)
    precompute_scale: bool = False  # one all-reduce for every weight's amax after the step
    filter_fqns: tuple[str, ...] = ()
    emulate: bool = False
    linears: bool = True  # model.converters has "float8": the linear layers convert
    moe_fqns: tuple[str, ...] = ()  # "float8_experts": routed-expert modules to convert (empty: none)
    cpu_gemm: str = "emulated"  # CPU_GEMMS: torch._scaled_mm on CPU tensors emulated, or torch's kernel

    def describe(self) -> str:
        parts = [f"recipe {self.recipe}" if self.linears else "linear layers in the parameter dtype"]
        if self.moe_fqns:
            parts.append("routed experts " + ", ".join(repr(f) for f in self.moe_fqns) + " rowwise")
        if self.fsdp_float8_all_gather:
            parts.append("FSDP float8 all-gather" + (" with precomputed scales" if self.precompute_scale else ""))
        if self.filter_fqns:
            parts.append("kept high precision: " + ", ".join(self.filter_fqns))
        if self.emulate:
            parts.append("emulated GEMMs")
        if self.cpu_gemm != "emulated":
            parts.append(f"CPU GEMMs {self.cpu_gemm}")
        return "; ".join(parts)


@dataclass
class Float8Report:
    """Which linear and routed-expert modules were converted and why the others were not
    (module FQN -> reason)."""

    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)  # routed-expert modules with float8 GEMMs
    experts_kept: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        reasons: dict[str, list[str]] = {}
        for fqn, why in self.kept.items():
            reasons.setdefault(why, []).append(fqn)
        kept = "; ".join(f"{why}: {_short(fqns)}" for why, fqns in reasons.items())
        return f"{len(self.converted)} linear layers in float8" + (f"; kept in high precision: {kept}" if kept else "")


def _short(fqns: list[str], limit: int = 4) -> str:
    return ", ".join(fqns[:limit]) + (f" and {len(fqns) - limit} more" if len(fqns) > limit else "")


def import_torchao_float8() -> Any:
    """``torchao.float8``, imported without torchao's start-up noise: on a host whose torch does
    not match torchao's prebuilt C++/CUDA extensions (every CPU build) torchao logs a warning per
    extension it cannot load; float8 training needs none of them (its GEMMs are
    ``torch._scaled_mm``). Raises ImportError when torchao is missing."""
    # torch's pytree logger also warns once about torchao registering an Enum as a constant
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return float8


def _version_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def check_float8_support(opts: Float8Options, device_type: str, compile_model: bool) -> None:
    """Raise ValueError (one line naming the fix) when float8 cannot train here: torchao missing
    or too old, a GPU without float8 GEMMs (before sm89; before sm90 for the routed experts'
    grouped GEMMs) and no emulation, emulation under torch.compile. The routed experts need
    torchao only on CUDA (its grouped kernel); elsewhere they run plain ``torch._scaled_mm``."""
    if opts.linears or (opts.moe_fqns and device_type == "cuda" and not opts.emulate):
        _check_torchao(opts)
    if device_type == "cuda" and torch.cuda.is_available() and not opts.emulate:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ValueError(
                f"float8 GEMMs need a GPU of compute capability 8.9 or newer (H100, L40S, ...); this "
                f"{torch.cuda.get_device_name()} is {major}.{minor}: remove the float8 converters from model.converters, "
                "or set float8.emulate = true to check the numerics (no speed-up)"
            )
        if opts.moe_fqns and major < 9:
            raise ValueError(
                f"float8 routed experts need torch._scaled_grouped_mm, which needs compute capability 9.0 or newer "
                f"(H100, B200); this {torch.cuda.get_device_name()} is {major}.{minor}: remove 'float8_experts' from "
                "model.converters (the linear layers can stay in float8), or set float8.emulate = true"
            )
        if opts.moe_fqns:
            _check_torchao_grouped_mm()
    if opts.emulate and compile_model:
        raise ValueError(
            "float8.emulate = true does not work under torch.compile (torchao's emulated GEMM is eager only): "
            "set compile.enable = false or float8.emulate = false"
        )


def _check_torchao_grouped_mm() -> None:
    """torchao's float8 grouped GEMM, which the routed experts use on CUDA (torchao >= 0.17)."""
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except ImportError:
        import torchao

        raise ValueError(
            f"'float8_experts' on CUDA needs torchao's float8 grouped GEMM "
            f"(torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm, torchao >= 0.17), which "
            f"torchao {torchao.__version__} lacks: pip install -U 'torchao>=0.17', or remove 'float8_experts' "
            "from model.converters"
        ) from None
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _check_torchao(opts: Float8Options) -> None:
    what = "'float8'" if opts.linears else "'float8_experts' on CUDA"
    try:
        import_torchao_float8()
        import torchao
    except ImportError:
        raise ValueError(
            f"model.converters entry {what} needs torchao, which is not installed for this python: "
            f"pip install 'torchao>=0.16' (make setup installs it), or remove {what.split()[0]} from model.converters"
        ) from None
    if _version_tuple(torchao.__version__) < TORCHAO_MIN:
        raise ValueError(
            f"model.converters entry {what} needs torchao >= {'.'.join(map(str, TORCHAO_MIN))}, found "
            f"{torchao.__version__}: pip install -U 'torchao>=0.16'"
        )


def float8_decisions(model: nn.Module, opts: Float8Options) -> dict[str, str | None]:
    """Every ``nn.Linear`` of ``model`` by FQN: None when it is converted, else why it stays in
    high precision. Works on meta-device models (only shapes are read)."""
    out: dict[str, str | None] = {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        keep = next((why for suffix, why in _KEEP.items() if fqn == suffix or fqn.endswith("." + suffix)), None)
        if keep is None and any(f in fqn for f in opts.filter_fqns):
            keep = "float8.filter_fqns"
        if keep is None and (mod.in_features % 16 or mod.out_features % 16):
            keep = "a dimension not a multiple of 16"
        out[fqn] = keep
    return out


def float8_expert_decisions(model: nn.Module, opts: Float8Options, etp: int = 1) -> dict[str, str | None]:
    """Every routed-expert module (a MoE layer's ``experts``) of ``model`` by FQN: None when its
    grouped GEMMs run in float8, else why not. ``etp``: the expert tensor-parallel degree, which
    slices the experts' hidden dimension (each rank's slice must be a multiple of 16 too). Works
    on meta-device models."""
    experts = {id(moe.experts) for moe in model.moe_layers()}
    out: dict[str, str | None] = {}
    for fqn, mod in model.named_modules():
        if id(mod) not in experts:
            continue
        hidden, dim = mod.w1.shape[1], mod.w1.shape[2]
        if not any(f in fqn for f in opts.moe_fqns):
            out[fqn] = "not matched by float8.moe_fqns"
        elif dim % 16 or hidden % (16 * etp):
            out[fqn] = f"a dimension not a multiple of 16 (dim {dim}, hidden {hidden // etp} per etp rank)"
        else:
            out[fqn] = None
    return out


def check_float8_experts(model: nn.Module, model_name: str, opts: Float8Options, etp: int = 1) -> None:
    """Raise ValueError (one line naming the fix) when ``model.converters`` asks for float8
    routed experts and none of ``model``'s (a meta build is enough) would convert."""
    if not opts.moe_fqns:
        return
    decisions = float8_expert_decisions(model, opts, etp)
    if not decisions:
        raise ValueError(
            f"model.converters has 'float8_experts' but the {model_name} model has no routed experts: "
            "remove it from model.converters ('float8' converts the linear layers)"
        )
    if all(why is not None for why in decisions.values()):
        fqn, why = next(iter(decisions.items()))
        raise ValueError(
            f"model.converters has 'float8_experts' but no routed-expert module converts ({fqn}: {why}): "
            f"set float8.moe_fqns to strings their FQNs contain (e.g. ['experts']), or remove 'float8_experts'"
        )


def _torchao_config(opts: Float8Options, fsdp_all_gather: bool) -> Any:
    f8 = import_torchao_float8()
    if opts.recipe == "tensorwise":
        return f8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=opts.emulate)
    import dataclasses

    config = f8.Float8LinearConfig.from_recipe_name(opts.recipe)
    return dataclasses.replace(config, emulate=opts.emulate) if opts.emulate else config


def convert_to_float8(model: nn.Module, opts: Float8Options, *, fsdp_all_gather: bool, etp: int = 1) -> Float8Report:
    """Before any parallelism: swap the convertible ``nn.Linear`` modules of ``model`` for
    ``Float8Linear`` in place (``opts.linears``), and mark the routed-expert modules that
    ``opts.moe_fqns`` selects to run their grouped GEMMs in float8. ``fsdp_all_gather``: the
    weights will be FSDP-sharded over more than one rank and ``opts`` asks for float8 all-gather
    (tensorwise only); ``etp``: the expert tensor-parallel degree. ``opts.cpu_gemm`` decides, for
    the whole process, how CPU tensors run ``torch._scaled_mm`` (module docstring)."""
    report = Float8Report()
    set_cpu_gemm(opts.cpu_gemm)
    if opts.linears:
        decisions = float8_decisions(model, opts)
        f8 = import_torchao_float8()
        config = _torchao_config(opts, fsdp_all_gather)
        f8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda _mod, fqn: decisions.get(fqn) is None
        )
        if opts.recipe == "rowwise":
            # inductor must round the rowwise scales' casts like eager does (torch issue 150859)
            import torch._inductor.config as inductor_config

            inductor_config.emulate_precision_casts = True
        for fqn, why in decisions.items():
            if why is None:
                report.converted.append(fqn)
            else:
                report.kept[fqn] = why
    if opts.moe_fqns:
        modules = dict(model.named_modules())
        for fqn, why in float8_expert_decisions(model, opts, etp).items():
            if why is None:
                modules[fqn].float8_emulate = opts.emulate
                report.experts.append(fqn)
            else:
                report.experts_kept[fqn] = why
    model._float8_report = report  # read by the trainer's start-up line
    return report


def float8_startup_line(model_parts: list[nn.Module], opts: Float8Options, device: torch.device | None = None) -> str:
    """What the trainer prints at start-up: the recipe and options, which linears and routed
    experts of this rank's model parts run in float8 and why the others do not, and which
    implementation runs the experts' float8 GEMMs on ``device``."""
    report = Float8Report()
    for part in model_parts:
        got = getattr(part, "_float8_report", None)
        if got is not None:
            report.converted += got.converted
            report.kept.update(got.kept)
            report.experts += got.experts
            report.experts_kept.update(got.experts_kept)
    if not opts.linears:
        linears = "linear layers in the parameter dtype"
    else:
        linears = report.summary()
    if opts.moe_fqns:
        from models.common.float8_grouped import BACKEND_NOTES, float8_grouped_backend

        backend = float8_grouped_backend(device or torch.device("cpu"), opts.emulate)
        experts = (
            f"{len(report.experts)} routed-expert modules' grouped GEMMs in float8 (rowwise, {BACKEND_NOTES[backend]})"
        )
        if report.experts_kept:
            experts += "; kept: " + _short([f"{f} ({why})" for f, why in report.experts_kept.items()])
    else:
        experts = "routed experts stay in the parameter dtype"
    where = ""
    if (device or torch.device("cpu")).type == "cpu" and not opts.emulate:
        where = "; " + cpu_gemm_note(opts.cpu_gemm)
    return f"float8: {opts.describe()}; {linears}; {experts}{where}; MFU stays priced at the parameter dtype's peak"


def set_cpu_gemm(cpu_gemm: str) -> str:
    """How this process runs ``torch._scaled_mm`` on CPU tensors from now on (``CPU_GEMMS``:
    ``float8.cpu_gemm``); returns the previous choice. Process-wide; :func:`convert_to_float8`
    sets it from its options."""
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"float8.cpu_gemm must be one of {', '.join(map(repr, CPU_GEMMS))}, got {cpu_gemm!r}")
    return "emulated" if emulate_cpu_scaled_mm(cpu_gemm == "emulated") else "scaled_mm"


def cpu_gemm_note(cpu_gemm: str) -> str:
    """What the start-up line says of how this CPU runs the float8 GEMMs (``float8.cpu_gemm``)."""
    if cpu_gemm == "emulated":
        return (
            "float8 GEMMs on this CPU emulated (torch._scaled_mm's float32 arithmetic: float8 operands "
            "times their scales, float32 GEMM; float8.cpu_gemm = 'scaled_mm' runs torch's kernel)"
        )
    slow = " (oneDNN on this AMX host: about a second per small GEMM)" if has_amx_int8() else ""
    return f"float8 GEMMs on this CPU by torch._scaled_mm{slow} (float8.cpu_gemm = 'scaled_mm')"


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """After the optimizer step: compute every float8-all-gathered weight's scale at once (one
    all-reduce of all the amaxes instead of one per weight in the next forward)."""
    f8 = import_torchao_float8()
    for part in model_parts:
        f8.precompute_float8_dynamic_scale_for_fsdp(part)


def _plain(t: Any) -> Any:
    """``t`` without torchao's float8 all-gather wrapper (``WeightWithDynamicFloat8CastTensor``,
    which holds the master weight as ``_tensor``): the same storage as a plain tensor (or a
    DTensor over a plain local tensor); anything else unchanged."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = t._local_tensor
        inner = _plain(local)
        if inner is local:
            return t
        return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    if (
        isinstance(t, torch.Tensor)
        and type(t) is not torch.Tensor
        and type(t).__name__ == "WeightWithDynamicFloat8CastTensor"
    ):
        return t._tensor
    return t


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A model or optimizer state dict with every float8 all-gather weight (and the optimizer
    moments torchao creates like it) as the plain master-dtype tensor it wraps, sharing its
    storage: a checkpoint then holds no torchao class (it loads without torchao, with float8 off,
    and with ``weights_only``), and DCP's in-place load still writes into the live weights."""
    return {k: _plain(v) for k, v in state.items()}

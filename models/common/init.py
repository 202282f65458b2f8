"""Layout-independent weight initialization.

A training run must start from the same weights whether the model is one process on CPU, FSDP
shards, a TP/EP layout, or a pipeline stage that holds only some layers; otherwise comparing
parallel runs against a reference run (or resuming a sweep on a different layout) is
meaningless. So every parameter is drawn, in full, on CPU, from its own generator seeded by
``(seed, fully-qualified name)``. The draw depends on nothing but that name and the parameter's
global shape; the local piece is then cut out the same way the parallelism cut the parameter.

Cost: each rank materializes every full parameter on CPU once (and, for DTensors, moves it to
the mesh device for slicing). That is seconds-to-minutes for the largest models and happens
once per run; correctness across layouts is worth it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.common.norms import RMSNorm
from parallel_dims.torch_compat import host_side

# Path components that wrappers (activation checkpointing, torch.compile, FSDP1) insert into
# parameter names. They are dropped so that wrapping a module does not change its weights.
_WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})

# Output projections that write into the residual stream; their std shrinks with depth so the
# residual variance stays bounded as layers are added (GPT-2 / Megatron practice).
_RESIDUAL_OUT_NAMES = frozenset({"wo", "w2"})


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is drawn: truncated normal (cut at ±3 std) or a constant."""

    kind: str
    std: float = 0.0
    value: float = 0.0

    @staticmethod
    def normal(std: float) -> ParamInit:
        if not std > 0:
            raise ValueError(f"ParamInit.normal needs std > 0, got {std}.")
        return ParamInit("normal", std=std)

    @staticmethod
    def constant(value: float) -> ParamInit:
        return ParamInit("constant", value=value)


InitRule = Callable[[str, nn.Module, str], ParamInit]


def canonical_fqn(fqn: str) -> str:
    """Parameter name with wrapper components removed."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_COMPONENTS)


def param_seed(seed: int, fqn: str) -> int:
    """63-bit generator seed from the run seed and the parameter's name. Uses SHA-256 rather
    than Python's ``hash()``, which is salted per process and would differ across ranks."""
    digest = hashlib.sha256(f"{int(seed)}|{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _truncated_normal_(out: torch.Tensor, std: float, gen: torch.Generator) -> torch.Tensor:
    """Normal(0, std) truncated at ±3 std by redrawing the ~0.3% of values outside.

    ``nn.init.trunc_normal_`` (inverse-CDF via ``erfinv``) is ~70x slower than ``normal_`` on
    CPU, which matters when every rank draws every full parameter of a multi-billion-parameter
    model. Rejection keeps the exact truncated distribution and stays deterministic because the
    redraws come from the same generator in the same order."""
    out.normal_(0.0, std, generator=gen)
    flat = out.view(-1)
    bound = 3 * std
    outside = (flat.abs() > bound).nonzero().squeeze(1)
    while outside.numel() > 0:
        redraw = torch.empty(outside.numel(), dtype=out.dtype).normal_(0.0, std, generator=gen)
        flat[outside] = redraw
        outside = outside[redraw.abs() > bound]
    return out


def full_init_tensor(spec: ParamInit, shape: torch.Size | tuple[int, ...], seed: int, fqn: str) -> torch.Tensor:
    """The full float32 CPU tensor for parameter ``fqn`` (a plain host tensor, also while
    ``comm.mode = 'local_tensor'`` simulates every rank: the draw is the same for all)."""
    with host_side():
        return _full_init_tensor(spec, shape, seed, fqn)


def _full_init_tensor(spec: ParamInit, shape: torch.Size | tuple[int, ...], seed: int, fqn: str) -> torch.Tensor:
    out = torch.empty(tuple(shape), dtype=torch.float32, device="cpu")
    if spec.kind == "constant":
        return out.fill_(spec.value)
    if spec.kind == "normal":
        gen = torch.Generator(device="cpu")
        gen.manual_seed(param_seed(seed, fqn))
        return _truncated_normal_(out, spec.std, gen)
    raise ValueError(f"Unknown ParamInit kind {spec.kind!r} for {fqn}; use 'normal' or 'constant'.")


@torch.no_grad()
def write_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (global shape, CPU) into ``param``, slicing it the way ``param`` is sharded
    when it is a DTensor. ``src_data_rank=None`` makes every rank slice its own copy instead of
    broadcasting from rank 0, which is valid because every rank drew the same full tensor."""
    if isinstance(param, DTensor):
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(
                f"Full init tensor {tuple(full.shape)} does not match the DTensor's global shape {tuple(param.shape)}."
            )
        local = distribute_tensor(
            full.to(dtype=param.dtype), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"Full init tensor {tuple(full.shape)} does not match parameter {tuple(param.shape)}.")
        param.copy_(full)


# std of a tied embedding/head weight (``tie_word_embeddings``); see ``standard_rule``.
TIED_EMBEDDING_STD = 0.02


def standard_rule(n_layers: int, dim: int, tied: bool = False) -> InitRule:
    """Init policy shared by both models:

    * norms: 1;
    * ``tok_embeddings``: std 1 (the residual stream starts at unit scale, which RMSNorm then
      sees without any dependence on ``dim``);
    * ``output``: std ``dim**-0.5`` so initial logits are O(1) and the first loss is ~ln(vocab);
    * ``tied`` (one weight for ``tok_embeddings`` and ``output``, and every pipeline-stage or MTP
      copy of it, all drawn under the name ``tok_embeddings.weight``): std
      ``TIED_EMBEDDING_STD`` = 0.02, HF's ``initializer_range`` of the tied Llama 3.2 and
      Qwen3 configs and torchtitan's current tied init. Why not either untied std: the logit of
      token ``v`` is ``norm(h) . e_v``, so with ``e ~ N(0, s^2)`` the logits of other tokens
      have std ``s * sqrt(dim)`` and, while the input's own embedding ``e_x`` dominates the
      residual ``h``, the input token's logit is about ``s * dim``. s = 1 makes that ``dim``
      (first loss ~250 at dim 256); s = ``dim**-0.5`` still ``sqrt(dim)`` (first loss 14.1 on
      llama3 debugmodel_tied, 12.6 on qwen3 debugmodel, for ln(2048) = 7.62). s = 0.02 gives
      a first loss of ln(vocab) + 0.08 (7.70 / 7.67) there, and 8.03 on Llama 3.2 1B's shape
      with vocab 2048 (other-token logit std 0.02 * sqrt(2048) = 0.9: ~ln(vocab) + 0.9**2 / 2);
      tests/unit/test_tied_init.py checks the band;
    * residual-writing projections (``wo``, ``w2``, including expert ``w2``):
      ``0.02 / sqrt(2 * n_layers)``, using the *global* layer count so a pipeline stage draws
      the same values as the full model;
    * everything else: std 0.02.
    """
    if n_layers <= 0 or dim <= 0:
        raise ValueError(f"standard_rule needs positive n_layers and dim, got {n_layers}, {dim}.")
    residual_std = 0.02 / math.sqrt(2 * n_layers)

    def rule(fqn: str, module: nn.Module, param_name: str) -> ParamInit:
        if isinstance(module, RMSNorm):
            return ParamInit.constant(1.0)
        if tied and fqn in ("tok_embeddings.weight", "output.weight"):
            return ParamInit.normal(TIED_EMBEDDING_STD)
        if fqn == "tok_embeddings.weight":
            return ParamInit.normal(1.0)
        if fqn == "output.weight":
            return ParamInit.normal(dim**-0.5)
        parts = fqn.split(".")
        owner = parts[-2] if len(parts) >= 2 else ""
        if owner in _RESIDUAL_OUT_NAMES or param_name in _RESIDUAL_OUT_NAMES:
            return ParamInit.normal(residual_std)
        return ParamInit.normal(0.02)

    return rule


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, rule: InitRule) -> None:
    """Draw every parameter of ``model`` from ``rule`` with a per-name generator and write it in,
    whatever the parameter's device or sharding."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"init seed must be an int, got {seed!r}.")
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            fqn = canonical_fqn(f"{module_name}.{param_name}" if module_name else param_name)
            if param.device.type == "meta":
                raise ValueError(
                    f"Parameter {fqn} is on the meta device; call model.to_empty(device=...) "
                    "before init_weights so parameters have real storage."
                )
            full = full_init_tensor(rule(fqn, module, param_name), param.shape, seed, fqn)
            write_full_into(param, full)

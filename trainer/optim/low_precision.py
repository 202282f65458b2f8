"""Optimizer state in bfloat16 (``optimizer.state_dtype = "bfloat16"``): AdamW's two moments and
Muon's momentum stored in bf16, half the bytes of float32, with stochastic rounding.

The treatment of rounding. The parameters stay float32 (meshtrain's master weights: mixed
precision casts only for compute), so the weight update itself is done in fp32 from fp32
moments and needs no compensation (Kahan summation pays off where the *weights* are bf16, as in
torchao's pure-bf16 optimizers; it would cost another buffer here and fix nothing). Each step
reads the stored bf16 moments into fp32, applies the EMA update in fp32, uses those fp32 values
for this step's parameter update, and stores them back in bf16 by **stochastic rounding**: a
value between two neighbouring bf16 numbers ``lo < x < hi`` is stored as ``hi`` with
probability ``(x - lo) / (hi - lo)``, so the stored moment equals the fp32 one in expectation
(unbiased, variance at most ulp^2 / 4). Round-to-nearest is biased where it matters: an EMA
``v <- b2 v + (1 - b2) g^2`` whose step ``(1 - b2)(g^2 - v)`` is below half an ulp of ``v``
(relative 2^-9) never moves, so ``v`` freezes at a stale value (the negative control of
tests/unit/test_low_precision_state.py); stochastic rounding moves it by a whole ulp with the
right probability. torchao's ``_fp32_to_bf16_sr`` (torchao/optim/quant_utils.py) rounds the same
way; torchtitan offers no bf16 moments of its own (it points to torchao).

The random bits. Rounding up adds a 16-bit integer to the fp32 bit pattern and truncates the low
16 bits. The integer is a hash of (global element index, parameter number, step, moment), not a
draw from a generator: every layout (one process, FSDP shards, TP shards, strided FSDP x TP
shards) rounds each element of the whole tensor with the same bits, the stream needs no state in
the checkpoint (a resume is bitwise the uninterrupted run) and no RNG is consumed (dropout and
data order are unaffected). The hash is Thomas Mueller's 32-bit integer mix on int32 tensors; one
hash per element serves both AdamW moments (its low and high 16 bits).

Checkpoints carry the moments in their stored dtype. Resuming across state dtypes casts: DCP
reads a float32 checkpoint into the bf16 state by round-to-nearest (once; the run then goes on
with stochastic rounding), and a bf16 checkpoint into float32 state exactly.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "STATE_DTYPES",
    "AdamWLowPrecision",
    "attach_state_dtype",
    "state_bytes",
    "state_bytes_fn",
    "state_bytes_per_param",
    "state_dtype_saving",
    "stochastic_round_bf16",
]

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_MASK32 = 0xFFFFFFFF
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def state_bytes_per_param(optimizer: str, state_dtype: str) -> int:
    """Bytes of optimizer state per trainable parameter element (what the planner prices):
    AdamW keeps two moments, Muon one momentum buffer (Muon's AdamW parameters price as AdamW),
    each of ``state_dtype``. The per-tensor step counter (one scalar per parameter tensor) is not
    per element and left out."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"optimizer.state_dtype {state_dtype!r}: use one of {tuple(STATE_DTYPES)}")
    moments = {"AdamW": 2, "Muon": 1}.get(optimizer)
    if moments is None:
        raise ValueError(f"optimizer {optimizer!r}: use 'AdamW' or 'Muon'")
    return moments * STATE_DTYPES[state_dtype].itemsize


def state_bytes_fn(cfg, state_dtype: str | None = None):
    """``(fqn, parameter) -> bytes of optimizer state per element`` under the optimizer config
    ``cfg``: :func:`state_bytes_per_param` of the optimizer the parameter's group routes it to
    (trainer/optim/groups.py ``choose``: Muon's matrices one buffer, AdamW's parameters two) in
    ``state_dtype`` (default ``cfg.state_dtype``). For models/parallel/offload.py
    ``cpu_offload_bytes`` and :func:`state_dtype_saving`."""
    from models.common.init import canonical_fqn
    from trainer.optim.groups import choose

    dtype = state_dtype or cfg.state_dtype
    return lambda name, p: state_bytes_per_param(choose(canonical_fqn(name), p.ndim, cfg).optimizer, dtype)


def state_dtype_saving(model_parts, cfg) -> int:
    """Bytes of optimizer state this rank saves with ``cfg.state_dtype`` (``cfg``: the optimizer
    config) against float32 state, from the model before the optimizer exists: each trainable
    parameter's local shard elements times the bytes per element :func:`state_bytes_fn` gives,
    float32 minus ``cfg.state_dtype``. What ``state_bytes`` of the built optimizer measures
    after its first step (the per-tensor step counters aside)."""
    fp32, ours = state_bytes_fn(cfg, "float32"), state_bytes_fn(cfg)
    saved, seen = 0, set()
    for part in model_parts:
        for name, p in part.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            saved += (p.to_local() if isinstance(p, DTensor) else p).numel() * (fp32(name, p) - ours(name, p))
    return saved


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state tensors (local shards of DTensors), measured."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if isinstance(v, DTensor) else v
                total += t.numel() * t.element_size()
    return total


def _signed32(v: int) -> int:
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Thomas Mueller's 32-bit integer hash on int32 tensors, in place: products wrap modulo
    2^32 (two's complement, as torch's integer kernels do on CPU and GPU), right shifts masked to
    be logical."""
    for _ in range(2):
        x = x.bitwise_xor_((x >> 16) & 0xFFFF).mul_(0x45D9F3B)
    return x.bitwise_xor_((x >> 16) & 0xFFFF)


def _split_rule(pl):
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if isinstance(pl, _StridedShard):
        return _StridedShard(0, split_factor=pl.split_factor)
    return Shard(0)


def global_index(p: torch.Tensor) -> torch.Tensor:
    """The flat index in the whole tensor of every element of ``p``'s local shard (int64, shaped
    like the local shard): each sharded dimension's positions follow the placements' own split
    rule, applied over the mesh dimensions left to right as DTensor does. A plain tensor, or a
    shard that is one contiguous run of the whole (dim-0 shards only), takes one arange."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if not isinstance(p, DTensor):
        return torch.arange(p.numel(), device=p.device).view(p.shape)
    mesh, coord = p.device_mesh, p.device_mesh.get_coordinate()
    index = [torch.arange(s) for s in p.shape]
    for i, pl in enumerate(p.placements):
        dim = getattr(pl, "dim", None)
        if dim is None:
            continue  # Replicate / Partial: every position
        d = dim % p.ndim
        pieces, _ = _split_rule(pl)._split_tensor(index[d], mesh.size(i), with_padding=False)
        index[d] = pieces[coord[i]]
    rows = index[0] if p.ndim else None
    inner = all(len(index[d]) == p.shape[d] for d in range(1, p.ndim))
    if p.ndim and inner and (len(rows) == 0 or int(rows[-1] - rows[0]) + 1 == len(rows)):
        start = int(rows[0]) * (p.numel() // max(p.shape[0], 1)) if len(rows) else 0
        return torch.arange(start, start + local.numel(), device=local.device).view(local.shape)
    flat = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(p.ndim)):
        shape = [1] * p.ndim
        shape[d] = -1
        flat = flat + index[d].view(shape) * stride
        stride *= p.shape[d]
    return flat.expand(local.shape).to(local.device)


def random_bits(index: torch.Tensor, salt: int) -> torch.Tensor:
    """32 pseudo-random bits per element (int32) from its global index (modulo 2^32) and a salt:
    the low and high 16 bits round two moments (:func:`low_bits`, :func:`high_bits`)."""
    x = index.to(torch.int32).mul_(0x61C88647).bitwise_xor_(_signed32(salt))
    return _mix32(x)


def low_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits & 0xFFFF


def high_bits(bits: torch.Tensor) -> torch.Tensor:
    return (bits >> 16) & 0xFFFF


def stochastic_round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16, up in magnitude with probability equal to the dropped
    fraction of an ulp: adds the 16 random ``bits`` (int32 in [0, 2^16)) to the low half of the
    fp32 pattern and truncates it. Infinities stay (their low half is 0, so nothing carries);
    torch's NaNs (quiet, the top mantissa bit set) stay NaN; a finite value above bf16's largest
    rounds up to inf with the probability of its fraction, as rounding should."""
    i = x.contiguous().view(torch.int32)
    return ((i + bits) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: low bits are 0


def salt(seed: int, step: int, param_no: int, moment: int) -> int:
    """One 32-bit salt per (seed, step, parameter, moment), itself hashed so neighbouring steps
    and parameters get unrelated streams."""
    v = torch.tensor(
        [_signed32(seed * 0x9E37 + step * 0x85EB + param_no * 0xC2B2 + moment * 0x27D4)], dtype=torch.int32
    )
    return int(_mix32(_mix32(v) ^ _signed32(param_no))[0])


def store(dst: torch.Tensor, x32: torch.Tensor, bits: torch.Tensor | None) -> None:
    """Write the fp32 ``x32`` into the local state tensor ``dst``: stochastically rounded with
    the 16 ``bits`` (int32) when ``dst`` is bf16, else copied."""
    if dst.dtype == torch.bfloat16:
        dst.copy_(stochastic_round_bf16(x32, bits))
    elif dst.data_ptr() != x32.data_ptr():
        dst.copy_(x32)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def attach_state_dtype(opt: torch.optim.Optimizer, state_dtype: torch.dtype, seed: int) -> None:
    """What an optimizer with low-precision state carries (AdamW here, Muon): its state dtype,
    the seed of the rounding bits, each parameter's number in the optimizer (salts the bits),
    and the hook that casts a loaded state dict to the state dtype."""
    opt.state_dtype, opt.seed = state_dtype, seed
    opt._number = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    opt.register_load_state_dict_post_hook(cast_state_hook(state_dtype))


def cast_state_hook(state_dtype: torch.dtype):
    """A load_state_dict post-hook: torch's ``Optimizer.load_state_dict`` casts floating state to
    the parameter's dtype (fp32); this casts the moments back to ``state_dtype`` (exact for
    values that were bf16; round-to-nearest for a float32 checkpoint's)."""

    def hook(opt: torch.optim.Optimizer) -> None:
        for st in opt.state.values():
            for k in MOMENT_KEYS:
                if k in st and st[k].dtype != state_dtype:
                    st[k] = st[k].to(state_dtype)

    return hook


class AdamWLowPrecision(torch.optim.Optimizer):
    """AdamW (torch's update rule: decoupled decay ``p *= 1 - lr wd``, bias-corrected moments,
    ``p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``) with ``exp_avg`` and ``exp_avg_sq``
    stored in ``state_dtype`` (bf16: stochastically rounded, module docstring), laid out like the
    parameter (DTensors keep the parameter's placements, so DCP reshards them). The update runs
    on local shards, one parameter at a time, in fp32. ``step`` is a float32 scalar tensor per
    parameter, as in torch's AdamW, so the flat state-dict keys are the same."""

    def __init__(
        self,
        params,
        lr: float,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ):
        # torch AdamW's group keys too (its flags at their for-loop values): a flat state dict
        # then has the same keys under either state dtype, so checkpoints load across them
        flags = dict(amsgrad=False, maximize=False, foreach=False, capturable=False, differentiable=False, fused=False)
        flags["decoupled_weight_decay"] = True
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **flags))
        attach_state_dtype(self, state_dtype, seed)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                st["step"] += 1
                t = int(st["step"].item())
                g = _local(p.grad).float()
                m_dst, v_dst = _local(st["exp_avg"]), _local(st["exp_avg_sq"])
                m = m_dst.float().lerp_(g, 1 - b1)
                v = v_dst.float().mul_(b2).addcmul_(g, g, value=1 - b2)
                lo = hi = None
                if self.state_dtype == torch.bfloat16:  # one hash per element rounds both moments
                    bits = random_bits(global_index(p), salt(self.seed, t, self._number[id(p)], 0))
                    lo, hi = low_bits(bits), high_bits(bits)
                    del bits
                store(m_dst, m, lo)
                store(v_dst, v, hi)
                w = _local(p)
                w.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
                w.addcdiv_(m.to(w.dtype), denom.to(w.dtype), value=-lr / (1 - b1**t))
        return loss

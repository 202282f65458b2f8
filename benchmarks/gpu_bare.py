"""The bare loops of ``make bench-gpu`` (``benchmarks/gpu.py``'s docstring), run in a worker
process: our model (or torchtitan's) with the same activation checkpointing and per-block compile
as the trainer, cross entropy, gradient-norm clipping and fused AdamW, in one of two recipes
(:data:`RECIPES`), both from the same model code:

* ``mixed``, the reference for the framework's overhead: the recipe the trainer runs (fp32 master
  weights, bf16 compute), written out by hand. The fp32 model holds the masters; a bf16 twin of it
  (the same modules, parameters cast to bf16, buffers as built) runs forward and backward. Per
  step: one foreach cast of every master into its bf16 compute copy, bf16 forward and backward,
  one foreach cast of the bf16 gradients into fp32 gradient buffers of the masters, the total
  norm from one ``torch._foreach_norm`` and one foreach scale, fp32 fused AdamW on the masters.
* ``bf16``: bf16 parameters, gradients and AdamW state (``model.to(torch.bfloat16)``); cheaper
  and a different recipe, kept as a second reference.

A float8 case converts the model's linears (and DeepSeek's routed experts) first
(``models/parallel/float8.py`` ``convert_to_float8``, as the trainer's ``model.converters`` does
before any other applier)."""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable

__all__ = ["RECIPES", "BareStep", "bare_loop", "float8_share"]

RECIPES = ("mixed", "bf16")


def _trainer_windows(case, steps: int, trainer_args: Callable[..., list[str]]):
    """``[steps, local_batch_size, seq_len + 1]`` packed windows of the trainer's data (its
    config, dataset and tokenizer) and the tokenizer's EOS id."""
    import torch

    from trainer.config import load_config
    from trainer.data.loader import build_source
    from trainer.data.packing import PackedStream
    from trainer.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        cfg = load_config(trainer_args(case, steps, folder))
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    windows = PackedStream(build_source(cfg), tokenizer, case.seq_len).take(steps * case.local_batch_size)
    return torch.as_tensor(windows).view(steps, case.local_batch_size, case.seq_len + 1), tokenizer.eos_id


def _build_ours(case, device, eos_id: int | None = None):
    from models.registry import build_model

    overrides = {"n_layers": case.n_layers, "max_seq_len": case.seq_len}
    if case.vocab_size is not None:
        overrides["vocab_size"] = case.vocab_size
    if case.attn_mask_type != "causal":
        overrides.update(attn_mask_type=case.attn_mask_type, attn_type=case.attn_type, eos_id=eos_id)
    model = build_model(case.model, case.flavor, device="meta", **overrides)
    model.to_empty(device=device)
    import torch

    with torch.no_grad():
        model.init_weights(0)
    return model, model.args.vocab_size


def _build_torchtitan(case, device, eos_id=None):
    import copy

    import torch

    if case.model == "llama3":
        from torchtitan.models.llama3 import Transformer, llama3_args

        args = copy.deepcopy(llama3_args[case.flavor])
        cls = Transformer
    else:
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args

        args = copy.deepcopy(deepseekv3_args[case.flavor])
        cls = DeepSeekV3Model
    args.n_layers = case.n_layers
    args.max_seq_len = case.seq_len
    args.attn_type, args.attn_mask_type = "sdpa", "causal"
    if case.model == "deepseek_v3":
        args.moe_impl = "standard"  # set from the job config in torchtitan's own trainer
    if case.vocab_size is not None:
        args.vocab_size = case.vocab_size
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model, args.vocab_size


def bf16_twin(model):
    """A copy of ``model`` whose parameters are bf16 (tied parameters stay tied; buffers are kept
    as built, as FSDP's bf16 mixed precision keeps them): the compute copy of the ``mixed``
    recipe. Its values are set by :meth:`BareStep.cast_in` before every forward."""
    import torch

    # deepcopy takes each parameter from the memo: its bf16 copy, made once (tied ones stay tied),
    # and no fp32 copy of the model is ever made
    memo = {id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


class BareStep:
    """One training step of a bare loop on ``model`` (built in fp32; a float8 model converted
    already) in ``recipe`` (:data:`RECIPES`): the model's activation checkpointing ``ac_mode``
    (per-op selective as the trainer's ``"op"`` option, or full, or none), each block compiled
    when ``compile``, cross entropy summed over the batch over ``n_tokens``, clipping to
    ``max_norm``, AdamW (fused on CUDA, foreach elsewhere; the trainer's lr, betas, weight decay).

    :meth:`step` runs one step; its parts (:meth:`cast_in`, :meth:`forward_backward`,
    :meth:`grads_to_masters`, :meth:`clip`, :meth:`optimizer_step`) are methods so a test can
    check the state between them. ``masters``: the parameters AdamW updates (fp32 in ``mixed``,
    bf16 in ``bf16``); ``compute_params``: the ones forward and backward use."""

    def __init__(self, model, recipe: str, *, ac_mode: str, compile: bool, n_tokens: int, max_norm: float = 1.0):
        import torch

        from models.parallel.activation_checkpoint import apply_activation_checkpointing

        if recipe not in RECIPES:
            raise ValueError(f"bare loop recipe {recipe!r} is not one of {', '.join(RECIPES)}")
        self.recipe, self.n_tokens, self.max_norm = recipe, n_tokens, max_norm
        if recipe == "bf16":
            model.to(torch.bfloat16)
            self.compute = model
            self.masters = list(model.parameters())
            self.compute_params = self.masters
        else:
            self.compute = bf16_twin(model)
            self.masters = list(model.parameters())
            self.compute_params = list(self.compute.parameters())
            names = [n for n, _ in model.named_parameters()]
            if names != [n for n, _ in self.compute.named_parameters()]:
                raise RuntimeError("the bf16 compute copy does not list the masters' parameters in their order")
            # fp32 gradients of the masters, written by one foreach cast per step
            self.master_grads = [torch.zeros_like(p) for p in self.masters]
            self.cast_in()
        device = self.masters[0].device
        apply_activation_checkpointing(self.compute, ac_mode, "op")
        if compile:
            for block in self.compute.layers.values():
                block.compile()
        self.optimizer = torch.optim.AdamW(
            self.masters,
            lr=3e-4,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            fused=device.type == "cuda",
            foreach=device.type != "cuda",
        )

    def cast_in(self) -> None:
        """``mixed``: every master into its bf16 compute copy, one foreach cast."""
        import torch

        if self.recipe == "mixed":
            with torch.no_grad():
                torch._foreach_copy_(self.compute_params, self.masters)

    def forward_backward(self, inputs, labels):
        import torch.nn.functional as F

        logits = self.compute(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / self.n_tokens
        loss.backward()
        return loss

    def grads_to_masters(self) -> None:
        """``mixed``: the bf16 gradients into the masters' fp32 gradients, one foreach cast (a
        parameter that got no gradient gets none); the compute copies' gradients freed."""
        import torch

        if self.recipe != "mixed":
            return
        pairs = [(g, p) for g, p in zip(self.master_grads, self.compute_params) if p.grad is not None]
        with torch.no_grad():
            torch._foreach_copy_([g for g, _ in pairs], [p.grad for _, p in pairs])
        for master, grad, p in zip(self.masters, self.master_grads, self.compute_params):
            master.grad = grad if p.grad is not None else None
            p.grad = None

    def clip(self):
        """Scale the masters' gradients to a total norm of at most ``max_norm``: the norm from one
        ``torch._foreach_norm`` (``mixed``), torch's foreach ``clip_grad_norm_`` (``bf16``, as
        before). Returns the norm before clipping."""
        import torch

        if self.recipe != "mixed":
            return torch.nn.utils.clip_grad_norm_(self.masters, self.max_norm, foreach=True)
        grads = [p.grad for p in self.masters if p.grad is not None]
        with torch.no_grad():
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)))
            torch._foreach_mul_(grads, torch.clamp(self.max_norm / (total + 1e-6), max=1.0))
        return total

    def optimizer_step(self) -> None:
        self.optimizer.step()
        if self.recipe == "bf16":
            self.optimizer.zero_grad(set_to_none=True)

    def step(self, inputs, labels):
        self.cast_in()
        loss = self.forward_backward(inputs, labels)
        self.grads_to_masters()
        self.clip()
        self.optimizer_step()
        return loss


def bare_loop(
    case, implementation: str, steps: int, warmup: int, trainer_args: Callable[..., list[str]], recipe: str = "mixed"
) -> dict:
    """``steps`` steps of :class:`BareStep` in ``recipe``, each ending with one ``loss.item()``,
    timed per step after ``warmup``; then, eager only, one more step under the matmul census.
    ``case``: a ``benchmarks.gpu_measure.Case``; ``implementation``: ``ours`` or ``torchtitan`` (its
    model); ``trainer_args``: ``benchmarks.gpu_measure.trainer_args`` (the trainer's config of the case,
    whose data the block-causal rows read)."""
    import torch

    from models.registry import build_model
    from trainer.instruments.matmul_census import MatmulCensus
    from trainer.reporting.metrics import peak_flops, training_flops_per_token

    device = torch.device(case.device)
    torch.manual_seed(0)
    build = _build_ours if implementation == "ours" else _build_torchtitan
    windows, eos_id = (
        _trainer_windows(case, steps + 1, trainer_args) if case.attn_mask_type != "causal" else (None, None)
    )
    model, vocab = build(case, device, eos_id)
    if case.precision == "float8":  # as the trainer: the converter first, then bf16, AC, compile
        from models.parallel.float8 import Float8Options, convert_to_float8

        experts = ("experts",) if case.model == "deepseek_v3" else ()  # as the trainer's converters
        convert_to_float8(model, Float8Options(recipe="tensorwise", moe_fqns=experts), fsdp_all_gather=False)
    n_tokens = case.local_batch_size * case.seq_len
    loop = BareStep(model, recipe, ac_mode=case.ac_mode, compile=case.compile, n_tokens=n_tokens)
    shape = (steps + 1, case.local_batch_size, case.seq_len + 1)  # block_causal: the trainer's documents
    tokens = windows.to(device) if windows is not None else torch.randint(0, vocab, shape, device=device)

    def step(i: int) -> None:
        loop.step(tokens[i, :, :-1], tokens[i, :, 1:]).item()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        step(i)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    tps = n_tokens / statistics.median(times)
    out = {
        "recipe": recipe,
        "tokens_per_s": tps,
        "steps_timed": len(times),
        "peak_memory_gib": None,
        "mfu_pct": None,
        "master_dtype": str(loop.masters[0].dtype).removeprefix("torch."),
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peak = peak_flops(torch.cuda.get_device_name(device), "bfloat16")
        # the trainer's FLOPs per token for these shapes (the same for torchtitan's model)
        reference = build_model(
            case.model,
            case.flavor,
            device="meta",
            n_layers=case.n_layers,
            max_seq_len=case.seq_len,
            **({"vocab_size": case.vocab_size} if case.vocab_size else {}),
        )
        if peak:
            out["mfu_pct"] = 100 * training_flops_per_token(reference, case.seq_len) * tps / peak
    if not case.compile:
        # which dtypes the GEMMs really ran in (one more step, outside the timing)
        with MatmulCensus() as census:
            step(steps)
        out["matmul_bf16_share"] = census.share(torch.bfloat16)
        out["matmul_float8_share"] = float8_share(census)
    return out


def float8_share(census) -> float:
    """Fraction of a :class:`MatmulCensus`'s FLOPs in float8 GEMMs (``_scaled_mm``: e4m3
    operands forward, e5m2 gradients first in the backward)."""
    import torch

    return census.share(torch.float8_e4m3fn) + census.share(torch.float8_e5m2)

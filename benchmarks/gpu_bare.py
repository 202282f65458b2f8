"""The bare loops of ``make bench-gpu`` (``benchmarks/gpu.py``'s docstring), run in a worker
process: our model (or torchtitan's) with bf16 parameters, the same activation checkpointing and
per-block compile as the trainer, cross entropy, clipping, fused AdamW; a float8 case converts
the model's linears (and DeepSeek's routed experts) first (``models/parallel/float8.py``
``convert_to_float8``, as the trainer's ``model.converters`` does before any other applier)."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

__all__ = ["bare_loop", "float8_share"]


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


def bare_loop(case, implementation: str, steps: int, warmup: int, trainer_args: Callable[..., list[str]]) -> dict:
    """Fwd + bwd + clipping + fused AdamW on bf16 parameters, timed per step after warmup.
    ``case``: a ``benchmarks.gpu.Case``; ``trainer_args``: its ``trainer_args`` (the trainer's
    config of the case, whose data the block-causal rows read)."""
    import torch
    import torch.nn.functional as F

    from models.parallel.activation_checkpoint import apply_activation_checkpointing
    from models.registry import build_model
    from trainer.instruments.matmul_census import MatmulCensus
    from trainer.metrics import peak_flops, training_flops_per_token

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
    model.to(torch.bfloat16)
    apply_activation_checkpointing(model, case.ac_mode, "op")
    if case.compile:
        for block in model.layers.values():
            block.compile()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=3e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=device.type == "cuda",
        foreach=device.type != "cuda",
    )
    shape = (steps + 1, case.local_batch_size, case.seq_len + 1)  # block_causal: the trainer's documents
    tokens = windows.to(device) if windows is not None else torch.randint(0, vocab, shape, device=device)
    n_tokens = case.local_batch_size * case.seq_len

    def step(i: int) -> None:
        inputs, labels = tokens[i, :, :-1], tokens[i, :, 1:]
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / n_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

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
    out = {"tokens_per_s": tps, "steps_timed": len(times), "peak_memory_gib": None, "mfu_pct": None}
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

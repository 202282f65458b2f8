"""Float8 (torchao, ``model.converters = ["float8"]``) under FSDP and TP on real gloo ranks.

1. The weight scales the forward GEMMs use do not depend on the layout. Observable: the scale
   of the weight operand that each ``Float8Linear``'s forward GEMM receives
   (``torchao.float8.float8_ops.addmm_float8_unwrapped``'s ``b_scale``, recorded between the
   module's forward pre-hook and forward hook, so only the forward GEMM is seen). That is the
   scale the GEMM really multiplies with, whichever path produced it: torchao's dynamic cast of
   a plain or DTensor weight, or FSDP2's float8 all-gather (``fsdp_pre_all_gather``). It is
   compared BITWISE with the single-process model's: a tensorwise scale is
   ``fp8_max / max|W|`` computed in float64 then rounded to float32, and a max is exact
   whatever the shard order, so any layout that reduces the amax over the whole weight gives
   the same bits (the initial weights are bit-identical across layouts: seeded,
   layout-independent init). Measured: equal on every converted linear of llama3 debug (2
   layers, 14 converted linears) under fsdp=4, fsdp=4 with float8 all-gather, tp=2 x fsdp=2,
   and tp=2 x fsdp=2 with float8 all-gather and precomputed scales, on all 4 ranks. The weight
   scale is the part that must not move; the activation / grad-output scales are per rank's
   tokens (tests/e2e/test_float8_compare.py shows where that matters: cp, pp).

   Not layout-independent, so the plan (trainer.plan.float8_options) turns the precompute on
   for it; asserted as it is with that taken away, so a torchao change shows up: tp=2 x fsdp=2
   WITH float8 all-gather and without precomputed scales. FSDP2's pre-all-gather hook sees the
   TP-local shard and torchao all-reduces its amax over the FSDP mesh only, so each TP rank
   scales its slice of the weight by that slice's own amax (a finer scale, not a wrong
   product: every output column / partial sum uses one consistent scale). With
   ``float8.precompute_float8_dynamic_scale_for_fsdp`` the amax is an ``inf``-norm of the
   DTensor over both meshes, and the scales are the single-process ones again. This case is
   also the observable's control: a scale that differs is seen (measured: the slices' scales
   differ from the whole weight's on some linears, asserted).

One 4-rank launch for the scale test (6 layouts), one 2-rank launch for the bytes test (2
trainers).

2. FSDP float8 all-gather halves the all-gather bytes of the converted weights under
   ``mixed_precision_param = bfloat16`` (see the test's docstring for the exact bytes).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch

from tests.distributed.parallel_harness import SEED, build_layout_model, harness_plan, make_batch
from tools.forkserver import run_distributed

GLOBAL_BS, SEQ_LEN = 4, 32
F8 = ("--model.converters", "float8")
AG = ("--float8.enable_fsdp_float8_all_gather", "true")
PRECOMPUTE = ("--float8.precompute_float8_dynamic_scale_for_fsdp", "true")
SLICE_SCALES = "tp2-fsdp2-f8ag-without-the-plan's-precompute"


@contextlib.contextmanager
def _record_forward_scales(model) -> Iterator[dict[str, dict]]:
    """Inside the block, every Float8Linear of ``model`` records its forward GEMM's (weight
    scale, input scale) and, for a TP-sharded weight, the dim it is sharded on."""
    import torchao.float8.float8_ops as ops  # (models.parallel.float8 imported torchao quietly)
    from torch.distributed.tensor import DTensor, Shard
    from torchao.float8.float8_linear import Float8Linear

    seen: dict[str, dict] = {}
    current: list[str | None] = [None]
    inner = ops.addmm_float8_unwrapped

    def wrapped(a_data, a_scale, b_data, b_scale, *args, **kwargs):
        fqn = current[0]
        if fqn is not None and fqn not in seen:
            # plain floats: tensors do not travel back from a rank (and a float32 is exact in one)
            seen[fqn] = {
                "w": b_scale.detach().float().reshape(-1).tolist(),
                "x": a_scale.detach().float().reshape(-1).tolist(),
            }
        return inner(a_data, a_scale, b_data, b_scale, *args, **kwargs)

    handles = []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, Float8Linear):
            continue

        def pre(_mod, _args, fqn=fqn):
            current[0] = fqn

        def post(mod, _args, _out, fqn=fqn):
            current[0] = None
            w = mod.weight
            if isinstance(w, DTensor) and "tp" in (w.device_mesh.mesh_dim_names or ()):
                i = w.device_mesh.mesh_dim_names.index("tp")
                placement = w.placements[i]
                seen[fqn]["tp_dim"] = placement.dim if isinstance(placement, Shard) else None

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    ops.addmm_float8_unwrapped = wrapped
    try:
        yield seen
    finally:
        ops.addmm_float8_unwrapped = inner
        for handle in handles:
            handle.remove()


def _reference_scales(config: tuple[str, ...]) -> tuple[dict, dict]:
    """The single-process float8 model's forward scales and full initial weights."""
    from models.parallel.float8 import convert_to_float8

    plan = harness_plan("llama3", {}, GLOBAL_BS, SEQ_LEN, config=(*F8, *config))
    with torch.device("meta"):
        model = plan.model.model_cls(plan.model_args)
    convert_to_float8(model, plan.parallelize.float8, fsdp_all_gather=False)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    inputs, _ = make_batch(GLOBAL_BS, SEQ_LEN, model.args.vocab_size)
    with _record_forward_scales(model) as seen:
        model(inputs)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return seen, weights


def _layout_scales(rank, world_size, cases):
    import dataclasses

    from models.parallel.float8 import precompute_float8_scales

    out = {}
    for name, degrees, config in cases:
        torch.manual_seed(0)
        plan = harness_plan("llama3", degrees, GLOBAL_BS, SEQ_LEN, config=(*F8, *config))
        out[name] = {"planned_precompute": plan.parallelize.float8.precompute_scale}
        if name == SLICE_SCALES:  # what the plan would do without its tp rule (see the test)
            f8 = dataclasses.replace(plan.parallelize.float8, precompute_scale=False)
            plan = dataclasses.replace(plan, parallelize=dataclasses.replace(plan.parallelize, float8=f8))
        pd = plan.parallel_dims
        pd.build_mesh("cpu")
        model = build_layout_model(plan)
        if plan.parallelize.float8.precompute_scale:
            precompute_float8_scales([model])  # what the trainer does after each step
        inputs, _ = make_batch(GLOBAL_BS, SEQ_LEN, model.args.vocab_size)
        per_rank = GLOBAL_BS // pd.size("batch")
        b = pd.coordinate("batch")
        # the forward alone: the observable is the forward GEMMs' scales (the backward run here
        # before issue 49 recorded nothing; without it the test 19.2 -> 13.7 CPU s, Intel Xeon)
        with _record_forward_scales(model) as seen:
            model(inputs[b * per_rank : (b + 1) * per_rank])
        out[name].update(scales=seen, tp_rank=pd.coordinate("tp") if pd.tp > 1 else 0, tp=pd.tp)
    return out


def test_float8_weight_scales_do_not_depend_on_the_layout():
    """Per converted linear: the forward GEMM's weight scale under each layout, every rank,
    bitwise equal to the single-process model's. tp x fsdp with the float8 all-gather gets
    precomputed scales from the plan even when the config does not ask for them (asserted:
    ``planned_precompute``), and then equals it too. The control: the same layout with the
    plan's precompute taken away, whose scale is that of the rank's TP slice (see the module
    docstring), which must differ on some linear for the case to mean anything."""
    from torchao.float8.float8_utils import amax_to_scale

    cases = [
        ("fsdp4", dict(dp_shard=4), ()),
        ("fsdp4-f8ag", dict(dp_shard=4), AG),
        ("tp2-fsdp2", dict(dp_shard=2, tp=2), ()),
        ("tp2-fsdp2-f8ag-precompute", dict(dp_shard=2, tp=2), (*AG, *PRECOMPUTE)),
        ("tp2-fsdp2-f8ag", dict(dp_shard=2, tp=2), AG),  # the plan adds the precompute
        (SLICE_SCALES, dict(dp_shard=2, tp=2), AG),
    ]
    ref, weights = _reference_scales(())
    assert len(ref) == 14, sorted(ref)  # 2 layers x (wq, wk, wv, wo, w1, w2, w3)
    per_rank = run_distributed(_layout_scales, 4, cases, timeout=300)
    fp8 = torch.float8_e4m3fn
    for rank, results in enumerate(per_rank):
        for name, _, _ in cases:
            got = results[name]["scales"]
            assert sorted(got) == sorted(ref), (rank, name)
            assert results[name]["planned_precompute"] is (name.startswith("tp2-fsdp2-f8ag")), (rank, name)
            if name != SLICE_SCALES:
                for fqn, r in ref.items():
                    assert got[fqn]["w"] == r["w"], (rank, name, fqn, got[fqn]["w"], r["w"])
                continue
            differs = 0
            for fqn, r in ref.items():
                dim = got[fqn]["tp_dim"]
                assert dim is not None, fqn
                full = weights[f"{fqn}.weight"]
                tp, tp_rank = results[name]["tp"], results[name]["tp_rank"]
                local = full.chunk(tp, dim=dim)[tp_rank]
                expected = amax_to_scale(local.abs().max(), fp8).reshape(-1).tolist()
                assert got[fqn]["w"] == expected, (rank, fqn, got[fqn]["w"], expected)
                differs += got[fqn]["w"] != r["w"]
            assert differs > 0, "every TP slice has the full weight's amax: the case shows nothing"


def _record_train_steps(rank, world_size, folder):
    """One recorded training step without and one with float8 all-gather (two trainers in one
    launch: a rank's start-up costs more than a step); this rank's records of each."""
    import json

    from trainer.config import load_config
    from trainer.trainer import Trainer

    out = []
    for float8_all_gather in ("false", "true"):
        dump = f"{folder}/f8ag_{float8_all_gather}"
        args = [
            *("--config", "llama3.toml", "--model.n_layers", "2", "--training.seq_len", "32"),
            *("--training.global_batch_size", "4", "--training.local_batch_size", "2", "--training.steps", "1"),
            *("--parallelism.dp_shard", "2", "--parallelism.mixed_precision_param", "bfloat16"),
            *("--comm.record_step", "1", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"),
            *("--job.dump_folder", dump, *F8, "--float8.enable_fsdp_float8_all_gather", float8_all_gather),
            # no collective; one op per parameter group instead of foreach's ten on DTensors
            *("--optimizer.implementation", "fused"),
        ]
        Trainer(load_config(args)).train()
        with open(f"{dump}/comm_rank{rank}.json") as f:
            out.append(json.load(f)["records"])
    return out


def _block_numels() -> tuple[dict[str, int], dict[str, int]]:
    """Per transformer block: numel of its converted weights and of its other parameters."""
    from models.parallel.float8 import float8_decisions
    from trainer.config import load_config
    from trainer.plan import plan_job

    plan = plan_job(load_config(["--config", "llama3.toml", "--model.n_layers", "2", *F8]), 1)
    with torch.device("meta"):
        model = plan.model.model_cls(plan.model_args)
    converted = {
        f"{fqn}.weight" for fqn, why in float8_decisions(model, plan.parallelize.float8).items() if why is None
    }
    conv: dict[str, int] = collections.Counter()
    other: dict[str, int] = collections.Counter()
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            block = ".".join(name.split(".")[:2])
            (conv if name in converted else other)[block] += p.numel()
    return dict(conv), dict(other)


def test_fsdp_float8_all_gather_halves_the_converted_weights_bytes(tmp_path):
    """llama3 debug (2 layers: every block's gather is checked alike, and FSDP gathers a
    resharded block twice, the last one once), fsdp=2, mixed_precision_param bfloat16, one recorded training step
    (comm.record_step 1, the trainer's recorder), float8 on both runs, float8 all-gather off
    and on. Compared: every FSDP all-gather record (kind all_gather, mesh fsdp; bytes = the
    all-gather's OUTPUT, i.e. the whole unsharded group as it travels), in issue order. Each
    block's all-gather carries its 7 converted weights and 2 norm weights: 2 bytes per element
    of both in bf16, 1 byte per converted element and still 2 per norm element in float8
    (FSDP2 packs the mixed dtypes into one uint8 buffer). The other groups (embeddings; final
    norm + output), none converted, are the same bf16 gathers in both runs. Also: the float8 run issues the
    tensorwise amax all-reduces on fsdp (4 bytes per converted weight per gather)."""
    conv, other = _block_numels()
    per_rank = run_distributed(_record_train_steps, 2, str(tmp_path), timeout=300)
    bf16, f8 = [r[0] for r in per_rank], [r[1] for r in per_rank]
    (block_conv,) = set(conv.values())  # every llama3 debug block is the same
    (block_other,) = set(other.values())
    bf16_block = 2 * (block_conv + block_other)
    f8_block = block_conv + 2 * block_other
    for rank in range(2):
        ag_bf16 = [r for r in bf16[rank] if (r["kind"], r["mesh"]) == ("all_gather", "fsdp")]
        ag_f8 = [r for r in f8[rank] if (r["kind"], r["mesh"]) == ("all_gather", "fsdp")]
        assert len(ag_bf16) == len(ag_f8) > 0
        n_block = 0
        for a, b in zip(ag_bf16, ag_f8):
            if a["bytes"] != bf16_block:  # embeddings, final norm + output: nothing converted
                assert (b["bytes"], b["dtype"]) == (a["bytes"], a["dtype"]) == (b["bytes"], "bfloat16"), (a, b)
            else:  # a block: the float8 weights and bf16 norms packed as bytes
                assert (b["bytes"], a["dtype"], b["dtype"]) == (f8_block, "bfloat16", "uint8"), (a, b, f8_block)
                n_block += 1
        assert n_block >= len(conv)  # each block gathered at least once (forward)
        # the converted weights' share of the block gathers: exactly half
        conv_bf16 = sum(a["bytes"] for a in ag_bf16 if a["bytes"] == bf16_block) - n_block * 2 * block_other
        conv_f8 = sum(b["bytes"] for b in ag_f8 if b["bytes"] == f8_block) - n_block * 2 * block_other
        assert conv_f8 * 2 == conv_bf16 == n_block * 2 * block_conv
        amax = [r for r in f8[rank] if (r["kind"], r["mesh"]) == ("all_reduce", "fsdp") and r["bytes"] == 4]
        assert len(amax) >= n_block * 7
        print(
            f"rank {rank}: {n_block} block all-gathers, converted weights {conv_bf16} B bf16 -> {conv_f8} B float8; "
            f"all fsdp all-gathers {sum(a['bytes'] for a in ag_bf16)} B -> {sum(b['bytes'] for b in ag_f8)} B"
        )

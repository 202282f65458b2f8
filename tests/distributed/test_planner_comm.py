"""The layout planner's predicted collectives (tools/planner/collectives.py) against what the
trainer really issues, recorded on real gloo ranks (parallel_dims/comm_record.py through the
trainer's ``comm.record_step``), for every layout of the CPU proof matrix (docs/compare_loss.md)
and for layouts that turn on what else changes a step's collectives
(:data:`LAYOUTS`): bf16 parameters with fp32 gradient reduction (FSDP2 over 2 ranks with
gradients accumulated over 2 micro-batches, and over one; on the size-1 FSDP mesh of a pipeline
stage without data parallelism; HSDP), a bf16 reduce dtype (with bf16 and with fp32
parameters), full AC (FSDP; TP with and without sequence parallel; CP; MLA; MoE experts
replicated over TP; EP; EP x ETP), selective AC (the per-op policy: FSDP, TP, MLA, EP x ETP;
every N-th block: TP), ``fsdp_reshard_after_forward`` ``never`` (HSDP x TP) and ``always``
(pipelined), TP without sequence parallel and without loss parallel, TP and CP inside pipeline
stages, every schedule the planner enumerates (1F1B; GPipe, also with one micro-batch;
Interleaved1F1B, LoopedBFS, InterleavedZeroBubble with two stages per rank; ZBVZeroBubble's
V, whose turn stays on one rank), CP without TP, MoE experts replicated over TP (deepseek_v3
tp=2 without EP), LoRA under TP (llama3 tp=2 x fsdp=2; deepseek_v3 fsdp=2 x tp=2 x ep=2 x etp=2
with expert adapters, whose factors replicated over etp get their gradients all-reduced over
etp), and three layouts on 8 ranks (HSDP x FSDP x TP; routed experts split over
etp and sharded over efsdp = 2; pp=4 x tp=2). Options share a layout where they do not
interact, to keep the launches short, and a layout whose every planner branch another layout
takes is not run: llama3 tp=2,fsdp=2 bf16 (bf16 gathers and compute under TP with resharding
after forward: the bf16-reduce "selective AC every 2" layout; fp32 reduce-scatters and the fp32
all-reduce of accumulated partial gradients: the 8-rank HSDP x FSDP x TP bf16 layout, fsdp=2,
2 micro-batches), llama3 pp=2,tp=2 bf16 (the size-1 FSDP mesh's casts and a non-split
schedule's fp32 accumulator under pp x tp: the GPipe one-micro-batch layout) and llama3
pp=2,cp=2 GPipe (its block-causal twin issues the same plus the token-id gathers).

What is compared, per layout and per rank: the planner's ``(kind, mesh, bytes of one call) ->
calls per optimizer step`` against the recorded step's, EXACTLY, over every kind and mesh the
step issues (FSDP2 all-gathers / reduce-scatters, HSDP all-reduces, TP/SP activation
collectives, loss-parallel and norm-gradient all-reduces, CP's K/V collectives, pipeline
send/recv, the loss / grad-norm / MoE-load all-reduces, EP's count exchanges). The bytes of
one call carry the dtype: bf16 all-gathers, fp32 reduce-scatters and norm-gradient all-reduces
in the dtype they run in are distinct records. One exception, narrow and explicit: the bytes
of EP's and ETP's TOKEN all-to-alls (float rows; not the int64 count exchanges) depend on
where the router sends each token, which no planner can know. For them the test compares per
rank the number of calls on each mesh exactly, and the bytes summed over the whole world
exactly: every row a rank sends is received by another, so the world's total equals the
planner's balanced-routing assumption summed over the ranks.

Each layout trains a 2-layer (llama3) / 3-layer (deepseek_v3) debug model (unless its config
says otherwise) through a fresh real Trainer, 32 tokens per sequence, 2 micro-batches of 2
sequences per rank (gradient accumulation is part of what is checked). A layout without
pipeline parallelism trains and records its first step: nothing in it is one-off (its records
equal the planner's, as a later step's did when step 2 was recorded), and a second step cost a
fifth of the launch's CPU time. A pipelined layout trains 2 steps and records step 2 (step 1 also runs
the pipeline's one-off shape exchange). The
layouts a session selects of one world size run one after another in few launches (three:
4 ranks in two halves of at most ``LAUNCH_LAYOUTS`` = 12 layouts, as all 24 in one launch took
71 s on a loaded host, over the 60 s per-test budget; and 8 ranks for the few layouts that need
them; ``tools.forkserver.run_distributed``; a layout that fails ends its launch, naming the
layout): a launch per layout paid the ranks' start and first-step warm-up again for every layout. Several
Trainers in one process share DTensor's sharding-propagation and redistribution caches, whose
keys compare meshes by value, so a later layout's equal mesh would get back specs holding an
earlier layout's mesh objects and process groups (seen: without the drop, 12 of 20 layouts
recorded calls on earlier layouts' groups); the caches that hold meshes are dropped after every
layout (the tensor-metadata cache, shapes and dtypes only, is kept), and the
test checks that every recorded call ran on a process group of its own layout's meshes (a
leaked group has no name among them). AdamW runs its fused kernel (the GPU default; on CPU the default is
foreach): AdamW issues no collective either way, and one op per parameter group costs
DTensor's first-step sharding propagation much less than foreach's ten (identical records,
measured).

Selective AC with ETP (deepseek_v3 fsdp=2, tp=2, ep=2, etp=2) once failed in the trainer's
step-1 backward (FSDP's profiler annotations replayed by selective checkpointing; fixed in
models/parallel/activation_checkpoint.py) and is checked here since.

Found by these layouts (the planner was wrong, now fixed): ZBVZeroBubble's two stages on one
rank hand activations over in memory, no send/recv; a pipelined group resharded after forward
is gathered m + 1 times per pipeline step, not once; under pp FSDP2 moves a gradient into its
reduce-dtype accumulator even with one micro-batch, and under a split-backward schedule only
in the stages where an input half follows a weight half (which decides the dtype of the
tp-replicated weights' gradient all-reduces); the every-N-th-block selective AC option
re-issues the checkpointed blocks' forward collectives. Found in the trainer:
``fsdp_reshard_after_forward = "always"`` with a zero-bubble schedule dropped the weight
gradients of the resharded groups (an InterleavedZeroBubble recording had 6 reduce-scatters
where 8 were due); ``trainer.plan.plan_job`` refuses that combination now.

Not checked here: more than 8 ranks, and what tools/planner/collectives.py lists as modelled
but not checked.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import pytest

from parallel_dims.axes import AXES
from tools.forkserver import run_distributed

WORLD = 4  # ranks of a layout unless it says otherwise
SEQ = 32
LOCAL = 2
ACCUM = 2
PP_RECORD_STEP = 2  # the step a pipelined layout records (step 1 runs the one-off shape exchange)
N_LAYERS = {"llama3": 2, "deepseek_v3": 3}  # deepseek: one dense layer, two MoE layers
# layouts per launch: the 24 layouts of 4 ranks in one launch took 71 s on a loaded 2-core host,
# over the 60 s per-test budget (a launch is charged to its first test)
LAUNCH_LAYOUTS = 12


class Layout(NamedTuple):
    model: str
    degrees: dict
    config: tuple[tuple[str, str], ...] = ()  # extra ``section.key``, value pairs (win over the above)
    world: int = WORLD


_BF16 = (("parallelism.mixed_precision_param", "bfloat16"), ("parallelism.mixed_precision_reduce", "float32"))
_FULL_AC = (("activation_checkpoint.mode", "full"),)
_SELECTIVE_AC = (("activation_checkpoint.mode", "selective"),)  # selective_ac_option "op"
_TWO_LAYERS = ("model.n_layers", "2")
_FOUR_LAYERS = ("model.n_layers", "4")
_BF16_REDUCE = (("parallelism.mixed_precision_param", "bfloat16"), ("parallelism.mixed_precision_reduce", "bfloat16"))
_FP32_BF16 = (("parallelism.mixed_precision_param", "float32"), ("parallelism.mixed_precision_reduce", "bfloat16"))

LAYOUTS = {
    # the CPU proof matrix (docs/compare_loss.md), fp32, no AC, sequence and loss parallel on, 1F1B
    "llama3 fsdp=4": Layout("llama3", dict(dp_shard=4)),
    "llama3 dp_replicate=2,fsdp=2": Layout("llama3", dict(dp_replicate=2, dp_shard=2)),
    "llama3 tp=2,fsdp=2": Layout("llama3", dict(dp_shard=2, tp=2)),
    "llama3 cp=2,tp=2": Layout("llama3", dict(dp_shard=1, cp=2, tp=2)),
    "llama3 pp=2,fsdp=2": Layout("llama3", dict(dp_shard=2, pp=2)),
    "deepseek_v3 fsdp=4,ep=2": Layout("deepseek_v3", dict(dp_shard=4, ep=2)),
    "deepseek_v3 fsdp=2,tp=2,ep=2,etp=2": Layout("deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2)),
    "deepseek_v3 pp=2,fsdp=2": Layout("deepseek_v3", dict(dp_shard=2, pp=2)),
    # DeepSeek-V3 multi-token prediction under tp: the MTP block's FSDP group and TP collectives,
    # its embedding copy's reduce-scatter, the head and loss over the main and the depth's tokens
    "deepseek_v3 tp=2,fsdp=2 mtp=1": Layout(
        "deepseek_v3", dict(dp_shard=2, tp=2), (("model.mtp_layers", "1"), _TWO_LAYERS)
    ),
    "deepseek_v3 pp=2,fsdp=2 mtp=1": Layout(
        "deepseek_v3", dict(dp_shard=2, pp=2), (("model.mtp_layers", "1"), _TWO_LAYERS)
    ),
    # tp inside pipeline stages: the last stage's MTP block under tp, its vocabulary-sharded
    # embedding copy's gradient over the embedding group (the pp mesh at each tp coordinate)
    "deepseek_v3 pp=2,tp=2 mtp=1": Layout(
        "deepseek_v3", dict(dp_shard=1, pp=2, tp=2), (("model.mtp_layers", "1"), _TWO_LAYERS)
    ),
    # the options that change what a step issues
    "llama3 tp=2,fsdp=2 no SP, no loss parallel, full AC": Layout(
        "llama3",
        dict(dp_shard=2, tp=2),
        (
            ("parallelism.enable_sequence_parallel", "false"),
            ("parallelism.enable_loss_parallel", "false"),
            *_FULL_AC,
        ),
    ),
    # FSDP over the cp ranks; block-causal masking: each stage gathers the micro-batch's token
    # ids over cp once per forward (document ids are defined on the whole row)
    "llama3 pp=2,cp=2 GPipe block_causal": Layout(
        "llama3",
        dict(dp_shard=1, pp=2, cp=2),
        (("parallelism.pipeline_parallel_schedule", "GPipe"), ("model.attn_mask_type", "block_causal")),
    ),
    # two stages per rank: 4 layers
    "llama3 pp=2,fsdp=2 Interleaved1F1B": Layout(
        "llama3",
        dict(dp_shard=2, pp=2),
        (("parallelism.pipeline_parallel_schedule", "Interleaved1F1B"), ("model.n_layers", "4")),
    ),
    # FSDP over all 4 ranks (dp_shard x cp): full AC's recomputation gathers nothing again
    "llama3 cp=2,fsdp=2 full AC": Layout("llama3", dict(dp_shard=2, cp=2), _FULL_AC),
    # experts replicated over tp (no EP); one micro-batch: norm and router-gate gradients
    # all-reduced over tp in bf16, not accumulated in fp32 first; MLA and SP recomputed
    "deepseek_v3 tp=2,fsdp=2 bf16 full AC accum=1": Layout(
        "deepseek_v3", dict(dp_shard=2, tp=2), (*_BF16, *_FULL_AC, ("training.global_batch_size", str(LOCAL * 2)))
    ),
    # one dense and one MoE layer; selective AC saves the functional count exchanges (EP's
    # all-to-all, ETP's all-gather) and the token all-to-alls: none is re-issued
    "deepseek_v3 fsdp=2,tp=2,ep=2,etp=2 selective AC": Layout(
        "deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2), (*_SELECTIVE_AC, _TWO_LAYERS)
    ),
    # full AC re-issues the count exchange and the token all-to-alls; experts on a size-2 FSDP
    # mesh inside the checkpointed block
    "deepseek_v3 fsdp=4,ep=2 full AC": Layout("deepseek_v3", dict(dp_shard=4, ep=2), (*_FULL_AC, _TWO_LAYERS)),
    # every N-th block fully checkpointed (2 layers, N = 2: block 0 re-runs its forward
    # collectives, block 1 does not); gradients reduced in bf16
    "llama3 tp=2,fsdp=2 bf16 reduce, selective AC every 2": Layout(
        "llama3",
        dict(dp_shard=2, tp=2),
        (*_BF16_REDUCE, *_SELECTIVE_AC, ("activation_checkpoint.selective_ac_option", "2")),
    ),
    # a V: stages 1 and 2 share pp rank 1 and hand over in memory; bf16 parameters on a
    # split-backward schedule (FSDP2's reduce-scatters in the reduce dtype all the same)
    "llama3 pp=2,fsdp=2 ZBVZeroBubble bf16": Layout(
        "llama3",
        dict(dp_shard=2, pp=2),
        (("parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"), *_BF16, _FOUR_LAYERS),
    ),
    # resharding after forward under pp: 2 layers per stage, so the embedding and every
    # stage's first block are gathered m + 1 times per pipeline step
    "llama3 pp=2,fsdp=2 LoopedBFS reshard always": Layout(
        "llama3",
        dict(dp_shard=2, pp=2),
        (
            ("parallelism.pipeline_parallel_schedule", "LoopedBFS"),
            ("parallelism.fsdp_reshard_after_forward", "always"),
            ("model.n_layers", "8"),
        ),
    ),
    # bf16 on the size-1 FSDP mesh (no data parallelism: FSDP2 only casts); one pipeline
    # micro-batch: its backward still moves the tp-replicated weights' gradients into FSDP2's
    # fp32 accumulator (torch's stage syncs only at the end of the step)
    "llama3 pp=2,tp=2 bf16 GPipe, 1 micro-batch": Layout(
        "llama3",
        dict(dp_shard=1, pp=2, tp=2),
        (
            *_BF16,
            ("parallelism.pipeline_parallel_schedule", "GPipe"),
            ("parallelism.pipeline_parallel_microbatches", "1"),
        ),
    ),
    # split backward, 2 micro-batches: pp rank 0's stages run an input half after a weight half
    # (their gradients reach FSDP2's bf16 accumulator), pp rank 1's do not (the weight halves
    # sum them in fp32): the norm and router-gate gradients are all-reduced in bf16 on pp rank
    # 0, in fp32 on pp rank 1; experts on ep borrowed from tp
    "deepseek_v3 pp=2,tp=2,ep=2 InterleavedZeroBubble fp32 params, bf16 reduce": Layout(
        "deepseek_v3",
        dict(dp_shard=1, pp=2, tp=2, ep=2),
        (("parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble"), *_FP32_BF16, _FOUR_LAYERS),
    ),
    # ETP under full AC: the etp count all-gather and token all-to-alls re-issued
    "deepseek_v3 fsdp=2,tp=2,ep=2,etp=2 full AC fp32 params, bf16 reduce": Layout(
        "deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2), (*_FULL_AC, *_FP32_BF16, _TWO_LAYERS)
    ),
    # LoRA (default targets; the base frozen): FSDP gathers base and adapters and reduces the
    # adapters only; no gradient of the frozen embedding's output (no backward all-gather) nor
    # of layer 0's attention input; the adapter factors replicated over tp beside a TP-split
    # base get Partial gradients (all-reduced), the frozen norms and router gate none
    "llama3 tp=2,fsdp=2 LoRA": Layout("llama3", dict(dp_shard=2, tp=2), (("model.converters", "lora"),)),
    # ... with per-expert adapters under etp (MLA, one dense, one MoE layer): the expert
    # adapters' factors replicated over etp get their gradients all-reduced over etp in each backward
    "deepseek_v3 fsdp=2,tp=2,ep=2,etp=2 LoRA expert adapters": Layout(
        "deepseek_v3",
        dict(dp_shard=2, tp=2, ep=2, etp=2),
        (("model.converters", "lora"), ("lora.experts", "true"), _TWO_LAYERS),
    ),
    # 8 ranks (a second launch): HSDP x FSDP x TP with bf16 parameters, never resharded
    "llama3 dp_replicate=2,fsdp=2,tp=2 bf16 reshard never": Layout(
        "llama3",
        dict(dp_replicate=2, dp_shard=2, tp=2),
        (*_BF16, ("parallelism.fsdp_reshard_after_forward", "never")),
        world=8,
    ),
    # routed experts split over etp and sharded over efsdp = 2 (on 4 ranks ETP leaves efsdp = 1)
    "deepseek_v3 fsdp=4,tp=2,ep=2,etp=2": Layout(
        "deepseek_v3", dict(dp_shard=4, tp=2, ep=2, etp=2), (_TWO_LAYERS,), world=8
    ),
    # four pipeline ranks, two stages each; 2 micro-batches: only pp rank 0's stages (0 and 4)
    # run an input half after a weight half (see above)
    "llama3 pp=4,tp=2 bf16 InterleavedZeroBubble": Layout(
        "llama3",
        dict(dp_shard=1, pp=4, tp=2),
        (
            *_BF16,
            ("parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble"),
            ("parallelism.pipeline_parallel_microbatches", "2"),
            ("model.n_layers", "8"),
        ),
        world=8,
    ),
}

# the config key of each degree, from the axis table
_KEYS = {a.name: f"--parallelism.{a.config_key}" for a in AXES}

ROUTED = "routed"  # the bytes key of a token all-to-all (see the module docstring)


def record_step(layout: Layout) -> int:
    """The step a layout trains to and records: the first without pipelining (the same
    collectives as every later step: it has no one-off exchange), :data:`PP_RECORD_STEP` with."""
    return PP_RECORD_STEP if layout.degrees.get("pp", 1) > 1 else 1


def _forget_mesh_caches() -> None:
    """DTensor's caches whose entries hold meshes (and so process groups): sharding
    propagation and redistribution plans (tools.planner.measure.forget_sharding_caches less its
    tensor-metadata cache, whose values are shapes, strides and dtypes only, valid for any layout)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from trainer.optim import foreach_strategy

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _gen_transform_infos.cache_clear()
    foreach_strategy.forget()  # its entries hold meshes too (keyed by the mesh object: no stale hit)


def _argv(layout: Layout, folder: str) -> list[str]:
    model, degrees = layout.model, layout.degrees
    batch_degree = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
    argv = [
        *("--config", f"{model}.toml", "--model.n_layers", str(N_LAYERS[model])),
        *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(LOCAL)),
        *("--training.global_batch_size", str(LOCAL * ACCUM * batch_degree)),
        *("--training.steps", str(record_step(layout)), "--comm.record_step", str(record_step(layout))),
        *("--training.prefetch", "false", "--checkpoint.enable", "false"),
        *("--metrics.enable_tensorboard", "false", "--job.dump_folder", folder),
    ]
    for name, key in _KEYS.items():
        argv += [key, str(degrees.get(name, 1))]
    argv += ["--optimizer.implementation", "fused"]  # see the module docstring
    for key, value in layout.config:  # later arguments win
        argv += [f"--{key}", value]
    return argv


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _record_layouts(rank: int, world_size: int, folder: str, names: list[str]) -> dict[str, list[dict]]:
    """Each layout of ``names`` in turn on this rank, each through a fresh real Trainer (built,
    trained, dropped, then DTensor's caches cleared): layout -> the records of its recorded
    step. A failure ends the launch, naming the layout."""
    from trainer.config import load_config
    from trainer.trainer import Trainer

    out: dict[str, list[dict]] = {}
    for name in names:
        sub = Path(folder) / _folder_name(name)
        try:
            trainer = Trainer(load_config(_argv(LAYOUTS[name], str(sub))))
            trainer.train()
        except Exception as exc:
            raise RuntimeError(f"layout {name!r} failed on rank {rank}") from exc
        with open(sub / f"comm_rank{rank}.json") as f:
            out[name] = json.load(f)["records"]
        trainer = None
        _forget_mesh_caches()
    return out


@functools.cache
def _plan(name: str):
    from trainer.config import load_config
    from trainer.plan import plan_job

    return plan_job(
        load_config(_argv(LAYOUTS[name], "unused")), LAYOUTS[name].world, tokenizer_vocab=2048, tokenizer_eos=_eos_id()
    )


@functools.cache
def _eos_id() -> int:
    """The shipped tokenizer's EOS id (the recorded runs use it; block-causal masking reads it)."""
    from trainer.data.tokenizer import load_tokenizer

    return load_tokenizer("").eos_id


def predicted(name: str, rank: int) -> list[dict]:
    """The planner's records for ``rank`` of the layout, from the trainer's own job plan of
    the same config (batch split, schedule, micro-batches, dtypes, SP / loss parallel, AC)."""
    from tools.planner.collectives import predict_collectives
    from tools.planner.from_config import choice_from_plan
    from trainer.plan import model_overrides

    plan = _plan(name)
    pd, choice = plan.parallel_dims, choice_from_plan(plan)
    overrides = model_overrides(plan.config, 2048, _eos_id())
    return predict_collectives(LAYOUTS[name].model, "debugmodel", pd.degrees, choice, rank, **overrides)


def _token_exchange(kind: str, mesh: str) -> bool:
    return kind == "all_to_all" and mesh in ("ep", "etp")


def _routed_predicted(r: dict, count_exchange_bytes: int) -> bool:
    """A planner record of token all-to-alls: all but the int64 count exchange (whose size,
    ``8 * n_routed_experts``, no token exchange has: rows are ``dim`` floats)."""
    return _token_exchange(r["kind"], r["mesh"]) and r["bytes"] != count_exchange_bytes


def _routed_measured(r: dict) -> bool:
    """A recorded token all-to-all: the floating-point ones (the count exchange is int64)."""
    return _token_exchange(r["kind"], r["mesh"]) and r["dtype"] != "int64"


def predicted_calls(records: list[dict], count_exchange_bytes: int) -> Counter:
    """(kind, mesh, bytes) -> calls of the planner's records, token all-to-alls under bytes =
    ROUTED."""
    out: Counter = Counter()
    for r in records:
        out[(r["kind"], r["mesh"], ROUTED if _routed_predicted(r, count_exchange_bytes) else r["bytes"])] += r["count"]
    return out


def measured_calls(records: list[dict]) -> Counter:
    """The same from a recorder's records (one record per call)."""
    out: Counter = Counter()
    for r in records:
        out[(r["kind"], r["mesh"], ROUTED if _routed_measured(r) else r["bytes"])] += 1
    return out


def predicted_routed_bytes(records: list[dict], count_exchange_bytes: int) -> Counter:
    """(kind, mesh) -> bytes of the token all-to-alls the planner predicts in a step."""
    out: Counter = Counter()
    for r in records:
        if _routed_predicted(r, count_exchange_bytes):
            out[(r["kind"], r["mesh"])] += r["bytes"] * r["count"]
    return out


def measured_routed_bytes(records: list[dict]) -> Counter:
    out: Counter = Counter()
    for r in records:
        if _routed_measured(r):
            out[(r["kind"], r["mesh"])] += r["bytes"]
    return out


def compare(want: Counter, got: Counter) -> list[str]:
    """Every (kind, mesh, bytes) whose call count differs, as readable lines ([] = equal)."""
    keys = sorted(set(want) | set(got), key=lambda k: (k[1], k[0], str(k[2])))
    return [
        f"{kind} on {mesh}, {nbytes} B per call: predicted {want.get(k, 0)}, recorded {got.get(k, 0)}"
        for k in keys
        for kind, mesh, nbytes in [k]
        if want.get(k, 0) != got.get(k, 0)
    ]


_TEST = "test_predicted_collectives_equal_a_recorded_step"


@pytest.fixture(scope="module")
def recorded(request, tmp_path_factory):
    """``recorded(name)``: the per-rank records of a layout's recorded step. The layouts this
    session selected of :data:`LAYOUTS` with one world size are recorded in launches of at most
    :data:`LAUNCH_LAYOUTS` of them (in the order of :data:`LAYOUTS`), each at the first call for
    one of its layouts; a layout not among them (none normally) gets a launch of its own."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == _TEST and getattr(item, "module", None) is request.module
    ]
    cache: dict[str, list[list[dict]]] = {}

    def get(name: str) -> list[list[dict]]:
        if name not in cache:
            world = LAYOUTS[name].world
            names = [n for n in dict.fromkeys(selected) if LAYOUTS[n].world == world]
            # the launch of this layout's group: at most LAUNCH_LAYOUTS consecutive layouts
            names = [
                n
                for i in range(0, len(names), LAUNCH_LAYOUTS)
                if name in (g := names[i : i + LAUNCH_LAYOUTS])
                for n in g
            ]
            names = names or [name]
            folder = tmp_path_factory.mktemp("comm")
            ranks = run_distributed(_record_layouts, world, str(folder), names, timeout=120 + 45 * len(names))
            cache.update({n: [r[n] for r in ranks] for n in names})
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_collectives_equal_a_recorded_step(name, recorded):
    from tools.planner.inventory import model_inventory

    records = recorded(name)
    _, args = model_inventory(LAYOUTS[name].model, "debugmodel")
    exchange = 8 * args.n_routed_experts if args.has_experts else -1
    world = LAYOUTS[name].world
    predictions = [predicted(name, rank) for rank in range(world)]
    for rank in range(world):
        # every call ran on a process group of this layout's own meshes (a group of an earlier
        # Trainer of the launch, kept alive by a cache, would have no name here)
        foreign = [r for r in records[rank] if not r["aliases"]]
        assert not foreign, f"{name} rank {rank}: {len(foreign)} calls on other layouts' groups: {foreign[:3]}"
        want, got = predicted_calls(predictions[rank], exchange), measured_calls(records[rank])
        assert got, f"{name} rank {rank}: nothing recorded"
        mismatches = compare(want, got)
        assert not mismatches, f"{name} rank {rank}:\n  " + "\n  ".join(mismatches)
        # the comparison can fail: the prediction without any one of its records differs
        for dropped in want:
            mutated = want.copy()
            del mutated[dropped]
            assert compare(mutated, got), (name, rank, dropped)
    # token all-to-alls: the world's total bytes per mesh equal the planner's
    want_routed = sum((predicted_routed_bytes(p, exchange) for p in predictions), Counter())
    got_routed = sum((measured_routed_bytes(r) for r in records), Counter())
    assert want_routed == got_routed, name
    if LAYOUTS[name].degrees.get("ep", 1) > 1:
        assert want_routed[("all_to_all", "ep")] > 0


def test_compare_names_each_difference():
    want = Counter({("all_gather", "fsdp", 64): 4, ("all_reduce", "loss", 4): 1})
    assert compare(want, want.copy()) == []
    got = Counter({("all_gather", "fsdp", 64): 3, ("all_reduce", "tp", 4): 1})
    assert compare(want, got) == [
        "all_gather on fsdp, 64 B per call: predicted 4, recorded 3",
        "all_reduce on loss, 4 B per call: predicted 1, recorded 0",
        "all_reduce on tp, 4 B per call: predicted 0, recorded 1",
    ]

"""A layout choice (everything besides the degrees that changes what a step runs) and what it
means for one rank: gradient-accumulation steps, the pipeline stages the rank runs, the blocks
whose forward the backward runs again. Shared by the collective, compute and memory estimates."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "DTYPE_BYTES",
    "LayoutChoice",
    "fully_checkpointed",
    "grad_accum_steps",
    "selective_every",
    "stage_layers",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LayoutChoice:
    """Everything besides the degrees that changes what a step runs."""

    global_batch: int
    local_batch: int  # sequences per micro-batch per rank (training.local_batch_size)
    seq_len: int
    schedule: str | None = None  # pp > 1
    n_microbatches: int | None = None  # pipeline micro-batches per local batch
    ac: str = "none"
    reshard: str = "default"  # fsdp_reshard_after_forward
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    # activation_checkpoint.selective_ac_option under ``ac == "selective"``: "op" (the per-op
    # policy) or an integer N (every N-th block of a stage fully checkpointed)
    selective_ac_option: str = "op"
    # model.converters = ["float8"] and/or ["float8_experts"]: models.parallel.float8.Float8Options
    # (None: off); which linears and routed experts convert and what that changes:
    # tools/planner/float8.py
    float8: object = None
    # model.converters = ["lora"]: models.parallel.lora.LoRAOptions (None: off); FSDP reduces the
    # adapters' gradients only (tools/planner/lora.py)
    lora: object = None

    @property
    def mixed(self) -> bool:
        return self.param_dtype != "float32" or self.reduce_dtype != "float32"


def grad_accum_steps(choice: LayoutChoice, degrees) -> int:
    return choice.global_batch // (degrees.dp_replicate * degrees.dp_shard * choice.local_batch)


def stage_layers(params_args, degrees, choice: LayoutChoice, rank: int, layout):
    """[(layers, has_embed, has_head)] of the pipeline stages ``rank`` runs. DeepSeek-V3's MTP
    depths (``mtp_layers`` = D) are blocks ``n_layers .. n_layers + D - 1`` of the stage with
    the head (the last; models/parallel/pipeline keeps them there)."""
    n_layers = params_args.n_layers
    depth = getattr(params_args, "mtp_layers", 0)
    if degrees.pp == 1:
        return [(range(n_layers + depth), True, True)], None
    stages, plan = _stages(n_layers, degrees.pp, choice.schedule, choice.n_microbatches, choice.local_batch,
                           layout.coordinate("pp", rank))  # fmt: skip
    if depth:
        stages = [(range(layers.start, layers.stop + depth) if head else layers, embed, head)
                  for layers, embed, head in stages]  # fmt: skip
    return stages, plan


@lru_cache(maxsize=65536)
def _stages(n_layers: int, pp: int, schedule: str, m: int, local_batch: int, pp_rank: int):
    from models.parallel.pipeline.plan import plan_stages

    plan = plan_stages(n_layers, pp, schedule, m, local_batch)
    stages = []
    for s in plan.rank_stages[pp_rank]:
        lo, hi = plan.layer_ranges[s]
        stages.append((range(lo, hi), s == 0, s == plan.num_stages - 1))
    return stages, plan


def fully_checkpointed(choice: LayoutChoice, layers) -> list[int]:
    """The layers of one stage (``layers``, in order) whose forward the backward runs again with
    every op (models/parallel/activation_checkpoint.py): all of them under full AC, every N-th
    block of the stage's model chunk (counting from its first block) under selective AC with an
    integer option, none otherwise (selective AC's per-op policy saves every collective's
    output, and no recomputation happens without AC)."""
    if choice.ac == "full":
        return list(layers)
    every = selective_every(choice)
    if every:
        return [layer for k, layer in enumerate(layers) if k % every == 0]
    return []


def selective_every(choice: LayoutChoice) -> int | None:
    """N of selective AC's every-N-th-block option, None for any other AC choice."""
    option = str(choice.selective_ac_option)
    return int(option) if choice.ac == "selective" and option.isdigit() and int(option) > 0 else None

"""The planner knows LoRA (tools/planner/lora.py): per rank, its predicted parameter bytes (the
frozen base in its storage dtype + the fp32 adapters, FSDP2's padded chunks), gradient bytes
(the adapters' padded reduce-scatter outputs only) and AdamW state (the adapters' local shards
only) equal the bytes of the real sharded LoRA model after a step (tools/planner/measure.py on
the fake backend, one forked process per layout), under FSDP x TP (adapters split like their
base), FSDP x EP with per-expert adapters and a bf16 frozen base, and FSDP x TP x EP x ETP with
per-expert adapters split over etp. Negative control: the
planner without LoRA predicts over 10x more (18x for llama3 rank 8) optimizer bytes than the LoRA model holds."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from models.parallel.lora import LoRAOptions
from parallel_dims.layout import validate_degrees
from tools.planner.choice import LayoutChoice
from tools.planner.estimate import Job
from tools.planner.hardware import load_hardware
from tools.planner.rank_memory import memory_parts, rank_context

pytestmark = pytest.mark.unit

CASES = [
    ("llama3", dict(dp_shard=2, tp=2, world_size=4), 1, "float32", dict(rank=8)),
    ("deepseek_v3", dict(dp_shard=2, ep=2, world_size=2), 0, "bfloat16", dict(rank=4, experts=True, frozen_dtype="bfloat16")),
    ("deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2, world_size=4), 3, "float32", dict(rank=4, experts=True)),
]  # fmt: skip


def _predicted(model, degrees, rank, dtype, lora):
    d = validate_degrees(**degrees)
    job = Job(
        model, "debugmodel", d.world_size, 8, 64, 2 * d.dp_shard, load_hardware("h100"), param_dtype=dtype,
        lora=LoRAOptions(**lora) if lora else None,
    )  # fmt: skip
    choice = LayoutChoice(global_batch=job.global_batch, local_batch=2, seq_len=64, param_dtype=dtype)
    return memory_parts(job, d, choice, rank_context(job, d, choice, rank))


def test_lora_training_state_equals_the_real_sharded_model():
    from tests.distributed.run_json import run_on_own_process

    def measure(case):
        model, degrees, rank, dtype, lora = case
        return run_on_own_process(
            "tools.planner.measure:measure_training_state", model, "debugmodel", degrees, rank, dtype, lora=lora
        )

    with ThreadPoolExecutor(2) as pool:
        measured = list(pool.map(measure, CASES))
    for case, got in zip(CASES, measured):
        mem = _predicted(*case)  # the state's bytes by kind (tools/planner/phases.py MemoryParts)
        assert (mem.params, mem.grads, mem.optimizer) == (
            got["params_bytes"],
            got["grads_bytes"],
            got["optimizer_bytes"],
        ), (case, mem, got)
        full = _predicted(*case[:4], None)
        assert full.optimizer > 10 * got["optimizer_bytes"], (full.optimizer, got["optimizer_bytes"])

"""Tied input/output embeddings under FSDP and TP (tier 2, gloo): one training step of the
harness's llama3 (2 layers, dim 256, vocab 512) with ``tie_word_embeddings`` equals the tied
model on one process (tests/distributed/parallel_harness.py: initial weights exact, loss and grad
norm 1e-6 relative, grads 5e-6 of each tensor's largest entry, AdamW-updated weights 5e-5, all
ranks bit-identical), and every rank keeps one Parameter for both uses.

Both layouts need 2 ranks and share one launch. fsdp=2 proves the embedding, norm and head in
the root FSDP unit reduce the tied gradient once, after both uses; tp=2 proves the embedding
(row-wise) and head (column-wise, loss parallel) share one vocabulary-sharded tensor: a head
with a weight of its own would leave the embedding's gradient without the head's share (the
reference's ``tok_embeddings.weight`` grad is the sum of both, checked in
tests/unit/test_tied_embeddings.py against two untied copies).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed import parallel_harness as ph
from tools.launcher import run_distributed

pytestmark = pytest.mark.distributed

GLOBAL_BS, SEQ_LEN, MAX_NORM = 4, 16, 1.0
LAYOUTS = {"fsdp2": dict(dp_shard=2), "tp2": dict(tp=2)}


def _tied_steps(rank, world_size, cases):
    plan_untied = ph.harness_plan
    build = ph.build_layout_model

    def tied_plan(*args, **kwargs):
        plan = plan_untied(*args, **kwargs)
        spec = dataclasses.replace(plan.model, args=dataclasses.replace(plan.model.args, tie_word_embeddings=True))
        return dataclasses.replace(plan, model=spec)

    def build_tied(plan):
        model = build(plan)
        assert model.output.weight is model.tok_embeddings.weight, "the layout untied the embedding and head"
        return model

    ph.harness_plan = tied_plan  # the forked rank's own copy of the module
    ph.build_layout_model = build_tied
    return ph.parallel_steps(rank, world_size, cases)


def test_tied_embeddings_fsdp_and_tp_match_one_process():
    cases = [("llama3", degrees, None, GLOBAL_BS, SEQ_LEN, MAX_NORM) for degrees in LAYOUTS.values()]
    per_rank = run_distributed(_tied_steps, 2, cases, timeout=240)
    failures = []
    for i, name in enumerate(LAYOUTS):
        results = [r[i] for r in per_rank]
        assert "output.weight" not in results[0]["grad_rel_err"]  # one tensor, as on one process
        failures += [f"{name}: {msg}" for msg in ph.fp32_failures(results)]
    assert not failures, "\n".join(failures)

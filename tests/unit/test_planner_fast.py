"""The planner's search after issue 53's speed-up ranks exactly what it ranked before, and
``--fit`` picks the memory options a hand-worked case needs.

Identity: every estimate of :func:`tools.planner.search.plan_layouts` (degrees, choice, memory
terms, time terms, tokens/s, as exact float reprs, in rank order) hashed
(:func:`tools.planner.search.ranking_digest`) for two cases, against the digests the search
before the speed-up (commit f4617db, the same digest code run on that tree) gave, re-recorded for
the phase-aware memory model where the batched search and the per-layout pricing
(``reference=True``) agreed (``tests/unit/data/planner_rankings.json``): a dense model on 16 GPUs (every schedule, split-backward
ones with bf16 parameters under tp, so the per-rank cast order is exercised) and a MoE with both
float8 converters on 8. The negative control: a one-ulp change of one estimate changes the digest.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data" / "planner_rankings.json"


def _cases():
    from models.parallel.float8 import Float8Options
    from tools.planner.estimate import Job
    from tools.planner.hardware import load_hardware

    h = load_hardware("h100")
    f8 = Float8Options(recipe="tensorwise", fsdp_float8_all_gather=True, linears=True, moe_fqns=("experts",))
    return {
        "llama3_8B_16": Job("llama3", "8B", 16, 8, 4096, 32, h),
        "qwen3_moe_8_f8": Job("qwen3", "30B-A3B", 8, 4, 2048, 16, h, float8=f8),
    }


@pytest.mark.parametrize("name", ["llama3_8B_16", "qwen3_moe_8_f8"])
def test_search_ranks_as_before(name):
    import math

    from tools.planner.search import plan_layouts, ranking_digest

    want = json.loads(DATA.read_text())["cases"][name]
    result = plan_layouts(_cases()[name])
    assert (len(result.estimates), result.pruned_oom) == (want["estimates"], want["pruned_oom"])
    assert ranking_digest(result) == want["sha256"]
    # negative control: one estimate's tokens/s one ulp off changes the digest
    e = result.estimates[0]
    moved = dataclasses.replace(e, tokens_per_s_per_gpu=math.nextafter(e.tokens_per_s_per_gpu, 0.0))
    assert ranking_digest(dataclasses.replace(result, estimates=[moved, *result.estimates[1:]])) != want["sha256"]


def _option_cases():
    """Small jobs that turn on what the two digest cases do not: Muon, LoRA (experts too),
    DeepSeek-V3's MTP depth with MLA, float32 parameters, and a 1B model on a memory budget
    that ``--fit`` fills with its options."""
    from models.parallel.lora import LoRAOptions
    from tools.planner.estimate import Job
    from tools.planner.hardware import load_hardware

    h = load_hardware("h100")
    small = dataclasses.replace(h, memory_gib=12.0, reserve_gib=0.0)
    return {
        "muon": Job("llama3", "debugmodel", 4, 4, 2048, 8, h, optimizer="Muon"),
        "lora_experts": Job("deepseek_v3", "debugmodel", 4, 2, 512, 4, h, lora=LoRAOptions(experts=True)),
        "mtp_fp32": Job("deepseek_v3", "debugmodel", 4, 4, 512, 4, h, param_dtype="float32",
                        model_overrides=(("mtp_layers", 1),)),
        "fit_1B": Job("llama3", "1B", 4, 4, 8192, 4, small),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["muon", "lora_experts", "mtp_fp32", "fit_1B"])
def test_batch_pricing_equals_pricing_each_layout(name):
    """The search's batched pricing (tools/planner/batch.py: contexts, activations, FLOPs and
    collective times shared over the choices of one set of degrees) ranks exactly what pricing
    each layout alone does, every field of every estimate, and so does ``--fit`` over them
    (every option set, saving and priced estimate). Negative control: a batched search whose
    memory is one byte off somewhere is told apart."""
    from tools.planner.batch import BatchPricer
    from tools.planner.fit import fit_layouts
    from tools.planner.search import plan_layouts, ranking_digest

    job = _option_cases()[name]
    fit = name == "fit_1B"
    new = plan_layouts(job, prune_state=not fit)
    old = plan_layouts(job, prune_state=not fit, reference=True)
    assert new.estimates and any(e.fits for e in new.estimates)
    assert ranking_digest(new) == ranking_digest(old)
    if fit:
        got = fit_layouts(job, new.estimates)
        assert any(r.options for r in got)  # the budget needs options for some layouts
        assert [repr(r) for r in got] == [repr(r) for r in fit_layouts(job, old.estimates)]
        return
    memories = BatchPricer.memories

    def off_by_one(self, choices, ranks):
        out = memories(self, choices, ranks)
        if self.d.tp == 1:
            return out
        return [[{**m, "total": m["total"] + 1} for m in mems] if c.ac == "full" else mems
                for c, mems in zip(choices, out)]  # fmt: skip

    try:
        BatchPricer.memories = off_by_one
        assert ranking_digest(plan_layouts(job)) != ranking_digest(old)
    finally:
        BatchPricer.memories = memories


def test_rank_split_backward_casts_match_the_whole_schedule():
    """The per-rank cast answer (that rank's actions alone, no bubbles) equals the whole
    schedule's on every rank's stages."""
    from tools.planner.schedule_order import rank_split_backward_casts, split_backward_casts

    for sched, pp, v, m in [
        ("InterleavedZeroBubble", 2, 2, 2), ("InterleavedZeroBubble", 4, 2, 8), ("InterleavedZeroBubble", 3, 3, 3),
        ("ZBVZeroBubble", 2, 2, 4), ("ZBVZeroBubble", 4, 2, 4), ("ZBVZeroBubble", 4, 2, 16),
    ]:  # fmt: skip
        whole = split_backward_casts(sched, pp, v, m)
        parts = {}
        for r in range(pp):
            part = rank_split_backward_casts(sched, pp, v, m, r)
            assert part == {s: whole[s] for s in part}, (sched, pp, v, m, r)
            parts.update(part)
        assert parts == whole
    assert rank_split_backward_casts("1F1B", 4, 1, 4, 0) is None


def _fit(seq_len: int, memory_gib: float, reserve_gib: float = 0.0):
    from tools.planner.estimate import Job
    from tools.planner.fit import fit_layouts
    from tools.planner.hardware import load_hardware
    from tools.planner.search import plan_layouts

    hw = dataclasses.replace(load_hardware("h100"), memory_gib=memory_gib, reserve_gib=reserve_gib)
    job = Job("llama3", "1B", 1, 1, seq_len, 1, hw)
    return job, fit_layouts(job, plan_layouts(job, ac_modes=("full",), prune_state=False).estimates)


def test_fit_picks_the_option_a_case_needs():
    """llama3 1B, one GPU, one sequence, full AC (GiB, the planner's phases,
    tools/planner/phases.py): at 8192 tokens the peak is the loss backward's start, params
    5.58 + AdamW 11.17 + gathered 2.79 + activations 6.50 + the loss's two float32 gradients
    7.83 = 33.86 (no parameter gradient exists yet); the blocks' backward peaks at 27.08, the
    optimizer step at 22.33. Chunked loss (1024-token chunks) moves the peak to the end of the
    backward (25.12: it saves 8.74, not the 11.47 it takes off the loss phase), bf16 state saves
    5.58, activation offload 0.50 (every block's input off the device at the loss backward), CPU offload 16.75 (params and state: the gradients, 5.58,
    are not alive at the peak). At 32,768 tokens the plain peak is 76.83; chunked loss alone
    26.02, CPU offload alone 60.09, bf16 state + activation offload 69.25.

    * 80 GiB: fits as it is, no option;
    * 18 GiB at 8192: only CPU offload can (17.12; every set without it peaks at 19.54 or more:
      chunked loss + bf16 state + activation offload, whose backward end holds params, grads,
      half the state and the gathered copies);
    * 61 GiB at 32,768: chunked loss alone fits and so does CPU offload alone, but its host
      copies cost more than the head's recomputation, so chunked loss ranks first."""
    gib = 2**30
    _, plain = _fit(8192, 80.0, 6.0)
    assert plain[0].options == () and plain[0].estimate.fits
    _, offload = _fit(8192, 18.0)
    assert {r.options for r in offload} == {("cpu_offload",)}
    assert offload[0].saved["cpu_offload"] == pytest.approx(16.747 * gib, rel=1e-3)
    assert offload[0].estimate.memory["total"] == pytest.approx(17.115 * gib, rel=1e-3)
    _, chunk = _fit(32768, 61.0)
    assert chunk[0].options == ("loss_chunk_tokens",)
    assert {r.options for r in chunk} == {("loss_chunk_tokens",), ("cpu_offload",)}
    assert chunk[0].saved["loss_chunk_tokens"] == pytest.approx((76.835 - 26.021) * gib, rel=1e-3)
    assert chunk[0].estimate.time["loss_recompute"] > 0
    assert chunk[1].estimate.time["host_link"] > chunk[0].estimate.time["loss_recompute"]


def test_fit_cli_prints_config_lines_and_refuses_bad_input(capsys, tmp_path):
    import tomllib

    from tools.planner.cli import main

    base = ["--model", "llama3", "--flavor", "1B", "--world-size", "1", "--gpus-per-node", "1", "--seq-len", "8192",
            "--global-batch", "1", "--ac", "full", "--reserve-gib", "0"]  # fmt: skip
    toml = tmp_path / "fit.toml"
    assert main([*base, "--fit", "--memory-gib", "18", "--toml", str(toml)]) == 0
    out = capsys.readouterr().out
    assert "[training]\n  cpu_offload = true" in out and "CPU offload" in out
    # the layout and the option in one valid config (the option under the layout's [training])
    config = tomllib.loads(toml.read_text())
    assert config["training"]["cpu_offload"] is True and config["training"]["seq_len"] == 8192
    for bad, needle in [
        (["--fit", "--loss-chunk-tokens", "0"], "--loss-chunk-tokens must be >= 1"),
        (["--loss-chunk-tokens", "512"], "add --fit"),
    ]:
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("name", ["llama3_8B_16", "qwen3_moe_8_f8"])
def test_collective_template_serves_every_batch_split(name):
    """A rank's collective template (tools/planner/collective_template.py) built from one batch
    split gives, for every other split of the same (degrees, rank, schedule, AC, reshard), the
    records a template built from that split gives (what the search's cache by
    ``template_key`` assumes), and its byte total without the records equals theirs (the
    busiest-rank test). Not vacuous: the splits' records differ."""
    from tools.planner.collectives import _build_template, template_key
    from tools.planner.inventory import cached_layout
    from tools.planner.search import enumerate_layouts

    job = _cases()[name]
    key = tuple(sorted(job.overrides.items()))
    groups: dict = {}
    for d, c in enumerate_layouts(job):
        for r in sorted({0, (d.pp - 1) * (d.world_size // d.pp)}):
            groups.setdefault(template_key(job.model, job.flavor, key, d, c, r), []).append((d, c, r))
    differ = checked = 0
    for members in list(groups.values())[::7]:
        d, first, r = members[0]
        shared = _build_template(job.model, job.flavor, d, first, r, cached_layout(d), key)
        seen = set()
        for _, c, _ in members:
            m = c.n_microbatches if d.pp > 1 else 1
            split = (c.global_batch // (d.dp_replicate * d.dp_shard * c.local_batch), m, c.local_batch // m)
            own = _build_template(job.model, job.flavor, d, c, r, cached_layout(d), key).records(*split)
            assert shared.records(*split) == own, (d, c, r)
            assert shared.total_bytes(*split) == sum(k[2] * n for k, n in own)
            seen.add(tuple(own))
            checked += 1
        differ += len(seen) > 1
    assert checked > 100 and differ > 10, (checked, differ)

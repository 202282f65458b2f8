"""Write docs/benchmarks.md from bench_results/*.json: the one page that holds measured figures.

``python -m benchmarks.report`` (the last step of ``make bench``) reads every JSON file in
``bench_results/`` and renders it; the output depends on the files' contents only (no clock, no
host), so the same files always give the same page, and ``tests/unit/test_benchmarks_report.py``
checks that the committed page is what the committed files give. Three kinds of file:

- ``make bench`` output (``benchmarks/run.py``: ``host``, ``started`` and one key per section);
- ``make bench-gpu`` output (``benchmarks/gpu.py``: ``host`` and ``rows``); smoke runs
  (``host.smoke``, tiny CPU shapes whose figures mean nothing) are left out;
- archives (``"kind": "archive"``): figures measured before results were kept as files, each
  section with how it was measured, its tables (``columns``, ``rows``) and notes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = "docs/benchmarks.md"
RESULTS_DIR = "bench_results"

# (section id, heading, what it measures and against which reference): the page's order
SECTIONS: list[tuple[str, str, str]] = [
    ("train", "The debug run (make train)", "the Llama 3 debug model, 50 steps, 4 CPU processes over gloo"),
    (
        "mesh_build",
        "Mesh build",
        "`make bench` section `mesh_build`: ParallelDims build time and process groups of rank 0 for "
        "world sizes 8 ... 131072 on the fake backend, one fresh process per implementation and size; "
        "reference: torchtitan 0.2.2's ParallelDims in the same run (the time ratio is the figure to "
        "read: absolute times move with machine load)",
    ),
    (
        "memory",
        "Memory per rank",
        "`make bench` section `memory`: per-rank bytes of params + grads + AdamW state under fsdp = 1, "
        "2, 3, 4, 8, from the real sharded model on the fake backend; reference: ideal = fsdp=1 bytes / N",
    ),
    (
        "chunked_loss",
        "Chunked cross-entropy",
        "`make bench` section `chunked_loss` (also `python -m benchmarks.run --only chunked_loss --out "
        "bench_results/chunked_loss.json`): peak live tensor bytes (tools/tensor_census.py) and CPU time (one "
        "thread, median of 3) of one forward + backward of a 151,936-token-vocabulary model at width 64 "
        "(1 block, 1,024 tokens) with `training.loss_chunk_tokens`, and the saving the planner predicts "
        "(`chunked_loss_saving_bytes`); reference: the plain head + loss (chunk 0) in the same run",
    ),
    (
        "memory_options",
        "Memory options on one job",
        "`make bench` section `memory_options` (also `python -m benchmarks.run --only memory_options --out "
        "bench_results/memory_options.json`): the device-resident peak of one training step (rank 0 of fsdp=2 on "
        "the fake backend, llama3 debug shell with a 151,936-token vocabulary at width 64) with each memory "
        "option of [memory.md](memory.md#the-options-on-one-job), classed by storage (tools/tensor_census.py's "
        "method: what an offload keeps on the host is left out); beside it the planner's prediction "
        "(`tools.planner.fit.option_memory`); reference: the plain row in the same run",
    ),
    (
        "lora",
        "LoRA against full fine-tuning",
        "`make bench` section `lora`: one rank of an fsdp=2 llama3 debug job through the real trainer on the "
        "fake backend: parameter, gradient and AdamW-state bytes and the step's peak memory (CPU: peak RSS) with "
        "LoRA (rank 8; in bf16 with the frozen base stored in bf16); reference: full fine-tuning in the same run",
    ),
    (
        "float8_cpu",
        "Float8 on a CPU host",
        "`make bench` section `float8_cpu` (also `python -m benchmarks.run --only float8_cpu --out "
        "bench_results/float8_cpu.json`): wall time of `train.py` as one process (one thread), llama3 debug "
        "model, the shipped config's batch, 3 steps, start-up included, median of 3, with float8 "
        '(`float8.cpu_gemm = "emulated"`, the CPU default) and, where it is not oneDNN\'s (no AMX-INT8), '
        'torch\'s own `_scaled_mm` (`"scaled_mm"`; on an AMX host priced from the GEMM figures instead of '
        "run); and one 256^3 GEMM by each route, one thread; reference: the same run without float8, goal "
        "float8 / reference <= 3",
    ),
    (
        "param_traffic",
        "Bytes moved per parameter per step (one rank)",
        "`make bench` section `param_traffic` (also `python -m benchmarks.param_traffic`): a census of "
        "the bytes every ATen op of one bf16 training step reads and writes (debug models, 1 x 16 tokens, "
        "fused AdamW, clipping), per parameter; reference: a hand-written mixed-precision loop on the same "
        "model and data (fp32 masters, one foreach cast, fused AdamW), goal trainer / reference <= 1.1; "
        "also FSDP2 on the size-1 mesh (the one-rank path before 2026-11-28) with and without its "
        "gradient divide factor",
    ),
    (
        "throughput",
        "Trainer throughput",
        "`make bench` section `throughput`: tokens/s of the llama3 debug model through `train.py` (1 "
        "process); reference: a bare PyTorch loop over the same model, data, AdamW and clipping",
    ),
    (
        "pipeline",
        "Pipeline schedules",
        "`make bench` section `pipeline`: steps/s per schedule and micro-batch count at pp=2 (2 CPU "
        "processes over gloo, llama3 debug model with 8 layers, local batch 8, seq 64); reference: "
        "GPipe with the same micro-batches; theory = the bubble fraction",
    ),
    (
        "moe",
        "MoE kernels",
        "`make bench` section `moe`: forward + backward of the routed experts against the number of "
        "experts E (4096 routed rows, dim 256, hidden 128, fp32, one thread); reference: the grouped "
        "GEMM path, and the old per-expert-indexing loop",
    ),
    (
        "attention",
        "Block-causal attention on CPU",
        "`make bench` section `attention`: forward + backward of one attention layer of each debug model "
        "(Llama 3 GQA, DeepSeek-V3 MLA; fp32, one thread) on one packed row of 1024 tokens holding "
        "documents of 64 ... 1024 tokens, SDPA with the block-causal boolean mask "
        '(`model.attn_mask_type = "block_causal"`, the CPU reference path; see [attention.md](attention.md)); '
        "reference: causal SDPA (`is_causal`) on the same weights in the same run",
    ),
    (
        "data_loading",
        "Data loading",
        "`make bench` section `data_loading`: one rank's (batch coordinate 0) data time per step "
        "against the batch degree D at a global batch of 512 x 1024, streaming (`jsonl`) against "
        "`tokens`, and the offline tokenizer's tokens/s with 1 and N workers; reference: the tokens "
        "path at the same D",
    ),
    (
        "planner",
        "Layout planner against measured steps",
        "`make bench` section `planner` (also `python -m benchmarks.planner`): step time of layouts of "
        "the llama3 debug model on 2 gloo processes (`train.py`, one thread each, interleaved rounds, "
        "noise = spread of the round medians) and each layout's busiest rank alone on the fake backend "
        "(its compute); reference: the planner's estimates with a CPU profile measured in the same run "
        "(FLOP rate of a 1-process step net of its optimizer step, the optimizer's memory bandwidth, "
        "full AC's recompute cost, gloo links per collective kind, a base latency per collective, TP's "
        "and CP's host overhead per block from tp=2 / cp=2 runs of 1- and 3-layer models, not the timed "
        "layouts; no overlap)",
    ),
    (
        "checkpoint",
        "Checkpoint saves and Hugging Face export",
        "`make bench` section `checkpoint` (also `python -m benchmarks.run --only checkpoint --out "
        "bench_results/checkpoint.json`): `train.py` on 2 gloo processes (fsdp 2, one thread each) of a "
        "llama3 debug model with several hundred MB of fp32 weights + AdamW state, saving every few steps, "
        "once per `checkpoint.async_mode`; per save, the seconds it held training "
        "(`checkpoint_stall_s` + `checkpoint_poll_stall_s`), the step time of steps a background write "
        "overlaps, the background write time; and the Hugging Face export of the same model in one "
        "process, direct from the live model and through a temporary DCP; reference: `disabled` "
        "(the synchronous save) in the same run, goal async / disabled <= 0.2",
    ),
    (
        "local_tensor",
        "Simulated ranks in one process against real processes",
        "`make bench` section `local_tensor` (also `python -m benchmarks.run --only local_tensor --out "
        "bench_results/local_tensor.json`): median step time (steps 3-6 of 6), peak RSS and CPU time of "
        "`train.py` with the llama3 debug model at tp=2 x dp_shard=2 (seq 64, global batch 8) run as one "
        "process with `--comm.mode local_tensor --comm.fake_world_size 4`; reference: the same job as 4 "
        "gloo processes through torchrun in the same run (one thread per process; memory against the sum "
        "of the 4 processes' peaks), and its last-step loss (bitwise the same for this layout)",
    ),
    (
        "optimizer",
        "Optimizer step: Muon against AdamW",
        "`make bench` section `optimizer` (also `python -m benchmarks.run --only optimizer --out "
        "bench_results/optimizer.json`): the optimizer step of the llama3 debug model (6 blocks) on 2 gloo "
        "ranks (one thread each) under fsdp=2 and tp=2, Muon (trainer/optim/muon.py) against AdamW (foreach) in "
        "the same processes, median of 5 steps, Muon under both `optimizer.muon_distribution` schemes: "
        "round_robin (the default: one owner rank per matrix) and gather (every rank every matrix)",
    ),
    (
        "first_step",
        "First optimizer step: DTensor's pricing of the foreach ops",
        "`make bench` section `first_step` (also `python -m benchmarks.run --only first_step --out "
        "bench_results/first_step.json`): the process CPU time of AdamW's (foreach) first step on rank 0 of a "
        "tp=2 x fsdp=2 fake-backend job, llama3 debug model (dim 256) with 2, 8 and 32 blocks, where DTensor "
        "prices every foreach op, with the per-element memo (trainer/optim/foreach_strategy.py) and without it, "
        "alternating, median of 3; reference: a later step (every cache warm) in the same process",
    ),
    (
        "muon_lr",
        "Muon at AdamW's learning rate",
        "`make bench` section `muon_lr` (also `python -m benchmarks.muon_lr --out bench_results/muon_lr.json`): "
        "train.py on one process, the llama3 debug model at widths 128 and 256 with 2 blocks, 120 steps at "
        "lr 8e-4 (WSD): loss of Muon at AdamW's lr with `optimizer.muon_update_rms` 0.2 (Moonlight's, the "
        "default) and 1.0, and the hidden matrices' update RMS; reference: AdamW in the same run",
    ),
    (
        "bf16_state",
        "bf16 optimizer state against float32",
        "`make bench` section `bf16_state` (also `python -m benchmarks.bf16_state --out "
        "bench_results/bf16_state.json`): train.py on one process, the llama3 debug model (6 blocks, dim 256), "
        "200 steps, lr 8e-4 cosine, `optimizer.state_dtype` bfloat16 (stochastically rounded moments) against "
        "float32 with the same seed and batches: max and final relative gap of the 10-step mean loss against "
        "the stated bound, the optimizer state bytes of the trainer's optimizers, the optimizer step time "
        "([optimizers.md](optimizers.md#bf16-optimizer-state))",
    ),
    (
        "muon_lr_full",
        "Muon at AdamW's learning rate (full)",
        "`python -m benchmarks.muon_lr --full --out bench_results/muon_lr_full.json`: as `muon_lr` at widths "
        "256 and 512 with the debug model's 6 blocks, 128-token rows, 200 steps (the table of "
        "[optimizers.md](optimizers.md#muon))",
    ),
    (
        "planner_search",
        "Layout planner search time",
        "`make bench` section `planner_search` (also `python -m benchmarks.planner_search`): the search of "
        "`python -m tools.planner --model llama3 --flavor 405B --world-size 16384 --gpus-per-node 8 "
        "--gpu h100 --seq-len 8192 --global-batch 2048` (goal <= 10 s, one thread), its ranking's digest "
        "against the search's before issue 53's speed-up; archived: the 70B / 256 example's time",
    ),
    (
        "equivalence",
        "Layouts against one process (one training step)",
        "`tests/distributed/test_parallelize_equivalence.py`: every layout against a single-process "
        "run on the same weights and global batch for one full training step (gloo, fp32, global "
        "batch 8 x 32 tokens); measured worst cases against the test's tolerances",
    ),
    (
        "compare_loss",
        "Loss curves across layouts",
        "`python -m tools.compare_loss` over 30 steps (fp32, CPU, default debug configs, one seed checkpoint)",
    ),
    (
        "gpu",
        "GPU runs (make bench-gpu)",
        "`make bench-gpu`: the trainer on one GPU against a mixed-precision bare loop of the same model "
        "code (fp32 masters, bf16 compute: the framework's overhead), a pure-bf16 bare loop, torchtitan's "
        "model in that loop and torchtitan's own trainer, in the same call (runs before 2026-11-28 had only "
        "the pure-bf16 loop and torchtitan's model)",
    ),
    ("tests", "Test suite time", "`make test` on a fresh clone (`bash .ci/run`)"),
]
SECTION_IDS = [s[0] for s in SECTIONS]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if v == int(v) and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        if any(isinstance(x, dict) for x in v):
            return f"({len(v)} record{'' if len(v) == 1 else 's'}: see the JSON)"
        return ", ".join(fmt(x) for x in v)
    text = " ".join(str(v).split()).replace("|", "\\|")
    return text if len(text) <= 300 else text[:297] + "..."  # e.g. a failed run's log tail


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def table(columns: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(fmt(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return lines


def dict_table(rows: list[dict]) -> list[str]:
    """A list of (nested) dicts as one table: a column per flattened key, in first-seen order."""
    flat = [_flatten(r) for r in rows]
    cols: list[str] = []
    for r in flat:
        cols += [k for k in r if k not in cols]
    return table(cols, [[r.get(c) for c in cols] for r in flat])


def grouped_tables(rows: list[dict], key: str = "name") -> list[str]:
    """Rows of nested groups (a bench-gpu run: case, trainer, bare, planner): one table per group,
    each row named by ``key``; the top-level scalars in a table of their own."""
    groups: list[str] = []
    for r in rows:
        groups += [k for k, v in r.items() if isinstance(v, dict) and k not in groups]
    lines: list[str] = []
    scalars = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows]
    if any(len(r) > 1 for r in scalars):
        lines += dict_table(scalars) + [""]
    for g in groups:
        lines += [f"{g}:", ""]
        lines += dict_table([{key: r.get(key), **_flatten(r.get(g) or {})} for r in rows]) + [""]
    return lines


# the GPU summary: (column, row key or keys tried in order); a run made before the
# mixed-precision loop had one bare loop, "bare", with pure bf16 parameters: its ratios read into
# the bf16 columns
_GPU_SUMMARY = [
    ("trainer tok/s", ("trainer.tokens_per_s",)),
    ("trainer MFU %", ("trainer.mfu_pct",)),
    ("ours / torchtitan trainer", ("ours_over_torchtitan_trainer", "torchtitan_trainer.skipped")),
    ("trainer / mixed bare", ("trainer_over_bare_mixed",)),
    ("trainer / bf16 bare", ("trainer_over_bare_bf16", "trainer_over_bare")),
    ("bf16 bare / torchtitan model", ("bare_bf16_over_torchtitan_model", "bare_over_torchtitan_model")),
    ("planner / measured step", ("planner.predicted_over_measured",)),
    ("planner / measured memory", ("planner.memory_predicted_over_measured",)),
]


def gpu_summary(rows: list[dict]) -> list[str]:
    """A bench-gpu run's rows as one table of its headline figures and ratios of tokens/s."""
    out = []
    for r in rows:
        flat = _flatten(r)
        line = [r.get("name")]
        for _col, keys in _GPU_SUMMARY:
            line.append(next((flat[k] for k in keys if flat.get(k) is not None), None))
        out.append(line)
    return table(["row"] + [c for c, _k in _GPU_SUMMARY], out)


def gpu_goals(runs: list[tuple[str, dict]]) -> list[str]:
    """Issue 39's GPU goals (``benchmarks.gpu_rows.GOALS``) on the rows of the bench-gpu runs that had
    its references (a ``references`` list; later runs replace earlier rows of the same case), each
    met, missed or UNMEASURED, with the command that measures them."""
    from benchmarks.gpu_rows import GOALS_COMMAND, evaluate_goals

    used = sorted(
        ((str(d.get("started", "")), name, d) for name, d in runs if "references" in d), key=lambda c: (c[0], c[1])
    )
    rows = [r for _s, _n, d in used for r in d["rows"]]
    goals = evaluate_goals(rows)
    sources = ", ".join(f"`{RESULTS_DIR}/{n}`" for _s, n, _d in used) or "no run with these references yet"
    lines = [f"Goals of issue 39 (from {sources}):", ""]
    body = [
        [g["what"], f">= {g['threshold']}", g["status"], ", ".join(f"{k} {fmt(v)}" for k, v in g["measured"].items())]
        for g in goals
    ]
    lines += table(["goal", "threshold", "status", "measured"], body) + [""]
    if any(g["status"] == "UNMEASURED" for g in goals):
        lines += [f"To measure the UNMEASURED goals: {GOALS_COMMAND}.", ""]
    return lines


def render_value(value, depth: int = 0) -> list[str]:
    """Raw benchmark output of any shape: scalars as a list, lists of dicts as tables."""
    if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
        return dict_table(value) + [""]
    if not isinstance(value, dict):
        return [fmt(value), ""]
    lines: list[str] = []
    if depth == 0 and isinstance(value.get("summary"), str):  # a section's own paragraph, in full
        lines += [" ".join(value["summary"].split()), ""]
        value = {k: v for k, v in value.items() if k != "summary"}
    scalars = {k: v for k, v in value.items() if not isinstance(v, (dict, list)) or (isinstance(v, list) and not v)}
    scalars.update({k: v for k, v in value.items() if isinstance(v, list) and v and not isinstance(v[0], dict)})
    for k, v in value.items():
        if k in scalars:
            lines.append(f"- {k}: {fmt(v)}")
    if lines:
        lines.append("")
    for k, v in value.items():
        if k in scalars:
            continue
        if isinstance(v, dict) and not any(isinstance(x, (dict, list)) for x in v.values()):
            lines += [f"- {k}: " + ", ".join(f"{kk} {fmt(vv)}" for kk, vv in v.items()), ""]
            continue
        lines += [f"{k}:", ""] + render_value(v, depth + 1)
    return lines


def load(paths: list[Path]) -> list[tuple[str, dict]]:
    return [(p.name, json.loads(p.read_text())) for p in sorted(paths, key=lambda p: p.name)]


def classify(data: dict) -> str:
    if data.get("kind") == "archive":
        return "archive"
    if "rows" in data and "host" in data:
        return "gpu_smoke" if data["host"].get("smoke") else "gpu"
    return "bench"


def _host(data: dict) -> str:
    host = data.get("host", {})
    parts = [f"{k} {fmt(v)}" for k, v in host.items()]
    return ", ".join(parts) + (f"; started {data['started']}" if "started" in data else "")


def render(files: list[tuple[str, dict]]) -> str:
    used = [(name, data) for name, data in files if classify(data) != "gpu_smoke"]
    per_section: dict[str, list[list[str]]] = {s: [] for s in SECTION_IDS}
    newest: dict[str, list[tuple[str, str, dict]]] = {}
    for name, data in used:
        kind = classify(data)
        if kind == "archive":
            for sid, sec in data["sections"].items():
                block = [f"From `{RESULTS_DIR}/{name}` (archived): {sec['measured']}", ""]
                for t in sec.get("tables", []):
                    if t.get("title"):
                        block += [t["title"] + ":", ""]
                    block += table(t["columns"], t["rows"]) + [""]
                block += [f"- {n}" for n in sec.get("notes", [])]
                per_section[sid].append(block + ([""] if sec.get("notes") else []))
        elif kind == "gpu":
            block = [f"From `{RESULTS_DIR}/{name}` ({_host(data)}):", ""]
            if data.get("how"):
                block += [" ".join(data["how"].split()), ""]
            block += ["Summary (ratios of tokens/s):", ""] + gpu_summary(data["rows"]) + [""]
            block += grouped_tables(data["rows"])
            for check, value in data.get("checks", {}).items():  # first-GPU-run checklist measurements
                block += [f"{check}:", ""] + render_value(value)
            per_section["gpu"].append(block)
        else:
            for sid in SECTION_IDS:
                if sid in data:
                    newest.setdefault(sid, []).append((str(data.get("started", "")), name, data))
    # a section measured in several `make bench` files (a full run's bench.json and an
    # `--only` run's file): the most recent measurement only, so no figure is shown twice
    for sid, candidates in newest.items():
        _started, name, data = max(candidates, key=lambda c: (c[0], c[1]))
        block = [f"From `{RESULTS_DIR}/{name}` ({_host(data)}):", ""]
        per_section[sid].append(block + render_value(data[sid]))
    per_section["gpu"].insert(0, gpu_goals([(n, d) for n, d in used if classify(d) == "gpu"]))
    sources = ", ".join(f"`{RESULTS_DIR}/{name}`" for name, _ in used) or "(none)"
    out = [
        "# Benchmarks",
        "",
        f"<!-- generated by `python -m benchmarks.report` from {sources}; do not edit by hand: "
        "`make bench` regenerates it -->",
        "",
        "Every measured figure of this project lives on this page, generated from the JSON files in "
        f"`{RESULTS_DIR}/` by `python -m benchmarks.report` (`make bench` runs it after its "
        "sections; `make bench-gpu` writes `bench_results/gpu.json`, then run the report). Figures "
        "are ratios against a reference measured in the same run where possible, so they compare "
        "across machines; absolute times move with machine load. Archived sections were measured "
        "before results were kept as files and are transcribed from the README of that time, with "
        "how they were measured. How to run each benchmark: [gpus.md](gpus.md) for `make bench-gpu`, "
        "[testing.md](testing.md#benchmarks-make-bench) for `make bench`.",
        "",
        f"Sources: {sources}.",
        "",
        "| section | what, and the reference |",
        "|---|---|",
    ]
    out += [f"| [{title}](#{anchor(title)}) | {what} |" for _sid, title, what in SECTIONS]
    out.append("")
    for sid, title, _what in SECTIONS:
        out += [f"## {title}", ""]
        blocks = per_section[sid]
        if not blocks:
            out += ["Not measured yet.", ""]
        for block in blocks:
            out += block
    while out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def result_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=RESULTS_DIR, help="folder of the JSON results (default: %(default)s)")
    p.add_argument("--out", default=DEFAULT_OUT, help="the page to write (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page differs")
    args = p.parse_args(argv)
    text = render(load(result_files(Path(args.results))))
    out = Path(args.out)
    if args.check:
        same = out.exists() and out.read_text() == text
        print(f"{out} is {'up to date' if same else 'stale: run python -m benchmarks.report'}", file=sys.stderr)
        return 0 if same else 1
    from trainer.runtime.files import atomic_write

    atomic_write(str(out), text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

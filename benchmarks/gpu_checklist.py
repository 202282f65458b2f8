"""What the first run on a GPU must confirm: the parts of the CUDA and NCCL paths that no CPU test
can prove, each with how to check it. One list, kept here: ``make bench-gpu`` prints it at the
end of every run (``benchmarks/gpu.py``), and docs/gpus.md ("The first-GPU-run checklist") carries
the same text (``python -m benchmarks.gpu_checklist --markdown`` prints it;
``tests/unit/test_bench_gpu.py`` checks the page against it).

To add an entry: append a :class:`CheckItem` to :data:`CHECKLIST` in the block of its topic (or a
new block), then paste the new markdown into docs/gpus.md between the checklist markers.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckItem:
    what: str  # what must hold on the GPU, one sentence
    how: str  # how to check it: the command or the column/file to read, and what to expect
    topic: str  # the area (and issue item) it comes from


CHECKLIST: list[CheckItem] = [
    # -- setup, MoE + activation checkpointing + compile, MFU and GEMM dtypes (issue 24, items 6-8)
    CheckItem(
        what="`make bench-gpu` runs with the node's own torch and no network.",
        how=(
            "On the GPU node: `SYSTEM_TORCH=1 PIP_NO_INDEX=1 make bench-gpu` (or, with no venv, "
            "`python -m benchmarks.gpu` run by the node's python from the repository root). Setup "
            "prints the system torch's version and CUDA and downloads nothing; the table's rows have "
            'numbers; `bench_results/gpu.json` "host.torch" is the node\'s torch.'
        ),
        topic="setup (issue 24 item 6)",
    ),
    CheckItem(
        what="DeepSeek-V3 with activation checkpointing under torch.compile passes forward and backward.",
        how=(
            'The "deepseek_v3 16B x6 layers, compiled" row (trainer and bare loop: selective per-op '
            "AC, bf16, inductor) has numbers and no failure block below the table; and on the node "
            "`.venv/bin/python -m pytest tests/unit/test_moe_ac_compile.py` passes with its CUDA "
            "cases run, not skipped (eager and inductor backends, full and selective AC: forward and "
            "backward pass, each routed token counted once)."
        ),
        topic="MoE + AC + compile (issue 24 item 7)",
    ),
    CheckItem(
        what="MFU is plausible and the GEMMs run in bf16.",
        how=(
            "MFU% columns: the trainer within 3% of the mixed-precision bare loop (tr/mixed at "
            "least 0.97), the pure-bf16 loop at least torchtitan's model (bf16/t-model at least 1.0); "
            "for scale, torchtitan's own trainer on one H100: 43% (Llama 3) and 16% (DeepSeek-V3), "
            "eager. The bf16 GEMM column (the mixed loop's census) is 1.000 in the eager rows. In a "
            "trainer profile (`--profiling.enable_profiling`, a "
            "Perfetto trace under `<dump>/profile_traces/`) the matmul kernels are bf16 kernels and "
            "the routed experts run CUTLASS grouped GEMM kernels, not one mm per expert."
        ),
        topic="MFU and GEMM dtypes (issue 24 checklist)",
    ),
    # -- NCCL timeouts, failures and the exit (issue 24 items 1-2, issue 23)
    CheckItem(
        what="A hung rank on NCCL ends every rank with our one line, exit code 3, not SIGABRT.",
        how=(
            "A 2-GPU run with `--comm.train_timeout_seconds 30`; `kill -STOP` one worker mid-run. "
            "Every other rank ends within 30 s + at most 10 s (dump) + torchrun's 30 s with exactly one "
            "`error: rank N: step K ... comm.train_timeout_seconds = 30 s ...; flight-recorder dump: ...` "
            "line and exit code 3; `<dump_folder>/comm_traces/rank_<N>` exists for every rank that was "
            "not stopped, and `torchfrtrace <dump_folder>/comm_traces -p rank_ --allow-incomplete-ranks` "
            "reads it and names the stuck collective."
        ),
        topic="NCCL timeouts (issue 24 item 1)",
    ),
    CheckItem(
        what="A rank killed mid-step ends the others within the train timeout + 30 s.",
        how=(
            "The same run with `kill -9` on one worker. Note whether NCCL's asynchronous error "
            "handling aborts first (then NCCL's message is printed, not ours) and record it in the "
            "docs; with the step watchdog disabled in a scratch run, NCCL's own timeout at T + 30 s "
            "writes its dump to the same `comm_traces/rank_` path."
        ),
        topic="NCCL failures (issue 24 item 1)",
    ),
    CheckItem(
        what="Every NCCL group has the configured timeout, and a finished NCCL run exits 0.",
        how=(
            "`parallel_dims.process_group_timeout(group)` on every group of a 2-GPU run: init + 30 s "
            "after `build_mesh`, train + 30 s after the first step. A normal run ends with exit 0, no "
            "watchdog line, and no abort at exit (workers end through trainer/lifecycle/shutdown.py; "
            "`python -m tools.exit_stress --layouts llama3:fsdp=2 --runs 5` on 2 GPUs)."
        ),
        topic="group timeouts (issue 24 item 2), clean exit (issue 23)",
    ),
    # -- TF32, MFU precision, determinism (issue 24 items 3-5)
    CheckItem(
        what="MFU is priced at the precision the matmuls run in, on the right part.",
        how=(
            "The start-up line `mfu: against the <part> dense <precision> peak, N TFLOP/s (<device "
            'name>)` names the part ("NVIDIA H100 80GB HBM3" is the H100 SXM) and: bfloat16 at 989 on '
            "an H100 SXM; a float32 run without TF32 at 67 (IEEE fp32 kernels in the profile); "
            "`--training.enable_tf32 true` at 494.5, TF32 tensor-core kernels in the profile and about "
            "7x faster matmuls than IEEE fp32."
        ),
        topic="TF32 and MFU (issue 24 items 3, 5)",
    ),
    CheckItem(
        what="`training.deterministic = true` runs and makes runs bitwise repeatable on GPU.",
        how=(
            'Neither model raises "does not have a deterministic implementation" nor a '
            "CUBLAS_WORKSPACE_CONFIG error; `python -m tools.compare_loss --assert-equal --layouts "
            "single single` (llama3 and deepseek_v3, one GPU) and `fsdp=2 fsdp=2` (two GPUs) pass "
            "bitwise (if the multi-GPU case fails, retry with `NCCL_ALGO=Ring NCCL_NVLS_ENABLE=0`); "
            "the MoE grouped GEMM repeats bitwise (torch has no determinism alert for it); record "
            "the cost in tokens/s against a normal run; the fp32 layout-comparison tolerances "
            "(1e-5 loss, 1e-4 grad norm) hold with TF32 off."
        ),
        topic="determinism (issue 24 item 4)",
    ),
    # -- block-causal attention (issue 26)
    CheckItem(
        what="Block-causal FlexAttention (compiled) trains and costs no more than causal attention.",
        how=(
            'The "block_causal flex, compiled" rows have numbers and no failure block; their '
            "trainer `data:` line (in gpu.json) shows short synthetic documents (about 35 tokens), so "
            "their tokens/s should be at least the causal compiled row's of the same model (block "
            "sparsity skips key blocks of other documents) and tr/mixed at least 0.97; record both "
            "ratios in docs/attention.md (measured 2026-11-26 for Llama on an H200: 1.03x causal, "
            "trainer / pure-bf16 loop 0.84, before the mixed-precision loop; the DeepSeek row not yet)."
        ),
        topic="block-causal attention (issue 26)",
    ),
    # -- asynchronous checkpoints (issue 27)
    CheckItem(
        what="`checkpoint.async_mode = async_with_pinned_mem` saves and resumes on CUDA and holds training less than `async`.",
        how=(
            "Train the llama3 debug model for 20 steps with `--checkpoint.enable true --checkpoint.interval 5` "
            "three times: `--checkpoint.async_mode disabled`, `async`, `async_with_pinned_mem`; each run "
            "prints `saved checkpoint .../step-N` for every save and metrics.jsonl has "
            "`checkpoint_stall_s` + `checkpoint_poll_stall_s` per save: expect pinned < async < disabled "
            "from the second save on (the first allocates the pinned buffers and starts the checkpoint "
            "process). Then run the pinned command with `--training.steps 30 --training.deterministic "
            "true` in a fresh folder, delete its step-25 and step-30 checkpoints and run it again: it "
            "resumes at step 20 and steps 21-30 match the first run (the same 30-step lr schedule). "
            "Record the stalls in bench_results/gpu.json's checks (measured 2026-11-26 on an H200: "
            "pinned < async < disabled, resume at step 20 ran; the loss match not yet checked)."
        ),
        topic="asynchronous checkpoints (issue 27)",
    ),
    # -- float8 (issue 28)
    CheckItem(
        what="Float8 trains faster than bf16 on the Llama row, compiled, and its GEMMs run in float8.",
        how=(
            "`python -m benchmarks.gpu --masks causal --modes compiled` with torchao importable (the float8 "
            "rows are on by default): the float8 rows have numbers, `float8_over_bf16` of the Llama "
            "compiled row is at least 1.2 for the trainer (torchtitan's anchor: +28% on 8 H100s with "
            "compile + float8) and `matmul_float8_share` is above 0.7; then a 2-GPU "
            "`--model.converters float8 --float8.enable_fsdp_float8_all_gather true` run trains and "
            "its `--comm.record_step 2` all-gather bytes are about half of bf16's. Record the ratios "
            "in docs/float8.md, which lists the speed as unmeasured."
        ),
        topic="float8 training (issue 28)",
    ),
    CheckItem(
        what="Float8 routed experts run torchao's scaled grouped GEMM and speed up DeepSeek.",
        how=(
            "`pytest tests/unit/test_float8_experts.py -k cuda` passes (torchao's triton kernels and "
            "`torch._scaled_grouped_mm` against one rowwise `_scaled_mm` per expert, never run on a GPU "
            "so far); the DeepSeek float8 row of `python -m benchmarks.gpu --masks causal` (converters "
            "float8 and float8_experts) has numbers, its trainer start-up line says \"torchao's scaled "
            "grouped GEMM\", its `matmul_float8_share` is near the planner's 0.578 for these shapes "
            "(0.276 if the experts stayed bf16) and `float8_over_bf16` is above 1. Record it in docs/float8.md, "
            "which lists the experts' GPU path as unrun."
        ),
        topic="float8 training (issue 28)",
    ),
    # -- honest references: the mixed-precision loop and torchtitan's own trainer (issue 39)
    CheckItem(
        what="torchtitan's own trainer runs beside ours in the same call, and issue 39's goals are measured.",
        how=(
            "Here `make bench-gpu-prepare` (fills `.gpu/`), carry `.gpu`; on the GPU machine `python -m "
            "benchmarks.gpu --models llama3 --masks causal --precisions bf16 --out "
            "bench_results/gpu_issue39_llama3.json`, then the same for `deepseek_v3`: the "
            "titan-tr tok/s column has numbers in both rows of each call (no `skipped:` line for "
            "them, no failure block) and its steps_timed is the trainer's. Then `python -m "
            "benchmarks.report` here: the goals table of docs/benchmarks.md (both files' rows) says "
            "met or missed, not UNMEASURED: ours/titan-tr at least 1.05 in every row, tr/mixed at "
            "least 0.97, DeepSeek compiled at least 1.10x eager."
        ),
        topic="honest references (issue 39)",
    ),
    # -- restarts: torch's checkpoint process killed mid-save (issue 52)
    CheckItem(
        what="A killed checkpoint process (`async_with_pinned_mem`) ends in a restart or one line, leaves no orphan, and the run resumes bitwise.",
        how=(
            "`python -m tools.ckpt_kill_drill --out $OUT/ckpt_kill_drill.json` (2 ranks with 2+ GPUs, 1 rank on "
            "one GPU; about 3 launches of the llama3 debug model with a 131,072-token vocabulary): it SIGKILLs "
            "a random rank's checkpoint process at a random moment of a random save and prints `checkpoint-process "
            "kill drill: passed (...)`, exit 0 (one restart line within comm.train_timeout_seconds + 60 s, no "
            "traceback, no process of the job left, resumed from the newest complete checkpoint, the steps after "
            "it bitwise the uninterrupted run's). Record the line and the JSON's kill and end in docs/long_runs.md "
            '("The checkpoint-process kill drill"), which lists the drill as never run on a GPU.'
        ),
        topic="restarts (issue 52)",
    ),
]


def render_text(items: list[CheckItem] | None = None) -> str:
    """The checklist as ``make bench-gpu`` prints it at the end of its output."""
    items = CHECKLIST if items is None else items
    lines = [f"First GPU run: confirm each of these ({len(items)}; from benchmarks/gpu_checklist.py):"]
    for i, item in enumerate(items, 1):
        what, how = f"{item.what} [{item.topic}]", item.how
        lines += textwrap.wrap(what, 96, initial_indent=f"{i:>3}. ", subsequent_indent="     ", break_on_hyphens=False)
        lines += textwrap.wrap(
            how, 96, initial_indent="     how: ", subsequent_indent="          ", break_on_hyphens=False
        )
    return "\n".join(lines)


# A wrapped line must not start with what markdown reads as a new block inside a list item.
_BLOCK_START = re.compile(r"\s*([>#*+-]|\d+[.)])(\s|$)")


def _wrap_markdown(text: str, width: int, indent: str) -> list[str]:
    lines = textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)
    for i in range(1, len(lines)):
        while _BLOCK_START.match(lines[i]) and " " in lines[i - 1].strip():
            head, word = lines[i - 1].rsplit(" ", 1)  # move the previous line's last word down
            lines[i - 1], lines[i] = head, f"{indent}{word} {lines[i].strip()}"
    return lines


def render_markdown(items: list[CheckItem] | None = None) -> str:
    """The checklist as docs/gpus.md carries it: a numbered list, one entry per item."""
    items = CHECKLIST if items is None else items
    out = []
    for i, item in enumerate(items, 1):
        out += _wrap_markdown(f"{i}. **{item.what}** {item.how}", 100, "   ")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_checklist", description=__doc__.split("\n\n")[0])
    p.add_argument("--markdown", action="store_true", help="print docs/gpus.md's markdown instead of the text")
    args = p.parse_args(argv)
    print(render_markdown() if args.markdown else render_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

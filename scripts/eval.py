"""Score a checkpoint on lm-eval tasks, on the training mesh.

    python scripts/eval.py --config X --checkpoint DIR --tasks T[,T2] [--include_path P]
        [--num_fewshot K] [--limit L] [--batch_size B] [--max_gen_toks N] --output_path OUT
        [--log_samples]
        [--section.key value ...]

``DIR``: a step folder of a run (``<dump_folder>/checkpoint/step-N``), the run's checkpoint
folder (its newest step), or a Hugging Face folder; the model is built and parallelized as the
config's ``[parallelism]`` says (``--parallelism.tp 2`` ...), on as many processes as train.py
would run: torchrun's flags (``--nproc_per_node N``) start the workers through the trainer's
launcher; plain ``python scripts/eval.py`` is one process; torchrun runs it as it runs train.py.

``--tasks``: lm-eval task, group or tag names, found in ``--include_path`` (a folder of task
YAMLs, e.g. over local ``data_files``) and otherwise among lm-eval's built-in tasks (whose data
``datasets`` reads from its cache, ``HF_DATASETS_CACHE``; set ``HF_DATASETS_OFFLINE=1`` on a
host without the hub). lm-eval runs its own task definitions, seeds and metrics on
trainer/inference/lm_eval_model.py's ``MeshLM``; every rank runs every request (the model is
sharded) and rank 0 prints lm-eval's table and writes ``OUT``: the results dict of
``lm_eval.simple_evaluate`` as JSON (what lm-eval's own CLI writes as ``results_*.json``, without
per-sample logs unless ``--log_samples``: then its ``samples`` too, each request's arguments
and responses), to ``OUT`` itself when it ends in ``.json``, else to ``OUT/results.json``.
Bad input (flags, config, checkpoint, tasks) is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.environ.get("RANK", "0") != "0":  # lm-eval's logs and progress bars: rank 0's alone
    os.environ.setdefault("LMEVAL_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TQDM_DISABLE", "1")

# as train.py: a Ctrl-C while torch imports is one line; a launcher's worker ends with it
from trainer.lifecycle.start_signals import quiet_start

quiet_start()

from trainer.lifecycle.parent_death import die_with_launcher  # noqa: E402

die_with_launcher()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402

gc.disable()  # the imports' objects go to the permanent generation, as in train.py
try:
    from trainer.config import load_config
    from trainer.lifecycle.script import UsageError, rank, run_script, script_parser
finally:
    gc.freeze()
    gc.enable()

SCRIPT = os.path.abspath(__file__)


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(
        "python scripts/eval.py",
        "Score a checkpoint on lm-eval tasks on the training mesh; config keys as --section.key, "
        "torchrun's flags start the workers.",
    )
    p.add_argument("--checkpoint", required=True, help="step-N folder, checkpoint folder, or Hugging Face folder")
    p.add_argument("--tasks", required=True, help="lm-eval task/group/tag names, comma-separated")
    p.add_argument("--include_path", default="", help="a folder of lm-eval task YAMLs (searched first)")
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's)")
    p.add_argument("--limit", type=float, default=None, help="documents per task (< 1: a fraction)")
    p.add_argument("--batch_size", type=int, default=1, help="loglikelihood requests (or prompts) per forward")
    p.add_argument("--max_gen_toks", type=int, default=256, help="new tokens of a generation task that sets none")
    p.add_argument("--output_path", required=True, help="results JSON (a .json file, or a folder for results.json)")
    p.add_argument("--log_samples", action="store_true", help="keep every request and response in the JSON ('samples')")

    return p


def output_file(path: str) -> str:
    return path if path.endswith(".json") else os.path.join(path, "results.json")


def check_flags(ns) -> list[str]:
    """The task names; the numbers in range."""
    tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    if not tasks:
        raise UsageError("--tasks names no task: give lm-eval task names, e.g. --tasks hellaswag,arc_easy")
    if ns.batch_size < 1 or ns.max_gen_toks < 1:
        raise UsageError("--batch_size and --max_gen_toks must be >= 1")
    if ns.num_fewshot is not None and ns.num_fewshot < 0:
        raise UsageError(f"--num_fewshot must be >= 0, got {ns.num_fewshot}")
    if ns.limit is not None and ns.limit <= 0:
        raise UsageError(f"--limit must be > 0, got {ns.limit}")
    return tasks


def check_job(ns, cfg, world_size: int) -> None:
    """The launcher's check before any worker starts: flags, tasks, checkpoint and layout."""
    from parallel_dims import default_device_type
    from trainer.inference.lm_eval_run import task_manager
    from trainer.inference.loading import preflight

    task_manager(check_flags(ns), ns.include_path)
    preflight(cfg, ns.checkpoint, world_size, default_device_type())


def evaluate(ns, config_args: list[str]) -> int:
    """This rank's part: load, score; rank 0 prints lm-eval's table and writes the results JSON."""
    from trainer.inference.lm_eval_model import MeshLM
    from trainer.inference.lm_eval_run import evaluate as lm_evaluate
    from trainer.inference.lm_eval_run import scores, task_manager
    from trainer.inference.session import InferenceSession

    cfg = load_config(config_args)
    tasks = check_flags(ns)
    manager = task_manager(tasks, ns.include_path)  # before the model: a bad task costs no load
    session = InferenceSession.from_checkpoint(cfg, ns.checkpoint)
    lm = MeshLM(session, batch_size=ns.batch_size, max_gen_toks=ns.max_gen_toks)
    results = lm_evaluate(lm, manager, tasks, num_fewshot=ns.num_fewshot, limit=ns.limit, log_samples=ns.log_samples)
    if rank() != 0 or results is None:
        return 0
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results), flush=True)
    path = output_file(ns.output_path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    line = "  ".join(f"{k} {v:.4f}" for k, v in scores(results).items())
    print(f"scores: {line}\nwrote {path}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    return run_script(argv, build_parser(), script=SCRIPT, check_flags=check_flags, check_job=check_job, run=evaluate)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

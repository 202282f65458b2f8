"""The checkpoint-process kill drill (issue 52; docs/long_runs.md, "The checkpoint-process kill
drill"): CUDA only.

    python -m tools.ckpt_kill_drill --out drill.json [--seed S] [--ranks N] [--work DIR]
    python -m tools.ckpt_kill_drill --print-commands      # the runs it makes; no GPU needed

``checkpoint.async_mode = async_with_pinned_mem`` writes each rank's checkpoint from a process of
its own (torch's ``AsyncCheckpointerType.PROCESS``, started with multiprocessing's spawn at the
first save and kept). This drill SIGKILLs one rank's checkpoint process at a random moment of a
random save and checks what the job does. Three runs of ``train.py`` through the launcher (llama3
debug, 2 layers, a 131,072-token vocabulary so that a save takes a while: about 0.8 GB of
weights and AdamW moments; deterministic kernels; a save every 2 steps):

1. the reference: the same job, uninterrupted, without checkpoints;
2. the drill, under ``--max_restarts 1`` with every process of the job tagged in its environment:
   once the first two saves (steps 2 and 4; the first starts the checkpoint process) are
   published and a later save (step N, at random) has begun (``step-N.tmp`` exists), it sleeps
   a random fraction of the second save's duration and SIGKILLs the checkpoint process of a
   random rank;
3. only if the drill did not restart and finish: the same command again, which resumes from the
   newest complete checkpoint.

It passes when (tools/ckpt_kill_drill/checks.py ``judge``): the job shows one restart line (or,
without a restart, ends in one line) within ``comm.train_timeout_seconds`` + 60 s of the kill
and no traceback; no process of the job outlives it (an orphaned checkpoint process); the run
resumed from the newest complete checkpoint (never an older one, never a ``.tmp``); the steps
after it are bitwise the reference's; and, as a control, the steps before it are bitwise the
reference's too (else the GPU's kernels are not deterministic here and the comparison says
nothing). Ranks: 2 on a machine of 2+ GPUs, 1 on one GPU (NCCL does not put two ranks on one
device); with 1 rank there is no peer whose save waits for the dead process, so the 2-rank case
is the one that tests the collective completion (trainer/checkpoint/async_save.py).

Writes the record (``--out``, JSON: every fact judged, the failures, the commands) and the
drill's output (``<out>.log``); prints one line; exit code 0 when it passed, 1 when not, 2 when
it cannot run here (no CUDA: one line).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from tools.ckpt_kill_drill.checks import (
    BOUND_GRACE_S,
    checkpoint_processes,
    compare_curves,
    complete_steps,
    judge,
    last_rows,
    outcome_lines,
    proc_table,
    read_records,
    restart_rows,
    tagged_processes,
)

ROOT = Path(__file__).resolve().parents[2]
TAG = "MESHTRAIN_CKPT_KILL_DRILL"  # in every process of the drill's job (the orphan search)
INTERVAL = 2


def job_args(steps: int, vocab: int, train_timeout: int) -> list[str]:
    return ["--config", "llama3.toml", "--model.n_layers", "2", "--model.vocab_size", str(vocab),
            "--training.seq_len", "256", "--training.global_batch_size", "4", "--training.local_batch_size", "2",
            "--training.steps", str(steps), "--training.deterministic", "true",
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--comm.train_timeout_seconds", str(train_timeout)]  # fmt: skip


def commands(
    python: str, ranks: int, steps: int, vocab: int, train_timeout: int, work: Path, mode: str = "async_with_pinned_mem"
) -> dict[str, list[str]]:
    """The reference's, the drill's and the resume's command lines (``mode``: checkpoint.async_mode)."""
    job = job_args(steps, vocab, train_timeout)
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", str(INTERVAL),
            "--checkpoint.async_mode", mode, "--checkpoint.keep_latest_k", "0"]  # fmt: skip
    launch = [python, "train.py", "--nproc_per_node", str(ranks)]
    drill = [*job, *ckpt, "--job.dump_folder", str(work / "drill")]
    return {
        "reference": [*launch, *job, "--checkpoint.enable", "false", "--job.dump_folder", str(work / "reference")],
        "drill": [*launch, "--max_restarts", "1", *drill],
        "resume": [*launch, *drill],
    }


class Launch:
    """One launch of train.py in a session of its own, its output lines kept with their times."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int | None:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its workers run in sessions of their own: see the orphan search
            self.proc.wait()
            code = None
        self._reader.join(timeout=10)
        return code

    def text(self, since: float = 0.0) -> str:
        return "\n".join(line for t, line in self.lines if t >= since)


def _wait_until(predicate, timeout: float, launch: Launch, period: float = 0.002) -> float | None:
    """The time ``predicate`` first held (polled every ``period`` s), None on a timeout or once the
    launch ended without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        if launch.proc.poll() is not None:
            return None
        time.sleep(period)
    return None


def _kill_moment(launch: Launch, ckpt: Path, rng: random.Random, ranks: int, steps: int, rehearse: bool) -> dict:
    """Wait for the first two saves (the first one starts the checkpoint process, so the second
    one's duration is a save's), then for a random later save to begin; SIGKILL a random rank's
    checkpoint process (``rehearse``: the rank itself) at a random moment within the second
    save's duration of its start. The facts of the kill (or why there was none)."""

    def began(step: int) -> float | None:
        return _wait_until(
            lambda: (ckpt / f"step-{step}.tmp").exists() or (ckpt / f"step-{step}").exists(), 900, launch
        )

    second = 2 * INTERVAL
    published_first = _wait_until(lambda: (ckpt / f"step-{INTERVAL}").exists(), 900, launch)
    start = began(second)
    published = _wait_until(lambda: (ckpt / f"step-{second}").exists(), 900, launch)
    if published_first is None or start is None or published is None:
        return {"why_no_kill": f"the first two saves (steps {INTERVAL}, {second}) were not published: see the log"}
    window = max(published - start, 0.05)  # a save's duration (to its publication at a step boundary), seen from here
    step, rank = rng.choice(range(second + INTERVAL, steps, INTERVAL)), rng.randrange(ranks)
    if began(step) is None:
        return {"why_no_kill": f"the save of step {step} never began"}
    delay = rng.uniform(0.0, window)
    time.sleep(delay)
    table = proc_table()
    found = checkpoint_processes(table, launch.proc.pid)
    if rehearse:  # no checkpoint process on CPU: the rank's worker stands for it
        found = {r: [p for p, proc in table.items() if proc["ppid"] == launch.proc.pid and f"RANK={r}" in proc["environ"]]
                 for r in range(ranks)}  # fmt: skip
    if len(found.get(rank, [])) != 1:
        return {"why_no_kill": f"rank {rank}'s checkpoint process is not one process: {found}"}
    pid = found[rank][0]
    complete_before = complete_steps(ckpt)
    mid_save = (ckpt / f"step-{step}.tmp").exists() and not (ckpt / f"step-{step}").exists()
    os.kill(pid, signal.SIGKILL)
    return {"kill": {"rank": rank, "pid": pid, "step": step, "delay_s": round(delay, 4), "save_s": round(window, 4),
                     "mid_save": mid_save, "complete_before": complete_before, "time": time.monotonic()}}  # fmt: skip


def run_drill(args, ranks: int, work: Path, log) -> dict:
    rng = random.Random(args.seed)
    mode = "async" if args.rehearse_on_cpu else "async_with_pinned_mem"
    cmds = commands(sys.executable, ranks, args.steps, args.vocab, args.train_timeout, work, mode)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    record: dict = {"seed": args.seed, "ranks": ranks, "commands": {k: " ".join(v) for k, v in cmds.items()}}
    record["bound_s"] = args.train_timeout + BOUND_GRACE_S
    log.write("== reference\n")
    ref = Launch(cmds["reference"], env)
    record["reference_exitcode"] = ref.wait(timeout=1200)
    log.write(ref.text() + "\n== drill\n")
    tag = uuid.uuid4().hex
    drill = Launch(cmds["drill"], {**env, TAG: tag})
    ckpt = work / "drill" / "checkpoint"
    record.update(_kill_moment(drill, ckpt, rng, ranks, args.steps, args.rehearse_on_cpu))
    kill = record.get("kill")
    code = drill.wait(timeout=record["bound_s"] + 900)
    ended = time.monotonic()
    time.sleep(3)  # a worker's spawned child ends within 0.5 s of it (trainer/lifecycle/parent_death.py)
    record["orphans"] = tagged_processes(proc_table(), TAG, tag, exclude={os.getpid()})
    for orphan in record["orphans"]:  # cleanup: this drill's own processes only
        try:
            os.kill(orphan["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    log.write(drill.text() + "\n")
    if kill is None:
        record["failures"] = judge(record)
        return record
    since = kill.pop("time")
    lines = outcome_lines(drill.text(since))
    restarts = [t for t, line in drill.lines if t >= since and re.match(r"restart \d+/\d+: ", line)]
    record["lines"] = lines
    record["end"] = {"exitcode": code, "outcome_after_s": round((restarts[0] if restarts else ended) - since, 2)}
    rows = restart_rows(read_records(work / "drill"))
    resumed = rows[0]["resumed_from"] if rows else None
    if code != 0:  # no restart that finished: the same command again resumes from the newest complete checkpoint
        log.write("== resume\n")
        again = Launch(cmds["resume"], env)
        record["resume_exitcode"] = again.wait(timeout=1200)
        log.write(again.text() + "\n")
        found = re.findall(r"resumed from \S+ at step (\d+)", again.text())
        resumed = int(found[0]) if found else None
    record["resumed_from"] = resumed
    record["complete_steps"] = complete_steps(ckpt)
    reference, drilled = last_rows(read_records(work / "reference")), last_rows(read_records(work / "drill"))
    upto = resumed if resumed is not None else 0
    record["before_kill"] = compare_curves(reference, drilled, range(1, upto + 1))
    record["after_resume"] = compare_curves(reference, drilled, range(upto + 1, args.steps + 1))
    record["failures"] = judge(record)
    return record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.ckpt_kill_drill", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default="bench_results/ckpt_kill_drill.json", help="the record (JSON); <out>.log the output"
    )
    p.add_argument("--seed", type=int, default=None, help="the random kill's seed (default: from the clock, recorded)")
    p.add_argument("--ranks", type=int, default=0, help="ranks, one per GPU (default: 2, or 1 on a one-GPU machine)")
    p.add_argument("--steps", type=int, default=12, help="training steps (a save every 2)")
    p.add_argument("--vocab", type=int, default=131072, help="the vocabulary: the checkpoint's size")
    p.add_argument("--train-timeout", type=int, default=60, help="comm.train_timeout_seconds of the drill")
    p.add_argument("--work", default="", help="the runs' folder (default: a new temporary folder)")
    p.add_argument("--print-commands", action="store_true", help="print the three runs' commands and exit")
    p.add_argument(
        "--rehearse-on-cpu",
        action="store_true",
        help="the drill's machinery on CPU: checkpoint.async_mode = async (a thread: no checkpoint process) and the "
        "rank itself killed mid-save; proves this tool, not the checkpoint process's handling",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.seed is None:
        args.seed = int(time.time())
    if args.steps < 4 * INTERVAL:
        print(f"error: --steps must be at least {4 * INTERVAL} (two saves, a save to kill, a step after it)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.print_commands:
        work = Path(args.work or "WORK")
        for name, cmd in commands("python", args.ranks or 2, args.steps, args.vocab, args.train_timeout, work).items():
            print(f"{name}: {' '.join(cmd)}")
        return 0
    import torch

    if not torch.cuda.is_available() and not args.rehearse_on_cpu:
        print(
            "error: the checkpoint-process kill drill needs CUDA (checkpoint.async_mode = async_with_pinned_mem, "
            "whose checkpoint process it kills, runs on CUDA only) and this host has no GPU; run it on a GPU machine "
            '(docs/long_runs.md, "The checkpoint-process kill drill")',
            file=sys.stderr,
        )
        return 2
    gpus = torch.cuda.device_count() if not args.rehearse_on_cpu else 0
    ranks = args.ranks or (min(2, gpus) if gpus else 2)
    if gpus and ranks > gpus:
        print(f"error: --ranks {ranks} needs {ranks} GPUs (NCCL puts each rank on a GPU of its own); this machine "
              f"has {gpus}: use --ranks {gpus}", file=sys.stderr)  # fmt: skip
        return 2
    out, work = Path(args.out), Path(args.work or tempfile.mkdtemp(prefix="ckpt_kill_drill_"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "w") as log:
        record = run_drill(args, ranks, work, log)
    record.update(
        gpu=torch.cuda.get_device_name(0) if gpus else "cpu (rehearsal)",
        gpus=gpus,
        torch=torch.__version__,
        passed=not record["failures"],
    )
    out.write_text(json.dumps(record, indent=1) + "\n")
    kill = record.get("kill") or {}
    victim = " itself" if args.rehearse_on_cpu else "'s checkpoint process"
    what = (
        f"{ranks} rank(s) on {record['gpu']}; rank {kill.get('rank')}{victim} killed "
        f"{kill.get('delay_s')} s into step {kill.get('step')}'s save (mid-save: {kill.get('mid_save')}); "
        f"resumed from step {record.get('resumed_from')}; seed {args.seed}"
    )
    if record["passed"]:
        print(f"checkpoint-process kill drill: passed ({what}); {out}")
        return 0
    print(f"checkpoint-process kill drill: FAILED ({what}): {'; '.join(record['failures'])}; {out}")
    return 1


if __name__ == "__main__":
    sys.exit(main())

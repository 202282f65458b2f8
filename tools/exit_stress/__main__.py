"""Exit stress test: many short ``train.py`` runs under CPU load, every one must exit 0 with
complete outputs.

    python -m tools.exit_stress --runs 10                     # 10 runs of each default layout
    python -m tools.exit_stress --runs 5 --starve-comm        # the amplifier (see below)
    python -m tools.exit_stress --layouts deepseek_v3:dp_replicate=2,fsdp=2,ep=2 --runs 20

A finished training run that then dies at exit (a C++ thread touching a finalizing
interpreter: "terminate called without an active exception", SIGABRT; trainer/lifecycle/shutdown.py)
is rare and load dependent, so one run proves nothing: this tool repeats short runs of layouts
that touch every axis, with ``--busy`` processes spinning on the cores, and checks each run:

* the launch exits 0 (torchrun turns any rank's abort into a non-zero exit);
* ``metrics.jsonl`` holds every step 1..N, each line whole;
* the final checkpoint ``checkpoint/step-N`` is complete (DCP ``.metadata`` written), unless
  ``--checkpoint none``: then the run ends right after its last step's collectives, as the
  runs of ``tools.compare_loss`` do (the configuration that aborted in the field, and the
  most sensitive one: a final save adds collectives and file I/O after the last step).

``--starve-comm`` renices the runs' communication threads (gloo's ``pt_gloo_runloop`` /
``gloo_tcp_loop``, NCCL's watchdog) to nice 19 while the busy processes hold the cores: a
worker thread then lags seconds behind the main thread that it has just woken, which widens
the exit race from a rare event to most runs of the MoE layout (without the fix of
trainer/lifecycle/shutdown.py). Only this tool's own child processes are touched.

The summary (per layout: runs, failures, exit codes, the first line of each failure's
signature) is printed and written as JSON (``--json``). Exit status: 0 when every run passed,
1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from tools.compare_loss.layouts import UsageError, parse_layout, slug
from tools.compare_loss.runner import TRAIN_PY, run_streaming, torchrun_cmd
from trainer.runtime.cli_errors import report_user_error

# (model config, layout): the four layouts together use every axis (dp_replicate, dp_shard,
# cp, tp, pp, ep, etp); the first is the layout whose exit aborted in the field.
DEFAULT_LAYOUTS = [
    "deepseek_v3:dp_replicate=2,fsdp=2,ep=2",
    "llama3:pp=2,fsdp=2",
    "llama3:cp=2,tp=2",
    "deepseek_v3:fsdp=2,tp=2,ep=2,etp=2",
]
TINY = [
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--lr_scheduler.warmup_steps",
    "1",
]
COMM_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_nccl_watchdg", "pt_nccl_heartbt")
SIGNATURES = (
    "terminate called without an active exception",
    "terminate called after throwing",
    "Fatal Python error",
    "Segmentation fault",
    "exitcode: -",
)


@dataclass
class RunOutcome:
    layout: str
    index: int
    returncode: int
    wall_s: float
    metrics_ok: bool
    checkpoint_ok: bool
    signature: str = ""
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.metrics_ok and self.checkpoint_ok


@dataclass
class LayoutSummary:
    layout: str
    runs: int = 0
    failures: int = 0
    exit_codes: dict[str, int] = field(default_factory=dict)
    signatures: list[str] = field(default_factory=list)


class Busy:
    """``n`` processes spinning on the CPU until stopped (the competing load)."""

    def __init__(self, n: int):
        self.procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(n)
        ]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


class CommStarver:
    """Renices the communication threads of ``root``'s descendants to 19, polling every 0.1 s
    (threads appear as process groups are created) until stopped."""

    def __init__(self, root_pid: int):
        self.root, self.done = root_pid, threading.Event()
        self.reniced: set[int] = set()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.wait(0.1):
            for pid in _descendants(self.root):
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in map(int, tids):
                    if tid in self.reniced:
                        continue
                    try:
                        with open(f"/proc/{pid}/task/{tid}/comm") as f:
                            name = f.read().strip()
                        if name.startswith(COMM_THREADS):
                            os.setpriority(os.PRIO_PROCESS, tid, 19)
                            self.reniced.add(tid)
                    except OSError:
                        continue

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def _metrics_complete(folder: str, steps: int) -> bool:
    try:
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return False
    return [r.get("step") for r in records if "loss" in r] == list(range(1, steps + 1))


def _checkpoint_complete(folder: str, steps: int) -> bool:
    return os.path.isfile(os.path.join(folder, "checkpoint", f"step-{steps}", ".metadata"))


def _signature(log_path: str) -> str:
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for needle in SIGNATURES:
        for line in lines:
            if needle in line:
                return line.strip()[:200]
    errors = [l for l in lines if l.lstrip().startswith("error:")]
    return errors[0][:200] if errors else ""


def _seed(model: str, out: str, timeout: float) -> str:
    folder = os.path.join(out, f"seed-{model}")
    args = ["--config", f"{model}.toml", "--checkpoint.create_seed_checkpoint", "--job.dump_folder", folder, *TINY]
    log = os.path.join(folder, "seed.log")
    rc = run_streaming([sys.executable, TRAIN_PY, *args], log, lambda line: None, timeout)
    if rc != 0:
        raise SystemExit(f"seed checkpoint for {model} failed (exit {rc}); see {log}")
    return os.path.join(folder, "checkpoint", "step-0")


def run_one(
    spec: str, index: int, seed: str, out: str, steps: int, starve: bool, timeout: float, checkpoint: bool = True
) -> RunOutcome:
    model, layout_text = spec.split(":", 1)
    layout = parse_layout(layout_text)
    folder = os.path.join(out, f"{slug(spec)}-{index:03d}")
    args = [
        "--config",
        f"{model}.toml",
        *layout.train_args(),
        *TINY,
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_jsonl",
        "true",
        "--checkpoint.enable",
        "true" if checkpoint else "false",
        "--checkpoint.interval",
        str(steps),
        "--checkpoint.initial_load_path",
        seed,
        "--job.dump_folder",
        folder,
    ]
    cmd = torchrun_cmd(layout.nproc, TRAIN_PY, args)
    log_path = os.path.join(folder, "train.log")
    start = time.perf_counter()
    starvers: list[CommStarver] = []
    on_start = (lambda proc: starvers.append(CommStarver(proc.pid))) if starve else None
    try:
        rc = run_streaming(cmd, log_path, lambda line: None, timeout, on_start=on_start)
    finally:
        for starver in starvers:
            starver.stop()
    return RunOutcome(
        layout=spec,
        index=index,
        returncode=rc,
        wall_s=round(time.perf_counter() - start, 1),
        metrics_ok=_metrics_complete(folder, steps),
        checkpoint_ok=_checkpoint_complete(folder, steps) if checkpoint else True,
        signature="" if rc == 0 else _signature(log_path),
        log=log_path,
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.exit_stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, metavar="MODEL:LAYOUT")
    p.add_argument("--runs", type=int, default=5, help="runs per layout (default 5)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes (default: one per core)")
    p.add_argument(
        "--checkpoint", choices=("last", "none"), default="last", help="save at the last step (default) or never"
    )
    p.add_argument("--starve-comm", action="store_true", help="renice the runs' comm threads to 19 (amplifier)")
    p.add_argument("--out", default="outputs/exit_stress", help="run folders and the summary")
    p.add_argument("--json", default=None, help="summary JSON (default OUT/summary.json)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    return p.parse_args(argv)


def _check(ns: argparse.Namespace) -> None:
    if ns.runs < 1 or ns.steps < 1 or ns.busy < 0:
        raise UsageError("--runs and --steps must be >= 1 and --busy >= 0")
    for spec in ns.layouts:
        model, sep, text = spec.partition(":")
        if not sep or model not in ("llama3", "deepseek_v3"):
            raise UsageError(f"--layouts {spec!r}: write MODEL:LAYOUT with MODEL llama3 or deepseek_v3")
        parse_layout(text)  # raises UsageError naming the problem


def main(argv: list[str] | None = None) -> int:
    ns = _parse(argv)
    try:
        _check(ns)
    except ValueError as exc:
        return report_user_error(exc)
    os.makedirs(ns.out, exist_ok=True)
    seeds = {m: _seed(m, ns.out, ns.timeout) for m in dict.fromkeys(s.split(":", 1)[0] for s in ns.layouts)}
    summaries = {spec: LayoutSummary(spec) for spec in ns.layouts}
    outcomes: list[RunOutcome] = []
    busy = Busy(ns.busy)
    try:
        for i in range(1, ns.runs + 1):  # interleaved: every layout sees the same drift in load
            for spec in ns.layouts:
                seed = seeds[spec.split(":", 1)[0]]
                o = run_one(spec, i, seed, ns.out, ns.steps, ns.starve_comm, ns.timeout, ns.checkpoint == "last")
                outcomes.append(o)
                s = summaries[spec]
                s.runs += 1
                s.exit_codes[str(o.returncode)] = s.exit_codes.get(str(o.returncode), 0) + 1
                if not o.ok:
                    s.failures += 1
                    what = o.signature or f"metrics complete={o.metrics_ok} checkpoint complete={o.checkpoint_ok}"
                    s.signatures.append(f"run {i}: exit {o.returncode}: {what}")
                status = "ok" if o.ok else f"FAILED exit {o.returncode} {o.signature}"
                print(f"[{i}/{ns.runs}] {spec:<42} {o.wall_s:6.1f}s  {status}", flush=True)
    finally:
        busy.stop()
    total = sum(s.runs for s in summaries.values())
    failed = sum(s.failures for s in summaries.values())
    print(f"\n{total} runs, {failed} failed (busy={ns.busy}, starve_comm={ns.starve_comm}, checkpoint={ns.checkpoint})")
    for s in summaries.values():
        print(f"  {s.layout:<42} {s.runs - s.failures}/{s.runs} ok  exit codes {s.exit_codes}")
        for line in s.signatures:
            print(f"      {line}")
    path = ns.json or os.path.join(ns.out, "summary.json")
    with open(path, "w") as f:
        json.dump(
            {
                "busy": ns.busy,
                "starve_comm": ns.starve_comm,
                "checkpoint": ns.checkpoint,
                "steps": ns.steps,
                "runs": total,
                "failures": failed,
                "layouts": [asdict(s) for s in summaries.values()],
                "outcomes": [asdict(o) | {"ok": o.ok} for o in outcomes],
            },
            f,
            indent=1,
        )
    print(f"summary: {path}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

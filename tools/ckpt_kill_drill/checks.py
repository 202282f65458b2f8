"""What the checkpoint-process kill drill reads and judges, without a GPU (tools/ckpt_kill_drill,
docs/long_runs.md "The checkpoint-process kill drill"): the processes of the job from /proc, the
launcher's lines, metrics.jsonl's curve and restart rows, the complete checkpoints, and the
verdict on one drill's record. Every function here is plain data in, data out (the tests in
tests/unit/test_ckpt_kill_drill.py run them on CPU); the runner (``__main__.py``) gathers the
facts on the GPU machine.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

__all__ = [
    "BOUND_GRACE_S",
    "checkpoint_processes",
    "compare_curves",
    "complete_steps",
    "judge",
    "last_rows",
    "outcome_lines",
    "proc_table",
    "restart_rows",
    "tagged_processes",
]

# past comm.train_timeout_seconds: the watchdog's flight-recorder dump (at most 10 s), the
# agent's SIGTERM grace to the other workers (30 s) and the restart's rendezvous
BOUND_GRACE_S = 60.0
_SPAWN_MARK = "--multiprocessing-fork"  # multiprocessing's spawn: how torch starts its checkpoint process


def proc_table() -> dict[int, dict]:
    """Every process this user may read: ``{pid: {"ppid", "cmdline", "environ"}}`` (Linux /proc;
    a process that ends while it is read is left out)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
        except (OSError, IndexError, ValueError):
            continue
        table[int(entry)] = {"ppid": ppid, "cmdline": cmdline, "environ": environ}
    return table


def _env_value(proc: dict, name: str) -> str | None:
    prefix = name + "="
    return next((item[len(prefix) :] for item in proc["environ"] if item.startswith(prefix)), None)


def checkpoint_processes(table: dict[int, dict], launcher: int) -> dict[int, list[int]]:
    """``{rank: [pid, ...]}``: the processes each worker of ``launcher`` started with
    multiprocessing's spawn (``--multiprocessing-fork`` on the command line: torch's checkpoint
    process under ``async_with_pinned_mem``; its resource tracker has no such flag). A worker is
    a child of the launcher with ``RANK`` in its environment."""
    workers = {
        pid: int(rank)
        for pid, proc in table.items()
        if proc["ppid"] == launcher and (rank := _env_value(proc, "RANK")) is not None and rank.isdigit()
    }
    found: dict[int, list[int]] = {rank: [] for rank in sorted(workers.values())}
    for pid, proc in sorted(table.items()):
        if proc["ppid"] in workers and _SPAWN_MARK in proc["cmdline"]:
            found[workers[proc["ppid"]]].append(pid)
    return found


def tagged_processes(table: dict[int, dict], tag: str, value: str, exclude: set[int] = frozenset()) -> list[dict]:
    """The processes whose environment has ``tag=value`` (every process of one drill's job carries
    it: the launcher's environment reaches its workers and their spawned children), but those in
    ``exclude``: after the job ended, its orphans."""
    return [
        {"pid": pid, "ppid": proc["ppid"], "cmdline": " ".join(proc["cmdline"])[:300]}
        for pid, proc in sorted(table.items())
        if pid not in exclude and _env_value(proc, tag) == value
    ]


def complete_steps(checkpoint_folder: str | Path) -> list[int]:
    """The steps of the complete checkpoints: a folder under its final name ``step-N`` (a save cut
    short stays ``step-N.tmp``) holding DCP's ``.metadata``; ascending."""
    folder = Path(checkpoint_folder)
    if not folder.is_dir():
        return []
    steps = []
    for child in folder.iterdir():
        m = re.fullmatch(r"step-(\d+)", child.name)
        if m and child.is_dir() and (child / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_records(folder: str | Path) -> list[dict]:
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_rows(records: list[dict]) -> dict[int, dict]:
    """step -> the last training row written for it (a restarted run trains the steps after its
    checkpoint again: the last row of a step is the one that counts)."""
    return {r["step"]: r for r in records if "loss" in r}


def restart_rows(records: list[dict]) -> list[dict]:
    """The ``restart`` rows the restarted workers write before their first step."""
    return [r for r in records if "restart" in r]


def compare_curves(reference: dict[int, dict], run: dict[int, dict], steps) -> list[str]:
    """Each step of ``steps`` whose loss or gradient norm is not bitwise the reference's (one
    line each; a step missing on either side too)."""
    out = []
    for step in steps:
        want, got = reference.get(step), run.get(step)
        if want is None or got is None:
            out.append(f"step {step}: {'no reference row' if want is None else 'no row in the drill'}")
            continue
        for key in ("loss", "grad_norm"):
            if want.get(key) != got.get(key):
                out.append(f"step {step}: {key} {got.get(key)!r} != reference {want.get(key)!r}")
    return out


def outcome_lines(output: str) -> dict:
    """The launcher's lines that say how a job went: ``restart K/N: ...``, ``gave up after ...``,
    ``error: ...`` (the workers' and the launcher's), and whether a traceback was printed."""
    lines = output.splitlines()
    return {
        "restarts": [line for line in lines if re.match(r"restart \d+/\d+: ", line)],
        "gave_up": [line for line in lines if line.startswith("gave up after ")],
        "errors": [line for line in lines if line.startswith("error:")],
        "traceback": any(line.startswith("Traceback (most recent call last)") for line in lines),
    }


def judge(record: dict) -> list[str]:
    """What failed in one drill (empty: it passed). ``record`` is the runner's (``__main__.py``):

    * ``kill``: ``{"rank", "pid", "step", "mid_save", "complete_before": [steps]}``, or None when
      no checkpoint process was found to kill;
    * ``end``: ``{"exitcode", "outcome_after_s"}``: the job's exit code (None: it did not end and
      was killed), the seconds from the kill to the first restart line or, without one, to the
      job's end; ``bound_s``: comm.train_timeout_seconds + :data:`BOUND_GRACE_S`;
    * ``lines``: :func:`outcome_lines` of the drill's output after the kill;
    * ``orphans``: :func:`tagged_processes` once the job ended;
    * ``resumed_from``: the step the resumed run started from (the restart row's, or the resume
      run's), None if nothing resumed; ``complete_steps``: :func:`complete_steps` at the end;
    * ``before_kill``: :func:`compare_curves` of the steps before the kill (a control: the
      reference and the drill must agree there, else bitwise means nothing on this GPU);
      ``after_resume``: of the steps after ``resumed_from``.
    """
    fails = []
    kill = record.get("kill")
    if not kill:
        return ["no checkpoint process was killed: " + record.get("why_no_kill", "none was found")]
    end, lines = record["end"], record["lines"]
    if end.get("exitcode") is None:
        fails.append(f"the job did not end within its deadline after the kill (a hang): {end}")
    after = end.get("outcome_after_s")
    if after is None or after > record["bound_s"]:
        fails.append(
            f"no restart line nor end within {record['bound_s']:.0f} s of the kill (comm.train_timeout_seconds + "
            f"{BOUND_GRACE_S:.0f} s): {after}"
        )
    if lines["restarts"]:
        if len(lines["restarts"]) != 1:
            fails.append(f"{len(lines['restarts'])} restart lines after one kill: {lines['restarts']}")
        if end.get("exitcode") not in (0, None):
            fails.append(f"the restarted job ended with exit code {end['exitcode']}: {lines['errors']}")
    elif len(lines["errors"]) + len(lines["gave_up"]) != 1:
        fails.append(f"without a restart the job must end in one line; got {lines['errors'] + lines['gave_up']}")
    if lines["traceback"]:
        fails.append("a traceback was printed after the kill")
    if record["orphans"]:
        fails.append(f"{len(record['orphans'])} process(es) of the job outlived it: {record['orphans']}")
    resumed = record.get("resumed_from")
    newest_before = max(kill.get("complete_before") or [0])
    if resumed is None:
        fails.append("nothing resumed after the kill (no restart row and no resume run)")
    elif resumed < newest_before:
        fails.append(f"resumed from step {resumed}, older than the newest complete checkpoint step-{newest_before}")
    elif resumed and resumed not in record.get("complete_steps", []):
        fails.append(f"resumed from step {resumed}, which is not a complete checkpoint {record.get('complete_steps')}")
    if record.get("before_kill"):
        fails.append(
            "the drill and the reference differ before the kill (the runs are not deterministic on this GPU, "
            f"so the resume cannot be judged bitwise): {record['before_kill'][:3]}"
        )
    if record.get("after_resume"):
        fails.append(f"the resumed curve is not bitwise the reference's: {record['after_resume'][:3]}")
    return fails

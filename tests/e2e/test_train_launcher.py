"""``python train.py --nproc_per_node N ...`` (trainer/lifecycle/launch.py) against plain torchrun: every
user error is one ``error:`` line, printed once; under the launcher also no traceback and exit
code 2, under torchrun before torchrun's own report. A Ctrl-C to the launcher stops the workers
at a step with their one line and exit code 130, no traceback; two launchers meet over c10d as
two nodes do (scripts/slurm_train.sh).

The kinds of error: an unknown key, a bad degree, a missing data file, an unknown dataset kind
(found by the launcher before any worker starts), and a bad checkpoint (a truncated
``.metadata``: found by the workers' resume). Under the launcher each at 2 and 4 processes;
under torchrun each at 4 processes (the most copies of a line to print once) and two of them
at 2 as well (the world size in the message). The launches as the user types them carry
``--max_restarts 2``: a user error is not restarted (one line, no restart line, exit 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from .helpers import FAST, ROOT, _descendants, _env, drill_env, run_train

LLAMA = ["--config", "llama3.toml", *FAST, "--model.n_layers", "2", "--training.steps", "8"]

KINDS = {
    "unknown_key": (["--training.stesp", "5"], "unknown key 'training.stesp'; did you mean 'training.steps'?"),
    "bad_degree": (["--parallelism.tp", "3"], "tp=3 does not divide world_size="),
    "missing_file": (["--training.dataset", "text", "--training.dataset_path", "{run}/missing"], "does not exist"),
    "dataset_kind": (["--training.dataset", "parquet"], "training.dataset must be one of"),
    "bad_checkpoint": (["--checkpoint.enable", "true"], "unreadable (truncated or corrupt .metadata"),
}


def _case(tmp_path, kind: str) -> list[str]:
    """The kind's arguments; for a bad checkpoint, a run folder whose only checkpoint has a
    truncated .metadata."""
    run = tmp_path / "run"
    if kind == "bad_checkpoint":
        (run / "checkpoint" / "step-2").mkdir(parents=True)
        (run / "checkpoint" / "step-2" / ".metadata").write_bytes(b"\x80\x04truncated")
    args, _ = KINDS[kind]
    return [*LLAMA, "--job.dump_folder", str(run), *(a.replace("{run}", str(run)) for a in args)]


def launch(nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python train.py --nproc_per_node N args``, as a user types it."""
    cmd = [sys.executable, "train.py", "--nproc_per_node", str(nproc), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env())


def _kill_job(proc: subprocess.Popen) -> None:
    """Cleanup after a failed test: the launcher and its workers (each in a session of its own)."""
    if proc.poll() is None:
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# Each kind at 2 and 4 processes. Those the launcher finds before any worker starts run its
# code in this process (trainer.lifecycle.launch.main, what `python train.py` calls for launcher flags: no interpreter
# to start); one of them, and the kind the workers find, as the user types it.
SUBPROCESS = {("unknown_key", 4), ("bad_checkpoint", 2), ("bad_checkpoint", 4)}


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_user_error_is_one_line_under_the_launcher(tmp_path, kind, nproc, capsys):
    if (kind, nproc) in SUBPROCESS:
        # with restarts allowed: bad input is never restarted (trainer/lifecycle/restarts.py)
        res = launch(nproc, "--max_restarts", "2", *_case(tmp_path, kind))
        code, out = res.returncode, res.stdout + res.stderr
    else:
        from trainer.lifecycle.launch import main

        code = main(["--nproc_per_node", str(nproc), *_case(tmp_path, kind)])
        captured = capsys.readouterr()
        out = captured.out + captured.err
    assert code == 2, (code, out[-3000:])
    errors = _error_lines(out)
    assert len(errors) == 1 and KINDS[kind][1] in errors[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not [line for line in out.splitlines() if line.startswith("restart ")], out[-3000:]
    if kind != "bad_checkpoint":  # found before any worker started: nothing else was printed
        assert out.strip() == errors[0], out[-3000:]


@pytest.mark.parametrize(
    "kind, nproc",
    [(kind, 4) for kind in KINDS] + [("bad_degree", 2), ("bad_checkpoint", 2)],
)
def test_every_user_error_is_one_line_first_under_torchrun(tmp_path, kind, nproc):
    """torchrun's own report follows (ChildFailedError and its traceback: torchrun's, which a
    worker cannot shorten; docs/training.md); our line is printed once, by rank 0, before it."""
    res = run_train(nproc, *_case(tmp_path, kind))
    assert res.returncode != 0
    errors = _error_lines(res.stderr)
    assert len(errors) == 1 and KINDS[kind][1] in errors[0], res.stderr[-3000:]
    report = [i for i in (res.stderr.find("Traceback"), res.stderr.find("ChildFailedError")) if i >= 0]
    assert report and res.stderr.index(errors[0]) < min(report), res.stderr[-3000:]


def _signalled_launch(run, until, then=None, env=None) -> tuple[int, str]:
    """``python train.py --nproc_per_node 2`` on LLAMA with checkpoints (none due before the
    last step) in the background; ``until(line, pid)`` sees each output line (and may signal the
    launcher) until it returns True, then ``then(pid)`` runs; the exit code and all output.
    ``env`` holds the drill (trainer/checkpoint/drill.py): with its ``last`` gate the workers
    wait before their last step until the signal has reached them, so a Ctrl-C this process
    sends late (a loaded machine) still stops them at a step, never after the run."""
    cmd = [sys.executable, "train.py", "--nproc_per_node", "2", *LLAMA, "--job.dump_folder", str(run),
           "--checkpoint.enable", "true", "--checkpoint.interval", "100"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or _env(),
        start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if until(line, proc.pid):
                break
        if then is not None:
            then(proc.pid)
        rest, _ = proc.communicate(timeout=120)
    finally:
        _kill_job(proc)
    return proc.returncode, "".join(lines) + rest


def _ctrl_c_at_step_2(line: str, pid: int) -> bool:
    if line.startswith("step 2/8"):
        os.kill(pid, signal.SIGINT)
        return True
    return False


def test_ctrl_c_to_the_launcher_stops_the_workers_at_a_step(tmp_path):
    """SIGINT to the launcher (a terminal's Ctrl-C): the agent sends it on, the workers stop
    after a step with a checkpoint there and their one line, the launcher exits 130 with
    nothing of its own (no torchrun traceback)."""
    run = tmp_path / "run"
    code, out = _signalled_launch(run, _ctrl_c_at_step_2, env=drill_env("last"))
    assert code == 130, (code, out[-3000:])
    stops = [line for line in out.splitlines() if line.startswith("stopped at step")]
    assert len(stops) == 1 and "by SIGINT; checkpoint step-" in stops[0], out[-3000:]
    stopped = int(stops[0].split()[3])
    assert 2 <= stopped < 8 and f"step-{stopped}" in os.listdir(run / "checkpoint"), out[-3000:]
    assert "Traceback" not in out and "error:" not in out, out[-3000:]


def test_a_second_ctrl_c_to_the_launcher_stops_the_workers_at_once(tmp_path):
    """Ctrl-C, then (3 s on, trainer/runtime/stop.py's window) Ctrl-C again while the workers are held
    in the middle of writing the stop's checkpoint (the drill's ``write`` point): the agent's
    wait is cut short and it shuts down again with SIGTERM, the workers stop at once (one line
    each), the launcher exits 130 with nothing of its own, no traceback; the save cut short is
    never published."""
    from trainer.checkpoint.dcp import CheckpointFolder
    from trainer.runtime.stop import REPEAT_WINDOW_S

    def held_mid_write(line: str, pid: int) -> bool:
        _ctrl_c_at_step_2(line, pid)
        return line.startswith("checkpoint drill: write")

    def again(pid: int) -> None:
        time.sleep(REPEAT_WINDOW_S)
        os.kill(pid, signal.SIGINT)

    run = tmp_path / "run"
    # every save holds once its files are written; the workers cannot reach their last step (and
    # its save) before the first Ctrl-C stops them, so the save held is the stop's
    env = drill_env("write,last")
    code, out = _signalled_launch(run, held_mid_write, again, env)
    assert code == 130, (code, out[-3000:])
    assert out.count("stopped at once by a second signal (SIGTERM)") == 2, out[-3000:]  # each worker, one line
    assert "Traceback" not in out and "error:" not in out, out[-3000:]
    assert CheckpointFolder(str(run / "checkpoint")).list_steps() == []  # the stop's save was cut short


def test_two_launchers_meet_as_two_nodes(tmp_path):
    """Two launchers with --nnodes 2 and a c10d rendezvous (what scripts/slurm_train.sh runs,
    one per node) train one 2-rank job: one metrics file, both ranks in the world."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    flags = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
             "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes"]  # fmt: skip
    cmd = [sys.executable, "train.py", *flags, *LLAMA, "--training.steps", "2", "--job.dump_folder", str(run)]
    nodes = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        for _ in range(2)
    ]
    outs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outs):
        assert node.returncode == 0, out[-2000:] + err[-3000:]
    printed = "".join(out for out, _ in outs)
    assert "mesh: world=2 " in printed and "step 2/2" in printed, printed[-3000:]

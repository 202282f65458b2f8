"""Losing a node (``--nnodes MIN:MAX``, trainer/lifecycle/elastic.py, docs/long_runs.md): two
launchers of 2 processes each stand for two nodes over a c10d rendezvous; one of them and every
process under it is SIGKILLed after a checkpoint, and the other finishes the run on 2 processes.
Run twice, with our launcher (``python train.py --nnodes 1:2 ...``) and with plain ``torchrun``
and the same flags (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` set, as its workers require,
trainer/lifecycle/torchrun_range.py); both compare with one uninterrupted run (a module fixture).
Without the variable, plain torchrun's workers refuse to start in one line at every start
torchrun makes, and the job ends (the last test).

The drill (one launch of each, so one test per launcher): llama3 debug, 2 layers, 6 steps, checkpoints every
2 steps, global batch 8 (1 micro-batch of 2 per rank on 4 ranks, 2 on 2 ranks). Rank 0 stops
in a sleep as step 4 starts in the first start only (``hang@4:rank=0:restart=0``), so the kill
lands at a known point: steps 1-3 logged, step-2 the newest checkpoint, the other ranks inside
step 4's collectives; the node lost is rank 0's (launcher and workers SIGKILLed). The test process hosts the rendezvous store (``is_host=false`` on both
launchers: the rendezvous endpoint stands for a head node that outlives the lost one; with
torch's c10d backend the node hosting it must survive, docs/long_runs.md). Then:

* the survivor's workers end (a collective on a gone peer, or the step watchdog within
  ``comm.train_timeout_seconds``), its agent restarts them with a world of 2: one restart
  line naming step-2, one line saying the job goes on with 1 node (2 ranks), exit 0 (torchrun
  prints neither line: the restart row in metrics.jsonl says it, as under our launcher);
* the loss curve (the last row of each step) equals the uninterrupted 4-process run's within
  the tolerance of tests/e2e/test_train.py ``test_resume_under_a_different_layout`` (rel 1e-5
  on the loss, 1e-4 on the grad norm: the same math in other reduction orders; here the 2-rank
  world sums 2 micro-batches per rank where the 4-rank world summed 1 per rank); steps 1-2
  bitwise (the same layout, before the loss);
* every global sample contributes to the final weights exactly once: the ``samples`` ranges
  of the committed steps (the last row of each step: the rows of step 3 before the loss were
  trained on weights the resume discarded) tile ``[0, 6 x 8)`` in order, and the step redone
  read the same samples both times.

Negative control: the survivor's steps against the uninterrupted run's next step (the data
order off by one step) are outside the tolerance."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from .helpers import FAST, ROOT, _descendants, _env, _rank_of, all_records, read_metrics, run_forked
from .test_train_launcher import _kill_job

pytestmark = pytest.mark.e2e

G, STEPS = 8, 6
JOB = ["--config", "llama3.toml", "--model.n_layers", "2", *FAST, "--training.steps", str(STEPS),
       "--checkpoint.enable", "true", "--checkpoint.interval", "2"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, timeout: float, what: str, procs) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"waiting for {what}: " + " | ".join(str(p.poll()) for p in procs))
        time.sleep(0.2)


def _steps_logged(run) -> set[int]:
    try:
        return {r["step"] for r in all_records(run) if "loss" in r}
    except (OSError, ValueError):
        return set()


class _Reference:
    """The uninterrupted 4-process run both drills compare with: run once, on forked ranks, in
    a thread started by the first drill after its kill (while the survivor regroups)."""

    def __init__(self, folder):
        self.folder, self.result, self._thread = folder, None, None

    def start(self) -> None:
        if self._thread is None:
            run = lambda: setattr(self, "result", run_forked(4, *JOB, "--job.dump_folder", str(self.folder)))  # noqa: E731
            self._thread = threading.Thread(target=run, daemon=True)
            self._thread.start()

    def metrics(self) -> dict:
        self.start()
        self._thread.join(timeout=240)
        assert self.result is not None and self.result.returncode == 0, self.result and self.result.stderr[-3000:]
        return read_metrics(self.folder)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _Reference(tmp_path_factory.mktemp("elastic_reference"))


def _launch(launcher: str, port: int, run) -> tuple[list[str], dict]:
    """The command of one node (our launcher or plain torchrun, the same flags) and its environment."""
    flags = ["--nnodes", "1:2", "--nproc_per_node", "2", "--max_restarts", "2", "--rdzv_backend", "c10d",
             "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "lost-node",
             "--rdzv_conf", "is_host=false,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"]  # fmt: skip
    job = [*JOB, "--job.dump_folder", str(run), "--debug.fault", "hang@4:rank=0:restart=0",
           "--comm.train_timeout_seconds", "8"]  # fmt: skip
    env = _env()
    if launcher == "launcher":
        return [sys.executable, "train.py", *flags, *job], env
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # the workers refuse the shared store (docs/long_runs.md)
    return [str(Path(sys.executable).with_name("torchrun")), *flags, "train.py", *job], env


@pytest.mark.parametrize("launcher", ["launcher", "torchrun"])
def test_a_lost_node_is_survived_on_the_nodes_left(tmp_path, reference, launcher):
    import torch.distributed as dist

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=60))
    run = tmp_path / "drill"
    cmd, env = _launch(launcher, port, run)
    nodes = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    try:
        _wait_for(lambda: 3 in _steps_logged(run), 240, "step 3 on 4 ranks", nodes)
        assert (run / "checkpoint" / "step-2").is_dir()
        # the node of the hung rank 0 is lost (its agent would wait for the hung rank to take
        # SIGTERM); the other one's ranks fail on their gone peers
        lost = next(n for n in nodes if 0 in {_rank_of(pid) for pid in _descendants(n.pid)})
        survivor = next(n for n in nodes if n is not lost)
        os.killpg(lost.pid, signal.SIGKILL)  # the launcher and every process under it: a lost node
        lost.wait()
        reference.start()  # the uninterrupted 4-process run, while the survivor waits for its peers and regroups
        out, _ = survivor.communicate(timeout=240)
    finally:
        for node in nodes:
            _kill_job(node)
        del store
    assert survivor.returncode == 0, out[-5000:]
    assert "mesh: world=2 " in out, out[-5000:]  # rank 0's line: before the loss it was on the lost node
    assert "Traceback" not in out, out[-5000:]
    restarts = [line for line in out.splitlines() if line.startswith(("restart ", "elastic:", "a node"))]
    if launcher == "launcher":
        assert len(restarts) == 2, out[-5000:]
        assert restarts[0].startswith("restart 1/2: rank ") and restarts[0].endswith(
            "at step 4; resuming from step-2"
        ), out
        assert restarts[1] == (
            "elastic: the job goes on with 1 node (2 ranks), was 2 (4 ranks); the layout is planned for it "
            "(docs/long_runs.md)"
        )
    else:  # torchrun's agent says nothing of its own (only its log records): the workers' rows tell
        assert restarts == [], out[-5000:]

    rows = all_records(run)
    events = [r for r in rows if "restart" in r]
    assert [(e["restart"], e["resumed_from"], e["redone_steps"]) for e in events] == [(1, 2, 1)], events
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 3, 4, 5, 6]
    # every global sample exactly once among the steps that count; the redone step read the same ones
    committed = read_metrics(run)  # the last row of each step
    assert [committed[s]["samples"] for s in range(1, STEPS + 1)] == [f"{(s - 1) * G}:{s * G}" for s in range(1, 7)]
    assert [r["samples"] for r in trained if r["step"] == 3] == ["16:24", "16:24"]

    want = reference.metrics()
    for step in (1, 2):  # before the loss: the same layout, bitwise
        assert (committed[step]["loss"], committed[step]["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"])
    for step in range(3, STEPS + 1):  # on 2 ranks after the loss: test_train.py's cross-layout tolerance
        assert committed[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        assert committed[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), step
    # negative control: the same curve one step off (another data order) is far outside the tolerance
    for step in range(3, STEPS):
        assert committed[step]["loss"] != pytest.approx(want[step + 1]["loss"], rel=1e-5), step


def test_plain_torchrun_with_the_shared_store_is_refused_at_every_start(tmp_path):
    """torchrun's default (the agents share the rendezvous store with the workers) would end the
    whole job when a node joins (trainer/lifecycle/torchrun_range.py): the workers refuse it in
    one line naming the fix, exit code 2, before any step; torchrun restarts every failed start
    (``--max_restarts 1``: two starts, the same line each) and then ends, non-zero. The drills
    above, with the variable set, are the control: the same workers start."""
    run = tmp_path / "refused"
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1:2", "--nproc_per_node", "1",
           "--max_restarts", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{_free_port()}",
           "--rdzv_id", "shared-store", "--rdzv_conf", "last_call_timeout=1",
           "train.py", *JOB, "--job.dump_folder", str(run)]  # fmt: skip
    env = _env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert (
        errors
        == [
            "error: torchrun --nnodes 1:2 shares its rendezvous store with the workers, and on torch 2.13.0 a node that "
            "joins the running job (one that comes back) then ends the whole job (every agent times out after 60 s "
            "waiting for the round's MASTER_ADDR); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's environment "
            "before torchrun, or launch with python train.py and the same flags (it sets it)"
        ]
        * 2
    ), proc.stderr[-3000:]
    assert "exitcode: 2" in proc.stderr, proc.stderr[-3000:]  # torchrun's record of each start's failure
    assert not (run / "metrics.jsonl").exists()  # no step

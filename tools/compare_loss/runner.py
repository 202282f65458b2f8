"""Running the layouts: the seed checkpoint every run starts from, one launch per layout
(sequentially: CPU runs share the cores), each run's output streamed to its log with a progress
line, and a --timeout that stops the launch and its ranks.

A layout's ranks start through torchrun (``--launcher torchrun``, the default) or are forked from
a server that already imported torch and the trainer (``--launcher fork``,
:class:`tools.forkserver.ForkedTrain`: one host, bitwise the torchrun results, about 1.5 CPU
seconds less per rank and no torchrun process)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from tools.compare_loss.compare import RunResult, load_metrics, load_validation
from tools.compare_loss.layouts import LAUNCHERS, Layout, Plan
from trainer.config import REPO_ROOT

TRAIN_PY = os.path.join(REPO_ROOT, "train.py")
TIMEOUT_RC = 124  # what a run stopped by --timeout returns, as coreutils' timeout does

STEP_LINE = re.compile(r"\bstep\s+(\d+)(?:/\d+)?\s+loss\s+(\S+)")


def torchrun_cmd(nproc: int, script: str, args: list[str], module: bool = False) -> list[str]:
    """``script`` is a file, or with ``module`` a module that each worker runs like ``python -m``."""
    # `python -m torch.distributed.run` is torchrun without depending on PATH.
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *(["-m"] if module else []),
        script,
        *args,
    ]


def run_streaming(
    cmd: list[str],
    log_path: str,
    on_line: Callable[[str], None],
    timeout: float | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
) -> int:
    """Run ``cmd``, copy its merged stdout/stderr to ``log_path`` and hand each line to ``on_line``
    (``on_start`` gets the process first).

    The child gets its own session so a timeout or Ctrl-C stops torchrun *and* its workers
    (signalling the group of the process we started, nothing else)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
        )
        if on_start is not None:
            on_start(proc)
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            _kill_group(proc)

        timer = threading.Timer(timeout, kill) if timeout else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                on_line(line)
            rc = proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if timer:
                timer.cancel()
        if timed_out.is_set():
            log.write(f"\ncompare_loss: killed after the {timeout:.0f}s --timeout\n")
            return TIMEOUT_RC
        return rc


def run_forked_streaming(
    nproc: int,
    argv: list[str],
    log_path: str,
    on_line: Callable[[str], None],
    timeout: float | None = None,
    script: str = TRAIN_PY,
) -> int:
    """:func:`run_streaming` for ``torchrun --nproc_per_node=nproc script argv`` (or ``python
    script argv``), the ranks forked instead (:class:`tools.forkserver.ForkedTrain`): their stdout
    and stderr merged into one pipe, copied to ``log_path`` line by line and handed to
    ``on_line``. Returns 0 when every rank exited 0, else the first failing rank's own exit code
    (torchrun says 1 for any failure) after the other ranks were stopped; 124 after ``timeout``
    seconds, the ranks stopped. The parent waits on the ranks while a thread reads the pipe, so
    a rank that fails while the others block in a collective still ends the job."""
    from tools.forkserver import ForkedTrain

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        log.write(f"$ [fork launcher, {nproc} rank{'s' if nproc > 1 else ''}] " + " ".join([script, *argv]) + "\n")
        log.flush()
        read_fd, write_fd = os.pipe()
        try:
            job = ForkedTrain(nproc, argv, stdout_fd=write_fd, stderr_fd=write_fd, env=env, script=script)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the ranks hold their own copies: EOF once every rank has exited

        def copy() -> None:
            with open(read_fd, errors="replace", closefd=True) as stream:
                for line in stream:
                    log.write(line)
                    on_line(line)

        reader = threading.Thread(target=copy, name="compare_loss-log", daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = job.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            job.stop()
            rc = job.wait()
        except BaseException:  # Ctrl-C: stop the ranks before leaving
            job.stop(grace=2.0)
            raise
        finally:
            reader.join(timeout=30)  # EOF follows the ranks' exit
        if timed_out:
            log.write(f"\ncompare_loss: killed after the {timeout:.0f}s --timeout\n")
            return TIMEOUT_RC
        return rc


def fork_server_running() -> bool:
    """Whether this process already has the fork launcher's server (a caller that ran the tool
    in its own process after launching forked ranks itself: a test worker)."""
    if "tools.forkserver" not in sys.modules:
        return False
    from tools.forkserver import server_running

    return server_running()


def stop_fork_server() -> None:
    """End the fork launcher's server, if this process started one, and wait for it: no process
    outlives the tool, and the ranks' CPU time (the server reaps them) is counted among this
    process's children, as torchrun's workers are."""
    if "tools.forkserver" in sys.modules:
        from tools.forkserver import stop_server

        stop_server()


def launch(
    launcher: str,
    nproc: int,
    script: str,
    args: list[str],
    log_path: str,
    on_line: Callable[[str], None],
    timeout: float | None = None,
    module: bool = False,
) -> int:
    """``script args`` on ``nproc`` ranks of this host through ``launcher`` (:data:`LAUNCHERS`),
    streamed as :func:`run_streaming` does; the exit code, 124 after a timeout. With ``module``,
    ``script`` is a module name that each rank runs as ``python -m`` would (forked ranks run its
    file as ``__main__``)."""
    if launcher == "fork":
        if module:
            import importlib.util

            script = importlib.util.find_spec(script).origin
        return run_forked_streaming(nproc, args, log_path, on_line, timeout, script=script)
    if launcher != "torchrun":
        raise ValueError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    return run_streaming(torchrun_cmd(nproc, script, args, module=module), log_path, on_line, timeout)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Progress:
    """One compact line per run: layout, step, loss, elapsed. Rewritten in place on a terminal;
    on a log (CI) only a few steps per run are printed."""

    def __init__(self, label: str, steps: int, stream=None):
        self.label, self.steps = label, steps
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self.every = max(1, steps // 5)

    def __call__(self, line: str) -> None:
        m = STEP_LINE.search(line)
        if not m:
            return
        step = int(m.group(1))
        text = f"{self.label}  step {step}/{self.steps}  loss {m.group(2)}  {time.perf_counter() - self.start:5.1f}s"
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
        elif step == 1 or step == self.steps or step % self.every == 0:
            print(text, file=self.stream, flush=True)

    def finish(self, status: str) -> None:
        text = f"{self.label}  {status}  {time.perf_counter() - self.start:5.1f}s"
        if self.tty:
            self.stream.write("\r\033[K")
        print(text, file=self.stream, flush=True)


def log_excerpt(log_path: str, tail: int = 25) -> str:
    """The trainer's own ``error:`` lines (torchrun's traceback tends to bury them) + the tail."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return f"(no log at {log_path})"
    errors = [l for l in lines if l.lstrip().startswith("error:") or "Error:" in l][:5]
    parts = []
    if errors:
        parts += ["  errors:"] + [f"    {l}" for l in errors] + ["  last lines:"]
    parts += [f"    {l}" for l in lines[-tail:]]
    return "\n".join(parts)


def create_seed_checkpoint(plan: Plan, timeout: float | None) -> str:
    """One process writes the initial weights every layout starts from (``python train.py``,
    or one forked rank with ``--launcher fork``)."""
    folder = os.path.join(plan.out, "seed")
    args = ["--config", plan.config, "--checkpoint.create_seed_checkpoint", "--job.dump_folder", folder]
    args += plan.extra
    log_path = os.path.join(folder, "seed.log")
    progress = Progress("seed checkpoint", 1)
    if plan.launcher == "fork":
        rc = run_forked_streaming(1, args, log_path, lambda line: None, timeout)
    else:
        rc = run_streaming([sys.executable, TRAIN_PY, *args], log_path, lambda line: None, timeout)
    if rc != 0:
        progress.finish(f"FAILED (exit {rc})")
        print(log_excerpt(log_path), file=sys.stderr)
        raise SystemExit(1)
    from trainer.config import load_config

    cfg = load_config(args)
    path = os.path.join(cfg.resolve_path(cfg.checkpoint.folder), "step-0")
    progress.finish(f"-> {path}")
    return path


def run_layouts(plan: Plan, layouts: list[Layout], timeout: float | None) -> list[RunResult]:
    """Sequentially (CPU runs share the cores); a failed run is reported and the rest go on."""
    results = []
    for i, layout in enumerate(layouts, 1):
        folder = plan.run_folder(i, layout)
        log_path = os.path.join(folder, "train.log")
        simulated = f"{layout.nproc} rank{'s' if layout.nproc > 1 else ''} in 1p"
        ranks = simulated if plan.comm_mode == "local_tensor" else f"{layout.nproc}p"
        label = f"[{i}/{len(layouts)}] {layout.name} ({ranks})"
        progress = Progress(label, plan.steps)
        start = time.perf_counter()
        argv = plan.run_argv(layout, folder)
        if plan.comm_mode == "local_tensor":  # one python process simulates all the layout's ranks
            rc = run_streaming([sys.executable, TRAIN_PY, *argv], log_path, progress, timeout)
        else:
            rc = launch(plan.launcher, layout.nproc, TRAIN_PY, argv, log_path, progress, timeout)
        result = RunResult(layout, folder, rc, time.perf_counter() - start, log_path)
        result.records = load_metrics(os.path.join(folder, "metrics.jsonl"))
        result.validation = load_validation(os.path.join(folder, "metrics.jsonl"))
        progress.finish("done" if rc == 0 else f"FAILED (exit {rc}); log: {log_path}")
        if rc != 0:
            print(log_excerpt(log_path), file=sys.stderr, flush=True)
        results.append(result)
    return results

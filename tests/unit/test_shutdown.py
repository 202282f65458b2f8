"""How processes that hold process groups end (trainer/lifecycle/shutdown.py): ``run_and_exit`` keeps
``sys.exit``'s behaviour up to interpreter finalization (exit codes, atexit handlers, joined
threads, flushed output) and never finalizes the interpreter, which is what keeps torch's
communication threads from calling into a dying interpreter. tests/e2e/test_exit.py checks that
train.py ends this way; ``python -m tools.exit_stress`` is the stress test of real runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXIT_PATHS = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from trainer.lifecycle.shutdown import run_and_exit

    mode, out = sys.argv[1], sys.argv[2]
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))

    class Teardown:  # module teardown (interpreter finalization) would run this
        def __del__(self, _open=open, _out=out):
            _open(_out + ".teardown", "w").write("ran")

    keeper = Teardown()

    def late_writer():
        time.sleep(0.3)
        open(out + ".thread", "w").write("done")

    def main():
        threading.Thread(target=late_writer).start()  # non-daemon: joined before the exit
        sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
        if mode == "code":
            return 3
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "sys_exit_message":
            sys.exit("stopping: a message")
        return None

    if mode == "plain_sys_exit":  # the negative control: Python's own exit
        sys.exit(main())
    run_and_exit(main)
    """
)


@pytest.mark.parametrize(
    "mode, code, stderr_has",
    [
        ("none", 0, ""),
        ("code", 3, ""),
        ("raise", 1, "RuntimeError: boom"),
        ("sys_exit_message", 1, "stopping: a message"),
    ],
)
def test_run_and_exit_keeps_sys_exit_semantics(tmp_path, mode, code, stderr_has):
    """Exit codes as sys.exit gives them; atexit handlers run, non-daemon threads finish,
    buffered stdout reaches the pipe, an uncaught exception prints its traceback; and the
    interpreter is not finalized (module teardown never runs)."""
    script = tmp_path / "paths.py"
    script.write_text(EXIT_PATHS)
    out = str(tmp_path / "mark")
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, str(script), mode, out], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == code, res.stderr
    assert res.stdout == "buffered, no newline"
    assert open(out + ".atexit").read() == "ran"
    assert open(out + ".thread").read() == "done"
    assert stderr_has in res.stderr
    if mode == "raise":
        assert "Traceback" in res.stderr
    assert not os.path.exists(out + ".teardown")


def test_plain_exit_finalizes_the_interpreter(tmp_path):
    """Negative control for the teardown check above: with sys.exit the marker is written."""
    script = tmp_path / "paths.py"
    script.write_text(EXIT_PATHS)
    out = str(tmp_path / "mark")
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run(
        [sys.executable, str(script), "plain_sys_exit", out], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert open(out + ".teardown").read() == "ran" and open(out + ".atexit").read() == "ran"

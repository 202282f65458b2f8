"""train.py ends without finalizing the interpreter (trainer/lifecycle/shutdown.py), on every exit path.

Why it matters: torch's gloo worker threads outlive ``destroy_process_group()`` and, under CPU
load, can still be releasing a finished collective's tensors when the main thread exits; if
the interpreter is being finalized then, the thread's GIL request ends in ``std::terminate``
and a finished run exits with SIGABRT ("terminate called without an active exception"). The
race is timing dependent (``python -m tools.exit_stress`` measures it on real runs); what this
test pins down deterministically is the property that removes it. A ``sitecustomize`` planted
in the workers registers a Python atexit handler (it must run: the orderly part of exiting) and
``abort()`` as a C exit handler (``__cxa_atexit``): a process that goes through the C runtime's
``exit()``, i.e. finalizes its interpreter and runs static destructors, dies by SIGABRT; one
that ends with ``os._exit`` after its shutdown does not. Every output must be complete.
(``gc.freeze()`` in train.py rules out the simpler probe, an object whose ``__del__`` runs in
module teardown: frozen objects are never collected.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.helpers import FAST, ROOT, train_cmd

SITECUSTOMIZE = """
import atexit, ctypes, os
if os.environ.get("LOCAL_RANK") is not None or os.environ.get("EXIT_PROBE_ALL"):  # workers, not torchrun
    _out = os.environ["EXIT_PROBE_DIR"]
    _tag = os.environ.get("RANK", "main") + "-" + str(os.getpid())
    atexit.register(lambda: open(os.path.join(_out, _tag + ".atexit"), "w").write("ran"))
    _libc = ctypes.CDLL(None)
    _libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    _libc.__cxa_atexit(ctypes.cast(_libc.abort, ctypes.c_void_p), None, None)
"""


def _probe_env(tmp_path, every_process: bool = False) -> tuple[dict, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", EXIT_PROBE_DIR=str(marks))
    if every_process:
        env["EXIT_PROBE_ALL"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env, str(marks)


def test_probe_catches_an_interpreter_that_finalizes(tmp_path):
    """Negative control: a process that exits as Python normally does dies by the probe."""
    env, marks = _probe_env(tmp_path, every_process=True)
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.exit(0)"], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -6  # SIGABRT from the C exit handler
    assert len(_marks(marks, "atexit")) == 1


def _marks(folder: str, kind: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith("." + kind))


@pytest.mark.parametrize(
    "nproc, extra, code",
    [
        (2, [], 0),  # a finished run: two gloo ranks (torchrun)
        (1, ["--parallelism.tp", "3"], 2),  # bad input found after the process group exists: exit 2
    ],
    ids=["finished_run", "bad_input"],
)
def test_train_py_exits_without_finalizing_the_interpreter(tmp_path, nproc, extra, code):
    env, marks = _probe_env(tmp_path, every_process=nproc == 1)  # plain python: its own worker
    out = tmp_path / "run"
    # 2 layers: the gloo threads, the process groups and the checkpoint writer are the same at any depth
    args = ["--config", "llama3.toml", *FAST, "--model.n_layers", "2", "--training.steps", "2"]
    args += ["--job.dump_folder", str(out)]
    args += ["--checkpoint.enable", "true", "--checkpoint.interval", "2", *extra]
    proc = subprocess.run(train_cmd(nproc, *args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # a worker that finalized its interpreter died by SIGABRT: torchrun exits 1, python -6
    assert proc.returncode == code, proc.stderr[-3000:]
    assert len(_marks(marks, "atexit")) == nproc, proc.stderr[-2000:]  # every worker shut down in order
    if code == 0:
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]
        assert (out / "checkpoint" / "step-2" / ".metadata").is_file()
    else:
        assert proc.stderr.strip().splitlines()[-1].startswith("error:"), proc.stderr[-2000:]

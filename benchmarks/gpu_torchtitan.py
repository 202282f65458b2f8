"""torchtitan in ``make bench-gpu``: its own trainer (``run_torchtitan_trainer``: torchrun of
``.gpu/torchtitan_ref``'s scripts, its log parsed into the row's figures), whether and why its
rows do not run (``torchtitan_skip``, ``torchtitan_unavailable``, which puts ``.gpu/site`` on the
path when torchtitan is not importable without it), and ``make bench-gpu-prepare``
(``prepare_torchtitan``: fills ``.gpu/`` from ``../shared``). torchtitan's model in the bare
loop is ``benchmarks/gpu_bare.py``'s.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import gpu_measure
from benchmarks.gpu_measure import ROOT, Case

# what the GPU machine needs besides the checkout, in a folder git ignores (.git/info/exclude):
# torchtitan_ref (torchtitan's trainer scripts and configs, its data and tokenizer) and site
# (torchtitan 0.2.2 and its pure-Python dependencies, unzipped); `make bench-gpu-prepare` fills it
GPU_FOLDER = ROOT / ".gpu"
TORCHTITAN_REF = GPU_FOLDER / "torchtitan_ref"
TORCHTITAN_SITE = GPU_FOLDER / "site"

# ------------------------------------------------------------------ torchtitan's own trainer

# model -> (flavor, layers, run script, config) of ../shared/gpu/torchtitan_ref: the scripts
# register torchtitan flavors of these shapes ("8B_l8", "16B_l6"); seq_len and batch come from
# the command line
TORCHTITAN_REF_RUNS = {
    "llama3": ("8B", 8, "llama_run.py", "llama_8b_8layers.toml"),
    "deepseek_v3": ("16B", 6, "deepseek_run.py", "deepseek_16b_6layers.toml"),
}
TORCHTITAN_DATA = "c4_test/data.json"  # written by its make_data.py (make bench-gpu-prepare)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torchtitan 0.2.2's training line (torchtitan/components/metrics.py, MetricsProcessor.log):
# "step: {step:2}  loss: {loss:8.5f}  grad_norm: {norm:7.4f}  memory: {reserved_gib:5.2f}GiB({pct:.2f}%)
#  tps: {round(tps):,}  tflops: {tflops:,.2f}  mfu: {mfu:.2f}%", each field after a color code
# unless metrics.disable_color_printing, behind its logger's "[titan] <time> - root - INFO - "
_TITAN_STEP = re.compile(
    r"(?<![A-Za-z])step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<memory>[\d.]+)GiB\((?P<memory_pct>[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%"
)


def parse_torchtitan_log(text: str) -> list[dict]:
    """Every training-step line of torchtitan's log in ``text`` (colored or not; validation lines,
    which have no grad_norm, are not steps): step, loss, grad_norm, tps (tokens per second per
    device over the steps since the last line; log_freq 1: that step), tflops, mfu_pct and
    reserved_gib (the step's max reserved memory), in log order."""
    records = []
    for line in text.splitlines():
        m = _TITAN_STEP.search(_ANSI.sub("", line))
        if m is None:
            continue
        records.append(
            {
                "step": int(m["step"]),
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),
                "tps": float(m["tps"].replace(",", "")),
                "tflops": float(m["tflops"].replace(",", "")),
                "mfu_pct": float(m["mfu"]),
                "reserved_gib": float(m["memory"]),
            }
        )
    return records


def summarize_torchtitan(records: list[dict], steps: int, warmup: int) -> dict:
    """The figures of our trainer's row from torchtitan's step records: medians over the steps
    after ``warmup`` (the window ours is timed on), every one of them logged, or an error."""
    timed = [r for r in records if r["step"] > warmup]
    if sorted(r["step"] for r in timed) != list(range(warmup + 1, steps + 1)):
        got = ", ".join(str(r["step"]) for r in records) or "none"
        return {"error": f"torchtitan's log has steps {got}, not every one of steps {warmup + 1}..{steps}"}
    return {
        "tokens_per_s": statistics.median(r["tps"] for r in timed),
        "mfu_pct": statistics.median(r["mfu_pct"] for r in timed),
        "peak_reserved_gib": max(r["reserved_gib"] for r in timed),
        "steps_timed": len(timed),
        "last_loss": timed[-1]["loss"],
    }


def torchtitan_trainer_cmd(case: Case, steps: int, folder: str) -> list[str]:
    """torchrun of ``.gpu/torchtitan_ref``'s script for ``case``'s model with its config, run from
    that folder (its data, tokenizer and configs are relative to it), one process."""
    _flavor, _layers, script, config = TORCHTITAN_REF_RUNS[case.model]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script]
    cmd += ["--job.config_file", config, "--job.dump_folder", folder, "--training.steps", str(steps)]
    cmd += ["--training.seq_len", str(case.seq_len), "--training.local_batch_size", str(case.local_batch_size)]
    if case.model == "deepseek_v3":
        cmd += ["--parallelism.expert_parallel_degree", "1"]
    if case.compile:
        cmd.append("--compile.enable")  # components model and loss, as its config lists
    return cmd


def torchtitan_skip(case: Case, kind: str, unavailable: str | None) -> str | None:
    """Why torchtitan's ``kind`` (``torchtitan_model`` or ``torchtitan_trainer``) does not run on
    ``case``'s row, or None. ``unavailable``: why torchtitan cannot be imported, or None."""
    if unavailable:
        return unavailable
    if case.precision != "bf16":
        return "the torchtitan comparison runs bf16 only"
    if case.attn_mask_type != "causal":
        return "the torchtitan comparison runs causal sdpa only"
    if kind == "torchtitan_model":
        if case.device == "cpu" and case.model == "deepseek_v3":
            # its router counts tokens with torch.histc, which has no CPU kernel for integers
            return "torchtitan's MoE does not run on CPU"
        return None
    if case.device != "cuda":
        return "torchtitan's trainer runs on CUDA only (it takes device cuda:LOCAL_RANK)"
    flavor, layers, script, _config = TORCHTITAN_REF_RUNS[case.model]
    if (case.flavor, case.n_layers) != (flavor, layers):
        return f"torchtitan_ref's {script} has {flavor} shapes with {layers} layers only"
    if not (TORCHTITAN_REF / script).exists() or not (TORCHTITAN_REF / TORCHTITAN_DATA).exists():
        return (
            f"{TORCHTITAN_REF.relative_to(ROOT)} is not prepared: run make bench-gpu-prepare where "
            "../shared is, and carry .gpu to the GPU machine"
        )
    return None


def run_torchtitan_trainer(case: Case, steps: int, warmup: int) -> dict:
    """torchtitan's trainer on ``case`` (``torchtitan_trainer_cmd``), its figures from its log
    (``summarize_torchtitan``), or an error with the log's tail. Past ``gpu_measure.TIMEOUT_S``
    torchrun gets SIGTERM, on which it stops its worker (which runs in a session of its own)
    before it exits, so no worker is left holding the GPU for the next measurement; SIGKILL to
    torchrun's session after 30 s more. The log goes to a file, which a worker cannot hold open the way it could a
    pipe."""
    import signal

    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
        if TORCHTITAN_SITE.is_dir():
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TORCHTITAN_SITE), env.get("PYTHONPATH")]))
        log_path = Path(folder) / "torchtitan.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(
                torchtitan_trainer_cmd(case, steps, os.path.join(folder, "dump")),
                cwd=TORCHTITAN_REF,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=gpu_measure.TIMEOUT_S)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        log = log_path.read_text(errors="replace")
    if timed_out:
        limit = f"{gpu_measure.TIMEOUT_S:g} s (--timeout)"
        return {"error": f"torchtitan's trainer did not finish in {limit}, killed: {log[-2000:]}"}
    if proc.returncode != 0:
        return {"error": f"torchtitan's trainer exited {proc.returncode}: {log[-2000:]}"}
    out = summarize_torchtitan(parse_torchtitan_log(log), steps, warmup)
    if "error" in out:
        out["error"] += f": {log[-2000:]}"
    return out


def _import_torchtitan() -> str | None:
    """None when torchtitan's models import, else the error."""
    try:
        import torchtitan.models.deepseek_v3
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def torchtitan_unavailable() -> str | None:
    """None when torchtitan is importable, else the reason its rows give. Not importable as is but
    ``.gpu/site`` exists (``make bench-gpu-prepare``): that folder goes on this process's path and
    on ``PYTHONPATH`` for the measurement processes, and counts if torchtitan imports from it."""
    err = _import_torchtitan()
    if err is not None and TORCHTITAN_SITE.is_dir() and str(TORCHTITAN_SITE) not in sys.path:
        sys.path.insert(0, str(TORCHTITAN_SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TORCHTITAN_SITE), os.environ.get("PYTHONPATH")]))
        err = _import_torchtitan()
    return None if err is None else f"torchtitan not importable ({err})"


# ------------------------------------------------------------------ prepare (make bench-gpu-prepare)


def prepare_torchtitan(shared: Path) -> int:
    """Fill ``.gpu/`` for the GPU machine from ``shared`` (../shared): ``gpu/torchtitan_ref`` copied
    to ``.gpu/torchtitan_ref`` (writable copies) and its data written there (its make_data.py),
    every wheel of ``wheels/`` unzipped into ``.gpu/site``, and ``/.gpu/`` added to
    ``.git/info/exclude`` so git ignores the folder."""
    import zipfile

    ref, wheels = shared / "gpu" / "torchtitan_ref", shared / "wheels"
    missing = [str(p) for p in (ref, wheels) if not p.is_dir()]
    if missing:
        print(
            f"error: {', '.join(missing)} not found: pass the folder that holds gpu/torchtitan_ref and "
            "wheels/ (make bench-gpu-prepare SHARED=path)",
            file=sys.stderr,
        )
        return 2
    for src in sorted(ref.rglob("*")):
        dst = TORCHTITAN_REF / src.relative_to(ref)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)  # contents only: the source is read-only
    TORCHTITAN_SITE.mkdir(parents=True, exist_ok=True)
    names = sorted(w.name for w in wheels.glob("*.whl"))
    for name in names:
        with zipfile.ZipFile(wheels / name) as z:
            z.extractall(TORCHTITAN_SITE)
    subprocess.run([sys.executable, "make_data.py"], cwd=TORCHTITAN_REF, check=True)
    git_dir = subprocess.run(
        ["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True, text=True
    )
    if git_dir.returncode == 0:
        exclude = ROOT / git_dir.stdout.strip()
        lines = exclude.read_text().splitlines() if exclude.exists() else []
        if "/.gpu/" not in lines:
            exclude.parent.mkdir(parents=True, exist_ok=True)
            exclude.write_text("\n".join([*lines, "/.gpu/"]) + "\n")
    print(
        f"prepared {GPU_FOLDER.relative_to(ROOT)}/: torchtitan_ref from {ref} (data: {TORCHTITAN_DATA}), "
        f"site from {len(names)} wheels ({', '.join(names)}); carry .gpu to the GPU machine"
    )
    return 0

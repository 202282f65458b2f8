"""lm-eval on the training mesh (issue 54, items 2 and 3), end to end on CPU, float32.

One module launch trains llama3/debugmodel with 2 layers for 2 steps (forked rank, as train.py
runs it) with ``[eval]`` scoring the local tasks of tests/lm_eval_tasks.py (multiple choice,
generate_until, loglikelihood_rolling) after every step, a step-2 checkpoint and its Hugging
Face export; and the same run without ``[eval]``. Claims:

* the loss curve (and grad norms) of the run with [eval] equal the run without, bitwise: the
  evaluation after step 1 changed nothing step 2 computes;
* ``scripts/eval.py`` (a forked process, as ``python scripts/eval.py`` runs) on the step-2
  checkpoint writes lm-eval's results JSON whose metrics equal the scores the run logged at
  step 2 (``eval/<task>/<metric>`` in metrics.jsonl): the same model, requests and kernels;
* every request's answer of that run, and of one 2-rank launch that evaluates the checkpoint
  on tp=2 and then on fsdp=2 (the first 2 documents of each task), equals lm-eval's own HFLM on
  the exported folder: log-likelihoods within 1e-5 relative (+ 1e-5 absolute; float32 on both
  sides, but other kernels: our attention and fused shapes against transformers', batch 2
  against 1, tp's sharded matmuls and reductions; measured: at most 1.5e-7 relative on 1
  process, 1.1e-7 on tp=2 and fsdp=2), is_greedy flags and greedy generations exactly, and the
  results' metrics to the same tolerance. The negative control (logits shifted one position
  fail the same comparison) is tests/unit/test_lm_eval_model.py::test_shifted_logits_fail;
* bad input to scripts/eval.py, one ``error:`` line and exit code 2: a checkpoint of another
  model (3 layers against 2), a missing checkpoint, a task file that does not parse (an unknown
  task name: tests/unit/test_lm_eval_model.py, in process).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.lm_eval_tasks import offline_env, write_tasks

from .helpers import FAST, ROOT, metric_records, run_forked

pytestmark = pytest.mark.e2e

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

EVAL_PY = ROOT / "scripts" / "eval.py"
TASKS = ["meshtrain_mc", "meshtrain_gen", "meshtrain_rolling"]
RTOL = ATOL = 1e-5
LIMIT = 2  # documents per task on tp=2 and fsdp=2 (every request of them compared)
MODEL = ["--config", "llama3.toml", "--model.n_layers", "2"]
TRAIN = [*MODEL, *FAST, "--training.steps", "2", "--lr_scheduler.warmup_steps", "1"]


def _env(root):
    return {**os.environ, **offline_env(), "HF_DATASETS_CACHE": str(root / "datasets"), "OMP_NUM_THREADS": "1"}


def _ok(res):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_train")
    tasks = write_tasks(root / "tasks")
    env = _env(root)
    with_eval = [
        "--eval.tasks", ",".join(TASKS), "--eval.interval", "1", "--eval.include_path", tasks, "--eval.batch_size",
        "2", "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.last_save_in_hf", "true",
        "--checkpoint.export_dtype", "float32",
    ]  # fmt: skip
    res = run_forked(1, *TRAIN, *with_eval, "--job.dump_folder", str(root / "eval"), env=env)
    _ok(res)
    assert "eval at step 1: meshtrain_gen/exact_match" in res.stdout
    _ok(run_forked(1, *TRAIN, "--job.dump_folder", str(root / "plain"), env=env))
    return root, tasks, env


def _eval_script(root, env, *args):
    from tools.forkserver import run_train

    return run_train(1, [*MODEL, *args], script=EVAL_PY, env=env, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def script_results(runs):
    root, tasks, env = runs
    out = root / "results.json"
    res = _eval_script(
        root, env, "--checkpoint", str(root / "eval" / "checkpoint" / "step-2"), "--tasks", ",".join(TASKS),
        "--include_path", tasks, "--batch_size", "2", "--log_samples", "--output_path", str(out),
    )  # fmt: skip
    _ok(res)
    assert f"wrote {out}" in res.stdout and "|meshtrain_mc" in res.stdout
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(runs):
    """lm-eval's HFLM on the step-2 export, batch 1, the context our session has."""
    from lm_eval.models.huggingface import HFLM

    from trainer.config import load_config
    from trainer.inference.lm_eval_run import evaluate, task_manager
    from trainer.plan import plan_job

    root, tasks, env = runs
    os.environ.update(offline_env())
    os.environ["HF_DATASETS_CACHE"] = env["HF_DATASETS_CACHE"]
    max_len = plan_job(load_config([*TRAIN]), 1).model.args.max_seq_len
    hflm = HFLM(
        pretrained=str(root / "eval" / "checkpoint" / "step-2-hf"), batch_size=1, max_length=max_len, device="cpu"
    )
    results = evaluate(hflm, task_manager(TASKS, tasks), TASKS, log_samples=True)
    return json.loads(json.dumps(results, default=str))


def _answers(results, task, docs=None):
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["resps"] for s in samples if docs is None or s["doc_id"] in docs]


def _close(a, b):
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)


def assert_same_answers(ours, ref, metrics=True):
    """Every request's answer of ``ours`` (module docstring's tolerance), and with ``metrics``
    the results' metrics; returns the largest relative log-likelihood difference."""
    worst = 0.0
    for task in TASKS:
        docs = {s["doc_id"] for s in ours["samples"][task]}
        got, want = _answers(ours, task), _answers(ref, task, docs)
        assert len(got) == len(want) > 0
        for doc_got, doc_want in zip(got, want, strict=True):
            for (a,), (b,) in zip(doc_got, doc_want, strict=True):  # one response per request
                if isinstance(b, str):
                    assert a == b, (task, a, b)
                    continue
                if isinstance(b, list):  # loglikelihood: [logprob, is_greedy]
                    assert a[1] == b[1], (task, a, b)
                    a, b = a[0], b[0]
                assert _close(a, b), (task, a, b)
                worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
    for task in TASKS if metrics else ():
        for key, value in ref["results"][task].items():
            if "," in key and "stderr" not in key and isinstance(value, float):
                assert _close(ours["results"][task][key], value), (task, key)
    return worst


def test_eval_leaves_the_loss_curve_bitwise(runs):
    root, _, _ = runs
    with_eval = [(r["step"], r["loss"], r["grad_norm"]) for r in metric_records(root / "eval")]
    plain = [(r["step"], r["loss"], r["grad_norm"]) for r in metric_records(root / "plain")]
    assert with_eval == plain and len(plain) == 2


def test_script_equals_eval_during_training(runs, script_results):
    from trainer.inference.lm_eval_run import scores

    root, _, _ = runs
    logged = [r for r in _records(root / "eval") if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in logged] == [1, 2]
    at_step_2 = {k[len("eval/") :]: v for k, v in logged[1].items() if k.startswith("eval/")}
    assert at_step_2 == scores(script_results) and "meshtrain_mc/acc" in at_step_2


def _records(folder):
    with open(folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_script_requests_equal_hflm(script_results, reference):
    worst = assert_same_answers(script_results, reference)
    print(f"1 process: largest relative log-likelihood difference to HFLM {worst:.2e}")
    assert worst < RTOL


def _mesh_answers(rank, world, checkpoint, tasks, layouts):
    """One 2-rank launch: the checkpoint on each layout in turn, every task with samples."""
    from trainer.config import load_config
    from trainer.inference.lm_eval_model import MeshLM
    from trainer.inference.lm_eval_run import evaluate, task_manager
    from trainer.inference.session import InferenceSession

    manager = task_manager(TASKS, tasks)
    out = {}
    for name, extra in layouts:
        session = InferenceSession.from_checkpoint(load_config([*TRAIN, *extra]), checkpoint)
        lm = MeshLM(session, batch_size=2)
        results = evaluate(lm, manager, TASKS, limit=LIMIT, log_samples=True, bootstrap_iters=0)
        if rank == 0:
            out[name] = json.loads(json.dumps(results, default=str))
    return out


def test_tp_and_fsdp_requests_equal_hflm(runs, reference):
    from tools.forkserver import run_distributed

    root, tasks, _ = runs
    layouts = [("tp=2", ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"]), ("fsdp=2", [])]
    checkpoint = str(root / "eval" / "checkpoint" / "step-2")
    out = run_distributed(_mesh_answers, 2, checkpoint, tasks, layouts, env=_env(root), timeout=300)[0]
    for name, _ in layouts:
        print(
            f"{name}: largest relative log-likelihood difference to HFLM {assert_same_answers(out[name], reference, False):.2e}"
        )
        assert assert_same_answers(out[name], reference, metrics=False) < RTOL, name


@pytest.mark.parametrize(
    "case",
    ["another_model", "missing_checkpoint", "bad_yaml"],
)
def test_bad_input_one_line_exit_2(runs, tmp_path, case):
    root, tasks, env = runs
    ckpt, include, extra = str(root / "eval" / "checkpoint" / "step-2"), tasks, []
    if case == "another_model":
        extra = ["--model.n_layers", "3"]
    elif case == "missing_checkpoint":
        ckpt = str(tmp_path / "nowhere" / "step-9")
    else:
        include = str(tmp_path / "tasks")
        os.makedirs(include)
        with open(os.path.join(include, "broken.yaml"), "w") as f:
            f.write("task: broken\ndataset_path: json\n  oops: [unclosed\n")
    args = ["--checkpoint", ckpt, "--tasks", "meshtrain_mc", "--include_path", include, "--output_path", str(tmp_path)]
    res = _eval_script(root, env, *args, *extra)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    want = {"another_model": "another model", "missing_checkpoint": "nowhere", "bad_yaml": "does not parse"}[case]
    assert want in lines[0], lines[0]

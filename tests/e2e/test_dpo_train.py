"""DPO through train.py (``training.objective = "dpo"`` on ``training.dataset = "preference"``),
end to end on CPU, fp32, forked ranks (tools/forkserver.py).

* Layouts: ``tools.compare_loss`` over single, fsdp=2, tp=2 (the vocabulary-sharded head's
  loss-parallel log-softmax: no logits gathered), cp=2 (per-row partial log-probs all-reduced
  over cp), pp=2 (the loss on the last stage, pairs whole in each pipeline micro-batch) with
  llama3 and sigmoid DPO, and deepseek_v3 (2 blocks: 1 dense + 1 MoE) single vs fsdp=2 x ep=2 and
  cp=2 x ep=2 with IPO (per-token-averaged log-ratios: the completion-token counts are summed over
  cp too) and the chunked loss (``training.loss_chunk_tokens``: the log-probs from the head's
  per-token losses): loss and grad norm within the tool's DEFAULT tolerance (1e-5 loss, 1e-4 grad norm,
  relative; never loosened), and TRL's six metrics within 1e-5 relative + 1e-5 absolute of the
  baseline's (logps: 1e-5 relative of ~ -150). The frozen-copy reference of these runs loads the
  compare's seed checkpoint (``initial_load_path``) like the policy. Measured (CPU): loss within
  5.3e-7 relative on every layout (fsdp=2 and fsdp=2 x ep=2 bitwise); the metrics within 3.8e-5
  of the baseline's relative to max(|value|, 1e-3) (cp=2: the pair loss takes differences of
  ~ -150 log-prob sums, so float32 summation-order noise of ~1e-5 in a sum shows there).
  Cost (CPU s, forked ranks): 12.8 (llama3, 5 runs), 9.7 (deepseek_v3, 3 runs), 4.0 (the LoRA
  and resume runs below).
* LoRA on the llama3 matrix's seed checkpoint (the base, a DCP folder): ``dpo.reference =
  "auto"`` (the policy with adapters off: no second copy) against ``"copy"`` (a frozen copy
  that loads the base's weights from that folder, its adapters' B = 0 from the init): the same
  reference log-probs,
  so loss, grad norm and the six metrics are bitwise equal over 3 steps (the adapters start at
  zero, so the policy of step 1 equals both references; steps 2-3 compare a moved policy against
  each reference).
* Export as without DPO: the adapters-off run writes its merged Hugging Face folder and PEFT
  adapters (every lora_B moved off its zero init by the DPO gradients).
* The copy loads a Hugging Face ``initial_load_path`` too: step 1's loss is ln 2, rewards 0.
* Kill + resume: the LoRA copy-reference run SIGKILLed after its step-2 checkpoint and resumed
  gives step 3 bitwise (loss, grad norm, metrics): the reference is rebuilt from the initial
  weights, not from the step checkpoint (a reference loaded from step 2's weights would give
  rewards 0 at step 3).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.preference_data import preference_rows, tokenizer_folder, write_jsonl

from .helpers import ForkedJob, drill_env, read_metrics, run_compare_loss, run_forked

pytestmark = pytest.mark.e2e

STEPS = 3
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
COMMON = [
    "--training.seq_len", "64", "--training.global_batch_size", "8", "--training.local_batch_size", "4",
    "--metrics.enable_tensorboard", "false", "--model.n_layers", "2", "--model.vocab_size", "2056",
    "--training.objective", "dpo", "--training.dataset", "preference",
]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    tok = tokenizer_folder(root / "tok", "llama3")
    pairs = write_jsonl(root / "pairs.jsonl", preference_rows(96, seed=1))
    return root, ["--training.dataset_path", pairs, "--model.tokenizer_path", tok]


def _compare(root, config: str, layouts: list[str], extra: list[str]) -> Path:
    """Run the matrix and check it; returns its seed checkpoint (every run's initial weights)."""
    out = root / f"cmp-{config}"
    proc = run_compare_loss(
        "--config", f"train_configs/{config}", "--steps", str(STEPS), "--out", str(out), "--timeout", "300",
        "--launcher", "fork", "--layouts", *layouts, "--", *COMMON, *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and (summary["rtol"], summary["grad_norm_rtol"]) == (1e-5, 1e-4)
    runs = summary["runs"]
    assert [r["layout"] for r in runs] == layouts
    base = read_metrics(runs[0]["folder"])
    assert abs(base[STEPS]["rewards/margins"]) > 1e-3  # the policy moved off the reference
    for run in runs:
        assert run["status"] in ("ok", "baseline") and run["first_step_beyond"] is None, run
        m = read_metrics(run["folder"])
        assert sorted(m) == list(range(1, STEPS + 1))
        worst = 0.0
        for step in m:
            for name in METRICS:
                a, b = m[step][name], base[step][name]
                worst = max(worst, abs(a - b) / max(abs(b), 1e-3))
                assert abs(a - b) <= 1e-5 + 1e-5 * abs(b), (run["layout"], step, name, a, b)
        print(f"{run['layout']:<14} rel loss {run['max_rel_diff']:.2e}  metrics {worst:.2e}")
    return out / "seed" / "checkpoint" / "step-0"


@pytest.fixture(scope="module")
def llama3_seed(data) -> Path:
    """The llama3 matrix (run once) and its seed checkpoint, the LoRA runs' base."""
    root, args = data
    return _compare(root, "llama3.toml", ["single", "fsdp=2", "tp=2", "cp=2", "pp=2"], args)


def test_dpo_layouts_llama3(llama3_seed):
    assert llama3_seed.is_dir()  # the matrix ran and passed in the fixture


def test_ipo_layouts_deepseek_ep(data):
    root, args = data
    extra = [*args, "--dpo.loss_type", "ipo", "--training.loss_chunk_tokens", "32"]
    _compare(root, "deepseek_v3.toml", ["single", "fsdp=2,ep=2", "cp=2,ep=2"], extra)


LORA = ["--config", "llama3.toml", *COMMON, "--model.converters", "lora", "--training.steps", str(STEPS)]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--metrics.log_freq", "1"]


def _run(root, name: str, *extra: str) -> dict:
    res = run_forked(1, *LORA, *CKPT, "--job.dump_folder", str(root / name), *extra)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _values(metrics: dict, step: int) -> tuple:
    return tuple(metrics[step][k] for k in ("loss", "grad_norm", *METRICS))


def test_lora_adapters_off_reference_equals_copy_and_resume_is_bitwise(data, llama3_seed):
    root, args = data
    args = [*args, "--checkpoint.initial_load_path", str(llama3_seed)]  # the base (a DCP folder)
    out = _run(root, "auto", *args, "--dpo.reference", "auto", "--checkpoint.save_in_hf_every", str(STEPS))
    assert "dpo reference: the policy with its LoRA adapters off" in out
    # the exports as without DPO: the merged Hugging Face folder and the PEFT adapters, trained
    exports = root / "auto" / "checkpoint"
    assert (exports / f"step-{STEPS}-hf" / "config.json").is_file()
    from safetensors.torch import load_file

    adapters = load_file(exports / f"step-{STEPS}-peft" / "adapter_model.safetensors")
    lora_b = [t for k, t in adapters.items() if "lora_B" in k]
    assert lora_b and all(t.abs().max() > 0 for t in lora_b)  # B starts at 0: DPO's gradients moved every one
    out = _run(root, "copy", *args, "--dpo.reference", "copy")
    assert f"dpo reference: a frozen copy of the initial weights ({llama3_seed})" in out
    auto, copy = read_metrics(root / "auto"), read_metrics(root / "copy")
    for step in range(1, STEPS + 1):
        assert _values(auto, step) == _values(copy, step), step
    assert auto[1]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # step 1: policy = reference
    assert abs(auto[STEPS]["rewards/margins"]) > 1e-4  # measured 9.1e-4: the adapters moved the policy

    # kill after the step-2 checkpoint (held before the step-3 save), resume: step 3 bitwise
    resumed = root / "resumed"
    cmd = [*LORA, *CKPT, "--job.dump_folder", str(resumed), *args, "--dpo.reference", "copy"]
    job = ForkedJob(1, *cmd, env=drill_env("begin:@3"))
    try:
        assert job.wait_for_output("saved checkpoint", 300), job.output[-3000:]
        job.signal(signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        job.close()
    res = run_forked(1, *cmd)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed from {resumed / 'checkpoint'} at step 2" in res.stdout
    assert _values(read_metrics(resumed), STEPS) == _values(copy, STEPS)


def test_copy_reference_loads_an_hf_initial_folder(data):
    """The frozen copy loads ``initial_load_path`` as a Hugging Face folder like the policy: at
    step 1 the policy is the reference, so every reward is 0 and the loss ln 2 exactly as far
    as float32 goes. Control, measured once with the copy's Hugging Face load skipped (left at
    the seeded init): step-1 loss 0.827."""
    from tests.hf_models import hf_model, llama_config

    root, args = data
    folder = root / "base-hf"
    hf_model(llama_config(num_hidden_layers=2, vocab_size=2056), seed=4).save_pretrained(folder)
    out = root / "hf-copy"
    res = run_forked(
        1, "--config", "llama3.toml", *COMMON, *args, "--training.steps", "1", "--job.dump_folder", str(out),
        "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", str(folder),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"dpo reference: a frozen copy of the initial weights ({folder})" in res.stdout
    m = read_metrics(out)[1]
    assert m["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert m["rewards/chosen"] == m["rewards/rejected"] == 0.0, m
    assert m["logps/chosen"] < -1.0  # a real forward

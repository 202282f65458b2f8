"""LoRA through train.py (``model.converters = ["lora"]``), end to end on CPU, fp32.

One fsdp=2 run of llama3 (2 blocks, the debug flavor's other shapes) starts from a random
transformers Llama saved as a Hugging Face folder (``initial_load_in_hf``) and trains 3 steps
with a resumable checkpoint at step 2, the collectives of step 2 recorded, and at step 3 the
consolidated weights (``last_save_model_only``) and the LoRA exports (``save_in_hf_every``: the
merged folder ``step-3-hf`` and the PEFT folder ``step-3-peft``). Claims on it:

* frozen base: every base tensor of the final weights is bitwise the Hugging Face folder's
  (through the adapter, fp32: a copy); the step checkpoint holds the adapters and optimizer
  state for the adapters only; the step's reduce-scatter bytes are exactly the adapters'
  gradients (4 bytes x 77,824 adapter elements of 2.7M parameters, in the two blocks' units),
  and the only fsdp all-reduce is the gradient norm's 8 bytes (the all-gathers still move the
  frozen base: forward needs it); the planner predicts exactly the recorded collectives;
* PEFT: ``PeftModel.from_pretrained(base, step-3-peft)`` gives our logits (our model rebuilt in
  this process from the consolidated weights) within 1e-5 (rtol and atol, logits of order 1;
  summation order differs as in tests/unit/test_lora.py);
* merged: every tensor of ``step-3-hf`` is bitwise ``to_hf(W + scale * B @ A)`` of the final
  weights (same float32 kernels, same shapes), and ``from_pretrained`` of it gives our logits
  within 1e-5;
* kill and resume: the same job under torchrun, both workers SIGKILLed after the step-2
  checkpoint, resumed (the base loaded again from its folder) gives step 3's loss and grad norm
  bitwise; a copy of step-2 pointed at another base folder stops with one line naming both bases
  (exit 2).

Forked ranks (tools/forkserver.py) for the runs whose claim is the math (bitwise the torchrun
runs, tests/e2e/test_launcher.py) and for the user error (the same train.py ``__main__`` and exit,
so the same stderr and exit code; a fresh ``python train.py`` on bad input:
tests/e2e/test_exit.py's bad_input case), torchrun for the kill.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tests.hf_models import hf_model, llama_config

from .helpers import FAST, read_metrics, run_forked, run_until

pytestmark = pytest.mark.e2e

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RTOL = ATOL = 1e-5
LORA = ["--config", "llama3.toml", *FAST, "--model.n_layers", "2", "--model.converters", "lora"]
HF_LOAD = ["--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path"]
RUN = [
    "--parallelism.dp_shard",
    "2",
    "--training.steps",
    "3",
    "--lr_scheduler.warmup_steps",
    "1",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
    "--checkpoint.last_save_model_only",
    "true",
    "--checkpoint.save_in_hf_every",
    "3",
    "--comm.record_step",
    "2",
]


def _hf(seed: int):
    return hf_model(llama_config(num_hidden_layers=2), seed=seed)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = root / "base-hf"
    _hf(1).save_pretrained(base)
    run = root / "run"
    res = run_forked(2, *LORA, *RUN, "--job.dump_folder", str(run), *HF_LOAD, str(base))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "lora: rank 8, alpha 16 (scale 2)" in res.stdout and "14 linear layers adapted" in res.stdout
    return root, base, run


def _ours_from(path) -> tuple[torch.nn.Module, dict]:
    from models.parallel.lora import LoRAOptions, convert_to_lora
    from models.registry import build_model

    model = build_model("llama3", "debugmodel", device="cpu", n_layers=2)
    convert_to_lora(model, LoRAOptions())
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state, strict=True)
    return model, state


def _tokens():
    return torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))


def test_base_frozen_and_only_adapters_move(lora_run):
    from models.parallel.lora import is_adapter_key
    from models.registry import get_hf_adapter
    from trainer.checkpoint.state import checkpoint_keys

    run = lora_run[2]
    model, final = _ours_from(run / "checkpoint" / "model-step-3.pt")
    theirs = get_hf_adapter("llama3", model.args).from_hf(_hf(1).state_dict())
    adapters = {k: v for k, v in final.items() if is_adapter_key(k)}
    assert len(adapters) == 28 and all(v.abs().max() > 0 for v in adapters.values())
    assert set(final) - set(adapters) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(final[k], v), k  # bitwise: the base never changed
    keys = checkpoint_keys(str(run / "checkpoint" / "step-2"))
    model_keys = {k[len("model.") :] for k in keys if k.startswith("model.")}
    assert model_keys == set(adapters)
    opt = {k for k in keys if k.startswith("optimizer.state.")}
    assert opt and all(is_adapter_key(k.split(".", 2)[2].rsplit(".", 1)[0]) for k in opt), sorted(opt)[:4]
    comm = json.loads((run / "comm_rank0.json").read_text())
    summary = {(e["kind"], e["mesh"]): e for e in comm["summary"]}
    adapter_bytes = 4 * sum(v.numel() for v in adapters.values())
    assert adapter_bytes == 4 * 77_824
    assert summary[("reduce_scatter", "fsdp")]["bytes"] == adapter_bytes, summary
    # the other fsdp all-reduce is the gradient norm's float64 sum of squares, 8 bytes
    assert summary[("all_reduce", "fsdp")] == {"kind": "all_reduce", "mesh": "fsdp", "count": 1, "bytes": 8}
    # the planner predicts exactly these collectives (tools/planner/lora.py)
    from models.parallel.lora import LoRAOptions
    from parallel_dims.layout import validate_degrees
    from tools.planner.choice import LayoutChoice
    from tools.planner.collectives import predict_collectives

    choice = LayoutChoice(global_batch=8, local_batch=2, seq_len=64, param_dtype="float32", lora=LoRAOptions())
    predicted = predict_collectives(
        "llama3", "debugmodel", validate_degrees(dp_shard=2, world_size=2), choice, n_layers=2
    )
    key = lambda r: (r["kind"], r["mesh"], r["bytes"])  # noqa: E731
    assert sorted(predicted, key=key) == sorted(comm["calls"], key=key), (predicted, comm["calls"])


def test_peft_folder_and_merged_folder(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from models.registry import get_hf_adapter
    from trainer.checkpoint.lora_export import merge_adapters

    _, base, run = lora_run
    model, final = _ours_from(run / "checkpoint" / "model-step-3.pt")
    with torch.no_grad():
        ours = model(_tokens())
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), run / "checkpoint" / "step-3-peft"
    )
    with torch.no_grad():
        theirs = peft_model(input_ids=_tokens(), use_cache=False).logits
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    # the adapters are not a no-op: the base alone is far from our logits
    with torch.no_grad(), peft_model.disable_adapter():
        plain = peft_model(input_ids=_tokens(), use_cache=False).logits
    assert not torch.allclose(ours, plain, rtol=RTOL, atol=ATOL)

    from safetensors.torch import load_file

    merged_dir = run / "checkpoint" / "step-3-hf"
    on_disk = {}
    for f in sorted(merged_dir.glob("*.safetensors")):
        on_disk.update(load_file(str(f)))
    expect = get_hf_adapter("llama3", model.args).to_hf(merge_adapters(final, 2.0))
    assert set(on_disk) == set(expect)
    for k, v in expect.items():
        assert torch.equal(on_disk[k], v), k
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=_tokens(), use_cache=False).logits, ours, rtol=RTOL, atol=ATOL)


def test_kill_resume_is_bitwise_and_another_base_is_refused(lora_run):
    root, base, run = lora_run
    resumed = root / "resumed"
    # the same job under torchrun, both workers SIGKILLed once the step-2 checkpoint is reported
    # (held before the step-3 save until then: the drill's begin point)
    run_until(
        2, "saved checkpoint", *LORA, *RUN, "--job.dump_folder", str(resumed), *HF_LOAD, str(base), hold="begin:@3"
    )
    assert sorted(os.listdir(resumed / "checkpoint")) == ["step-2"]
    res = run_forked(2, *LORA, *RUN, "--job.dump_folder", str(resumed), *HF_LOAD, str(base))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed from {resumed / 'checkpoint'} at step 2" in res.stdout
    assert "loaded initial weights from Hugging Face folder" in res.stdout  # the base, again
    a, b = read_metrics(run)[3], read_metrics(resumed)[3]
    assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]) and math.isfinite(a["loss"])

    other = root / "other-hf"
    _hf(2).save_pretrained(other)
    wrong = root / "wrong"
    shutil.copytree(run / "checkpoint" / "step-2", wrong / "checkpoint" / "step-2")
    cmd = [*LORA, *RUN, "--parallelism.dp_shard", "1", "--job.dump_folder", str(wrong), *HF_LOAD, str(other)]
    res = run_forked(1, *cmd)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "LoRA adapters trained on the base" in lines[0] and str(base) in lines[0] and str(other) in lines[0]


def _convert_hf_main():
    import importlib.util

    from .helpers import ROOT

    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "scripts" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_convert_hf_lora_peft_and_merge_from_a_step(lora_run, capsys):
    """scripts/convert_hf.py on the step-2 checkpoint (in this process): ``lora-merge`` (the base
    from the folder the run recorded, fingerprint checked) is bitwise ``to_hf(W + scale * B @ A)``;
    the ``lora-peft`` folder on the base gives the merged folder's logits within 1e-5; another
    base is refused in one line (exit 2)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from models.registry import get_hf_adapter
    from trainer.checkpoint.lora_export import merge_adapters
    from trainer.checkpoint.lora_offline import read_lora_step

    root, base, run = lora_run
    main = _convert_hf_main()
    step = str(run / "checkpoint" / "step-2")
    common = ["--model", "llama3", "--flavor", "debugmodel", "--n-layers", "2", "--dtype", "float32"]
    assert main(["lora-merge", step, str(root / "merged2"), *common]) == 0
    assert main(["lora-peft", step, str(root / "peft2"), *common]) == 0
    adapters, extra = read_lora_step(step)
    assert extra["lora"]["rank"] == 8 and extra["lora_base"]["path"] == str(base)
    model, _ = _ours_from(run / "checkpoint" / "model-step-3.pt")
    hf_adapter = get_hf_adapter("llama3", model.args)
    expect = hf_adapter.to_hf(merge_adapters({**hf_adapter.from_hf(_hf(1).state_dict()), **adapters}, 2.0))
    got = load_file(str(root / "merged2" / "model.safetensors"))
    assert set(got) == set(expect) and all(torch.equal(got[k], v) for k, v in expect.items())
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(root / "merged2", dtype=torch.float32)
        want = merged(input_ids=_tokens(), use_cache=False).logits
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), root / "peft2")
        torch.testing.assert_close(peft_model(input_ids=_tokens(), use_cache=False).logits, want, rtol=RTOL, atol=ATOL)

    other = root / "other-base"
    _hf(3).save_pretrained(other)
    capsys.readouterr()
    assert main(["lora-merge", step, str(root / "merged-wrong"), *common, "--base", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "is not the base the adapters" in err[0], err
    assert not (root / "merged-wrong").exists()


def test_frozen_base_in_bf16_trains_as_the_fp32_masters(tmp_path):
    """bf16 mixed precision on fsdp=2, 3 steps: the frozen base stored in bf16
    (``lora.frozen_dtype``, half its memory) gives bitwise the losses and grad norms of the run
    that keeps fp32 masters of it and casts them to bf16 every step (the same bf16 values; the
    adapters are fp32 masters in both)."""
    bf16 = [*LORA, "--parallelism.mixed_precision_param", "bfloat16", "--parallelism.dp_shard", "2",
            "--training.steps", "3", "--checkpoint.enable", "false"]  # fmt: skip
    curves = []
    for extra in ([], ["--lora.frozen_dtype", "bfloat16"]):
        out = tmp_path / f"run{len(curves)}"
        res = run_forked(2, *bf16, *extra, "--job.dump_folder", str(out))
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        m = read_metrics(out)
        curves.append([(m[s]["loss"], m[s]["grad_norm"]) for s in (1, 2, 3)])
    assert "frozen base stored in bfloat16" in res.stdout
    assert curves[0] == curves[1] and curves[0][0] != curves[0][2], curves

"""Generation on the training mesh (issue 54 item 1): trainer/inference/ and scripts/generate.py.

Three debug models at 2 layers (llama3, qwen3, deepseek_v3: GQA with interleaved RoPE, GQA with
q/k norms and half-split RoPE, MLA with a MoE layer) start from random transformers models
(tests/hf_models.py's weights: large enough that attention depends on positions), train 2 steps
(forked ranks) with a step checkpoint and the trainer's Hugging Face export of it; a LoRA run
(llama3, a high learning rate so the adapters move the tokens) writes its adapters and the merged
export. Claims:

* greedy tokens from the DCP step folder (``InferenceSession.from_checkpoint``) equal
  transformers' ``generate(do_sample=False)`` on the exported folder token for token, with and
  without the KV cache; negative control: RoPE positions of the decoded tokens one off
  (``session.position_error``) change them; the full-vocabulary logits equal transformers' to
  1e-5 (fp32, different kernels);
* the same greedy tokens, and the same sampled tokens (seed fixed), on tp=2, fsdp=2 (2 ranks)
  and tp=2 x fsdp=2 (4 ranks); deepseek_v3 on tp=2 too (its MoE needs sequence parallelism: the
  one-token steps are padded to tp);
* the LoRA step folder generates with its adapters: its tokens differ from the base's and equal
  transformers' on the merged export;
* scripts/generate.py prints the completions and writes JSONL; bad input (a missing checkpoint,
  another model's checkpoint, a prompt longer than the context, a pp or cp layout, an unknown flag) is
  one line with exit code 2, the pp layout also through the launcher (before any worker starts).

Sessions run on ranks forked from the launcher's server (tools/forkserver.py), transformers in
this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.hf_models import deepseek_v3_config, hf_model, llama_config, randomize_hf_
from tools.forkserver import run_distributed, run_train

from .generate_ranks import CONFIGS, NEW, PROMPTS, _args, _layouts, _one_process
from .helpers import ROOT, _env, run_forked

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")

TRAIN = [
    "--model.n_layers", "2", "--training.seq_len", "32", "--training.global_batch_size", "2",
    "--training.local_batch_size", "2", "--training.steps", "2", "--lr_scheduler.warmup_steps", "1",
    "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
    "--checkpoint.last_save_in_hf", "true", "--checkpoint.initial_load_in_hf", "true",
]  # fmt: skip
GENERATE = os.path.join(ROOT, "scripts", "generate.py")


def _hf_source(name: str):
    if name == "llama3":
        return hf_model(llama_config(num_hidden_layers=2), seed=1)
    if name == "deepseek_v3":
        return hf_model(deepseek_v3_config(num_hidden_layers=2, max_position_embeddings=2048), seed=1)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=8, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=2048,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    randomize_hf_(model, 1)
    return model.float().eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    out = {}
    for name in CONFIGS:
        base = root / f"{name}-hf"
        _hf_source(name).save_pretrained(base)
        run = root / name
        res = run_forked(
            1, "--config", CONFIGS[name], *TRAIN, "--checkpoint.initial_load_path", str(base),
            "--job.dump_folder", str(run),
        )  # fmt: skip
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        out[name] = run / "checkpoint"
    base = root / "llama3-hf"
    lora = root / "lora"
    res = run_forked(
        1, "--config", "llama3.toml", *TRAIN, "--checkpoint.initial_load_path", str(base), "--model.converters",
        "lora", "--optimizer.lr", "0.05", "--job.dump_folder", str(lora),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out["lora"] = lora / "checkpoint"
    out["base"] = base
    return out


@pytest.fixture(scope="module")
def single(runs):
    return run_distributed(_one_process, 1, runs, timeout=300)[0]


def _transformers(folder, eos) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).float().eval()
    outs = []
    for p in PROMPTS:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=list(eos), pad_token_id=0
            )[0, len(p) :].tolist()
        outs.append([t for t in ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]])
    return outs, model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers_on_the_export(runs, single, name):
    got = single[name]
    want, model = _transformers(runs[name] / "step-2-hf", got["eos"])
    assert got["cached"] == want
    assert got["uncached"] == want
    assert got["off_by_one"] != want  # negative control: the decoded tokens' positions one off
    with torch.no_grad():
        ref = model(torch.tensor([PROMPTS[0]])).logits.float()
    torch.testing.assert_close(torch.from_numpy(got["logits"]), ref, rtol=1e-5, atol=1e-5)
    assert all(len(t) == NEW for t in want), "a completion ended early: the comparison would be short"


def test_layouts_generate_the_same_tokens(runs, single):
    two = run_distributed(
        _layouts, 2, runs,
        [("llama3", ["--parallelism.tp", "2"], True), ("llama3", ["--parallelism.dp_shard", "2"], True),
         ("deepseek_v3", ["--parallelism.tp", "2"], False)],
        timeout=300,
    )  # fmt: skip
    four = run_distributed(
        _layouts, 4, runs, [("llama3", ["--parallelism.tp", "2", "--parallelism.dp_shard", "2"], True)], timeout=300
    )
    llama, deepseek = single["llama3"], single["deepseek_v3"]
    for ranks, want in ((two, [llama, llama, deepseek]), (four, [llama])):
        for per_rank in ranks:
            for (greedy, sampled), ref in zip(per_rank, want):
                assert greedy == ref["cached"]
                assert sampled in (None, ref["sampled"])
    assert llama["sampled"] != llama["cached"]  # sampling drew other tokens than the arg-max


def test_from_live_leaves_the_model_as_it_found_it(single):
    live, ref = single["live"], single["deepseek_v3"]
    assert live["kept"]  # train/eval mode per module, RNG, buffers (MoE counters), weights
    assert live["tokens"] == ref["cached"] and live["sampled"] == ref["sampled"]
    assert (live["logits"] == ref["logits"]).all()  # the same kernels on the same weights: bitwise
    first, stopped = live["stop_at"]
    assert stopped == first[: first.index(first[3])]  # a stop id ends the completion, left out


def test_lora_generates_with_its_adapters(runs, single):
    want, _ = _transformers(runs["lora"] / "step-2-hf", single["llama3"]["eos"])
    assert single["lora"] == want
    assert single["lora"] != single["base"]


def test_generate_script_prints_and_writes(runs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The cat"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")  # fmt: skip
    out = tmp_path / "out.jsonl"
    argv = _args("llama3", "--checkpoint", str(runs["llama3"]), "--prompt", "hi", "--chat", "--prompts_file", str(prompts),
                 "--max_new_tokens", "5", "--output", str(out), "--parallelism.tp", "2")  # fmt: skip
    res = run_train(2, argv, env=_env(), cwd=ROOT, timeout=300, script=GENERATE)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("prompt") for r in rows] == ["hi", "The cat", None]
    assert rows[0]["prompt_tokens"] == rows[2]["prompt_tokens"]  # --chat: a text prompt is one user message
    assert all(len(r["tokens"]) <= 5 for r in rows) and rows[2]["messages"][0]["content"] == "hi"
    assert res.stdout.count("--- prompt:") == 3  # rank 0 only


def _one_line(res, *needles):
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_input_is_one_line(runs, tmp_path):
    ckpt = str(runs["llama3"])

    def bad(nproc, *argv):
        return run_train(nproc, ["--prompt", "hi", *argv], env=_env(), cwd=ROOT, timeout=120, script=GENERATE)

    _one_line(bad(1, *_args("llama3"), "--checkpoint", str(tmp_path / "nope")), "does not exist")
    _one_line(bad(1, *_args("qwen3"), "--checkpoint", ckpt), "lacks", "another model")
    _one_line(bad(1, *_args("llama3", "--model.vocab_size", "4096"), "--checkpoint", ckpt), "shape", "another model")
    _one_line(bad(1, *_args("llama3"), "--checkpoint", ckpt, "--prompt", "x " * 3000), "max_seq_len 2048")
    _one_line(bad(2, *_args("llama3", "--parallelism.pp", "2"), "--checkpoint", ckpt), "pipeline stages")
    _one_line(bad(2, *_args("llama3", "--parallelism.cp", "2"), "--checkpoint", ckpt), "context parallelism")
    _one_line(bad(1, *_args("llama3"), "--checkpoint", ckpt, "--tempreature", "1"), "unknown option --tempreature")
    # the launcher refuses the layout before any worker starts
    cmd = [sys.executable, GENERATE, "--nproc_per_node", "2", *_args("llama3", "--parallelism.pp", "2"),
           "--checkpoint", ckpt, "--prompt", "hi"]  # fmt: skip
    _one_line(subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120), "pipeline stages")

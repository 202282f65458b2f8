"""Exports a transformers / PEFT user opens with nothing else (issue 50, items 2 and 3), end to
end on CPU, fp32.

The source is a Llama 3 Instruct-style Hugging Face folder written here: a random 2-layer
``LlamaForCausalLM`` (hidden 64, context 512, Llama 3.1 rope parameters), an eos list
``[<|end_of_text|>, <|eot_id|>]`` in config.json, a generation_config.json with sampling
defaults (temperature 0.6, top_p 0.9), and the shipped BPE with Llama 3's special tokens and
Meta's chat template (tests/chat_data.py). Two runs of 20 steps on one repeated conversation
(so the model learns to end its turn with ``<|eot_id|>``), sized by the folder
(``model.flavor = 'hf'``) with its tokenizer, one a full fine-tune and one LoRA, each with
``last_save_in_hf``. Claims:

* each export (``step-20-hf``, the merged LoRA folder, the PEFT folder on the source) opened in
  a fresh process that imports only transformers (+ peft): ``AutoTokenizer`` +
  ``apply_chat_template`` give our template's prompt ids, greedy ``generate`` stops at
  ``<|eot_id|>`` and equals our model's greedy tokens; negative control: with the eos the old
  export wrote (``<|end_of_text|>`` alone) generation runs past the turn's end;
* the source's eos list, context length 512, rope parameters and sampling defaults survive the
  fine-tune; the PEFT folder's base is the source's name (not a path of this host) and its
  ``target_modules`` the list of module names;
* ``convert_hf.py lora-peft`` / ``lora-merge`` / ``to-hf`` on the step checkpoints without
  ``--flavor`` (the checkpoint's record) or with ``--hf-config``: the same folders;
* a finished run started again with ``last_save_in_hf`` writes the missing export (bitwise the
  first); SIGTERM at a step writes the exports of that step.

Forked ranks (tools/forkserver.py, bitwise the torchrun runs) for the runs, the conversions in
this process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from tests.chat_data import tokenizer_folder, write_jsonl
from tests.hf_models import hf_model

from .helpers import ROOT, ForkedJob, _env, drill_env, run_forked

pytestmark = pytest.mark.e2e

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MAX_NEW = 12
BOT, EOT_TEXT, EOT = 2048, 2049, 2052  # <|begin_of_text|>, <|end_of_text|>, <|eot_id|> (tests/chat_data.py)
ROPE = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
GENERATION = {"bos_token_id": BOT, "eos_token_id": [EOT_TEXT, EOT], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
PROMPT = [{"role": "user", "content": "hi"}]


def _args(src, chat, run, *extra):
    return [
        "--config", "llama3.toml", "--training.seq_len", "64", "--training.global_batch_size", "8",
        "--training.local_batch_size", "8", "--metrics.log_freq", "10", "--metrics.enable_tensorboard", "false",
        "--model.flavor", "hf", "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", str(src),
        "--model.tokenizer_path", str(src), "--training.dataset", "chat", "--training.dataset_path", str(chat),
        "--training.chat_packing", "padded", "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "true",
        "--checkpoint.interval", "20", "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32",
        "--job.dump_folder", str(run), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("exports")
    src = root / "Llama-3-Instruct-tiny"
    tokenizer_folder(src, "llama3")  # vocabulary 2053
    config = LlamaConfig(
        vocab_size=2053, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512, rope_parameters=ROPE,
        bos_token_id=BOT, eos_token_id=[EOT_TEXT, EOT],
    )  # fmt: skip
    hf_model(config).save_pretrained(src)
    (src / "generation_config.json").write_text(json.dumps(GENERATION))
    chat = write_jsonl(root / "chat.jsonl", [[*PROMPT, {"role": "assistant", "content": "yo yo"}]] * 64)
    out = {"src": src, "chat": chat}
    for name, extra in (("full", ["--optimizer.lr", "1e-2"]), ("lora", ["--optimizer.lr", "3e-2", "--model.converters", "lora"])):  # fmt: skip
        run = root / name
        res = run_forked(1, *_args(src, chat, run, "--training.steps", "20", *extra))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        out[name] = run
    return out


_GENERATE = r"""
import json, sys
import torch, transformers as t
out = []
prompt, max_new, old_eos = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for folder, peft_dir in json.loads(sys.argv[1]):
    tok = t.AutoTokenizer.from_pretrained(peft_dir or folder)
    model = t.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if peft_dir:
        import peft
        model = peft.PeftModel.from_pretrained(model, peft_dir)
    ids = tok.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    gen = lambda **kw: model.generate(ids, max_new_tokens=max_new, do_sample=False, **kw)[0, ids.shape[1]:].tolist()
    g = t.GenerationConfig.from_pretrained(folder)
    out.append({"prompt": ids[0].tolist(), "new": gen(), "old_eos": gen(eos_token_id=old_eos),
                "generation": {"eos": g.eos_token_id, "temperature": g.temperature, "top_p": g.top_p}})
mods = sorted(m for m in sys.modules if m.split(".")[0] in ("trainer", "models", "tools", "tests"))
print(json.dumps({"results": out, "project_modules": mods}))
"""


@pytest.fixture(scope="module")
def generated(runs) -> dict:
    """Greedy generation on every export in one fresh process that imports only transformers
    (+ peft), started outside the repository (nothing of ours on its path)."""
    ck_full, ck_lora = runs["full"] / "checkpoint", runs["lora"] / "checkpoint"
    jobs = {
        "full": (ck_full / "step-20-hf", ""),
        "merged": (ck_lora / "step-20-hf", ""),
        "peft": (runs["src"], ck_lora / "step-20-peft"),
    }
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    args = [json.dumps([[str(a), str(b)] for a, b in jobs.values()]), json.dumps(PROMPT), str(MAX_NEW), str(EOT_TEXT)]
    res = subprocess.run(
        [sys.executable, "-c", _GENERATE, *args], capture_output=True, text=True, env=env, cwd=str(runs["src"]),
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["project_modules"] == [], got["project_modules"]
    return dict(zip(jobs, got["results"]))


def _ours(runs, name: str):
    """Our model of run ``name`` at step 20 (a LoRA step holds the adapters: the base from the
    source folder), and our template's prompt ids."""
    from safetensors.torch import load_file

    from models.parallel.lora import LoRAOptions, convert_to_lora, is_adapter_key
    from models.registry import build_model, get_hf_adapter
    from trainer.checkpoint.dcp import load_checkpoint
    from trainer.data.chat_template import load_chat_template
    from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

    src = runs["src"]
    config = json.loads((src / "config.json").read_text())
    model = build_model("llama3", "hf", device="cpu", hf_config=config, max_seq_len=64)
    base = get_hf_adapter("llama3", model.args).from_hf(load_file(str(src / "model.safetensors")))
    model.load_state_dict(base, strict=False)
    select = None
    if name == "lora":
        convert_to_lora(model, LoRAOptions())
        select = is_adapter_key
    load_checkpoint(str(runs[name] / "checkpoint" / "step-20"), [model], select=select)
    tok = load_tokenizer(str(src))
    prompt, _ = tok.encode_chat(load_chat_template(tok, DEFAULT_TOKENIZER_PATH).render(PROMPT, True))
    return model.eval(), prompt


@torch.no_grad()
def _greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(MAX_NEW):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        if ids[-1] == EOT:
            break
    return ids[len(prompt) :]


def _check_generation(got: dict, ours: list[int], prompt: list[int]) -> None:
    assert got["prompt"] == prompt
    assert got["new"] == ours and got["new"][-1] == EOT and len(got["new"]) < MAX_NEW, (got, ours)
    # negative control: with the eos the old export wrote, generation runs past the turn's end
    assert got["old_eos"][: len(ours)] == ours and len(got["old_eos"]) > len(ours), got["old_eos"]
    assert got["generation"] == {"eos": [EOT_TEXT, EOT], "temperature": 0.6, "top_p": 0.9}


def _config_survives(folder) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == [EOT_TEXT, EOT] and config["bos_token_id"] == BOT
    assert config["max_position_embeddings"] == 512 and config["rope_parameters"] == ROPE
    assert json.loads((folder / "generation_config.json").read_text()) == GENERATION


def test_full_fine_tune_export_opens_alone(runs, generated):
    _config_survives(runs["full"] / "checkpoint" / "step-20-hf")
    model, prompt = _ours(runs, "full")
    _check_generation(generated["full"], _greedy(model, prompt), prompt)


def test_lora_exports_open_alone(runs, generated):
    ck = runs["lora"] / "checkpoint"
    _config_survives(ck / "step-20-hf")
    adapter = json.loads((ck / "step-20-peft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == runs["src"].name
    assert adapter["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(ck / "step-20-peft"))
    model, prompt = _ours(runs, "lora")
    ours = _greedy(model, prompt)
    _check_generation(generated["merged"], ours, prompt)
    _check_generation(generated["peft"], ours, prompt)


def _same_folder(a, b) -> None:
    from safetensors.torch import load_file

    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        if name.endswith(".safetensors"):
            x, y = load_file(str(a / name)), load_file(str(b / name))
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_convert_hf_from_the_checkpoint_record_or_hf_config(runs, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "scripts" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lora_step, full_step = (str(runs[n] / "checkpoint" / "step-20") for n in ("lora", "full"))
    ck = runs["lora"] / "checkpoint"
    # no --model, no --flavor: the checkpoint's record
    assert module.main(["lora-peft", lora_step, str(tmp_path / "peft")]) == 0
    _same_folder(ck / "step-20-peft", tmp_path / "peft")
    assert module.main(["lora-merge", lora_step, str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    _same_folder(ck / "step-20-hf", tmp_path / "merged")
    assert module.main(["to-hf", full_step, str(tmp_path / "full"), "--dtype", "float32"]) == 0
    _same_folder(runs["full"] / "checkpoint" / "step-20-hf", tmp_path / "full")
    # --hf-config: every size, config fields and generation defaults from the folder
    hf = ["--hf-config", str(runs["src"]), "--dtype", "float32"]
    assert module.main(["lora-merge", lora_step, str(tmp_path / "merged2"), *hf]) == 0
    _same_folder(ck / "step-20-hf", tmp_path / "merged2")
    capsys.readouterr()
    assert module.main(["lora-peft", lora_step, str(tmp_path / "bad"), "--flavor", "8B", *hf]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--flavor or --hf-config, not both" in err[0], err


def test_finished_run_rerun_writes_the_missing_export(runs, tmp_path):
    run = tmp_path / "full"
    shutil.copytree(runs["full"], run)
    shutil.rmtree(run / "checkpoint" / "step-20-hf")
    res = run_forked(1, *_args(runs["src"], runs["chat"], run, "--training.steps", "20", "--optimizer.lr", "1e-2"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "nothing to train" in res.stdout and "wrote Hugging Face folder" in res.stdout
    _same_folder(runs["full"] / "checkpoint" / "step-20-hf", run / "checkpoint" / "step-20-hf")


def test_sigterm_stop_writes_the_exports(runs, tmp_path):
    run = tmp_path / "stopped"
    args = _args(runs["src"], runs["chat"], run, "--training.steps", "3", "--model.converters", "lora")
    job = ForkedJob(1, *args, env=drill_env("last"))
    try:
        assert job.wait_for_output("step 1/3", 120), job.output[-3000:]
        job.signal(signal.SIGTERM)
        code = job.wait(timeout=120)
    finally:
        job.close()
    assert code == 143, job.output[-3000:]
    names = sorted(os.listdir(run / "checkpoint"))
    stopped = int(names[0].split("-")[1])
    assert names == [f"step-{stopped}", f"step-{stopped}-hf", f"step-{stopped}-peft"] and stopped < 3, names
    assert {"tokenizer.json", "generation_config.json"} <= set(os.listdir(run / "checkpoint" / names[1]))

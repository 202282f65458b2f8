"""The ranks of tests/e2e/test_generate.py (forked from the launcher's server): sessions built
from the fixture's checkpoints, their tokens returned. Kept apart from the test module so that a
rank imports neither transformers nor pytest's plugins."""

from __future__ import annotations

import torch

NEW = 12
PROMPTS = [[5, 17, 300, 41, 9], [7, 8, 9], [100, 200, 300, 400, 500]]
SAMPLE = dict(temperature=0.8, top_p=0.9, seed=3)
CONFIGS = {"llama3": "llama3.toml", "qwen3": "qwen3.toml", "deepseek_v3": "deepseek_v3.toml"}


def _args(name: str, *extra: str) -> list[str]:
    return ["--config", CONFIGS[name], "--model.n_layers", "2", *extra]


def _session(name, ckpt, *overrides):
    from trainer.config import load_config
    from trainer.inference.session import InferenceSession

    return InferenceSession.from_checkpoint(load_config(_args(name, *overrides)), str(ckpt))


def _one_process(rank, world, runs):
    """Everything a single process generates (the references of the layouts)."""
    got = {}
    for name in CONFIGS:
        s = _session(name, runs[name] / "step-2")
        got[name] = {
            "cached": s.generate(PROMPTS, NEW),
            "uncached": s.generate(PROMPTS, NEW, use_cache=False),
            "sampled": s.generate(PROMPTS, NEW, **SAMPLE),
            "logits": s.logits(torch.tensor([PROMPTS[0]])).numpy(),  # a tensor would travel by file descriptor
            "eos": s.eos_ids,
        }
        s.position_error = 1
        got[name]["off_by_one"] = s.generate(PROMPTS, NEW)
    lora = ["--model.converters", "lora", "--checkpoint.initial_load_in_hf", "true"]
    lora += ["--checkpoint.initial_load_path", str(runs["base"])]  # the LoRA run's own config
    got["lora"] = _session("llama3", runs["lora"] / "step-2", *lora).generate(PROMPTS, NEW)
    got["base"] = _session("llama3", runs["base"]).generate(PROMPTS, NEW)
    return got


def _layouts(rank, world, runs, layouts):
    """Greedy and sampled tokens of each layout (``name``, config overrides), on every rank."""
    out = []
    for name, overrides in layouts:
        s = _session(name, runs[name] / "step-2", *overrides)
        out.append((s.generate(PROMPTS, NEW), s.generate(PROMPTS, NEW, **SAMPLE)))
    return out

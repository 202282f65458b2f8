"""The ranks of tests/e2e/test_generate.py (forked from the launcher's server): sessions built
from the fixture's checkpoints, their tokens returned. Kept apart from the test module so that a
rank imports neither transformers nor pytest's plugins."""

from __future__ import annotations

import torch

NEW = 8
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
    got["live"] = _live(_session("deepseek_v3", runs["deepseek_v3"] / "step-2"))
    lora = ["--model.converters", "lora", "--checkpoint.initial_load_in_hf", "true"]
    lora += ["--checkpoint.initial_load_path", str(runs["base"])]  # the LoRA run's own config
    got["lora"] = _session("llama3", runs["lora"] / "step-2", *lora).generate(PROMPTS, NEW)
    got["base"] = _session("llama3", runs["base"]).generate(PROMPTS, NEW)
    return got


def _layouts(rank, world, runs, layouts):
    """Greedy and (``sampled``) sampled tokens of each layout (``name``, config overrides,
    sampled), on every rank."""
    out = []
    for name, overrides, sampled in layouts:
        s = _session(name, runs[name] / "step-2", *overrides)
        out.append((s.generate(PROMPTS, NEW), s.generate(PROMPTS, NEW, **SAMPLE) if sampled else None))
    return out


def _live(session):
    """``from_live`` over a model in training mode (MoE counters mid-step, RNG drawn from):
    its tokens, and whether the mode, the RNG and every buffer and parameter came back as
    they were."""
    from trainer.inference.session import InferenceSession

    model = session.model
    model.train()
    model.layers["1"].attention.eval()  # mixed modes come back module by module
    for moe in model.moe_layers():
        moe.tokens_per_expert.add_(7)
    torch.manual_seed(11)
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    modes = {n: m.training for n, m in model.named_modules()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    live = InferenceSession.from_live([model], session.tokenizer, session.plan, session.device, eos_ids=session.eos_ids)
    tokens = live.generate(PROMPTS, NEW, stop_ids=())
    sampled = live.generate(PROMPTS, NEW, **SAMPLE)
    logits = live.logits(torch.tensor(PROMPTS[:1]))
    kept = (
        modes == {n: m.training for n, m in model.named_modules()}
        and torch.equal(rng, torch.get_rng_state())
        and all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
        and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    )
    first = tokens[0]
    stopped = live.generate(PROMPTS[:1], NEW, stop_ids=[first[3]])[0]
    return {"tokens": tokens, "sampled": sampled, "logits": logits.numpy(), "kept": kept, "stop_at": (first, stopped)}

"""The real-size configs are valid for the world sizes they are written for: the job plan
(degrees, model rules, batch, pipeline stages) and, for two of them, a full dry run that shards
the meta-device model on the fake backend for one rank."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.plan import plan_job
from trainer.plan_report import dry_run

WORLD = {"llama3_8b": 8, "llama3_70b": 64, "deepseek_v3_16b": 8, "deepseek_v3_671b": 512}


@pytest.mark.parametrize("name", sorted(WORLD))
def test_real_configs_fit_their_world(name):
    cfg = load_config(["--config", f"{name}.toml"])
    plan = plan_job(cfg, WORLD[name], tokenizer_vocab=2048)
    assert plan.parallel_dims.degrees.world_size == WORLD[name]
    assert plan.batch.global_batch_size == cfg.training.global_batch_size
    assert (plan.stages is not None) == (plan.parallel_dims.pp > 1)


@pytest.mark.parametrize("name, rank", [("llama3_8b", 3), ("deepseek_v3_16b", 5)])
def test_dry_run_shards_the_real_model(name, rank):
    cfg = load_config(["--config", f"{name}.toml"])
    plan = plan_job(cfg, WORLD[name], tokenizer_vocab=2048)
    result = dry_run(plan, rank)
    # FSDP over all 8 ranks (and EP over 8 for the experts): each rank holds ~1/8
    local, total = result["local_params"], result["model_params"]
    assert abs(local * WORLD[name] / total - 1) < 0.01, (local, total)
    assert result["memory_gib"]["total"] == pytest.approx(16 * local / 2**30)

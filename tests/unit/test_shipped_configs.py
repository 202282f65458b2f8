"""The real-size configs are valid for the world sizes they are written for: degrees, model
rules, and (for two of them) a full dry run that shards the meta-device model on the fake
backend for one rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from models.parallelize import check_model_fits_layout, parallelize_model
from models.registry import build_model
from trainer.train import _parallelize_options, model_overrides, parallel_dims_from_config
from trainer.config import load_config

WORLD = {"llama3_8b": 8, "llama3_70b": 64, "deepseek_v3_16b": 8, "deepseek_v3_671b": 512}


@pytest.mark.parametrize("name", sorted(WORLD))
def test_real_configs_fit_their_world(name):
    cfg = load_config(["--config", f"{name}.toml"])
    pd = parallel_dims_from_config(cfg, WORLD[name])
    model = build_model(cfg.model.name, cfg.model.flavor, device="meta", **model_overrides(cfg, 2048))
    check_model_fits_layout(model.args, pd, cfg.training.seq_len, cfg.parallelism.enable_sequence_parallel)
    pd.check_model(global_batch_size=cfg.training.global_batch_size,
                   local_batch_size=cfg.training.local_batch_size)


@pytest.mark.parametrize("name, rank", [("llama3_8b", 3), ("deepseek_v3_16b", 5)])
def test_dry_run_shards_the_real_model(name, rank):
    cfg = load_config(["--config", f"{name}.toml"])
    world = WORLD[name]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        pd = parallel_dims_from_config(cfg, world)
        pd.build_mesh("cpu")
        model = build_model(cfg.model.name, cfg.model.flavor, device="meta", **model_overrides(cfg, 2048))
        total = sum(p.numel() for p in model.parameters())
        parallelize_model(model, pd, _parallelize_options(cfg))
        local = sum(p.to_local().numel() for p in model.parameters())
        # FSDP over all 8 ranks (and EP over 8 for the experts): each rank holds ~1/8
        assert abs(local * world / total - 1) < 0.01, (local, total)
    finally:
        dist.destroy_process_group()

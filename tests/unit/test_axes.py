"""parallel_dims/axes.py is the one list of parallel axes: everything else is derived from it."""

from __future__ import annotations

import dataclasses

from parallel_dims import ParallelDims, validate_degrees
from parallel_dims.__main__ import _parse
from parallel_dims.axes import AXES, DEGREE_NAMES, PROCESS_AXES
from parallel_dims.layout import Degrees
from trainer.config import PARALLELISM_ALIASES, Parallelism, load_config
from trainer.trainer import parallel_dims_from_config


def test_every_consumer_lists_the_table_axes_in_order():
    assert [f.name for f in dataclasses.fields(Degrees)] == [*DEGREE_NAMES, "world_size"]
    degree_fields = [f for f in dataclasses.fields(Parallelism) if f.name.endswith("_degree")]
    assert [f.name for f in degree_fields] == [a.config_key for a in AXES]
    assert [f.default for f in degree_fields] == [a.default for a in AXES]
    # each axis by its name and by its layout-spec aliases (fsdp for dp_shard), both from the table
    assert PARALLELISM_ALIASES == {n: a.config_key for a in AXES for n in (a.name, *a.layout_aliases)}
    assert PARALLELISM_ALIASES["fsdp"] == "data_parallel_shard_degree"
    assert PROCESS_AXES == ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    # one describe-CLI flag per axis (unset flags take the table's default, or the config's)
    args = _parse(["--world-size", "8", *[x for a in AXES for x in (a.cli_flag, "2")]])
    assert {n: getattr(args, n) for n in DEGREE_NAMES} == {a.name: 2 for a in AXES}


def test_degrees_travel_from_config_to_parallel_dims():
    cfg = load_config(["--config", "deepseek_v3.toml", "--parallelism.tp", "2", "--parallelism.ep", "2"])
    pd = parallel_dims_from_config(cfg, 8)
    assert pd.degrees == validate_degrees(world_size=8, tp=2, ep=2)
    # positional construction keeps torchtitan's order (the table's, then world_size)
    assert ParallelDims(1, -1, 1, 2, 1, 2, 1, 8).degrees == pd.degrees

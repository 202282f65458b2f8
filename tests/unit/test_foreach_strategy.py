"""The per-element sharding memo (trainer/optim/foreach_strategy.py): AdamW's foreach step over
FSDP x TP DTensors is bitwise the same with and without it, and DTensor's strategy expansions
no longer grow with the number of blocks.

One process on torch's fake backend (rank 0 of a 2 x 2 dp_shard x tp world): the parameters are
placed exactly as a 4-rank job places them (TP colwise/rowwise, then FSDP per block, so the
colwise weights are ``_StridedShard`` on dp_shard, the specs the propagator writes a flag to
after the expansion), and the optimizer's update is local arithmetic, which the fake backend
leaves real. Each run starts from empty caches (DTensor's and the memo)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tools.planner.measure import forget_sharding_caches
from trainer.optim import foreach_strategy

pytestmark = pytest.mark.unit
needs_it = pytest.mark.skipif(
    not foreach_strategy.supported(), reason="this torch's DTensor propagation is not torch 2.13's form"
)


def test_the_pinned_torch_gets_it():
    """The skip below is for other torch versions only: on the torch this project pins, both
    functions have the form the module wraps."""
    if torch.__version__.split("+")[0].startswith("2.13."):
        assert foreach_strategy.supported()


DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(DIM))
        self.wq = nn.Linear(DIM, 2 * DIM, bias=False)
        self.wo = nn.Linear(2 * DIM, DIM, bias=False)


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    finally:
        foreach_strategy.uninstall()
        forget_sharding_caches()
        dist.destroy_process_group()


def _first_step(mesh, n_blocks: int, memo: bool) -> dict:
    """One AdamW (foreach) step of a fresh ``n_blocks`` model: the parameters' local shards before
    and after it, their placements, how many full-mesh expansions DTensor ran, and the memo's
    counters."""
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops import utils
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    foreach_strategy.uninstall()
    forget_sharding_caches()
    torch.manual_seed(0)
    model = nn.ModuleList(Block() for _ in range(n_blocks))
    for block in model:
        parallelize_module(block, mesh["tp"], {"wq": ColwiseParallel(), "wo": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp_shard"])
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    before = [p.to_local().detach().clone() for p in params]
    gen = torch.Generator().manual_seed(1)
    for p in params:
        local = torch.randn(p.to_local().shape, generator=gen)
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    expansions = [0]
    torch_expand = utils.expand_to_full_mesh_op_strategy

    @functools.wraps(torch_expand)  # torch's signature, which install checks
    def counting(*args, **kwargs):
        expansions[0] += 1
        return torch_expand(*args, **kwargs)

    utils.expand_to_full_mesh_op_strategy = counting
    try:
        if memo:
            assert foreach_strategy.install()
        torch.optim.AdamW(params, lr=1e-2, foreach=True).step()
        stats = foreach_strategy.stats()
    finally:
        foreach_strategy.uninstall()
        utils.expand_to_full_mesh_op_strategy = torch_expand
    after = [p.to_local().detach().clone() for p in params]
    placements = [p.placements for p in params]
    return dict(before=before, after=after, placements=placements, expansions=expansions[0], stats=stats)


@needs_it
def test_the_update_is_bitwise_and_expansions_stop_growing_with_the_blocks(mesh):
    from torch.distributed.tensor.placement_types import _StridedShard

    plain_1, plain_4 = _first_step(mesh, 1, memo=False), _first_step(mesh, 4, memo=False)
    memo_1, memo_4 = _first_step(mesh, 1, memo=True), _first_step(mesh, 4, memo=True)

    # the specs the propagator writes a flag to after the expansion are among them
    assert any(isinstance(p, _StridedShard) for pl in memo_4["placements"] for p in pl)
    # the same kernels on the same shards: bitwise; and the step did change every parameter
    for plain, memo in ((plain_1, memo_1), (plain_4, memo_4)):
        assert len(memo["after"]) == len(plain["after"])
        for a, b in zip(memo["after"], plain["after"]):
            assert torch.equal(a, b)
        for a, b in zip(memo["after"], memo["before"]):
            assert not torch.equal(a, b)
    assert len(memo_4["after"]) == 12

    # without the memo every block is priced again (the control: the count does grow) ...
    assert plain_4["expansions"] >= plain_1["expansions"] + 3 * 3, (plain_1["expansions"], plain_4["expansions"])
    # ... with it, once per kind of parameter, whatever the number of blocks
    assert memo_4["expansions"] == memo_1["expansions"] <= plain_1["expansions"]
    assert memo_4["stats"]["misses"] == memo_4["expansions"] and memo_4["stats"]["hits"] > 0


@pytest.fixture
def torch_as_is():
    """An earlier test in this process may have built an optimizer, which installed it."""
    foreach_strategy.uninstall()
    yield
    foreach_strategy.uninstall()


@needs_it
def test_switched_off_by_the_environment(monkeypatch, torch_as_is):
    monkeypatch.setenv(foreach_strategy.ENV, "0")
    assert foreach_strategy.install() is False
    from torch.distributed.tensor._ops import utils

    assert utils.expand_to_full_mesh_op_strategy.__module__ == utils.__name__


def _strategy(mesh, flag):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    meta = TensorMeta(torch.Size([8, 8]), (8, 1), torch.float32)

    def spec(strided: bool):
        placements = (_StridedShard(0, split_factor=2), Shard(0)) if strided else (Replicate(), Shard(1))
        return DTensorSpec(mesh, placements, tensor_meta=meta, use_strided_shard_as_shard_order=flag)

    return OpStrategy(
        [
            OpSpec(spec(True), [spec(True), spec(False)], [[0.0], [0.0]]),
            OpSpec((spec(True), None), [spec(False), spec(True)], [[0.0], [0.0]]),
            OpSpec(spec(False), [spec(False), spec(False)], [[0.0], [0.0]]),
        ]
    )


def _specs(strategy) -> list:
    out = []
    for s in strategy.strategies:
        outs = s.output_specs if isinstance(s.output_specs, tuple) else (s.output_specs,)
        for spec in (*outs, *s.input_specs):
            out.append(None if spec is None else (spec.use_strided_shard_as_shard_order, spec.shard_order))
    return out


@needs_it
@pytest.mark.parametrize("arg_flags", [(False, False), (True, False), (False, None), (None, None)])
def test_the_strided_flag_is_torchs_and_the_memos_specs_stay_as_expanded(mesh, arg_flags):
    """The flag fix-up (worked out once per op, on copies) leaves every spec as torch's own
    ``_propagate_use_strided_shard_flag`` does, and the OpSpecs it was handed unedited."""
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor._op_schema import OpSchema

    args = tuple(_strategy(mesh, f).strategies[0].output_specs for f in arg_flags)
    schema = OpSchema(torch.ops.aten.mul.Tensor, args, {})
    changes = []
    for strategy_flag in (True, False):
        torch_side, ours = _strategy(mesh, strategy_flag), _strategy(mesh, strategy_flag)
        handed = list(ours.strategies)
        before = _specs(ours)
        _sharding_prop._propagate_use_strided_shard_flag(torch_side, schema)
        foreach_strategy._flag_once_per_op(ours, schema)
        assert _specs(ours) == _specs(torch_side)
        # the OpSpecs handed in (the memo's) kept their flags: a changed one was replaced
        assert _specs(type(ours)(handed)) == before
        changed = _specs(torch_side) != before
        assert changed == any(a is not b for a, b in zip(ours.strategies, handed))
        changes.append(changed)
    # the inputs' flag (None reads as True) differs from one of the two expansions' flags
    assert any(changes)
    # the negative control: with the inputs' flags False, torch does change specs expanded as True
    torch_side = _strategy(mesh, True)
    _sharding_prop._propagate_use_strided_shard_flag(torch_side, OpSchema(torch.ops.aten.mul.Tensor, args[:1], {}))
    assert (_specs(torch_side) != _specs(_strategy(mesh, True))) == (arg_flags[0] is False)


@needs_it
def test_another_torchs_fix_up_leaves_torch_as_it_is(monkeypatch, torch_as_is):
    """A torch whose flag fix-up has another form (one the memo's shared OpSpecs could be edited
    by) gets neither change."""
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor._ops import utils

    torch_expand = utils.expand_to_full_mesh_op_strategy
    monkeypatch.setattr(_sharding_prop, "_propagate_use_strided_shard_flag", lambda strategy, schema, mesh: None)
    assert foreach_strategy.supported() is False and foreach_strategy.install() is False
    assert utils.expand_to_full_mesh_op_strategy is torch_expand

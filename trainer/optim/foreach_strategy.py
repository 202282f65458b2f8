"""One DTensor sharding expansion per distinct tensor of a foreach op, not one per tensor.

The first time DTensor (torch 2.13) meets a foreach op over DTensors (AdamW's
``_foreach_lerp_``, ``_foreach_addcdiv_``, ... and clipping's ``_foreach_norm`` and
``_foreach_mul_``, trainer/optim/grad_clip.py), it prices the op element by element:
``single_dim_strategy``'s ``expanded_foreach_strategy`` turns each element into its own op
schema and calls ``expand_to_full_mesh_op_strategy`` for it, which enumerates every combination
of the op's single-dimension strategies over the mesh dimensions and the redistribution cost of
each. The propagator caches the result for the whole list (its LRU on the list's op schema), but
not per element, so the first step expands every parameter separately, although a model's
parameters come in a handful of kinds: every block's ``wq`` has the same shape and placements as
every other block's, and the same per-element schema gives the same strategy.

:func:`install` wraps ``expand_to_full_mesh_op_strategy`` in a memo keyed on its arguments: the
element's op schema (the op, and the mesh, placements, shard order, shape, stride and dtype of
every input: what DTensor's own caches key on), the single-dimension strategies and the flags.
A call with a validity callback is not memoized (a callable is no key). Each hit returns a fresh
copy of the cached strategy's specs: after the expansion the propagator sets
``use_strided_shard_as_shard_order`` on the specs it selects (``_propagate_use_strided_shard_flag``,
from the whole list's inputs), a field spec equality ignores, so two elements must not share a
spec object.

The wrapper reaches the element path because ``single_dim_strategy`` (and the decomposition
path, ``_decompositions``) import the function from its module at each call; op strategies that
imported it at their own import keep the original, and the propagator's per-op caches already
serve them. Measured (Intel Xeon AMX host, forked 4-rank llama3 tp=2 x fsdp=2, 2 blocks, 3
steps, CPU seconds per rank): 1.56 -> 1.39, 93 expansions and 98 hits; docs/optimizers.md has
the scaling with the number of blocks. ``MESHTRAIN_FOREACH_STRATEGY_MEMO=0`` leaves torch as it
is (to rule the memo out when a sharding question comes up);
tests/unit/test_foreach_strategy.py proves that the optimizer's update is bitwise the same with
and without it and that the number of expansions no longer grows with the number of blocks.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from copy import copy
from typing import Any

ENV = "MESHTRAIN_FOREACH_STRATEGY_MEMO"
MAX_ENTRIES = 8192  # distinct (op, element schema) pairs; a model has tens of parameter kinds

_lock = threading.Lock()
_state: dict[str, Any] = {"original": None, "memo": OrderedDict(), "hits": 0, "misses": 0}


def _utils():
    from torch.distributed.tensor._ops import utils

    return utils


def _key(mesh, op_schema, strategies, kwargs: dict) -> tuple | None:
    """A hashable key for one call, or None when an argument cannot be one (a SymInt shape
    under tracing, a callback)."""
    if kwargs.get("is_valid_strategy_cb") is not None:
        return None
    try:
        flags = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
        # id(mesh): meshes compare by value, and a process that runs one job after another (the
        # planner's measurements, in-process tests) must not get specs holding an earlier job's
        # mesh and process groups; the key keeps that mesh alive, so its id is not reused
        key = (id(mesh), mesh, op_schema, tuple(tuple(s) for s in strategies), flags)
        hash(key)
    except TypeError:
        return None
    return key


def _strided(spec) -> bool:
    if spec is None:
        return False
    if isinstance(spec, (tuple, list)):
        return any(_strided(s) for s in spec)
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in spec.placements)


def _spec_copy(spec):
    if spec is None:
        return None
    if isinstance(spec, (tuple, list)):
        return type(spec)(_spec_copy(s) for s in spec)
    return copy(spec)


def _entry(strategy) -> tuple:
    """What the memo keeps: the strategy, and which of its OpSpecs hold a ``_StridedShard`` spec
    (the only specs the propagator writes to afterwards, ``_propagate_use_strided_shard_flag``)."""
    return strategy, [_strided(s.output_specs) or _strided(s.input_specs) for s in strategy.strategies]


def _fresh(entry):
    """The cached strategy, with its own copies of the specs the propagator may write to; the
    rest is shared, as DTensor's own caches share their specs between calls."""
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    strategy, written = entry
    if not any(written):
        return strategy
    return OpStrategy(
        [
            OpSpec(_spec_copy(s.output_specs), _spec_copy(s.input_specs), s.redistribute_cost) if w else s
            for s, w in zip(strategy.strategies, written)
        ]
    )


def _memoized(mesh, op_schema, single_mesh_dim_strategies, **kwargs):
    original = _state["original"]
    key = _key(mesh, op_schema, single_mesh_dim_strategies, kwargs)
    if key is None:
        return original(mesh, op_schema, single_mesh_dim_strategies, **kwargs)
    memo: OrderedDict = _state["memo"]
    with _lock:
        cached = memo.get(key)
        if cached is not None:
            memo.move_to_end(key)
            _state["hits"] += 1
    if cached is None:
        cached = _entry(original(mesh, op_schema, single_mesh_dim_strategies, **kwargs))
        with _lock:
            memo[key] = cached
            _state["misses"] += 1
            if len(memo) > MAX_ENTRIES:
                memo.popitem(last=False)
    return _fresh(cached)


def install() -> bool:
    """Wrap DTensor's per-element strategy expansion (once per process; idempotent). False when
    ``MESHTRAIN_FOREACH_STRATEGY_MEMO=0`` or this torch has no such function."""
    if os.environ.get(ENV, "1") == "0":
        return False
    utils = _utils()
    with _lock:
        if _state["original"] is not None:
            return True
        original = getattr(utils, "expand_to_full_mesh_op_strategy", None)
        if original is None:
            return False
        _state["original"] = original
        utils.expand_to_full_mesh_op_strategy = _memoized
    return True


def forget() -> None:
    """Drop the memo (with DTensor's own caches: tools/planner/measure.py forget_sharding_caches):
    its entries hold meshes, and so their process groups, alive."""
    with _lock:
        _state["memo"].clear()


def uninstall() -> None:
    """Put torch's function back and forget the memo (tests)."""
    utils = _utils()
    with _lock:
        if _state["original"] is not None:
            utils.expand_to_full_mesh_op_strategy = _state["original"]
        _state.update(original=None, memo=OrderedDict(), hits=0, misses=0)


def stats() -> dict[str, int]:
    """Expansions run (misses) and served from the memo (hits) since install."""
    with _lock:
        return {"misses": _state["misses"], "hits": _state["hits"], "entries": len(_state["memo"])}

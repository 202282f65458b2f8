"""DTensor's pricing of a foreach op, linear in the length of its list and once per kind of tensor.

The first time DTensor (torch 2.13) meets a foreach op over DTensors (AdamW's
``_foreach_lerp_``, ``_foreach_addcdiv_``, ...: every optimizer step op of the CPU default,
foreach), it prices the op element by element: ``single_dim_strategy``'s
``expanded_foreach_strategy`` turns each element into its own op schema and calls
``expand_to_full_mesh_op_strategy`` for it, which enumerates every combination of the op's
single-dimension strategies over the mesh dimensions and the redistribution cost of each. The
propagator caches the result for the whole list (its LRU on the list's op schema), but not per
element, so the first step expands every parameter separately, although a model's parameters
come in a handful of kinds: every block's ``wq`` has the same shape and placements as every
other block's, and the same per-element schema gives the same strategy. Then, for every element,
``_propagate_use_strided_shard_flag`` reads every input spec of the whole list again
(quadratic in the list's length). Every rank pays both at its first step (a GPU rank too: it is
host work); the tests pay them in every one of their ~1,000 forked ranks.

:func:`install` (trainer/optim/optimizers.py ``build_optimizer`` calls it) changes two things:

* ``expand_to_full_mesh_op_strategy`` gets a memo keyed on its arguments: the element's op
  schema (the op, and the mesh, placements, shard order, shape, stride and dtype of every input:
  what DTensor's own caches key on), the single-dimension strategies and the flags, and the
  mesh object's identity (meshes compare by value; a process that runs one job after another
  must not get specs that hold an earlier job's mesh and process groups). A call with a validity
  callback, or with arguments that cannot be hashed (SymInt shapes under tracing), runs as before.
  Each call gets the cached strategy in a list of its own; the OpSpecs in it are shared, as
  DTensor's own caches share theirs.
* ``_propagate_use_strided_shard_flag`` (after a strategy is produced, every ``_StridedShard``
  spec in it gets the flag the op's ``_StridedShard`` inputs carry) works the flag out once per
  op instead of once per element, and replaces an OpSpec whose specs need another flag with a
  copy instead of editing it, so the memo's OpSpecs stay as expanded.

The memo reaches the element path because ``single_dim_strategy`` (and the decomposition path,
``_decompositions``) import the function from its module at each call; op strategies that
imported it at their own import keep the original, and the propagator's per-op caches already
serve them. Measured (``make bench`` section ``first_step``, docs/benchmarks.md): AdamW's first
step on a tp=2 x fsdp=2 rank, 32 blocks, 3.0 -> 1.0 CPU s; a forked 4-rank llama3 tp=2 x fsdp=2
run of 2 blocks and 3 steps, 1.56 -> 1.39 CPU s a rank. ``MESHTRAIN_FOREACH_STRATEGY_MEMO=0``
leaves torch as it is (to rule this out when a sharding question comes up), as does a torch whose
two functions have another form than 2.13's (:func:`supported`).
tests/unit/test_foreach_strategy.py proves that the optimizer's update is bitwise the same with
and without it, that the number of expansions no longer grows with the number of blocks, and
that the flag comes out as torch's own function sets it.
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
_state: dict[str, Any] = {"original": None, "memo": OrderedDict(), "hits": 0, "misses": 0, "flag_original": None}
# per thread (DTensor's own caches are per thread too): the op schema of the last flag call, its flag
_last_flag = threading.local()


def _utils():
    from torch.distributed.tensor._ops import utils

    return utils


def _sharding_prop():
    from torch.distributed.tensor import _sharding_prop

    return _sharding_prop


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


def _fresh(strategy):
    """The cached strategy in a list of its own: the OpSpecs are shared, as DTensor's own caches
    share theirs between calls, and :func:`_flag_once_per_op` replaces, never edits, one whose
    specs need another flag."""
    from torch.distributed.tensor._op_schema import OpStrategy

    return OpStrategy(list(strategy.strategies))


def _memoized(*args, **kwargs):
    original = _state["original"]
    key = _key(*args, kwargs) if len(args) == 3 else None  # torch 2.13's (mesh, op_schema, strategies)
    if key is None:
        return original(*args, **kwargs)
    memo: OrderedDict = _state["memo"]
    with _lock:
        cached = memo.get(key)
        if cached is not None:
            memo.move_to_end(key)
            _state["hits"] += 1
    if cached is None:
        cached = original(*args, **kwargs)
        with _lock:
            memo[key] = cached
            _state["misses"] += 1
            if len(memo) > MAX_ENTRIES:
                memo.popitem(last=False)
    return _fresh(cached)


def _strided_flag(op_schema) -> bool | None:
    """The ``use_strided_shard_as_shard_order`` the op's ``_StridedShard`` inputs ask of the specs
    it selects (None: no such input), by torch's rule: their common flag, True where they differ."""
    from torch.distributed.tensor.placement_types import _StridedShard

    flag = None
    for spec in op_schema.args_spec:
        if any(isinstance(p, _StridedShard) for p in spec.placements):
            value = spec.use_strided_shard_as_shard_order
            flag = True if flag is not None and flag != value else value
    return flag


def _flagged(spec, flag: bool):
    """``spec``, or a copy of it with ``flag`` where it has a ``_StridedShard`` placement and
    another flag (torch's fix-up, on a copy)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.placement_types import _StridedShard

    if spec is None or spec.use_strided_shard_as_shard_order == flag:
        return spec
    if not any(isinstance(p, _StridedShard) for p in spec.placements):
        return spec
    spec = copy(spec)
    spec.use_strided_shard_as_shard_order = flag
    spec.shard_order = None if flag else DTensorSpec.compute_default_shard_order(spec.placements)
    return spec


def _flag_once_per_op(op_strategy, op_schema) -> None:
    """torch's ``_propagate_use_strided_shard_flag`` (after a strategy is produced, every
    ``_StridedShard`` spec in it gets the flag the op's ``_StridedShard`` inputs carry), with two
    changes. The flag is worked out once per op: the propagator calls this for every element of
    a foreach op with the whole op's schema, and torch reads every input spec of the list each
    time (quadratic in the list's length: at 32 blocks, 291 parameters, half of the first step's
    pricing left with the memo); within one op the input specs do not change, and the flag is a
    function of them. And an OpSpec whose specs need another flag is replaced in the strategy's
    list by a copy, not edited, so the memo's OpSpecs stay as expanded."""
    from torch.distributed.tensor._op_schema import OpSpec

    if getattr(_last_flag, "schema", None) is not op_schema:
        _last_flag.schema, _last_flag.flag = op_schema, _strided_flag(op_schema)
    flag = _last_flag.flag
    if flag is None:
        return
    for i, op_spec in enumerate(op_strategy.strategies):
        out, ins = op_spec.output_specs, op_spec.input_specs
        several = isinstance(out, (tuple, list))
        new_out = type(out)(_flagged(s, flag) for s in out) if several else _flagged(out, flag)
        new_ins = None if ins is None else [_flagged(s, flag) for s in ins]
        olds = [*(out if several else [out]), *(ins or ())]
        news = [*(new_out if several else [new_out]), *(new_ins or ())]
        if any(a is not b for a, b in zip(olds, news)):
            op_strategy.strategies[i] = OpSpec(new_out, new_ins, op_spec.redistribute_cost)


def _takes(fn, names: list[str], prefix: bool = False) -> bool:
    """``fn`` is a function of exactly these parameters (or, with ``prefix``, of these first): the
    torch 2.13 functions this module wraps or stands in for."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters) if callable(fn) else []
    except (TypeError, ValueError):
        return False
    return (params[: len(names)] if prefix else params) == names


def supported() -> bool:
    """This torch has both functions in torch 2.13's form (only the pair: the memo shares OpSpecs,
    which another torch's fix-up might edit in place)."""
    if _state["original"] is not None:  # installed: torch's own were checked then
        return True
    utils, prop = _utils(), _sharding_prop()
    return _takes(
        getattr(utils, "expand_to_full_mesh_op_strategy", None),
        ["mesh", "op_schema", "single_mesh_dim_strategies"],
        prefix=True,
    ) and _takes(getattr(prop, "_propagate_use_strided_shard_flag", None), ["op_strategy", "op_schema"])


def install() -> bool:
    """Put the memo and the once-per-op flag in DTensor's propagation (once per process;
    idempotent). False, and torch left as it is, when ``MESHTRAIN_FOREACH_STRATEGY_MEMO=0`` or
    this torch lacks either function in torch 2.13's form."""
    if os.environ.get(ENV, "1") == "0":
        return False
    utils = _utils()
    with _lock:
        if _state["original"] is not None:
            return True
        if not supported():
            return False
        original = utils.expand_to_full_mesh_op_strategy
        prop = _sharding_prop()
        flag = prop._propagate_use_strided_shard_flag
        _state["original"], _state["flag_original"] = original, flag
        utils.expand_to_full_mesh_op_strategy = _memoized
        prop._propagate_use_strided_shard_flag = _flag_once_per_op
    return True


def forget() -> None:
    """Drop the memo (with DTensor's own caches: tools/planner/measure.py forget_sharding_caches):
    its entries hold meshes, and so their process groups, alive."""
    with _lock:
        _state["memo"].clear()
        _last_flag.schema = _last_flag.flag = None


def uninstall() -> None:
    """Put torch's function back and forget the memo (tests)."""
    utils = _utils()
    with _lock:
        if _state["original"] is not None:
            utils.expand_to_full_mesh_op_strategy = _state["original"]
        if _state["flag_original"] is not None:
            _sharding_prop()._propagate_use_strided_shard_flag = _state["flag_original"]
        _state.update(original=None, memo=OrderedDict(), hits=0, misses=0, flag_original=None)
        _last_flag.schema = _last_flag.flag = None


def stats() -> dict[str, int]:
    """Expansions run (misses) and served from the memo (hits) since install."""
    with _lock:
        return {"misses": _state["misses"], "hits": _state["hits"], "entries": len(_state["memo"])}

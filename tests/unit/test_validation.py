"""Every validation rule: the message names the degrees, the rule and the legal values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel_dims import ModelRules, ParallelDims, check_model_layout, validate_degrees

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(tp=3, world_size=8), r"tp=3 does not divide world_size=8; legal tp values: 1, 2, 4, 8"),
        (dict(pp=5, world_size=8), r"pp=5 does not divide world_size=8; legal pp values: 1, 2, 4, 8"),
        (dict(tp=0, world_size=8), r"tp=0 is invalid: degrees must be integers >= 1"),
        (dict(cp=-1, world_size=8), r"cp=-1 is invalid.*only dp_shard may be -1.*at most one axis is inferred"),
        (dict(tp=2.5, world_size=8), r"tp=2.5 is not an integer"),
        (dict(tp="2", world_size=8), r"tp='2' is not an integer"),
        (dict(tp=True, world_size=8), r"tp=True is not an integer"),
        (dict(dp_shard=0, world_size=8), r"dp_shard=0 is invalid.*-1 to infer"),
        (dict(dp_shard=-2, world_size=8), r"dp_shard=-2 is invalid"),
        (dict(world_size=0), r"world_size=0 is invalid"),
        (
            dict(dp_shard=3, world_size=8),
            r"dp_shard=3 does not divide world_size=8; legal dp_shard values: 1, 2, 4, 8, or -1",
        ),
        (
            dict(dp_replicate=2, dp_shard=2, tp=2, world_size=16),
            r"dp_replicate\*dp_shard\*cp\*tp\*pp = 2\*2\*1\*2\*1 = 8 != world_size=16.*use dp_shard=4 or dp_shard=-1",
        ),
        (
            dict(dp_replicate=4, cp=4, world_size=8),
            r"dp_replicate\*cp\*tp\*pp = 4\*4\*1\*1 = 16 does not divide world_size=8",
        ),
        (
            dict(dp_shard=4, tp=2, ep=3, world_size=8),
            r"ep\*etp = 3\*1 = 3 does not divide dp_shard\*cp\*tp = 4\*1\*2 = 8.*legal ep values with etp=1: 1, 2, 4, 8",
        ),
        (
            dict(dp_shard=2, tp=2, ep=4, etp=2, world_size=4),
            r"ep\*etp = 4\*2 = 8 does not divide dp_shard\*cp\*tp = 2\*1\*2 = 4.*legal ep values with etp=2: 1, 2",
        ),
        (
            dict(tp=4, etp=2, world_size=8),
            r"etp=2 is not supported with tp=4.*etp must be 1 or tp; legal etp values: 1, 4",
        ),
    ],
)
def test_degree_rules(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_degrees(**kwargs)
    # the same check runs when ParallelDims is constructed, before any process group exists
    full = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1) | kwargs
    with pytest.raises(ValueError, match=pattern):
        ParallelDims(**full)


def test_infers_dp_shard():
    pd = ParallelDims(dp_replicate=2, dp_shard=-1, cp=2, tp=2, pp=1, ep=1, etp=1, world_size=32)
    assert pd.dp_shard == 4
    assert pd.fsdp_gradient_divide_factor == 16
    assert pd.non_data_parallel_size == 4
    assert pd.seq_len_divisor == 8
    assert pd.fsdp_enabled and pd.dp_replicate_enabled and not pd.pp_enabled


@pytest.mark.parametrize(
    "degrees, model, pattern",
    [
        (
            dict(tp=4, world_size=4),
            dict(n_heads=6),
            r"tp=4 does not divide n_heads=6.*legal tp values for this model: 1, 2, 3, 6",
        ),
        (
            dict(tp=4, world_size=4),
            dict(n_heads=16, n_kv_heads=2),
            r"tp=4 does not divide n_kv_heads=2.*legal tp values: 1, 2",
        ),
        (
            dict(dp_shard=8, ep=8, world_size=8),
            dict(n_experts=12),
            r"ep=8 does not divide n_routed_experts=12.*legal ep values: 1, 2, 3, 4, 6, 12",
        ),
        (
            dict(dp_shard=1, cp=2, tp=2, world_size=4),
            dict(seq_len=100),
            r"seq_len=100 is not divisible by 8 = 2\*cp\*tp: 2\*cp",
        ),
        (
            dict(dp_shard=1, tp=4, world_size=4),
            dict(seq_len=30),
            r"seq_len=30 is not divisible by 4 = tp: tp \(sequence parallel",
        ),
        (dict(pp=4, world_size=4), dict(n_layers=3), r"n_layers=3 is fewer than the 4 pipeline stages.*use pp <= 3"),
        (
            dict(dp_shard=4, world_size=4),
            dict(global_batch_size=6),
            r"global_batch_size=6 is not divisible by the batch degree dp_replicate\*dp_shard = 4",
        ),
        (
            dict(dp_shard=4, world_size=4),
            dict(global_batch_size=24, local_batch_size=4),
            r"local_batch_size=4 does not divide the 6 samples.*legal local_batch_size values: 1, 2, 3, 6",
        ),
    ],
)
def test_model_rules(degrees, model, pattern):
    d = validate_degrees(**degrees)
    with pytest.raises(ValueError, match=pattern):
        check_model_layout(d, ModelRules(**model))


def test_model_rules_accept_good_layouts():
    d = validate_degrees(dp_shard=2, cp=2, tp=2, ep=4, pp=1, world_size=8)
    check_model_layout(
        d,
        ModelRules(
            n_heads=16, n_kv_heads=8, n_experts=8, seq_len=64, n_layers=6, global_batch_size=8, local_batch_size=2
        ),
    )


def _cli(*args):
    """``python -m parallel_dims args...`` in a new interpreter (the entry point as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "parallel_dims", *args], cwd=ROOT, capture_output=True, text=True)


def _cli_forked(*args):
    """The same command on a process forked from tools/forkserver.py's server (the module's
    ``__main__``, exit code and output, without a new interpreter's imports)."""
    from tests.distributed.run_json import run_module_on_own_process

    return run_module_on_own_process("parallel_dims", *args)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "8", "--tp", "3"], "tp=3 does not divide world_size=8; legal tp values: 1, 2, 4, 8"),
        (["--world-size", "8", "--tp", "4", "--etp", "2"], "etp must be 1 or tp"),
        (["--world-size", "8", "--rank", "8"], "--rank 8 is outside world_size=8"),
    ],
)
def test_cli_rejects_bad_degrees(args, message):
    result = _cli_forked(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_cli_describes_layout():
    result = _cli(
        "--world-size",
        "64",
        "--dp-shard",
        "-1",
        "--cp",
        "2",
        "--tp",
        "4",
        "--ep",
        "8",
        "--rank",
        "5",
        "--gpus-per-node",
        "4",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "dense   mesh (pp=1, dp_replicate=1, dp_shard=8, cp=2, tp=4)" in out
    assert "sparse  mesh (pp=1, dp_replicate=1, efsdp=8, ep=8, etp=1)" in out
    tp_line = next(line for line in out.splitlines() if line.startswith("tp "))
    assert "[4, 5, 6, 7]" in tp_line and " no " in tp_line  # inside one node of 4
    cp_line = next(line for line in out.splitlines() if line.startswith("cp "))
    assert "[1, 5]" in cp_line and " yes " in cp_line


def test_cli_json():
    import json

    result = _cli_forked("--world-size", "16", "--tp", "2", "--ep", "4", "--etp", "2", "--rank", "3", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["degrees"]["dp_shard"] == 8 and info["degrees"]["efsdp"] == 2
    assert info["meshes"]["etp"]["group"] == info["meshes"]["tp"]["group"] == [2, 3]
    assert info["meshes"]["etp"]["shares_group_with"] == "tp"
    assert info["meshes"]["ep"]["group"] == [1, 3, 5, 7]
    counts = info["process_groups_per_rank"]
    assert counts["distinct_real_rank_sets"] == 5  # world, dp_shard(=fsdp,batch,loss), tp(=etp), efsdp, ep


_CHANGE = __import__("re").compile(r"(\w+) ('[^']*'|\S+?) -> (-?\d+)")


@given(
    degrees=st.fixed_dictionaries(
        {
            name: st.one_of(
                st.integers(-3, 70),
                st.sampled_from([0.5, 2.0, "2", "x", True, None]),
                st.sampled_from([1, 2, 4, 8, 16, 32]),
            )
            for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")
        }
    ),
    world_size=st.sampled_from([1, 2, 3, 6, 8, 12, 64, 96, 4096]),
)
@settings(max_examples=1000, deadline=None)
def test_every_degree_error_names_a_change_that_makes_the_layout_valid(degrees, world_size):
    try:
        validate_degrees(world_size=world_size, **degrees)
        return
    except ValueError as exc:
        message = str(exc)
    assert f"a valid choice for world_size={world_size}: change " in message, message
    suggestion = message.split("a valid choice", 1)[1]
    fixed = dict(degrees)
    for name, _, value in _CHANGE.findall(suggestion):
        fixed[name] = int(value)
    # a change must change something; True == 1 in Python, so compare (type, value) pairs
    assert {k: (type(v), v) for k, v in fixed.items()} != {k: (type(v), v) for k, v in degrees.items()}, message
    validate_degrees(world_size=world_size, **fixed)  # the named change is enough

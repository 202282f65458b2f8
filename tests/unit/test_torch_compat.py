"""The torch-private overrides (``parallel_dims/torch_compat.py``): the table in the docstring is
the table in the code, each override is applied exactly where the table says and nowhere else,
the torch API it touches exists on the installed torch, and the table's column for the
installed torch version agrees with what that torch's source does. Nothing else in the project
overrides a torch-private method."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from parallel_dims import torch_compat
from parallel_dims.torch_compat import OVERRIDES, PipelineStageFixes, render_table
from tests.unit.test_imports import ROOT, discover_modules

ROWS = {o.name: o for o in OVERRIDES}
THIS_TORCH = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _module_trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in discover_modules(ROOT).items()}


def _modules_naming(trees: dict[str, ast.Module], name: str) -> set[str]:
    """Modules, torch_compat aside, that mention ``name`` (a name, attribute or import)."""
    found = set()
    for module, tree in trees.items():
        if module == "parallel_dims.torch_compat":
            continue
        for node in ast.walk(tree):
            if (
                (isinstance(node, ast.Name) and node.id == name)
                or (isinstance(node, ast.Attribute) and node.attr == name)
                or (isinstance(node, ast.alias) and name in (node.name, node.asname))
            ):
                found.add(module)
                break
    return found


def test_docstring_table_is_the_table():
    assert render_table() in torch_compat.__doc__
    for o in OVERRIDES:
        assert set(o.versions) == set(torch_compat.TORCH_VERSIONS), o.name
        assert set(o.versions.values()) <= {"needed", "not needed", "not reached", "n/a", "not checked"}, o.name
        assert o.fixes and o.torch_api and o.members, o.name
        for member in o.members:
            assert hasattr(PipelineStageFixes, member) or hasattr(torch_compat, member), (o.name, member)


def test_each_override_is_applied_exactly_where_the_table_says():
    trees = _module_trees()
    for o in OVERRIDES:
        module_name, _, cls_name = o.applied_in.rpartition(".")
        if module_name and module_name in discover_modules(ROOT) and cls_name[:1].isupper():
            # mixed into a class: the stage class runs torch_compat's methods, unchanged
            cls = getattr(importlib.import_module(module_name), cls_name)
            assert issubclass(cls, PipelineStageFixes), o.name
            for member in o.members:
                assert getattr(cls, member) is getattr(PipelineStageFixes, member), (o.name, member)
                torch_base = next(b for b in cls.__mro__ if b.__module__.startswith("torch."))
                if o.versions[THIS_TORCH] != "n/a":
                    assert hasattr(torch_base, member), f"{o.name}: torch {THIS_TORCH} has no {member}"
            assert _modules_naming(trees, "PipelineStageFixes") == {module_name}, o.name
        else:
            # a function: called from that module only
            for member in o.members:
                assert _modules_naming(trees, member) == {o.applied_in}, (o.name, member)


def _probe(name: str) -> str:
    """What the installed torch's source says about override ``name``."""
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.pipelining._utils import _make_tensor_from_meta

    warmup = getattr(schedules._PipelineSchedule, "_warmup_p2p", None)
    warmup_src = inspect.getsource(warmup) if warmup is not None else ""
    if name == "fsdp_submodule_reduce":
        src = inspect.getsource(PipelineStage.perform_reduce_grad)
        return "needed" if "isinstance(self.submod, FSDPModule)" in src else "not needed"
    if name == "p2p_warmup_self_send":
        return "not reached" if "_warmup_forward_vote" in warmup_src else "needed"
    if name == "fake_backend_vote":
        return "not reached" if '"fake"' in warmup_src else "needed"
    if name == "fake_backend_recv_buffers":
        src = inspect.getsource(_make_tensor_from_meta)
        return "needed" if "torch.empty" in src else "not needed"
    if name == "unflatten_without_groups":
        src = inspect.getsource(DeviceMesh._create_unflatten_mesh)
        return "needed" if 'hasattr(self, "_dim_group_names")' in src else "not needed"
    if name == "sliced_mesh_flat_layout":
        from torch.distributed._mesh_layout import _MeshLayout

        return "needed" if hasattr(_MeshLayout, "coalesce") else "not needed"
    if name == "schedule_compute_order":
        src = inspect.getsource(schedules.ScheduleInterleaved1F1B.__init__)
        return "needed" if "self._prepare_schedule_with_comms(" in src else "not needed"
    if name == "local_tensor_fsdp_storage":
        from torch.distributed.fsdp._fully_shard import _fsdp_param

        return "needed" if ".resize_(" in inspect.getsource(_fsdp_param.free_storage) else "not needed"
    if name == "constant_result_marker":
        import torch._dynamo.decorators as decorators

        marks = "fn._dynamo_marked_constant = True" in inspect.getsource(decorators.assume_constant_result)
        imports = "import torch._dynamo" in inspect.getsource(torch.compiler.assume_constant_result)
        return "needed" if marks and imports else "not needed"
    if name == "cpu_scaled_mm_emulation":
        return _probe_cpu_scaled_mm()
    if name == "cpu_flash_attention_pack":
        return _probe_cpu_flash_attention_pack()
    raise AssertionError(f"no probe for {name}")


def _probe_cpu_scaled_mm() -> str:
    """torch's CPU ``_scaled_mm`` hands tensorwise GEMMs to oneDNN where torch is built with it
    and the host has AMX-INT8; on such a host that shows as other bits than torch's own
    emulation (oneDNN off) gives. Elsewhere the probe can only read that the build has oneDNN
    (the dispatch is there; this host does not reach it)."""
    import warnings

    from models.common.cpu_info import has_amx_int8
    from parallel_dims.torch_compat import emulate_cpu_scaled_mm

    if not torch.backends.mkldnn.is_available():
        return "not needed"
    if not has_amx_int8():
        return "needed"
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(64, 256, generator=g).to(torch.float8_e4m3fn).t()
    # scales that are not powers of two: float8 products and their sums are exact in float32
    # otherwise, and any summation order gives the same bits
    sa, sb = torch.tensor(0.7), torch.tensor(1.3)
    was = emulate_cpu_scaled_mm(False)
    try:
        outs = []
        for onednn in (True, False):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                with torch.backends.mkldnn.flags(enabled=onednn):
                    outs.append(torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32))
    finally:
        emulate_cpu_scaled_mm(was)
    return "needed" if not torch.equal(*outs) else "not needed"


# torch's own CPU flash attention kernel on bfloat16 inputs it packs (64 queries and keys, 4 heads
# of 64), in a process of its own: only torch imported, the guard not installed
_FLASH_PACK_PROBE = r"""
import torch
q = torch.zeros(1, 4, 64, 64, dtype=torch.bfloat16)
try:
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)
    print("runs")
except RuntimeError as exc:
    print("pack_vnni" if "pack_vnni" in str(exc) else f"other error: {exc}")
"""


def _host_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


def _probe_cpu_flash_attention_pack() -> str:
    """torch's CPU flash attention packs bfloat16 inputs for oneDNN's AMX GEMMs on hosts with
    AMX-BF16 and then needs ATen's AVX-512 build. On such a host the probe runs the kernel under
    ATen's DEFAULT build: in this process when it already runs one (through torch's own kernel,
    around the guard), else in a process under ``ATEN_CPU_CAPABILITY=default``. Elsewhere no
    kernel packs and the probe can only read that the build has oneDNN (the packing is there;
    this host does not reach it)."""
    import os
    import subprocess
    import sys

    if not torch.backends.mkldnn.is_available():
        return "not needed"
    if not _host_has_amx_bf16():
        return "needed"
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
        return "needed" if torch_compat.flash_attention_pack_fails(torch.bfloat16) else "not needed"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _FLASH_PACK_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() in ("runs", "pack_vnni"), proc.stdout + proc.stderr
    return "needed" if proc.stdout.strip() == "pack_vnni" else "not needed"


@pytest.mark.parametrize("name", list(ROWS))
def test_version_column_matches_this_torch(name):
    entry = ROWS[name].versions.get(THIS_TORCH)
    if entry in (None, "not checked", "n/a"):
        pytest.skip(f"torch {torch.__version__}: {entry or 'outside the table'}")
    assert _probe(name) == entry, f"{name} on torch {torch.__version__}: the table says {entry}"


def test_probes_tell_the_cases_apart(monkeypatch):
    """Negative control: a probe reads torch, not the table (a patched torch changes its answer)."""
    from torch.distributed._mesh_layout import _MeshLayout

    before = _probe("sliced_mesh_flat_layout")
    monkeypatch.setattr(_MeshLayout, "coalesce", lambda self: self, raising=False)
    assert _probe("sliced_mesh_flat_layout") == "needed" != before


def _torch_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch")
    return names


# torch's documented extension point: a custom ParallelStyle implements ``_apply``
EXTENSION_POINTS = {("models.parallel.tensor_parallel", "_ReplicatedOnShards", "_apply")}


def _private(expr: str) -> bool:
    return expr.split(".")[0] == "torch" and any(part.startswith("_") for part in expr.split(".")[1:])


def test_no_torch_private_override_outside_torch_compat():
    """No class outside torch_compat that subclasses a torch class overrides an underscore
    method of it, and no code outside it assigns a private attribute of the ``torch`` module
    tree (public settings such as ``torch.backends.cudnn.benchmark`` are fine)."""
    bad = []
    for module, tree in _module_trees().items():
        if module == "parallel_dims.torch_compat":
            continue
        torch_names = _torch_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else ast.unparse(b).split(".")[0] for b in node.bases}
                methods = [
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef)
                    and item.name.startswith("_")
                    and not item.name.endswith("__")
                    and (module, node.name, item.name) not in EXTENSION_POINTS
                ]
                if not bases & torch_names or not methods:
                    continue
                cls = getattr(importlib.import_module(module), node.name)
                torch_bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "torch"]
                bad += [f"{module}.{node.name}.{m}" for m in methods if any(m in vars(b) for b in torch_bases)]
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and _private(ast.unparse(target)):
                    bad.append(f"{module}: {ast.unparse(target)} = ...")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
                if ast.unparse(node.args[0]).split(".")[0] == "torch":
                    bad.append(f"{module}: {ast.unparse(node)}")
    assert not bad, "torch-private overrides outside parallel_dims/torch_compat.py: " + ", ".join(bad)


def test_override_scan_finds_a_planted_override():
    """Negative control: the scan's test for an override (a method of a torch base class)
    catches a subclass that redefines one of torch's underscore methods."""
    from torch.distributed.pipelining import PipelineStage

    class Planted(PipelineStage):
        def _get_init_p2p_neighbors_ops(self):
            return []

    torch_bases = [b for b in Planted.__mro__[1:] if b.__module__.split(".")[0] == "torch"]
    assert any("_get_init_p2p_neighbors_ops" in vars(b) for b in torch_bases)
    assert not any("_check" in vars(b) for b in torch_bases)  # our own helper names are not overrides
    assert _private("torch._dynamo.config.x") and not _private("torch.backends.cudnn.benchmark")

"""The shape of the code: no import circles, imports that point one way, no oversized files.

The module graph is built from the source (AST), not by importing it: every ``import`` and
``from ... import`` anywhere in a module counts, function-level and ``if TYPE_CHECKING:`` ones
included (a circle that only type checkers or a lazy call follow is still a circle a reader has
to untangle). Circles are looked for twice: between modules, and between folders (a folder's
modules taken as one node, ``trainer/`` apart from ``trainer/config/``): folders that import each
other through different modules form no module circle, yet a reader cannot take either in alone. The project's packages are found by walking the repository (every top-level
folder with Python files, tests/ and hidden or virtual-environment folders aside), so a new
package is covered without editing this file.

Direction (docs/design.md section 1): ``tools -> trainer -> models -> parallel_dims``;
``models/common`` (the decoder shell every model builds on) imports only itself and
``parallel_dims``. Command-line entry points (``__main__`` modules) follow the same direction: a
command lives in the package whose code it runs. The one exception is :data:`FORWARDING`:
``parallel_dims/moved_commands.py`` runs the commands that moved out of ``python -m
parallel_dims`` (``plan`` -> ``python -m tools.planner``, ``--config`` -> ``python -m
trainer.plan_report``) for users of the old forms. No module may import an entry point.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"tests", "build", "dist", "outputs", "bench_results", "node_modules"}

# importer package -> project packages it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "parallel_dims": ("models", "trainer", "tools", "benchmarks", "scripts", "train"),
    "models": ("trainer", "tools", "benchmarks", "scripts", "train"),
    "trainer": ("tools", "benchmarks", "scripts", "train"),
    "tools": ("benchmarks", "scripts", "train"),
}
# a package whose modules may import only these project packages
ONLY: dict[str, tuple[str, ...]] = {
    "models.common": ("models.common", "parallel_dims"),
}
# the only imports against the direction: module -> the project modules it may import anyway.
# parallel_dims/moved_commands.py forwards the old ``python -m parallel_dims plan`` and
# ``--config`` to the commands that now live with their code (a moved or renamed target module
# changes this entry and the forwarding together).
FORWARDING: dict[str, frozenset[str]] = {
    "parallel_dims.moved_commands": frozenset({"tools.planner.cli", "trainer.plan_report"}),
}

# trainer/'s folders: what each package may import of the others (its docstring says the same;
# docs/design.md section 1). The loop at trainer/'s top may import all of them but lifecycle/,
# which nothing in the trainer imports (it is the way in).
TRAINER_FOLDERS: dict[str, tuple[str, ...]] = {
    "trainer.config": (),
    "trainer.data": ("trainer.config",),
    "trainer.simulation": ("trainer.config", "trainer.data"),
    "trainer.runtime": ("trainer.config", "trainer.simulation"),
    "trainer.optim": ("trainer.config", "trainer.simulation"),
    "trainer.checkpoint": ("trainer.config", "trainer.data", "trainer.optim", "trainer.runtime"),
    "trainer.reporting": ("trainer.config", "trainer.runtime"),
    "trainer.instruments": ("trainer.config", "trainer.runtime", "trainer.simulation"),
    # builds the model the loop's way (trainer/startup.py, build.py at trainer/'s top), so the
    # loop must not import it (a folder cycle): code running it during training is wired in
    # from lifecycle/
    "trainer.inference": ("trainer.config", "trainer.data", "trainer.runtime", "trainer.checkpoint"),
}

MAX_LINES = 500
# Source files over MAX_LINES that other branches of issue 25 split (trainer/ in rooms); the
# integrator removes this list, and the xfail below, once those branches are merged.
# Generated tables (data written by a script, not code to read) are exempt from the limit.
GENERATED: tuple[str, ...] = ()


# ------------------------------------------------------------------ discovery and parsing


def _is_venv(path: Path) -> bool:
    return (path / "pyvenv.cfg").exists()


def discover_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the project's top-level folders
    and the top-level scripts (``train.py``)."""
    modules: dict[str, Path] = {}
    for top in sorted(root.iterdir()):
        if top.is_file() and top.suffix == ".py":
            modules[top.stem] = top
            continue
        if not top.is_dir() or top.name.startswith((".", "_")) or top.name in SKIP_DIRS or _is_venv(top):
            continue
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The project module ``name`` refers to: itself, or its longest prefix that is a module
    (``pkg.mod.attr`` -> ``pkg.mod``); None outside the project."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The project modules ``module`` imports, anywhere in its body."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                target = submodule if submodule in modules else _resolve(source, modules)
                if target:
                    found.add(target)
    found.discard(module)
    return found


def module_graph(root: Path) -> dict[str, set[str]]:
    modules = discover_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def folder_of(root: Path, path: Path) -> str:
    """The folder a module file lies in, dotted (``trainer/config/schema.py`` and
    ``trainer/config/__init__.py`` -> ``trainer.config``); ``.`` for the top-level scripts."""
    return ".".join(path.parent.relative_to(root).parts) or "."


def folder_graph(
    root: Path, graph: Mapping[str, Iterable[str]] | None = None, forwarding: Mapping[str, Iterable[str]] | None = None
) -> dict[str, set[str]]:
    """Folder -> the other folders its modules import. Entry points (``__main__``: nothing
    imports them) and the :data:`FORWARDING` imports (the old commands' forwarding, the one
    exception to the direction) are left out."""
    forwarding = FORWARDING if forwarding is None else forwarding
    modules = discover_modules(root)
    graph = module_graph(root) if graph is None else graph
    folders: dict[str, set[str]] = {}
    for importer, imported in graph.items():
        if _is_entry_point(importer):
            continue
        source = folders.setdefault(folder_of(root, modules[importer]), set())
        for target in imported:
            if not _is_entry_point(target) and target not in forwarding.get(importer, ()):
                source.add(folder_of(root, modules[target]))
    for source, targets in folders.items():
        targets.discard(source)
    return folders


# ------------------------------------------------------------------ checks on a graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One concrete cycle (``[a, b, ..., a]``) per strongly connected component of more than
    one module (Tarjan, iterative)."""
    graph = {k: sorted(v) for k, v in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: Mapping[str, list[str]], members: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in graph.get(node, ()):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_entry_point(module: str) -> bool:
    return module.rsplit(".", 1)[-1] == "__main__"


def layering_violations(
    graph: Mapping[str, Iterable[str]], forwarding: Mapping[str, Iterable[str]] = FORWARDING
) -> list[str]:
    """Every import against :data:`FORBIDDEN` / :data:`ONLY` but the ``forwarding`` ones, and
    every import of an entry point, as ``"importer -> imported"``."""
    bad = []
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            if _is_entry_point(imported):
                bad.append(f"{importer} -> {imported} (an entry point)")
                continue
            if imported in forwarding.get(importer, ()):
                continue
            for package, forbidden in FORBIDDEN.items():
                if _in(importer, package) and any(_in(imported, f) for f in forbidden):
                    bad.append(f"{importer} -> {imported}")
            for package, allowed in ONLY.items():
                if _in(importer, package) and not any(_in(imported, a) for a in allowed):
                    bad.append(f"{importer} -> {imported} ({package} may import only {', '.join(allowed)})")
    return bad


# ------------------------------------------------------------------ the project


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return module_graph(ROOT)


def test_discovery_finds_the_project_packages(graph):
    tops = {name.split(".")[0] for name in graph}
    assert {"parallel_dims", "models", "trainer", "tools", "benchmarks", "scripts", "train"} <= tops
    assert "tests" not in tops
    # function-level and TYPE_CHECKING imports count: the forwarding of the old planner command
    # reaches the planner only inside a function
    assert "tools.planner.cli" in graph["parallel_dims.moved_commands"]


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_no_folder_cycles(graph):
    """No two folders import each other, through any modules (docs/design.md section 1)."""
    cycles = find_cycles(folder_graph(ROOT, graph))
    assert not cycles, "folders that import each other:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_trainer_folders_import_what_they_may(graph):
    folders = folder_graph(ROOT, graph)
    packages = {name for name in folders if name.startswith("trainer.")}
    assert set(TRAINER_FOLDERS) | {"trainer.lifecycle"} == packages, "a trainer/ package without its rule here"
    bad = [
        f"{folder} -> {target}"
        for folder, targets in sorted(folders.items())
        if folder == "trainer" or folder.startswith("trainer.")
        for target in sorted(targets)
        if target.startswith("trainer.")
        and (
            target == "trainer.lifecycle"
            if folder in ("trainer", "trainer.lifecycle")
            else target not in TRAINER_FOLDERS[folder]
        )
    ]
    assert not bad, "trainer/ folders importing what their docstring does not allow:\n  " + "\n  ".join(bad)


def test_imports_point_one_way(graph):
    bad = layering_violations(graph)
    assert not bad, "imports against the direction of docs/design.md section 1:\n  " + "\n  ".join(bad)


def _upward(graph: Mapping[str, Iterable[str]], package: str) -> dict[str, set[str]]:
    """``package``'s modules that import a package it must not import, and those imports."""
    return {
        importer: up
        for importer, imported in graph.items()
        if _in(importer, package)
        if (up := {m for m in imported if any(_in(m, f) for f in FORBIDDEN[package])})
    }


def test_parallel_dims_reaches_up_only_to_forward_moved_commands(graph):
    """parallel_dims imports trainer/ and tools/ in one place only, parallel_dims/moved_commands.py,
    and there only the two commands' entry points (``python -m parallel_dims`` describes a layout
    itself: its ``__main__`` imports nothing above parallel_dims); ``import parallel_dims`` never
    loads the forwarding module."""
    assert _upward(graph, "parallel_dims") == {m: set(t) for m, t in FORWARDING.items()}
    assert "parallel_dims.moved_commands" not in graph["parallel_dims"]
    assert {m for m, imported in graph.items() if "parallel_dims.moved_commands" in imported} == {
        "parallel_dims.__main__"
    }


def _source_files(root: Path) -> dict[str, int]:
    return {
        path.relative_to(root).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in discover_modules(root).values()
    }


def test_no_source_file_over_the_limit():
    long = {f: n for f, n in _source_files(ROOT).items() if n > MAX_LINES and f not in GENERATED}
    assert not long, f"source files over {MAX_LINES} lines (split them by concern): {long}"


# ------------------------------------------------------------------ negative controls


def test_checker_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"x": {"y"}, "y": set()}) == []
    two = find_cycles({"p": {"q"}, "q": {"p"}, "r": {"s"}, "s": {"t"}, "t": {"r"}})
    assert sorted(map(tuple, two)) == [("p", "q", "p"), ("r", "s", "t", "r")]


def test_checker_reads_lazy_and_type_only_imports(tmp_path):
    """A circle closed only by a function-level import and a TYPE_CHECKING import (relative,
    from a package ``__init__``) is still found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("class A:\n    def f(self):\n        from pkg.sub import b\n        return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n")
    (pkg / "c.py").write_text("import pkg.a as a_mod\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "x.py").write_text("import pkg.a\n")
    graph = module_graph(tmp_path)
    assert set(graph) == {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b", "pkg.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_checker_finds_a_folder_cycle_without_a_module_cycle(tmp_path):
    """The knot this check was written for (trainer/ before issue 51): config's validation
    imported a loose module of the trainer's folder that imported the checkpoint package, whose
    saver imported another loose module that imported config. No module circle, a folder one;
    an entry point that reaches back is no circle."""
    files = {
        "pkg/__init__.py": "",
        "pkg/config/__init__.py": "",
        "pkg/config/validate.py": "def check():\n    from pkg.local_tensor import available\n",
        "pkg/local_tensor.py": "from pkg.checkpoint.errors import CheckpointError\n",
        "pkg/distributed_init.py": "from pkg.config import validate\n",
        "pkg/checkpoint/__init__.py": "",
        "pkg/checkpoint/errors.py": "class CheckpointError(Exception): ...\n",
        "pkg/checkpoint/async_save.py": "from pkg.distributed_init import init\n",
        "pkg/checkpoint/__main__.py": "import pkg.distributed_init\n",
        "lib/__init__.py": "",
        "lib/__main__.py": "import pkg.checkpoint.errors\n",
        "pkg/lib_user.py": "import lib\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = module_graph(tmp_path)
    assert find_cycles(graph) == []
    folders = folder_graph(tmp_path, graph)
    assert folders == {
        "pkg": {"pkg.checkpoint", "pkg.config", "lib"},
        "pkg.config": {"pkg"},
        "pkg.checkpoint": {"pkg"},
        "lib": set(),
    }
    assert find_cycles(folders) == [["pkg", "pkg.checkpoint", "pkg"]]  # one per knot of folders


def test_checker_finds_layering_violations():
    graph = {
        "models.common.decoder": {"models.registry", "parallel_dims.layout", "models.common.args"},
        "models.registry": {"models.common.decoder"},
        "parallel_dims.layout": {"trainer.config"},
        "parallel_dims.__main__": {"trainer.plan"},
        "parallel_dims.moved_commands": {"trainer.plan_report", "tools.planner.cli", "trainer.plan"},
        "trainer.plan": {"tools.planner.cli", "parallel_dims.__main__"},
        "tools.planner.cli": set(),
        "trainer.config": set(),
        "models.common.args": set(),
    }
    forwarding = {"parallel_dims.moved_commands": {"trainer.plan_report", "tools.planner.cli"}}
    assert layering_violations(graph, forwarding) == [
        "models.common.decoder -> models.registry (models.common may import only models.common, parallel_dims)",
        "parallel_dims.__main__ -> trainer.plan",  # an entry point follows the direction too
        "parallel_dims.layout -> trainer.config",
        "parallel_dims.moved_commands -> trainer.plan",  # only the forwarded entry points
        "trainer.plan -> parallel_dims.__main__ (an entry point)",
        "trainer.plan -> tools.planner.cli",
    ]

"""docs/design.md's map (section 1) matches the tree, as the README's paths are checked
(tests/unit/test_docs_commands.py): every folder (``name/``) and module (``name.py``) the map
names exists, and the map names every package of the folders it describes in full."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
# top-level folders whose every package (a folder with __init__.py, one level down) the map names
COMPLETE = ("trainer", "tools")
NAME = re.compile(r"(?<![\w./-])((?:\w+/)*\w+(?:/|\.py))(?![\w/])")


def design_map(text: str) -> dict[str, str]:
    """Top-level folder -> its text in the map: the first fenced block of section 1, where an
    entry starts at column 0 (``trainer/   the training loop ...``) and goes on indented."""
    section = text.split("\n## 1.", 1)[1].split("\n## 2.", 1)[0]
    block = section.split("```", 2)[1]
    entries: dict[str, str] = {}
    top = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            top, _, line = line.partition(" ")
            top = top.rstrip("/")
            entries[top] = ""
        if top is not None:
            entries[top] += " " + line.strip()
    return entries


def names_in(text: str) -> list[str]:
    return NAME.findall(text)


def resolves(top: str, name: str, root: Path = ROOT) -> bool:
    """``name`` exists as a path from the repository root, from the entry's folder, or as the
    tail of a path below the entry's folder (``pipeline/`` of ``models/parallel/``)."""
    path = name.rstrip("/")
    if (root / path).exists() or (root / top / path).exists():
        return True
    return any(p.as_posix().endswith("/" + path) for p in (root / top).rglob(Path(path).name))


def missing_names(text: str, root: Path = ROOT) -> list[str]:
    return [
        f"{top}: {name}"
        for top, body in design_map(text).items()
        for name in names_in(body)
        if not resolves(top, name, root)
    ]


def unnamed_packages(text: str, root: Path = ROOT) -> list[str]:
    entries = design_map(text)
    missing = []
    for top in COMPLETE:
        named = set(names_in(entries.get(top, "")))
        for init in sorted((root / top).glob("*/__init__.py")):
            if f"{init.parent.name}/" not in named:
                missing.append(f"{top}/{init.parent.name}/")
    return missing


def test_the_map_names_only_what_exists():
    text = DESIGN.read_text(encoding="utf-8")
    entries = design_map(text)
    assert {"parallel_dims", "models", "trainer", "tools", "benchmarks"} <= set(entries), sorted(entries)
    assert len(names_in(entries["trainer"])) >= 20
    assert not missing_names(text), "docs/design.md's map names what the tree lacks: " + ", ".join(missing_names(text))


def test_the_map_names_every_package():
    text = DESIGN.read_text(encoding="utf-8")
    assert not unnamed_packages(text), "packages docs/design.md's map leaves out: " + ", ".join(unnamed_packages(text))


def test_checker_finds_a_stale_map(tmp_path):
    """Negative control: a map naming a module that moved, and a tree with a package it omits."""
    for path in ("trainer/__init__.py", "trainer/optim/__init__.py", "trainer/trainer.py", "tools/__init__.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    text = (
        "# d\n\n## 1. Parts\n\n```\ntrainer/    the loop: trainer.py, train.py (gone), optim/\n"
        "            and lifecycle/\ntools/      nothing\n```\n\n## 2. Next\n"
    )
    assert names_in(design_map(text)["trainer"]) == ["trainer.py", "train.py", "optim/", "lifecycle/"]
    assert missing_names(text, tmp_path) == ["trainer: train.py", "trainer: lifecycle/"]
    (tmp_path / "tools" / "planner").mkdir()
    (tmp_path / "tools" / "planner" / "__init__.py").write_text("")
    assert unnamed_packages(text, tmp_path) == ["tools/planner/"]

"""A model is a folder plus a registry line (docs/adding_a_model.md), read from the imports.

Every part two models share lives in ``models/common``; a model folder (``models/<name>/``, a
package with a registered model) imports only ``models.common``, ``parallel_dims`` and itself,
and no module outside the folder imports it except ``models/registry.py`` (docs/design.md
section 1). Shared code that needs something of a model asks it through the contract instead
(e.g. ``models/kernels.py`` asks ``DecoderAttention.narrow_value_heads``), so adding a model
edits no shared module. The module graph is the one ``tests/unit/test_imports.py`` builds.
"""

from __future__ import annotations

from tests.unit.test_imports import ROOT, module_graph

MODELS_DIR = ROOT / "models"
SHARED = {"common", "parallel"}


def _model_folders() -> list[str]:
    return sorted(
        p.name
        for p in MODELS_DIR.iterdir()
        if p.is_dir() and p.name not in SHARED and not p.name.startswith(("_", ".")) and (p / "__init__.py").exists()
    )


def _folder_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "models" else None


def test_the_model_folders_are_found():
    assert {"llama3", "qwen3", "deepseek_v3"} <= set(_model_folders())


def test_model_folders_import_only_common_and_themselves():
    graph = module_graph(ROOT)
    folders = set(_model_folders())
    bad = []
    for module, targets in graph.items():
        own = _folder_of(module)
        if own not in folders:
            continue
        for target in targets:
            top = target.split(".")[0]
            if top == "parallel_dims" or _folder_of(target) in ("common", own):
                continue
            bad.append(f"{module} imports {target}")
    assert not bad, "model folders may import only models.common, parallel_dims and themselves:\n" + "\n".join(bad)


def test_only_the_registry_imports_a_model_folder():
    graph = module_graph(ROOT)
    folders = set(_model_folders())
    bad = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if _folder_of(target) in folders and _folder_of(module) != _folder_of(target) and module != "models.registry"
    ]
    assert not bad, "shared code reaches into a model folder (ask the model through the contract):\n" + "\n".join(bad)

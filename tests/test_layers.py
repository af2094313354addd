"""What the layer contracts (.importlinter, run by .ci/run) cannot hold, and the surface the notebooks touch.

import-linter sees labkit's own modules and only the top of an external package (`torch`, never
`torch.distributed`), so a direct `import torch.distributed` in a formula module is checked here. And the
notebooks import only public names: a module of labkit without an underscore in its path, and a name in that
module's `__all__` (docs/architecture.md lists that surface).
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The formulas: run nothing, so they need no process group (the .importlinter contract "formulas").
FORMULAS = [
    "memory",
    "gemm",
    "op_time",
    "activations",
    "links",
    "batch",
    "schedules",
    "pipeline_plan",
    "planner",
    "layout",
    "course/forecast",
]


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in `tree`, wherever it stands (a function body too)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


@pytest.mark.parametrize("module", FORMULAS)
def test_a_formula_module_never_imports_torch_distributed(module):
    tree = ast.parse((ROOT / "labkit" / f"{module}.py").read_text())
    bad = [
        m
        for m, names in _imports(tree)
        if m.startswith("torch.distributed") or (m == "torch" and "distributed" in names)
    ]
    assert not bad, f"labkit/{module}.py imports {bad}: the formulas run nothing (see .importlinter)"


NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_imports_only_public_names(nb):
    cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    for cell in cells:
        source = "".join(cell["source"])
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.startswith(("%", "!"))))
        for module, names in _imports(tree):
            if not module.startswith("labkit"):
                continue
            assert not any(part.startswith("_") for part in module.split(".")), f"{nb.stem}: imports {module}"
            public = set(getattr(importlib.import_module(module), "__all__", []))
            for name in names:
                if hasattr(importlib.import_module(module), "__path__") and f"{module}.{name}" in _packages():
                    continue  # a submodule (`from labkit.course import quiz`)
                assert name in public, f"{nb.stem}: `from {module} import {name}`: not in {module}.__all__"


def _packages() -> set[str]:
    """Every labkit module's dotted name."""
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "labkit").rglob("*.py")
    }


def test_every_public_module_declares_its_surface():
    """Each module of labkit lists its public names in `__all__` (a package's `__init__` that hands names on
    too; one that only documents its package need not)."""
    missing = []
    for path in sorted((ROOT / "labkit").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if any(part.startswith("_") and part != "__init__.py" for part in rel.parts):
            continue
        text = path.read_text()
        if path.name == "__init__.py" and "import" not in text:
            continue
        if "__all__" not in text:
            missing.append(str(rel))
    assert not missing, f"modules without __all__: {missing}"

"""labkit._torch_compat: every private torch internal labkit uses is there and looks as expected,
and no other module of labkit reaches into torch's private names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from labkit import _torch_compat as compat

PACKAGE = Path(compat.__file__).resolve().parent
PRIVATE = re.compile(r"\btorch\.(?:_(?!_)\w|utils\._|distributed\._)|\._plugins\b|_world\.pg_map")


def test_every_internal_is_present_on_this_torch():
    problems = compat.problems()
    assert problems == [], f"torch {torch.__version__}:\n" + "\n".join(problems)


def test_a_missing_internal_is_named_with_the_torch_version(monkeypatch):
    gone = compat.Internal("torch.utils._pytree", "tree_map_that_never_was", "a test")
    moved = compat.Internal("torch._no_such_module", "thing", "a test")
    monkeypatch.setattr(compat, "INTERNALS", (gone, moved))
    problems = compat.problems()
    assert len(problems) == 2
    assert "torch.utils._pytree.tree_map_that_never_was" in problems[0] and torch.__version__ in problems[0]
    assert "AttributeError" in problems[0] and "a test" in problems[0]
    assert "torch._no_such_module.thing" in problems[1] and "ModuleNotFoundError" in problems[1]


def test_a_changed_signature_is_reported(monkeypatch):
    changed = compat.Internal("torch.utils._pytree", "tree_map", "a test", ("tree", "func"))
    monkeypatch.setattr(compat, "INTERNALS", (changed,))
    (problem,) = compat.problems()
    assert "changed" in problem and "('func', 'tree')" in problem and "('tree', 'func')" in problem


def test_the_emulated_group_overrides_only_listed_private_methods():
    from labkit.emulate import EmulatedProcessGroup

    overridden = {
        n
        for n in vars(EmulatedProcessGroup)
        if n.startswith("_") and not n.startswith("__") and hasattr(torch.distributed.ProcessGroup, n)
    }
    assert overridden == set(compat.PROCESS_GROUP_OVERRIDES)
    listed = {i.attr.split(".", 1)[1] for i in compat.INTERNALS if i.attr.startswith("ProcessGroup.")}
    assert listed == set(compat.PROCESS_GROUP_OVERRIDES)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_torch_name_outside_the_compat_module(path: Path):
    if path.name == "_torch_compat.py":
        return
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line) and not line.lstrip().startswith("#")
    ]
    assert not hits, "private torch names belong in labkit/_torch_compat.py:\n" + "\n".join(hits)
